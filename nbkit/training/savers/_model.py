"""Finding the parts of a transformers model that the memory savers change, and changing them reversibly.

Shared by every saver (checkpointing, tiled MLP, chunked loss):

- `base_model(model)`: the transformers model under peft / DDP wrappers.
- `decoder_layers(model)`: the ModuleList of the language model's decoder layers (the vision tower of
  a VLM is never returned).
- `layer_mlp(layer)`: the feed-forward block of one decoder layer.
- `add_mixin(module, mixin)` / `remove_mixin(module, mixin)`: give one module instance extra
  behaviour by swapping its class for a cached subclass `(mixin, original class)`, and swap it back.
  Overriding `__call__` this way wraps the module's hooks and any instance-level `forward` set by
  accelerate's device hooks, which a plain `forward` replacement would sit inside of.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

__all__ = ["add_mixin", "base_model", "decoder_layers", "has_mixin", "layer_mlp", "remove_mixin", "vision_encoder"]

# Attribute names under which transformers VLMs keep their vision / audio encoders.
_ENCODER_NAMES = ("visual", "vision_tower", "vision_model", "vision_encoder", "image_encoder", "audio_tower")
# Attribute names of the feed-forward block inside a decoder layer.
_MLP_NAMES = ("mlp", "feed_forward", "ffn")


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside `model`, which may be wrapped by peft and/or DistributedDataParallel.

    Returns `model` itself when it is not wrapped.
    """
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
            continue
        get_base_model = getattr(model, "get_base_model", None)  # peft.PeftModel
        if not callable(get_base_model):
            return model
        inner = get_base_model()
        if inner is model:
            return model
        model = inner


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of the (language) model, as the ModuleList the model iterates over.

    Takes a transformers decoder or VLM, bare or wrapped (peft, DDP). Uses transformers'
    `get_decoder()` (Qwen3, Llama, Gemma: `model.model.layers`; Qwen3-VL, Gemma 3, LLaVA:
    `model.model.language_model.layers`) and otherwise the largest ModuleList of identical blocks
    that have a feed-forward part and sit outside any vision/audio encoder (GPT-2's `transformer.h`).
    Raises ValueError when no such list exists.
    """
    base = base_model(model)
    try:
        get_decoder = getattr(base, "get_decoder", None)
        decoder = get_decoder() if callable(get_decoder) else base
    except (AttributeError, NotImplementedError, ValueError):
        decoder = base
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0 and layer_mlp(layers[0]) is not None:
        return layers
    candidates = [
        module
        for name, module in base.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) > 0
        and not any(part in _ENCODER_NAMES for part in name.split("."))
        and len({type(block) for block in module}) == 1
        and layer_mlp(module[0]) is not None
    ]
    if not candidates:
        raise ValueError(
            f"nbkit.savers could not find the decoder layers of {type(base).__name__}: no ModuleList of "
            "blocks with an 'mlp' / 'feed_forward' part outside the vision tower. Pass a transformers "
            "decoder or vision-language model (Qwen3, Qwen3-VL, Llama, Gemma, ...), or turn the savers off."
        )
    return max(candidates, key=len)


def vision_encoder(model: nn.Module) -> nn.Module | None:
    """The vision (or audio) encoder of a transformers VLM (`model.model.visual`, `model.visual`, ...), or None.

    Takes the transformers model itself (see base_model()).
    """
    inner = getattr(model, "model", None)
    for name in _ENCODER_NAMES:
        encoder = getattr(inner, name, None) if isinstance(inner, nn.Module) else None
        encoder = encoder if isinstance(encoder, nn.Module) else getattr(model, name, None)
        if isinstance(encoder, nn.Module):
            return encoder
    return None


def layer_mlp(layer: nn.Module) -> nn.Module | None:
    """The feed-forward block of a decoder layer (`mlp`, `feed_forward` or `ffn`), or None."""
    for name in _MLP_NAMES:
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


_SUBCLASSES: dict[tuple[type, type], type] = {}


def add_mixin(module: nn.Module, mixin: type) -> None:
    """Make `module` an instance of a subclass of (mixin, its class); a no-op if it already is one.

    The subclass keeps the original name and module, so printing the model and transformers' class
    checks see the same model.
    """
    if isinstance(module, mixin):
        return
    original = type(module)
    subclass = _SUBCLASSES.get((mixin, original))
    if subclass is None:
        subclass = type(
            original.__name__,
            (mixin, original),
            {"__module__": original.__module__, "__qualname__": original.__qualname__, "_nbkit_original": original},
        )
        _SUBCLASSES[(mixin, original)] = subclass
    module.__class__ = subclass


def remove_mixin(module: nn.Module, mixin: type) -> None:
    """Undo add_mixin: give `module` back its original class; a no-op if it does not have the mixin."""
    if has_mixin(module, mixin):
        module.__class__ = cast(Any, type(module))._nbkit_original


def has_mixin(module: nn.Module, mixin: type) -> bool:
    """Whether add_mixin(module, mixin) is in effect."""
    return isinstance(module, mixin) and type(module) is _SUBCLASSES.get(
        (mixin, cast(Any, type(module))._nbkit_original)
    )
