"""Regional compilation: `torch.compile` of each decoder layer (and each vision block), in place.

A short-sequence LoRA step (1K tokens x 4 on one H100) is bound by host work: each decoder layer
launches a few hundred small kernels, LoRA's extra matmuls and adds included. Compiling each repeated
block as one region fuses its element-wise work and cuts the launches, and since the blocks of a list
are the same code, the first one's compiled graph serves the others (guards on their class and
attributes, parameters as inputs: torch's "regional compilation" recipe). Compiling the whole model
instead would take minutes and break on the vision tower's and the loss's data-dependent code.

The compilation is `nn.Module.compile()`, in place: the layer objects stay where they are, so peft's
LoRA modules, nbkit's other savers (their mixins swap the layers' and MLPs' classes) and DDP see the
same modules. accelerate's `compile_regions` returns `torch.compile` wrappers (OptimizedModule) in a
copied model instead, which the savers' `remove()` could not find again; its FSDP2 variant
(`compile_regions_fsdp2`) uses the same in-place call for the same reason, for FSDP's hooks.

Composes with the other savers: checkpointing wraps the compiled call (non-reentrant checkpoint and
the offloading saved-tensor hooks run outside the compiled region; the recompute in the backward
calls the compiled forward again), Liger's kernels run inside it, and a layer whose MLP is tiled is
compiled as two regions, its attention and its MLP (see regions()). Gradients are those of the eager
model up to floating-point order, in one process and under DDP and FSDP2 (tests/test_savers_compile.py
on the CPU; on one H100, tests/test_liger_gpu.py with Liger's kernels, every saver, 4-bit weights and three lengths).

Measured on one H100 (benchmarks/RESULTS.md, "Regional compilation at 16K"), SFTTrainer, Qwen3-VL-2B,
LoRA r=16, Liger's kernels and Trainer's NaN check off, against the same run uncompiled: faster at
1K x 4 and 16K x 1, in bf16 and under the T4 profile, where it matches unsloth's step time at 16K
(1.00x against 1.10x uncompiled). In bf16 it stays 1.4-1.6x of unsloth's. Without the tiled MLP
(tiled_mlp=False: whole layers compiled) 16K took 0.885 s against 1.057 s, for 0.5 GiB more: at
lengths where memory allows, that is the faster setting.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from nbkit import notices
from nbkit.savers import tiled_mlp
from nbkit.savers._model import _ENCODER_NAMES, base_model, decoder_layers, layer_mlp

__all__ = ["disable", "enable", "is_enabled", "regions"]

# Set on every module this saver compiled, so that disable() touches no compile the user made.
_MARK = "_nbkit_compiled"


def regions(model: nn.Module, *, vision: bool = True) -> list[nn.Module]:
    """The blocks compiled one by one: each decoder layer (or, where its MLP is tiled, the layer's
    attention and its MLP), then (vision=True) the blocks of the vision encoder (its longest
    ModuleList of one block class), if there is one.

    Why a tiled layer is split: dynamo cannot trace the tiled MLP's autograd function (it captures
    the RNG state, and its backward differentiates each shard with `torch.autograd.grad`), so a
    compiled layer breaks into two graphs around it. At 16K tokens on an H100 the first backward of such a layer failed
    inside inductor (a 2-D gradient for the layer's 3-D hidden state; benchmarks/RESULTS.md).
    Compiling the attention and the MLP as regions of their own leaves no break inside a graph: the
    tiled function runs eagerly and calls the compiled MLP once per shard, and its backward
    differentiates that compiled MLP.

    Raises ValueError when the decoder layers cannot be found.
    """
    base = base_model(model)
    blocks: list[nn.Module] = []
    for layer in decoder_layers(base):
        mlp = layer_mlp(layer)
        if mlp is not None and tiled_mlp.is_tiled(mlp):
            attention = getattr(layer, "self_attn", None)
            blocks.extend([attention, mlp] if isinstance(attention, nn.Module) else [mlp])
        else:
            blocks.append(layer)
    if vision:
        for name in _ENCODER_NAMES:
            inner = getattr(base, "model", None)
            encoder = getattr(inner, name, None) if isinstance(inner, nn.Module) else None
            encoder = encoder if isinstance(encoder, nn.Module) else getattr(base, name, None)
            if isinstance(encoder, nn.Module):
                lists: list[nn.ModuleList] = [
                    m
                    for m in encoder.modules()
                    if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(b) for b in m}) == 1
                ]
                if lists:
                    longest = max(lists, key=len)
                    blocks.extend(longest)
                break
    return blocks


def enable(model: nn.Module, *, backend: str = "inductor", vision: bool = True, **options: Any) -> None:
    """Compile every region of `model` (see regions()) in place with `torch.compile(backend=..., **options)`.

    Compilation happens on each region's first call (the first training step: tens of seconds per
    distinct shape on a GPU); an INFO notice (nbkit.notices) says so. Replaces a previous setting of
    this saver.

    Args:
        model: a transformers model, bare, peft- or DDP-wrapped.
        backend: torch.compile's backend ("inductor"; "aot_eager" traces without generating code).
        vision: also compile the vision encoder's blocks.
        options: further torch.compile keyword arguments (mode, dynamic, ...).

    Raises:
        ValueError: when the model's decoder layers cannot be found.
    """
    disable(model)
    blocks = regions(model, vision=vision)
    for block in blocks:
        block.compile(backend=backend, **options)
        setattr(block, _MARK, True)
    # Said here because the wait comes later, where nothing else explains it: a first step that takes a
    # minute on a slow notebook CPU looks like a hang.
    notices.logger(__name__).info(
        f"nbkit: {len(blocks)} blocks of the model compile at its first training step, and once more at the first "
        "step of another sequence length (one H100: 40-48 s from launch to the first step, 23 s uncompiled; longer on "
        "a notebook's few CPU cores); the steps after run faster. compile=None leaves them uncompiled."
    )


def disable(model: nn.Module) -> None:
    """Undo enable(): each region runs eagerly again. A no-op where nothing was compiled by enable()."""
    # Every module is looked at, not regions(): the tiled MLP may have been switched since enable().
    for block in base_model(model).modules():
        if getattr(block, _MARK, False):
            # nn.Module has compile() but no public way back; compile() only sets this attribute,
            # which nn.Module.__call__ checks on every call.
            cast(Any, block)._compiled_call_impl = None
            delattr(block, _MARK)


def is_enabled(model: nn.Module) -> bool:
    """Whether enable() is in effect on `model`."""
    return any(getattr(block, _MARK, False) for block in base_model(model).modules())
