"""Where the supported release lines differ, asked and bridged in one place.

nbkit supports transformers 4.57.1 through 5.24 and trl 0.22.2 through 1.16 (unsloth's Kaggle
notebooks pin transformers 4.57.1 and trl 0.22.2). Code that must behave differently on the two
lines asks `transformers_major()` instead of importing transformers to find out: reading the
installed version costs nothing and imports nothing. Differences that would break training are
bridged by the patches here, which apply on the older lines only; on transformers 5.23 and newer two
more keep the checkpointing names it renamed, which peft and trl still use, from printing a deprecation
notice into every training cell. `enable()` applies them in every rank nbkit.launch starts and wherever
nbkit's chunked loss is applied.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from nbkit.platform import patching

__all__ = ["enable", "trainer_checkpointing_field", "transformers_major"]


@lru_cache(maxsize=1)
def transformers_major() -> int:
    """The installed transformers' major version (4 or 5).

    Raises:
        importlib.metadata.PackageNotFoundError: transformers is not installed.
    """
    return int(importlib.metadata.version("transformers").split(".")[0])


def _transformers_4() -> bool:
    return transformers_major() < 5


def _release(name: str) -> tuple[int, int] | None:
    """(major, minor) of the installed distribution `name`; None where it is not installed or not numbered so."""
    try:
        major, minor = importlib.metadata.version(name).split(".")[:2]
        return int(major), int(minor)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def _trl_0() -> bool:
    release = _release("trl")
    return release is not None and release < (1, 0)


@patching.patch(
    "transformers.modeling_utils:PreTrainedModel.gradient_checkpointing_enable",
    reason="transformers 4.x checkpoints reentrantly unless told otherwise, and Trainer wraps PEFT models in "
    "DDP with find_unused_parameters=True; together they fail in the first backward with 'Expected to mark "
    "a variable ready only once' (seen: transformers 4.57.1 and trl 0.22.2, whose SFTConfig turns "
    "checkpointing on by default, LoRA on 2 gloo ranks). In launched ranks the default becomes "
    "non-reentrant, as in transformers 5; an explicit use_reentrant is kept",
    upstream="https://github.com/huggingface/transformers/pull/43203 (the default changed in 5.0)",
    group="compat",
    when=_transformers_4,
)
def _non_reentrant_by_default(original: Callable[..., Any]) -> Callable[..., Any]:
    def gradient_checkpointing_enable(self: Any, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        return original(self, gradient_checkpointing_kwargs=kwargs)

    return gradient_checkpointing_enable


@patching.patch(
    "trl.trainer.sft_trainer:SFTTrainer.compute_loss",
    reason="trl 0.x's SFTTrainer computes token accuracy and entropy from the model's full logits; with "
    "nbkit's chunked loss (nbkit.savers.apply) the logits hold the last position only, and trl 0.22.2 failed "
    "every step with 'The size of tensor a (0) must match the size of tensor b (N)'. For such a model the "
    "loss is Trainer's and those two logged metrics are left out (trl 1.x gets them from its own chunked "
    "loss instead of the logits)",
    upstream="no upstream report: trl 1.0 reworked compute_loss (loss_type='chunked_nll' reports its own metrics)",
    group="compat",
    when=_trl_0,
)
def _loss_without_full_logits(original: Callable[..., Any]) -> Callable[..., Any]:
    def compute_loss(
        self: Any, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        from transformers import Trainer

        if _chunked_loss is None or not _chunked_loss(model):
            return original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        inputs["use_cache"] = False  # as trl does: the cache does not go with gradient checkpointing
        return Trainer.compute_loss(
            self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    return compute_loss


@patching.patch(
    "trl.models.utils:prepare_model_for_kbit_training",
    reason="trl 0.22's SFTTrainer runs peft's prepare_model_for_kbit_training on a quantised model even when it is "
    "already a PeftModel. That function freezes every parameter, LoRA's included, so QLoRA trained nothing: under fp16 "
    "the first optimizer step failed with GradScaler's 'No inf checks were recorded prior to update' (transformers "
    "4.57.1, trl 0.22.2, peft 0.18.0, one H100 under the T4 profile). It also casts every frozen 16-bit weight that "
    "is not quantised to fp32 (embeddings, vision tower, norms): Qwen3-VL-2B in 4-bit without checkpointing then "
    "peaked at 10.27 GiB, against 6.37 with trl 1.15 (one H200 under the T4 profile). A PeftModel now keeps its "
    "parameters as they are, as in trl 0.23; checkpointing, where asked for, is enabled as peft's preparation does",
    upstream="https://github.com/huggingface/trl/issues/3926 (fixed by https://github.com/huggingface/trl/pull/4081)",
    group="compat",
    when=_trl_0,
)
def _peft_model_stays_as_it_is(original: Callable[..., Any]) -> Callable[..., Any]:
    def prepare_model_for_kbit_training(
        model: Any, use_gradient_checkpointing: bool = True, gradient_checkpointing_kwargs: Any = None
    ) -> Any:
        from peft import PeftModel

        if not isinstance(model, PeftModel):
            return original(model, use_gradient_checkpointing, gradient_checkpointing_kwargs)
        if use_gradient_checkpointing:  # the checkpointing part of the preparation, as peft does it
            options = gradient_checkpointing_kwargs or {}
            if options.get("use_reentrant", True):
                model.enable_input_require_grads()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        return model

    return prepare_model_for_kbit_training


def _transformers_5_23() -> bool:
    """Whether transformers is 5.23 or newer: it renamed gradient checkpointing to activation checkpointing."""
    release = _release("transformers")
    return release is not None and release >= (5, 23)


def trainer_checkpointing_field() -> str:
    """The TrainingArguments field that turns transformers' own checkpointing on or off: "activation_checkpointing"
    from transformers 5.23, whose old name "gradient_checkpointing" warns when set, "gradient_checkpointing" before.
    """
    return "activation_checkpointing" if _transformers_5_23() else "gradient_checkpointing"


@patching.patch(
    "transformers.modeling_utils:PreTrainedModel.is_gradient_checkpointing",
    reason="transformers 5.23 renamed this property is_activation_checkpointing and made the old name warn on every "
    "read ('`is_gradient_checkpointing` is deprecated and will be removed in v6'); peft 0.21.2 reads the old name in "
    "every get_peft_model and PeftModel.from_pretrained, so each LoRA cell printed a notice meant for peft's authors "
    "(seen: transformers 5.24.0). The old name answers as the new one, without the notice (code of the user's that "
    "reads it gets none either: the name works until transformers 6)",
    upstream="no upstream report yet: peft 0.21.2 (peft_model.py, mixed_model.py) and trl 1.16.0 (models/utils.py) "
    "read is_gradient_checkpointing",
    group="compat",
    when=_transformers_5_23,
    value=True,
)
def _checkpointing_alias_without_notice(original: Any) -> Any:
    return property(lambda self: self.is_activation_checkpointing, doc=original.__doc__)


@patching.patch(
    "trl.trainer.base_config:_BaseConfig.__post_init__",
    reason="trl's configs (SFTConfig and the others) default gradient_checkpointing to True, a name transformers 5.23 "
    "deprecated for activation_checkpointing: every SFTConfig() printed '`gradient_checkpointing` is deprecated and "
    "will be removed in v6' though its user never wrote the name (seen: trl 1.16.0, transformers 5.24.0). trl's "
    "default goes in under the new name, which transformers mirrors to the old one as it would have; a False the "
    "user wrote, or a value under the new name, is left to transformers",
    upstream="no upstream report yet: trl 1.16.0's _BaseConfig declares gradient_checkpointing=True",
    group="compat",
    when=_transformers_5_23,
)
def _trl_default_under_the_new_name(original: Callable[..., Any]) -> Callable[..., Any]:
    def __post_init__(self: Any) -> Any:
        if self.activation_checkpointing is None and self.gradient_checkpointing is True:
            self.activation_checkpointing = True
        return original(self)

    return __post_init__


@patching.patch(
    "trl.trainer.sft_trainer:DataCollatorForVisionLanguageModeling._collate_prompt_completion",
    reason="trl 0.x's vision collator for prompt-completion data appends each completion to input_ids but keeps the "
    "prompt's mm_token_type_ids, which transformers 5's Qwen-VL processors return: every training step failed in "
    "Qwen3-VL's get_rope_index with 'The shape of the mask [52] at index 0 does not match the shape of the indexed "
    "tensor [49]' (seen: transformers 5.5.4 and trl 0.24.0, the Kaggle image's set, with TRL's collator). The ids are "
    "made again from the batch's final input_ids by the processor's own create_mm_token_type_ids",
    upstream="no upstream report for trl 0.x: trl 1.x's collator extends the prompt's ids over the completion",
    group="compat",
    when=_trl_0,
)
def _mm_token_types_of_the_whole_sequence(original: Callable[..., Any]) -> Callable[..., Any]:
    def _collate_prompt_completion(self: Any, examples: list[dict[str, Any]]) -> dict[str, Any]:
        output = original(self, examples)
        types = output.get("mm_token_type_ids")
        if types is not None:  # the prompt's, left-padded: the flushed, joined sequence needs its own
            made = self.processor.create_mm_token_type_ids(output["input_ids"].tolist())
            output["mm_token_type_ids"] = types.new_tensor(made)
        return output

    return _collate_prompt_completion


def _peft_before_0_21() -> bool:
    release = _release("peft")
    return release is not None and release < (0, 21)


@patching.patch(
    "peft.tuners.lora.model:dispatch_torchao",
    reason="peft before 0.21 imports torchao's LinearActivationQuantizedTensor to test every layer it adds LoRA "
    "to, whenever torchao is installed; torchao 0.18 (which unsloth 2026.10 installs) no longer has it, so "
    "get_peft_model failed on every model with 'cannot import name LinearActivationQuantizedTensor' (seen: "
    "peft 0.18.0, the transformers path on unsloth's Kaggle pins). A layer whose weight is not a torchao "
    "tensor is left to peft's other dispatchers, as it would be without torchao",
    upstream="https://github.com/pytorch/ao/pull/4258 (torchao removed the class; peft 0.21 no longer imports it)",
    group="compat",
    when=_peft_before_0_21,
)
def _torchao_dispatch_without_removed_class(original: Callable[..., Any]) -> Callable[..., Any]:
    def dispatch_torchao(target: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(target, *args, **kwargs)
        except ImportError:
            base = target.get_base_layer() if hasattr(target, "get_base_layer") else target
            if type(getattr(base, "weight", None)).__module__.split(".")[0] == "torchao":
                raise  # a torchao weight that this peft cannot handle: say so
            return None

    return dispatch_torchao


# Whether a model computes its loss with nbkit's chunked loss (nbkit.savers.loss.is_applied), handed
# over by that module when it applies: it imports this one, so this one must not import it.
_chunked_loss: Callable[[Any], bool] | None = None


def enable(*, chunked_loss: Callable[[Any], bool] | None = None) -> None:
    """Apply the patches above where transformers is imported, and when it is imported otherwise.

    Called in every rank nbkit.launch starts, and by nbkit.savers.loss.apply with `chunked_loss`,
    its test for a model whose logits hold the last position only. Idempotent; imports nothing.
    """
    global _chunked_loss
    if chunked_loss is not None:
        _chunked_loss = chunked_loss
    patching.apply("compat")
