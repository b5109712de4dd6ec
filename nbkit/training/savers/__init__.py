"""DDP-safe memory savers for any transformers decoder or vision-language model.

    model = nbkit.savers.apply(model)            # offloaded checkpointing, tiled MLP, chunked loss; compiled on a GPU
    model = nbkit.savers.apply(model, checkpointing="recompute", tiled_mlp=8, chunked_loss=False)
    model = nbkit.savers.apply(model, kernels="liger")   # and Liger's fused kernels (Qwen3 / Qwen3-VL, CUDA)
    model = nbkit.savers.apply(model, compile=None)      # without torch.compile of each decoder layer / vision block
    nbkit.savers.remove(model)                   # the model computes exactly as before

- checkpointing (nbkit.savers.checkpointing): non-reentrant activation checkpointing per decoder
  layer; "offload" also keeps the saved layer inputs in pinned CPU memory. None leaves the model's own
  setting: under TRL's SFTConfig, whose gradient checkpointing is on by default, transformers then
  checkpoints each layer around its compiled region (1.10-1.20x nbkit's step at 1K x 4 on an H200,
  benchmarks/RESULTS.md).
- tiled_mlp (nbkit.savers.tiled_mlp): the MLPs run over sequence shards, recomputed in the backward,
  each weight's gradient accumulated once.
- chunked_loss (nbkit.savers.loss): the causal-LM loss is computed in row chunks without full logits.
- kernels="liger" (nbkit.savers.liger): Liger's fused RMSNorm, RoPE and SwiGLU kernels (where the
  layers are not compiled), and the chunked loss computed by Liger's fused linear cross-entropy.
- compile="regional" (nbkit.savers.compiling): torch.compile of each decoder layer and vision block,
  in place (fewer kernel launches where the step is bound by host work, fused element-wise work
  everywhere); "auto", the default: the same for a model on one GPU, none on the CPU.

All three keep every trainable parameter's gradient accumulated exactly once per backward, so they
work under DDP (find_unused_parameters True or False, static_graph, no_sync) and with a model split
over several GPUs. Only the language model is changed; a VLM's vision tower is left as it is, but
for compile="regional", which compiles its blocks too (same gradients, fewer kernel launches).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from nbkit.training import fsdp
from nbkit.training.savers import checkpointing as _checkpointing
from nbkit.training.savers import compiling as _compiling
from nbkit.training.savers import liger as _liger
from nbkit.training.savers import tiled_mlp as _tiled_mlp
from nbkit.training.savers._model import base_model, decoder_layers

__all__ = ["CHECKPOINTING", "apply", "remove"]

# The checkpointing modes apply() takes (nbkit.plan models the same ones).
CHECKPOINTING = ("offload", "recompute", None)
_KERNELS = ("liger", "auto", None)
_COMPILE = ("regional", "auto", None)
# apply()'s compile default: "auto", regional compilation wherever the model sits on one CUDA GPU. Measured on one
# H100 with Liger's loss (benchmarks/RESULTS.md, "The loss's chunks, and layers compiled with their checkpoint
# inside", and the section before it), against unsloth's step time: 0.91x at 1K x 4 in bf16 (median of three runs),
# 1.00-1.03x at 16K in bf16, 1.05x at 16K under the T4 profile and 1.16-1.66x at 1K x 4 there (single runs); 64K
# tokens under the T4 profile train compiled.
# A model split over several GPUs (device_map) stays uncompiled: not measured, and each layer's graph would be
# specialised per device. So does a 4-bit (bitsandbytes) model in an FSDP rank: its 4-bit matmul breaks each
# compiled layer into ~7 graphs whose calls, beside FSDP's hooks, cost the host more than compiling saves
# (Qwen3-14B shapes, T4 profile, 4K tokens per GPU, 2x H100: 1.48 s per step eager against 1.76 compiled).
DEFAULT_COMPILE: str | None = "auto"


@dataclass(frozen=True)
class _Options:
    checkpointing: str | None
    tiled_mlp: str | int | None  # "auto", a shard count, or None (off): True == 1 must not compare equal
    chunked_loss: bool
    kernels: str | None = None
    compile: str | None = None

    @classmethod
    def resolve(
        cls,
        model: nn.Module,
        checkpointing: str | None,
        tiled_mlp: bool | int,
        chunked_loss: bool,
        kernels: str | None,
        compile: str | None,
    ) -> _Options:
        """apply()'s arguments checked (ValueError names the invalid one) and each "auto" decided for `model`."""
        if checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing={checkpointing!r} is not valid; use 'offload', 'recompute' or None.")
        if not isinstance(tiled_mlp, (bool, int)) or (not isinstance(tiled_mlp, bool) and tiled_mlp < 1):
            raise ValueError(f"tiled_mlp={tiled_mlp!r} is not valid; use True, False or a shard count >= 1.")
        if kernels not in _KERNELS:
            raise ValueError(f"kernels={kernels!r} is not valid; use 'liger', 'auto' or None.")
        if compile not in _COMPILE:
            raise ValueError(f"compile={compile!r} is not valid; use 'regional', 'auto' or None.")
        if kernels == "auto":
            kernels = "liger" if _liger.can_run(model) else None
        if compile == "auto":
            devices = {p.device for p in model.parameters()}
            on_one_gpu = len(devices) == 1 and devices.pop().type == "cuda"
            # unsloth compiles its own layers; its models carry the version that loaded them.
            by_unsloth = getattr(getattr(base_model(model), "config", None), "unsloth_version", None) is not None
            four_bit_fsdp = fsdp.requested() and fsdp.holds_4bit_weights(model)
            compile = "regional" if on_one_gpu and not by_unsloth and not four_bit_fsdp else None
        tiled = None if tiled_mlp is False else "auto" if tiled_mlp is True else tiled_mlp
        return cls(checkpointing, tiled, bool(chunked_loss), kernels, compile)


def apply(
    model: nn.Module,
    *,
    checkpointing: str | None = "offload",
    tiled_mlp: bool | int = True,
    chunked_loss: bool = True,
    kernels: str | None = None,
    compile: str | None = DEFAULT_COMPILE,
) -> nn.Module:
    """Turn the memory savers on for `model` and return it (the same object).

    Args:
        model: a transformers PreTrainedModel, a peft PeftModel around one, or either wrapped in
            DistributedDataParallel. Apply on every rank (inside the launched function), before or
            after wrapping in DDP, and before training.
        checkpointing: "offload" (checkpoint each decoder layer, saved inputs in pinned CPU memory),
            "recompute" (checkpoint, inputs stay on the GPU) or None (leave the model's own setting).
        tiled_mlp: True (automatic shard count), an int (that many sequence shards) or False.
        chunked_loss: compute `model(..., labels=...).loss` without full logits: with nbkit's chunked
            cross-entropy, or with Liger's fused linear cross-entropy when kernels="liger".
        kernels: "liger" (Liger's fused RMSNorm, RoPE, SwiGLU and linear cross-entropy kernels; Qwen3
            and Qwen3-VL on CUDA GPUs, see nbkit.savers.liger), "auto" (Liger's where they can run:
            supported model, on a GPU, liger-kernel installed; none otherwise, without an error) or None.
        compile: "regional" (torch.compile, inductor, of each decoder layer and vision block in
            place; each compiles on its first call, see nbkit.savers.compiling), "auto" (the default:
            regional where the whole model is on one CUDA GPU, as in a single-GPU, DDP or FSDP rank;
            none on the CPU, where compiling costs more than it saves, for a model split over several
            GPUs, for a 4-bit model in an FSDP rank, and for a model unsloth loaded, which compiles its
            own layers) or None.

    How the kernels compose with the savers: with compile="regional", only Liger's fused linear
    cross-entropy applies; the compiled regions fuse their own RMSNorm, RoPE and SwiGLU (Liger's
    Triton functions would break each region's graph). Liger's fused linear cross-entropy *is* a chunked loss
    (no logits, gradients in the forward), so with chunked_loss=True it computes the loss in place
    of nbkit's loop, and with chunked_loss=False neither runs (transformers' loss over full logits).
    The tiled MLP and Liger's SwiGLU both change the MLP, at different levels, so both apply: the
    tiled MLP splits the sequence into shards (memory), Liger's SwiGLU computes each shard (speed);
    where the automatic shard count is 1 (the MLP's tensors a small share of the GPU's memory, see
    nbkit.savers.tiled_mlp) only SwiGLU acts.
    Checkpointing recomputes layers that use the kernels.

    Applying again with the same options does nothing; with other options it switches cleanly.
    Raises ValueError for an invalid option or a model whose decoder layers cannot be found (the
    model is then left as it was), nbkit.errors.KernelsError where kernels="liger" cannot run (not
    Qwen3 / Qwen3-VL, not on a CUDA GPU, liger-kernel missing; the model is left as it was), and,
    from the chunked loss, for a model without an lm_head (then no saver is left on).
    """
    wanted = _Options.resolve(model, checkpointing, tiled_mlp, chunked_loss, kernels, compile)
    base = base_model(model)
    current = getattr(base, "_nbkit_savers", None)
    if current == wanted:
        return model
    decoder_layers(base)  # raises, before anything changes, for a model the savers cannot handle
    if wanted.kernels == "liger":
        _liger.check(model)  # likewise
    remove(model)
    try:
        if wanted.checkpointing is not None:
            _checkpointing.enable(base, offload=wanted.checkpointing == "offload")
        if wanted.tiled_mlp is not None:
            _tiled_mlp.enable(base, shards=wanted.tiled_mlp if isinstance(wanted.tiled_mlp, int) else None)
        kernel = None
        if wanted.kernels == "liger":
            # Compiled regions get their fused RMSNorm, RoPE and SwiGLU from inductor instead: dynamo cannot trace
            # Liger's Triton functions, so each breaks the region's graph (see nbkit.savers.liger).
            if wanted.compile != "regional":  # after the tiled MLP: its mixin on each MLP comes off first in remove()
                _liger.enable(base)
            kernel = _liger.fused_linear_cross_entropy
        if wanted.chunked_loss:
            from nbkit.training.savers import loss

            # given as is: it also hooks the peft wrapper (older peft skips the inner hooks)
            loss.apply(model, kernel=kernel)
        if wanted.compile == "regional":  # last: the regions are traced with the other savers' classes in place
            _compiling.enable(base)
    except Exception:
        _disable(base)
        raise
    setattr(base, "_nbkit_savers", wanted)  # noqa: B010 (an attribute nn.Module's type does not declare)
    return model


def remove(model: nn.Module) -> nn.Module:
    """Turn every saver off: the model's layers, MLPs, loss and config are as before apply(). Returns `model`.

    A no-op for a model without savers.
    """
    base = base_model(model)
    current = getattr(base, "_nbkit_savers", None)
    if current is None:
        return model
    _disable(base)
    if current.chunked_loss:
        from nbkit.training.savers import loss

        loss.remove(base)
    del base._nbkit_savers
    return model


def _disable(base: nn.Module) -> None:
    """Take the module-level savers off, the last put on first (their mixins stack on the same MLPs)."""
    _compiling.disable(base)
    if _liger.is_enabled(base):
        _liger.disable(base)
    _tiled_mlp.disable(base)
    _checkpointing.disable(base)
