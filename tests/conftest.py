"""Shared test setup: offline hub, one model cache per test session, tiny checkpoints."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Set before anything imports transformers/huggingface_hub, which read them at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
# Tests fork processes after tokenizing; the Rust thread pool must not be live across a fork.
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import torch

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
    from nbkit.offline import resolve_model

    return resolve_model("tiny:qwen3")


@pytest.fixture(scope="session")
def tiny_vl_path(nbkit_cache: Path) -> str:
    """Local checkpoint of tiny:qwen3-vl (Qwen3VLForConditionalGeneration, ~1 MB)."""
    from nbkit.offline import resolve_model

    return resolve_model("tiny:qwen3-vl")


@pytest.fixture(autouse=True)
def no_accelerate_state_leaks() -> Iterator[None]:
    """A test that builds a Trainer or Accelerator in the test process leaves accelerate's shared
    state behind, after which nbkit.launch rightly refuses to fork: reset it between tests."""
    yield
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
    from nbkit import patching

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
