"""The IPython shell this process runs in, if any, found without importing IPython, and the cell
that output from other threads should go to.

`import nbkit` and the API modules never import IPython (it takes about a second, and scripts and
launched ranks have no use for it); code that behaves differently inside a notebook asks here.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["OutputCell", "current"]


def current() -> Any:
    """The running IPython shell (an ipykernel ZMQInteractiveShell in a notebook), or None.

    Returns:
        None in a script, in a launched rank that never had IPython, or where IPython is imported
        but no shell was created. Never imports IPython.
    """
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


class OutputCell:
    """The notebook cell running when this object is created.

    `with cell.active():` makes output from another thread (display, print, widget updates) go to
    that cell. Needed because ipykernel 7 keeps the "parent" message per thread (a context variable)
    and a new thread has none. Outside a kernel, and in the main thread, `active()` does nothing.
    """

    def __init__(self) -> None:
        shell = current()
        self.shell = shell if hasattr(shell, "get_parent") else None
        self.parent = self.shell.get_parent() if self.shell is not None else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, output of this (non-main) thread goes to the cell that started the run."""
        if self.shell is None or not self.parent or threading.current_thread() is threading.main_thread():
            yield
            return
        if hasattr(self.shell, "set_thread_parent"):  # ipykernel >= 7
            tokens = self.shell.set_thread_parent(self.parent)
            try:
                yield
            finally:
                self.shell.reset_thread_parent(tokens)
        else:
            self.shell.set_parent(self.parent)
            yield
