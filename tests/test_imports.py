"""The package's import structure: no cycles (lazy imports included), no IPython at import, submodules reachable."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import nbkit

PACKAGE = Path(nbkit.__file__).parent
# The one module that needs IPython: the magics, loaded by `%load_ext nbkit`.
NEEDS_IPYTHON = {"nbkit.notebook.magics"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The nbkit modules `path` imports anywhere in its code (module level, functions, TYPE_CHECKING
    blocks), including `importlib.import_module("nbkit....")` with a literal name."""
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from nbkit import x` imports the submodule nbkit.x where x is one, else a name of nbkit
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                named.add(submodule if submodule in modules else node.module)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            named.add(node.args[0].value)
    return {name for name in named if name in modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


@pytest.mark.version_independent
def test_the_walker_sees_lazy_imports():
    graph = _graph()
    assert "nbkit.platform.forksafety" in graph["nbkit"]  # importlib.import_module("nbkit.platform.forksafety")
    assert "nbkit.notebook.magics" in graph["nbkit"]  # inside load_ipython_extension
    assert "nbkit.training.savers.tiled_mlp" in graph["nbkit.notebook.planner"]  # inside a function
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.version_independent
def test_no_import_cycles():
    graph = _graph()
    # the package's own __init__ is imported first by every submodule: edges back to it are not cycles
    for name in graph:
        graph[name].discard("nbkit")
    assert _cycles(graph) == []


@pytest.mark.version_independent
def test_import_nbkit_and_the_api_modules_import_no_ipython():
    api = sorted(name for name in _modules() if name not in NEEDS_IPYTHON)
    code = (
        "import importlib, sys\n"
        "import nbkit\n"
        "assert 'IPython' not in sys.modules, 'import nbkit'\n"
        f"for name in {api!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'IPython' not in sys.modules, name\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


@pytest.mark.version_independent
def test_a_ranks_set_up_imports_no_torch_dynamo():
    # Every rank nbkit starts runs prepare_rank, which imports the savers; importing torch._dynamo takes a
    # second of CPU, in each rank of each launch from a process that has not imported it (a kernel's %%ddp,
    # spawn mode, a live set's engines), and only a rank that compiles or tiles needs it.
    code = (
        "import os, sys\n"
        "os.environ.update(RANK='0', LOCAL_RANK='0', WORLD_SIZE='2', LOCAL_WORLD_SIZE='2')\n"
        "from nbkit.rank_side.setup import prepare_rank\n"
        "prepare_rank(owns_exit=False)\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')) or 'ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "ok", (result.stdout[-2000:], result.stderr[-2000:])


@pytest.mark.version_independent
def test_documented_submodules_are_reachable_after_import_nbkit():
    code = (
        "import nbkit\n"
        "print(nbkit.dashboard.display_mode.__module__, nbkit.export.__name__, nbkit.savers.apply.__module__,\n"
        "      nbkit.checkpoints.resume_point.__module__, nbkit.offline.resolve_model.__module__,\n"
        "      nbkit.patching.describe.__module__, nbkit.integration.GROUPS['guard'].module,\n"
        "      nbkit.config.setting.__module__, nbkit.synthetic.__name__)\n"
        "try:\n"
        "    nbkit.not_a_module\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.split("\n")[:2] == [
        "nbkit.notebook.dashboard nbkit.notebook.export nbkit.training.savers nbkit.training.checkpoints nbkit.training.offline "
        "nbkit.platform.patching nbkit.training.guard nbkit.platform.config nbkit.training.synthetic",
        "module 'nbkit' has no attribute 'not_a_module'",
    ], result.stderr[-2000:]


@pytest.mark.version_independent
def test_the_old_paths_of_moved_modules_import_the_modules_themselves():
    """A module that moved into its layer's folder keeps its old path for users (`from nbkit.offline import ...`,
    an exported script's `nbkit.cell_group`), as the same module object: one copy, so that one patch or one
    monkeypatch acts on both names."""
    code = (
        "import importlib, sys\n"
        "import nbkit\n"
        "from nbkit.errors import NbkitError\n"
        "from nbkit.platform.errors import NbkitError as Moved\n"
        "assert NbkitError is Moved\n"
        "import nbkit.savers.loss\n"
        "assert nbkit.savers.loss is sys.modules['nbkit.training.savers.loss'] is nbkit.training.savers.loss\n"
        "for old, new in nbkit._MOVED.items():\n"
        "    module = importlib.import_module(old)\n"
        "    assert module is importlib.import_module(new) is sys.modules[old], old\n"
        "    assert module.__name__ == module.__spec__.name == new, (old, module.__spec__)\n"
        "print(sorted(nbkit._MOVED))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert {"nbkit.config", "nbkit.errors", "nbkit.integration"} <= set(ast.literal_eval(result.stdout))
