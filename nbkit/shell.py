"""The IPython shell this process runs in, if any, found without importing IPython.

`import nbkit` and the API modules never import IPython (it takes about a second, and scripts and
launched ranks have no use for it); code that behaves differently inside a notebook asks here.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["current"]


def current() -> Any:
    """The running IPython shell (an ipykernel ZMQInteractiveShell in a notebook), or None.

    Returns:
        None in a script, in a launched rank that never had IPython, or where IPython is imported
        but no shell was created. Never imports IPython.
    """
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None
