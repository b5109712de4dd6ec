"""nbkit.savers.apply(model, kernels="liger") on a machine without a GPU: the selection and its errors.

Liger's kernels are Triton programs for CUDA GPUs, so here every request for them must fail with a
message that says why and what to do, before anything about the model changes. The kernels
themselves (gradients equal the reference on 1 GPU and under DDP on 2) are tested in
test_liger_gpu.py.
"""

from __future__ import annotations

import sys

import pytest
import torch
from test_savers import LANGUAGE_LINEARS, loss_and_grads, make_batch, relative_error, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from nbkit.platform import patching
from nbkit.platform.errors import KernelsError, NbkitError
from nbkit.training import savers
from nbkit.training.savers import liger, loss
from nbkit.training.savers._model import decoder_layers, layer_mlp


def _classes(model: torch.nn.Module) -> list[type]:
    return [type(m) for m in model.modules()]


def test_unknown_kernels_value_is_refused():
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="kernels='triton' is not valid; use 'liger', 'auto' or None"):
        savers.apply(model, kernels="triton")
    assert not hasattr(savers._model.base_model(model), "_nbkit_savers")


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-vl"])
def test_liger_on_a_cpu_model_says_it_needs_a_gpu_and_changes_nothing(kind):
    model = tiny_model(kind)
    savers.apply(model, checkpointing="recompute", tiled_mlp=2, chunked_loss=True)
    before = _classes(model)
    batch = make_batch(model, [20, 13], seed=1)
    reference_loss, reference = loss_and_grads(model, batch)
    with pytest.raises(KernelsError) as raised:
        savers.apply(model, kernels="liger")
    message = str(raised.value)
    assert "need the model on CUDA GPUs" in message and "decoder layers are on cpu" in message
    assert "kernels=None" in message
    assert isinstance(raised.value, NbkitError) and isinstance(raised.value, RuntimeError)
    # The savers applied before are still exactly on, and the model computes what it did.
    assert _classes(model) == before
    assert savers._model.base_model(model)._nbkit_savers.kernels is None
    assert not liger.is_enabled(model)
    assert patching.applied("kernels") == []
    loss_value, grads = loss_and_grads(model, batch)
    assert relative_error(loss_value, reference_loss) == 0
    assert all(torch.equal(grads[n], reference[n]) for n in reference)


def test_auto_kernels_fall_back_to_the_savers_alone_where_liger_cannot_run():
    # Here (no GPU) Liger cannot run, so "auto" is exactly kernels=None: the same savers, the same gradients.
    model = tiny_model("qwen3")
    batch = make_batch(model, [20, 13], seed=1)
    savers.apply(model, checkpointing="recompute", tiled_mlp=2, chunked_loss=True)
    reference_loss, reference = loss_and_grads(model, batch)
    savers.remove(model)
    assert not liger.can_run(model)
    savers.apply(model, checkpointing="recompute", tiled_mlp=2, chunked_loss=True, kernels="auto")
    assert savers._model.base_model(model)._nbkit_savers.kernels is None
    assert not liger.is_enabled(model) and patching.applied("kernels") == []
    loss_value, grads = loss_and_grads(model, batch)
    assert relative_error(loss_value, reference_loss) == 0
    assert all(torch.equal(grads[n], reference[n]) for n in reference)


def test_liger_for_another_model_family_names_the_supported_ones():
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = LlamaForCausalLM(config)
    with pytest.raises(
        KernelsError, match=r"supports the Qwen3 and Qwen3-VL families; LlamaForCausalLM \(model_type 'llama'\)"
    ):
        savers.apply(model, kernels="liger")
    assert not hasattr(model, "_nbkit_savers")


def test_liger_for_a_non_silu_mlp_is_refused():
    model = tiny_model("qwen3", lora=False)
    model.config.hidden_act = "gelu"
    with pytest.raises(KernelsError, match="needs a SiLU MLP; this model's hidden_act is 'gelu'"):
        savers.apply(model, kernels="liger")


def test_missing_liger_kernel_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # what `import liger_kernel` meets when absent
    liger._functional.cache_clear()
    try:
        with pytest.raises(KernelsError, match=r"pip install liger-kernel==0\.8\.5.*or use kernels=None"):
            liger._functional()
    finally:
        liger._functional.cache_clear()


def test_rope_patches_are_registered_and_off_until_a_model_asks():
    targets = {p.target for p in patching.registered("kernels")}
    assert targets == {
        "transformers.models.qwen3.modeling_qwen3:apply_rotary_pos_emb",
        "transformers.models.qwen3_vl.modeling_qwen3_vl:apply_rotary_pos_emb",
    }
    assert patching.applied("kernels") == []


def test_the_rope_dispatcher_calls_the_original_outside_liger_attention():
    """With the patch in place, a model without kernels (CPU tensors, no Liger attention running)
    computes exactly as before: the dispatcher hands every call to transformers' function."""
    from transformers.models.qwen3 import modeling_qwen3

    model = tiny_model("qwen3")
    batch = make_batch(model, [18], seed=2)
    reference_loss, reference = loss_and_grads(model, batch)
    original = modeling_qwen3.apply_rotary_pos_emb
    try:
        assert "transformers.models.qwen3.modeling_qwen3:apply_rotary_pos_emb" in patching.apply("kernels")
        assert modeling_qwen3.apply_rotary_pos_emb is not original
        loss_value, grads = loss_and_grads(model, batch)
    finally:
        patching.revert("kernels")
    assert modeling_qwen3.apply_rotary_pos_emb is original
    assert relative_error(loss_value, reference_loss) == 0
    assert all(torch.equal(grads[n], reference[n]) for n in reference)


def test_chunked_loss_kernel_is_what_computes_the_loss():
    """The loss's kernel hook (what kernels='liger' plugs Liger's fused loss into) receives the rows
    linear_cross_entropy prepared and its value is the model's loss; without it nbkit's loop runs."""
    model = tiny_model("qwen3")
    batch = make_batch(model, [21, 9], seed=4)
    reference_loss, reference = loss_and_grads(model, batch)
    seen = []

    def kernel(hidden, weight, bias, labels, ignore_index, num_items, softcap, compute_dtype, rows):
        seen.append((tuple(hidden.shape), tuple(labels.shape), ignore_index, num_items, softcap, compute_dtype, rows))
        return loss.linear_cross_entropy(hidden, weight, labels, bias=bias, ignore_index=ignore_index, shift=False)

    loss.apply(model, kernel=kernel)
    try:
        loss_value, grads = loss_and_grads(model, batch)
    finally:
        loss.remove(model)
    hidden = model.config.hidden_size
    # No chunk size asked for: the kernel picks its own (None).
    assert seen == [((2 * 21, hidden), (2 * 21,), -100, None, None, torch.float32, None)]
    assert relative_error(loss_value, reference_loss) < 1e-6
    assert all(relative_error(grads[n], reference[n]) < 1e-5 for n in reference)


def test_mlp_and_norms_untouched_after_a_refused_request():
    model = tiny_model("qwen3-vl", targets=LANGUAGE_LINEARS)
    mlp_types = [type(layer_mlp(layer)) for layer in decoder_layers(model)]
    with pytest.raises(KernelsError):
        savers.apply(model, checkpointing=None, tiled_mlp=False, chunked_loss=False, kernels="liger")
    assert [type(layer_mlp(layer)) for layer in decoder_layers(model)] == mlp_types


def _liger_chunk_rows(tokens: int, vocab: int, hidden: int, chunk_mem_const: int) -> int:
    """Liger 0.8.5's chunk size (fused_linear_cross_entropy_forward), written out as its docs state it."""
    divisor = -(-vocab // (chunk_mem_const * hidden))
    return min(1 << (-(-tokens // divisor) - 1).bit_length(), tokens)


@pytest.mark.parametrize("tokens", [1, 700, 4096, 3_900, 16_384, 65_536])
@pytest.mark.parametrize("rows", [1, 64, 100, 512, 828, 4393, 70_000])
def test_liger_chunks_stay_within_the_rows_nbkit_gives_and_use_them(tokens, rows):
    """What kernels='liger' hands Liger keeps its chunks at or below the rows nbkit's loss allows, and no
    smaller than the largest power of two those rows allow (else chunks are made small for nothing)."""
    vocab, hidden = 151_936, 2048  # Qwen3-VL-2B's head
    const = liger.chunk_mem_const(rows, tokens, vocab, hidden)
    size = _liger_chunk_rows(tokens, vocab, hidden, const)
    own = _liger_chunk_rows(tokens, vocab, hidden, 1)  # Liger's default
    allowed = min(1 << (rows.bit_length() - 1), tokens)
    assert size <= max(allowed, own)
    assert size >= min(allowed, tokens) or const == 1
