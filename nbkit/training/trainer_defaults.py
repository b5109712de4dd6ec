"""Trainer's defaults that misfire in nbkit's ranks, and the patch that chooses them as Trainer would have.

Where the user leaves a setting at its default (None for ddp_find_unused_parameters, True for
dataloader_pin_memory), Trainer decides it from the model and the machine. Two of those decisions misfire in
the ranks nbkit starts, and each prints a warning into every training cell:

- **find_unused_parameters.** Trainer passes DDP `find_unused_parameters=False` for a model with gradient
  checkpointing on (a search for unused parameters and checkpointing do not mix), but only where the model
  is a transformers PreTrainedModel: a peft model (every LoRA run) is not one, so it gets True, pays an extra
  traversal of the autograd graph every step, and DDP says so in a C++ warning after the first step
  ("find_unused_parameters=True was specified ... but did not find any unused parameters"). Here a peft model
  gets the decision of the model it wraps. TRL's SFTTrainer (1.16) sets True itself, before Trainer reads it,
  for every vision-language model: a batch without images leaves the vision tower's weights without
  gradients. That holds only where some of them train; where every trainable weight is in the language
  model and its head (LoRA on the language layers, the notebooks' setting) no batch leaves one unused, and
  the model gets the decision above. (A model whose trainable weights really go unused in some steps,
  outside TRL's case, fails then as the plain model would, with DDP's "Expected to have finished
  reduction ..." error; `ddp_find_unused_parameters=True` is its setting.)
- **dataloader_pin_memory** on a machine without an accelerator (CPU ranks): pinning does nothing there, and
  torch's DataLoader warns about it for every data loader Trainer builds. Here it is off where there is no
  accelerator.

A third misfires in a process that trains on its own with several GPUs visible (the model_parallel notebook,
which installs this group): Trainer wraps no bitsandbytes-quantised model in DataParallel, yet still counts every
visible GPU, so a 4-bit model that accelerate's "balanced" map put on one GPU (a model that fits one: Qwen3-1.7B
on two GPUs lands whole on the second) trained on twice the batch per step and logged twice its loss (2x H100:
24.37 logged for a forward's 12.18, benchmarks/split_probe.py). Such a model counts one GPU here, as Trainer
counts one for a model it finds split over several.

All are set on the trainer's own arguments before Trainer reads them, so what ran is what
`trainer.args` shows.

One more is TRL's, not Trainer's: an SFTConfig whose user sets neither `bf16` nor `fp16` trains in bf16 (TRL turns
bf16 on wherever fp16 is off, trl 0.22-1.16). That is right on an Ampere or newer GPU and wrong elsewhere: a T4
has no bf16 of its own (torch says it has, counting emulation, so the T4 trains in emulated bf16, and unsloth's
float16 model refuses it), under nbkit's T4 profile transformers refuses it ("Your setup doesn't support bf16/gpu"),
and on CPU ranks without `use_cpu` as well. Such a config gets `nbkit.precision()`'s instead: bf16 where the GPU
has it, fp16 on older GPUs and under the T4 profile (with the GradScaler, as unsloth's notebooks choose there), 32-bit
on CPU ranks. `use_cpu=True` is left to TRL.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from nbkit.platform import distributed
from nbkit.platform.patching import patch

__all__ = ["choose"]


def choose(args: Any, model: Any, left_to_default: bool = False) -> None:
    """Set, on TrainingArguments `args` for `model`, the defaults the module docstring names, where the
    user left them at their defaults, and the GPU count of a quantised model. Changes nothing a user set.
    `left_to_default`: the user left find_unused_parameters unset and a library (TRL's SFTTrainer) may have set
    it since.
    """
    chosen_by_trl = left_to_default and args.ddp_find_unused_parameters is True
    if args.ddp_find_unused_parameters is None or chosen_by_trl:
        base = _pretrained_model(model)
        # A PreTrainedModel left at None is Trainer's to decide, which it does correctly; TRL's True stands where
        # vision weights train.
        ours = base is not None and (base is not model or chosen_by_trl)
        if ours and not (chosen_by_trl and _trains_outside_language_model(base)):
            args.ddp_find_unused_parameters = not _checkpointing(args, base)
    if args.dataloader_pin_memory and not _has_accelerator():
        args.dataloader_pin_memory = False
    if args.n_gpu > 1 and _not_replicated(model):
        args._n_gpu = 1


def _not_replicated(model: Any) -> bool:
    """Whether Trainer leaves `model` out of DataParallel: a bitsandbytes-quantised model (its own test)."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def _pretrained_model(model: Any) -> Any:
    """The transformers model `model` is or wraps (a peft model's base model); None for anything else."""
    from transformers import PreTrainedModel

    get_base_model = getattr(model, "get_base_model", None)
    base = model if isinstance(model, PreTrainedModel) or get_base_model is None else get_base_model()
    return base if isinstance(base, PreTrainedModel) else None


def _checkpointing(args: Any, model: Any) -> bool:
    """Whether Trainer checkpoints `model`: as the model says or as `args` ask, read under the names transformers
    has (5.23 renamed gradient checkpointing to activation checkpointing; its old names warn when read).
    """
    on_model = getattr(model, "is_activation_checkpointing", None)
    if on_model is None:
        on_model = model.is_gradient_checkpointing
    return bool(on_model or getattr(args, "activation_checkpointing", args.gradient_checkpointing))


def _trains_outside_language_model(model: Any) -> bool:
    """Whether a trainable weight of `model` lies outside its language model (get_decoder()) and output head:
    a vision tower's, which a batch without images leaves without gradients. True where the model cannot say.
    """
    try:
        parts = [model.get_decoder(), model.get_output_embeddings()]
    except (AttributeError, NotImplementedError):
        return True
    inside = {id(p) for part in parts if part is not None for p in part.parameters()}
    return any(p.requires_grad and id(p) not in inside for p in model.parameters())


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6, what the DataLoader's warning asks
    return bool(accelerator.is_available() if accelerator is not None else torch.cuda.is_available())


# Whether the SFTTrainer being built was given find_unused_parameters unset, for choose() below: TRL sets it in
# SFTTrainer.__init__ before Trainer's __init__ creates the accelerator, where choose() runs.
_left_to_default: ContextVar[bool] = ContextVar("nbkit_find_unused_left_to_default", default=False)


@patch(
    "transformers.trainer:Trainer.create_accelerator_and_postprocess",
    reason="a peft model gets DDP's find_unused_parameters as the model it wraps would (False under gradient "
    "checkpointing, where Trainer's isinstance(PreTrainedModel) check gives a peft model True: an extra "
    "autograd traversal per step and a DDP warning), and data loaders pin no memory where there is no "
    "accelerator (torch warns for each one); only where the user left these settings at their defaults. In a "
    "process that sees several GPUs, a quantised model, which Trainer does not wrap in DataParallel, counts one "
    "GPU: counted as several, it trained on that many times the batch and logged that many times its loss",
    upstream="https://github.com/huggingface/transformers/issues/9802 (find_unused_parameters hard-wired); "
    "https://github.com/huggingface/transformers/pull/9857 (pin memory by default, on every device); "
    "https://github.com/huggingface/transformers/pull/45407 (quantised models kept out of DataParallel, "
    "their GPU count left as it was)",
    group="trainer_defaults",
)
def _create_accelerator(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_accelerator_and_postprocess(self: Any) -> Any:
        choose(self.args, self.model, left_to_default=_left_to_default.get())
        return original(self)

    return create_accelerator_and_postprocess


@patch(
    "trl.trainer.sft_trainer:SFTTrainer.__init__",
    reason="TRL 1.16 sets DDP's find_unused_parameters=True for every vision-language model whose user left it "
    "unset (a batch without images leaves the vision tower without gradients), before Trainer reads it; with "
    "LoRA on the language layers only nothing goes unused, and DDP warned after the first step of every training "
    "cell ('find_unused_parameters=True was specified ... did not find any unused parameters'). This notes that "
    "the user left it unset, so that the patch of Trainer above decides it where no vision weight trains",
    upstream="no upstream report yet: TRL 1.16.0's SFTTrainer sets it for a vision-language model whatever trains",
    group="trainer_defaults",
)
def _sft_trainer_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        config = inspect.signature(original).bind_partial(self, *args, **kwargs).arguments.get("args")
        token = _left_to_default.set(config is None or config.ddp_find_unused_parameters is None)
        try:
            original(self, *args, **kwargs)
        finally:
            _left_to_default.reset(token)

    return __init__


@patch(
    "trl.trainer.sft_config:SFTConfig.__post_init__",
    reason="TRL turns bf16 on for every SFTConfig whose user set neither bf16 nor fp16; on a T4 (no bf16 of its own) "
    "that trains in emulated bf16, under the T4 profile and on CPU ranks transformers refuses it ('Your setup "
    "doesn't support bf16/gpu'). Left unset, the precision is nbkit.precision()'s: bf16 where the GPU has it, fp16 "
    "on older GPUs, 32-bit on CPU",
    upstream="no upstream report yet: TRL's configs set bf16 = not fp16 where bf16 is unset (trl 0.22-1.16)",
    group="trainer_defaults",
)
def _sft_config_post_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __post_init__(self: Any) -> Any:
        if self.bf16 is None and not self.fp16 and not self.use_cpu:
            chosen = distributed.precision()
            self.bf16, self.fp16 = chosen == "bf16", chosen == "fp16"
        return original(self)

    return __post_init__
