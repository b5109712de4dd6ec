"""Faults seen from a real Jupyter kernel (jupyter_client, as nbclient and the notebook front ends
drive it): an interrupt during a %%ddp cell in fork and spawn mode, the kernel killed mid-cell, a
taken port and a bad MASTER_PORT in the kernel's environment. Each time the cell ends with a clear
error within seconds, the ranks are gone, nothing is left in the temporary directory, and the
next %%ddp cell works.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultkit import Kernel

_NEXT_CELL = "%%ddp --gpus 2\nimport nbkit\n40 + nbkit.rank() + 2"
# The ranks write their pids, then wait in a collective for a peer that never comes.
_HANGING_CELL = (
    "import os, time, torch.distributed as dist\nfrom pathlib import Path\n"
    "dist.init_process_group('gloo')\n"
    "Path(PIDS, str(os.getpid())).touch()\n"
    "if dist.get_rank() == 0:\n    dist.barrier()\ntime.sleep(300)"
)


# nbkit runs in the kernels, not here: this process's own descriptors and threads are
# jupyter_client's (ZeroMQ's epoll, eventfds and socket pairs, created lazily) and say nothing about
# nbkit. Its children (the kernels, reaped), listening ports and temporary files are still checked.
pytestmark = [pytest.mark.usefixtures("leftovers"), pytest.mark.leftovers_ignore("descriptors", "threads")]


@pytest.fixture
def fresh_kernel(kernel_name: str, tmp_path: Path) -> Iterator[Kernel]:
    """A kernel of the case's own (not the live-set modules' shared `kernel`): a fault may leave it unusable."""
    with Kernel(kernel_name, tmp_path) as k:
        yield k


def _wait_for_pids(pids: Path, count: int = 2, timeout: float = 90) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(list(pids.iterdir())) < count:
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    return [int(p.name) for p in pids.iterdir()]


def _gone(pids: list[int], timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("mode", ["", " --spawn"], ids=["fork", "spawn"])
def test_an_interrupt_stops_the_cell_and_every_rank_and_the_next_cell_runs(fresh_kernel, tmp_path, mode):
    pids = tmp_path / "pids"
    pids.mkdir()
    assert fresh_kernel.run(f"%load_ext nbkit\nPIDS = {str(pids)!r}")["error"] is None
    msg_id = fresh_kernel.start(f"%%ddp --gpus 2{mode}\n{_HANGING_CELL}")
    ranks = _wait_for_pids(pids)
    sent = time.monotonic()
    fresh_kernel.interrupt()
    out = fresh_kernel.wait(msg_id, timeout=60)
    assert time.monotonic() - sent < 5
    assert out["error"] is not None and out["error"].ename == "KeyboardInterrupt"
    assert out["error"].traceback == "KeyboardInterrupt", "one line under nbkit's, not a traceback"
    assert "nbkit: interrupted; stopped ranks 0, 1." in out["stderr"]
    assert "death signal" not in out["stderr"] + out["stdout"]  # torch elastic's own log line
    assert _gone(ranks)
    assert fresh_kernel.run(_NEXT_CELL)["result"] == "42"


@pytest.mark.parametrize("mode", ["", " --spawn"], ids=["fork", "spawn"])
def test_a_kernel_killed_mid_cell_takes_its_ranks_and_leaves_no_files(kernel_name, tmp_path, mode):
    pids = tmp_path / "pids"
    pids.mkdir()
    kernel = Kernel(kernel_name, tmp_path)
    try:
        kernel.run(f"%load_ext nbkit\nPIDS = {str(pids)!r}\nSECRET = 'hf_not_on_disk'")
        # SECRET is a value the cell uses: spawn mode sends it to the ranks
        kernel.start(f"%%ddp --gpus 2{mode}\nassert SECRET\n{_HANGING_CELL}")
        ranks = _wait_for_pids(pids)
        os.kill(kernel.pid, signal.SIGKILL)
        assert _gone(ranks), "ranks outlived their kernel"
    finally:
        kernel.close()
    # the leftovers fixture checks the temporary directory; a new kernel works at once
    again = Kernel(kernel_name, tmp_path)
    try:
        assert again.run("%load_ext nbkit")["error"] is None
        assert again.run(_NEXT_CELL)["result"] == "42"
    finally:
        again.close()


@pytest.mark.parametrize(
    "env", [{"MASTER_PORT": "29500"}, {"MASTER_PORT": "not-a-port"}], ids=["port-taken", "bad-master-port"]
)
def test_the_launch_uses_its_own_port_whatever_the_environment_says(kernel_name, tmp_path, env):
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        taken.bind(("127.0.0.1", 29500))  # accelerate's default port, and MASTER_PORT's usual value
        taken.listen()
    except OSError:
        pass  # taken already, by someone else: the case holds all the same
    kernel = Kernel(kernel_name, tmp_path, env)
    try:
        assert kernel.run("%load_ext nbkit")["error"] is None
        assert kernel.run(_NEXT_CELL)["result"] == "42"
        out = kernel.run("%%ddp --gpus 2\nimport os\nos.environ['MASTER_PORT']")
        assert out["error"] is None and out["result"] not in ("'29500'", "'not-a-port'")
    finally:
        kernel.close()
        taken.close()


def test_a_spawn_mode_cell_that_does_not_parse_is_one_short_message(fresh_kernel):
    assert fresh_kernel.run("%load_ext nbkit")["error"] is None
    out = fresh_kernel.run("%%ddp --gpus 2 --spawn\nx = 1\ny = (x,\n")
    error = out["error"]
    assert error is not None and error.ename == "CellSyntaxError"
    shown = error.traceback
    assert "line 2 of the cell does not parse: '(' was never closed" in shown and "y = (x," in shown
    assert len(shown.splitlines()) <= 4 and "nbkit/" not in shown  # none of nbkit's frames
    assert "spawn mode" not in out["stdout"]  # refused before anything started
    assert fresh_kernel.run(_NEXT_CELL)["result"] == "42"


def test_a_fork_mode_cell_that_does_not_parse_is_one_short_message_and_forks_nothing(fresh_kernel):
    assert fresh_kernel.run("%load_ext nbkit")["error"] is None
    out = fresh_kernel.run("%%ddp --gpus 2\nimport os\nprint(os.getpid())\nif True\n    pass")
    error = out["error"]
    assert error is not None and error.ename == "CellSyntaxError", out  # not a LaunchError from 2 forks
    shown = error.traceback
    assert "line 3 of the cell does not parse: expected ':'" in shown and "if True" in shown, shown
    assert len(shown.splitlines()) <= 4 and "nbkit/" not in shown  # none of nbkit's frames
    assert out["stdout"] == "" and "rank" not in out["stderr"]  # refused before any process started
    assert fresh_kernel.run(_NEXT_CELL)["result"] == "42"
