"""nbkit.savers.vision_attention: Qwen3-VL's vision attention split by image at sizes read once per forward.

What a user relies on: the same loss and gradients as transformers' own attention (here bit for bit, eagerly, with
LoRA on the vision tower's attention too), for batches with images of several sizes, under both attention
implementations that split; with two images or more the sizes are read once per forward instead of three times in
each block (counted here as the host reads of a tensor, `Tensor.tolist`, which on a GPU each wait for it), with one
image transformers' split runs; and disable() gives transformers' attention back. That each vision block then
compiles as one graph is checked in tests/test_savers_compile.py on the CPU, and here on a GPU (`pytest -m gpu`),
with inductor, against transformers' attention uncompiled.
"""

from __future__ import annotations

import math

import pytest
import test_savers
import torch
from gpu_marks import one_gpu
from test_savers import (
    GPU_TOLERANCE,
    LANGUAGE_LINEARS,
    assert_grads_match,
    loss_and_grads,
    make_batch,
    relative_error,
    tiny_model,
)
from transformers.models.qwen3_vl import modeling_qwen3_vl

from nbkit.training import savers
from nbkit.training.savers import _model, vision_attention

# Three batches: one image, two images of different sizes, two images of the same size.
GRIDS = [[(1, 4, 4)], [(1, 8, 4), (1, 2, 6)], [(1, 6, 6), (1, 6, 6)]]


def _batches(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    batches = []
    for index, grids in enumerate(GRIDS):
        rows = []
        for grid in grids:
            monkeypatch.setattr(test_savers, "IMAGE_GRID", grid)
            rows.append(make_batch(model, [math.prod(grid) // 4 + 7], seed=10 * index + len(rows)))
        width = max(row["input_ids"].shape[1] for row in rows)
        batch = {}
        for key in rows[0]:
            parts = [row[key] for row in rows]
            if parts[0].dim() == 2 and key not in ("pixel_values", "image_grid_thw"):
                pad = -100 if key == "labels" else 0
                parts = [torch.nn.functional.pad(part, (0, width - part.shape[1]), value=pad) for part in parts]
            batch[key] = torch.cat(parts)
        batches.append(batch)
    return batches


def _host_reads(model: torch.nn.Module, batch: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> int:
    reads = 0
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> object:
        nonlocal reads
        reads += 1
        return tolist(self)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", counted)
        model(**batch)
    return reads


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_the_split_at_sizes_read_once_gives_transformers_results(monkeypatch, implementation):
    model = tiny_model("qwen3-vl", targets=[*LANGUAGE_LINEARS, "qkv"]).train()
    tower = _model.vision_encoder(_model.base_model(model))
    tower.config._attn_implementation = implementation
    blocks = len(tower.blocks)
    batches = _batches(model, monkeypatch)
    references = [loss_and_grads(model, batch) for batch in batches]
    reads_before = _host_reads(model, batches[1], monkeypatch)
    one_image_reads_before = _host_reads(model, batches[0], monkeypatch)

    assert vision_attention.enable(model)
    assert vision_attention.enable(model)  # again: nothing more
    for batch, (reference_loss, reference_grads) in zip(batches, references, strict=True):
        loss, grads = loss_and_grads(model, batch)
        assert torch.equal(loss, reference_loss)
        assert grads.keys() == reference_grads.keys()
        assert any("qkv" in name for name in grads)
        for name, grad in grads.items():
            assert torch.equal(grad, reference_grads[name]), name
    # transformers reads the sizes for the query, key and value of every block; nbkit once, from the grid
    assert _host_reads(model, batches[1], monkeypatch) == reads_before - 3 * blocks + 1
    # one image: transformers' split, and the grid read to count the images
    assert _host_reads(model, batches[0], monkeypatch) == one_image_reads_before + 1

    vision_attention.disable(model)
    assert not vision_attention.is_enabled(model)
    assert type(tower.blocks[0].attn) is modeling_qwen3_vl.Qwen3VLVisionAttention
    assert not tower._forward_pre_hooks
    assert _host_reads(model, batches[1], monkeypatch) == reads_before


def test_image_sizes_count_each_frame_as_transformers_cu_seqlens_does():
    grid = torch.tensor([[1, 4, 6], [2, 2, 2]])
    lengths = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    assert vision_attention.image_sizes(grid) == tuple(lengths.tolist()) == (24, 4, 4)


def test_a_model_without_a_splitting_vision_attention_is_left_alone():
    model = tiny_model("qwen3", lora=False)
    assert not vision_attention.enable(model)
    assert not vision_attention.is_enabled(model)


@pytest.mark.gpu
@one_gpu
@pytest.mark.usefixtures("exact_fp32")
def test_on_a_gpu_the_vision_blocks_of_several_images_compile_whole_and_give_transformers_results(monkeypatch):
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3-vl", targets=[*LANGUAGE_LINEARS, "qkv"]).to("cuda").train()
    batches = [{key: value.to("cuda") for key, value in batch.items()} for batch in _batches(model, monkeypatch)]
    references = [loss_and_grads(model, batch) for batch in batches]
    savers.apply(model, checkpointing=None, tiled_mlp=False, chunked_loss=True, compile="regional")
    assert vision_attention.is_enabled(model)
    torch._dynamo.reset()
    try:
        for batch, (reference_loss, reference_grads) in zip(batches, references, strict=True):
            counters.clear()
            loss, grads = loss_and_grads(model, batch)
            assert relative_error(loss, reference_loss) < GPU_TOLERANCE
            assert_grads_match(grads, reference_grads, GPU_TOLERANCE)
            if len(batch["image_grid_thw"]) > 1:  # one image keeps transformers' split, and its graph break
                assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        savers.remove(model)
        torch._dynamo.reset()
    assert not vision_attention.is_enabled(model)
