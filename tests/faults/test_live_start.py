"""A live set whose start fails or is interrupted leaves nothing running (2 gloo CPU ranks, real processes).

nbkit.start starts a controller and one engine process per rank, then waits for the engines to
register and join the process group. Whatever ends that wait early -- the notebook's stop button
(SIGINT, as `%ddp start` gets it), the start-up timeout, an engine that dies while starting -- every
process started so far must end with it, and the notebook must be able to start a set at once.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable

import ipyparallel.cluster.launcher
import psutil
import pytest
from faultkit import nothing_left

import nbkit
from nbkit.platform.errors import LiveError

pytestmark = [pytest.mark.slow, pytest.mark.version_independent]


@pytest.fixture
def before() -> set[int]:
    assert nbkit.live.current() is None
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _starts_again() -> None:
    """A new set starts at once, and works."""
    assert nbkit.live.current() is None and nbkit.live.ended() is None
    with nbkit.start(gpus=2) as ranks:
        assert ranks.run(lambda: nbkit.world_size()) == 2


def _as_started(monkeypatch, module: str, action: Callable[[subprocess.Popen], object], nth: int = 1) -> None:
    """Call action(process) in the notebook's main thread the moment the nth process that runs `module` has
    started: on the line after its Popen, before the caller has the process, long before it registers. (From the
    main thread, not from a thread that watches for the processes: on a loaded machine such a thread saw them
    seconds late, after the start had returned.)"""
    started = []

    class Popen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            super().__init__(args, *rest, **kwargs)
            if module in args:
                started.append(self.pid)
                if len(started) == nth:
                    action(self)

    monkeypatch.setattr(subprocess, "Popen", Popen)  # nbkit's engines
    monkeypatch.setattr(ipyparallel.cluster.launcher, "Popen", Popen)  # ipyparallel's controller launcher


def _press_stop(process: subprocess.Popen | None = None) -> None:
    """The stop button: SIGINT in the notebook's main thread, as `%ddp start` gets it."""
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("when", ["controller-started", "engine-started", "engines-registering"])
def test_an_interrupt_while_the_set_starts_ends_every_process(before, monkeypatch, when):
    # The stop button during `%ddp start`, as the controller or an engine has just started (an interrupt between a
    # process's start and the record of its pid left it running), or as nbkit starts waiting for both engines to
    # register (which takes seconds).
    if when == "engines-registering":
        wait = nbkit.live.engines._wait_for_engines

        def press_stop_then_wait(*args, **kwargs):
            _press_stop()
            return wait(*args, **kwargs)

        monkeypatch.setattr(nbkit.live.engines, "_wait_for_engines", press_stop_then_wait)
    else:
        _as_started(monkeypatch, f"ipyparallel.{when.split('-')[0]}", _press_stop)
    with pytest.raises(KeyboardInterrupt):
        nbkit.start(gpus=2)
    monkeypatch.undo()
    # Nothing the interrupted start ran is left to be finalised later, wherever a garbage collection happens to run
    # (asyncio's "Task was destroyed but it is pending!" a cell later).
    pending = _Messages()
    logging.getLogger("asyncio").addHandler(pending)
    try:
        gc.collect()
    finally:
        logging.getLogger("asyncio").removeHandler(pending)
    assert not [m for m in pending.messages if "destroyed but it is pending" in m], pending.messages
    assert nothing_left(before) == []
    _starts_again()


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_start_up_timeout_ends_the_engines(before):
    says = r"rank\(s\) 0 \(pid \d+\), 1 \(pid \d+\) did not start and register .* within the start-up timeout \(1 s\)"
    with pytest.raises(LiveError, match=says):
        nbkit.start(gpus=2, startup_timeout=1)
    assert nothing_left(before) == []
    _starts_again()


def test_an_engine_that_dies_while_starting_takes_the_others_with_it(before, monkeypatch):
    _as_started(monkeypatch, "ipyparallel.engine", lambda engine: engine.kill(), nth=2)
    with pytest.raises(LiveError, match=r"Rank \d's process ended while starting \(died from signal SIGKILL\)"):
        nbkit.start(gpus=2)
    assert nothing_left(before) == []
    _starts_again()


def test_an_engine_that_cannot_say_who_it_is_is_named_with_its_error_at_once(before, monkeypatch, tmp_path):
    # The engines register, but the first thing a rank does there (nbkit's identify(), which imports torch) fails:
    # the start ends with that error as soon as it comes back, not at the 180 s timeout as a rank that "did not
    # register". A torch that cannot be imported, first on the engines' path, stands in for any such failure.
    broken = tmp_path / "torch"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise ImportError("torch is broken here")\n')
    original = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), original])))
    started = time.monotonic()
    with pytest.raises(LiveError, match=r"Engine \d+ could not start as a rank: .*torch is broken here"):
        nbkit.start(gpus=2)
    assert time.monotonic() - started < 90  # the engines' own start on a loaded machine; not the 180 s timeout
    assert nothing_left(before) == []
    if original is None:
        monkeypatch.delenv("PYTHONPATH")
    else:
        monkeypatch.setenv("PYTHONPATH", original)
    _starts_again()


def test_a_rank_that_never_arrives_is_named_with_its_step_within_seconds(before, monkeypatch):
    # The second engine is frozen (SIGSTOP) as it starts: the other registers, the frozen one never does. The
    # start fails _STALL_S after the other arrived, naming the frozen rank and the step, not at the 180 s timeout.
    monkeypatch.setattr(nbkit.live.engines, "_STALL_S", 3.0)
    frozen: list[int] = []

    def freeze(engine: subprocess.Popen) -> None:
        psutil.Process(engine.pid).suspend()
        frozen.append(engine.pid)

    _as_started(monkeypatch, "ipyparallel.engine", freeze, nth=2)
    started = time.monotonic()
    with pytest.raises(LiveError) as failed:
        nbkit.start(gpus=2)
    took = time.monotonic() - started
    text = str(failed.value)
    named = re.search(rf"rank\(s\) (\d) \(pid {frozen[0]}\) did not start and register with the ipyparallel", text)
    assert named, text
    other = 1 - int(named.group(1))
    assert f"(start-up step 1 of 3) within 3 s of rank(s) {other}, which did" in text, text
    assert took < 90, took  # rank 0's own start on a loaded machine, plus the 3 s; not the 180 s timeout
    assert nothing_left(before) == []
    _starts_again()
