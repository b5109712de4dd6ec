"""Liger's fused Triton kernels on the transformers path: RMSNorm, RoPE, SwiGLU, fused linear cross-entropy.

    nbkit.savers.apply(model, kernels="liger")   # with the savers' defaults, on every rank, model on its GPU

For the Qwen3 and Qwen3-VL families (liger-kernel 0.8.5, its public functional API). Only the
language model changes, as with the other savers: a VLM's vision tower is left as it is.

Why not `liger_kernel.transformers.apply_liger_kernel_to_qwen3(model=...)`: it also rebinds
module-level names of transformers for every model of the family in the process
(`modeling_qwen3.Qwen3RMSNorm`, `Qwen3MLP`, `apply_rotary_pos_emb`), replaces the model's whole
`forward` with a copy written for one transformers release, and offers no way back. Here each
change is made on this model's modules, reversibly (`nbkit.savers.remove`), and the one global
change goes through nbkit's patch registry:

- RMSNorm: the decoder's RMSNorms (input, post-attention, q_norm, k_norm, the final norm) compute
  with `liger_rms_norm` (casting mode "llama", as transformers' Qwen3 RMSNorm). `in_place=False`:
  Liger's in-place backward writes the input's gradient into the incoming gradient's buffer, which
  is only safe when autograd hands no other node that buffer; not worth the risk for one
  activation-sized buffer per norm.
- SwiGLU: each decoder layer's MLP computes `down(liger_swiglu(gate(x), up(x)))`. The projections
  are still called as modules, so LoRA on them works unchanged.
- RoPE: the attention calls its modeling module's global `apply_rotary_pos_emb`. A registered patch
  (group "kernels") replaces that function with a dispatcher: inside an attention module of a model
  with kernels on (tracked per thread, so a checkpoint's recompute in autograd's thread counts too)
  it calls `liger_rotary_pos_emb`, everywhere else the original. The patch is in place while at
  least one model in the process has kernels on, and reverted exactly after the last one.
- Fused linear cross-entropy: the chunked loss (nbkit.savers.loss) computes its rows with
  `liger_fused_linear_cross_entropy` instead of nbkit's own loop. Same contract: no (tokens, vocab)
  logits, hidden states moved to the lm_head's device, `num_items_in_batch` and `shift_labels`
  honoured. With `chunked_loss=False` the model keeps transformers' loss over full logits.

With regional compilation (compile="regional") only the fused linear cross-entropy applies: the
compiled decoder layers fuse their RMSNorm, RoPE and SwiGLU in inductor's own kernels. Dynamo cannot
trace these Triton functions (torch 2.11: inductor's analysis of Liger's kernels fails, "'float' object
has no attribute 'to'"), nor the RoPE dispatcher's per-thread state, so each call broke its layer's
graph and ran eagerly: at 1K x 4 on one H200, a step bound by host work, 113 RMSNorm calls per step
took 41 ms of host time outside the compiled graphs (benchmarks/RESULTS.md, "Where the 1K x 4 step
goes"). Inductor's fused kernels cost no such host work.

Composition with the savers (nbkit.savers.apply decides; see there): checkpointing recomputes layers
that use the kernels; the tiled MLP splits the sequence and runs Liger's SwiGLU on each shard (the
tiled MLP decides how many tokens go through the MLP at once, Liger how each shard is computed).

DDP: every kernel is an autograd Function whose backward returns each input's gradient once, and no
trainable (LoRA) weight is an input of one: LoRA weights still get their gradients from the
projections, so DDP's hooks fire once per backward as without kernels.

Liger's kernels are Triton programs for CUDA GPUs. Asking for them for a model on the CPU, for a
model family not listed here, or without liger-kernel installed raises nbkit.errors.KernelsError
(no fallback: a run that silently trained without them would be measured and reported as Liger).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from nbkit.platform import patching
from nbkit.platform.errors import KernelsError
from nbkit.training.savers._model import add_mixin, base_model, decoder_layers, has_mixin, layer_mlp, remove_mixin
from nbkit.training.savers.loss import rows_per_chunk

__all__ = [
    "LIGER_VERSION",
    "SUPPORTED",
    "check",
    "chunk_mem_const",
    "disable",
    "enable",
    "fused_linear_cross_entropy",
    "is_enabled",
]

LIGER_VERSION = "0.8.5"
# model_type of the language model -> the transformers module whose apply_rotary_pos_emb its attention calls.
SUPPORTED = {
    "qwen3": "transformers.models.qwen3.modeling_qwen3",
    "qwen3_vl_text": "transformers.models.qwen3_vl.modeling_qwen3_vl",
}
_GROUP = "kernels"
_ACTIVATIONS = ("silu", "swish")


@functools.cache
def _functional() -> Any:
    """liger_kernel.transformers.functional, imported on first use (it imports Triton)."""
    try:
        from liger_kernel.transformers import functional
    except ImportError as error:
        raise KernelsError(
            f"kernels='liger' needs liger-kernel (and Triton), which cannot be imported here ({error}). Install "
            f"it with `pip install liger-kernel=={LIGER_VERSION}` (or nbkit's `liger` extra), or use kernels=None."
        ) from error
    return functional


def _text_config(model: nn.Module) -> Any:
    config = cast(Any, base_model(model)).config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check(model: nn.Module) -> None:
    """Raise KernelsError unless Liger's kernels can run on `model` here; change nothing.

    Checks, in this order: the language model is Qwen3 or Qwen3-VL (model_type in SUPPORTED) with a
    SiLU MLP, its decoder layers are on CUDA devices, and liger-kernel imports.
    """
    text = _text_config(model)
    model_type = getattr(text, "model_type", None)
    if model_type not in SUPPORTED:
        raise KernelsError(
            f"kernels='liger' supports the Qwen3 and Qwen3-VL families; {type(base_model(model)).__name__} "
            f"(model_type {model_type!r}) is not one of them. Use kernels=None (nbkit's savers alone)."
        )
    if getattr(text, "hidden_act", None) not in _ACTIVATIONS:
        raise KernelsError(
            f"kernels='liger' needs a SiLU MLP; this model's hidden_act is {text.hidden_act!r}. Use kernels=None."
        )
    devices = {p.device.type for p in decoder_layers(model).parameters()}
    if devices != {"cuda"}:
        raise KernelsError(
            f"kernels='liger' runs Liger's Triton kernels, which need the model on CUDA GPUs; its decoder layers "
            f"are on {', '.join(sorted(devices))}. Move the model to its GPU first (in each rank: "
            "model.to(f'cuda:{local_rank}')), or use kernels=None on a machine without a GPU."
        )
    _functional()


def can_run(model: nn.Module) -> bool:
    """Whether check(model) passes: what kernels="auto" asks. Changes nothing."""
    try:
        check(model)
    except KernelsError:
        return False
    return True


# --------------------------------------------------------------------------------------------------
# Per-module kernels


class _LigerRMSNorm:
    """Mixin for transformers' Qwen3 RMSNorms: the forward as one fused kernel."""

    weight: torch.Tensor
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _functional().liger_rms_norm(
            hidden_states, self.weight, self.variance_epsilon, offset=0.0, casting_mode="llama", in_place=False
        )


class _LigerSwiGLU:
    """Mixin for SwiGLU MLPs (gate_proj, up_proj, down_proj): SiLU(gate) * up in one fused kernel."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_functional().liger_swiglu(self.gate_proj(x), self.up_proj(x)))


_here = threading.local()  # .depth: attention modules with kernels on running in this thread


class _LigerAttention:
    """Mixin for attention modules: while one runs, the RoPE dispatcher uses Liger's kernel."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _here.depth = getattr(_here, "depth", 0) + 1
        try:
            return nn.Module.__call__(self, *args, **kwargs)
        finally:
            _here.depth -= 1


def _rope_dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_rotary_pos_emb(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(_here, "depth", 0) > 0 and q.is_cuda:
            return _functional().liger_rope(q, k, cos, sin, None, unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


for _model_type, _module in SUPPORTED.items():
    patch = patching.patch(
        f"{_module}:apply_rotary_pos_emb",
        reason="Liger's fused RoPE kernel for the models given kernels='liger' (nbkit.savers.apply), and only "
        "inside their attention modules; the attention looks this function up in its module, so no per-model "
        "hook exists. Applied while such a model exists",
        upstream="https://github.com/linkedin/Liger-Kernel (apply_liger_kernel_to_qwen3 rebinds it for every "
        "model, irreversibly)",
        group=_GROUP,
    )
    patch(_rope_dispatcher)

# The base models with kernels on: the RoPE patch stays while this is not empty.
_ENABLED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_lock = threading.Lock()


def _norms(decoder: nn.Module) -> list[nn.Module]:
    return [m for m in decoder.modules() if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")]


def _attention(layer: nn.Module) -> nn.Module | None:
    attention = getattr(layer, "self_attn", None)
    return attention if isinstance(attention, nn.Module) else None


def _decoder(model: nn.Module) -> nn.Module:
    base = cast(Any, base_model(model))
    return base.get_decoder() if callable(getattr(base, "get_decoder", None)) else base


def _mixins(model: nn.Module) -> Iterator[tuple[nn.Module, type]]:
    """The modules of `model`'s language model that get a Liger mixin, each with its mixin."""
    for norm in _norms(_decoder(model)):
        yield norm, _LigerRMSNorm
    for layer in decoder_layers(base_model(model)):
        mlp = layer_mlp(layer)
        if mlp is not None:
            yield mlp, _LigerSwiGLU
        attention = _attention(layer)
        if attention is not None:
            yield attention, _LigerAttention


def enable(model: nn.Module) -> None:
    """Put Liger's RMSNorm, SwiGLU and RoPE kernels into `model`'s language model (bare, peft or DDP-wrapped).

    Raises KernelsError (see check()) with the model unchanged. Idempotent. The fused loss is
    separate: pass `fused_linear_cross_entropy` to nbkit.savers.loss.apply (nbkit.savers.apply does).
    """
    check(model)
    for module, mixin in _mixins(model):
        add_mixin(module, mixin)
    with _lock:
        _ENABLED.add(base_model(model))
        patching.apply(_GROUP)


def disable(model: nn.Module) -> None:
    """Undo enable(): the modules compute as before; the RoPE patch goes when no model has kernels on.

    A no-op where kernels are not on. Call it before removing another mixin from the same MLP
    (nbkit.savers.remove does): the mixins come off in the reverse order they went on.
    """
    for module, mixin in _mixins(model):
        remove_mixin(module, mixin)
    with _lock:
        _ENABLED.discard(base_model(model))
        if not _ENABLED:
            patching.revert(_GROUP)


def is_enabled(model: nn.Module) -> bool:
    """Whether enable() is in effect on `model`."""
    mlp = layer_mlp(decoder_layers(model)[0])
    return mlp is not None and has_mixin(mlp, _LigerSwiGLU)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int,
    num_items_in_batch: torch.Tensor | int | None,
    softcap: float | None,
    compute_dtype: torch.dtype,
    rows: int | None = None,
) -> torch.Tensor:
    """nbkit.training.savers.loss's Kernel computed by Liger's fused linear cross-entropy.

    Takes the prepared rows (hidden [N, H] on the weight's device, labels [N] already shifted) and the
    most rows a chunk may hold (None: about 256 MiB of the 16-bit logits Liger keeps, by
    nbkit.savers.loss.rows_per_chunk, instead of Liger's own 1/75 of the rows; see chunk_mem_const).
    Returns the fp32 loss: the summed token losses over `num_items_in_batch` when given, else over the
    counted tokens (NaN when there are none), as nbkit's chunked loss and transformers do. The logits
    of each chunk are computed in `compute_dtype` (the autocast dtype under autocast).
    """
    h = hidden.to(compute_dtype)
    w = weight.to(compute_dtype)
    b = None if bias is None else bias.to(compute_dtype)
    rows = rows_per_chunk(w.shape[0], rows, logit_bytes=w.element_size())
    # Liger casts nothing itself: the inputs are already in the compute dtype.
    with torch.autocast(hidden.device.type, enabled=False):
        total = _functional().liger_fused_linear_cross_entropy(
            h,
            w,
            labels,
            bias=b,
            ignore_index=ignore_index,
            reduction="sum",
            softcap=softcap,
            chunk_mem_const=chunk_mem_const(rows, h.shape[0], w.shape[0], w.shape[1]),
        )
    if num_items_in_batch is None:
        denominator = (labels != ignore_index).sum().to(torch.float32)
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=total.device).to(torch.float32)
    return total.float() / denominator


def chunk_mem_const(rows: int, tokens: int, vocab: int, hidden: int) -> int:
    """The `chunk_mem_const` that keeps Liger's chunks at or below `rows` rows for `tokens` rows.

    Liger sizes its chunks as next_power_of_2(ceil(tokens / ceil(vocab / (c * hidden)))) rows for
    chunk_mem_const c; its default, 1, bounds a chunk's logits by tokens x hidden elements, which for a
    152K vocabulary means chunks of 1/75 of the tokens (64 rows at 4K tokens) whatever the GPU's memory.
    Here c is the largest whose chunks stay within the largest power of two not above `rows` (at least 1,
    Liger's own choice, where that is smaller still).
    """
    power = 1 << (max(1, rows).bit_length() - 1)
    chunks = -(-tokens // power)  # Liger's divisor ceil(vocab / (c * hidden)) must reach this, no more
    if chunks == 1:
        return max(1, -(-vocab // hidden))
    return max(1, -(-vocab // ((chunks - 1) * hidden)) - 1)
