"""The notebook's end of the live ranks' connections (nbkit.live): their output, dashboard events and
end-of-call marks arrive here while a call runs, and a connection that closes says its rank died.

Each rank connects once, at set-up, and writes through nbkit.messages.rank: every message is a
channel.Envelope(rank, body), the body channel.Started (its first), channel.Report (dashboard
events) or one of nbkit.messages.live' dataclasses.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from multiprocessing import connection
from typing import cast

from nbkit.messages import rank as channel
from nbkit.messages.live import Lost

__all__ = ["Relay"]


# Connections the listener queues before accept() takes them. Every rank of a set connects at the same
# moment; with multiprocessing's default backlog of 1 the kernel dropped the handshakes of the others
# (8 simultaneous clients: 3 stuck for good in answer_challenge), so the set never started. The kernel
# caps it at net.core.somaxconn (4096 on current Linux).
_BACKLOG = 4096
# Seconds a connection has to pass the authkey handshake; one that does not is closed.
_HANDSHAKE_S = 30.0
# The Envelope rank of a Lost whose connection closed before it said which rank it was (no rank is negative).
_UNKNOWN_RANK = -1


class Relay:
    """The notebook's end of the ranks' relay connections (multiprocessing.connection, 127.0.0.1 or the
    given address, a random authkey): one thread accepts, one reads, messages go to a queue that the
    notebook's main thread drains while a call runs. A connection that closes is reported as
    Envelope(rank, Lost(rank)): its rank died (Lost(None): one that had not said which rank it was).

    A burst of connections is fine: the listener's backlog holds them, and the authkey handshake runs
    on a short-lived thread per connection, so one slow client cannot hold up the others.
    """

    def __init__(self, host: str):
        self.authkey = os.urandom(32)
        # No authkey on the listener: its accept() would run the handshake on the accepting thread.
        self._listener = connection.Listener((host, 0), backlog=_BACKLOG)
        self.address: tuple[str, int] = self._listener.address
        self.messages: queue.Queue[channel.Envelope] = queue.Queue()
        self._conns: dict[connection.Connection, int | None] = {}  # its rank, once its Started said it
        self._pending: set[connection.Connection] = set()  # in the handshake
        self._admitting: set[threading.Thread] = set()  # the handshakes' threads (the running ones and a few ended)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads = [
            threading.Thread(target=self._accept, name="nbkit-live-accept", daemon=True),
            threading.Thread(target=self._read, name="nbkit-live-relay", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except Exception:
                if self._closed.is_set():
                    return
                continue
            with self._lock:
                # After close(): the connection that woke accept() up (or a late rank's) gets no handshake,
                # whose thread would outlive close().
                if self._closed.is_set():
                    conn.close()
                    return
                thread = threading.Thread(target=self._admit, args=(conn,), name="nbkit-live-handshake", daemon=True)
                self._admitting = {t for t in self._admitting if t.is_alive()} | {thread}
            thread.start()

    def _admit(self, conn: connection.Connection) -> None:
        """Check `conn`'s authkey (both ways, as Listener(authkey=...) does), then read from it."""
        with self._lock:
            if self._closed.is_set():  # close() ran before this thread did: it hangs up only what is pending
                conn.close()
                return
            self._pending.add(conn)
        # Hangs up on a peer that stops halfway (the handshake has no timeout of its own).
        timer = threading.Timer(_HANDSHAKE_S, _hang_up, args=(conn,))
        timer.name = "nbkit-live-handshake-timer"
        timer.start()
        try:
            connection.deliver_challenge(conn, self.authkey)
            connection.answer_challenge(conn, self.authkey)
        except Exception:  # a wrong key, a peer gone, or the timer closed it
            with contextlib.suppress(Exception):
                conn.close()
            return
        finally:
            timer.cancel()
            timer.join()  # ends at once once cancelled; joined so that close() leaves no timer running
            with self._lock:
                self._pending.discard(conn)
        with self._lock:
            if self._closed.is_set():
                conn.close()
                return
            self._conns[conn] = None

    def _read(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                conns = list(self._conns)
            if not conns:
                time.sleep(0.01)
                continue
            for ready in connection.wait(conns, timeout=0.01):
                conn = cast(connection.Connection, ready)
                try:
                    message: channel.Envelope = conn.recv()
                except Exception:  # EOF, or a rank killed mid-message
                    with self._lock:
                        rank = self._conns.pop(conn, None)
                    with contextlib.suppress(Exception):
                        conn.close()
                    if not self._closed.is_set():
                        self.messages.put(channel.Envelope(_UNKNOWN_RANK if rank is None else rank, Lost(rank)))
                    continue
                if isinstance(message.body, channel.Started):
                    with self._lock:
                        self._conns[conn] = message.rank
                self.messages.put(message)

    def close(self) -> None:
        """Stop listening and reading, and close every connection. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        address = self.address
        with contextlib.suppress(Exception):
            self._listener.close()
        # accept() does not wake up when its socket is closed: a connection does it.
        with contextlib.suppress(OSError), socket.create_connection(address, timeout=1):
            pass
        accept, read = self._threads
        accept.join(timeout=2)  # first: no handshake starts after this
        with self._lock:
            for conn in self._pending:
                _hang_up(conn)
            for conn in self._conns:
                with contextlib.suppress(Exception):
                    conn.close()
            self._conns.clear()
            admitting = list(self._admitting)
        # Each ends within a poll (the reader) or once its hung-up peer's read fails (a handshake): nothing of the
        # set is left running after close(). A fixed bound keeps a stuck thread from hanging the notebook.
        for thread in [read, *admitting]:
            thread.join(timeout=2)


def _hang_up(conn: connection.Connection) -> None:
    """Shut `conn`'s socket down, which wakes a thread blocked reading it (close() alone would not)."""
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)
