"""The patch registry: idempotent, reversible, exact."""

from __future__ import annotations

import os
import sys
import types

import pytest

from nbkit.platform import patching


@pytest.fixture
def lib(monkeypatch):
    """A small library module, importable by name, with the shapes real patches meet."""
    mod = types.ModuleType("fakelib_for_patching")

    class Base:
        @classmethod
        def load(cls, x):
            return ("orig", cls.__name__, x)

        @staticmethod
        def helper(x):
            return x + 1

    class Child(Base):  # inherits load: nothing of its own to restore
        pass

    def top(x):
        return x * 2

    mod.Base, mod.Child, mod.top = Base, Child, top
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def _make(target, factory, **kw):
    return patching.Patch(target, factory, reason="test", upstream="none", group="test", **kw)


@pytest.mark.version_independent
def test_classmethod_on_an_inheriting_class_is_restored_to_nothing(lib):
    original = vars(lib.Base)["load"]
    p = _make(f"{lib.__name__}:Child.load", lambda orig: lambda cls, x: ("patched",) + orig(cls, x))
    assert p.apply() and p.apply()  # idempotent
    assert lib.Child.load(1) == ("patched", "orig", "Child", 1)
    assert lib.Base.load(1) == ("orig", "Base", 1)
    p.revert()
    assert "load" not in vars(lib.Child) and vars(lib.Base)["load"] is original
    p.revert()  # a second revert is a no-op
    assert lib.Child.load(2) == ("orig", "Child", 2)


@pytest.mark.version_independent
def test_staticmethod_and_module_function(lib):
    helper, top = vars(lib.Base)["helper"], lib.top
    p1 = _make(f"{lib.__name__}:Base.helper", lambda orig: lambda x: orig(x) * 10)
    p2 = _make(f"{lib.__name__}:top", lambda orig: lambda x: orig(x) + 100)
    p1.apply(), p2.apply()
    assert lib.Base.helper(1) == 20 and lib.top(1) == 102
    p1.revert(), p2.revert()
    assert vars(lib.Base)["helper"] is helper and lib.top is top


@pytest.mark.version_independent
def test_a_value_patch_replaces_a_class_as_it_is_so_it_can_be_subclassed(lib):
    original = lib.Base

    class Other:
        pass

    p = _make(f"{lib.__name__}:Base", lambda orig: Other, value=True)
    assert p.apply()
    assert lib.Base is Other

    class Sub(lib.Base):  # what a library does with tqdm.auto's class at its import
        pass

    assert issubclass(Sub, Other)
    p.revert()
    assert lib.Base is original


@pytest.mark.version_independent
def test_skipped_when_library_missing_or_feature_present(lib):
    assert not _make("no_such_module_xyz:thing", lambda orig: orig).apply()
    assert not _make(f"{lib.__name__}:Base.no_such_attr", lambda orig: orig).apply()
    assert not _make(f"{lib.__name__}:top", lambda orig: orig, when=lambda: False).apply()
    assert lib.top(1) == 2


@pytest.mark.version_independent
def test_revert_under_another_librarys_wrapper_passes_through(lib):
    p = _make(f"{lib.__name__}:Base.load", lambda orig: lambda cls, x: ("patched",) + orig(cls, x))
    p.apply()
    ours = vars(lib.Base)["load"]
    # Another library wraps what it finds (ours), as unsloth does with from_pretrained.
    lib.Base.load = classmethod(lambda cls, x: ("theirs",) + ours.__func__(cls, x))
    p.revert()
    assert lib.Base.load(1) == ("theirs", "orig", "Base", 1)  # their wrapper kept, ours inert
    assert not p.is_applied
    p.apply()
    assert lib.Base.load(2) == ("theirs", "patched", "orig", "Base", 2)  # reactivated, not stacked


@pytest.mark.version_independent
def test_group_apply_and_revert(lib):
    before = lib.top
    p = patching.patch(f"{lib.__name__}:top", reason="r", upstream="u", group="test-group")(
        lambda orig: lambda x: -orig(x)
    )
    try:
        assert patching.apply("test-group") == [p.target]
        assert patching.applied("test-group") == [p.target] and lib.top(3) == -6
        patching.revert("test-group")
        assert patching.applied("test-group") == [] and lib.top is before
    finally:
        patching._REGISTRY.remove(p)


@pytest.mark.version_independent
def test_import_nbkit_makes_the_triton_probe_context_free_before_torchao_can_call_it():
    import subprocess

    code = (
        "import sys, nbkit; assert 'torch' not in sys.modules\n"
        "from torch.utils._triton import has_triton\n"  # what torchao does at import
        "import torch\n"
        "import os\n"
        "print(has_triton.__module__, has_triton.__wrapped__.__module__, has_triton(),\n"
        "      torch.cuda.get_device_capability.__module__, os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'])"
    )
    # Without the variable this test process has from its own `import nbkit` (conftest.py): set by the child's.
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    # nbkit's replacements, around torch's own (on this machine without a GPU they defer to torch),
    # and torch's NVML-based availability check, which does not poison fork.
    assert out.split() == [
        "nbkit.platform.forksafety",
        "torch.utils._triton",
        "False",
        "nbkit.platform.forksafety",
        "1",
    ]


_ORDER_PROBE = """
import os, sys

def pytest_collection_finish(session):
    order = list(sys.modules)
    with open(os.environ["ORDER_OUT"], "w") as f:
        f.write(str(order.index("nbkit") < order.index("transformers")))
"""


def test_the_test_process_imports_nbkit_before_transformers_as_a_notebook_must(tmp_path):
    # transformers imports torchao wherever it is installed (with unsloth), and torchao's import asks
    # the GPU for its properties, creating a CUDA context in the process that then cannot fork ranks,
    # unless nbkit's context-free queries are in place first. test_guard.py imports transformers at
    # collection (through test_planner), before its own `import nbkit`.
    import subprocess
    from pathlib import Path

    (tmp_path / "order_probe.py").write_text(_ORDER_PROBE)
    tests = Path(__file__).parent
    result = tmp_path / "nbkit_first"
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{tests.parent}", "ORDER_OUT": str(result)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "order_probe", str(tests / "test_guard.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tests.parent,
        timeout=300,
    ).stdout
    assert result.read_text() == "True", out


@pytest.mark.version_independent
@pytest.mark.parametrize("torchao_first", [True, False])
def test_a_cuda_context_is_blamed_on_torchao_only_where_it_was_imported_before_nbkit(torchao_first):
    import subprocess

    stand_in = "import sys, types; sys.modules['torchao'] = types.ModuleType('torchao')\n"
    code = (stand_in if torchao_first else "") + "import nbkit\n" + ("" if torchao_first else stand_in)
    code += "from nbkit.platform import forksafety; print(forksafety._likely_cuda_cause())"
    cause = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert cause.startswith("torchao was imported before nbkit") is torchao_first, cause
