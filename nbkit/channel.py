"""Messages from launched ranks back to the notebook process.

One pipe per local rank is created before the processes are forked; each rank writes only to its
own pipe (so a rank killed mid-message cannot block the others behind a shared lock), and a thread
in the notebook process reads all of them. Messages are `(kind, rank, payload)` tuples:

    "started"  payload: the rank's pid
    "event"    payload: a dict of metrics (nbkit.report, the Trainer callback)
    "result"   payload: rank 0's pickled return value (bytes)
    "error"    payload: RankError of an exception raised in the rank

Code inside a launched rank calls `send(kind, payload)`; outside a launch `connected()` is False.

The ranks of a live set (nbkit.live) are not forked from the notebook: each connects to the
notebook's relay listener instead and hands that connection to `attach_connection`; `send` then
works the same way there (and the live set adds kind "live": nbkit.live.messages dataclasses).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from multiprocessing import connection, get_context
from typing import Any

__all__ = ["Channel", "attach_connection", "connected", "send"]


_writer: connection.Connection | _LockedConnection | None = None
_writer_rank: int = -1


def connected() -> bool:
    """Whether this process is a rank launched by nbkit.launch with a channel to the notebook."""
    return _writer is not None


def send(kind: str, payload: Any) -> None:
    """Send one message to the notebook process. A no-op outside a launched rank."""
    if _writer is None:
        return
    _writer.send((kind, _writer_rank, payload))


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
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

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
    def start(self, handle: Callable[[str, int, Any], None]) -> None:
        """Read messages on a daemon thread and pass each to `handle(kind, rank, payload)`."""
        self._thread = threading.Thread(target=self._read, args=(handle,), name="nbkit-channel", daemon=True)
        self._thread.start()

    def _read(self, handle: Callable[[str, int, Any], None]) -> None:
        open_readers = list(self._readers)
        started = 0
        while open_readers:
            # After stop(), one last pass takes whatever the ranks wrote before they exited.
            final = self._stop.is_set()
            ready = connection.wait(open_readers, timeout=0 if final else 0.1)
            for reader in ready:
                try:
                    kind, rank, payload = reader.recv()
                except (EOFError, OSError):
                    open_readers.remove(reader)
                    continue
                except Exception:  # a rank killed mid-message leaves a truncated pickle
                    open_readers.remove(reader)
                    continue
                if kind == "started":
                    started += 1
                    if started == len(self._writers):
                        # Every rank is forked and holds its own end: dropping ours lets a rank
                        # that dies mid-message show up as EOF instead of a reader blocked forever.
                        self._close_writers()
                handle(kind, rank, payload)
            if final and not ready:
                break

    def stop(self) -> None:
        """Drain what is left, stop the reader thread and close every pipe end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._close_writers()
        for end in self._readers:
            end.close()

    def _close_writers(self) -> None:
        for end in self._writers:
            end.close()
