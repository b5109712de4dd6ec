"""Trainer's defaults in nbkit's ranks (nbkit.training.trainer_defaults): a peft model gets DDP's find_unused_parameters as the
model it wraps would, and data loaders pin no memory without an accelerator; a setting the user made is kept.
(That a training cell then prints neither warning is tests/test_training_cell.py, in a real kernel.)"""

from __future__ import annotations

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, TrainingArguments

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
