"""Grouped-query attention without flash attention: the same result, memory that grows with the sequence only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nbkit
from nbkit.platform.distributed import GPU
from nbkit.training import attention


@pytest.fixture
def patched():
    nbkit.install("attention")
    yield
    nbkit.uninstall("attention")


def _qkv(seq: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 16, seq, 64, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(1, 8, seq, 64, device=device, dtype=dtype, generator=g) for _ in range(2))
    return q, k, v


@pytest.mark.version_independent
def test_on_cpu_the_call_is_torchs_own(patched):
    q, k, v = _qkv(32, "cpu", torch.float32)
    assert not attention.flash_attention_can_run(q)
    assert (
        torch.compile(F.scaled_dot_product_attention, fullgraph=True, backend="eager")(q, k, v, enable_gqa=True).shape
        == q.shape
    )
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    nbkit.uninstall("attention")
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.version_independent
def test_ranks_get_the_patch_only_on_a_gpu_without_flash_attention():
    t4, h100, unknown = (GPU(0, "T4", 15.0, (7, 5)), GPU(1, "H100", 79.6, (9, 0)), GPU(0, "unknown", 0.0, (0, 0)))
    assert attention.needed([t4, t4], 1)
    assert not attention.needed([h100, h100], 0)
    assert attention.needed([h100, t4], 1) and not attention.needed([h100, t4], 0)  # each rank's own GPU
    assert attention.needed([unknown], 0)  # nvidia-smi could not say: the patch is harmless, math attention is not
    assert not attention.needed([], 0)  # CPU ranks: SDPA on the CPU is left alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_compiled_layer_traces_through_the_patch_in_one_graph(patched):
    q, k, v = _qkv(256, "cuda", torch.float16)
    compiled = torch.compile(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2, fullgraph=True
    )
    out = compiled(q, k, v)  # fullgraph: a graph break raises
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(out, reference * 2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_without_flash_gqa_runs_in_memory_linear_in_the_sequence(patched):
    torch.backends.cuda.enable_flash_sdp(False)  # as on a T4 (and under nbkit.emulate("T4"))
    try:
        q, k, v = _qkv(1024, "cuda", torch.float16)
        reference = F.scaled_dot_product_attention(
            q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert torch.allclose(out, reference, atol=2e-3)
        q, k, v = _qkv(32768, "cuda", torch.float16)  # math attention: 16 x 32K x 32K scores, 32+ GiB
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert torch.cuda.max_memory_allocated() - before < 2**30
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
