"""The relay of a live set (the notebook's end of the ranks' connections; real sockets): what it reports
when a connection closes, in words, alone and in the message of the set it ends (2 gloo CPU ranks).
"""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing import connection

import psutil
import pytest
from faultkit import nothing_left

import nbkit
from nbkit.live.relay import Relay
from nbkit.messages import rank as channel
from nbkit.messages.live import Lost
from nbkit.platform.errors import LiveError


@pytest.mark.usefixtures("leftovers")
def test_a_connection_that_closes_says_which_rank_it_was_or_that_it_never_said():
    relay = Relay("127.0.0.1")
    try:
        # passes the handshake, then closes before its first message (a rank that dies while connecting)
        connection.Client(relay.address, authkey=relay.authkey).close()
        lost = relay.messages.get(timeout=5).body
        assert isinstance(lost, Lost) and lost == Lost(None)
        assert lost.what == "a connection to the notebook closed before it said which rank it was"

        conn = connection.Client(relay.address, authkey=relay.authkey)
        conn.send(channel.Envelope(1, channel.Started(1)))
        assert relay.messages.get(timeout=5).body == channel.Started(1)
        conn.close()
        message = relay.messages.get(timeout=5)
        lost = message.body
        assert isinstance(lost, Lost) and (message.rank, lost) == (1, Lost(1))
        assert lost.what == "rank 1's connection to the notebook closed"
    finally:
        relay.close()


@pytest.mark.usefixtures("leftovers")
def test_close_returns_with_none_of_the_relays_threads_running():
    """stop() of a set closes its relay, and must leave nothing of the set running when it returns (a leak
    check right after it, as the GPU soak makes, sees what is still there): no settling allowed here.
    """
    for _ in range(20):  # the end of a handshake races with close(): the soak saw one close in 15 leave two threads
        relay = Relay("127.0.0.1")
        rank = connection.Client(relay.address, authkey=relay.authkey)
        rank.send(channel.Envelope(0, channel.Started(0)))
        assert relay.messages.get(timeout=5).body == channel.Started(0)
        stalled = socket.create_connection(relay.address)  # a peer that stops halfway through the handshake
        relay.close()
        running = [t.name for t in threading.enumerate() if t.name.startswith("nbkit-live")]
        stalled.close()
        rank.close()
        assert running == []


@pytest.mark.version_independent  # a live set whose cell uses the standard library alone
def test_a_set_whose_connection_closes_before_it_says_its_rank_ends_saying_so():
    """The live set's message names what happened in words: no rank number it does not have.

    A process that passes the relay's handshake and dies before its first message (a rank dying while
    it connects) is made here by a connection from the test: nothing public gives a rank that moment,
    so the test takes the set's relay address and key.
    """
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ranks = nbkit.start(gpus=2)
    try:
        relay = ranks._engines.relay
        assert relay is not None
        threading.Timer(1.0, lambda: connection.Client(relay.address, authkey=relay.authkey).close()).start()
        started = time.monotonic()
        with pytest.raises(LiveError) as caught:
            ranks.exec("import time\ntime.sleep(60)", timeout=120)
        message = str(caught.value)
        assert caught.value.ended, message
        assert "a connection to the notebook closed before it said which rank it was" in message, message
        assert "rank -1" not in message, message
        assert time.monotonic() - started < 30, message
        assert nothing_left(before) == []  # every process of the set was stopped
    finally:
        ranks.stop()
        nbkit.live.forget_ended()
