"""Tiled MLP: the decoder layers' feed-forward blocks run over sequence shards, safely under DDP.

At long sequence lengths the MLP's intermediate activations ((tokens, intermediate_size), several
of them, LoRA dropout copies included) are the largest tensors of a layer. Here the MLP runs on one
sequence shard at a time without keeping them; the backward recomputes each shard and
differentiates it with `torch.autograd.grad`.

DDP safety: the trainable parameters of the MLP (LoRA A/B included) are *inputs* of the autograd
function, the per-shard weight gradients are summed inside its backward and returned once, so every
weight's AccumulateGrad -- and DDP's ready hook on it -- fires exactly once per backward. (Calling
`.backward()` per shard, as Arctic-style tiled MLPs did, fires them once per shard: DDP then fails
with "marked ready twice".)

The function is split in two nodes so that an enclosing non-reentrant checkpoint does not run the
MLP once more for nothing: `_TiledGrad` saves the MLP input and owns the backward, `_TiledRun` only
computes the output. During a checkpoint's recompute, torch stops as soon as the last tensor the
backward needs is saved; that is `_TiledGrad`'s input whenever nothing after the MLP in the layer
saves a tensor (Qwen3, Llama: a residual add), so the recompute skips the MLP's forward. Where a
later op does save the MLP output (Gemma's post-feed-forward norm), the recompute runs it as usual.

Dropout inside the MLP (LoRA dropout) replays identically: the RNG state (CPU and the input's
device) is captured before the first shard and restored for the shard-by-shard recompute. Autocast
is replayed too.

Shard count: given, or automatic. On a CUDA GPU the automatic count is the fewest shards whose
working set (about seven 16-bit (tokens, intermediate_size) tensors per shard) stays under 1/40 of
the memory the process may use there (the card's, or an emulated GPU's, nbkit.emulate), decided
when the saver is enabled. Tiling costs time where memory does not need it (Qwen3-VL-2B at 16K
tokens under the T4 profile: 1.588 s per step in 4 shards against 1.438 s untiled, for 1.01 GiB
less peak; benchmarks/RESULTS.md), so it starts where the MLP's tensors become a real share of the
GPU: for that model past ~4.6K tokens on a 15 GiB T4 (16K: 4 shards, 64K: 15) and past ~24K on an
80 GiB card. Elsewhere (the CPU: tests and debugging, with no device memory to plan against)
ceil(tokens / (2 * hidden_size)), which splits short sequences of tiny models too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, cast

import torch
from torch import nn

from nbkit.training import emulation
from nbkit.training.savers._model import add_mixin, base_model, decoder_layers, has_mixin, layer_mlp, remove_mixin

__all__ = ["automatic_tokens_per_shard", "disable", "enable", "is_tiled", "shard_count", "splits", "tokens_per_shard"]

# Off a GPU, automatic shards hold about this many hidden sizes of tokens each.
_TOKENS_PER_SHARD_PER_HIDDEN = 2
# On a GPU: the untiled MLP, compiled, holds about this many (tokens, intermediate_size) 16-bit tensors at once
# (its projections' outputs, their product and, in the backward, their gradients): 4 shards took 1.01 GiB off
# the peak at 16K tokens of Qwen3-VL-2B under the T4 profile (6.64 -> 5.63 GiB), 3/4 of a working set of
# 7.2 such tensors (192 MiB each) ...
_WORKING_TENSORS = 7
# ... and automatic shards keep that working set under this share of the memory the process may use: on a
# 15 GiB T4, 384 MiB, so 16K tokens of that model run in 4 shards (1.05x unsloth's step at 0.94x its peak,
# against 0.95x at 1.11x untiled); on an 80 GiB card the MLP stays whole up to ~24K tokens.
_MEMORY_SHARE = 1 / 40


def shard_count(
    tokens: int, seq_len: int, hidden_size: int, requested: int | None = None, *, tokens_per_shard: int | None = None
) -> int:
    """How many sequence shards the MLP runs over, at least 1 and at most seq_len.

    `requested` where given; else enough shards of at most `tokens_per_shard` tokens (tokens_per_shard()
    of the MLP, on a GPU); else ceil(tokens / (2 * hidden_size)). Plain integer arithmetic on sizes, so
    that dynamo traces it inside a compiled layer (a guard on the length, no graph break).
    """
    if requested is None:
        per_shard = tokens_per_shard or _TOKENS_PER_SHARD_PER_HIDDEN * hidden_size
        requested = -(-tokens // per_shard)
    return max(1, min(requested, seq_len))


def automatic_tokens_per_shard(usable_bytes: float, intermediate_size: int) -> int:
    """Tokens an automatic shard holds on a GPU where the process may use `usable_bytes`: the most whose
    working set (_WORKING_TENSORS 16-bit (tokens, intermediate_size) tensors) fits _MEMORY_SHARE of it.
    """
    return max(1, int(usable_bytes * _MEMORY_SHARE) // (_WORKING_TENSORS * 2 * max(1, intermediate_size)))


def tokens_per_shard(mlp: nn.Module) -> int | None:
    """automatic_tokens_per_shard() for `mlp` where it lives on a CUDA GPU, None elsewhere (the token rule).

    What the process may use there: the card's memory, or the emulated GPU's (nbkit.emulate).
    """
    device = next((p.device for p in mlp.parameters()), None)
    usable = None if device is None else emulation.usable_bytes(device)
    if usable is None:
        return None
    width = getattr(mlp, "intermediate_size", None) or max(
        (m.out_features for m in mlp.modules() if isinstance(m, nn.Linear)), default=1
    )
    return automatic_tokens_per_shard(usable, width)


def _shard_bounds(seq_len: int, shards: int) -> list[tuple[int, int]]:
    size, extra = divmod(seq_len, shards)
    bounds, start = [], 0
    for i in range(shards):
        length = size + (1 if i < extra else 0)
        bounds.append((start, length))
        start += length
    return bounds


def _forward_shards(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, shards: int) -> torch.Tensor:
    out: torch.Tensor | None = None
    for start, length in _shard_bounds(x.shape[-2], shards):
        y = fn(x.narrow(-2, start, length))
        if out is None:
            if not isinstance(y, torch.Tensor) or y.shape[-2] != length or y.shape[-1] != x.shape[-1]:
                raise ValueError(
                    f"nbkit.savers tiled_mlp needs an MLP that maps (..., seq, hidden) to the same shape; this "
                    f"one returned {type(y).__name__} {tuple(getattr(y, 'shape', ()))} for input "
                    f"{tuple(x.narrow(-2, start, length).shape)}. Use nbkit.savers.apply(..., tiled_mlp=False)."
                )
            out = y.new_empty(x.shape)
        out.narrow(-2, start, length).copy_(y)
    assert out is not None  # _shard_bounds gives at least one shard
    return out


class _RngReplay:
    """The CPU RNG state and that of one accelerator device, captured now, replayable later."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        devices = [self.device] if self.accelerator is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            if self.accelerator is not None:
                torch.cuda.set_rng_state(self.accelerator, self.device)
            yield


def _autocast_like_now(device_type: str) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """A factory of contexts that re-enter the autocast state in effect now for `device_type`."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return functools.partial(torch.autocast, device_type, dtype=torch.get_autocast_dtype(device_type))
    return contextlib.nullcontext


class _TiledGrad(torch.autograd.Function):
    """Takes the MLP input and trainable parameters, returns an alias of the input for _TiledRun.

    Its backward receives the gradient of the MLP *output* (passed through by _TiledRun) and
    returns the gradients of the input and of every parameter, each computed once.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], shards: int, *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.fn, ctx.shards, ctx.params = fn, shards, params
        ctx.rng = _RngReplay(x.device)
        ctx.autocast = _autocast_like_now(x.device.type)
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        wanted = [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:]) if need]
        grad_x = torch.empty_like(x) if need_x else None
        grad_params: list[torch.Tensor | None] = [None] * len(wanted)
        with ctx.rng.replay(), ctx.autocast():
            # Shards in forward order: each consumes the RNG exactly as it did in the forward.
            for start, length in _shard_bounds(x.shape[-2], ctx.shards):
                piece = x.narrow(-2, start, length).detach().requires_grad_(need_x)
                with torch.enable_grad():
                    y = ctx.fn(piece)
                inputs = ([piece] if need_x else []) + wanted
                grads = torch.autograd.grad(
                    y, inputs, grad_out.narrow(-2, start, length).to(y.dtype), allow_unused=True
                )
                if grad_x is not None:
                    grad_x.narrow(-2, start, length).copy_(grads[0])
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    summed = grad_params[i]
                    if g is not None:
                        grad_params[i] = g if summed is None else summed + g
        by_param = iter(grad_params)
        return (grad_x, None, None, *(next(by_param) if need else None for need in ctx.needs_input_grad[3:]))


class _TiledRun(torch.autograd.Function):
    """Runs the MLP shard by shard (no graph kept); passes the output gradient to _TiledGrad unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], shards: int) -> torch.Tensor:
        return _forward_shards(fn, x, shards)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad_out, None, None


def _run_tiled(mlp: nn.Module, x: torch.Tensor, shards: int) -> torch.Tensor:
    """`mlp` on `x` in `shards` sequence shards. Never traced (_TiledMLP calls it through torch.compiler.disable):
    inside a compiled layer the graph breaks here (dynamo cannot trace the RNG capture or the backward's
    autograd.grad) and the shards run eagerly.
    """
    call = functools.partial(nn.Module.__call__, mlp)
    params = [p for p in mlp.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and (x.requires_grad or params):
        return _TiledRun.apply(_TiledGrad.apply(x, call, shards, *params), call, shards)
    return _forward_shards(call, x, shards)


class _TiledMLP:
    """Mixin for feed-forward blocks: a call on one (..., seq, hidden) tensor runs tiled."""

    _nbkit_shards: int | None  # requested, or None: automatic
    _nbkit_tokens: int | None  # tokens per automatic shard on a GPU (tokens_per_shard), decided at enable()
    # _run_tiled as torch.compiler.disable wraps it, set by the first enable(): wrapping it at import imported
    # torch._dynamo (a second of CPU) in every rank nbkit starts, which imports the savers and mostly never tiles.
    _nbkit_run: ClassVar[Callable[[nn.Module, torch.Tensor, int], torch.Tensor]]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            return nn.Module.__call__(cast(nn.Module, self), *args, **kwargs)
        x = args[0]
        shards = self._nbkit_shards_for(x)
        if shards == 1:
            return nn.Module.__call__(cast(nn.Module, self), x)
        return type(self)._nbkit_run(cast(nn.Module, self), x, shards)

    def _nbkit_shards_for(self, x: torch.Tensor) -> int:
        tokens = x.numel() // x.shape[-1]
        return shard_count(tokens, x.shape[-2], x.shape[-1], self._nbkit_shards, tokens_per_shard=self._nbkit_tokens)


def splits(layer: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether the tiled MLP of decoder `layer` runs in more than one shard for a layer input shaped like
    `hidden_states` (the MLP's input has the layer's shape). False where the MLP is not tiled.
    """
    mlp = layer_mlp(layer)
    return isinstance(mlp, _TiledMLP) and hidden_states.dim() >= 2 and mlp._nbkit_shards_for(hidden_states) > 1


def enable(model: nn.Module, *, shards: int | None = None) -> None:
    """Tile the MLP of every decoder layer of `model`.

    Mixture-of-experts blocks (an `experts` attribute) are left alone. Replaces a previous setting
    of this saver.

    Args:
        model: a transformers model, bare, peft- or DDP-wrapped.
        shards: a fixed shard count, or None for automatic (shard_count).

    Raises:
        ValueError: for shards below 1, or when the decoder layers cannot be found.
    """
    if shards is not None and shards < 1:
        raise ValueError(f"tiled_mlp shard count must be at least 1, got {shards}.")
    if not hasattr(_TiledMLP, "_nbkit_run"):
        _TiledMLP._nbkit_run = torch.compiler.disable(_run_tiled)
    for layer in decoder_layers(base_model(model)):
        mlp = layer_mlp(layer)
        if mlp is None or hasattr(mlp, "experts"):
            continue
        cast(Any, mlp)._nbkit_shards = shards
        cast(Any, mlp)._nbkit_tokens = tokens_per_shard(mlp)
        add_mixin(mlp, _TiledMLP)


def is_tiled(mlp: nn.Module) -> bool:
    """Whether enable() tiled this feed-forward block (other savers' mixins may sit on top of it)."""
    return isinstance(mlp, _TiledMLP)


def disable(model: nn.Module) -> None:
    """Undo enable(); a no-op where it was not enabled."""
    for layer in decoder_layers(base_model(model)):
        mlp = layer_mlp(layer)
        if mlp is not None and has_mixin(mlp, _TiledMLP):
            remove_mixin(mlp, _TiledMLP)
            del mlp._nbkit_shards, mlp._nbkit_tokens
