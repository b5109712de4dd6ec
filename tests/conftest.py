"""Shared test setup: offline hub, one model cache per test session, tiny checkpoints."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Set before anything imports transformers/huggingface_hub, which read them at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
# Tests fork processes after tokenizing; the Rust thread pool must not be live across a fork.
os.environ["TOKENIZERS_PARALLELISM"] = "false"

# nbkit first, as a notebook must: test modules import transformers at collection, which imports torchao
# wherever it is installed (with unsloth), and torchao's import asks the GPU for its properties; without
# nbkit's context-free queries in place that creates a CUDA context here, and no launch can fork.
import nbkit  # noqa: F401, I001  (before torch and everything that imports transformers)
import torch
from plain_failures import pytest_runtest_makereport  # noqa: F401  (a hook: see plain_failures)
from version_split import RECORDER, Record, versioned_modules
from versioned_imports.sitecustomize import VersionedImports

# The test models are tiny and CI has 2 shared cores: a second intra-op thread only spin-waits
# (measured here: 15 steps of tiny:qwen3 took 1.6 s on one thread, 15 s on two under load).
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def nbkit_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """NBKIT_CACHE for the whole session: tiny checkpoints are built once and shared by all tests
    (and by processes they launch, which inherit the environment)."""
    path = tmp_path_factory.mktemp("nbkit-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NBKIT_CACHE", str(path))
        yield path


@pytest.fixture(scope="session")
def tiny_text_path(nbkit_cache: Path) -> str:
    """Local checkpoint of tiny:qwen3 (Qwen3ForCausalLM, a few hundred KB)."""
    from nbkit.training.offline import resolve_model

    return resolve_model("tiny:qwen3")


@pytest.fixture(scope="session")
def tiny_vl_path(nbkit_cache: Path) -> str:
    """Local checkpoint of tiny:qwen3-vl (Qwen3VLForConditionalGeneration, ~1 MB)."""
    from nbkit.training.offline import resolve_model

    return resolve_model("tiny:qwen3-vl")


@pytest.fixture(autouse=True)
def no_accelerate_state_leaks() -> Iterator[None]:
    """A test that builds a Trainer or Accelerator in the test process leaves accelerate's shared
    state behind, after which nbkit.launch rightly refuses to fork: reset it between tests. transformers
    4.x's TrainingArguments also exports its precision as ACCELERATE_MIXED_PRECISION (TRL 0.x's SFTConfig
    defaults to bf16), which every later rank inherits (a later FSDP test's ranks computed in bf16): put
    the variable back as it was."""
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION")
    yield
    if precision is None:
        os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
    else:
        os.environ["ACCELERATE_MIXED_PRECISION"] = precision
    import sys

    state = sys.modules.get("accelerate.state")
    if state is not None and (state.PartialState._shared_state or state.AcceleratorState._shared_state):
        state.AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="session")
def kernel_name(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Jupyter kernel that runs this very interpreter (so it sees the nbkit under test), without
    touching the user's own kernelspecs."""
    from ipykernel.kernelspec import write_kernel_spec

    name = "nbkit-test-python"
    root = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(str(root / "kernels" / name))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(root), os.environ.get("JUPYTER_PATH")])))
        yield name


@pytest.fixture(autouse=True)
def patch_groups_as_found() -> Iterator[None]:
    """`nbkit.uninstall()` reverts every group, including forksafety, which `import nbkit` applied:
    tests that call it put back the groups that were applied before them."""
    from nbkit.platform import patching

    before = {p.group for p in patching.registered() if p.is_applied}
    yield
    for group in before:
        patching.apply(group)


@pytest.fixture
def exact_fp32() -> Iterator[None]:
    """fp32 matmuls and convolutions on CUDA without TF32 during the test, as before it afterwards: GPU
    results are compared with fp32 references (GPU tests: `pytest.mark.usefixtures("exact_fp32")`)."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


# ---- version_independent: tests that `make test-oldest` leaves out (see the marker in pyproject.toml) --------


@pytest.fixture(scope="module", autouse=True)
def versioned_imports(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Record | None]:
    """In a module with `version_independent` tests, every process notes the versioned modules it imports: this
    one from here on, and every Python process started from it (kernels, engines, ranks) from its start, through
    tests/versioned_imports/sitecustomize.py. Set up before the module's other fixtures (autouse comes first), so
    that the kernels and sets they start are watched too."""
    items = [i for i in request.session.items if i.module is request.module]
    if not any(i.get_closest_marker("version_independent") for i in items):
        yield None
        return
    path = tmp_path_factory.mktemp("versioned-imports") / "imports.txt"
    path.touch()
    names = versioned_modules()
    finder = VersionedImports(names, str(path))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NBKIT_TEST_VERSIONED_RECORD", str(path))
        mp.setenv("NBKIT_TEST_VERSIONED_NAMES", ",".join(sorted(names)))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(RECORDER), os.environ.get("PYTHONPATH")])))
        sys.meta_path.insert(0, finder)
        try:
            yield Record(path, names)
        finally:
            sys.meta_path.remove(finder)


@pytest.fixture(autouse=True)
def version_independent_checked(request: pytest.FixtureRequest, versioned_imports: Record | None) -> Iterator[None]:
    """A `version_independent` test fails if it, or a process it used, imported a versioned module (since the
    test before it ended: a module-scoped kernel's start counts for the module's first test)."""
    yield
    if versioned_imports is None:
        return
    imported = versioned_imports.since_last()
    if request.node.get_closest_marker("version_independent"):
        assert not imported, (
            "marked version_independent, yet imported libraries whose version differs in the oldest set "
            f"(so `make test-oldest` must run it: remove the marker): {imported}"
        )
