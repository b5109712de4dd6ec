"""A live set driven from Python (nbkit.start, 2 gloo CPU ranks, real processes): stop() from another
thread, as a script's watchdog or a second notebook thread calls it, ends the call that waits at once,
with a message that names the stop, and leaves nothing running.
"""

from __future__ import annotations

import threading
import time

import psutil
import pytest
from faultkit import nothing_left

import nbkit
from nbkit.platform.errors import LiveError

pytestmark = [pytest.mark.slow, pytest.mark.version_independent]


@pytest.mark.parametrize("timeout", [None, 60.0], ids=["no-timeout", "with-timeout"])
def test_stop_from_another_thread_ends_the_waiting_call_at_once_naming_the_stop(timeout):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    live = nbkit.start(gpus=2)
    stopped_at: list[float] = []

    def stop() -> None:
        stopped_at.append(time.monotonic())
        live.stop()

    timer = threading.Timer(2.0, stop)
    timer.start()
    try:
        with pytest.raises(LiveError, match=r"LiveRanks.stop\(\) ended the live set while this call ran") as error:
            live.exec("import time\nwhile True:\n    time.sleep(0.1)", timeout=timeout)
        assert time.monotonic() - stopped_at[0] < 5.0
        assert error.value.ended and "None" not in str(error.value)
    finally:
        timer.join()
        live.stop()
    assert nothing_left(before) == []
    assert nbkit.live.current() is None
    with nbkit.start(gpus=2) as again:
        assert again.exec("1 + 1") == 2
