"""Chunked linear cross-entropy: the causal-LM loss without the (tokens, vocab) logits.

A causal LM's loss needs `hidden @ lm_head.weight.T`: at 16K tokens and a 152K vocabulary that is
10 GB of fp32 logits plus as much again for their gradient, more than the rest of a LoRA step.
`linear_cross_entropy` computes the same loss a chunk of rows at a time; each chunk's logits are
turned into that chunk's gradients straight away (softmax minus one-hot), so the peak extra memory
is about two fp32 chunks of logits and nothing of size (tokens, vocab) is ever allocated or saved.
Rows whose label is ignored are skipped entirely (prompt and image tokens cost nothing). A chunk holds
a few hundred rows (rows_per_chunk): each one reads the whole lm_head weight, so smaller chunks would
cost more in those reads than the loss's FLOPs.

Gradients are exact, not approximations: values and gradients equal transformers' `ForCausalLMLoss`
to fp32 rounding. The weight (and bias) gradient is returned from one backward node, so it is
accumulated exactly once per backward and DDP's hook on it fires once.

Devices: the hidden states are moved to the lm_head's device with a differentiable `.to`, so a model
split over GPUs (hidden states on cuda:1, lm_head on cuda:0) gets its gradient back on cuda:1.

`apply(model)` makes `model(**batch, labels=labels).loss` use it for transformers causal LMs and
VLMs, bare or inside peft, without touching their forward code: while labels are given and grad is
enabled, the lm_head is handed only the last position (so the model's own code builds logits of
shape (batch, 1, vocab), exactly as with `logits_to_keep=1`), and the model's `loss_function`
computes the loss from the full hidden states it was about to project.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from nbkit.platform import compat
from nbkit.training.savers._model import base_model

__all__ = ["BYTES_PER_LOGIT", "Kernel", "apply", "is_applied", "linear_cross_entropy", "remove", "rows_per_chunk"]

# At its peak a chunk of nbkit's loop holds its fp32 logits and logsumexp's fp32 temporary of their size; their
# 16-bit copy and 16-bit gradient are smaller and come at other moments (nbkit.plan models the loss's peak with this).
BYTES_PER_LOGIT = 4 + 4
# A chunk's logits take about this many bytes: rows_per_chunk's default. Each chunk reads the whole lm_head
# weight twice (logits, then the hidden states' gradient), so a chunk needs a few hundred rows before its
# matmuls are bound by FLOPs rather than by those reads. Measured on one H100 (benchmarks/RESULTS.md, "The
# loss's chunks, and layers compiled with their checkpoint inside"), Qwen3-VL-2B's head, forward + backward of
# 4K tokens: nbkit's loop 20.0 ms at 512 rows against 18.8 ms in one chunk of 4.2 GiB and 42.9 ms at 64 rows;
# Liger's fused loss 8.8 ms at 512 rows (its default here: 16-bit logits) against 8.3 ms in one chunk and
# 32.3 ms at 64, its own choice for that vocabulary.
_CHUNK_BYTES = 256 * 2**20

# The loss of prepared rows: (hidden [N, H] on the weight's device, weight [V, H], bias [V] or None,
# labels [N] already shifted, ignore_index, num_items_in_batch, softcap, compute dtype, rows per chunk
# or None) -> fp32 scalar, with linear_cross_entropy's normalisation and gradients (each accumulated
# once per backward). A kernel keeps its chunks at or below the rows it is given; None: the kernel's
# own default, rows_per_chunk for the bytes its logits take.
Kernel = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor,
        int,
        torch.Tensor | int | None,
        float | None,
        torch.dtype,
        int | None,
    ],
    torch.Tensor,
]


def rows_per_chunk(vocab: int, requested: int | None = None, *, logit_bytes: int = 4) -> int:
    """Rows of logits per chunk: `requested`, or as many as make one chunk's logits about 256 MiB at
    `logit_bytes` per logit (4: nbkit's fp32 logits; Liger's fused loss keeps 16-bit ones, 2).

    nbkit.plan models the loss's peak memory with this same number.

    Raises:
        ValueError: for a requested size below 1.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"chunk_size must be a positive number of rows, not {requested}.")
        return requested
    return max(1, _CHUNK_BYTES // (logit_bytes * vocab))


def _chunked_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    ignore_index: int,
    num_items: torch.Tensor | int | None,
    softcap: float | None,
    rows: int,
    compute_dtype: torch.dtype,
    want: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Loss and (as `want` asks) the gradients for hidden [N, H], weight and bias, one chunk at a time.

    labels [N] are already shifted and on hidden's device. Returns (loss, grad_hidden, grad_weight,
    grad_bias, denominator) with the gradients of a backward that starts from d(loss) = 1, except that
    grad_hidden is not yet divided by the denominator (the counted tokens or num_items): in fp16 a
    gradient of size 1/denominator falls below the smallest normal number (6e-5) at a few thousand
    tokens and loses its digits before fp16 training's loss scale could lift it. The backward divides,
    in fp32, together with the loss scale.
    """
    want_hidden, want_weight, want_bias = want
    device = hidden.device
    valid = (labels != ignore_index).nonzero().squeeze(1)
    if num_items is None:
        denominator = torch.tensor(float(valid.numel()), device=device)
    else:
        denominator = torch.as_tensor(num_items, device=device).to(torch.float32)
    w = weight.to(compute_dtype)
    b = None if bias is None else bias.to(compute_dtype)

    total = torch.zeros((), dtype=torch.float32, device=device)
    grad_hidden = torch.zeros_like(hidden) if want_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device) if want_weight else None
    grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=device) if want_bias and bias is not None else None
    scale = 1.0 / denominator

    def chunk(index: torch.Tensor) -> torch.Tensor:
        """The loss summed over the rows `index`, their gradients added in place. A chunk's buffers end with this
        call: kept in the loop's variables into the next chunk, the last chunk's fp32 logits and 16-bit gradient
        sat beside the next one's logits, 12 bytes per logit at the peak instead of BYTES_PER_LOGIT's 8.
        """
        h = hidden.index_select(0, index).to(compute_dtype)
        target = labels.index_select(0, index).unsqueeze(1)
        # Logits in the compute dtype (as the lm_head makes them), everything after in fp32.
        logits = F.linear(h, w, b).float()
        if softcap is not None:
            tanh = logits.div_(softcap).tanh_()
            logits = tanh * softcap
        lse = torch.logsumexp(logits, dim=1, keepdim=True)
        summed = (lse - logits.gather(1, target)).sum()
        if not any(want):
            return summed
        # d loss / d logits = (softmax - one_hot) / denominator, built in place in the logits buffer; the
        # division waits until after the 16-bit matmuls (see the docstring), the weight's and bias's in fp32.
        grad_logits = logits.sub_(lse).exp_()
        grad_logits.scatter_add_(1, target, torch.full_like(target, -1, dtype=torch.float32))
        if softcap is not None:
            # d(c * tanh(x / c)) / dx = 1 - tanh(x / c)^2
            grad_logits.mul_(tanh.square_().neg_().add_(1))
            del tanh
        if grad_bias is not None:
            grad_bias.add_(grad_logits.sum(0).mul_(scale))
        grad_logits = grad_logits.to(compute_dtype)
        if grad_hidden is not None:
            grad_hidden.index_copy_(0, index, (grad_logits @ w).to(hidden.dtype))
        if grad_weight is not None:
            grad_weight.add_((grad_logits.t() @ h).float().mul_(scale))
        return summed

    for start in range(0, valid.numel(), rows):
        total += chunk(valid[start : start + rows])
    loss = total / denominator
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None and bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return loss, grad_hidden, grad_weight, grad_bias, denominator


class _LinearCrossEntropy(torch.autograd.Function):
    """One backward node for the whole loss; gradients are computed in the forward, chunk by chunk."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        options: dict[str, Any],
    ) -> torch.Tensor:
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        # The compute dtype was fixed by the caller; autocast must not cast a second time in here.
        with torch.autocast(hidden.device.type, enabled=False):
            loss, grad_hidden, grad_weight, grad_bias, denominator = _chunked_pass(
                hidden, weight, bias, labels, want=want, **options
            )
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, denominator)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight, grad_bias, denominator = ctx.saved_tensors
        # In fp32: under fp16 training grad_loss is the loss scale (65536 at first), which fp16 cannot hold.
        factors = (grad_loss.float() / denominator, grad_loss.float(), grad_loss.float())
        grads = tuple(
            None if g is None else (g.float() * f.to(g.device)).to(g.dtype)
            for g, f in zip((grad_hidden, grad_weight, grad_bias), factors, strict=True)
        )
        return (*grads, None, None)


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    shift: bool = True,
    kernel: Kernel | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden_states @ weight.T + bias` against `labels`, without the full logits.

    The logits are computed in the weight's dtype (the autocast dtype under autocast), then upcast:
    logsumexp and all accumulation are fp32. Gradients flow to hidden_states (arriving on
    hidden_states' own device) and to weight / bias only where they require grad, each accumulated
    once per backward. Runs on whichever rank calls it; no communication.

    Args:
        hidden_states: (..., H); may sit on another device than the weight.
        weight: the lm_head weight (V, H).
        labels: (...), the same leading shape as hidden_states.
        bias: the lm_head bias (V,), if any.
        ignore_index: labels equal to it do not count.
        num_items_in_batch: the divisor of the summed loss (transformers' gradient-accumulation
            normalisation), or Trainer's copies of it, one per GPU; None: the number of counted tokens.
        softcap: c applies `c * tanh(logits / c)` first (Gemma 2's `final_logit_softcapping`).
        chunk_size: rows per chunk (default: rows_per_chunk, about 256 MiB of logits).
        shift: True predicts token t+1 from position t, exactly like transformers' causal-LM loss;
            False takes labels that are already aligned (transformers' `shift_labels`).
        kernel: computes the loss of the prepared rows instead of nbkit's chunked loop (see `Kernel`;
            nbkit.savers.liger passes Liger's fused linear cross-entropy); the contract holds either way.

    Returns:
        A float32 scalar on the weight's device: the summed loss divided by `num_items_in_batch`
        when given, else the mean over counted tokens (NaN if there are none, as in transformers).

    Raises:
        ValueError: when the shapes of hidden_states and labels do not match.
    """
    device = weight.device
    hidden = hidden_states.to(device)
    labels = labels.to(device)
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"linear_cross_entropy needs one label per hidden state: hidden_states {tuple(hidden.shape)} "
            f"vs labels {tuple(labels.shape)}."
        )
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() > 1:
        # Trainer in a process that sees n GPUs hands over the count n times (copies for DataParallel's
        # replicas) even where it does not replicate the model: a 4-bit model, or one that device_map
        # placed on one of them. Its own loss then comes out n times and is averaged; one copy is the same.
        num_items_in_batch = num_items_in_batch.reshape(-1)[0]
    compute_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else weight.dtype
    if kernel is not None:
        return kernel(
            hidden, weight, bias, labels, ignore_index, num_items_in_batch, softcap, compute_dtype, chunk_size
        )
    options: dict[str, Any] = dict(
        ignore_index=ignore_index,
        num_items=num_items_in_batch,
        softcap=softcap,
        rows=rows_per_chunk(weight.shape[0], chunk_size),
        compute_dtype=compute_dtype,
    )
    tensors = (hidden, weight) if bias is None else (hidden, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _LinearCrossEntropy.apply(hidden, weight, bias, labels, options)
    return _chunked_pass(hidden, weight, bias, labels, want=(False, False, False), **options)[0]


# --------------------------------------------------------------------------------------------------
# Making model(**batch, labels=...).loss use it


class _Head:
    """Per-model state of an applied chunked loss (kept on the transformers model as `_nbkit_chunked_loss`)."""

    ATTR = "_nbkit_chunked_loss"

    def __init__(self, model: nn.Module) -> None:
        self.model: Any = model  # a transformers model: its methods are not nn.Module's
        config: Any = model.config
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None)
        # One frame per forward in progress of a hooked model (the transformers model, its peft wrapper):
        # whether that call may use the chunked loss, and what the lm_head handed over.
        self.frames: list[dict[str, Any]] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.wrappers: list[int] = []  # ids of the outer modules (peft wrappers) hooked
        self.checked = False
        self.own_loss = model.__dict__.get("_loss_function", _MISSING)
        self.kernel: Kernel | None = None  # set by apply(); None: nbkit's chunked loop
        self.previous_loss = cast(Callable[..., torch.Tensor], model.loss_function)

    # hooks on a model (the transformers model or a wrapper around it)
    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        keep = kwargs.get("logits_to_keep")
        armed = (
            kwargs.get("labels") is not None
            and torch.is_grad_enabled()
            and (keep is None or (isinstance(keep, int) and keep == 0))
        )
        self.frames.append({"armed": armed, "head": None})

    def leave(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        frame = self.frames.pop() if self.frames else None
        # output is None when the forward raised; then only clean up.
        if frame is not None and frame["head"] is not None and output is not None:
            raise RuntimeError(
                f"nbkit's chunked loss handed {type(self.model).__name__}'s lm_head only the last position, "
                "but the model never called self.loss_function, so its loss (if any) was computed from those "
                "truncated logits. This model computes its loss in its own way: turn the chunked loss off "
                "with nbkit.savers.apply(model, chunked_loss=False) or nbkit.savers.loss.remove(model)."
            )

    # hook on the lm_head
    def head_input(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        frame = self.frames[-1] if self.frames else None
        if frame is None or not frame["armed"] or frame["head"] is not None or not args:
            return None
        # Only the plain nn.Linear the model projects with: a peft LoRA or modules_to_save wrapper around
        # it (which is what get_output_embeddings returns then), a quantised head or an offloaded weight
        # would need the wrapper's own forward, so those keep their full logits.
        if module is not self.model.get_output_embeddings() or type(module).forward is not nn.Linear.forward:
            return None
        if module.weight.device.type == "meta":
            return None
        hidden = args[0]
        frame["head"] = (hidden, module.weight, module.bias)
        return (hidden[..., -1:, :], *args[1:])

    # the model's loss_function while applied
    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        frame = self.frames[-1] if self.frames else None
        if frame is None or frame["head"] is None:
            return self.previous_loss(logits, labels, *args, **kwargs)
        hidden, weight, bias = frame["head"]
        frame["head"] = None
        bound = _LOSS_SIGNATURE.bind(logits, labels, *args, **kwargs).arguments
        if not self.checked:
            self._check_logits(logits, hidden, weight, bias)
        shift_labels = bound.get("shift_labels")
        return linear_cross_entropy(
            hidden,
            weight,
            labels if shift_labels is None else shift_labels,
            bias=bias,
            ignore_index=bound.get("ignore_index", -100),
            num_items_in_batch=bound.get("num_items_in_batch"),
            softcap=self.softcap,
            shift=shift_labels is None,
            kernel=self.kernel,
        )

    def _check_logits(
        self, logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        """Once per model: the last position's logits as the model made them must be ours, else the model
        transforms its logits in a way this loss does not reproduce (a scale, a cap it does not declare).
        """
        with torch.no_grad():
            ours = F.linear(hidden[..., -1:, :].to(weight.device), weight, bias).float()
            if self.softcap is not None:
                ours = torch.tanh(ours / self.softcap) * self.softcap
            theirs = logits.detach().float().to(ours.device)
            tol = 1e-4 if weight.dtype == torch.float32 else 3e-2
            same = theirs.shape == ours.shape and torch.allclose(
                theirs, ours, rtol=tol, atol=tol * max(1.0, ours.abs().max().item())
            )
        if not same:
            difference = (theirs - ours).abs().max().item() if theirs.shape == ours.shape else "shape"
            raise RuntimeError(
                f"nbkit's chunked loss cannot reproduce {type(self.model).__name__}'s logits (largest "
                f"difference: {difference}): the model transforms them between its lm_head and its loss in a "
                "way nbkit does not know. Turn the chunked loss off for this model with "
                "nbkit.savers.apply(model, chunked_loss=False) or nbkit.savers.loss.remove(model)."
            )
        self.checked = True

    def hook_model(self, module: nn.Module) -> None:
        self.handles.append(module.register_forward_pre_hook(self.enter, with_kwargs=True))
        self.handles.append(module.register_forward_hook(self.leave, with_kwargs=True, always_call=True))


_MISSING = object()


def _reference_loss(
    logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """Signature of transformers' ForCausalLMLoss, used only to read the arguments the model passed."""


_LOSS_SIGNATURE = inspect.signature(_reference_loss)


def _outer_modules(model: nn.Module, inner: nn.Module) -> list[nn.Module]:
    """The wrappers between `model` and the transformers model (peft), outermost first, DDP excluded."""
    outer = []
    while model is not inner:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
            continue
        outer.append(model)
        model = cast(Any, model).get_base_model()
    return outer


def apply(model: nn.Module, *, kernel: Kernel | None = None) -> None:
    """Make `model(**batch, labels=labels).loss` use `linear_cross_entropy`. Idempotent.

    While a forward gets `labels` with grad enabled (and no `logits_to_keep`), the loss is computed
    in chunks from the hidden states and the real lm_head weight, with the model's
    `final_logit_softcapping` and the `num_items_in_batch`, `ignore_index` and `shift_labels` the
    caller passes; `.logits` of that output then holds only the last position's logits, shape
    (batch, 1, vocab), as with `logits_to_keep=1`. Without labels, or under torch.no_grad()
    (evaluation, generation), the model runs unchanged with full logits. A head that is not a plain
    nn.Linear (LoRA on lm_head, modules_to_save, quantised) keeps full logits. Call it on every rank
    (or before launching); it adds forward hooks and sets the model's `loss_function`, nothing
    global.

    Args:
        model: a transformers causal LM or VLM (anything with an lm_head from
            `get_output_embeddings()` and a `loss_function`), bare or wrapped in peft and/or DDP.
        kernel: what computes the loss of the prepared rows (see `Kernel`); None is nbkit's chunked
            loop. Applying again with another kernel switches to it.

    Raises:
        ValueError: for a model without output embeddings.
        RuntimeError: at the first chunked call, if the model transforms its logits in a way not
            reproduced here (its last-position logits are checked against this loss's).
    """
    inner = base_model(model)
    get_output_embeddings = getattr(inner, "get_output_embeddings", None)
    head = get_output_embeddings() if callable(get_output_embeddings) else None
    if not isinstance(head, nn.Module) or not hasattr(type(inner), "loss_function"):
        raise ValueError(
            f"nbkit's chunked loss needs a transformers causal LM or VLM with an lm_head and a loss_function; "
            f"{type(inner).__name__} has none. Use nbkit.savers.apply(model, chunked_loss=False)."
        )
    # trl 0.x computes metrics from full logits, which this loss does not keep
    compat.enable(chunked_loss=is_applied)
    state: _Head | None = getattr(inner, _Head.ATTR, None)
    if state is None:
        state = _Head(inner)
        state.hook_model(inner)
        state.handles.append(head.register_forward_pre_hook(state.head_input))
        cast(Any, inner).loss_function = state.loss_function
        setattr(inner, _Head.ATTR, state)
    state.kernel = kernel
    # peft releases before 0.19 call the inner model's forward() directly, skipping its hooks; the
    # wrapper's hooks see the labels there.
    for wrapper in _outer_modules(model, inner):
        if id(wrapper) not in state.wrappers:
            state.hook_model(wrapper)
            state.wrappers.append(id(wrapper))


def remove(model: nn.Module) -> None:
    """Undo apply(): remove the hooks and restore the model's loss_function exactly. No-op if not applied."""
    inner = base_model(model)
    state: _Head | None = getattr(inner, _Head.ATTR, None)
    if state is None:
        return
    for handle in state.handles:
        handle.remove()
    if state.own_loss is _MISSING:
        del inner._loss_function
    else:
        inner._loss_function = state.own_loss
    delattr(inner, _Head.ATTR)


def is_applied(model: nn.Module) -> bool:
    """Whether apply() is in effect on this model."""
    return getattr(base_model(model), _Head.ATTR, None) is not None
