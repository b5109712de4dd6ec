"""Synthetic training batches for the benchmarks (text, or text with one small image), and their shards."""

from __future__ import annotations

from typing import Any

import torch

IMAGE_GRID = (1, 16, 16)


def synthetic_batch(
    config: Any,
    seq_len: int,
    batch: int,
    device: torch.device | str,
    *,
    image: bool = False,
    seed: int = 0,
    image_grid: tuple[int, int, int] = IMAGE_GRID,
) -> dict[str, torch.Tensor]:
    """A training batch of `batch` random sequences of exactly `seq_len` tokens, labels = inputs
    (image tokens excepted).

    Takes the model's config (text or Qwen-VL), the length and count, the device, whether each
    sequence carries one image (image_grid patches, (t, h, w), by default IMAGE_GRID's small one, as
    <vision_start> <image_pad>... <vision_end> right after the first token, with pixel_values,
    image_grid_thw and mm_token_type_ids), and a seed (same seed, same batch). No attention mask (no
    padding), so attention never materialises a seq x seq mask. Token ids avoid the image/video marker ids; image tokens get label -100. Raises ValueError when an image
    is asked of a model that is not a Qwen-VL or does not fit in `seq_len`.
    """
    if seq_len < 2 or batch < 1:
        raise ValueError(f"A batch needs seq_len >= 2 and batch >= 1 (got {seq_len} x {batch}).")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = text.vocab_size
    markers = {
        getattr(config, name, None)
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    } - {None}
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    if markers:
        filler = next(i for i in range(vocab) if i not in markers)
        ids[torch.isin(ids, torch.tensor(sorted(markers)))] = filler
    out = {"input_ids": ids}
    if image:
        out.update(_image_inputs(config, ids, generator, image_grid))
    out["labels"] = ids.clone()
    if image:  # as chat collators do: no loss on image tokens
        out["labels"][out["mm_token_type_ids"].bool()] = -100
    return {k: v.to(device) for k, v in out.items()}


def _image_inputs(
    config: Any, ids: torch.Tensor, generator: torch.Generator, grid: tuple[int, int, int]
) -> dict[str, torch.Tensor]:
    vision = getattr(config, "vision_config", None)
    needed = ("patch_size", "temporal_patch_size", "spatial_merge_size")
    if vision is None or not all(hasattr(vision, n) for n in needed) or getattr(config, "image_token_id", None) is None:
        raise ValueError(
            f"--image needs a Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL); {type(config).__name__} is not one. "
            "Run text-only batches instead."
        )
    batch, seq_len = ids.shape
    t, h, w = grid
    patches = t * h * w
    tokens = patches // vision.spatial_merge_size**2
    if seq_len < tokens + 3:
        raise ValueError(f"One image takes {tokens + 2} tokens; seq_len {seq_len} is too short for it.")
    channels = getattr(vision, "in_channels", 3)
    width = channels * vision.temporal_patch_size * vision.patch_size**2
    ids[:, 1] = config.vision_start_token_id
    ids[:, 2 : 2 + tokens] = config.image_token_id
    ids[:, 2 + tokens] = config.vision_end_token_id
    kinds = torch.zeros_like(ids, dtype=torch.int32)
    kinds[:, 2 : 2 + tokens] = 1
    return {
        "pixel_values": torch.randn(batch * patches, width, generator=generator),
        "image_grid_thw": torch.tensor([grid] * batch),
        "mm_token_type_ids": kinds,
    }


def shard_batch(batch: dict[str, torch.Tensor], parts: int, index: int) -> dict[str, torch.Tensor]:
    """Rows index*n/parts .. (index+1)*n/parts of a synthetic batch (its images' patches included):
    the share of one rank of `parts` in a global batch. Raises ValueError if the rows do not split evenly.
    """
    rows = batch["input_ids"].shape[0]
    if rows % parts:
        raise ValueError(f"A batch of {rows} rows does not split into {parts} equal parts.")
    size = rows // parts
    out = {}
    for key, value in batch.items():
        if key == "pixel_values":  # (images x patches, width): each row's image is a block of patches
            per_row = value.shape[0] // rows
            out[key] = value[index * size * per_row : (index + 1) * size * per_row]
        else:
            out[key] = value[index * size : (index + 1) * size]
    return out
