"""Messages from launched ranks back to the notebook process.

One pipe per local rank is created before the processes are forked; each rank writes only to its
own pipe (so a rank killed mid-message cannot block the others behind a shared lock), and one
thread in the notebook process reads all of them. Every message is an `Envelope(rank, body)` whose
body is one of the dataclasses below:

    Started   the rank runs; its pid, so the notebook can watch the process itself
    Report    a dict of metrics (nbkit.report, the Trainer callback)
    Result    rank 0's pickled return value
    Raised    the RankError of an exception raised in the rank
    Returned  the rank's function returned (and rank 0's Result was sent before it)

Code inside a launched rank calls `send(body)`; outside a launch `connected()` is False.

The ranks of a live set (nbkit.live) are not forked from the notebook: each connects to the
notebook's relay listener instead and hands that connection to `attach_connection`; `send` then
works the same way there, and the live set adds bodies of its own (nbkit.messages.live).

These bodies are defined here once for every channel between nbkit's processes: a live set's ranks
send Started and Report over the relay and answer each call with Result, Raised or Returned (in
nbkit.messages.live.Outcome), and spawn mode's launcher process passes Report and Result on to the
notebook (nbkit.messages.spawn). Each channel's own messages live in one module: this one for
launched ranks, nbkit.messages.live for a live set, nbkit.messages.spawn for spawn mode.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection, get_context
from typing import Any

from nbkit.platform.errors import RankError

__all__ = [
    "Body",
    "Channel",
    "Envelope",
    "Raised",
    "Report",
    "Result",
    "Returned",
    "Started",
    "attach_connection",
    "connected",
    "send",
]


@dataclass(frozen=True)
class Started:
    """The rank is running in process `pid`."""

    pid: int


@dataclass(frozen=True)
class Report:
    """Metrics a rank reported (nbkit.report or the Trainer callback)."""

    metrics: dict[str, Any]


@dataclass(frozen=True)
class Result:
    """A rank's return value (a launch's rank 0, a live call's lowest target), pickled in the rank
    (rank_contract.pickle_for_notebook): only the notebook has the classes to rebuild it.
    """

    payload: bytes


@dataclass(frozen=True)
class Raised:
    """An exception raised in the rank."""

    error: RankError


@dataclass(frozen=True)
class Returned:
    """The rank's function returned (a launch: anything the rank does after this is the launcher's teardown; a
    live call: its value was not asked for).
    """


# The bodies of a launch; a live set (nbkit.messages.live) sends bodies of its own over the same wire.
Body = Started | Report | Result | Raised | Returned


@dataclass(frozen=True)
class Envelope:
    """One message on the wire: which global rank sent it, and what."""

    rank: int
    body: object  # a Body, or a live set's message


_writer: connection.Connection | _LockedConnection | None = None
_writer_rank: int = -1


def connected() -> bool:
    """Whether this process is a rank launched by nbkit.launch with a channel to the notebook."""
    return _writer is not None


def send(body: object) -> None:
    """Send one message to the notebook process. A no-op outside a launched rank."""
    if _writer is None:
        return
    _writer.send(Envelope(_writer_rank, body))


class _LockedConnection:
    """A connection that several threads of a rank may send on (a Trainer callback, a print in a
    data-loading thread): one message at a time, so messages never interleave on the socket.
    """

    def __init__(self, conn: connection.Connection):
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self._lock:
            self._conn.send(message)


def attach_connection(conn: connection.Connection, rank: int) -> None:
    """In a live rank: make `send()` write to `conn` (a connection to the notebook's relay)."""
    global _writer, _writer_rank
    _writer, _writer_rank = _LockedConnection(conn), rank


class Channel:
    """The pipes of one launch: created in the notebook process, inherited by the forked ranks."""

    def __init__(self, nprocs: int):
        ctx = get_context("fork")
        pairs = [ctx.Pipe(duplex=False) for _ in range(nprocs)]
        self._readers = [r for r, _ in pairs]
        self._writers = [w for _, w in pairs]
        self._open = list(self._readers)
        self._started = 0

    # -- rank side -------------------------------------------------------------------------
    def attach(self, local_rank: int, rank: int) -> None:
        """In a forked rank: make `send()` write to this rank's pipe and drop the other ends."""
        global _writer, _writer_rank
        for i, (r, w) in enumerate(zip(self._readers, self._writers)):
            r.close()
            if i != local_rank:
                w.close()
        _writer, _writer_rank = self._writers[local_rank], rank

    # -- notebook side ---------------------------------------------------------------------
    def receive(self, handle: Callable[[Envelope], None], timeout: float) -> bool:
        """Pass every message that arrives within `timeout` seconds (0: only those already
        waiting) to `handle`, in the calling thread. Returns whether any arrived.
        """
        if not self._open:  # every rank's pipe is closed: nothing can arrive
            time.sleep(timeout)
            return False
        ready = connection.wait(self._open, timeout=timeout)
        for reader in ready:
            while reader in self._open and reader.poll(0):
                try:
                    message = reader.recv()
                except Exception:  # EOF, or a rank killed mid-message left a truncated pickle
                    self._open.remove(reader)
                    break
                if isinstance(message.body, Started):
                    self._started += 1
                    if self._started == len(self._writers):
                        # Every rank is forked and holds its own end: dropping ours lets a rank
                        # that dies mid-message show up as EOF instead of a reader blocked forever.
                        self._close_writers()
                handle(message)
        return bool(ready)

    def close(self) -> None:
        """Close every pipe end this process holds (after the ranks are gone)."""
        self._close_writers()
        for end in self._readers:
            end.close()
        self._open = []

    def _close_writers(self) -> None:
        for end in self._writers:
            end.close()
