"""The platform every layer stands on, in the notebook and in a rank alike: settings, errors, notices, the patch
registry and its table of groups, where the supported library lines differ, where this process stands, fork
safety, the IPython shell, and which host and frontend this is.
"""
