"""The dtypes a model must have for fp16 mixed-precision training, and the patch that restores them.

fp16 training (Trainer's `fp16=True`, the only mixed precision of a T4) scales the loss with a
GradScaler, whose unscaling takes fp32 gradients only: a trainable weight in bf16 fails at the first
optimizer step with `"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for
'BFloat16'`, one in fp16 with "Attempting to unscale FP16 gradients". The rule here is the one of
peft's `prepare_model_for_kbit_training` and unsloth, kept to what fp16 needs:

- trainable floating-point weights (LoRA) in fp32;
- frozen floating-point weights that are not quantised (norms, embeddings, lm_head, the vision
  tower) in fp16, the compute dtype, where they are bf16 (which a T4 only emulates, slowly, and
  which would mix bf16 activations into fp16 autocast);
- bitsandbytes 4-bit layers computing in fp16 (their `compute_dtype`).

Quantised weights (bitsandbytes' Params4bit / Int8Params, integer storage) are never touched.

Where bf16 comes from: TRL's SFTTrainer (1.x) casts every trainable weight of a quantised model to
bf16 in its `__init__`, whatever the precision ("QLoRA ... bf16 to follow the paper",
trl/trainer/sft_trainer.py), so QLoRA with fp16=True crashed at its first step (seen on an H100 under
the T4 profile, transformers 5.17, trl 1.15). The patch below applies the rule right after that
`__init__` whenever the trainer trains in fp16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from nbkit.platform.patching import patch

__all__ = ["fit_for_fp16"]

_HALF = (torch.float16, torch.bfloat16)


def fit_for_fp16(model: nn.Module) -> dict[str, int]:
    """Give `model` the dtypes fp16 mixed-precision training needs (see the module docstring). Idempotent.

    Args:
        model: any torch model: transformers, peft-wrapped, quantised with bitsandbytes or not.

    Returns:
        How many tensors changed: {"trainable_to_fp32": n, "frozen_to_fp16": n, "compute_dtype_to_fp16": n}.
    """
    counts = {"trainable_to_fp32": 0, "frozen_to_fp16": 0, "compute_dtype_to_fp16": 0}
    for param in model.parameters():
        if _quantised(param) or not param.is_floating_point():
            continue
        if param.requires_grad and param.dtype in _HALF:
            param.data = param.data.to(torch.float32)
            counts["trainable_to_fp32"] += 1
        elif not param.requires_grad and param.dtype == torch.bfloat16:
            param.data = param.data.to(torch.float16)
            counts["frozen_to_fp16"] += 1
    for module in model.modules():
        # bitsandbytes' Linear4bit computes in `compute_dtype` (bnb_4bit_compute_dtype)
        if getattr(module, "compute_dtype", None) == torch.bfloat16:
            cast(Any, module).compute_dtype = torch.float16
            counts["compute_dtype_to_fp16"] += 1
    return counts


def _quantised(param: torch.Tensor) -> bool:
    """Whether `param` is bitsandbytes-quantised (Params4bit, Int8Params): its storage is not the weight's dtype."""
    return type(param).__name__ in ("Params4bit", "Int8Params") or hasattr(param, "quant_state")


@patch(
    "trl.trainer.sft_trainer:SFTTrainer.__init__",
    reason="TRL's SFTTrainer casts a quantised model's trainable weights to bf16 whatever the precision, so "
    "QLoRA with fp16=True (a T4) failed at the first optimizer step with '_amp_foreach_non_finite_check_and_"
    "unscale_cuda not implemented for BFloat16'; under fp16 give trainable weights fp32 and frozen ones fp16, "
    "as peft's prepare_model_for_kbit_training does",
    upstream="https://github.com/huggingface/peft/issues/2889 (why TRL casts by hand: autocast_adapter_dtype=False "
    "is not supported for quantised models)",
    group="mixed_precision",
)
def _fp16_dtypes_after_sft_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if getattr(self.args, "fp16", False) and isinstance(self.model, nn.Module):
            fit_for_fp16(self.model)

    return __init__
