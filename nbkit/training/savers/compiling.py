"""Regional compilation: `torch.compile` of each decoder layer (and each vision block), in place.

A short-sequence LoRA step (1K tokens x 4 on one H100) is bound by host work: each decoder layer
launches a few hundred small kernels, LoRA's extra matmuls and adds included. Compiling each repeated
block as one region fuses its element-wise work and cuts the launches, and since the blocks of a list
are the same code, the first one's compiled graph serves the others (guards on their class and
attributes, parameters as inputs: torch's "regional compilation" recipe). Compiling the whole model
instead would take minutes and break on the vision tower's and the loss's data-dependent code.

The compilation is what `nn.Module.compile()` does, in place, for calls that autograd records (training; inference
runs eagerly, see _TrainingCalls): the layer objects stay where they are, so peft's
LoRA modules, nbkit's other savers (their mixins swap the layers' and MLPs' classes) and DDP see the
same modules. accelerate's `compile_regions` returns `torch.compile` wrappers (OptimizedModule) in a
copied model instead, which the savers' `remove()` could not find again; its FSDP2 variant
(`compile_regions_fsdp2`) uses the same in-place call for the same reason, for FSDP's hooks.

A vision block compiles as one graph where nbkit.savers.vision_attention gives its attention the image sizes
(Qwen3-VL's with two images or more a forward, whose split by image otherwise reads them from the GPU and breaks the
graph there).

Composes with the other savers: a checkpointed layer is compiled with its non-reentrant checkpoint
inside (nbkit.savers.checkpointing.compile_checkpointed: the compiled backward recomputes the layer,
the offloading saved-tensor hooks run outside the compiled region), except for calls where its tiled
MLP splits and for layers with module hooks (FSDP2's), which the checkpoint wraps from outside as for
an uncompiled layer; the tiled MLP is
traced into its layer's graph until it splits (see regions()); with kernels="liger" only Liger's
loss applies, the layers' RMSNorm, RoPE and SwiGLU being fused by inductor (nbkit.savers.liger says
why). Gradients are those of the eager model up to floating-point order, in one process and under
DDP and FSDP2 (tests/test_savers_compile.py on the CPU; on one H100, tests/test_liger_gpu.py with
Liger's loss, every saver, 4-bit weights and three lengths).

Measured on one H100 (benchmarks/RESULTS.md, "The loss's chunks, and layers compiled with their checkpoint
inside"), SFTTrainer, Qwen3-VL-2B, LoRA r=16, Liger's loss, Trainer's NaN check off, against unsloth in
the same call: 0.91x of its step time at 1K x 4 in bf16 (median of three runs; 1.18x with the checkpoint
around each compiled layer), 1.00-1.03x at 16K x 1 in bf16 and 1.05x under the T4 profile (the earlier
section); under the T4 profile at 1K x 4, 1.16x and 1.66x in single runs. 64K tokens under the T4
profile train compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from nbkit.platform import notices
from nbkit.training.savers import checkpointing, vision_attention
from nbkit.training.savers._model import base_model, decoder_layers, vision_encoder

__all__ = ["disable", "enable", "is_enabled", "regions"]

# Set on every module this saver compiled, so that disable() touches no compile the user made.
_MARK = "_nbkit_compiled"
# Compilations dynamo allows per function in the regions' calls; its own default is 8
# (torch._dynamo.config.recompile_limit), past which each new variant of the inputs runs eagerly. All decoder layers
# and vision blocks run one function (transformers' GradientCheckpointingLayer.__call__, or nbkit's compiled
# checkpoint), and each variant its guards tell apart takes one compilation: a first length and then dynamic ones, the
# first layer's input (no grad) and the later layers' (grad), a batch of one, a vision block beside a decoder layer.
# tiny:qwen3-vl trained on batches of 1 and 2 with ten image sizes: the shared function reached 8 at the third batch,
# and with room its functions took 24 in all, none after the fourth batch (benchmarks/RESULTS.md); 64 leaves room and
# still stops a loop that recompiles at every step.
_RECOMPILE_LIMIT = 64


def regions(model: nn.Module, *, vision: bool = True) -> list[nn.Module]:
    """The blocks compiled one by one: each decoder layer, then (vision=True) the blocks of the vision
    encoder (its longest ModuleList of one block class), if there is one.

    A layer is compiled whole, its tiled MLP included: the tiled MLP's shard count is integer
    arithmetic on the input's size, so below the length where it splits dynamo traces the MLP into
    the layer's graph (a guard on the length); where it splits, the graph breaks around the tiled
    call, which runs its shards eagerly (nbkit.savers.tiled_mlp). Compiling the attention and the MLP
    as regions of their own instead was slower in one call on one H200, one run each: 0.283 s against
    0.220 s at 1K x 4 and 0.795 s against 0.712 s at 16K x 1 (benchmarks/RESULTS.md, "Where the 1K x 4
    step goes").

    Raises ValueError when the decoder layers cannot be found.
    """
    base = base_model(model)
    blocks: list[nn.Module] = list(decoder_layers(base))
    encoder = vision_encoder(base) if vision else None
    if encoder is not None:
        lists: list[nn.ModuleList] = [
            m
            for m in encoder.modules()
            if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(b) for b in m}) == 1
        ]
        if lists:
            longest = max(lists, key=len)
            blocks.extend(longest)
    return blocks


def enable(model: nn.Module, *, backend: str = "inductor", vision: bool = True, **options: Any) -> None:
    """Compile every region of `model` (see regions()) in place with `torch.compile(backend=..., **options)`.

    Compilation happens on each region's first training call (the first training step: tens of seconds per
    distinct shape on a GPU); an INFO notice (nbkit.platform.notices) says so. Calls without autograd
    (generation, evaluation) run eagerly. Replaces a previous setting of this saver.

    Args:
        model: a transformers model, bare, peft- or DDP-wrapped.
        backend: torch.compile's backend ("inductor"; "aot_eager" traces without generating code).
        vision: also compile the vision encoder's blocks, each as one graph where its attention is one that
            nbkit.savers.vision_attention splits at sizes read once per forward (Qwen3-VL's).
        options: further torch.compile keyword arguments (mode, dynamic, ...).

    Raises:
        ValueError: when the model's decoder layers cannot be found.
    """
    disable(model)
    blocks = regions(model, vision=vision)
    if vision:
        vision_attention.enable(model)  # so that each vision block compiles as one graph

    def compiler(fn: Callable[..., Any]) -> Callable[..., Any]:
        return _Compiled(torch.compile(fn, backend=backend, **options))

    for block in blocks:
        # What nn.Module.compile() does, with inference left eager (_TrainingCalls says why).
        cast(Any, block)._compiled_call_impl = _TrainingCalls(compiler(block._call_impl), block)
        if checkpointing.is_checkpointed(block):
            checkpointing.compile_checkpointed(block, compiler)
        setattr(block, _MARK, True)
    # Said here because the wait comes later, where nothing else explains it: a first step that takes a
    # minute on a slow notebook CPU looks like a hang.
    notices.logger(__name__).info(
        f"nbkit: {len(blocks)} blocks of the model compile at its first training step, and again where another kind "
        "of batch (without padding, with padding, of one row) first comes (Qwen3-VL-2B on one H200: 16-24 s each; "
        "longer on a notebook's few CPU cores); the steps after run faster. compile=None leaves them uncompiled."
    )


class _Compiled:
    """A region's compiled function, called with dynamo's limit on compilations per function raised to
    _RECOMPILE_LIMIT (where the process's own is lower) for these calls alone, and with its inputs' sequence length
    dynamic from the first compilation on (_mark_sequence_dynamic).
    """

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _mark_sequence_dynamic(args, kwargs)
        limit = max(_RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
        with torch._dynamo.config.patch(recompile_limit=limit):
            return self.compiled(*args, **kwargs)


def _mark_sequence_dynamic(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Mark the sequence length of a decoder layer's inputs as a size that may change, before dynamo sees them.

    Left to itself, dynamo compiles a layer for the first length it meets and again, with that length dynamic, at
    the second. The flagship notebook on one H200 stopped 16-19 s at each of three compilations in its 20 steps
    (benchmarks/RESULTS.md), longer on a notebook's few CPU cores; on the CPU, tiny:qwen3-vl on the same data compiled
    at the same three steps (a static graph for a batch without padding, a dynamic one with padding, a dynamic one
    without), and with the marks at two. Marked here, the first compilation is the dynamic one the later steps would
    have used anyway (their steps took as long on the CPU with and without, 0.19-0.22 s). The sequence length is the
    hidden states' middle size ([batch, length, hidden]); every input size equal to it past the batch dimension is
    marked (hidden states, rotary cos and sin, a 4-D mask's two lengths), except the hidden states' own width.
    maybe_mark_dynamic lets dynamo keep a size static where the code needs it (a length equal to the width, or one
    that a view fixes): then it recompiles at the next length, as it did before. Vision blocks ([patches, width])
    are left as they are: their sizes follow the images, not the text. Costs 6 us a call on a 2-core CPU (Qwen3-VL-2B:
    28 calls a step).
    """
    first = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(first, torch.Tensor) or first.dim() != 3 or first.shape[1] < 2:  # 0 and 1 stay specialised
        return
    length = first.shape[1]
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if not isinstance(item, torch.Tensor):
                continue
            for dim in range(1, item.dim() - (1 if item is first else 0)):
                if item.shape[dim] == length:
                    torch._dynamo.maybe_mark_dynamic(item, dim)


class _TrainingCalls:
    """A region's call: compiled where autograd records it (training, and a checkpoint's recompute), eager where
    it does not (generation, evaluation under no_grad), and compiled under no_grad where grad mode is on but nothing
    in the call can be recorded (a frozen vision tower in training: no argument and no parameter of the block
    requires grad).

    Generation would compile graphs of its own (a prefill, then one token at a time against a growing cache, in
    another grad mode), and they count against dynamo's limit on compilations per function
    (torch._dynamo.config.recompile_limit: 8), which the training calls of every layer share. In the flagship
    notebook, which generates an answer before it trains, that limit was reached at the first training step, so
    each later length trained eagerly: without checkpointing, 0.493 s a step against 0.413 s with the compiled
    checkpoint (which is a function of its own), 1x H200 under the T4 profile (benchmarks/RESULTS.md). Eager
    generation also spares a notebook's answer cell the compilation.

    The frozen block's call runs under no_grad because the Trainer's checkpointing (transformers'
    GradientCheckpointingLayer) would otherwise wrap it in a checkpoint inside the compiled graph, with nothing to
    recompute; torch 2.13 refuses to compile such an inference graph around an attention kernel ("does not support
    RNG ops in recompute regions"). Under no_grad transformers skips the checkpoint; the outputs, which nothing
    recorded, are the same.
    """

    def __init__(self, compiled: Callable[..., Any], block: nn.Module) -> None:
        self.compiled, self.block = compiled, block
        self.eager = block._call_impl

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.eager(*args, **kwargs)
        if self._records(args, kwargs):
            return self.compiled(*args, **kwargs)
        with torch.no_grad():
            return self.compiled(*args, **kwargs)

    def _records(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether autograd would record the block's call: an argument (or a tuple's item) or a parameter requires
        grad. The arguments first: every call after a model's first layer answers there.
        """
        for value in (*args, *kwargs.values()):
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, torch.Tensor) and item.requires_grad:
                    return True
        return any(parameter.requires_grad for parameter in self.block.parameters())


def disable(model: nn.Module) -> None:
    """Undo enable(): each region runs eagerly again. A no-op where nothing was compiled by enable()."""
    # Every module is looked at, not regions(): the tiled MLP may have been switched since enable().
    for block in base_model(model).modules():
        if getattr(block, _MARK, False):
            # nn.Module has compile() but no public way back; compile() only sets this attribute, as enable() does,
            # which nn.Module.__call__ checks on every call.
            cast(Any, block)._compiled_call_impl = None
            checkpointing.drop_compiled(block)
            delattr(block, _MARK)
    vision_attention.disable(model)


def is_enabled(model: nn.Module) -> bool:
    """Whether enable() is in effect on `model`."""
    return any(getattr(block, _MARK, False) for block in base_model(model).modules())
