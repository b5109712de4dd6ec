"""nbkit's notices to the user: the `nbkit` logger (and its children), shown at INFO by default.

    log = notices.logger(__name__)       # in a module of nbkit: logging.getLogger("nbkit.<module>"), set up
    log.info("nbkit: resuming from checkpoint-40 (step 40) in outputs.")

Every notice nbkit gives goes through logging (warnings that a user should act on go through
`warnings`), so a user filters them the usual way: `logging.getLogger("nbkit").setLevel(logging.WARNING)`
hides the INFO notices, `logging.getLogger("nbkit.training.checkpoints")` one module's.

Shown by default: the first logger() call gives the `nbkit` logger level INFO (unless the user set a
level) and one handler that writes each record's message to the process's sys.stdout (INFO) or
sys.stderr (WARNING and above) as they are at that moment: in a notebook the running cell's output, in
a rank the rank's relay to the notebook, in a script the terminal. The `nbkit` logger does not
propagate, so a logging set-up of the user's (logging.basicConfig, a handler on the root logger) never
shows a notice a second time; to have nbkit's notices there instead:
`log = logging.getLogger("nbkit"); log.handlers.clear(); log.propagate = True`.
(Deciding by the root logger's handlers instead does not work: a rank forked from a process that had
one, a test runner's for instance, would send its notices to that handler, in the rank, unseen.)
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterable, Iterator

__all__ = ["ROOT", "logger", "quieted"]

ROOT = "nbkit"

_lock = threading.Lock()
_handler: _CurrentStreams | None = None


class _CurrentStreams(logging.Handler):
    """Writes a record's message to sys.stdout (below WARNING) or sys.stderr, looked up at each record
    (a notebook cell, a rank's relay and a test's capture replace them).
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def logger(name: str = ROOT) -> logging.Logger:
    """The logger for `name` ("nbkit" or a module under it: pass __name__), with nbkit's set-up in place.

    Returns logging.getLogger(name). The first call gives "nbkit" level INFO where the user set none, its
    handler, and propagate=False (see the module docstring); later calls change nothing.
    """
    global _handler
    with _lock:
        if _handler is None:
            root = logging.getLogger(ROOT)
            if root.level == logging.NOTSET:
                root.setLevel(logging.INFO)
            _handler = _CurrentStreams()
            _handler.setFormatter(logging.Formatter("%(message)s"))
            root.addHandler(_handler)
            root.propagate = False
    return logging.getLogger(name)


@contextlib.contextmanager
def quieted(loggers: Iterable[logging.Logger], level: int) -> Iterator[None]:
    """Set each of `loggers` to `level` while the block runs (another library's loggers, whose messages
    nbkit reports in its own words or knows to be beside the point), then give each back the level it had.
    """
    held = [(log, log.level) for log in loggers]
    for log, _ in held:
        log.setLevel(level)
    try:
        yield
    finally:
        for log, before in held:
            log.setLevel(before)
