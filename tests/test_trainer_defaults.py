"""Trainer's defaults in nbkit's ranks (nbkit.training.trainer_defaults): a peft model gets DDP's find_unused_parameters as the
model it wraps would, TRL's choice for a vision-language model stands only where vision weights train, and data
loaders pin no memory without an accelerator; a setting the user made is kept. (That a training cell then prints
neither warning is tests/test_training_cell.py, in a real kernel.)"""

from __future__ import annotations

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, TrainingArguments

import nbkit
from nbkit.training.trainer_defaults import choose


@pytest.fixture
def peft_model(tiny_text_path):
    return get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_text_path), LoraConfig(r=4))


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_peft_model_gets_the_decision_of_the_model_it_wraps(tmp_path, peft_model, checkpointing):
    args = TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=checkpointing, use_cpu=True)
    choose(args, peft_model)
    assert args.ddp_find_unused_parameters is (not checkpointing)
    assert args.dataloader_pin_memory is False  # no accelerator on this machine


def test_what_the_user_set_is_kept_and_a_plain_model_is_left_to_trainer(tmp_path, peft_model, tiny_text_path):
    args = TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True, ddp_find_unused_parameters=True)
    choose(args, peft_model)
    assert args.ddp_find_unused_parameters is True
    plain = TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True)
    choose(plain, AutoModelForCausalLM.from_pretrained(tiny_text_path))
    assert plain.ddp_find_unused_parameters is None


def _sft_find_unused(path: str, targets: str, tmp_path, nbkit_decides: bool) -> bool | None:
    """find_unused_parameters of an SFTTrainer built (not trained) on tiny:qwen3-vl with LoRA on `targets` and image
    samples, the user leaving it unset, with nbkit's trainer_defaults patches installed or not."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model = get_peft_model(AutoModelForImageTextToText.from_pretrained(path), LoraConfig(r=4, target_modules=targets))
    rows = nbkit.data.image_text_dataset("synthetic", 2, image_size=32)
    data = [
        {
            "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Read it."}]}],
            "images": [row["image"].convert("RGB")],
        }
        for row in rows
    ]
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[], bf16=False)
    if nbkit_decides:
        nbkit.install("trainer_defaults")
    try:
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(data),
            processing_class=nbkit.offline.load_processor(path),
        )
    finally:
        nbkit.uninstall("trainer_defaults")
    return trainer.args.ddp_find_unused_parameters


LANGUAGE_LAYERS = r".*language_model.*\.(q|v)_proj"
AND_VISION_LAYERS = r".*(language_model.*\.(q|v)_proj|visual.*\.qkv)"


def test_sft_trainer_searches_for_unused_weights_only_where_vision_weights_train(tmp_path, tiny_vl_path):
    # What TRL alone chooses for a vision-language model: 1.16 turns the search on (a batch without images would
    # leave vision weights without gradients), 1.14 and older leave it to Trainer (unset).
    by_trl = _sft_find_unused(tiny_vl_path, AND_VISION_LAYERS, tmp_path, nbkit_decides=False)
    assert by_trl in (True, None)
    # LoRA on the language layers only: every trainable weight gets a gradient in every batch, so no search
    # (TRL's checkpointing is on), and no DDP warning after the first step.
    assert _sft_find_unused(tiny_vl_path, LANGUAGE_LAYERS, tmp_path, nbkit_decides=True) is False
    # Vision weights train too: TRL's choice stands where it made one.
    assert _sft_find_unused(tiny_vl_path, AND_VISION_LAYERS, tmp_path, nbkit_decides=True) is (by_trl is True)


def test_a_quantised_model_in_a_process_that_sees_two_gpus_trains_on_its_own_batch(tmp_path, peft_model):
    """Trainer keeps a bitsandbytes-quantised model out of DataParallel but counted every visible GPU: twice the
    batch per step, twice the logged loss (2x H100, benchmarks/split_probe.py). This machine has no GPU, so the
    count a process seeing two GPUs gets is set on the arguments; the model carries the flag transformers reads."""
    from transformers import Trainer

    def two_gpus() -> TrainingArguments:
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[])
        args._n_gpu = 2
        return args

    peft_model.base_model.model.is_loaded_in_4bit = True  # what transformers sets on a 4-bit load
    nbkit.install("trainer_defaults")
    try:
        trainer = Trainer(model=peft_model, args=two_gpus())
        assert (trainer.args.n_gpu, trainer._train_batch_size) == (1, 4)
    finally:
        nbkit.uninstall("trainer_defaults")
    unpatched = Trainer(model=peft_model, args=two_gpus())
    assert (unpatched.args.n_gpu, unpatched._train_batch_size) == (2, 8)  # what the patch is for


def test_an_sft_config_without_a_precision_takes_nbkits(tmp_path, monkeypatch):
    from trl import SFTConfig

    from nbkit.platform import distributed

    def config(**precision) -> SFTConfig:
        return SFTConfig(output_dir=str(tmp_path), report_to=[], **precision)

    # TRL alone turns bf16 on wherever fp16 is off, which transformers refuses on this GPU-less machine.
    with pytest.raises(ValueError, match="bf16"):
        config()
    nbkit.install("trainer_defaults")
    try:
        assert (config().bf16, config().fp16) == (False, False)  # nbkit.precision(): 32-bit on CPU
        # A T4's answer (this machine has none): fp16, as unsloth's notebooks choose there.
        monkeypatch.setattr(distributed, "precision", lambda: "fp16")
        assert (config().bf16, config().fp16) == (False, True)
        # What the user set is kept, and use_cpu=True is left to TRL (bf16 on the CPU).
        assert (config(fp16=True).bf16, config(fp16=True).fp16) == (False, True)
        assert (config(bf16=False).bf16, config(bf16=False).fp16) == (False, False)
        assert config(use_cpu=True).bf16 is True
    finally:
        nbkit.uninstall("trainer_defaults")
