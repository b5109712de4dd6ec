"""The notebook's end of the live ranks' connections (nbkit.live): their output, dashboard events and
end-of-call marks arrive here while a call runs, and a connection that closes says its rank died.

Each rank connects once, at set-up, and writes through nbkit.channel: every message is a
channel.Envelope(rank, body), the body channel.Started (its first), channel.Report (dashboard
events) or one of nbkit.live.messages' dataclasses.
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

from nbkit import channel
from nbkit.live.messages import Lost

__all__ = ["Relay"]


class Relay:
    """The notebook's end of the ranks' relay connections (multiprocessing.connection, 127.0.0.1 or the
    given address, a random authkey): one thread accepts, one reads, messages go to a queue that the
    notebook's main thread drains while a call runs. A connection that closes is reported as
    Envelope(rank, Lost()): its rank died.
    """

    def __init__(self, host: str):
        self.authkey = os.urandom(32)
        self._listener = connection.Listener((host, 0), authkey=self.authkey)
        self.address: tuple[str, int] = self._listener.address
        self.messages: queue.Queue[channel.Envelope] = queue.Queue()
        self._conns: dict[connection.Connection, int] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="nbkit-live-accept", daemon=True).start()
        threading.Thread(target=self._read, name="nbkit-live-relay", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except Exception:
                if self._closed.is_set():
                    return
                continue
            with self._lock:
                self._conns[conn] = -1

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
                        rank = self._conns.pop(conn, -1)
                    with contextlib.suppress(Exception):
                        conn.close()
                    if not self._closed.is_set():
                        self.messages.put(channel.Envelope(rank, Lost()))
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
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(Exception):
                    conn.close()
            self._conns.clear()
