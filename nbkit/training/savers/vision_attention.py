"""The vision tower's attention split by image with sizes read once per forward, so each vision block compiles whole.

transformers' Qwen3-VL vision attention (sdpa and eager) attends within each image by splitting its queries, keys
and values at sizes it reads back from the GPU: `cu_seqlens` subtracted and `.tolist()`-ed once per query, key and
value in each block, 72 host syncs per forward of Qwen3-VL-2B's 24 blocks (benchmarks/RESULTS.md, "Where a step's
host syncs come from"). Under regional compilation the same read breaks each block's graph: dynamo cannot trace a
value it does not know, so it runs the split eagerly and resumes the block in graphs of its own.

Here a forward pre-hook on the vision tower reads the image sizes once, from `grid_thw` (the tower reads it on the
host anyway for its position embeddings), and hands them down as a keyword argument that transformers passes
through the tower to each block and its attention. The attention, given them, computes what transformers' does,
op for op, splitting at those Python ints: no sync, and dynamo traces the split with the sizes as symbolic
integers, so each vision block compiles as one graph (a new count of images a batch is a new graph; new sizes are
not, after the first change). Without the keyword (a tower called without the hook), with an attention
implementation that takes `cu_seqlens` itself (flash), or for a forward of one image, transformers' own forward
runs.

Measured on one H200 (benchmarks/RESULTS.md, "The vision blocks compiled whole"), SFTTrainer, Qwen3-VL-2B, the
notebooks' transformers path, against transformers' split in the same call: four 64-token images a step stepped
1.07x faster in bf16 (0.200 s against 0.215, medians of 3) and 1.19x under the T4 profile (one pair); two
1,600-token images as fast (0.492 against 0.501). One 1,600-token image a step stepped slower in 10 of 12
interleaved pairs over three calls (by a median of 1.08x), every host op a little slower, for a reason not found; so
a forward of one piece keeps transformers' split (its 72 syncs and graph breaks with it).

Only for attention classes whose split is exactly one piece per image or frame (_CLASSES): Qwen2.5-VL, for one,
splits its windowed layers by window, which the grid alone does not give.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import torch
from torch import nn

from nbkit.training.savers._model import add_mixin, base_model, remove_mixin, vision_encoder

__all__ = ["disable", "enable", "image_sizes", "is_enabled"]

# The keyword argument that carries the sizes from the tower's pre-hook to the attention.
_SIZES = "nbkit_image_sizes"
# Attention classes computed here, by name: the same code in transformers 4.57 to 5.x.
_CLASSES = ("Qwen3VLVisionAttention", "Qwen3VLMoeVisionAttention")
# Forwards of fewer pieces (images or frames) keep transformers' split: one 1,600-token image stepped slower here than
# there in 10 of 12 pairs, by a median of 1.08x (the module docstring).
_FEWEST_PIECES = 2
# The implementations for which transformers splits by image itself (flash takes cu_seqlens whole).
_SPLIT_IMPLEMENTATIONS = ("sdpa", "eager")
# The original forward's own parameters besides hidden_states and cu_seqlens (4.57: rotary_pos_emb, 5.x:
# max_seqlen): not passed on to the attention function, as the original does not pass them.
_OWN_PARAMETERS = ("position_embeddings", "rotary_pos_emb", "max_seqlen")
# Set on the tower: the pre-hook's handle, removed by disable().
_HOOK = "_nbkit_image_sizes_hook"


def image_sizes(grid_thw: torch.Tensor) -> tuple[int, ...]:
    """The patch count of each image or video frame of `grid_thw` (rows of temporal, height, width): the pieces
    transformers' `cu_seqlens` marks. Reads `grid_thw` on the host (one sync where it is on a GPU).
    """
    return tuple(height * width for frames, height, width in grid_thw.tolist() for _ in range(frames))


def enable(model: nn.Module) -> bool:
    """Give `model`'s vision attention the sizes read once per forward (see the module docstring).

    Takes a transformers VLM, bare or wrapped (peft, DDP). Returns whether anything changed: False for a model
    without a vision tower or whose attention is not one of _CLASSES. Idempotent; disable() undoes it.
    """
    tower = vision_encoder(base_model(model))
    if tower is None:
        return False
    attentions = [m for m in tower.modules() if type(m).__name__ in _CLASSES]  # add_mixin keeps the name
    if not attentions:
        return False
    for attention in attentions:
        add_mixin(attention, _SizedSplit)
    if getattr(tower, _HOOK, None) is None:
        setattr(tower, _HOOK, tower.register_forward_pre_hook(_pass_sizes, with_kwargs=True))
    return True


def disable(model: nn.Module) -> None:
    """Undo enable(): transformers' own split again. A no-op where enable() changed nothing."""
    tower = vision_encoder(base_model(model))
    if tower is None:
        return
    handle = getattr(tower, _HOOK, None)
    if handle is not None:
        handle.remove()
        delattr(tower, _HOOK)
    for module in tower.modules():
        remove_mixin(module, _SizedSplit)


def is_enabled(model: nn.Module) -> bool:
    """Whether enable() is in effect on `model`."""
    tower = vision_encoder(base_model(model))
    return tower is not None and getattr(tower, _HOOK, None) is not None


def _pass_sizes(
    tower: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The tower's pre-hook: its call (pixel values, grid_thw) gets the image sizes as _SIZES, where there are
    _FEWEST_PIECES or more.
    """
    grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
    if not isinstance(grid, torch.Tensor):
        return None
    sizes = image_sizes(grid)
    return (args, {**kwargs, _SIZES: sizes}) if len(sizes) >= _FEWEST_PIECES else None


class _SizedSplit:
    """Mixin on a vision attention module: its split by image at the sizes given as _SIZES."""

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes = kwargs.pop(_SIZES, None)
        position_embeddings = kwargs.get("position_embeddings")
        module = cast(Any, self)
        implementation = module.config._attn_implementation
        if sizes is None or args or position_embeddings is None or implementation not in _SPLIT_IMPLEMENTATIONS:
            # transformers' forward from the class add_mixin kept, not super(): dynamo did not trace a zero-argument
            # super() in this mixin (torch 2.11 on one H200: "invalid args to call_super") and broke each compiled
            # vision block's graph there, beside transformers' own break at its split.
            original = type(module)._nbkit_original.forward
            return original(module, hidden_states, cu_seqlens, *args, **kwargs)
        passed = {name: value for name, value in kwargs.items() if name not in _OWN_PARAMETERS}
        # transformers' steps, in its order (modeling_qwen3_vl.py, Qwen3VLVisionAttention.forward), with the model
        # module's own rotary embedding and attention functions.
        code = sys.modules[type(module)._nbkit_original.__module__]
        tokens = hidden_states.shape[0]
        query, key, value = (
            module.qkv(hidden_states).reshape(tokens, 3, module.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        )
        query, key = code.apply_rotary_pos_emb_vision(query, key, *position_embeddings)
        query, key, value = (states.transpose(0, 1).unsqueeze(0) for states in (query, key, value))
        functions = code.ALL_ATTENTION_FUNCTIONS
        attend = code.eager_attention_forward if implementation == "eager" else functions[implementation]
        pieces = [
            attend(
                module,
                q,
                k,
                v,
                attention_mask=None,
                scaling=module.scaling,
                dropout=0.0 if not module.training else module.attention_dropout,
                is_causal=False,
                **passed,
            )[0]
            for q, k, v in zip(*(torch.split(states, list(sizes), dim=2) for states in (query, key, value)))
        ]
        return module.proj(torch.cat(pieces, dim=1).reshape(tokens, -1).contiguous())
