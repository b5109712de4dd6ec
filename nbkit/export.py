"""Export a %%ddp cell, and what it needs from earlier cells, as a standalone training script.

    nbkit.export.export_script("train.ipynb", "train", "train.py")     # or %nbkit export ...

The script runs the cell's body as a function through nbkit.launch, so the same file works
under `torchrun --nproc_per_node N train.py`, `accelerate launch train.py` (launch() then runs the
function directly on each rank) and `python train.py` (launch() forks one process per GPU, or
`--gpus N` CPU processes as the cell asked).

What comes along from the cells above the exported one (a backward slice over top-level
statements, read with ast): every statement that binds a name the cell needs, directly or through
the functions and values it uses; statements that change such an object (`cfg.lr = ...`,
`data.append(...)`); the whole cell tagged "parameters" (papermill's convention) or
"injected-parameters"; and process-wide set-up (os.environ / sys.path changes, seeding,
warnings filters, nbkit.configure). Statements that only show something (plots, prints, display)
are left out. Line magics and shell escapes (`%pip`, `!ls`) never come along; cells run by other
cell magics (%%bash, %%writefile, other %%ddp cells) are skipped and listed in the script's
docstring. The slice is syntactic: read the script once before relying on it.
"""

from __future__ import annotations

import ast
import io
import os
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbkit import cells, ddp_options

__all__ = ["export_script"]

_PARAMETER_TAGS = {"parameters", "injected-parameters"}
_PYTHON_CELL_MAGICS = {"time", "capture", "timeit"}  # their body is plain Python
_SETUP_CALLS = {
    "seed",
    "manual_seed",
    "set_seed",
    "filterwarnings",
    "simplefilter",
    "basicConfig",
    "configure",
    "set_verbosity",
    "set_verbosity_error",
    "set_verbosity_warning",
    "set_verbosity_info",
    "use_deterministic_algorithms",
    "set_float32_matmul_precision",
    "disable_progress_bar",
}
_SETUP_OBJECTS = {("os", "environ"), ("sys", "path")}


@dataclass
class _Statement:
    cell: int
    code: str
    node: ast.stmt
    parameters: bool


def export_script(notebook_path: str | os.PathLike[str], cell: str | int, out: str | os.PathLike[str]) -> Path:
    """Write the cell `cell` of the notebook at `notebook_path`, with what it needs, to `out`.

    Takes `cell` as a tag, a cell id, or an index into the notebook's cells (0 = first; digits in
    a string count as an index). Returns the path written. Raises FileNotFoundError for a missing
    notebook, ValueError for a cell that cannot be found (the message lists the %%ddp cells and
    tags) or whose body is not valid Python.
    """
    import nbformat

    nb_path = Path(notebook_path)
    if not nb_path.is_file():
        raise FileNotFoundError(f"No notebook at {nb_path}: save the notebook first and give its path.")
    notebook = nbformat.read(nb_path, as_version=4)
    index = _find_cell(notebook.cells, cell)
    target = notebook.cells[index]
    if target.cell_type != "code":
        raise ValueError(f"Cell {index} of {nb_path.name} is a {target.cell_type} cell, not code.")
    magic_line, body = _split_cell_magic(target.source)
    options = _ddp_options(magic_line)
    body = _without_line_magics(body)
    try:
        tree = ast.parse(body)
    except SyntaxError as exc:
        raise ValueError(
            f"Cell {index} of {nb_path.name} is not valid Python at line {exc.lineno}: {exc.msg}."
        ) from exc

    statements, skipped = _earlier_statements(notebook.cells[:index])
    kept = _slice(statements, cells.free_names(tree.body))
    function = _unused_name(
        "ddp_cell", {n for s in statements for n in cells.usage([s.node]).binds} | cells.usage(tree.body).binds
    )
    out_path = Path(out)
    script = _render(nb_path, index, cell, options, kept, skipped, function, body, tree, out_path.name)
    out_path.write_text(script)
    return out_path


# --------------------------------------------------------------------------------------------
# Finding and reading cells
# --------------------------------------------------------------------------------------------


def _find_cell(nb_cells: list[Any], wanted: str | int) -> int:
    if isinstance(wanted, int) or str(wanted).isdigit():
        index = int(wanted)
        if 0 <= index < len(nb_cells):
            return index
        raise ValueError(
            f"The notebook has {len(nb_cells)} cells (0 to {len(nb_cells) - 1}); there is no cell {index}."
        )
    tagged = [i for i, c in enumerate(nb_cells) if wanted in c.get("metadata", {}).get("tags", [])]
    if len(tagged) == 1:
        return tagged[0]
    if len(tagged) > 1:
        raise ValueError(f"Several cells carry the tag {wanted!r} (cells {tagged}); give one of those indices.")
    by_id = [i for i, c in enumerate(nb_cells) if c.get("id") == wanted]
    if by_id:
        return by_id[0]
    ddp = [i for i, c in enumerate(nb_cells) if c.cell_type == "code" and c.source.lstrip().startswith("%%ddp")]
    tags = sorted({t for c in nb_cells for t in c.get("metadata", {}).get("tags", [])})
    raise ValueError(
        f"No cell with the tag or id {wanted!r}. %%ddp cells are at indices {ddp or 'none'} (0 = first cell); "
        f"tags in this notebook: {', '.join(tags) or 'none'}. Tag the cell (View > Cell Toolbar > Tags in "
        "Jupyter) or give its index."
    )


def _split_cell_magic(source: str) -> tuple[str | None, str]:
    """("%%name args", body) for a cell that starts with a cell magic, else (None, source)."""
    stripped = source.lstrip()
    if not stripped.startswith("%%"):
        return None, source
    first, _, body = stripped.partition("\n")
    return first, body


def _ddp_options(magic_line: str | None) -> ddp_options.DdpOptions:
    if magic_line is not None and magic_line.split()[0] == "%%ddp":
        return ddp_options.parse(magic_line[len("%%ddp") :])
    return ddp_options.parse("")


def _without_line_magics(source: str) -> str:
    """Line magics and shell escapes have no meaning in a script: each becomes `pass`, keeping
    the line (and any block it sits in) valid.
    """
    lines = []
    for line in source.splitlines():
        code = line.lstrip()
        if code.startswith(("%", "!")):
            indent = line[: len(line) - len(code)]
            lines.append(f"{indent}pass  # notebook only: {code}")
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _earlier_statements(nb_cells: list[Any]) -> tuple[list[_Statement], list[str]]:
    statements, skipped = [], []
    for index, cell in enumerate(nb_cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        magic_line, body = _split_cell_magic(cell.source)
        if magic_line is not None and magic_line[2:].split()[0] not in _PYTHON_CELL_MAGICS:
            skipped.append(f"cell {index} ({magic_line.split()[0]})")
            continue
        body = _without_line_magics(body)
        try:
            tree = ast.parse(body)
        except SyntaxError:
            skipped.append(f"cell {index} (not valid Python)")
            continue
        lines = body.splitlines(True)
        parameters = bool(_PARAMETER_TAGS & set(cell.get("metadata", {}).get("tags", [])))
        for node in tree.body:
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            code = "".join(lines[first - 1 : node.end_lineno]).rstrip() + "\n"
            statements.append(_Statement(index, code, node, parameters))
    return statements, skipped


# --------------------------------------------------------------------------------------------
# The slice
# --------------------------------------------------------------------------------------------


def _slice(statements: list[_Statement], needed: set[str]) -> list[_Statement]:
    """The statements (in notebook order) that the needed names depend on; see the module doc.

    Order is ignored while collecting names: a function reads its globals when it is called, so
    every binding of a name it uses matters, even one that comes after the def. Running the kept
    statements in notebook order then rebuilds the state the cell saw.
    """

    def wanted(statement: _Statement, names: set[str]) -> bool:
        root = _mutated_root(statement.node)
        return bool(
            statement.parameters
            or cells.usage([statement.node]).binds & names
            or (root is not None and root in names)
            or _is_setup(statement.node)
        )

    needed = set(needed)
    while True:
        grown = set(needed)
        for statement in statements:
            if wanted(statement, needed):
                use = cells.usage([statement.node])
                grown |= use.now | use.later
        if grown == needed:
            break
        needed = grown
    return [s for s in statements if wanted(s, needed)]


def _mutated_root(node: ast.stmt) -> str | None:
    """X for `x.a = ...`, `x[k] = ...`, `x.a += ...`, `x.method(...)`; None otherwise."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, (ast.Attribute, ast.Subscript)):
                return _root(target)
        return None
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute):
        return _root(node.value.func.value)
    return None


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_setup(node: ast.stmt) -> bool:
    """Process-wide set-up a training script needs too: os.environ / sys.path changes, seeding,
    warning and logging settings, nbkit.configure(...).
    """
    if not isinstance(node, (ast.Assign, ast.AugAssign, ast.Expr)):
        return False
    if any(
        isinstance(sub, ast.Attribute)
        and isinstance(sub.value, ast.Name)
        and (sub.value.id, sub.attr) in _SETUP_OBJECTS
        for sub in ast.walk(node)
    ):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        func = node.value.func
        return (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) in _SETUP_CALLS
    return False


# --------------------------------------------------------------------------------------------
# Writing the script
# --------------------------------------------------------------------------------------------


def _render(
    nb_path: Path,
    index: int,
    wanted: Any,
    options: Any,
    kept: list[_Statement],
    skipped: list[str],
    function: str,
    body: str,
    tree: ast.Module,
    script: str,
) -> str:
    gpus = options.gpus
    n = gpus if gpus is not None else "<GPUs>"
    forks = f"{gpus} processes" if gpus is not None else "one process per visible GPU"
    doc = [
        f"Exported by nbkit from {nb_path.name}, cell {index} ({wanted!r}).",
        "",
        f"Run:  torchrun --nproc_per_node {n} {script}",
        f"  or: accelerate launch --num_processes {n} {script}",
        f"  or: python {script}   (nbkit.launch forks {forks})",
    ]
    if skipped:
        doc += ["", "Not exported (notebook only): " + ", ".join(skipped) + "."]
    out = ["#!/usr/bin/env python", '"""' + "\n".join(doc) + '\n"""', ""]
    env = options.env
    if env:
        out.append("import os")
        out += [f"os.environ.setdefault({k!r}, {v!r})  # %%ddp --env" for k, v in env.items()]
        out.append("")
    cell = None
    for statement in kept:
        if statement.cell != cell:
            cell = statement.cell
            out.append(f"# --- from cell {cell}")
        elif isinstance(statement.node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append("")
        out.append(statement.code.rstrip())
    out += [
        "",
        "",
        f"def {function}():",
        f'    """The %%ddp cell (cell {index}); runs on every rank."""',
        _function_body(body, tree),
        "",
        "",
    ]
    call = [f"gpus={gpus!r}"]
    if options.timeout is not None:
        call.append(f"timeout={options.timeout!r}")
    if not options.all_ranks:
        call.append("quiet=True")
    result = options.out or "result"
    out += [
        'if __name__ == "__main__":',
        "    import nbkit",
        "",
        "    # Under torchrun / accelerate launch this runs the function on each rank directly.",
        f"    {result} = nbkit.launch({function}, {', '.join(call)})",
        f"    if nbkit.is_main() and {result} is not None:",
        f"        print({result})",
        "",
    ]
    return "\n".join(out)


def _function_body(body: str, tree: ast.Module) -> str:
    """The cell's body indented into a function, its last expression returned."""
    lines = body.splitlines()
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1].lineno - 1
        lines[last] = "return " + lines[last]
    if not tree.body:
        lines.append("pass")
    inside_strings = _lines_inside_strings("\n".join(lines) + "\n")
    # Lines inside a multi-line string are part of its value: indenting them would change it.
    return "\n".join(
        line if (i + 1) in inside_strings or not line.strip() else "    " + line for i, line in enumerate(lines)
    )


def _lines_inside_strings(source: str) -> set[int]:
    inside: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.STRING and token.end[0] > token.start[0]:
            inside.update(range(token.start[0] + 1, token.end[0] + 1))
    return inside


def _unused_name(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_"
    return name
