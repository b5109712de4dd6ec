"""nbkit.savers.apply(model, kernels="liger") on GPUs (`pytest -m gpu`; needs liger-kernel 0.8.5 and Triton).

- One GPU, fp32 without TF32: with Liger's kernels alone and with every saver, losses and LoRA
  gradients of tiny Qwen3 / Qwen3-VL equal the plain model's (as test_savers_gpu.py checks the
  savers), and Liger's autograd Functions really are in the graph.
- One GPU, bf16 autocast: close to the plain model under the same autocast.
- nbkit.savers.remove takes the kernels off: the RoPE patch is reverted and the model is plain again.
- Two GPUs, NCCL DDP: test_savers_ddp.py's matrix (gradient accumulation with no_sync, ranks with
  different lengths, find_unused_parameters True and False) with the kernels, against the
  single-GPU reference without them; every LoRA gradient accumulated and reduced once.
"""

from __future__ import annotations

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
from test_savers_ddp import assert_matrix_on_two_gpus

import nbkit
from nbkit.platform import patching
from nbkit.training import savers
from nbkit.training.savers import liger

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32")]

# Uncompiled: with compile (apply()'s default on a GPU) only Liger's loss applies; the compiled case has its own test.
LIGER_CASES = {
    "liger": dict(checkpointing=None, tiled_mlp=False, chunked_loss=True, kernels="liger", compile=None),
    "liger_full_logits": dict(checkpointing=None, tiled_mlp=False, chunked_loss=False, kernels="liger", compile=None),
    "liger_all": dict(checkpointing="offload", tiled_mlp=3, chunked_loss=True, kernels="liger", compile=None),
}


def _on_gpu(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to("cuda") for k, v in batch.items()}


def _graph_nodes(loss: torch.Tensor) -> set[str]:
    seen, names, stack = set(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


@one_gpu
@pytest.mark.parametrize("kind", ["qwen3", "qwen3-vl"])
def test_liger_kernels_match_the_plain_model(kind):
    model = tiny_model(kind).to("cuda")
    batch = _on_gpu(make_batch(model, [40, 29], seed=3))
    reference_loss, reference = loss_and_grads(model, batch)
    for name, options in LIGER_CASES.items():
        savers.apply(model, **options)
        loss, grads = loss_and_grads(model, batch)
        assert relative_error(loss, reference_loss) < GPU_TOLERANCE, (name, loss, reference_loss)
        assert_grads_match(grads, reference, GPU_TOLERANCE, label=f"{name}: ")
    # Without checkpointing or tiling every kernel leaves its node in the graph.
    savers.apply(model, **LIGER_CASES["liger"])
    nodes = _graph_nodes(model(**batch).loss)
    for function in ("LigerRMSNormFunction", "LigerRopeFunction", "LigerSiLUMulFunction"):
        assert any(n.startswith(function) for n in nodes), (function, sorted(n for n in nodes if "Liger" in n))
    assert any(n.startswith("LigerFusedLinearCrossEntropyFunction") for n in nodes)
    savers.remove(model)
    assert not liger.is_enabled(model) and patching.applied("kernels") == []
    assert not any("Liger" in n for n in _graph_nodes(model(**batch).loss))


@one_gpu
def test_liger_under_bf16_autocast():
    model = tiny_model("qwen3").to("cuda")
    batch = _on_gpu(make_batch(model, [96, 70], seed=5))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        reference_loss, reference = loss_and_grads(model, batch)
        savers.apply(model, **LIGER_CASES["liger_all"])
        loss, grads = loss_and_grads(model, batch)
    assert relative_error(loss, reference_loss) < 1e-2
    assert_grads_match(grads, reference, 5e-2)


@two_gpus
@pytest.mark.parametrize("kind", ["qwen3", "qwen3-vl"])
def test_liger_under_ddp_on_two_gpus_matches_one_gpu(kind):
    assert_matrix_on_two_gpus(kind, {saver: LIGER_CASES[saver] for saver in ("liger", "liger_all")})


def _qlora_tiny_vl() -> torch.nn.Module:
    """tiny:qwen3-vl in 4-bit (bitsandbytes, fp32 compute) on the GPU, with tiny_model's LoRA."""
    from peft import LoraConfig, get_peft_model  # not at import: see test_savers.tiny_model
    from transformers import AutoModelForImageTextToText, BitsAndBytesConfig

    base = AutoModelForImageTextToText.from_pretrained(
        nbkit.resolve_model("tiny:qwen3-vl"),
        dtype=torch.float32,
        device_map={"": "cuda"},
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
    )
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LANGUAGE_LINEARS, init_lora_weights=False)
    return get_peft_model(base, config)


@one_gpu
@pytest.mark.parametrize("tiled", [3, True], ids=["split", "whole-mlp"])
@pytest.mark.parametrize("four_bit", [False, True], ids=["16bit", "4bit"])
def test_regional_compile_with_kernels_and_every_saver_across_lengths(four_bit, tiled):
    # What the transformers path of a notebook runs with compile on: Liger's kernels, every saver and the
    # compiled regions, on batches of other lengths (a trainer pads each batch to its longest). The tiled MLP
    # split in 3 (where whole compiled layers failed at 16K on an H100; the offloaded checkpoint wraps each
    # compiled layer), or automatic, which does not split a tiny model's short sequences on a GPU (each layer
    # compiled with its checkpoint inside, its input offloaded from outside).
    # Each length's loss and LoRA gradients equal the same model's uncompiled ones.
    model = _qlora_tiny_vl() if four_bit else tiny_model("qwen3-vl").to("cuda")
    batches = [_on_gpu(make_batch(model, lengths, seed=3)) for lengths in ([24, 17], [40], [300])]
    options = dict(LIGER_CASES["liger_all"], tiled_mlp=tiled)
    savers.apply(model, **options)
    eager = [loss_and_grads(model, batch) for batch in batches]
    savers.apply(model, **dict(options, compile="regional"))  # Liger's loss, inductor's fused layers
    for batch, (reference_loss, reference) in zip(batches, eager, strict=True):
        loss, grads = loss_and_grads(model, batch)
        assert relative_error(loss, reference_loss) < GPU_TOLERANCE
        assert_grads_match(grads, reference, GPU_TOLERANCE)
    savers.remove(model)


@one_gpu
def test_regional_compile_in_fp16_with_4bit_weights_gives_the_eager_gradients():
    """The T4 path of the transformers backend: QLoRA with fp16 compute under fp16 autocast and a loss scale of
    65,536 (the fp16 loss scaler's first), compiled regions against the same model eager; the test above compares in
    fp32 only. fp16's arithmetic allows 2e-2 where fp32's allows 1e-3: inductor's fused kernels round in other
    places (2x H100: 1.09e-2 on the worst of the LoRA gradients, the rest below)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from nbkit.training import fsdp, mixed_precision

    base = AutoModelForCausalLM.from_pretrained(
        nbkit.resolve_model("tiny:qwen3"),
        dtype=torch.float16,
        device_map={"": "cuda"},
        quantization_config=fsdp.qlora_config(torch.float16),
    )
    torch.manual_seed(0)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=LANGUAGE_LINEARS, init_lora_weights=False)
    )
    mixed_precision.fit_for_fp16(model)  # trainable weights in fp32, as nbkit's ranks give them under fp16
    batches = [_on_gpu(make_batch(model, lengths, seed=3)) for lengths in ([24, 17], [300])]
    scale = 65536.0

    def scaled_loss_and_grads(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(**batch).loss
        (loss.float() * scale).backward()
        grads = {
            n: p.grad.float() / scale for n, p in model.named_parameters() if p.requires_grad and p.grad is not None
        }
        return loss.detach().float(), grads

    options = dict(checkpointing="recompute", tiled_mlp=False, chunked_loss=True, kernels=None)
    savers.apply(model, **dict(options, compile=None))
    eager = [scaled_loss_and_grads(batch) for batch in batches]
    savers.apply(model, **dict(options, compile="regional"))
    for batch, (reference_loss, reference) in zip(batches, eager, strict=True):
        loss, grads = scaled_loss_and_grads(batch)
        assert all(torch.isfinite(g).all() for g in reference.values()), "the eager fp16 gradients overflowed"
        assert reference
        assert relative_error(loss, reference_loss) < 1e-2
        assert_grads_match(grads, reference, 2e-2)
    savers.remove(model)


@one_gpu
def test_liger_loss_follows_the_rows_nbkit_gives():
    """Liger's fused loss through nbkit: the same loss and gradient in chunks of 8 rows and in one chunk,
    and one chunk of 1,024 rows holds its logits at once (the bound is honoured, not ignored)."""
    from nbkit.training.savers import loss

    tokens, hidden_size, vocab = 1024, 256, 32_000  # Liger's own chunks: 8 rows
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=g).requires_grad_()
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=g) / hidden_size**0.5
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    results = {}
    for rows in (8, tokens):
        hidden.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        value = loss.linear_cross_entropy(
            hidden, weight, labels, chunk_size=rows, shift=False, kernel=liger.fused_linear_cross_entropy
        )
        value.backward()
        peak = torch.cuda.max_memory_allocated() - before
        results[rows] = (value.detach(), hidden.grad.clone(), peak)
    (small_loss, small_grad, small_peak), (whole_loss, whole_grad, whole_peak) = results[8], results[tokens]
    assert relative_error(whole_loss, small_loss) < GPU_TOLERANCE
    assert relative_error(whole_grad, small_grad) < GPU_TOLERANCE
    logits_bytes = tokens * vocab * 4  # fp32 here
    assert small_peak < logits_bytes / 4 < logits_bytes <= whole_peak, (small_peak, whole_peak)
