"""Trainer's defaults that misfire in nbkit's ranks, and the patch that chooses them as Trainer would have.

Where the user leaves a setting at its default (None for ddp_find_unused_parameters, True for
dataloader_pin_memory), Trainer decides it from the model and the machine. Two of those decisions misfire in
the ranks nbkit starts, and each prints a warning into every training cell:

- **find_unused_parameters.** Trainer passes DDP `find_unused_parameters=False` for a model with gradient
  checkpointing on (a search for unused parameters and checkpointing do not mix), but only where the model
  is a transformers PreTrainedModel: a peft model (every LoRA run) is not one, so it gets True, pays an extra
  traversal of the autograd graph every step, and DDP says so in a C++ warning after the first step
  ("find_unused_parameters=True was specified ... but did not find any unused parameters"). Here a peft model
  gets the decision of the model it wraps. (A model whose trainable weights really go unused in some steps,
  LoRA on a VLM's vision tower with text-only batches, fails then as the plain model would, with DDP's
  "Expected to have finished reduction ..." error; `ddp_find_unused_parameters=True` is its setting.)
- **dataloader_pin_memory** on a machine without an accelerator (CPU ranks): pinning does nothing there, and
  torch's DataLoader warns about it for every data loader Trainer builds. Here it is off where there is no
  accelerator.

Both are set on the trainer's own arguments before Trainer reads them, so what ran is what
`trainer.args` shows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbkit.platform.patching import patch

__all__ = ["choose"]


def choose(args: Any, model: Any) -> None:
    """Set, on TrainingArguments `args` for `model`, the two defaults the module docstring names, where the
    user left them at their defaults. Changes nothing a user set.
    """
    if args.ddp_find_unused_parameters is None:
        base = _wrapped_pretrained_model(model)
        if base is not None:
            args.ddp_find_unused_parameters = not (base.is_gradient_checkpointing or args.gradient_checkpointing)
    if args.dataloader_pin_memory and not _has_accelerator():
        args.dataloader_pin_memory = False


def _wrapped_pretrained_model(model: Any) -> Any:
    """The transformers model a peft model wraps; None for anything else (a PreTrainedModel itself included,
    which Trainer decides for correctly).
    """
    from transformers import PreTrainedModel

    get_base_model = getattr(model, "get_base_model", None)
    if isinstance(model, PreTrainedModel) or get_base_model is None:
        return None
    base = get_base_model()
    return base if isinstance(base, PreTrainedModel) else None


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6, what the DataLoader's warning asks
    return bool(accelerator.is_available() if accelerator is not None else torch.cuda.is_available())


@patch(
    "transformers.trainer:Trainer.create_accelerator_and_postprocess",
    reason="a peft model gets DDP's find_unused_parameters as the model it wraps would (False under gradient "
    "checkpointing, where Trainer's isinstance(PreTrainedModel) check gives a peft model True: an extra "
    "autograd traversal per step and a DDP warning), and data loaders pin no memory where there is no "
    "accelerator (torch warns for each one); only where the user left these settings at their defaults",
    upstream="https://github.com/huggingface/transformers/issues/9802 (find_unused_parameters hard-wired); "
    "https://github.com/huggingface/transformers/pull/9857 (pin memory by default, on every device)",
    group="trainer_defaults",
)
def _create_accelerator(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_accelerator_and_postprocess(self: Any) -> Any:
        choose(self.args, self.model)
        return original(self)

    return create_accelerator_and_postprocess
