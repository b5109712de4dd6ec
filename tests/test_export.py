"""%nbkit export / nbkit.export.export_script: the written script carries what the cell needs and
really runs under torchrun (2 gloo processes), the %%ddp line's $name / {expr} come from the
notebook's parameters as IPython expands them, `%` and `!` inside strings stay text, the cell's last
expression is returned however its line is written, the notebook is never written over, and the
training cell of every shipped notebook exports to a script that trains under torchrun."""

from __future__ import annotations

import ast
import json
import os
import runpy
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook
from outside_launcher import torchrun

from nbkit import ExportError, NbkitError
from nbkit.notebook.export import export_script

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"

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


@pytest.mark.version_independent
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
    assert "total = nbkit.launch(joined(ddp_cell), gpus=2, quiet=True)" in text


@pytest.mark.version_independent  # torchrun and a cell of torch alone
def test_runs_under_torchrun_with_two_gloo_processes(exported):
    script, out_dir = exported
    proc = torchrun(script, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out_dir / "result.json").read_text())
    # ranks contribute 3 and 6; three all-reduces over 2 ranks multiply the sum by 4
    assert result == {"sum": 36.0, "env": "7", "world": 2, "note": "two\nlines", "flag": "yes"}
    assert proc.stdout.strip().splitlines()[-1] == "36.0"  # rank 0 prints the value, once


@pytest.mark.version_independent
def test_an_unknown_cell_lists_the_ddp_cells_and_tags(tmp_path):
    nb_path = _notebook(tmp_path, tmp_path)
    with pytest.raises(
        ExportError, match=r"%%ddp cells are at indices \[6\].*tags in this notebook: parameters, train"
    ):
        export_script(nb_path, "training", tmp_path / "x.py")
    with pytest.raises(ExportError, match="there is no cell 12"):
        export_script(nb_path, 12, tmp_path / "x.py")
    with pytest.raises(ExportError, match="save the notebook first") as missing:
        export_script(tmp_path / "missing.ipynb", "train", tmp_path / "x.py")
    # One family with the rest of nbkit's errors, and still the ValueError callers caught before.
    assert isinstance(missing.value, NbkitError) and isinstance(missing.value, ValueError)
    assert not (tmp_path / "x.py").exists()


def _one_cell_notebook(path: Path, cell: str, *before: str, parameters: str = "", injected: str = "") -> Path:
    """A notebook: a parameters cell, papermill's injected-parameters cell (when given), the cells
    `before`, and `cell` tagged "train"."""
    nb = new_notebook()
    nb.cells = [new_code_cell(parameters, metadata={"tags": ["parameters"]})]
    if injected:
        nb.cells.append(new_code_cell(injected, metadata={"tags": ["injected-parameters"]}))
    nb.cells += [new_code_cell(source) for source in before]
    nb.cells.append(new_code_cell(cell, metadata={"tags": ["train"]}))
    nb_path = path / "nb.ipynb"
    nbformat.write(nb, nb_path)
    return nb_path


def _launch_line(script: Path) -> str:
    (line,) = [line for line in script.read_text().splitlines() if "nbkit.launch(" in line]
    return line.strip()


@pytest.mark.version_independent
def test_the_ddp_line_is_expanded_from_the_parameters_as_ipython_expands_it(tmp_path):
    from IPython.core.interactiveshell import InteractiveShell

    parameters = "procs = 2\nminutes = 1.5\nlabel = 'run-a'\nname = 'total'"
    injected = "procs = 3  # papermill's values win, as in the kernel"
    line = "--gpus $procs.real --timeout {minutes * 60} --out $name --env LABEL=$label PRICE=$$5 SET={{1,2}}"
    nb_path = _one_cell_notebook(tmp_path, f"%%ddp {line}\n1 + 1", parameters=parameters, injected=injected)
    script = export_script(nb_path, "train", tmp_path / "train.py")

    text = script.read_text()
    assert "total = nbkit.launch(joined(ddp_cell), gpus=3, timeout=90.0, quiet=True)" in text
    assert "os.environ.setdefault('LABEL', 'run-a')" in text
    assert "os.environ.setdefault('PRICE', '$5')" in text  # $$ is a literal $
    assert "os.environ.setdefault('SET', '{1,2}')" in text  # {{ }} are literal braces
    # The same line expanded by IPython itself, in a shell holding the parameters' values.
    shell = InteractiveShell.instance()
    saved = dict(shell.user_ns)
    try:
        exec(parameters + "\n" + injected, shell.user_ns)
        assert shell.var_expand(line, depth=10**6) == (
            "--gpus 3 --timeout 90.0 --out total --env LABEL=run-a PRICE=$5 SET={1,2}"
        )
    finally:
        shell.user_ns.clear()
        shell.user_ns.update(saved)


@pytest.mark.version_independent
def test_a_name_that_is_not_a_parameter_is_named(tmp_path):
    # n_procs exists in the notebook, but in an ordinary cell: the exporter does not run those.
    nb_path = _one_cell_notebook(tmp_path, "%%ddp --gpus $n_procs\n1", "n_procs = 2", parameters="steps = 1")
    with pytest.raises(ExportError, match=r"uses 'n_procs', which is not a parameter.*\(parameters: steps\)"):
        export_script(nb_path, "train", tmp_path / "train.py")
    nb_path = _one_cell_notebook(tmp_path, "%%ddp --timeout {budget * 60}\n1", parameters="steps = 1")
    with pytest.raises(ExportError, match="uses 'budget', which is not a parameter"):
        export_script(nb_path, "train", tmp_path / "train.py")
    nb_path = _one_cell_notebook(tmp_path, "%%ddp --gpus {1 // 0}\n1", parameters="steps = 1")
    with pytest.raises(ExportError, match=r"cannot expand the %%ddp line.*ZeroDivisionError"):
        export_script(nb_path, "train", tmp_path / "train.py")
    nb_path = _one_cell_notebook(tmp_path, "%%ddp --gpus $gpus\n1", parameters="gpus = 'two'")
    with pytest.raises(ExportError, match="Cell 1 of nb.ipynb: .*--gpus: invalid int value: 'two'"):
        export_script(nb_path, "train", tmp_path / "train.py")
    assert not (tmp_path / "train.py").exists()


@pytest.mark.version_independent
def test_a_parameter_left_at_none_means_the_default(tmp_path):
    # The shipped notebooks' `gpus = None  # one per visible GPU` with `%%ddp --gpus $gpus`.
    nb_path = _one_cell_notebook(
        tmp_path, "%%ddp --gpus $gpus --timeout $limit\n1", parameters="gpus = None\nlimit = None"
    )
    script = export_script(nb_path, "train", tmp_path / "train.py")
    assert _launch_line(script) == "result = nbkit.launch(joined(ddp_cell), gpus=None, quiet=True)"
    assert "one process per visible GPU" in script.read_text()


@pytest.mark.version_independent
def test_strategy_and_emulate_reach_the_launch_call_of_the_script(tmp_path):
    # the profile under its own name, as the export checked it
    nb_path = _one_cell_notebook(tmp_path, "%%ddp --gpus 2 --strategy fsdp --emulate t4\n1")
    script = export_script(nb_path, "train", tmp_path / "train.py")
    assert (
        _launch_line(script)
        == "result = nbkit.launch(joined(ddp_cell), gpus=2, quiet=True, strategy='fsdp', emulate='T4')"
    )


@pytest.mark.version_independent
def test_the_notebook_is_never_written_over(tmp_path, monkeypatch):
    nb_path = _notebook(tmp_path, tmp_path)
    original = nb_path.read_bytes()
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.ipynb").symlink_to(nb_path)
    os.link(nb_path, tmp_path / "hard.ipynb")
    monkeypatch.chdir(tmp_path / "sub")
    for out in (
        nb_path,
        "../experiment.ipynb",
        tmp_path / "sub" / ".." / "experiment.ipynb",
        tmp_path / "link.ipynb",
        tmp_path / "hard.ipynb",
    ):
        with pytest.raises(ExportError, match="is the notebook being exported.*Give the script its own name"):
            export_script(nb_path, "train", out)
        assert nb_path.read_bytes() == original
    # Another notebook's name is fine: it is not the input.
    assert export_script(nb_path, "train", tmp_path / "other.ipynb").read_text().startswith("#!/usr/bin/env python")


MAGIC_IN_STRINGS = '''%%ddp --gpus 1
import os
s = "100%\\n!"
t = """
%pip install x
!ls
"""
if os.environ.get("NBKIT_NEVER_SET"):
    %pip install nothing
    !echo never
u = f"""{s}
%done
!{len(t)}"""
x = 1; x + len(s) * 1000 + len(t) * 100 + len(u)
'''


@pytest.mark.version_independent
def test_percent_and_bang_inside_strings_stay_and_the_last_expression_is_returned(tmp_path):
    nb_path = _one_cell_notebook(tmp_path, MAGIC_IN_STRINGS, "%matplotlib inline\n!nvidia-smi")
    script = export_script(nb_path, "train", tmp_path / "train.py")
    text = script.read_text()
    ast.parse(text)
    assert "    pass  # notebook only: %pip install nothing" in text
    assert "    pass  # notebook only: !echo never" in text
    assert "x = 1; return x + len(s)" in text
    assert "matplotlib" not in text and "nvidia-smi" not in text
    # The function runs as the cell would: the strings keep every character.
    ddp_cell = runpy.run_path(str(script))["ddp_cell"]  # not as __main__: nothing launches
    s, t = "100%\n!", "\n%pip install x\n!ls\n"
    u = f"{s}\n%done\n!{len(t)}"
    assert ddp_cell() == 1 + len(s) * 1000 + len(t) * 100 + len(u)


@pytest.mark.version_independent
def test_code_that_needs_ipython_is_named(tmp_path):
    nb_path = _one_cell_notebook(tmp_path, "%%ddp --gpus 1\nfiles = !ls\nlen(files)")
    with pytest.raises(ExportError, match=r"Cell 1 of nb.ipynb needs IPython in `files = get_ipython\(\).getoutput"):
        export_script(nb_path, "train", tmp_path / "train.py")
    nb_path = _one_cell_notebook(tmp_path, "%%ddp --gpus 1\nlen(names)", "names = %who_ls")
    with pytest.raises(ExportError, match=r"Cell 1 of nb.ipynb needs IPython in `names = get_ipython\(\)"):
        export_script(nb_path, "train", tmp_path / "train.py")
    assert not (tmp_path / "train.py").exists()


# ----------------------------------------------------------------------------------------------
# The shipped notebooks: each training cell exports to a script that trains under torchrun.


def _exported_cells(nb: nbformat.NotebookNode) -> list[str]:
    """The ids of the cells a user exports: those tagged "export" where the notebook tags any, else
    every %%ddp cell. (Ids, not indices: papermill inserts a cell.)"""
    code = [c for c in nb.cells if c.cell_type == "code"]
    tagged = [c.id for c in code if "export" in c.metadata.get("tags", [])]
    return tagged or [c.id for c in code if c.source.lstrip().startswith("%%ddp")]


SHIPPED = [
    (path.stem, cell_id)
    for path in sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
    for cell_id in _exported_cells(nbformat.read(path, as_version=4))
]


@pytest.mark.version_independent
def test_the_shipped_notebooks_have_training_cells_to_export():
    assert {name for name, _ in SHIPPED} >= {"qwen3_vl_2xT4", "text_llm_ddp"}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "cell_id"), SHIPPED, ids=[f"{n}-{i}" for n, i in SHIPPED])
def test_a_shipped_training_cell_exports_to_a_script_that_trains_under_torchrun(tmp_path, name, cell_id):
    import papermill

    # The parameters notebooks/run.py gives this machine (tiny offline models, 2 CPU processes),
    # injected by papermill as CI's notebook runs get them, with fewer steps.
    offline = runpy.run_path(str(NOTEBOOKS_DIR / "run.py"))["parameters"]
    params = offline(name, tmp_path, gpu=False, hub=False, overrides={"max_steps": 2, "save_steps": 2})
    nb_path = tmp_path / f"{name}.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOKS_DIR / f"{name}.ipynb"), str(nb_path), parameters=params, prepare_only=True,
        kernel_name="python3", language="python", progress_bar=False,
    )  # fmt: skip
    script = export_script(nb_path, cell_id, tmp_path / "train.py")
    assert "gpus=2" in _launch_line(script)  # `--gpus $gpus`, expanded from the injected parameters

    proc = torchrun(script, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # rank 0 prints the cell's value, once (under torchrun the other ranks' lines come prefixed "[rank N] ",
    # in any order relative to rank 0's)
    rank0 = [line for line in proc.stdout.strip().splitlines() if not line.startswith("[rank ")]
    result = ast.literal_eval(rank0[-1])
    assert result["global_step"] == 2 and result["resumed_from"] is None
    assert result["last_loss"] > 0
    assert proc.stdout.count("'global_step'") == 1


# ----------------------------------------------------------------------------------------------
# A live set's cells keep their names between cells: exporting one exports the set's cells up to it.


@pytest.mark.version_independent
def test_a_live_set_cell_exports_with_the_cells_that_ran_before_it_on_the_set(tmp_path):
    nb = new_notebook(
        cells=[
            new_code_cell("workers = 2", metadata={"tags": ["parameters"]}),
            new_code_cell("%%ddp --gpus 9\nignored = 'a one-shot cell before the set, not part of it'"),
            new_code_cell("%load_ext nbkit\n%ddp start --gpus $workers --env A=1"),
            new_code_cell("offset = 100"),
            new_code_cell("%%ddp\nimport math\nbase = math.floor(2.5) + offset"),
            new_code_cell("%%ddp --rank 0\nbase = base * 10"),
            new_code_cell("%%ddp --out value\nbase + 1", metadata={"tags": ["train"]}),
            new_code_cell("%ddp stop"),
        ]
    )
    nb_path = tmp_path / "live.ipynb"
    nbformat.write(nb, nb_path)
    script = export_script(nb_path, "train", tmp_path / "train.py").read_text()
    assert "nbkit.launch(joined(ddp_cell), gpus=2, quiet=True)" in script  # --gpus from the %ddp start line
    assert "os.environ.setdefault('A', '1')" in script
    assert "cells 4, 5, 6 run in order" in script and "ignored" not in script
    assert "global base, math" in script and "if nbkit.rank() in (0,):" in script
    namespace = runpy.run_path(str(tmp_path / "train.py"), run_name="exported")
    # Outside a distributed run this process is rank 0: every cell runs, in order, sharing names.
    assert namespace["ddp_cell"]() == (2 + 100) * 10 + 1
