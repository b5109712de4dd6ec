"""A Trainer's DDP gradients averaged by one all-reduce per step, in place of DDP's reducer.

Why: at the notebooks' shapes (1K tokens x 4 on a fast GPU) a two-GPU step is bound by host work, and DDP's reducer
adds host work for every trainable tensor: it copies each gradient into a bucket, divides it and copies it back,
about three kernel launches per tensor per step, 1,178 for the 392 LoRA tensors of a 28-layer model
(benchmarks/ddp_op_count.py), and it broadcasts the model's buffers before every forward. One flat all-reduce after
the backward launches a handful. Under SFTTrainer through nbkit.launch on 2x H200 at 1K x 4 the median two-GPU step
fell 12-14% (transformers 0.336 -> 0.289 s, unsloth 0.407 -> 0.355 s, transformers without checkpointing 0.280 ->
0.246 s; faster in six of seven pairs of launches); in a live set it made no difference (0.341 against 0.335 s, two
pairs): benchmarks/RESULTS.md.

How: DDP keeps its wrapper (model.module, no_sync(), rank 0's weights broadcast at the start: what Trainer, peft
and nbkit's savers expect), but its reducer stays idle, since the model is left in DDP's no-sync state. When the
backward of a step's last micro-batch ends (accelerate's backward, where Trainer's and unsloth's training steps
end theirs, with `sync_gradients` set), each dtype's gradients are averaged by one all-reduce of one flat buffer,
each rank's share divided by the world size before the sum as DDP does, so they equal DDP's; each gradient is then
a view of that buffer, until Trainer's zero_grad() drops it.

Where: models that a Trainer's accelerator wraps in DDP, with no static graph, no communication hook, every
trainable weight on one device, no batch norm (DDP broadcasts buffers before each forward, which only modules that
change their buffers in training need), and at most FLAT_LIMIT_BYTES of trainable weights: a larger set (full
fine-tuning) gains from DDP's overlap of its bucketed all-reduces with the backward, which one all-reduce after the
backward gives up. Everything else, and every model where `nbkit.configure(ddp_reducer="ddp")` was set, keeps DDP's
reducer. A loop of the user's own keeps it too: one that calls loss.backward() itself would never reach the averaging.

Weights a step may leave unused: with find_unused_parameters=False (Trainer's choice under checkpointing, and
nbkit's for LoRA on the language layers) a weight without a gradient on one rank is an error, as under DDP. With
True (Trainer's choice without checkpointing), such a weight counts as a zero gradient, and a weight no rank used
keeps no gradient, as DDP leaves it: a used-weight flag per tensor travels in the same all-reduce, and the host
reads them back, one sync per step where DDP also makes one (its reducer copies its used-weight map to the host)
and where DDP's search of the autograd graph after every forward is gone.

The cost: the all-reduce no longer overlaps the backward. Over NVLink LoRA's gradients (70 MB for Qwen3-VL-2B at
r=16) take well under a millisecond; between two T4s over PCIe, at 5-10 GB/s, about 7-14 ms, near 1% of a T4's
step at these shapes (an estimate: no T4 was at hand), where the host work it saves hides under the GPU's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from nbkit.platform import config
from nbkit.platform.patching import patch

__all__ = ["FLAT_LIMIT_BYTES", "FlatAverager", "averager", "eligible", "mode"]

# Above this many bytes of trainable weights, DDP's reducer stays (see the module docstring). LoRA r=16 on every
# linear layer of a 14B model holds 64M weights, 256 MiB in fp32; full fine-tuning of even a 0.5B model holds more.
FLAT_LIMIT_BYTES = 512 * 2**20


class FlatAverager:
    """Averages the gradients of `params` over `process_group` by one all-reduce per dtype and device.

    Takes the trainable tensors of one model with their names, in the same order on every rank, and whether a
    step may leave some unused (DDP's find_unused_parameters). `average()` is a collective: every rank calls it
    once per optimisation step, after that step's last backward.
    """

    def __init__(
        self, params: list[tuple[str, torch.Tensor]], process_group: Any = None, find_unused: bool = False
    ) -> None:
        import torch.distributed as dist

        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.find_unused = find_unused
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for _, param in params:
            groups.setdefault((param.device, param.dtype), []).append(param)
        self._groups = list(groups.values())
        self._names = {id(param): name for name, param in params}

    @torch.no_grad()
    def average(self) -> None:
        """Replace every gradient by its mean over the ranks (each a view of one flat buffer per dtype); with
        find_unused, a weight without a gradient counts as zero, and one that no rank used keeps none.

        Raises:
            nbkit.GradientError: without find_unused, a trainable weight has no gradient on this rank (DDP with
                find_unused_parameters=False fails there too, a step later).
        """
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for group in self._groups:
            used = [p.grad is not None for p in group]
            if not self.find_unused and not all(used):
                raise _no_gradient([self._names[id(p)] for p, u in zip(group, used) if not u])
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
            if self.find_unused:  # the used-weight flags ride at the end of the same buffer
                grads.append(torch.tensor(used, dtype=group[0].dtype, device=group[0].device))
            flat = _flatten_dense_tensors(grads).div_(self.world_size)
            dist.all_reduce(flat, group=self.process_group)
            views = list(_unflatten_dense_tensors(flat, grads))
            anyone_used = views.pop().ne(0).tolist() if self.find_unused else used
            for param, grad, kept in zip(group, views, anyone_used):
                param.grad = grad if kept else None


def _no_gradient(names: list[str]) -> Exception:
    from nbkit.platform.errors import GradientError

    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return GradientError(
        f"{len(names)} trainable weight(s) got no gradient in this step on this rank ({shown}), so the ranks "
        "cannot average them. A common cause is a vision-language model's LoRA'd vision tower on a batch "
        "without images: train only what every batch uses (unsloth: get_peft_model(..., "
        "finetune_vision_layers=False) for text-only data), or give every batch an image. Where some weights "
        "really go unused in some steps, TrainingArguments(ddp_find_unused_parameters=True) lets a step leave them "
        "without a gradient (an unsloth vision model needs nbkit.configure(unsloth_vlm_ddp_checkpointing='unsloth') "
        "before loading it for that)."
    )


def eligible(model: Any) -> bool:
    """Whether `model`, as accelerate prepared it, gets the flat averaging (see the module docstring)."""
    from torch.nn.parallel import DistributedDataParallel

    if config.setting("ddp_reducer") != "flat" or not isinstance(model, DistributedDataParallel):
        return False
    if model.static_graph or getattr(model, "_comm_hooks", None):
        return False
    params = [p for p in model.module.parameters() if p.requires_grad]
    if not params or len({p.device for p in params}) > 1 or any(p.is_sparse for p in params):
        return False
    if sum(p.numel() * p.element_size() for p in params) > FLAT_LIMIT_BYTES:
        return False
    return not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.module.modules())


# The accelerators that Trainers created, and the averager of the model each one prepared (none: DDP's reducer).
_trainer_accelerators: weakref.WeakSet = weakref.WeakSet()
_averagers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def averager(accelerator: Any) -> FlatAverager | None:
    """The averager that stands in for DDP's reducer for the model `accelerator` prepared; None where DDP's
    reducer averages (or nothing does: one process).
    """
    return _averagers.get(accelerator)


def mode(trainer: Any) -> str | None:
    """How `trainer`'s ranks average gradients: "flat" (this module), "ddp" (DDP's reducer), or None (one process,
    or a model that is not DDP-wrapped). Read it after train() has prepared the model; any rank.
    """
    from torch.nn.parallel import DistributedDataParallel

    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None and averager(accelerator) is not None:
        return "flat"
    wrapped = getattr(trainer, "model_wrapped", None)
    return "ddp" if isinstance(wrapped, DistributedDataParallel) else None


# The upstream change that would make the two patches of Accelerator unnecessary: DDP batching its own copies.
_BATCHED_COPIES = (
    "https://github.com/pytorch/pytorch/pull/176638 (DDP's batched_grad_copy batches these copies inside DDP: in "
    "torch 2.13, off by default; torch 2.11 lacks it)"
)


@patch(
    "transformers.trainer:Trainer.create_accelerator_and_postprocess",
    reason="notes the accelerator a Trainer creates, so that the group's patches of Accelerator change only what a "
    "Trainer prepares and backpropagates (a loop of the user's own that calls loss.backward() keeps DDP's reducer)",
    upstream="no upstream change wanted: nbkit's choice of how DDP ranks average LoRA gradients",
    group="gradient_averaging",
)
def _note_trainer_accelerator(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_accelerator_and_postprocess(self: Any) -> Any:
        result = original(self)
        _trainer_accelerators.add(self.accelerator)
        return result

    return create_accelerator_and_postprocess


@patch(
    "accelerate.accelerator:Accelerator.prepare_model",
    reason="a LoRA model a Trainer wraps in DDP keeps DDP's wrapper and start but not its reducer, which costs "
    "~3 kernel launches per trainable tensor per step (1,178 for 392 LoRA tensors) on a step that the host "
    "bounds; the gradients are averaged by one flat all-reduce instead (the group's patch of Accelerator.backward)",
    upstream=_BATCHED_COPIES,
    group="gradient_averaging",
)
def _prepare_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def prepare_model(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.nn.parallel import DistributedDataParallel

        prepared = original(self, model, *args, **kwargs)
        trains = isinstance(prepared, DistributedDataParallel) and any(p.requires_grad for p in prepared.parameters())
        if self in _trainer_accelerators and trains:
            # A Trainer prepares its model again at each train() (a second training cell, a resume): the averaging
            # follows the newest wrapper, and a model that no longer qualifies gets DDP's reducer back.
            _averagers.pop(self, None)
            if eligible(prepared):
                params = [(n, p) for n, p in prepared.module.named_parameters() if p.requires_grad]
                _averagers[self] = FlatAverager(params, prepared.process_group, prepared.find_unused_parameters)
                # DDP's no_sync() state, for good: its forward prepares no reduction, its hooks return at once, and
                # Trainer's no_sync() around the first micro-batches restores this same state.
                prepared.require_backward_grad_sync = False
        return prepared

    return prepare_model


@patch(
    "accelerate.accelerator:Accelerator.backward",
    reason="averages the gradients of a model whose DDP reducer nbkit left idle (the group's patch of "
    "Accelerator.prepare_model) when the "
    "backward of an optimisation step's last micro-batch ends, before Trainer clips them",
    upstream=_BATCHED_COPIES,
    group="gradient_averaging",
)
def _backward(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(self: Any, loss: Any, **kwargs: Any) -> Any:
        result = original(self, loss, **kwargs)
        flat = _averagers.get(self)
        if flat is not None and self.sync_gradients:
            flat.average()
        return result

    return backward
