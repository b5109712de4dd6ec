"""nbkit.configure / nbkit.config.setting: every NBKIT_* variable nbkit reads, read one way."""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import pytest

import nbkit
from nbkit.notebook import dashboard
from nbkit.platform import config
from nbkit.training import offline


@pytest.mark.version_independent
def test_settings_are_read_from_the_environment_with_defaults(monkeypatch, tmp_path):
    for spec in config.SETTINGS.values():
        monkeypatch.delenv(spec.env, raising=False)
    assert config.setting("dashboard") == "auto" and config.setting("dashboard_interval") == "10"
    assert offline.cache_root() == Path.home() / ".cache" / "nbkit" / "models"
    monkeypatch.setenv("NBKIT_DASHBOARD", " Text ")
    monkeypatch.setenv("NBKIT_CACHE", str(tmp_path))
    assert dashboard.display_mode() == "text"
    assert offline.cache_root() == tmp_path / "models"
    monkeypatch.setenv("NBKIT_DASHBOARD_INTERVAL", "0.5")
    board = dashboard.Dashboard(1, mode="off")
    board.close(success=True)
    assert board.interval == 0.5
    monkeypatch.setenv("NBKIT_DASHBOARD_INTERVAL", "often")
    with pytest.raises(
        ValueError, match="NBKIT_DASHBOARD_INTERVAL='often' is not valid for nbkit's dashboard_interval"
    ):
        dashboard.Dashboard(1, mode="off")


@pytest.mark.version_independent
def test_configure_checks_everything_before_changing_anything(monkeypatch):
    for spec in config.SETTINGS.values():
        # set first, so that monkeypatch records each one and removes what configure() writes below (a
        # delenv of a variable that is not there records nothing, and NBKIT_DASHBOARD=off leaked into
        # every later test of the session)
        monkeypatch.setenv(spec.env, "")
        monkeypatch.delenv(spec.env)
    with pytest.raises(ValueError, match="dashboard='fancy' is not valid; use one of 'auto', 'html', 'widget'"):
        nbkit.configure(device_map_policy="error", dashboard="fancy")
    with pytest.raises(ValueError, match="nbkit has no setting 'colour'"):
        nbkit.configure(colour="blue")
    assert "NBKIT_DEVICE_MAP_POLICY" not in os.environ
    now = nbkit.configure(dashboard="off", dashboard_interval="2")
    assert now["dashboard"] == "off" and now["dashboard_interval"] == "2"
    assert os.environ["NBKIT_DASHBOARD"] == "off" and dashboard.display_mode() == "off"


@pytest.mark.version_independent
def test_the_settings_users_configure_are_declared():
    declared = {spec.env for spec in config.SETTINGS.values()}
    assert {"NBKIT_DASHBOARD", "NBKIT_DASHBOARD_INTERVAL", "NBKIT_CACHE", "NBKIT_DEVICE_MAP_POLICY"} <= declared


# Reads of the environment whose variable is computed, by (file, function): the variables each reads.
_COMPUTED_READS = {
    ("distributed.py", "_env_int"): lambda: ("RANK", "LOCAL_RANK", "WORLD_SIZE"),  # torchrun's
    ("distributed.py", "launched"): lambda: ("RANK", "WORLD_SIZE", "MASTER_ADDR"),  # torch's env:// rendezvous
    ("diagnostics.py", "_secrets"): lambda: importlib.import_module("nbkit.notebook.diagnostics").SECRET_NAMES,
    ("rank_contract.py", "nccl_environment"): lambda: (
        importlib.import_module("nbkit.launching.rank_contract")._NCCL_ERROR_HANDLING
    ),
}


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and _named(node.value, "os")


def _named(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _environ_reads(tree: ast.Module) -> list[tuple[ast.AST, str]]:
    """(the expression naming the variable, the function it is read in) for each read of os.environ:
    os.environ.get(...), os.getenv(...), os.environ[...] (not assigned to) and `... in os.environ`."""
    reads: list[tuple[ast.AST, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if (func.attr == "get" and _is_environ(func.value)) or (func.attr == "getenv" and _named(func.value, "os")):
                reads.append((node.args[0], function))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            reads.append((node.slice, function))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            reads.append((node.left, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return reads


def _resolved(node: ast.AST, module: object) -> object:
    """The value of a constant, a module-level name or an attribute of one (config.STRATEGY); None otherwise."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return getattr(module, node.id, None)
    if isinstance(node, ast.Attribute):
        owner = _resolved(node.value, module)
        return getattr(owner, node.attr, None) if owner is not None else None
    return None


@pytest.mark.version_independent
def test_nbkit_and_accelerate_variables_are_read_through_config_only():
    """config.py reads every NBKIT_* and ACCELERATE_* variable (one parsing of each, accelerate's for its
    flags); a read of one anywhere else in nbkit/ fails here, whether its name is spelt out or held in a
    constant."""
    package = Path(nbkit.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "config.py":
            continue
        reads = _environ_reads(ast.parse(path.read_text(), str(path)))
        if not reads:
            continue
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        module = importlib.import_module(name)
        for key, function in reads:
            value = _resolved(key, module)
            where = f"{path.relative_to(package.parent)}:{key.lineno} ({function})"
            computed = _COMPUTED_READS.get((path.name, function))
            names = [value] if isinstance(value, str) else list(computed()) if computed is not None else None
            if names is None:
                found.append(f"{where}: reads a variable whose name the test cannot tell")
            found += [f"{where}: reads {n}" for n in names or () if n.startswith(("NBKIT_", "ACCELERATE_"))]
    assert not found, "read these through nbkit.config (declare a setting, or a function there):\n" + "\n".join(found)


@pytest.mark.version_independent
def test_accelerates_flags_are_read_one_way(monkeypatch):
    for spelt, meant in [("1", True), ("Yes", True), (" on ", True), ("TRUE", True), ("0", False), ("off", False)]:
        monkeypatch.setenv(config.USE_FSDP, spelt)
        assert config.flag(config.USE_FSDP) is meant
    monkeypatch.setenv(config.USE_FSDP, "sometimes")
    with pytest.raises(ValueError, match="ACCELERATE_USE_FSDP='sometimes' is neither true nor false"):
        config.flag(config.USE_FSDP)
    monkeypatch.delenv(config.USE_FSDP)
    assert config.flag(config.USE_FSDP) is None


def test_the_strategy_nbkit_set_decides_whether_a_rank_shards(monkeypatch, capsys):
    from nbkit.training import fsdp, guard

    monkeypatch.delenv(config.STRATEGY, raising=False)
    monkeypatch.setenv(config.USE_FSDP, "1")  # accelerate launch --use_fsdp, spelt as transformers reads it
    assert config.fsdp_rank() and guard._placement_managed_elsewhere({})
    config.settle_fsdp_flag()
    assert os.environ[config.USE_FSDP] == "true"  # the one spelling accelerate's Accelerator takes
    assert capsys.readouterr().err == ""  # the same meaning: nothing to say
    monkeypatch.setenv(config.STRATEGY, "ddp")
    monkeypatch.setenv(config.USE_FSDP, "1")
    assert not config.fsdp_rank() and not fsdp.requested()
    # the guard keeps device_map="auto" from splitting the model in a DDP rank
    assert not guard._placement_managed_elsewhere({})
    config.settle_fsdp_flag()
    assert os.environ[config.USE_FSDP] == "false"
    assert (
        "ACCELERATE_USE_FSDP=1 in this rank's environment, and the rank's strategy is 'ddp'" in capsys.readouterr().err
    )
    monkeypatch.setenv(config.STRATEGY, "fsdp")
    assert config.fsdp_rank() and fsdp.requested()
