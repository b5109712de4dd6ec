"""Fault matrix: export and checkpoints.

Export's bad inputs go through `%nbkit export` in a real kernel (nbclient), the way a user meets
them: each cell fails within seconds with one message naming what happened and what to do, writes
nothing, leaves the notebook as it was, and the next cell (the corrected command) works at once.
Checkpoints: a process copying a previous session's checkpoint is SIGKILLed half-way; the partial
copy never counts, and the next resume copies it whole and leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from nbkit.training.checkpoints import _mark_complete, is_complete, resume_point

TRAIN = "%%ddp --gpus $procs --out total\nimport nbkit\nnbkit.rank() + steps"


def _source_notebook(path: Path, train: str = TRAIN) -> Path:
    nb = new_notebook()
    nb.cells = [
        new_code_cell("procs = 2\nsteps = 3", metadata={"tags": ["parameters"]}),
        new_code_cell(train, metadata={"tags": ["train"]}),
    ]
    nbformat.write(nb, path)
    return path


def _cell_seconds(cell: nbformat.NotebookNode) -> float:
    """How long the kernel took to run the cell (nbclient's recorded timing)."""
    timing = cell.metadata["execution"]
    start, end = (
        datetime.fromisoformat(timing[k].replace("Z", "+00:00")) for k in ("iopub.execute_input", "shell.execute_reply")
    )
    return (end - start).total_seconds()


@pytest.mark.version_independent
def test_bad_exports_fail_fast_with_one_message_and_the_corrected_command_works_at_once(tmp_path, kernel_name):
    source = _source_notebook(tmp_path / "experiment.ipynb")
    unparameterised = _source_notebook(tmp_path / "other.ipynb", TRAIN.replace("$procs", "$n_gpus"))
    a100 = _source_notebook(tmp_path / "a100.ipynb", TRAIN.replace("--out", "--emulate A100 --out"))
    original = source.read_bytes()
    script = tmp_path / "train.py"
    notes = tmp_path / "notes.py"
    notes.write_text("# the user's own file\n")
    (tmp_path / "scripts").mkdir()
    cases = {
        "over the notebook": (
            f"%nbkit export {source} train -o {source}",
            f"{source} is the notebook being exported: writing the script there would replace the notebook. "
            "Give the script its own name, e.g. -o train.py.",
        ),
        "over the notebook, by another path": (
            f"%nbkit export {source} train -o {tmp_path}/./experiment.ipynb",
            "is the notebook being exported",
        ),
        "missing notebook": (
            f"%nbkit export {tmp_path}/missing.ipynb train -o {script}",
            f"No notebook at {tmp_path}/missing.ipynb: save the notebook first and give its path.",
        ),
        "unknown cell": (
            f"%nbkit export {source} training -o {script}",
            "No cell with the tag or id 'training'. %%ddp cells are at indices [1] (0 = first cell); "
            "tags in this notebook: parameters, train.",
        ),
        "not a parameter": (
            f"%nbkit export {unparameterised} train -o {script}",
            "Cell 1 of other.ipynb: the %%ddp line uses 'n_gpus', which is not a parameter of the notebook.",
        ),
        "over a file nbkit did not write": (
            f"%nbkit export {source} train -o {notes}",
            f"{notes} exists and nbkit did not export it: writing the script would replace it. Give another name, "
            "or pass --force (force=True) to replace it.",
        ),
        "a folder": (
            f"%nbkit export {source} train -o {tmp_path}/scripts",
            f"{tmp_path}/scripts is a folder: give the script's file name, e.g. -o {tmp_path}/scripts/train.py.",
        ),
        "a cell that is not %%ddp": (
            f"%nbkit export {source} 0 -o {script}",
            "Cell 0 of experiment.ipynb is not a %%ddp cell: export writes a %%ddp cell as a training script that "
            "runs it on every rank. Give a %%ddp cell (at indices [1]), or put %%ddp at the top of this one.",
        ),
        "a GPU profile nbkit does not have": (
            f"%nbkit export {a100} train -o {script}",
            "Cell 1 of a100.ipynb: emulate must name a GPU profile, one of 'T4'",
        ),
    }
    nb = new_notebook()
    nb.cells = [new_code_cell("%load_ext nbkit")]
    nb.cells += [new_code_cell(line) for line, _ in cases.values()]
    nb.cells += [
        new_code_cell(f"%nbkit export {source} train -o {notes} --force"),
        new_code_cell(f"%nbkit export {source} train -o {script}"),
        new_code_cell("6 * 7"),
    ]
    status: dict[int, str] = {}
    NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=120,
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
        on_cell_executed=lambda cell, cell_index, execute_reply: status.update(
            {cell_index: execute_reply["content"]["status"]}
        ),
    ).execute()

    for index, (name, (_, message)) in enumerate(cases.items(), start=1):
        cell = nb.cells[index]
        # The cell fails (papermill stops there), showing IPython's one-line usage error and no traceback.
        assert status[index] == "error", name
        shown = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        assert shown.startswith("UsageError: ") and message in shown and shown.count("\n") == 1, f"{name}: {shown}"
        assert _cell_seconds(cell) < 10, name
    assert source.read_bytes() == original  # never written over
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a100.ipynb",
        "experiment.ipynb",
        "notes.py",
        "other.ipynb",
        "scripts",
        "train.py",
    ]
    assert list((tmp_path / "scripts").iterdir()) == []
    assert status[len(nb.cells) - 3] == "ok" and notes.read_text().startswith("#!/usr/bin/env python")  # --force
    # The corrected command right after the failures: the script, with $procs from the parameters.
    exported, usable = nb.cells[-2], nb.cells[-1]
    assert status[len(nb.cells) - 2] == "ok" and f"nbkit: wrote {script}" in exported.outputs[0]["text"]
    assert "total = nbkit.launch(joined(ddp_cell), gpus=2, quiet=True)" in script.read_text()
    assert usable.outputs[0]["data"]["text/plain"] == "42"  # the kernel is still usable


# ----------------------------------------------------------------------------------------------
# A copy of a previous session's checkpoint, killed half-way.


def _big_checkpoint(root: Path, step: int, files: int) -> Path:
    path = root / f"checkpoint-{step}"
    (path / "shards").mkdir(parents=True)
    for i in range(files):
        (path / "shards" / f"{i:05d}.bin").write_bytes(os.urandom(4096))
    (path / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    _mark_complete(path, step)
    return path


COPY = "import sys\nfrom nbkit.checkpoints import resume_point\nresume_point(sys.argv[1], previous=sys.argv[2])\n"


@pytest.mark.version_independent
def test_a_copy_killed_half_way_never_counts_and_the_next_resume_copies_it_whole(tmp_path, capsys):
    previous = tmp_path / "input" / "run"
    _big_checkpoint(previous, 40, files=1200)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", COPY, str(out), str(previous)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        deadline = time.monotonic() + 120
        partial: list[Path] = []
        while time.monotonic() < deadline and proc.poll() is None:
            partial = list(out.glob(".nbkit-partial-*/shards/0010*.bin"))  # some files copied, not all
            if partial:
                break
            time.sleep(0.001)
        assert partial, "the copy ended before it could be killed half-way: give it more files"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    left = list(out.iterdir())
    assert [p.name.startswith(".nbkit-partial-") for p in left] == [True]  # the cut-off copy, nothing else
    assert len(list(left[0].rglob("*.bin"))) < 1200
    assert not list(out.glob("checkpoint-*"))  # neither nbkit nor transformers' glob takes it for a checkpoint
    assert resume_point(out) is None

    started = time.monotonic()
    assert resume_point(out, previous=previous) == str(out / "checkpoint-40")
    assert time.monotonic() - started < 60
    assert "copied from" in capsys.readouterr().out
    assert is_complete(out / "checkpoint-40")
    assert [p.name for p in out.iterdir()] == ["checkpoint-40"]  # the cut-off copy is gone
