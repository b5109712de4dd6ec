"""nbkit.savers in one process: each saver computes what the plain model computes, and comes off cleanly.

Tiny offline models (nbkit.resolve_model), fp32, LoRA with random A and B (so every LoRA gradient is
non-zero). The DDP matrix is in test_savers_ddp.py, the CUDA paths in test_savers_gpu.py.
"""

from __future__ import annotations

import copy
import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import nbkit
from nbkit.training import savers
from nbkit.training.savers import loss
from nbkit.training.savers._model import decoder_layers, layer_mlp
from nbkit.training.savers.tiled_mlp import automatic_tokens_per_shard, shard_count, tokens_per_shard

# Every linear layer of the language model; the names do not occur in Qwen3-VL's vision tower.
LANGUAGE_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOLERANCE = 1e-4
# On GPUs (test_savers_gpu.py, test_liger_gpu.py): fp32 without TF32, but kernels may order sums differently.
GPU_TOLERANCE = 1e-3
# A 32x32 image at the tiny VL model's 8px patches and 2x2 merge: a 4x4 patch grid, 4 image tokens.
IMAGE_GRID = (1, 4, 4)


@functools.cache
def _pretrained(kind: str) -> torch.nn.Module:
    auto = AutoModelForImageTextToText if kind == "qwen3-vl" else AutoModelForCausalLM
    return auto.from_pretrained(nbkit.resolve_model(f"tiny:{kind}"), dtype=torch.float32)


def tiny_model(
    kind: str, *, lora: bool = True, dropout: float = 0.0, targets: list[str] | None = None, seed: int = 0
) -> torch.nn.Module:
    """A fresh tiny:qwen3 or tiny:qwen3-vl in fp32, with LoRA (random A and B, r=4) unless lora=False."""
    model = copy.deepcopy(_pretrained(kind))
    if not lora:
        return model
    # Imported here: peft imports bitsandbytes where it is installed, which a process that launches
    # ranks (test_savers_ddp, the GPU tests) should not have done.
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets or LANGUAGE_LINEARS, init_lora_weights=False
    )
    return get_peft_model(model, config)


def make_batch(model: torch.nn.Module, lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """A right-padded batch of random tokens, one sequence per entry of `lengths`.

    Labels ignore the padding and the first two tokens. For a VL model every sequence starts
    with one 32x32 image (pixel_values, image_grid_thw, mm_token_type_ids built directly).
    """
    config = savers._model.base_model(model).config
    vision = getattr(config, "vision_config", None)
    vocab = config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(16, vocab, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100
    if vision is not None:
        t, h, w = IMAGE_GRID
        tokens = t * h * w // vision.spatial_merge_size**2
        ids[:, 1] = config.vision_start_token_id
        ids[:, 2 : 2 + tokens] = config.image_token_id
        ids[:, 2 + tokens] = config.vision_end_token_id
        labels[:, : 3 + tokens] = -100
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        batch["pixel_values"] = torch.randn(len(lengths) * t * h * w, patch, generator=generator)
        batch["image_grid_thw"] = torch.tensor([IMAGE_GRID] * len(lengths))
        batch["mm_token_type_ids"] = (ids == config.image_token_id).long()
    batch["labels"] = labels
    return batch


def trainable_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor], seed: int = 1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), trainable_grads(model)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_grads_match(
    grads: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    tolerance: float = TOLERANCE,
    label: str = "",
) -> None:
    """Same names, every gradient within `tolerance` (relative) of the reference's, no LoRA gradient zero; a
    failure names the worst gradient, after `label` (the case or rank compared)."""
    assert grads.keys() == reference.keys(), f"{label}names differ"
    errors = {name: relative_error(grads[name], reference[name]) for name in reference}
    worst = max(errors, key=errors.get)
    assert errors[worst] < tolerance, f"{label}{worst}: relative error {errors[worst]:.2e}"
    assert all(reference[name].norm() > 0 for name in reference if "lora" in name), f"{label}a LoRA gradient is zero"


def count_calls(module: torch.nn.Module, counts: dict[str, int], key: str):
    """Count calls of `module` (pre-hook: a recompute stopped early still counts)."""

    def hook(*_):
        counts[key] += 1

    return module.register_forward_pre_hook(hook)


SAVER_CASES = {
    "offload": dict(checkpointing="offload", tiled_mlp=False, chunked_loss=False),
    "recompute": dict(checkpointing="recompute", tiled_mlp=False, chunked_loss=False),
    "tiled": dict(checkpointing=None, tiled_mlp=3, chunked_loss=False),
    "chunked_loss": dict(checkpointing=None, tiled_mlp=False, chunked_loss=True),
    "all": dict(checkpointing="offload", tiled_mlp=3, chunked_loss=True),
}


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-vl"])
def test_each_saver_matches_the_plain_lora_model(kind):
    model = tiny_model(kind)
    batch = make_batch(model, [24, 17], seed=3)
    reference_loss, reference = loss_and_grads(model, batch)
    for name, options in SAVER_CASES.items():
        savers.apply(model, **options)
        loss, grads = loss_and_grads(model, batch)
        assert relative_error(loss, reference_loss) < TOLERANCE, name
        assert_grads_match(grads, reference)
    savers.remove(model)
    loss, grads = loss_and_grads(model, batch)
    assert torch.equal(loss, reference_loss)
    assert all(torch.equal(grads[n], reference[n]) for n in reference)


def test_full_finetune_of_a_bare_pretrained_model():
    model = tiny_model("qwen3", lora=False)
    batch = make_batch(model, [20, 20], seed=4)
    reference_loss, reference = loss_and_grads(model, batch)
    assert savers.apply(model, checkpointing="offload", tiled_mlp=2) is model
    loss, grads = loss_and_grads(model, batch)
    assert relative_error(loss, reference_loss) < TOLERANCE
    assert_grads_match(grads, reference)


def test_checkpointing_recomputes_each_layer_and_tiling_skips_the_redundant_mlp_forward():
    model = tiny_model("qwen3")
    layer = decoder_layers(model)[0]
    counts = {"layer": 0, "mlp": 0}
    count_calls(layer, counts, "layer")
    count_calls(layer_mlp(layer), counts, "mlp")
    batch = make_batch(model, [16], seed=5)

    def calls(**options):
        savers.apply(model, chunked_loss=False, **options)
        counts.update(layer=0, mlp=0)
        loss_and_grads(model, batch)
        return dict(counts)

    assert calls(checkpointing=None, tiled_mlp=False) == {"layer": 1, "mlp": 1}
    assert calls(checkpointing="recompute", tiled_mlp=False) == {"layer": 2, "mlp": 2}
    # 4 shards forward + 4 recomputed in the backward.
    assert calls(checkpointing=None, tiled_mlp=4) == {"layer": 1, "mlp": 8}
    # Under checkpointing the layer's recompute stops before the MLP: still 8 MLP calls, not 12.
    assert calls(checkpointing="offload", tiled_mlp=4) == {"layer": 2, "mlp": 8}
    # No grad (evaluation): no checkpoint, MLP still tiled.
    counts.update(layer=0, mlp=0)
    with torch.no_grad():
        model(**batch)
    assert counts == {"layer": 1, "mlp": 4}
    # A layer with nothing to differentiate (frozen, its input without grad) is not checkpointed.
    for p in layer.parameters():
        p.requires_grad_(False)
    assert calls(checkpointing="offload", tiled_mlp=False) == {"layer": 1, "mlp": 1}


def test_automatic_shard_count_follows_tokens_and_hidden_size():
    model = tiny_model("qwen3")
    hidden = savers._model.base_model(model).config.hidden_size
    mlp = layer_mlp(decoder_layers(model)[0])
    counts = {"mlp": 0}
    count_calls(mlp, counts, "mlp")
    savers.apply(model, checkpointing=None, tiled_mlp=True, chunked_loss=False)
    for length in (2 * hidden, 2 * hidden + 1, 5 * hidden):
        counts["mlp"] = 0
        with torch.no_grad():
            model(input_ids=torch.randint(16, 200, (1, length)))
        assert counts["mlp"] == -(-length // (2 * hidden)) == shard_count(length, length, hidden)
    assert shard_count(100, 10, 64, requested=32) == 10
    assert tokens_per_shard(mlp) is None  # on the CPU: the rule above, not the device's memory


def test_automatic_tiling_on_a_gpu_follows_its_memory():
    # Qwen3-VL-2B's MLP (hidden 2048, intermediate 6144): on a 15 GiB T4, 16K tokens run in 4 shards (the
    # count that kept the peak under unsloth's there), 4K tokens (1K x 4) whole; on an 80 GiB card 16K
    # tokens run whole (faster) and 64K tokens split.
    t4, h100 = (automatic_tokens_per_shard(gib * 2**30, 6144) for gib in (15.0, 79.2))
    assert shard_count(16384, 16384, 2048, tokens_per_shard=t4) == 4
    assert shard_count(4096, 1024, 2048, tokens_per_shard=t4) == 1
    assert shard_count(16384, 16384, 2048, tokens_per_shard=h100) == 1
    assert shard_count(65536, 65536, 2048, tokens_per_shard=h100) == 3
    assert shard_count(16384, 16384, 2048, 2, tokens_per_shard=h100) == 2  # an asked count wins


@pytest.mark.parametrize("checkpointing, tiled_mlp", [("recompute", False), (None, 3), ("offload", 3)])
def test_lora_dropout_replays_identically(checkpointing, tiled_mlp):
    """The recompute must draw the forward's dropout masks, or gradients do not match the forward."""
    model = tiny_model("qwen3", dropout=0.3)
    batch = make_batch(model, [18, 12], seed=6)
    model.train()
    if tiled_mlp:
        # The reference runs every MLP shard by shard with autograd (same RNG draws, nothing recomputed).
        for layer in decoder_layers(model):
            mlp = layer_mlp(layer)
            plain = mlp.forward
            mlp.forward = lambda x, plain=plain: torch.cat([plain(p) for p in x.tensor_split(tiled_mlp, -2)], -2)
    reference_loss, reference = loss_and_grads(model, batch, seed=7)
    for layer in decoder_layers(model):
        layer_mlp(layer).__dict__.pop("forward", None)
    loss_without_dropout, _ = loss_and_grads(model.eval(), batch)
    assert relative_error(loss_without_dropout, reference_loss) > 1e-3  # dropout is really active
    savers.apply(model.train(), checkpointing=checkpointing, tiled_mlp=tiled_mlp)
    loss, grads = loss_and_grads(model, batch, seed=7)
    assert relative_error(loss, reference_loss) < TOLERANCE
    assert_grads_match(grads, reference)


def test_inputs_that_do_not_require_grad():
    """LoRA on the MLPs only: neither a layer's input nor the first MLP's input requires grad."""
    model = tiny_model("qwen3", targets=["gate_proj", "up_proj", "down_proj"])
    batch = make_batch(model, [20, 14], seed=8)
    reference_loss, reference = loss_and_grads(model, batch)
    savers.apply(model, checkpointing="offload", tiled_mlp=2)
    loss, grads = loss_and_grads(model, batch)
    assert relative_error(loss, reference_loss) < TOLERANCE
    assert_grads_match(grads, reference)


def test_apply_is_idempotent_switches_and_removes_cleanly():
    model = tiny_model("qwen3")
    base = savers._model.base_model(model)
    layers = decoder_layers(model)
    plain_layer, plain_mlp = type(layers[0]), type(layer_mlp(layers[0]))
    assert base.config.use_cache is True

    savers.apply(model)
    state = layers[0]._nbkit_checkpointing
    patched = type(layers[0]), type(layer_mlp(layers[0]))
    assert patched[0] is not plain_layer and patched[0].__name__ == plain_layer.__name__
    assert base.config.use_cache is False and state.offloader is not None and loss.is_applied(model)
    savers.apply(model)  # same options: nothing changes
    assert layers[0]._nbkit_checkpointing is state
    assert (type(layers[0]), type(layer_mlp(layers[0]))) == patched

    savers.apply(model, checkpointing="recompute", tiled_mlp=False, chunked_loss=False)
    assert layers[0]._nbkit_checkpointing.offloader is None
    assert type(layer_mlp(layers[0])) is plain_mlp
    assert base.config.use_cache is False and not loss.is_applied(model)

    savers.apply(model, checkpointing=None, tiled_mlp=True, chunked_loss=True)
    assert layer_mlp(layers[0])._nbkit_shards is None  # automatic
    savers.apply(model, checkpointing=None, tiled_mlp=1, chunked_loss=True)  # 1 == True, but not automatic
    assert layer_mlp(layers[0])._nbkit_shards == 1
    assert type(layers[0]) is plain_layer and not hasattr(layers[0], "_nbkit_checkpointing")
    assert base.config.use_cache is True and loss.is_applied(model)

    assert savers.remove(model) is model
    assert all(type(layer) is plain_layer and type(layer_mlp(layer)) is plain_mlp for layer in layers)
    assert not hasattr(base, "_nbkit_savers") and base.config.use_cache is True and not loss.is_applied(model)
    savers.remove(model)  # removing twice is fine


def test_transformers_gradient_checkpointing_is_not_doubled():
    model = tiny_model("qwen3")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    layer = decoder_layers(model)[0]
    counts = {"layer": 0}
    count_calls(layer, counts, "layer")
    batch = make_batch(model, [16], seed=9)
    savers.apply(model, checkpointing="offload", tiled_mlp=False, chunked_loss=False)
    model.train()
    loss_and_grads(model, batch)
    assert counts["layer"] == 2  # one forward, one recompute (not a checkpoint inside a checkpoint)


def test_bad_options_and_models_raise_helpful_errors():
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="checkpointing='cpu'.*'offload', 'recompute' or None"):
        savers.apply(model, checkpointing="cpu")
    with pytest.raises(ValueError, match="tiled_mlp=0"):
        savers.apply(model, tiled_mlp=0)
    with pytest.raises(ValueError, match="could not find the decoder layers of Sequential"):
        savers.apply(torch.nn.Sequential(torch.nn.Linear(2, 2)), chunked_loss=False)
    assert not hasattr(savers._model.base_model(model), "_nbkit_savers")
    # The bare decoder (no lm_head): the chunked loss refuses it, and no saver stays half-applied.
    decoder = tiny_model("qwen3", lora=False).model
    plain_layer = type(decoder.layers[0])
    with pytest.raises(ValueError, match="lm_head"):
        savers.apply(decoder)
    assert type(decoder.layers[0]) is plain_layer and not hasattr(decoder, "_nbkit_savers")
