"""nbkit.launching.supervisor: one cause, one story, whichever way the ranks were started.

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
from nbkit.launching import spawn, supervisor
from nbkit.launching.rank_options import RankOptions
from nbkit.launching.supervisor import ExitStatus

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
        spawn.run_source(_CELL, {}, RankOptions(gpus=2, dashboard=False))
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


# version_independent: the live set's ranks run torch alone; fork and spawn launch through accelerate's
# notebook_launcher, whose version differs between the two sets.
LIVE_ONLY = pytest.mark.version_independent


@pytest.mark.parametrize(
    "run", [_forked, _spawned, pytest.param(_live, marks=LIVE_ONLY)], ids=["fork", "spawn", "live"]
)
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


@pytest.mark.version_independent  # plain Python processes
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


@pytest.mark.version_independent  # plain Python processes
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


@pytest.mark.version_independent  # plain Python processes
def test_stop_with_no_grace_kills_at_once_and_without_a_first_signal_only_waits():
    quick = _sleeper()
    start = time.monotonic()
    assert supervisor.stop({0: quick}, grace_s=0) == {0: ExitStatus(signal=signal.SIGKILL)}
    assert time.monotonic() - start < 1
    leaving = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(0)"])
    assert supervisor.stop({0: leaving}, grace_s=30, first=None) == {0: ExitStatus(code=0)}


# What the machine's environment holds for NCCL, as a GPU host sets it (NVLink multicast off): every
# process nbkit starts must inherit it, whichever way it starts them.
_MACHINE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_READ_ENV = f"import os\n{{k: os.environ.get(k) for k in {sorted(_MACHINE_ENV)!r}}}\n"


def _read_env() -> dict:
    return {k: os.environ.get(k) for k in sorted(_MACHINE_ENV)}


def _env_forked() -> dict:
    return nbkit.launch(_read_env, gpus=2, dashboard=False)


def _env_spawned() -> dict:
    return spawn.run_source(_READ_ENV, {}, RankOptions(gpus=2, dashboard=False))


def _env_live() -> dict:
    ranks = nbkit.start(gpus=2)
    try:
        return ranks.exec(_READ_ENV)
    finally:
        ranks.stop()


@pytest.mark.parametrize(
    "run", [_env_forked, _env_spawned, pytest.param(_env_live, marks=LIVE_ONLY)], ids=["fork", "spawn", "live"]
)
def test_the_notebooks_environment_reaches_every_rank(run, monkeypatch):
    for name, value in _MACHINE_ENV.items():
        monkeypatch.setenv(name, value)
    assert run() == _MACHINE_ENV


def test_gpu_ranks_get_nccls_error_handling_unless_the_notebook_chose_its_own(monkeypatch):
    from nbkit.launching import rank_contract

    wait = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
    for name in (
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
        wait,
    ):
        monkeypatch.delenv(name, raising=False)
    gpu = rank_contract.rank_environment(RankOptions(), use_cpu=False)
    assert gpu["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and gpu["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert gpu["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "60" and "TORCH_NCCL_BLOCKING_WAIT" not in gpu
    assert gpu[wait] == "0"  # no dump is coming: the watchdog must not wait a minute for one
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # debugging a desync: torch's wait for the dump stays
    assert wait not in rank_contract.rank_environment(RankOptions(), use_cpu=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # the dump set off by hand: still no wait for it
    assert rank_contract.rank_environment(RankOptions(), use_cpu=False)[wait] == "0"
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT")
    assert not any(k.startswith("TORCH_NCCL") for k in rank_contract.rank_environment(RankOptions(), use_cpu=True))
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the user's choice, inherited as it is
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in rank_contract.rank_environment(RankOptions(), use_cpu=False)


def _watchdog_timeout() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:  # the text torch's ProcessGroupNCCL raises for a collective past its timeout
        raise RuntimeError(
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4, OpType=ALLREDUCE, "
            "NumelIn=1, NumelOut=1, Timeout(ms)=5000) ran for 5012 milliseconds before timing out."
        )
    dist.barrier()


def _out_of_gpu_memory() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:  # the text of torch's OutOfMemoryError on a GPU
        raise RuntimeError("CUDA out of memory. Tried to allocate 4096.00 GiB. GPU 1 has a total capacity of 79.19 GiB")
    dist.barrier()


def _aborts() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os.abort()  # what NCCL's watchdog does to a rank whose collective timed out
    dist.barrier()


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        (_watchdog_timeout, ("NCCL's watchdog ended the rank", "nccl_timeout")),
        (_aborts, ("died from signal SIGABRT", "NCCL's watchdog ended the rank", "nccl_timeout")),
        (_out_of_gpu_memory, ("A rank ran out of GPU memory", "nbkit.plan(")),
    ],
    ids=["watchdog-timeout", "sigabrt", "out-of-gpu-memory"],
)
def test_a_gpu_failure_is_named_with_its_rank_its_cause_and_what_to_do(fn, says):
    with pytest.raises(nbkit.LaunchError) as caught:
        nbkit.launch(fn, gpus=2, dashboard=False)
    message = str(caught.value)
    assert message.startswith("rank 1 "), message
    assert all(phrase in message for phrase in says), message


def test_a_launch_blames_the_rank_elastic_reports_when_elastic_collected_every_status_first():
    # On 2 GPUs torch elastic can collect both ranks' statuses before nbkit's supervisor reads them:
    # rank 0 aborted by NCCL's watchdog, rank 1 (asleep) stopped by elastic. Unknown to nbkit, they
    # arrive in any order; the cause is the one elastic's report says failed on its own.
    from nbkit.launching import fork

    aborts = subprocess.Popen([sys.executable, "-c", "import os; os.abort()"])
    sleeps = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    aborts.wait()
    sleeps.terminate()
    sleeps.wait()  # both collected here, as elastic collects them
    run = fork._Run(nprocs=2, on_event=None, timeout=None)
    try:
        run.pids = {1: sleeps.pid, 0: aborts.pid}  # the sleeping rank's Started came first
        run._check_exits(drain=False)
        assert run.failed == [], "no rank can be blamed from statuses nbkit never read"
        with pytest.raises(nbkit.LaunchError) as caught:
            run._conclude({0: ExitStatus(signal=signal.SIGABRT), 1: ExitStatus(signal=signal.SIGTERM)}, "")
    finally:
        run.pipes.close()
    assert str(caught.value).startswith("rank 0 died from signal SIGABRT"), str(caught.value)
    assert list(caught.value.failures) == [0]


def test_a_rank_that_exited_0_before_its_peer_lost_it_is_blamed_when_elastic_collected_it_first():
    # Rank 1 exits 0 mid-run; torch elastic, taking code 0 for success, collects its status before nbkit's
    # supervisor reads it (unknown to nbkit). Rank 0's barrier then fails with "Connection reset by peer" and
    # it exits 1, which elastic reports as the launch's one failure. The cause is rank 1's silent end, not the
    # error that only says a peer went away (a CPU CI run blamed rank 0 this way).
    from nbkit.launching import fork
    from nbkit.platform.errors import RankError

    exits_0 = subprocess.Popen([sys.executable, "-c", "import os; os._exit(0)"])
    exits_0.wait()  # collected here, as elastic collects it
    lost_peer = subprocess.Popen([sys.executable, "-c", "import os; os._exit(1)"])
    while supervisor.exit_status(lost_peer.pid) is None:  # ended, its status left for nbkit to read
        time.sleep(0.01)
    message = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:55681: Connection reset by peer."
    run = fork._Run(nprocs=2, on_event=None, timeout=None)
    try:
        run.pids = {0: lost_peer.pid, 1: exits_0.pid}
        run.errors[0] = RankError(rank=0, type="RuntimeError", message=message, traceback="", time=time.time())
        run._unsettled[0] = time.monotonic() - 10  # its error arrived long ago: no death was seen before it
        run._check_exits(drain=False)
        run._settle_errors(time.monotonic())
        assert run.failed == [], "a rank that lost its peer is not the cause, and rank 1's status was never read"
        with pytest.raises(nbkit.LaunchError) as caught:
            run._conclude({0: ExitStatus(code=1)}, "")
    finally:
        run.pipes.close()
        lost_peer.wait()
    message = str(caught.value)
    assert message.startswith(("rank 1 exited with code 0", "rank 1 ended without returning")), message
    assert list(caught.value.failures) == [1]
