"""Grouped-query attention on GPUs where flash attention cannot run (T4), without seq x seq memory.

transformers hands torch's scaled_dot_product_attention the key/value heads of a grouped-query
model (Qwen3: 16 query heads, 8 key/value heads) as they are, with `enable_gqa=True`. Of torch's
kernels only flash attention and the math fallback take `enable_gqa`; the memory-efficient kernel
does not. Where flash cannot run (compute capability below 8.0, as on a T4, or switched off, as under
nbkit.emulate("T4")) torch therefore picks the math kernel, which materialises the scores and the
causal mask: under the T4 profile Qwen3-VL-2B then failed at 16K tokens trying to allocate 16 GiB
(16 heads x 16K x 16K fp32), at 64K 256 GiB (H100, torch 2.11). Repeating the key/value heads first
(what transformers itself does where it does not use `enable_gqa`) lets the memory-efficient kernel
run, whose memory grows with the sequence, not its square. Results are the same: `enable_gqa` is
defined as that repetition.

Ranks get the patch only where their GPU cannot run flash attention (`needed`), and under a profile
that turns flash attention off (nbkit.emulation). Elsewhere it would only cost: the wrapper runs
inside unsloth's compiled decoder layers, and its first form, which asked torch whether flash could
run on each call, broke those graphs into pieces (2x H100, unsloth, 1K x 4 on 2 GPUs: 1,056 TorchDynamo
cache lookups per step against 160 without nbkit's rank set-up, 0.472 s per step against 0.365 s;
benchmarks/RESULTS.md). It now asks nothing at run time, so a compiled layer traces through it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nbkit.platform.patching import patch

__all__ = ["flash_attention_can_run", "needed"]

# Flash attention needs compute capability 8.0 (Ampere) or newer.
_FLASH_CAPABILITY = (8, 0)


def flash_attention_can_run(query: torch.Tensor) -> bool:
    """Whether torch's flash attention may run for `query`: a CUDA tensor in 16 bits on compute
    capability 8.0 or newer, with flash SDPA enabled.
    """
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and torch.backends.cuda.flash_sdp_enabled()
        and torch.cuda.get_device_capability(query.device) >= _FLASH_CAPABILITY
    )


def needed(gpus: Sequence[Any], local_rank: int) -> bool:
    """Whether the rank on `gpus[local_rank]` (nbkit.distributed.visible_gpus(), read without a CUDA
    context) needs the patch: its GPU is older than flash attention, or of unknown capability. False
    on a machine without GPUs, where SDPA runs on the CPU, which the patch leaves alone.
    """
    if not gpus:
        return False
    gpu = gpus[local_rank] if 0 <= local_rank < len(gpus) else gpus[0]
    return tuple(gpu.capability) < _FLASH_CAPABILITY


@patch(
    "torch.nn.functional:scaled_dot_product_attention",
    reason="with enable_gqa=True and no flash attention (a T4, or nbkit.emulate('T4')) torch falls back to the math "
    "kernel, whose scores and causal mask are seq x seq: Qwen3-VL-2B under the T4 profile failed at 16K tokens "
    "allocating 16 GiB; repeat the key/value heads instead, so that the memory-efficient kernel runs",
    upstream="none filed yet: torch 2.11 chose the math kernel for enable_gqa=True with flash attention off (the "
    "memory-efficient kernel was not used); transformers passes enable_gqa whenever there is no attention mask",
    group="attention",
)
def _gqa_without_flash(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    # torch's docstring stays: unsloth reads it ("enable_gqa" in its text) to decide how to call the function
    @functools.wraps(original)
    def scaled_dot_product_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        # Installed only where flash attention cannot run, so nothing here asks torch at run time (a
        # query torch.compile cannot trace would break a compiled layer in two at every call).
        heads, kv_heads = query.shape[-3], key.shape[-3]
        if kwargs.get("enable_gqa") and heads != kv_heads and query.is_cuda:
            key = key.repeat_interleave(heads // kv_heads, dim=-3)
            value = value.repeat_interleave(heads // kv_heads, dim=-3)
            kwargs["enable_gqa"] = False
        return original(query, key, value, *args, **kwargs)

    return scaled_dot_product_attention
