"""A vision-language model for LoRA training with either backend, so that a notebook chooses the backend once.

The backends are unsloth's FastVisionModel ("unsloth", on GPUs where unsloth is installed) and transformers + peft
("transformers", everywhere, the CPU included). A notebook's cells call these in place of either library's calls,
in the order of unsloth's own notebooks: load the model and processor, add LoRA, switch it to training or to
inference, build the batches; each function does what that step's call does on the chosen backend. Run them in
the training processes (a %%ddp cell, or the function nbkit.launch runs), not in the notebook.

    backend = nbkit.models.backend("auto")
    model, processor = nbkit.models.load_vision(model_name, backend, load_in_4bit=False, dtype=torch.float16)
    model = nbkit.models.add_lora(model, backend, r=16, lora_alpha=16)
    nbkit.models.for_training(model, backend)
    trainer = SFTTrainer(model=model, ..., data_collator=nbkit.models.vision_collator(model, processor, backend))
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["BACKENDS", "add_lora", "backend", "for_inference", "for_training", "load_vision", "vision_collator"]

BACKENDS = ("unsloth", "transformers")

# LoRA on the language model's attention and MLP projections, as unsloth's finetune_language_layers does; the
# vision tower stays frozen.
_LANGUAGE_LAYERS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def backend(choice: str = "auto") -> str:
    """The backend for `choice`: "auto" gives "unsloth" where unsloth is installed and a GPU is visible (asked of
    nvidia-smi, so CUDA stays untouched here), else "transformers". Raises ValueError for another name.
    """
    if choice == "auto":
        from nbkit import distributed

        return "unsloth" if distributed.visible_gpus() and importlib.util.find_spec("unsloth") else "transformers"
    if choice not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {', '.join(map(repr, BACKENDS))}; got {choice!r}.")
    return choice


def load_vision(
    name: str, backend: str, *, load_in_4bit: bool, dtype: Any, max_seq_length: int = 2048
) -> tuple[Any, Any]:
    """(model, processor) of the vision-language model `name` (an nbkit name, hub id or path) on this rank's device.

    unsloth: FastVisionModel.from_pretrained with unsloth's gradient checkpointing. transformers: the processor of
    nbkit.offline.load_processor (AutoProcessor, also where torchvision is missing) and
    AutoModelForImageTextToText in `dtype`, 4-bit through bitsandbytes where `load_in_4bit`.
    """
    from nbkit import distributed, offline

    path = offline.resolve_model(name)
    if backend == "unsloth":
        from unsloth import FastVisionModel

        return FastVisionModel.from_pretrained(
            path,
            load_in_4bit=load_in_4bit,
            dtype=dtype,
            max_seq_length=max_seq_length,
            use_gradient_checkpointing="unsloth",
        )
    from transformers import AutoModelForImageTextToText, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype) if load_in_4bit else None
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=dtype, device_map={"": distributed.device()}, quantization_config=quantization
    )
    return model, offline.load_processor(path)


def add_lora(model: Any, backend: str, *, r: int = 16, lora_alpha: int = 16, random_state: int = 3407) -> Any:
    """`model` with LoRA adapters on its language layers (the vision tower frozen) and nbkit's DDP-safe memory
    savers, returned as the backend returns it.

    unsloth: FastVisionModel.get_peft_model, then nbkit's chunked loss (unsloth brings its own checkpointing).
    transformers: peft's get_peft_model, then nbkit.savers.apply with Liger's kernels and compilation where they
    run (a GPU), which is what unsloth brings itself.
    """
    from nbkit import savers

    if backend == "unsloth":
        from unsloth import FastVisionModel

        model = FastVisionModel.get_peft_model(
            model,
            finetune_vision_layers=False,
            finetune_language_layers=True,
            finetune_attention_modules=True,
            finetune_mlp_modules=True,
            r=r,
            lora_alpha=lora_alpha,
            lora_dropout=0,
            bias="none",
            random_state=random_state,
        )
        return savers.apply(model, checkpointing=None, tiled_mlp=False)
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(random_state)
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=_LANGUAGE_LAYERS))
    return savers.apply(model, kernels="auto", compile="auto")


def for_training(model: Any, backend: str) -> None:
    """Put `model` in training mode (unsloth: FastVisionModel.for_training, which also turns its caches off)."""
    if backend == "unsloth":
        from unsloth import FastVisionModel

        FastVisionModel.for_training(model)
    model.train()


def for_inference(model: Any, backend: str) -> None:
    """Put `model` in inference mode (unsloth: FastVisionModel.for_inference, its faster generation)."""
    if backend == "unsloth":
        from unsloth import FastVisionModel

        FastVisionModel.for_inference(model)
    else:
        model.eval()


def vision_collator(model: Any, processor: Any, backend: str) -> Any:
    """The data collator for image-and-text batches: unsloth's UnslothVisionDataCollator, or None for
    transformers, where TRL's SFTTrainer builds its own vision collator from the processor.
    """
    if backend != "unsloth":
        return None
    from unsloth.trainer import UnslothVisionDataCollator

    return UnslothVisionDataCollator(model, processor)
