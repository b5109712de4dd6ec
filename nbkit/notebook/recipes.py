"""A run's choices, made once in the notebook before the ranks start, and the model steps for them in the ranks.

`nbkit.recipe(model_name, gpus=..., backend=..., ...)` decides, in the notebook process and without touching CUDA:
how many training processes (one per visible GPU unless `gpus` says), the GPU profile (`emulate`), the backend
(nbkit.models.backend: unsloth where it is installed and a GPU is visible), the precision (what the GPU does best),
the plan for this model on these GPUs (nbkit.plan, from the model's configuration alone) and from it 16-bit LoRA or
4-bit (QLoRA) where `load_in_4bit` is None, and the batch per GPU and accumulation steps (Plan.batch_settings).
`print(recipe)` says all of it. The Recipe is a frozen value that travels to the ranks with the cells that use it;
there its methods are the steps of unsloth's notebooks on the chosen backend (nbkit.models), so no cell branches on
the backend:

    recipe = nbkit.recipe(model_name, gpus=gpus, backend=backend)       # in the notebook
    %ddp start --gpus {recipe.gpus}
    %%ddp
    model, processor = recipe.from_pretrained(model_name)   # FastVisionModel.from_pretrained, or transformers
    model = recipe.get_peft_model(model, r=16, lora_alpha=16)  # FastVisionModel.get_peft_model, or peft
    recipe.for_training(model)
    SFTTrainer(model=model, data_collator=recipe.data_collator(model, processor),
               args=SFTConfig(**recipe.trainer_args, ...), ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nbkit.launching import rank_contract
from nbkit.notebook import planner
from nbkit.platform import compat, distributed
from nbkit.platform.errors import OptionsError, StrategyError
from nbkit.training import emulation, models

__all__ = ["PRECISIONS", "Recipe", "recipe"]

PRECISIONS = ("bf16", "fp16", "fp32")
# Where no GPU is visible the ranks train on CPU cores; the plan is then for Kaggle's T4 (15 GiB usable), the GPU
# these notebooks are written for.
_CPU_PLANNED_GIB = 15.0


@dataclass(frozen=True)
class Recipe:
    """What a run trains with. model: the model's name as given; gpus: training processes; strategy: "ddp" (a full
    copy per GPU) or "fsdp" (sharded); backend: "unsloth" or "transformers"; precision: "bf16", "fp16" or "fp32";
    load_in_4bit: 4-bit (QLoRA) or 16-bit LoRA, and bits_reason: why; max_seq_length: the longest example in tokens;
    plan: the planner's verdict for these settings; batch: Trainer's batch per GPU and accumulation steps;
    checkpointing: nbkit's per-layer activation checkpointing as chosen ("offload", "recompute" or None: off, the
    Trainer's own off too), and checkpointing_note: why, where there is something to say (print(recipe) shows it).
    """

    model: str
    gpus: int
    strategy: str
    backend: str
    precision: str
    load_in_4bit: bool
    bits_reason: str
    max_seq_length: int
    plan: planner.Plan
    batch: planner.BatchSettings
    checkpointing: str | None = "offload"
    checkpointing_note: str = ""

    @property
    def dtype(self) -> Any:
        """The torch dtype of `precision` (torch.float32 for fp32). Imports torch: use it in the ranks."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)

    @property
    def trainer_args(self) -> dict[str, Any]:
        """Trainer's batch per GPU, accumulation steps and precision flags, for SFTConfig(**recipe.trainer_args);
        with checkpointing=None also the Trainer's own checkpointing off (gradient_checkpointing=False, named
        activation_checkpointing from transformers 5.23), since SFTConfig turns it on by default and it would then
        recompute every layer, slower than nbkit's checkpoint (benchmarks/RESULTS.md).
        """
        args = {**self.batch.trainer_args, "bf16": self.precision == "bf16", "fp16": self.precision == "fp16"}
        return args if self.checkpointing is not None else {**args, compat.trainer_checkpointing_field(): False}

    def from_pretrained(self, name: str | None = None) -> tuple[Any, Any]:
        """(model, processor) of `name` (default: the model planned for) on this rank's device, in this recipe's
        precision or 4-bit: nbkit.models.load (unsloth's FastVisionModel / FastLanguageModel.from_pretrained, or
        transformers). Raises StrategyError under fsdp, where a rank must not load a full copy onto its GPU.
        """
        self._full_copy("from_pretrained")
        return models.load(
            name or self.model,
            self.backend,
            load_in_4bit=self.load_in_4bit,
            dtype=self.dtype,
            max_seq_length=self.max_seq_length,
        )

    def get_peft_model(self, model: Any, *, r: int = 16, lora_alpha: int = 16, random_state: int = 3407) -> Any:
        """`model` with LoRA on its language layers and nbkit's DDP-safe memory savers, with this recipe's
        checkpointing (nbkit.models.add_lora).
        """
        self._full_copy("get_peft_model")
        return models.add_lora(
            model,
            self.backend,
            r=r,
            lora_alpha=lora_alpha,
            random_state=random_state,
            checkpointing=self.checkpointing,
        )

    def for_training(self, model: Any) -> None:
        """Training mode, as unsloth's for_training (nbkit.models.for_training)."""
        models.for_training(model, self.backend)

    def for_inference(self, model: Any) -> None:
        """Inference mode, as unsloth's for_inference (nbkit.models.for_inference)."""
        models.for_inference(model, self.backend)

    def data_collator(self, model: Any, processor: Any) -> Any:
        """Unsloth's vision collator, or None where TRL builds its own (nbkit.models.vision_collator)."""
        return models.vision_collator(model, processor, self.backend)

    def save_merged(self, model: Any, processor: Any, directory: str) -> None:
        """Unsloth's save_pretrained_merged (16-bit, for vLLM); BackendError with transformers (nbkit.models)."""
        models.save_merged(model, processor, directory, self.backend)

    def save_gguf(self, model: Any, processor: Any, directory: str, quantization_method: str) -> None:
        """Unsloth's save_pretrained_gguf (llama.cpp, Ollama); BackendError with transformers (nbkit.models)."""
        models.save_gguf(model, processor, directory, self.backend, quantization_method)

    def _full_copy(self, step: str) -> None:
        if self.strategy == "fsdp":
            raise StrategyError(
                f"recipe.{step} loads a full copy of the model onto each rank's GPU, which the fsdp strategy exists "
                "to avoid. Load it without a device_map (big_model_fsdp.ipynb shows how), or use strategy='ddp'."
            )

    def __str__(self) -> str:
        gpu = self.plan.gpu or "GPU"
        bits = "4-bit (QLoRA)" if self.load_in_4bit else "16-bit LoRA"
        choices = f"{self.gpus} processes on {gpu}, backend {self.backend}, precision {self.precision}, {bits}"
        note = f"\n{self.checkpointing_note}" if self.checkpointing_note else ""
        return f"{self.plan}\n{choices}: {self.bits_reason}{note}\n{self.batch}"


def recipe(
    model: str,
    *,
    gpus: int | None = None,
    backend: str = "auto",
    strategy: str = "ddp",
    precision: str | None = None,
    load_in_4bit: bool | None = None,
    emulate: str | None = None,
    max_seq_length: int = 2048,
    batch_size: int = 1,
    effective_batch: int | None = None,
    checkpointing: str | None = "auto",
) -> Recipe:
    """The choices for training `model` (an nbkit name, hub id or path) on this machine, made once.

    gpus: training processes (None: one per visible GPU; without a GPU, N CPU processes must be asked for).
    backend: "auto", "unsloth" or "transformers" (nbkit.models.backend); strategy: "ddp" or "fsdp" (transformers
    only). precision: None for what the GPU does best (nbkit.precision()), or one of PRECISIONS. load_in_4bit: None
    for 16-bit LoRA where the plan says the model fits (a full copy per GPU; under fsdp, shards), else 4-bit.
    emulate: a GPU profile (nbkit.emulate) switched on here and in every rank started afterwards.
    max_seq_length, batch_size, effective_batch: the tokens per example, the examples per GPU per step asked for,
    and the examples per optimizer step over all GPUs (None: the planned batch x GPUs), as nbkit.plan and
    Plan.batch_settings take them. checkpointing: nbkit's per-layer activation checkpointing under ddp with the
    transformers backend (unsloth brings its own, offloaded; fsdp its own, recomputed): "auto" is off where the plan
    says the same batch fits without it in the same bits, else "offload"; or as nbkit.savers.apply takes it
    ("offload", "recompute", None: off). Without it a step skips the recompute (1.2-1.6x faster under the T4 profile
    on an H200 from 1K to 4K tokens) at 1.9-2.6x the peak memory; print(recipe) says what was chosen and why.

    Runs in the notebook process; never touches CUDA. Raises RanksError (no GPU and gpus=None, or more GPUs than
    are visible), StrategyError (unsloth with fsdp), OptionsError / ValueError for other values out of range.
    """
    if emulate is not None:
        emulation.emulate(emulate)
    visible = distributed.visible_gpus()
    gpus = rank_contract.count_ranks(gpus, visible, api="nbkit.recipe")[1]
    if strategy not in ("ddp", "fsdp"):
        raise OptionsError(f"strategy must be 'ddp' or 'fsdp', not {strategy!r}.")
    chosen = models.backend(backend)
    if strategy == "fsdp" and chosen == "unsloth":
        if backend == "unsloth":
            from nbkit.training import fsdp

            raise fsdp.unsloth_error()
        chosen = "transformers"  # "auto": unsloth has no FSDP
    if precision is not None and precision not in PRECISIONS:
        raise OptionsError(f"precision must be None or one of {', '.join(map(repr, PRECISIONS))}, not {precision!r}.")
    if checkpointing != "auto":
        models.check_checkpointing(checkpointing, chosen)
    if strategy == "fsdp" and checkpointing not in ("auto", "offload"):
        raise OptionsError(
            f"checkpointing={checkpointing!r} applies to strategy='ddp': under fsdp nbkit's FSDP set-up checkpoints "
            "each layer itself (accelerate's activation checkpointing). Leave checkpointing='auto'."
        )
    gpu, memory = _planned_gpu(visible)
    asked = dict(gpus=gpus, gpu_memory_gib=memory, seq_len=max_seq_length, batch_size=batch_size, gpu=gpu)
    planned, note = _choose_checkpointing(
        model, _Asked(asked, load_in_4bit, strategy, effective_batch), chosen, checkpointing
    )
    return Recipe(
        model=model,
        gpus=gpus,
        strategy=strategy,
        backend=chosen,
        precision=precision or distributed.precision(),
        load_in_4bit=planned.load_in_4bit,
        bits_reason=planned.bits_reason,
        max_seq_length=max_seq_length,
        plan=planned.plan,
        batch=planned.batch,
        checkpointing=planned.plan.checkpointing,
        checkpointing_note=note,
    )


@dataclass(frozen=True)
class _Asked:
    """What recipe() plans for, checkpointing apart: nbkit.plan's arguments, load_in_4bit, strategy, effective_batch."""

    plan_args: dict[str, Any]
    load_in_4bit: bool | None
    strategy: str
    effective_batch: int | None


@dataclass(frozen=True)
class _Planned:
    """One way to train: the plan, 16- or 4-bit and why, the Trainer's batch."""

    plan: planner.Plan
    load_in_4bit: bool
    bits_reason: str
    batch: planner.BatchSettings

    @property
    def per_device(self) -> int:
        return self.batch.per_device_train_batch_size


def _planned(model: str, asked: _Asked, checkpointing: str | None) -> _Planned:
    plan, bits, reason = _plan_bits(
        model, asked.load_in_4bit, asked.strategy, {**asked.plan_args, "checkpointing": checkpointing}
    )
    return _Planned(plan, bits, reason, plan.batch_settings(asked.effective_batch))


# Without checkpointing, against nbkit's offloaded checkpoint, as measured (benchmarks/RESULTS.md): the words
# print(recipe) uses for what a step gains.
_GAIN = "1.2-1.6x faster per step under the T4 profile on an H200 from 1K to 4K tokens, 11-13% at 1K x 4 in bf16"


def _choose_checkpointing(model: str, asked: _Asked, backend: str, requested: str | None) -> tuple[_Planned, str]:
    """(what to train with, the line print(recipe) adds, "" for none) for checkpointing `requested`.

    "auto" turns nbkit's checkpoint off where it is nbkit's to turn off (the transformers backend under DDP on
    GPUs; unsloth and FSDP bring their own) and the plan says the same batch fits without it in the same bits:
    the planner errs towards more memory (planned 12.3 GiB at 2048 tokens, 8.7 measured under the T4 profile).
    Elsewhere "auto" keeps "offload". An explicit choice stays; the line says what the other would do.
    """
    checked = _planned(model, asked, "offload" if requested == "auto" else requested)
    if backend != "transformers" or asked.strategy != "ddp" or checked.plan.gpu == "cpu":
        return checked, ""
    if requested is None:
        offloaded = _planned(model, asked, "offload")
        if checked.load_in_4bit and not offloaded.load_in_4bit:
            return checked, (
                "Checkpointing: off, so the model trains in 4-bit: in 16-bit it fits only with checkpointing "
                "(checkpointing='auto' or 'offload'; 16-bit with the offloaded checkpoint stepped 1.23x faster than "
                "4-bit without it in the flagship notebook under the T4 profile)."
            )
        return checked, ""
    unchecked = _planned(model, asked, None)
    fits = (
        unchecked.plan.strategy == "ddp"
        and unchecked.load_in_4bit == checked.load_in_4bit
        and unchecked.per_device >= checked.per_device
    )
    if not fits:
        return checked, ""
    # The memory at the batch trained (the plan above is at the batch asked, which the recommendation may raise).
    at_batch = {"batch_size": unchecked.per_device, "load_in_4bit": unchecked.load_in_4bit, "checkpointing": None}
    trained = planner.plan(model, **{**asked.plan_args, **at_batch})
    memory = f"{trained.per_gpu_gib:.1f} GiB per GPU of {trained.usable_gib:.1f} usable"
    if requested == "auto":
        return unchecked, (
            f"Checkpointing: off: without it the plan says about {memory}, and a step skips the recompute "
            f"({_GAIN}). checkpointing='offload' keeps it."
        )
    return checked, (
        f"Checkpointing: {requested}. Without it the plan says about {memory}, and a step skips the recompute "
        f"({_GAIN}): nbkit.recipe(..., checkpointing='auto')."
    )


def _planned_gpu(visible: list[distributed.GPU]) -> tuple[str, float]:
    """(the GPU model, its memory in GiB) to plan for: the emulated GPU's under a profile, "cpu" with a T4's memory
    where no GPU is visible, else the first visible GPU's model and the smallest one's memory.
    """
    profile = emulation.active()
    if profile is not None:
        return profile.gpu, profile.memory_gib
    if not visible:
        return "cpu", _CPU_PLANNED_GIB
    return visible[0].name, min(g.memory_gib for g in visible)


def _plan_bits(
    model: str, load_in_4bit: bool | None, strategy: str, asked: dict[str, Any]
) -> tuple[planner.Plan, bool, str]:
    """(the plan trained with, whether in 4-bit, why in words): 16-bit where the plan says it fits and
    load_in_4bit is None, else 4-bit planned again.
    """
    fits = ("ddp", "fsdp") if strategy == "fsdp" else ("ddp",)
    plan = planner.plan(model, load_in_4bit=bool(load_in_4bit), **asked)
    if load_in_4bit is not None:
        return plan, load_in_4bit, "as asked (load_in_4bit)"
    where = "the shards fit" if strategy == "fsdp" else "a full copy fits"
    if plan.strategy in fits:
        return plan, False, f"{where} on each GPU in 16-bit"
    reason = f"in 16-bit the planner says {plan.strategy} ({plan.per_gpu_gib:.1f} GiB per GPU with a full copy)"
    return planner.plan(model, load_in_4bit=True, **asked), True, reason
