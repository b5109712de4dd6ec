"""A model for LoRA training with either backend, so that a notebook chooses the backend once.

The backends are unsloth ("unsloth": FastVisionModel for vision-language models, FastLanguageModel for text
models, on GPUs where unsloth is installed) and transformers + peft ("transformers", everywhere, the CPU included).
A notebook's cells call these in place of either library's calls, in the order of unsloth's own notebooks: load the
model and its processor (a tokenizer for text models), add LoRA, switch it to training or to inference, build the
batches; each function does what that step's call does on the chosen backend, for a vision-language model (its
config has a vision_config) or a text model alike. Run them in the training processes (a %%ddp cell, or the
function nbkit.launch runs), not in the notebook. nbkit.recipe makes the choices once and calls these.

    backend = nbkit.models.backend("auto")
    model, processor = nbkit.models.load(model_name, backend, load_in_4bit=False, dtype=torch.float16)
    model = nbkit.models.add_lora(model, backend, r=16, lora_alpha=16)
    nbkit.models.for_training(model, backend)
    trainer = SFTTrainer(model=model, ..., data_collator=nbkit.models.vision_collator(model, processor, backend))
"""

from __future__ import annotations

import importlib.util
from typing import Any

from nbkit.notebook.planner import LORA_TARGET_MODULES
from nbkit.platform.errors import BackendError, OptionsError

__all__ = [
    "BACKENDS",
    "add_lora",
    "backend",
    "check_checkpointing",
    "for_inference",
    "for_training",
    "load",
    "load_text",
    "load_vision",
    "save_gguf",
    "save_merged",
    "vision_collator",
]

BACKENDS = ("unsloth", "transformers")

# LoRA on the language model's attention and MLP projections, as unsloth's finetune_language_layers does; the
# vision tower stays frozen.
_LANGUAGE_LAYERS = rf".*language_model.*\.({'|'.join(LORA_TARGET_MODULES)})"


def backend(choice: str = "auto") -> str:
    """The backend for `choice`: "auto" gives "unsloth" where unsloth is installed and a GPU is visible (asked of
    nvidia-smi, so CUDA stays untouched here), else "transformers". Raises ValueError for another name.
    """
    if choice == "auto":
        from nbkit.platform import distributed

        return "unsloth" if distributed.visible_gpus() and importlib.util.find_spec("unsloth") else "transformers"
    if choice not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {', '.join(map(repr, BACKENDS))}; got {choice!r}.")
    return choice


def load(name: str, backend: str, *, load_in_4bit: bool, dtype: Any, max_seq_length: int = 2048) -> tuple[Any, Any]:
    """(model, processor) of `name` (an nbkit name, hub id or path) on this rank's device: load_vision for a
    vision-language model (its config has a vision_config), load_text (the processor is a tokenizer) otherwise.
    """
    if backend == "unsloth":
        import unsloth  # noqa: F401  # first, before reading the config imports transformers: it patches it on import
    from nbkit.training import offline

    loader = load_vision if _has_vision(offline.load_config(name)) else load_text
    return loader(name, backend, load_in_4bit=load_in_4bit, dtype=dtype, max_seq_length=max_seq_length)


def load_vision(
    name: str, backend: str, *, load_in_4bit: bool, dtype: Any, max_seq_length: int = 2048
) -> tuple[Any, Any]:
    """(model, processor) of the vision-language model `name` (an nbkit name, hub id or path) on this rank's device.

    unsloth: FastVisionModel.from_pretrained with unsloth's gradient checkpointing. transformers: the processor of
    nbkit.offline.load_processor (AutoProcessor, also where torchvision is missing) and
    AutoModelForImageTextToText in `dtype`, 4-bit through bitsandbytes where `load_in_4bit`.
    """
    from nbkit.training import offline

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
    from transformers import AutoModelForImageTextToText

    return _transformers_model(AutoModelForImageTextToText, path, load_in_4bit, dtype), offline.load_processor(path)


def load_text(
    name: str, backend: str, *, load_in_4bit: bool, dtype: Any, max_seq_length: int = 2048
) -> tuple[Any, Any]:
    """(model, tokenizer) of the text model `name` (an nbkit name, hub id or path) on this rank's device.

    unsloth: FastLanguageModel.from_pretrained. transformers: the tokenizer and AutoModelForCausalLM in `dtype`, 4-bit
    through bitsandbytes where `load_in_4bit`.
    """
    from nbkit.training import offline

    path = offline.resolve_model(name)
    if backend == "unsloth":
        from unsloth import FastLanguageModel

        return FastLanguageModel.from_pretrained(
            path, load_in_4bit=load_in_4bit, dtype=dtype, max_seq_length=max_seq_length
        )
    from transformers import AutoModelForCausalLM

    return _transformers_model(AutoModelForCausalLM, path, load_in_4bit, dtype), offline.load_processor(path)


def _transformers_model(auto_class: Any, path: str, load_in_4bit: bool, dtype: Any) -> Any:
    """`auto_class`.from_pretrained(path) whole on this rank's device, in `dtype` or 4-bit (bitsandbytes)."""
    from transformers import BitsAndBytesConfig

    from nbkit.platform import distributed

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype) if load_in_4bit else None
    return auto_class.from_pretrained(
        path, dtype=dtype, device_map={"": distributed.device()}, quantization_config=quantization
    )


def check_checkpointing(checkpointing: str | None, backend: str) -> None:
    """Raise OptionsError for a checkpointing value nbkit.savers.apply does not take, or for one other than
    "offload" under unsloth, whose own checkpointing is offloaded (add_lora's `checkpointing`).
    """
    from nbkit.training.savers import CHECKPOINTING

    if checkpointing not in CHECKPOINTING:
        choices = ", ".join(map(repr, CHECKPOINTING))
        raise OptionsError(f"checkpointing must be one of {choices}, not {checkpointing!r}.")
    if backend == "unsloth" and checkpointing != "offload":
        raise OptionsError(
            f"checkpointing={checkpointing!r} applies to the transformers backend: unsloth brings its own offloaded "
            "checkpointing. Leave checkpointing='offload', or pass backend='transformers'."
        )


def add_lora(
    model: Any,
    backend: str,
    *,
    r: int = 16,
    lora_alpha: int = 16,
    random_state: int = 3407,
    checkpointing: str | None = "offload",
) -> Any:
    """`model` with LoRA adapters on its language layers' attention and MLP projections (a vision tower stays
    frozen) and nbkit's DDP-safe memory savers, returned as the backend returns it.

    unsloth: FastVisionModel.get_peft_model, then nbkit's chunked loss (unsloth brings its own checkpointing), or
    FastLanguageModel.get_peft_model for a text model (unsloth's own loss and checkpointing). transformers: peft's
    get_peft_model, then nbkit.savers.apply with `checkpointing` and Liger's kernels and compilation where they run
    (a GPU), which is what unsloth brings itself. Raises OptionsError for checkpointing other than "offload" under
    unsloth, whose own checkpointing is offloaded.
    """
    from nbkit.training import savers

    check_checkpointing(checkpointing, backend)
    vision = _has_vision(model.config)
    if backend == "unsloth":
        lora = dict(r=r, lora_alpha=lora_alpha, lora_dropout=0, bias="none", random_state=random_state)
        if not vision:
            from unsloth import FastLanguageModel

            return FastLanguageModel.get_peft_model(model, target_modules=list(LORA_TARGET_MODULES), **lora)
        from unsloth import FastVisionModel

        language_only = dict(finetune_vision_layers=False, finetune_language_layers=True)
        model = FastVisionModel.get_peft_model(
            model, **language_only, finetune_attention_modules=True, finetune_mlp_modules=True, **lora
        )
        return savers.apply(model, checkpointing=None, tiled_mlp=False)
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(random_state)  # the same adapters on every rank and every run
    targets = _LANGUAGE_LAYERS if vision else list(LORA_TARGET_MODULES)
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets))
    return savers.apply(model, checkpointing=checkpointing, kernels="auto", compile="auto")


def for_training(model: Any, backend: str) -> None:
    """Put `model` in training mode (unsloth: FastVisionModel / FastLanguageModel.for_training, which also turns its
    caches off).
    """
    if backend == "unsloth":
        _unsloth_class(model).for_training(model)
    model.train()


def for_inference(model: Any, backend: str) -> None:
    """Put `model` in inference mode (unsloth: FastVisionModel / FastLanguageModel.for_inference, its faster
    generation).
    """
    if backend == "unsloth":
        _unsloth_class(model).for_inference(model)
    else:
        model.eval()


def vision_collator(model: Any, processor: Any, backend: str) -> Any:
    """The data collator for image-and-text batches: unsloth's UnslothVisionDataCollator, or None for
    transformers and for text models, where TRL's SFTTrainer builds its own collator from the processor.
    """
    if backend != "unsloth" or not _has_vision(model.config):
        return None
    from unsloth.trainer import UnslothVisionDataCollator

    return UnslothVisionDataCollator(model, processor)


def save_merged(model: Any, processor: Any, directory: str, backend: str) -> None:
    """Write the model with its LoRA merged into 16-bit weights (for vLLM) to `directory`: unsloth's
    save_pretrained_merged. Raises BackendError with the transformers backend, which has no such saver.
    """
    _unsloth_saver(backend, "merged 16-bit weights")
    model.save_pretrained_merged(directory, processor, save_method="merged_16bit")


def save_gguf(model: Any, processor: Any, directory: str, backend: str, quantization_method: str) -> None:
    """Write a GGUF file (llama.cpp, Ollama) of the merged model to `directory`, quantised by `quantization_method`
    ("q8_0", "q4_k_m", "f16", ...): unsloth's save_pretrained_gguf. Raises BackendError with the transformers
    backend, which has no such saver.
    """
    _unsloth_saver(backend, "a GGUF file")
    model.save_pretrained_gguf(directory, processor, quantization_method=quantization_method)


def _unsloth_saver(backend: str, what: str) -> None:
    if backend != "unsloth":
        raise BackendError(
            f"Saving {what} is unsloth's (backend 'unsloth'); this model trains with {backend}. The LoRA adapter "
            "is saved: to merge it, load the base model and the adapter with peft in one process and call "
            "merge_and_unload(), or train with backend='unsloth' on a GPU."
        )


def _has_vision(config: Any) -> bool:
    """Whether `config` (a model's, or a peft model's base) is a vision-language model's."""
    return getattr(config, "vision_config", None) is not None


def _unsloth_class(model: Any) -> Any:
    """The unsloth class for `model`: FastVisionModel for a vision-language model, FastLanguageModel for text."""
    if _has_vision(model.config):
        from unsloth import FastVisionModel

        return FastVisionModel
    from unsloth import FastLanguageModel

    return FastLanguageModel
