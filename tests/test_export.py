"""%nbkit export / nbkit.export.export_script: the written script carries what the cell needs and
really runs under torchrun (2 gloo processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from nbkit.export import export_script

TRAIN_CELL = '''%%ddp --gpus 2 --env TEST_VAR=7 --out total
import nbkit
dist.init_process_group("gloo")
t = torch.tensor([contribution(nbkit.rank())])
for _ in range(steps):
    dist.all_reduce(t)
note = """two
lines"""
if nbkit.rank() == 0:
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({"sum": t.item(), "env": os.environ["TEST_VAR"], "world": dist.get_world_size(),
                   "note": note, "flag": os.environ["FROM_NOTEBOOK"]}, f)
dist.destroy_process_group()
t.item()
'''


def _notebook(path: Path, out_dir: Path) -> Path:
    nb = new_notebook()
    nb.cells = [
        new_code_cell("%load_ext nbkit\n!nvidia-smi\nimport os, json\nimport torch\nimport torch.distributed as dist"),
        new_code_cell(f"steps = 3\nscale = 2.0\nout_dir = {str(out_dir)!r}", metadata={"tags": ["parameters"]}),
        new_markdown_cell("## helpers"),
        new_code_cell("def contribution(rank):\n    return (rank + 1) * scale\n\nunused = 42\nprint('shown only')"),
        new_code_cell("%%bash\necho notebook only"),
        new_code_cell("torch.manual_seed(0)\nos.environ['FROM_NOTEBOOK'] = 'yes'\nscale = scale * 1.5"),
        new_code_cell(TRAIN_CELL, metadata={"tags": ["train"]}),
    ]
    nb_path = path / "experiment.ipynb"
    nbformat.write(nb, nb_path)
    return nb_path


@pytest.fixture
def exported(tmp_path: Path) -> tuple[Path, Path]:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    script = export_script(_notebook(tmp_path, out_dir), "train", tmp_path / "train.py")
    return script, out_dir


def test_the_script_holds_what_the_cell_needs_and_nothing_else(exported):
    script, _ = exported
    text = script.read_text()
    compile(text, str(script), "exec")
    assert "os.environ.setdefault('TEST_VAR', '7')" in text
    assert "steps = 3" in text and "def contribution(rank):" in text and "scale = scale * 1.5" in text
    assert "torch.manual_seed(0)" in text and "os.environ['FROM_NOTEBOOK'] = 'yes'" in text
    assert "unused = 42" not in text and "print('shown only')" not in text
    assert "nvidia-smi" not in text and "load_ext" not in text
    assert "cell 4 (%%bash)" in text  # skipped cells are listed
    assert '    note = """two\nlines"""' in text  # the string's value is not indented
    assert "total = nbkit.launch(ddp_cell, gpus=2, quiet=True)" in text


def test_runs_under_torchrun_with_two_gloo_processes(exported):
    script, out_dir = exported
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script.name],
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out_dir / "result.json").read_text())
    # ranks contribute 3 and 6; three all-reduces over 2 ranks multiply the sum by 4
    assert result == {"sum": 36.0, "env": "7", "world": 2, "note": "two\nlines", "flag": "yes"}
    assert proc.stdout.strip().splitlines()[-1] == "36.0"  # rank 0 prints the value, once


def test_an_unknown_cell_lists_the_ddp_cells_and_tags(tmp_path):
    nb_path = _notebook(tmp_path, tmp_path)
    with pytest.raises(ValueError, match=r"%%ddp cells are at indices \[6\].*tags in this notebook: parameters, train"):
        export_script(nb_path, "training", tmp_path / "x.py")
    with pytest.raises(ValueError, match="there is no cell 12"):
        export_script(nb_path, 12, tmp_path / "x.py")
    with pytest.raises(FileNotFoundError, match="save the notebook first"):
        export_script(tmp_path / "missing.ipynb", "train", tmp_path / "x.py")
