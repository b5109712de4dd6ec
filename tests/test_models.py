"""nbkit.models: one call per step of unsloth's notebooks for either backend (here transformers + peft; unsloth's
path runs in the flagship notebook's GPU runs)."""

from __future__ import annotations

import pytest
import torch

from nbkit.platform.errors import OptionsError
from nbkit.training import models


@pytest.mark.version_independent
def test_auto_is_transformers_without_a_gpu_and_a_wrong_name_is_refused():
    assert models.backend("auto") == "transformers"  # no GPU here
    assert models.backend("unsloth") == "unsloth"
    with pytest.raises(ValueError, match="backend must be 'auto' or one of 'unsloth', 'transformers'; got 'peft'"):
        models.backend("peft")


def test_transformers_backend_loads_adds_lora_to_the_language_layers_and_switches_modes(tiny_vl_path):
    model, processor = models.load_vision(tiny_vl_path, "transformers", load_in_4bit=False, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration" and hasattr(processor, "image_processor")
    model = models.add_lora(model, "transformers", r=4, lora_alpha=8)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name and "language_model" in name for name in trainable)
    models.for_inference(model, "transformers")
    assert not model.training
    models.for_training(model, "transformers")
    assert model.training
    assert models.vision_collator(model, processor, "transformers") is None  # TRL builds its own


def test_add_lora_checkpoints_each_decoder_layer_unless_told_not_to(tiny_text_path):
    from nbkit.training.savers import checkpointing

    def checkpointed(model: torch.nn.Module) -> int:
        return sum(checkpointing.is_checkpointed(m) for m in model.modules())

    loaded = [models.load(tiny_text_path, "transformers", load_in_4bit=False, dtype=torch.float32)[0] for _ in range(2)]
    on = models.add_lora(loaded[0], "transformers", r=4, lora_alpha=8)
    off = models.add_lora(loaded[1], "transformers", r=4, lora_alpha=8, checkpointing=None)
    assert checkpointed(on) == on.config.num_hidden_layers and checkpointed(off) == 0
    with pytest.raises(OptionsError, match="checkpointing=None applies to the transformers backend"):
        models.add_lora(off, "unsloth", checkpointing=None)  # refused before unsloth is imported


def test_a_text_model_loads_with_its_tokenizer_and_gets_lora_on_every_layers_projections(tiny_text_path):
    model, tokenizer = models.load(tiny_text_path, "transformers", load_in_4bit=False, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM" and tokenizer("a b").input_ids
    model = models.add_lora(model, "transformers", r=4, lora_alpha=8, random_state=0)
    trainable = {name.split(".layers.")[1].split(".")[0] for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {str(i) for i in range(model.config.num_hidden_layers)}
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    assert models.vision_collator(model, tokenizer, "unsloth") is None  # TRL's own collator for text


def test_load_picks_the_vision_loader_by_the_models_config(tiny_vl_path):
    model, processor = models.load(tiny_vl_path, "transformers", load_in_4bit=False, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration" and hasattr(processor, "image_processor")
