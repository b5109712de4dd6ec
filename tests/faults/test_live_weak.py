"""A live set's weaker spots, each in a real Jupyter kernel with real engines (1 or 2 gloo CPU ranks): IPython-only
syntax in a %%ddp cell, a cell that swallows the interrupt, a notebook object whose module only the notebook can
import, start/stop cycles (the notebook's descriptors and threads), and a killed kernel's files.
"""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
from faultkit import MARGIN_S, Kernel, ended_the_set, fresh_set

pytestmark = [pytest.mark.slow, pytest.mark.version_independent]


@pytest.mark.parametrize(
    ("line", "shown"),
    [("%ddp stop", "%ddp stop"), ("!echo hi", "!echo hi"), ("shell = get_ipython()", "shell = get_ipython()")],
    ids=["magic", "shell-command", "get_ipython"],
)
def test_ipython_syntax_in_a_ddp_cell_says_it_runs_in_the_notebook(kernel, line, shown):
    procs = fresh_set(kernel)
    out = kernel.run(f"%%ddp\nx = 0\n{line}")
    assert out["error"] is not None and out["error"][0] == "LiveError", out
    text = out["error"][2]
    assert "line 2 of the cell is IPython syntax" in text and "runs in the notebook, not on the ranks" in text, text
    assert f"\n    {shown}\n" in text, text
    assert "NameError" not in text
    # Nothing ran (not even line 1), and the set is the same.
    assert kernel.run("%%ddp\nx")["result"] == "41"
    assert [p.pid for p in procs if not p.is_running()] == []


def test_a_cell_that_swallows_the_interrupt_is_named_as_the_cause(kernel):
    procs = fresh_set(kernel)
    cell = (
        "%%ddp\nprint('running', flush=True)\nwhile True:\n    try:\n        time.sleep(0.05)\n"
        "    except KeyboardInterrupt:\n        pass"
    )
    out = kernel.run(cell, interrupt_on="running")
    text = ended_the_set(
        out,
        procs,
        "rank(s) 0, 1 got the interrupt but went on running: the cell's code caught the KeyboardInterrupt",
        within_s=MARGIN_S,
    )
    assert "collective" not in text, text


def test_an_object_of_a_module_only_the_notebook_imports_names_the_variable_and_the_module(kernel, tmp_path):
    procs = fresh_set(kernel)
    folder = tmp_path / "notebook_only"
    folder.mkdir()
    (folder / "notebook_only_mod.py").write_text("class Thing:\n    value = 7\n")
    made = kernel.run(
        f"import sys\nsys.path.insert(0, {str(folder)!r})\nimport notebook_only_mod\nthing = notebook_only_mod.Thing()"
    )
    assert made["error"] is None, made
    out = kernel.run("%%ddp\nthing.value")
    assert out["error"] is not None and out["error"][0] == "LiveError", out
    text = out["error"][2]
    says = "the notebook's 'thing' cannot be rebuilt on rank 0: it needs the module 'notebook_only_mod'"
    assert says in text and "the live set is still running" in text, text
    assert "cloudpickle" not in text and "rank_side.py" not in text, text  # not nbkit's own traceback
    # The set and its names stay, and with the folder on the ranks' path the object arrives.
    assert kernel.run("%%ddp\nx")["result"] == "41"
    assert kernel.run(f"%%ddp\nimport sys\nsys.path.insert(0, {str(folder)!r})")["error"] is None
    fixed = kernel.run("%%ddp\nthing.value")
    assert fixed["error"] is None and fixed["result"] == "7", fixed
    assert [p.pid for p in procs if not p.is_running()] == []
    kernel.run("%ddp stop")


_SNAPSHOT = """
import os, threading
def _nbkit_snapshot():
    return len(os.listdir("/proc/self/fd")), sorted(t.name for t in threading.enumerate())
"""


def test_ten_start_stop_cycles_leave_descriptors_and_threads_flat(kernel):
    assert kernel.run("if nbkit.live.current() is not None:\n    nbkit.live.current().stop()")["error"] is None
    assert kernel.run(_SNAPSHOT)["error"] is None

    def cycle() -> None:
        assert kernel.run("%ddp start --gpus 1")["error"] is None
        assert kernel.run("%%ddp\n1 + 1")["result"] == "2"
        assert kernel.run("%ddp stop")["error"] is None

    def snapshot() -> tuple[int, list[str]]:
        return eval(kernel.run("_nbkit_snapshot()")["result"])

    cycle()  # the first start imports ipyparallel and torch, whose threads and files stay for good
    before = snapshot()
    for _ in range(10):
        cycle()
    deadline = time.monotonic() + 10  # the controller's reaping thread trails its end by a moment
    while (after := snapshot()) != before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert after[0] <= before[0], (before, after)
    assert after[1] == before[1], (before, after)


def test_a_killed_kernels_files_are_gone_once_the_next_set_starts(kernel_name, tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the kernels' temporary directory, which nothing else uses
    first = Kernel(kernel_name, str(tmp_path))
    try:
        assert first.run("%load_ext nbkit\n%ddp start --gpus 1")["error"] is None
        procs = first.descendants()
        left = glob.glob(str(tmp / "nbkit-live-*"))
        assert len(left) == 1, left
        os.kill(first.pid, signal.SIGKILL)  # no clean-up runs
        deadline = time.monotonic() + 10
        while any(p.is_running() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.isdir(left[0])  # what a killed kernel leaves, until:
    finally:
        first.close()
    second = Kernel(kernel_name, str(tmp_path))
    try:
        assert second.run("%load_ext nbkit\n%ddp start --gpus 1")["error"] is None
        assert not os.path.exists(left[0])
        assert len(glob.glob(str(tmp / "nbkit-live-*"))) == 1  # the new set's own
        assert second.run("%ddp stop")["error"] is None
        assert glob.glob(str(tmp / "nbkit-live-*")) == []
    finally:
        second.close()
