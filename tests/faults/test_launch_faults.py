"""Fork mode (nbkit.launch): every way a rank can fail ends in a LaunchError that leads with the
rank and the cause, within seconds, with nothing left behind and an immediate rerun that works.

Real ranks: forked processes talking gloo on this CPU machine.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from faultkit import Snapshot, assert_reruns, failed_within

import nbkit
from nbkit.platform.errors import RankError

pytestmark = pytest.mark.usefixtures("leftovers")

# Issue 14's target is 2 s from a rank's death to the error; the bound here leaves room for this
# shared 2-core machine (measured: 0.24-0.96 s, see benchmarks/RESULTS.md).
DEATH_TO_ERROR_S = 4.0
# A launch's start (fork, gloo set-up) before the fault can happen, on the loaded machine.
START_S = 20.0


def _group() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")


def _wait_for_peers() -> None:
    import torch.distributed as dist

    dist.barrier()  # the failing rank never arrives
    time.sleep(120)


def _about_to_die(stamp: str) -> None:
    Path(stamp).write_text(repr(time.time()))


def raises(stamp: str) -> None:
    _group()
    if nbkit.rank() == 1:
        _about_to_die(stamp)
        raise ValueError("batch 7 has no labels")
    _wait_for_peers()


def exits_with_code(stamp: str) -> None:
    _group()
    if nbkit.rank() == 1:
        _about_to_die(stamp)
        os._exit(3)
    _wait_for_peers()


def exits_with_zero(stamp: str) -> None:
    _group()
    if nbkit.rank() == 1:
        _about_to_die(stamp)
        os._exit(0)
    _wait_for_peers()


def raises_keyboard_interrupt(stamp: str) -> None:
    _group()
    if nbkit.rank() == 1:
        _about_to_die(stamp)
        raise KeyboardInterrupt
    _wait_for_peers()


def interrupts_itself(stamp: str) -> None:
    _group()
    if nbkit.rank() == 1:
        _about_to_die(stamp)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    _wait_for_peers()


def segfaults(stamp: str) -> None:
    _group()
    if nbkit.rank() == 1:
        _about_to_die(stamp)
        ctypes.string_at(0)  # reads address 0
    _wait_for_peers()


def _killed_mid_all_reduce(stamp: str, victim: int) -> None:
    import torch.distributed as dist

    _group()
    t = torch.ones(1 << 16)
    for step in range(10_000):
        if step == 3 and nbkit.rank() == victim:
            _about_to_die(stamp)
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does
        dist.all_reduce(t)


def rank0_killed_mid_all_reduce(stamp: str) -> None:
    _killed_mid_all_reduce(stamp, 0)


def rank1_killed_mid_all_reduce(stamp: str) -> None:
    _killed_mid_all_reduce(stamp, 1)


def only_rank_exits_with_zero(stamp: str) -> None:
    _about_to_die(stamp)
    os._exit(0)


def only_rank_interrupts_itself(stamp: str) -> None:
    _about_to_die(stamp)
    raise KeyboardInterrupt


# A rank that exits with code 0: torch elastic takes that for success and collects the status at
# once; where it does so before nbkit looks, the code is unknown and the message says less.
EXIT_0 = ("rank {} exited with code 0", "rank {} ended without returning")

# (function, gpus, timeout, the failing rank, what the message leads with, what it must hold)
DEATHS = [
    (raises, 2, None, 1, "rank 1 failed", "ValueError: batch 7 has no labels"),
    (exits_with_code, 2, None, 1, "rank 1 exited with code 3", "without returning"),
    (exits_with_zero, 2, None, 1, EXIT_0, "os._exit()"),
    (raises_keyboard_interrupt, 2, None, 1, "rank 1 failed", "KeyboardInterrupt"),
    (interrupts_itself, 2, None, 1, "rank 1 failed", "KeyboardInterrupt"),
    (segfaults, 2, None, 1, "rank 1 died from signal SIGSEGV", "crash in native code"),
    (rank0_killed_mid_all_reduce, 2, None, 0, "rank 0 died from signal SIGKILL", "out of CPU memory"),
    (rank1_killed_mid_all_reduce, 2, None, 1, "rank 1 died from signal SIGKILL", "out of CPU memory"),
    (only_rank_exits_with_zero, 1, None, 0, EXIT_0, "os._exit()"),
    (only_rank_exits_with_zero, 1, 30, 0, EXIT_0, "os._exit()"),
    (only_rank_interrupts_itself, 1, 30, 0, "rank 0 failed", "KeyboardInterrupt"),
]


@pytest.mark.parametrize(
    ("fn", "gpus", "timeout", "rank", "lead", "detail"),
    DEATHS,
    ids=[f"{case[0].__name__}-gpus{case[1]}-timeout{case[2]}" for case in DEATHS],
)
def test_a_rank_that_ends_without_returning_is_named_at_once(
    tmp_path, leftovers, fn, gpus, timeout, rank, lead, detail
):
    stamp = tmp_path / "died_at"
    with failed_within(START_S + DEATH_TO_ERROR_S), pytest.raises(nbkit.LaunchError) as caught:
        nbkit.launch(fn, str(stamp), gpus=gpus, timeout=timeout)
    noticed = time.time()
    message = str(caught.value)
    leads = (lead,) if isinstance(lead, str) else tuple(phrasing.format(rank) for phrasing in lead)
    assert message.startswith(leads), message
    assert detail in message
    assert list(caught.value.failures) == [rank], message  # the cause only, not the ranks stopped after it
    assert not caught.value.timed_out
    assert noticed - float(stamp.read_text()) < DEATH_TO_ERROR_S
    # Released by the launch itself, before anything collects garbage (automatic collection is off).
    assert not Snapshot.take().grown_since(leftovers)
    assert_reruns(gpus)


def hangs_in_a_collective() -> None:
    _group()
    if nbkit.rank() == 0:
        _wait_for_peers()
    time.sleep(120)


def hangs() -> None:
    time.sleep(120)


@pytest.mark.parametrize(("fn", "gpus"), [(hangs_in_a_collective, 2), (hangs, 1)])
def test_a_hung_run_stops_at_its_timeout_for_any_number_of_ranks(leftovers, fn, gpus):
    start = time.monotonic()
    with failed_within(3 + 5), pytest.raises(nbkit.LaunchError) as caught:
        nbkit.launch(fn, gpus=gpus, timeout=3)
    assert time.monotonic() - start >= 3
    assert caught.value.timed_out
    assert str(caught.value).startswith("The launch did not finish within the timeout (3 s)")
    assert not Snapshot.take().grown_since(leftovers)
    assert_reruns(gpus)


def _sleep_then_answer() -> int:
    time.sleep(1.5)
    return 7


def _launch_while(call: Callable[[], None], every_s: float) -> None:
    """Launch _sleep_then_answer on 2 ranks while another thread of this process calls `call` every `every_s`."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            call()
            time.sleep(every_s)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        assert nbkit.launch(_sleep_then_answer, gpus=2) == 7
    finally:
        stop.set()
        thread.join()


def test_output_of_other_notebook_threads_is_kept_during_a_launch(capfd):
    ticks = itertools.count()
    _launch_while(lambda: print(f"tick {next(ticks)}", flush=True), 0.05)
    out = capfd.readouterr().out
    assert out.count("tick ") >= 10  # the launch ran for >= 1.5 s: a tick every 0.05 s got through
    assert "Launching training" not in out  # the launcher's own banner is still dropped


def test_the_stream_a_launch_put_on_sys_stdout_outlives_the_launch():
    # print() in another thread holds sys.stdout without a reference (CPython issue 130163): a stream freed as the
    # launch puts the notebook's back could be written through after its memory was gone (a rare crash in gc).
    notebook_stdout, seen = sys.stdout, []

    def watch() -> None:
        stream = sys.stdout
        if stream is not notebook_stdout and not seen:
            seen.append(weakref.ref(stream))

    _launch_while(watch, 0.01)
    gc.collect()
    assert sys.stdout is notebook_stdout
    assert seen, "the watcher never saw the launch's stream on sys.stdout"
    assert seen[0]() is not None, "the launch's stream was freed as soon as the launch ended"


def _fails_the_first_times(counter_dir: str, failures: int) -> str:
    import torch.distributed as dist

    path = Path(counter_dir, f"rank{nbkit.rank()}")
    attempt = int(path.read_text()) if path.exists() else 0
    path.write_text(str(attempt + 1))
    _group()
    dist.barrier()  # every rank has counted this attempt before any fails
    if attempt < failures:
        raise RuntimeError(f"flaky failure on attempt {attempt}")
    return f"succeeded on attempt {attempt}"


def test_accelerates_fault_tolerant_case_is_a_retry_around_launch(tmp_path):
    # accelerate's test_fault_tolerant passes max_restarts to notebook_launcher; nbkit has no
    # max_restarts (see nbkit.launch's docstring): a retry in plain sight does the same.
    counter = str(tmp_path)
    errors = []
    result = None
    for _ in range(3):
        try:
            result = nbkit.launch(_fails_the_first_times, counter, 2, gpus=2)
            break
        except nbkit.LaunchError as exc:
            errors.append(exc)
    assert result == "succeeded on attempt 2"
    assert len(errors) == 2
    assert all("RuntimeError: flaky failure on attempt" in str(e) for e in errors)


def test_an_interrupt_stops_every_rank_and_the_process_stays_usable(tmp_path, leftovers):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "interrupt.py"
    script.write_text(
        "import os, sys, time\nfrom pathlib import Path\nimport nbkit\n"
        "def hang():\n    import torch.distributed as dist\n    dist.init_process_group('gloo')\n"
        f"    Path({str(pids)!r}, str(os.getpid())).touch()\n    time.sleep(120)\n"
        "try:\n    nbkit.launch(hang, gpus=2)\nexcept KeyboardInterrupt:\n"
        "    print('interrupted at', time.time(), flush=True)\n    print('again', nbkit.launch(lambda: 42, gpus=2))\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + START_S
        while len(list(pids.iterdir())) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
            time.sleep(0.05)
        ranks = [int(p.name) for p in pids.iterdir()]
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert "interrupted at " in out, out
    assert float(out.split("interrupted at ")[1].split()[0]) - sent < 5
    assert "again 42" in out, out
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)


_PEER_GOES_AWAY = """
import os, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    os._exit(0)
try:
    dist.barrier()
except RuntimeError as exc:
    print(str(exc).splitlines()[0])
"""


def test_a_collective_that_lost_its_peer_is_known_for_a_symptom(tmp_path):
    # What this torch's gloo says when a peer process ends mid-collective must be one that
    # RankError.lost_a_peer knows: a launch whose rank died then names that rank, not the survivor
    # whose "Connection closed by peer" reached the notebook first (seen in CI on a loaded machine).
    # Plain processes: in nbkit's ranks the teardown group keeps destroyed groups open.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _PEER_GOES_AWAY], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    message = ranks[0].communicate(timeout=60)[0].strip()
    ranks[1].wait(timeout=60)
    assert message, "rank 0's barrier did not fail when its peer ended"
    survivor = RankError(rank=0, type="RuntimeError", message=message, traceback="", time=time.time())
    assert survivor.lost_a_peer, message
