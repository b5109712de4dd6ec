"""nbkit.savers on GPUs (run on a GPU machine with `pytest -m gpu`).

- A model split over 2 GPUs with device_map="balanced" (layers on both GPUs, hidden states on
  cuda:1, lm_head on cuda:0): with LoRA dropout, offloaded checkpointing replays each GPU's
  dropout masks (gradients equal the plain model's); with all savers it matches and trains.
- Offloading really moves the saved layer inputs to the host (memory after the forward), and
  computes exactly what recompute-only checkpointing computes.
- The tiled MLP under bf16 autocast on a GPU.
- The DDP matrix of test_savers_ddp.py on 2 GPUs over NCCL (in a fresh interpreter: launching
  needs a process without CUDA, and earlier GPU tests of the session have initialised it here).
"""

from __future__ import annotations

import copy

import pytest
import torch
from gpu_marks import one_gpu, two_gpus
from test_savers import (
    GPU_TOLERANCE,
    LANGUAGE_LINEARS,
    assert_grads_match,
    loss_and_grads,
    make_batch,
    relative_error,
    tiny_model,
)
from test_savers_ddp import SAVERS, assert_matrix_on_two_gpus
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from nbkit.training import savers
from nbkit.training.offline import load_config
from nbkit.training.savers._model import decoder_layers

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32")]


def _lora(model: torch.nn.Module, dropout: float) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model  # not at import: see test_savers.tiny_model

    torch.manual_seed(0)
    return get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=LANGUAGE_LINEARS, init_lora_weights=False),
    )


@pytest.fixture(scope="module")
def four_layer_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tiny:qwen3 with 4 layers, saved: "balanced" puts the embeddings, lm_head and layer 0 on cuda:0,
    layers 1-3 and the final norm on cuda:1."""
    config = load_config("tiny:qwen3")
    config.num_hidden_layers, config.layer_types = 4, ["full_attention"] * 4
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("four-layers")
    Qwen3ForCausalLM(config).save_pretrained(path)
    return str(path)


def _balanced(path: str, dropout: float) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, device_map="balanced", dtype=torch.float32)
    # Each layer whole on one GPU, the layers over both.
    layer_devices = [{p.device for p in layer.parameters()} for layer in decoder_layers(model)]
    assert all(len(devices) == 1 for devices in layer_devices), model.hf_device_map
    assert set().union(*layer_devices) == {torch.device("cuda", 0), torch.device("cuda", 1)}, model.hf_device_map
    return _lora(model, dropout)


def _on(batch: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


@two_gpus
def test_split_model_replays_dropout_on_each_gpu(four_layer_path):
    model = _balanced(four_layer_path, dropout=0.2)
    batch = _on(make_batch(model, [40, 33], seed=1), "cuda:0")
    reference_loss, reference = loss_and_grads(model, batch, seed=3)
    savers.apply(model, checkpointing="offload", tiled_mlp=False, chunked_loss=True, compile=None)
    loss, grads = loss_and_grads(model, batch, seed=3)
    assert relative_error(loss, reference_loss.to(loss.device)) < GPU_TOLERANCE
    assert_grads_match(grads, reference, GPU_TOLERANCE)
    # A recompute with the wrong GPU's RNG would draw other masks: make sure dropout matters here.
    savers.remove(model)
    _, other_seed = loss_and_grads(model, batch, seed=4)
    assert max(relative_error(other_seed[n], reference[n]) for n in reference) > 1e-2


@two_gpus
def test_split_model_trains_with_all_savers(four_layer_path):
    model = _balanced(four_layer_path, dropout=0.0)
    batch = _on(make_batch(model, [64, 50], seed=2), "cuda:0")
    reference_loss, reference = loss_and_grads(model, batch)
    savers.apply(model, checkpointing="offload", tiled_mlp=4, chunked_loss=True, compile=None)
    loss, grads = loss_and_grads(model, batch)
    assert relative_error(loss, reference_loss.to(loss.device)) < GPU_TOLERANCE
    assert_grads_match(grads, reference, GPU_TOLERANCE)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    losses = []
    for _ in range(8):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1, losses


def _allocated_after_forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[int, dict]:
    """What the forward itself leaves allocated (after minus before), and the gradients.

    The growth, not the total: the first backward leaves allocations of its own that stay (on one H100,
    torch 2.11: 64 MiB more before the offloaded forwards than before the first, recomputing one, and
    not garbage: gc.collect() freed none of it; what holds it was not identified), which made the total
    of a later run look as if offloading had kept layer inputs.
    """
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = model(**batch).loss
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # lets the allocator retire blocks whose copies have finished
    allocated = torch.cuda.memory_allocated() - before
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return allocated, grads


@one_gpu
def test_offload_moves_saved_layer_inputs_to_the_host():
    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = _lora(Qwen3ForCausalLM(config).to("cuda"), dropout=0.0)
    batch = {"input_ids": torch.randint(0, 1024, (2, 2048), device="cuda")}
    batch["labels"] = batch["input_ids"]
    savers.apply(model, checkpointing="recompute", tiled_mlp=False, chunked_loss=False, compile=None)
    on_gpu, recomputed = _allocated_after_forward(model, batch)
    savers.apply(model, checkpointing="offload", tiled_mlp=False, chunked_loss=False, compile=None)
    for _ in range(2):  # twice: prefetching must find the right tensors again
        offloaded, grads = _allocated_after_forward(model, batch)
    layer_inputs = config.num_hidden_layers * 2 * 2048 * config.hidden_size * 4
    assert on_gpu - offloaded > 0.75 * layer_inputs, (on_gpu, offloaded, layer_inputs)
    assert_grads_match(grads, recomputed, 1e-5)
    copy.deepcopy(model)  # e.g. a reference model: the offloader's CUDA streams are not copied


@one_gpu
def test_tiled_mlp_under_bf16_autocast():
    model = _lora(AutoModelForCausalLM.from_pretrained(_tiny_path(), dtype=torch.float32).to("cuda"), dropout=0.0)
    batch = _on(make_batch(model, [96, 70], seed=5), "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        reference_loss, reference = loss_and_grads(model, batch)
        savers.apply(model, checkpointing="offload", tiled_mlp=3, chunked_loss=False, compile=None)
        loss, grads = loss_and_grads(model, batch)
    assert relative_error(loss, reference_loss) < 1e-2
    assert_grads_match(grads, reference, 5e-2)


def _tiny_path() -> str:
    import nbkit

    return nbkit.resolve_model("tiny:qwen3")


@two_gpus
@pytest.mark.parametrize("kind", ["qwen3", "qwen3-vl"])
def test_ddp_on_two_gpus_matches_one_gpu(kind):
    assert_matrix_on_two_gpus(kind, {saver: SAVERS[saver] for saver in ("offload", "all")})


@one_gpu
def test_automatic_tiling_reads_the_gpus_memory_or_the_emulated_ones():
    # The shard size follows what the process may use on its GPU: the card's memory, or 15 GiB under the
    # T4 profile (so an H100 standing in for a T4 tiles as the T4 would).
    import nbkit
    from nbkit.training.savers.tiled_mlp import automatic_tokens_per_shard, tokens_per_shard

    mlp = decoder_layers(tiny_model("qwen3").to("cuda"))[0].mlp
    total = torch.cuda.get_device_properties(0).total_memory
    assert tokens_per_shard(mlp) == automatic_tokens_per_shard(total, mlp.intermediate_size)
    nbkit.emulate("T4")
    try:
        assert tokens_per_shard(mlp) == automatic_tokens_per_shard(15 * 2**30, mlp.intermediate_size)
    finally:
        nbkit.emulate(None)


@one_gpu
def test_apply_compiles_a_model_on_one_gpu_by_default_but_not_one_unsloth_loaded():
    from nbkit.training.savers import compiling

    model = tiny_model("qwen3").to("cuda")
    savers.apply(model)
    assert compiling.is_enabled(model)
    savers.remove(model)
    savers._model.base_model(model).config.unsloth_version = "2026.10.9"  # what unsloth's loaders set
    savers.apply(model)  # unsloth compiles its own layers
    assert not compiling.is_enabled(model)
    savers.remove(model)
