"""Spawn mode (nbkit.launching.spawn.run_source, what %%ddp runs when the kernel cannot fork): the same
faults end the same way as in fork mode, through the launcher process in between, and no file
holds the cell's values at any time.

Each case starts a fresh Python process that imports torch: seconds each on this machine.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

import nbkit
from nbkit.launching import spawn
from nbkit.launching.rank_options import RankOptions

pytestmark = pytest.mark.usefixtures("leftovers")

# Starting the launcher process (a fresh interpreter importing torch) on the loaded machine.
START_S = 40.0
DEATH_TO_ERROR_S = 4.0

_GROUP = "import os, signal, time, nbkit, torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"


def _run(source: str, namespace: dict | None = None, **options) -> object:
    return spawn.run_source(source, namespace or {}, RankOptions(gpus=2, dashboard=False, **options))


def _rerun() -> None:
    assert _run("nbkit.rank() + 40", {"nbkit": nbkit}) == 40


@pytest.mark.parametrize(
    ("cell", "lead", "detail"),
    [
        (
            "if nbkit.rank() == 1:\n    raise ValueError('batch 7 has no labels')\ndist.barrier()",
            "rank 1 failed",
            "ValueError: batch 7 has no labels",
        ),
        (
            "if nbkit.rank() == 1:\n    os._exit(0)\ndist.barrier()",
            # the code is unknown where torch elastic collected the status before nbkit looked
            ("rank 1 exited with code 0", "rank 1 ended without returning"),
            "os._exit()",
        ),
        (
            "t = torch.ones(1 << 16)\nfor step in range(10_000):\n"
            "    if step == 3 and nbkit.rank() == 1:\n        os.kill(os.getpid(), signal.SIGKILL)\n"
            "    dist.all_reduce(t)",
            "rank 1 died from signal SIGKILL",
            "out of CPU memory",
        ),
    ],
    ids=["raises", "exits-with-zero", "sigkill-mid-all-reduce"],
)
def test_a_failing_rank_is_named_through_the_launcher_process(cell, lead, detail):
    start = time.monotonic()
    with pytest.raises(nbkit.LaunchError) as caught:
        _run(_GROUP + cell)
    assert time.monotonic() - start < START_S + DEATH_TO_ERROR_S
    message = str(caught.value)
    assert message.startswith(lead), message
    assert detail in message
    assert list(caught.value.failures) == [1]
    _rerun()


def test_a_hung_cell_stops_at_its_timeout():
    start = time.monotonic()
    with pytest.raises(nbkit.LaunchError) as caught:
        _run(_GROUP + "if nbkit.rank() == 0:\n    dist.barrier()\ntime.sleep(120)", timeout=3)
    assert 3 <= time.monotonic() - start < START_S + 3 + 5
    assert caught.value.timed_out and "within the timeout (3 s)" in str(caught.value)


def test_notebook_functions_lambdas_closures_and_classes_come_along_by_value():
    namespace: dict = {}
    exec(
        "class Box:\n    def __init__(self, v):\n        self.v = v\n"
        "def make(k):\n    return lambda x: x + k + base\n"
        "base = 100\nadd = make(3)\nsquare = lambda x: x * x\nbox = Box(5)\n",
        namespace,
    )
    for name in ("Box", "make", "square"):
        namespace[name].__module__ = "__main__"
    namespace["add"].__module__ = "__main__"
    value = _run("import nbkit\nbase = 1000\n[add(nbkit.rank()), square(box.v), type(box).__name__]", namespace)
    # add reads `base` from the rank's namespace, which the cell changed, as in a notebook
    assert value == [1003, 25, "Box"]


def test_the_launcher_process_killed_mid_cell_ends_the_cell_and_its_ranks(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    cell = (
        "import os, time, nbkit\nfrom pathlib import Path\n"
        f"Path({str(pids)!r}, f'{{os.getppid()}}-{{os.getpid()}}').touch()\ntime.sleep(120)"
    )
    killed = {}

    def kill_the_launcher() -> None:
        deadline = time.monotonic() + START_S
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        launcher = int(next(pids.iterdir()).name.split("-")[0])
        killed["at"] = time.monotonic()
        os.kill(launcher, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_launcher)
    killer.start()
    try:
        with pytest.raises(nbkit.LaunchError) as caught:
            _run(cell)
    finally:
        killer.join()
    assert time.monotonic() - killed["at"] < DEATH_TO_ERROR_S
    assert "launcher process (spawn mode) died from signal SIGKILL" in str(caught.value)
    ranks = [int(p.name.split("-")[1]) for p in pids.iterdir()]
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)  # the ranks died with it
    _rerun()
