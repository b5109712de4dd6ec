"""fp16 training dtypes: trainable weights fp32, frozen non-quantised weights fp16, also after TRL's SFTTrainer.

bitsandbytes does not run on CPU: the 4-bit case here is TRL's own (it decides from the model's
`is_loaded_in_4bit`, the flag transformers sets on a bitsandbytes model); the GPU run of
benchmarks/gpu_suite.sh t4 trains real 4-bit models in fp16.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest
import torch

import nbkit
from nbkit.mixed_precision import fit_for_fp16


def _lora_model(path: str) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def _dtypes(model: Any) -> tuple[set[torch.dtype], set[torch.dtype]]:
    params = list(model.parameters())
    return {p.dtype for p in params if p.requires_grad}, {p.dtype for p in params if not p.requires_grad}


def test_fit_for_fp16_makes_trainable_weights_fp32_and_frozen_ones_fp16(tiny_text_path):
    model = _lora_model(tiny_text_path)
    for p in model.parameters():  # as TRL leaves a QLoRA model: LoRA in bf16
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    lora = sum(p.requires_grad for p in model.parameters())
    frozen = sum(not p.requires_grad for p in model.parameters())
    counts = fit_for_fp16(model)
    assert _dtypes(model) == ({torch.float32}, {torch.float16})
    assert counts == {"trainable_to_fp32": lora, "frozen_to_fp16": frozen, "compute_dtype_to_fp16": 0}
    assert fit_for_fp16(model) == dict.fromkeys(counts, 0)  # idempotent
    # the model still trains: one fp16-autocast step gives every LoRA weight a finite fp32 gradient
    ids = torch.arange(1, 9).unsqueeze(0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def _sft_trainer(model: Any, path: str, tmp_path: Any, fp16: bool) -> Any:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    base = model.get_base_model()
    base.is_loaded_in_4bit = True  # what transformers sets on a bitsandbytes model; TRL reads it
    try:
        args = SFTConfig(
            output_dir=str(tmp_path),
            fp16=fp16,
            use_cpu=True,
            max_steps=1,
            report_to=[],
            per_device_train_batch_size=2,
            dataset_kwargs={"skip_prepare_dataset": True},
            max_length=None,
            remove_unused_columns=False,
        )
        data = Dataset.from_dict({"input_ids": [list(range(1, 9))] * 2})
        return SFTTrainer(
            model=model, args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(path)
        )
    finally:
        del base.is_loaded_in_4bit  # transformers would look for bitsandbytes, absent on CPU


def _trl_casts_to_bf16() -> bool:
    return int(importlib.metadata.version("trl").split(".")[0]) >= 1


@pytest.mark.skipif(
    not _trl_casts_to_bf16(),
    reason="TRL 0.x does not cast QLoRA weights to bf16 (it runs peft's prepare_model_for_kbit_training instead)",
)
def test_sft_trainer_under_fp16_leaves_qlora_weights_fp16_ready(tiny_text_path, tmp_path):
    nbkit.uninstall("mixed_precision")
    model = _lora_model(tiny_text_path)  # the cause, on TRL 1.x: LoRA weights in bf16 under fp16
    _sft_trainer(model, tiny_text_path, tmp_path, fp16=True)
    assert _dtypes(model)[0] == {torch.bfloat16}
    nbkit.install("mixed_precision")
    try:
        model = _lora_model(tiny_text_path)
        _sft_trainer(model, tiny_text_path, tmp_path, fp16=True)
        assert _dtypes(model) == ({torch.float32}, {torch.float16})
        model = _lora_model(tiny_text_path)  # bf16 training: TRL's choice stands
        _sft_trainer(model, tiny_text_path, tmp_path, fp16=False)
        assert _dtypes(model)[0] == {torch.bfloat16}
    finally:
        nbkit.uninstall("mixed_precision")


def _groups_in_rank() -> list[str]:
    import trl.trainer.sft_trainer  # noqa: F401  (the patch waits for TRL's import)

    from nbkit import patching

    return sorted({p.group for p in patching.registered() if p.is_applied})


def test_every_launched_rank_gets_the_fp16_fix():
    assert "mixed_precision" in nbkit.launch(_groups_in_rank, gpus=1)
