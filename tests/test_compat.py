"""The checkpointing names transformers 5.23 renamed (nbkit.compat): peft and TRL still use the old ones, which warn on
every use; in nbkit's ranks a LoRA model and TRL's config are made without that notice, and both names answer alike."""

from __future__ import annotations

import warnings

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import nbkit
from nbkit.platform import compat

pytestmark = pytest.mark.skipif(not compat._transformers_5_23(), reason="transformers before 5.23 has one name")


def _lora_and_config(path: str, tmp_path, **config) -> tuple[list[str], object, object]:
    """get_peft_model and an SFTConfig, as a training cell makes them; the checkpointing notices they printed."""
    from trl import SFTConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4))
        args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, **config)
    return [str(w.message) for w in caught if "checkpointing` is deprecated" in str(w.message)], model, args


def test_peft_and_trl_old_names_print_no_notice_where_nbkit_applies_its_fixes(tiny_text_path, tmp_path):
    nbkit.uninstall("compat")  # as a fresh process has it: an earlier test's model steps may have applied the group
    without, _, _ = _lora_and_config(tiny_text_path, tmp_path)
    assert any("`is_gradient_checkpointing`" in m for m in without), without  # peft's read of the old name
    assert any("`gradient_checkpointing`" in m for m in without), without  # TRL's default under the old name

    compat.enable()
    try:
        notices, model, args = _lora_and_config(tiny_text_path, tmp_path)
        base = model.get_base_model()
        answers = [base.is_gradient_checkpointing]
        base.activation_checkpointing_enable()
        answers.append(base.is_gradient_checkpointing)
        # A False the user wrote under the old name is the user's to change: transformers' notice stays.
        explicit, _, off = _lora_and_config(tiny_text_path, tmp_path, gradient_checkpointing=False)
    finally:
        nbkit.uninstall("compat")
    assert notices == []
    assert answers == [False, True]  # the old name answers as the new one
    assert args.activation_checkpointing is True and args.gradient_checkpointing is True  # TRL's default, both names
    assert explicit == [
        "`gradient_checkpointing` is deprecated and will be removed in v6. Use `activation_checkpointing` instead."
    ]
    assert off.activation_checkpointing is False
