"""nbkit.supervisor: one cause, one story, whichever way the ranks were started.

Real processes on gloo: a rank that the kernel's OOM killer would end (SIGKILL) is named with the
same cause line and the same advice in a forked launch, a spawned launch and a live set. stop(), the
one way nbkit ends processes, on real child processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import nbkit
from nbkit import spawning, supervisor
from nbkit.rank_options import RankOptions
from nbkit.supervisor import ExitStatus

# rank 1 dies as the OOM killer ends a process, while rank 0 waits for it in a collective
_CELL = (
    "import os, signal, torch.distributed as dist\n"
    "if not dist.is_initialized():\n    dist.init_process_group('gloo')\n"
    "if dist.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    "dist.barrier()\n"
)


def _killed_rank() -> None:
    exec(_CELL, {})


def _forked() -> str:
    with pytest.raises(nbkit.LaunchError) as caught:
        nbkit.launch(_killed_rank, gpus=2, dashboard=False)
    return str(caught.value)


def _spawned() -> str:
    with pytest.raises(nbkit.LaunchError) as caught:
        spawning.run_source(_CELL, {}, RankOptions(gpus=2, dashboard=False))
    return str(caught.value)


def _live() -> str:
    ranks = nbkit.start(gpus=2)
    try:
        with pytest.raises(nbkit.LiveError) as caught:
            ranks.exec(_CELL)
    finally:
        ranks.stop()
        nbkit.live.forget_ended()
    assert caught.value.ended
    return str(caught.value)


@pytest.mark.parametrize("run", [_forked, _spawned, _live], ids=["fork", "spawn", "live"])
def test_a_rank_killed_by_sigkill_gets_the_same_cause_and_advice_everywhere(run):
    message = run()
    killed = ExitStatus(signal=signal.SIGKILL)
    assert killed.cause == "died from signal SIGKILL"
    assert "rank 1" in message and killed.cause in message, message
    assert killed.hint in message, message  # the same advice, word for word
    assert "out of CPU memory" in killed.hint


# A child that says "ready" once its SIGTERM handling is in place, then sleeps for a minute.
_SLEEPER = "import signal, sys, time\n{handling}\nprint('ready', flush=True)\ntime.sleep(60)\n"


def _sleeper(handling: str = "") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _SLEEPER.format(handling=handling)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def test_stop_ends_each_process_and_says_with_what():
    """SIGTERM ends one, another ignores it and is SIGKILLed after the grace, one that ended before is
    only reported; whether given as a Popen or as a pid, each is collected: nothing is left, not even a zombie.
    """
    ends = _sleeper()
    ignores = _sleeper("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    # given by pid: a child that no Popen watches, as torch elastic's ranks are to the launch
    ignores_pid = _sleeper("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    ended = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    while supervisor.pid_alive(ended.pid):
        time.sleep(0.01)
    start = time.monotonic()
    try:
        result = supervisor.stop(
            {"ends": ends, "ignores": ignores, "ignores by pid": ignores_pid.pid, "ended": ended}, grace_s=1.0
        )
        took = time.monotonic() - start
    finally:
        for proc in (ends, ignores, ignores_pid, ended):
            proc.kill()
            proc.wait()  # a no-op for those stop() collected
    assert result == {
        "ends": ExitStatus(signal=signal.SIGTERM),
        "ignores": ExitStatus(signal=signal.SIGKILL),
        "ignores by pid": ExitStatus(signal=signal.SIGKILL),
        "ended": ExitStatus(code=3),
    }
    assert list(result) == ["ends", "ignores", "ignores by pid", "ended"]  # the caller's order
    assert 1.0 <= took < 5, took  # the grace, all together, then SIGKILL takes effect at once
    assert (ends.returncode, ignores.returncode) == (-signal.SIGTERM, -signal.SIGKILL)  # set on the Popen
    with pytest.raises(ChildProcessError):  # collected: no zombie left
        os.waitpid(ignores_pid.pid, os.WNOHANG)
    assert not any(supervisor.pid_alive(p.pid) for p in (ends, ignores, ignores_pid, ended))


def test_stop_of_a_process_that_is_not_a_child_reports_it_gone_without_a_status():
    """A process started by another (the ipyparallel controller is watched by ipyparallel): its status
    is not this process's to read; stop() ends it and says only that it ended.
    """
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; print(subprocess.Popen(sys.argv[1:]).pid, flush=True)",
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    parent.wait()
    try:
        assert supervisor.stop({"orphan": pid}, grace_s=5.0) == {"orphan": ExitStatus()}
        assert not supervisor.pid_alive(pid)
    finally:
        supervisor.kill(pid, signal.SIGKILL)


def test_stop_with_no_grace_kills_at_once_and_without_a_first_signal_only_waits():
    quick = _sleeper()
    start = time.monotonic()
    assert supervisor.stop({0: quick}, grace_s=0) == {0: ExitStatus(signal=signal.SIGKILL)}
    assert time.monotonic() - start < 1
    leaving = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(0)"])
    assert supervisor.stop({0: leaving}, grace_s=30, first=None) == {0: ExitStatus(code=0)}
