"""Training steps for the benchmarks: DDP wrapping with the benchmark's options, the probe step, timed steps."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from benchmarks.cases import DDP_DEFAULTS, PRECISIONS, ddp_argument_names


def wrap_ddp(
    model: nn.Module, device: torch.device, options: Iterable[tuple[str, Any]] = (), *, unused: Iterable[str] = ()
) -> nn.Module:
    """`model` in DistributedDataParallel with `options` (see parse_ddp_options), or in FlatGradients with
    reducer=flat; `model` itself when torch.distributed is not initialised or has one rank.

    `unused`: names of trainable parameters the probe step left without a gradient; they decide
    find_unused_parameters="auto" and are the ones freeze_unused freezes (undo with
    `unfreeze(model, names)`). Raises ValueError for an option this torch's DDP does not take.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    options = dict(DDP_DEFAULTS, **dict(options))
    unused = set(unused)
    freeze = bool(options.pop("freeze_unused"))
    hook = options.pop("comm_hook", None)
    reducer = options.pop("reducer", None)
    if freeze and unused:
        for name, param in model.named_parameters():
            if name in unused:
                param.requires_grad_(False)
        unused = set()
    if reducer == "flat":
        return FlatGradients(model)
    if options["find_unused_parameters"] == "auto":
        options["find_unused_parameters"] = bool(unused)
    bad = set(options) - ddp_argument_names()
    if bad:
        raise ValueError(f"This torch's DistributedDataParallel takes no {', '.join(sorted(bad))}.")
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **options)
    if hook is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        wrapped.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
    return wrapped


class FlatGradients(nn.Module):
    """`module` trained on every rank with its gradients averaged by one all-reduce of one flat buffer per dtype,
    which Stepper calls (reduce_gradients) after a step's last backward, in place of DDP's reducer.

    Why: DDP hooks every trainable tensor and copies each gradient into a bucket and back; for LoRA's many small
    tensors that is 3 more data-moving ops per tensor per step (392 tensors of a 28-layer model: 1,178 more copies
    and multiplies, counted by benchmarks/ddp_op_count.py, each a kernel launch on a GPU), where this is a handful.
    The averaging is nbkit's own (nbkit.training.gradient_averaging.FlatAverager, what a Trainer's DDP ranks use), so
    the gradients equal DDP's; starts every rank from rank 0's values, as DDP does; a gradient that is None on a rank
    counts as zeros here. Leaves each gradient a view of the flat buffer.
    """

    def __init__(self, module: nn.Module):
        import torch.distributed as dist

        from nbkit.training.gradient_averaging import FlatAverager

        super().__init__()
        self.module = module
        self._params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._averager = FlatAverager(self._params)
        # Every parameter and buffer, frozen or not, as DDP's start does; one by one, so that no copy of the whole
        # model is made (once per run: the count of broadcasts does not matter).
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, 0)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradient accumulation: nothing is sent until reduce_gradients, so there is nothing to hold back."""
        return contextlib.nullcontext()

    def reduce_gradients(self) -> None:
        """Average every trainable tensor's gradient over the ranks (a collective: call on every rank)."""
        for _, param in self._params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        self._averager.average()


def unfreeze(model: nn.Module, names: Iterable[str]) -> None:
    """Make the named parameters trainable again (after wrap_ddp's freeze_unused)."""
    names = set(names)
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(True)


class Stepper:
    """One optimisation step of `model` as a Trainer does it: autocast forward, backward, AdamW.

    Takes the model (bare, peft or DDP-wrapped; called as model(**batch).loss), the precision
    ("bf16"/"fp16" autocast, fp16 with a GradScaler; "fp32" none), the device, the optimizer
    (default: AdamW over the trainable parameters, fused on CUDA, lr 1e-4), and the number of
    micro-batches per optimisation step (gradient accumulation: DDP all-reduces on the last one
    only, as Trainer's gradient_accumulation_steps does; each micro-batch is the same batch).
    """

    def __init__(
        self,
        model: nn.Module,
        precision: str,
        device: torch.device,
        optimizer: torch.optim.Optimizer | None = None,
        lr: float = 1e-4,
        grad_accum: int = 1,
    ):
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be at least 1 (got {grad_accum}).")
        self.model = model
        self.grad_accum = grad_accum
        self.device = device
        self.dtype = PRECISIONS[precision] if precision != "fp32" else None
        params = [p for p in model.parameters() if p.requires_grad]
        if optimizer is None:
            optimizer = torch.optim.AdamW(params, lr=lr, fused=device.type == "cuda")
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, batch: dict[str, torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """Forward and backward only (gradients accumulate, the loss multiplied by `scale`);
        returns the detached, unscaled loss.
        """
        with self._autocast():
            loss = self.model(**batch).loss
        scaled = loss * scale if scale != 1.0 else loss
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return loss.detach()

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A full optimisation step over grad_accum micro-batches; returns the last detached loss."""
        for _ in range(self.grad_accum - 1):
            no_sync = getattr(self.model, "no_sync", contextlib.nullcontext)  # DDP: no all-reduce yet
            with no_sync():
                self.backward(batch, 1.0 / self.grad_accum)
        loss = self.backward(batch, 1.0 / self.grad_accum)
        reduce = getattr(self.model, "reduce_gradients", None)  # FlatGradients: the step's one all-reduce
        if reduce is not None:
            reduce()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def probe(stepper: Stepper, batch: dict[str, torch.Tensor]) -> list[str]:
    """One forward and backward of the bare model (no optimizer step); returns the names of the
    trainable parameters that got no gradient (the unused ones DDP must be told about). Leaves
    every gradient cleared.
    """
    stepper.backward(batch)
    sync(stepper.device)
    unused = [n for n, p in stepper.model.named_parameters() if p.requires_grad and p.grad is None]
    stepper.model.zero_grad(set_to_none=True)
    return unused


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(stepper: Stepper, batch: dict[str, torch.Tensor], steps: int) -> tuple[list[float], list[float]]:
    """Run `steps` optimisation steps; returns (seconds per step, loss per step). Each step ends
    with the device synchronised, so its time is the step's own.
    """
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = stepper.step(batch)
        losses.append(float(loss))
        sync(stepper.device)
        times.append(time.perf_counter() - start)
    return times, losses
