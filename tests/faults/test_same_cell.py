"""The same %%ddp cell gives the same result on every path: forked ranks, spawned ranks, a live set,
and the script `%nbkit export` writes, run under torchrun (2 gloo CPU ranks each, real processes).

A cell reads the notebook's bindings first (a name that shadows a builtin included), and finds the
default process group set up whichever path runs it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook
from outside_launcher import TORCHRUN, rank_env

import nbkit
from nbkit.notebook.export import export_script

pytestmark = [pytest.mark.usefixtures("leftovers"), pytest.mark.slow]

# The live set's client keeps pyzmq's process-wide context (its eventfd and epoll descriptors) for
# the next set this process starts: that is this test process's, not a leftover of the case.
LIVE = pytest.param("live", marks=pytest.mark.leftovers_ignore("descriptors"))
PATHS = ["fork", "spawn", LIVE, "export"]
# A cell of torch alone: on a live set and in the exported script under torchrun nothing but torch runs it, so
# those paths are version_independent; fork and spawn launch through accelerate's notebook_launcher, whose
# version differs between the two sets.
TORCH_ONLY_PATHS = [
    "fork",
    "spawn",
    pytest.param("live", marks=[*LIVE.marks, pytest.mark.version_independent]),
    pytest.param("export", marks=pytest.mark.version_independent),
]

# Notebook names that shadow builtins: the cell must read these values, never the builtins.
SHADOWING = {"dir": "outputs", "input": "a prompt"}
SHADOWING_CELL = 'f"{dir}/lora|{input}"'


def _run_on(path: str, tmp_path: Path, setup: str, cell: str) -> str:
    """The value of `cell` run on 2 ranks by `path`, after the notebook ran `setup`, as text (the
    exported script prints it).
    """
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(setup, namespace)
    if path == "export":
        return _exported(tmp_path, setup, cell)
    if path == "live":
        live = nbkit.start(gpus=2)
        try:
            return str(nbkit.run_cell(cell, namespace))
        finally:
            live.stop()
    return str(nbkit.run_cell(cell, namespace, gpus=2, spawn=path == "spawn", dashboard=False))


def _exported(tmp_path: Path, setup: str, cell: str) -> str:
    """What the exported script prints last on rank 0 under torchrun."""
    notebook = new_notebook()
    notebook.cells = [new_code_cell(setup), new_code_cell(f"%%ddp --gpus 2\n{cell}")]
    nbformat.write(notebook, tmp_path / "cells.ipynb")
    script = export_script(tmp_path / "cells.ipynb", 1, tmp_path / "cell.py")
    proc = subprocess.run(
        [*TORCHRUN, script.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=rank_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(params=TORCH_ONLY_PATHS)
def run_on(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[str, str], str]]:
    yield lambda setup, cell: _run_on(request.param, tmp_path, setup, cell)


def test_a_notebook_name_that_shadows_a_builtin_is_the_notebooks_value(run_on):
    setup = "".join(f"{name} = {value!r}\n" for name, value in SHADOWING.items())
    assert run_on(setup, SHADOWING_CELL) == "outputs/lora|a prompt"


def test_a_collective_finds_the_default_process_group(run_on):
    assert run_on("import torch, torch.distributed as dist", "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == "2.0"


@pytest.mark.parametrize("run_on", PATHS, indirect=True)  # its cell uses transformers: every path on both sets
def test_a_cell_that_sets_up_its_own_group_works_on_every_path(run_on):
    cell = (
        "dist.init_process_group('gloo')\nt = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\n"
        "from transformers import TrainingArguments\nargs = TrainingArguments('out', use_cpu=True, report_to=[])\n"
        "(t.item(), args.world_size)"
    )
    assert run_on("import torch, torch.distributed as dist", cell) == "(3.0, 2)"


def test_a_cell_that_asks_for_another_backend_is_told_which_group_it_has(run_on):
    with pytest.raises(Exception, match=r"init_process_group\('nccl'\): this cell runs in the default process group"):
        run_on("import torch.distributed as dist", "dist.init_process_group('nccl')")


def test_a_one_rank_cell_finds_a_group_of_one_as_on_a_live_set_of_one():
    cell = "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), dist.get_world_size())"
    assert nbkit.run_cell(cell, {}, gpus=1, dashboard=False) == (1.0, 1)
