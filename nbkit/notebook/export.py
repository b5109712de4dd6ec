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
are left out. Line magics and shell escapes (`%pip`, `!ls`) never come along: each cell is read
the way the kernel reads it (IPython's own input transformer, so `%` or `!` inside a string stays
text), and every magic or shell line becomes `pass  # notebook only: ...`; cells run by other
cell magics (%%bash, %%writefile, other %%ddp cells) are skipped and listed in the script's
docstring. The slice is syntactic: read the script once before relying on it.

The %%ddp line's `$name`, `$name.attr` and `{expr}` are expanded as IPython expands magic lines
(`$$` and `{{ }}` escape), with the values of the notebook's parameters: the cells tagged
"parameters" / "injected-parameters" above the exported cell, run on their own in a fresh
namespace (nothing else of the notebook runs). A name that is not a parameter is an error naming
it. An option whose value comes out as `None` (a parameter left at None, e.g. `--gpus $gpus`
with `gpus = None`) takes its default, which is None for every valued option of %%ddp.

A notebook that runs its %%ddp cells on a live set (`%ddp start` above them) keeps state across
those cells: the model loaded in one is trained in a later one. Exporting such a cell exports every
%%ddp cell of the set up to it, in order, each as a function whose top-level names are the
script's globals (as they are the rank's names in the live set), cells run `--rank N` only on those
ranks, and the `%ddp start` line's --gpus/--timeout/--env become the launch's; the exported cell's
value is what the script returns.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import os
import shlex
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbkit.launching.rank_options import RankOptions
from nbkit.notebook import cell_code, ddp_options
from nbkit.platform.errors import ExportError

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
# What IPython's input transformer turns magics and shell escapes into: get_ipython().<method>(...),
# and the prefix the user typed for each.
_IPYTHON_CALLS = {"run_line_magic": "%", "system": "!", "getoutput": "!!"}


@dataclass
class _Statement:
    cell: int
    code: str
    node: ast.stmt
    parameters: bool


def export_script(
    notebook_path: str | os.PathLike[str], cell: str | int, out: str | os.PathLike[str], *, force: bool = False
) -> Path:
    """Write the %%ddp cell `cell` of the notebook at `notebook_path`, with what it needs, to `out`.

    Takes `cell` as a tag, a cell id, or an index into the notebook's cells (0 = first; digits in
    a string count as an index). Returns the path written. Raises ExportError (a ValueError) for
    a missing notebook, an `out` that is the notebook itself, a folder, or a file nbkit did not
    export (unless `force`), a cell that cannot be found (the message lists the %%ddp cells and
    tags) or is not a %%ddp cell, a %%ddp line that uses a name which is not a parameter or does
    not parse or names no GPU profile to emulate, and a cell whose body is not valid Python or
    needs IPython. Writes nothing when it raises.
    """
    import nbformat

    nb_path, out_path = Path(notebook_path), Path(out)
    if not nb_path.is_file():
        raise ExportError(f"No notebook at {nb_path}: save the notebook first and give its path.")
    _check_out(nb_path, out_path, force)
    notebook = nbformat.read(nb_path, as_version=4)
    index = _find_cell(notebook.cells, cell)
    target = notebook.cells[index]
    where = f"Cell {index} of {nb_path.name}"
    if target.cell_type != "code":
        raise ExportError(f"{where} is a {target.cell_type} cell, not code.")
    magic_line, _ = _split_cell_magic(target.source)
    if magic_line is None or magic_line.split()[0] != "%%ddp":
        raise ExportError(
            f"{where} is not a %%ddp cell: export writes a %%ddp cell as a training script that runs it on every "
            f"rank. Give a %%ddp cell (at indices {_ddp_cells(notebook.cells) or 'none'}), or put %%ddp at the top "
            "of this one."
        )
    statements, skipped = _earlier_statements(notebook.cells[:index])
    start_line, earlier = _live_set(notebook.cells[:index])
    parts = [_Part.read(i, notebook.cells[i].source, statements, nb_path.name) for i in [*earlier, index]]
    options = parts[-1].options
    if start_line is not None:
        start = _start_options(start_line, statements, where)
        setup = dataclasses.replace(
            start,
            env=(*start.env, *options.setup.env),
            timeout=options.setup.timeout or start.timeout,
            all_ranks=options.setup.all_ranks,
        )
        options = dataclasses.replace(options, setup=setup)
    exported = {f"cell {part.cell} (%%ddp)" for part in parts}
    skipped = [item for item in skipped if item not in exported]
    needed = cell_code.free_names([node for part in parts for node in part.tree.body])
    kept = _slice(statements, needed)
    for statement in kept:
        _refuse_ipython(statement.code, f"Cell {statement.cell} of {nb_path.name}")
    taken = {n for s in statements for n in cell_code.usage([s.node]).binds}
    taken |= {n for part in parts for n in cell_code.usage(part.tree.body).binds}
    function = _unused_name("ddp_cell", taken)
    script = _render(nb_path, index, cell, options, kept, skipped, function, parts, taken, out_path.name)
    out_path.write_text(script)
    return out_path


@dataclass
class _Part:
    """One %%ddp cell of what is exported: its index, options, Python body and tree."""

    cell: int
    options: ddp_options.DdpOptions
    body: str
    tree: ast.Module

    @classmethod
    def read(cls, index: int, source: str, statements: list[_Statement], notebook: str) -> _Part:
        where = f"Cell {index} of {notebook}"
        magic_line, body = _split_cell_magic(source)
        options = _ddp_options(magic_line, statements, where)
        try:
            body, tree = _as_python(body)
        except SyntaxError as exc:
            raise ExportError(f"{where} is not valid Python at line {exc.lineno}: {exc.msg}.") from exc
        _refuse_ipython(body, where)
        return cls(index, options, body, tree)


def _live_set(nb_cells: list[Any]) -> tuple[str | None, list[int]]:
    """The `%ddp start` line in force after `nb_cells` (None: no live set) and the indices of the
    %%ddp cells that ran on that set, in order.
    """
    start_line: str | None = None
    ran: list[int] = []
    for index, cell in enumerate(nb_cells):
        if cell.cell_type != "code":
            continue
        if cell.source.lstrip().startswith("%%ddp"):
            if start_line is not None:
                ran.append(index)
            continue
        for line in cell.source.splitlines():
            words = line.split()
            if words[:2] == ["%ddp", "start"]:
                start_line, ran = line.strip()[len("%ddp start") :], []
            elif words[:2] == ["%ddp", "stop"]:
                start_line, ran = None, []
    return start_line, ran


def _start_options(line: str, statements: list[_Statement], where: str) -> RankOptions:
    """The options of the `%ddp start` line above the cell, expanded as a %%ddp line is."""
    if "$" in line or "{" in line:
        line = _expand(line, statements, where)
    try:
        return ddp_options.parse_start(_without_none_values(line))
    except ddp_options.OptionsError as exc:
        raise ExportError(f"{where}: the `%ddp start` line above it: {exc}") from None


# The first lines of every script export_script writes: what it may replace without --force.
_HEADER = '#!/usr/bin/env python\n"""Exported by nbkit from '


def _check_out(nb_path: Path, out_path: Path, force: bool) -> None:
    """ExportError for an `out` the script must not be written to: the notebook, a folder, or a file nbkit
    did not export (unless `force`).
    """
    if _same_file(nb_path, out_path):
        raise ExportError(
            f"{out_path} is the notebook being exported: writing the script there would replace the notebook. "
            "Give the script its own name, e.g. -o train.py."
        )
    if out_path.is_dir():
        raise ExportError(f"{out_path} is a folder: give the script's file name, e.g. -o {out_path / 'train.py'}.")
    if out_path.exists() and not force:
        with open(out_path, errors="replace") as existing:
            ours = existing.read(len(_HEADER)) == _HEADER
        if not ours:
            raise ExportError(
                f"{out_path} exists and nbkit did not export it: writing the script would replace it. Give another "
                "name, or pass --force (force=True) to replace it."
            )


def _same_file(a: Path, b: Path) -> bool:
    """Whether the paths name one file (through links, relative parts, or a second hard link)."""
    if b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


# --------------------------------------------------------------------------------------------
# Finding and reading cells
# --------------------------------------------------------------------------------------------


def _find_cell(nb_cells: list[Any], wanted: str | int) -> int:
    if isinstance(wanted, int) or str(wanted).isdigit():
        index = int(wanted)
        if 0 <= index < len(nb_cells):
            return index
        raise ExportError(
            f"The notebook has {len(nb_cells)} cells (0 to {len(nb_cells) - 1}); there is no cell {index}."
        )
    tagged = [i for i, c in enumerate(nb_cells) if wanted in c.get("metadata", {}).get("tags", [])]
    if len(tagged) == 1:
        return tagged[0]
    if len(tagged) > 1:
        raise ExportError(f"Several cells carry the tag {wanted!r} (cells {tagged}); give one of those indices.")
    by_id = [i for i, c in enumerate(nb_cells) if c.get("id") == wanted]
    if by_id:
        return by_id[0]
    ddp = _ddp_cells(nb_cells)
    tags = sorted({t for c in nb_cells for t in c.get("metadata", {}).get("tags", [])})
    raise ExportError(
        f"No cell with the tag or id {wanted!r}. %%ddp cells are at indices {ddp or 'none'} (0 = first cell); "
        f"tags in this notebook: {', '.join(tags) or 'none'}. Tag the cell (View > Cell Toolbar > Tags in "
        "Jupyter) or give its index."
    )


def _ddp_cells(nb_cells: list[Any]) -> list[int]:
    """The indices of the notebook's %%ddp cells."""
    return [i for i, c in enumerate(nb_cells) if c.cell_type == "code" and c.source.lstrip().startswith("%%ddp")]


def _split_cell_magic(source: str) -> tuple[str | None, str]:
    """("%%name args", body) for a cell that starts with a cell magic, else (None, source)."""
    stripped = source.lstrip()
    if not stripped.startswith("%%"):
        return None, source
    first, _, body = stripped.partition("\n")
    return first, body


def _ddp_options(magic_line: str | None, statements: list[_Statement], where: str) -> ddp_options.DdpOptions:
    """The options of the cell's %%ddp line, its `$name` / `{expr}` expanded from the parameters."""
    if magic_line is None or magic_line.split()[0] != "%%ddp":
        return ddp_options.parse("")
    line = magic_line[len("%%ddp") :]
    if "$" in line or "{" in line:
        line = _expand(line, statements, where)
    try:
        return ddp_options.parse(_without_none_values(line))
    except ddp_options.OptionsError as exc:
        raise ExportError(f"{where}: {exc}") from None


def _expand(line: str, statements: list[_Statement], where: str) -> str:
    """`line` with `$name`, `$name.attr` and `{expr}` replaced as IPython replaces them in a magic
    line, evaluated against the notebook's parameters.
    """
    # IPython's own formatter, so the rules are exactly IPython's; imported here, never at module
    # import (scripts that export without IPython running pay for it only when a line needs it).
    from IPython.utils.text import DollarFormatter

    namespace = _parameters(statements, where)
    try:
        return DollarFormatter().vformat(line, args=[], kwargs=namespace)
    except NameError as exc:
        names = sorted(n for n in namespace if not n.startswith("__"))
        raise ExportError(
            f"{where}: the %%ddp line uses {exc.name!r}, which is not a parameter of the notebook. The exporter "
            "expands $name and {expr} from the cells tagged 'parameters' or 'injected-parameters' above it "
            f"(parameters: {', '.join(names) or 'none'}): set {exc.name!r} there, or write its value into the line."
        ) from None
    except Exception as exc:
        raise ExportError(
            f"{where}: cannot expand the %%ddp line {line.strip()!r}: {type(exc).__name__}: {exc}"
        ) from None


def _parameters(statements: list[_Statement], where: str) -> dict[str, Any]:
    """The values the parameters cells assign, from running those cells alone in a fresh namespace."""
    namespace: dict[str, Any] = {"__name__": "__nbkit_parameters__"}
    for statement in statements:
        if not statement.parameters:
            continue
        try:
            exec(compile(statement.code, f"<cell {statement.cell}>", "exec"), namespace)
        except Exception as exc:
            raise ExportError(
                f"{where}: running the parameters cell (cell {statement.cell}) to expand the %%ddp line failed at "
                f"`{statement.code.strip()}`: {type(exc).__name__}: {exc}. Parameters cells should hold plain "
                "assignments."
            ) from None
    return namespace


def _without_none_values(line: str) -> str:
    """The line without `--option None` for the options whose default is None (a parameter left at
    None means the default, as it does for nbkit.launch).
    """
    defaults_none = {
        "--" + f.name.replace("_", "-")
        for f in (*dataclasses.fields(ddp_options.DdpOptions), *dataclasses.fields(RankOptions))
        if f.default is None
    }
    try:
        words = shlex.split(line)
    except ValueError:
        return line  # ddp_options names the problem
    kept: list[str] = []
    for word in words:
        if word == "None" and kept and kept[-1] in defaults_none:
            kept.pop()
        else:
            kept.append(word)
    return shlex.join(kept)


def _as_python(source: str) -> tuple[str, ast.Module]:
    """Cell code as the kernel runs it, with every magic and shell line made `pass  # notebook only: ...`.

    The text goes through IPython's input transformer, so only real line magics and shell
    escapes are found (never `%` or `!` inside a string), and the statements it made of them are
    replaced, keeping any block they sit in valid. Returns the text and its tree. Raises
    SyntaxError for code that is not valid Python.
    """
    from IPython.core.inputtransformer2 import TransformerManager  # not at module import: see _expand

    text = TransformerManager().transform_cell(source)
    tree = ast.parse(text)
    lines = text.splitlines()
    replaced = False
    for node in ast.walk(tree):
        if not isinstance(node, ast.Expr) or (typed := _typed_magic(node.value)) is None:
            continue
        indent = lines[node.lineno - 1][: node.col_offset]
        last = lines[(node.end_lineno or node.lineno) - 1]
        # Only a call on lines of its own, as the transformer writes it (anything else is the user's
        # own get_ipython() code, which _refuse_ipython names).
        rest = last.encode()[node.end_col_offset :].decode().strip()
        if not indent.strip() and (not rest or rest.startswith("#")):
            lines[node.lineno - 1] = f"{indent}pass  # notebook only: {typed}"
            for number in range(node.lineno, node.end_lineno or node.lineno):
                lines[number] = ""
            replaced = True
    if not replaced:
        return text, tree
    text = "\n".join(lines) + "\n"
    return text, ast.parse(text)


def _typed_magic(node: ast.expr) -> str | None:
    """What the user typed (`%pip install x`, `!ls`) for a call IPython's transformer made of a
    magic or shell escape; None for any other expression.
    """
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _IPYTHON_CALLS
        and _calls_get_ipython(node.func.value)
        and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)
    ):
        return None
    words = [a.value for a in node.args]  # type: ignore[attr-defined]
    text = " ".join(w for w in words if w).replace("\n", " ")
    return _IPYTHON_CALLS[node.func.attr] + text


def _calls_get_ipython(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "get_ipython"


def _refuse_ipython(source: str, where: str) -> None:
    """Raise ExportError for code that still needs IPython once the magic lines are `pass`
    (`files = !ls`, `x = %who_ls`): a script has no notebook shell to run it.
    """
    for node in ast.walk(ast.parse(source)):
        if _calls_get_ipython(node):
            line = source.splitlines()[node.lineno - 1].strip()  # type: ignore[attr-defined]
            raise ExportError(
                f"{where} needs IPython in `{line}` (IPython's reading of a magic or shell line whose value is "
                "used). A script has no notebook shell to run it: use subprocess.run(...) or plain Python there, "
                "or keep that line out of the code the exported cell needs."
            )


def _earlier_statements(nb_cells: list[Any]) -> tuple[list[_Statement], list[str]]:
    statements, skipped = [], []
    for index, cell in enumerate(nb_cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        magic_line, body = _split_cell_magic(cell.source)
        if magic_line is not None and magic_line[2:].split()[0] not in _PYTHON_CELL_MAGICS:
            skipped.append(f"cell {index} ({magic_line.split()[0]})")
            continue
        try:
            body, tree = _as_python(body)
        except SyntaxError:
            skipped.append(f"cell {index} (not valid Python)")
            continue
        lines = body.splitlines(True)
        parameters = bool(_PARAMETER_TAGS & set(cell.get("metadata", {}).get("tags", [])))
        for node in tree.body:
            if isinstance(node, ast.Pass):  # a magic or shell line (see _as_python), or a plain pass
                continue
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
            or cell_code.usage([statement.node]).binds & names
            or (root is not None and root in names)
            or _is_setup(statement.node)
        )

    needed = set(needed)
    while True:
        grown = set(needed)
        for statement in statements:
            if wanted(statement, needed):
                use = cell_code.usage([statement.node])
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
    options: ddp_options.DdpOptions,
    kept: list[_Statement],
    skipped: list[str],
    function: str,
    parts: list[_Part],
    taken: set[str],
    script: str,
) -> str:
    setup = options.setup
    gpus = setup.gpus
    n = gpus if gpus is not None else "<GPUs>"
    forks = f"{gpus} processes" if gpus is not None else "one process per visible GPU"
    doc = [
        f"Exported by nbkit from {nb_path.name}, cell {index} ({wanted!r}).",
        "",
        f"Run:  torchrun --nproc_per_node {n} {script}",
        f"  or: accelerate launch --num_processes {n} {script}",
        f"  or: python {script}   (nbkit.launch forks {forks})",
    ]
    if len(parts) > 1:
        doc += ["", f"The live set's %%ddp cells {', '.join(str(p.cell) for p in parts)} run in order on every rank."]
    if skipped:
        doc += ["", "Not exported (notebook only): " + ", ".join(skipped) + "."]
    out = ["#!/usr/bin/env python", '"""' + "\n".join(doc) + '\n"""', ""]
    env = setup.env_dict()
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
    if len(parts) == 1:
        out += ["", "", f"def {function}():", f'    """The %%ddp cell (cell {index}); runs on every rank."""']
        out += [_function_body(parts[0].body, parts[0].tree), "", ""]
    else:
        out += _live_functions(function, parts, taken)
    call = [f"gpus={gpus!r}"]
    if setup.timeout is not None:
        call.append(f"timeout={setup.timeout!r}")
    if not setup.all_ranks:
        call.append("quiet=True")
    if setup.strategy not in (None, "ddp"):
        call.append(f"strategy={setup.strategy!r}")
    if setup.emulate is not None:
        call.append(f"emulate={setup.emulate!r}")
    result = options.out or "result"
    out += [
        'if __name__ == "__main__":',
        "    import nbkit",
        "    from nbkit.cell_group import joined",
        "",
        "    # Under torchrun / accelerate launch this runs the function on each rank directly; either way",
        "    # it runs in the default process group, set up before it as for the %%ddp cell.",
        f"    {result} = nbkit.launch(joined({function}), {', '.join(call)})",
        f"    if nbkit.is_main() and {result} is not None:",
        f"        print({result})",
        "",
    ]
    return "\n".join(out)


def _live_functions(function: str, parts: list[_Part], taken: set[str]) -> list[str]:
    """One function per %%ddp cell of a live set, its top-level names the script's globals (as
    they stay the rank's names between cells), and `function`, which calls them in order.
    """
    names = [_unused_name(f"ddp_cell_{part.cell}", taken | {function}) for part in parts]
    out: list[str] = []
    for name, part in zip(names, parts):
        bound = sorted(cell_code.usage(part.tree.body).binds)
        out += ["", "", f"def {name}():", f'    """%%ddp cell {part.cell}."""']
        if bound:
            out.append(f"    global {', '.join(bound)}")
        out += [_function_body(part.body, part.tree), ""]
    out += [
        "",
        f"def {function}():",
        f'    """The live set\'s %%ddp cells, in order, on every rank; returns cell {parts[-1].cell}\'s value."""',
        "    import nbkit",
        "",
    ]
    for name, part in zip(names, parts):
        is_last = part is parts[-1]
        call = f"return {name}()" if is_last else f"{name}()"
        if part.options.ranks is None:
            out.append(f"    {call}")
        else:
            out += [f"    if nbkit.rank() in {tuple(part.options.ranks)!r}:  # %%ddp --rank", f"        {call}"]
    out += ["", ""]
    return out


def _function_body(body: str, tree: ast.Module) -> str:
    """The cell's body indented into a function, its last expression returned (wherever it starts
    on its line: `x = 1; x + 1` becomes `x = 1; return x + 1`).
    """
    lines = body.splitlines()
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        line = lines[last.lineno - 1]
        column = len(line.encode()[: last.col_offset].decode())  # ast counts UTF-8 bytes
        lines[last.lineno - 1] = line[:column] + "return " + line[column:]
    if not tree.body:
        lines.append("pass")
    inside_strings = _lines_inside_strings("\n".join(lines) + "\n")
    # Lines inside a multi-line string are part of its value: indenting them would change it.
    return "\n".join(
        line if (i + 1) in inside_strings or not line.strip() else "    " + line for i, line in enumerate(lines)
    )


def _lines_inside_strings(source: str) -> set[int]:
    """Numbers of the lines (1 = first) that begin inside a string literal started on a line above."""
    inside: set[int] = set()
    # Python 3.12+ splits f-strings into FSTRING_START ... FSTRING_END tokens instead of one STRING.
    fstring_start, fstring_end = getattr(tokenize, "FSTRING_START", None), getattr(tokenize, "FSTRING_END", None)
    open_fstrings: list[int] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.STRING and token.end[0] > token.start[0]:
            inside.update(range(token.start[0] + 1, token.end[0] + 1))
        elif token.type == fstring_start:
            open_fstrings.append(token.start[0])
        elif token.type == fstring_end and open_fstrings:
            started = open_fstrings.pop()
            if not open_fstrings and token.end[0] > started:
                inside.update(range(started + 1, token.end[0] + 1))
    return inside


def _unused_name(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_"
    return name
