"""A live set under stress: a burst of ranks connecting at once, a rank that never arrives (real processes,
the notebook's own relay listener).
"""

from __future__ import annotations

import threading
import time
from multiprocessing import connection

import pytest

from nbkit import channel
from nbkit.live.relay import Relay

pytestmark = pytest.mark.usefixtures("leftovers")


def test_a_burst_of_64_connections_to_the_relay_all_get_through_within_5_s():
    relay = Relay("127.0.0.1")
    clients: list[connection.Connection] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    go = threading.Barrier(64)

    def rank(r: int) -> None:
        go.wait()  # every client connects at the same moment, as the ranks of a set do
        try:
            conn = connection.Client(relay.address, authkey=relay.authkey)
            conn.send(channel.Envelope(r, channel.Started(r)))
        except BaseException as exc:  # reported by the assert below
            with lock:
                errors.append(exc)
            return
        with lock:
            clients.append(conn)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(64)]
    start = time.monotonic()
    try:
        for t in threads:
            t.start()
        seen: set[int] = set()
        while len(seen) < 64 and time.monotonic() - start < 5:
            try:
                seen.add(relay.messages.get(timeout=0.1).rank)
            except Exception:
                pass
        took = time.monotonic() - start
        assert errors == []
        assert sorted(seen) == list(range(64)), f"{64 - len(seen)} of 64 did not get through in {took:.1f} s"
        for t in threads:
            t.join(5)
    finally:
        relay.close()
        for conn in clients:
            conn.close()


def test_a_client_with_the_wrong_key_is_refused_and_the_others_get_through():
    relay = Relay("127.0.0.1")
    try:
        with pytest.raises(connection.AuthenticationError):
            connection.Client(relay.address, authkey=b"not the key")
        conn = connection.Client(relay.address, authkey=relay.authkey)
        conn.send(channel.Envelope(0, channel.Started(0)))
        assert relay.messages.get(timeout=5).rank == 0
        conn.close()
    finally:
        relay.close()
