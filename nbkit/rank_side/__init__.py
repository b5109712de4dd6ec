"""What runs in a rank: its set-up, the default process group a cell runs in, its output, its reports, a live
rank's calls and its stop at an agreed step, and its end. The notebook starts these; nothing here runs there.
"""
