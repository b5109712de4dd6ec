"""LoRA models for the benchmarks, built the way each backend's users build them.

- "unsloth": unsloth's FastVisionModel (FastLanguageModel for text models), 16-bit weights, its
  gradient checkpointing "unsloth". Imported inside the rank only (importing it initialises CUDA).
- "nbkit": transformers + peft with `nbkit.savers.apply(model)` (offloaded checkpointing, tiled MLP,
  chunked loss by default).
- "plain": transformers + peft with transformers' non-reentrant gradient checkpointing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from benchmarks.cases import BACKENDS, PRECISIONS, LaunchSpec


def is_vision(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def build_model(
    backend: str,
    path: str,
    precision: str,
    device: torch.device,
    *,
    lora_r: int = 16,
    max_seq_len: int = 2048,
    savers: dict[str, Any] | None = None,
    unsloth_checkpointing: str | bool = "unsloth",
    seed: int = 0,
) -> nn.Module:
    """A LoRA model ready to train on `device`, built the way each backend's users build it.

    Takes the backend ("unsloth", "nbkit", "plain"), a local checkpoint path, the precision
    ("bf16"/"fp16": weights in that dtype, trained under autocast; "fp32"), the rank's device, the
    LoRA rank (alpha = r, all linear layers, the LM head excluded), the longest sequence unsloth
    should prepare for, nbkit.savers.apply options (defaults: all savers), unsloth's
    use_gradient_checkpointing, and the seed of the LoRA initialisation (same on every rank).
    Returns the peft model in train mode, trainable parameters in fp32 (GradScaler needs fp32
    gradients; peft does this by default, unsloth may not). Raises ValueError for an unknown
    backend or precision; ImportError when unsloth is asked for and not installed.
    """
    from transformers import AutoConfig

    if backend not in BACKENDS:
        raise ValueError(f"Unknown backend {backend!r}; use one of {', '.join(BACKENDS)}.")
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}.")
    dtype = PRECISIONS[precision]
    vision = is_vision(AutoConfig.from_pretrained(path))
    place = str(device)  # the whole model on this rank's device ("cuda:1", "cpu")
    if backend == "unsloth":
        model = _unsloth_model(path, dtype, place, vision, lora_r, max_seq_len, unsloth_checkpointing, seed)
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", device_map=place)
        model.config.use_cache = False
        if backend == "plain":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(seed)
        lora = LoraConfig(
            r=lora_r, lora_alpha=lora_r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
        model = get_peft_model(model, lora)
        if backend == "nbkit":
            import nbkit.savers

            nbkit.savers.apply(model, **(savers or {}))
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    model.train()
    return model


def _unsloth_model(
    path: str,
    dtype: torch.dtype,
    place: str,
    vision: bool,
    lora_r: int,
    max_seq_len: int,
    checkpointing: str | bool,
    seed: int,
) -> nn.Module:
    import unsloth  # noqa: F401  (first, as unsloth requires; ~25 s, initialises CUDA)
    from unsloth import FastLanguageModel, FastVisionModel

    loader = FastVisionModel if vision else FastLanguageModel
    model, _ = loader.from_pretrained(
        path,
        max_seq_length=max_seq_len,
        dtype=dtype,
        load_in_4bit=False,
        device_map=place,
        use_gradient_checkpointing=checkpointing,
    )
    lora = dict(
        r=lora_r,
        lora_alpha=lora_r,
        lora_dropout=0.0,
        bias="none",
        random_state=seed,
        use_gradient_checkpointing=checkpointing,
    )
    if vision:
        lora.update(
            target_modules="all-linear",
            finetune_vision_layers=True,
            finetune_language_layers=True,
            finetune_attention_modules=True,
            finetune_mlp_modules=True,
        )
    else:
        lora.update(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = loader.get_peft_model(model, **lora)
    loader.for_training(model)
    return model


def preload(spec: LaunchSpec) -> None:
    """Import what the ranks of `spec` will use (transformers, the model's modeling module, nbkit's
    savers) in the process that launches, so that forked ranks inherit it as they inherit a
    notebook's earlier imports. Never imports unsloth (it initialises CUDA) nor peft: `import peft`
    imports bitsandbytes where it is installed (peft/helpers.py), and both notebook launchers then
    refuse to fork. No CUDA here.
    """
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    config = AutoConfig.from_pretrained(spec.model_path)
    mapping = (
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
        if is_vision(config)
        else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    )
    mapping[type(config)]  # imports the modeling module
    if spec.backend == "nbkit":
        import nbkit.savers  # noqa: F401
