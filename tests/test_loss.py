"""nbkit.savers.loss: the chunked linear cross-entropy equals transformers' causal-LM loss, in value and
gradient, alone and inside real tiny models (bare, peft-wrapped, VLM), and never builds full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from nbkit.training.savers import loss as chunked

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

B, S, H, V = 3, 11, 16, 97  # 33 rows: no chunk size used below divides it


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :5] = -100
    labels[2, 7:] = -100
    return hidden, weight, bias, labels


def _reference(hidden, weight, bias, labels, softcap=None, **kwargs):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return ForCausalLMLoss(logits, labels, V, **kwargs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_items_in_batch": torch.tensor(40)},
        {"num_items_in_batch": 7},
        {"softcap": 2.0},
        {"softcap": 2.0, "num_items_in_batch": torch.tensor(9)},
        {"ignore_index": 3},
    ],
    ids=["mean", "num_items_tensor", "num_items_int", "softcap", "softcap_num_items", "ignore_index"],
)
@pytest.mark.parametrize("chunk_size", [None, 4, 10])
def test_value_and_grads_equal_transformers(kwargs, chunk_size):
    hidden, weight, bias, labels = _inputs()
    if "ignore_index" in kwargs:
        labels = labels.clamp(min=0)
        labels[1, :4] = kwargs["ignore_index"]
    ref = _reference(hidden, weight, bias, labels, **kwargs)
    ref_grads = torch.autograd.grad(ref, (hidden, weight, bias))

    ours = chunked.linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_size=chunk_size, **kwargs)
    grads = torch.autograd.grad(ours, (hidden, weight, bias))

    assert ours.dtype == torch.float32
    assert abs(ours.item() - ref.item()) <= 1e-5 * abs(ref.item())
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert _rel(g, r) < 1e-5, name


def test_the_count_trainer_repeats_per_gpu_divides_once():
    """Trainer in one process that sees 2 GPUs passes num_items_in_batch as 2 copies of the count, also where it
    does not replicate the model (4-bit, or placed on one GPU): the loss and gradients are those of one count, where
    the backward failed on the copies' shape."""
    hidden, weight, bias, labels = _inputs()
    count = torch.tensor(40)
    ref = chunked.linear_cross_entropy(hidden, weight, labels, bias=bias, num_items_in_batch=count)
    ref_grads = torch.autograd.grad(ref, (hidden, weight, bias))
    copies = count.unsqueeze(0).expand(2, -1)  # what Trainer.get_batch_samples makes of it for n_gpu=2
    ours = chunked.linear_cross_entropy(hidden, weight, labels, bias=bias, num_items_in_batch=copies, chunk_size=4)
    grads = torch.autograd.grad(ours, (hidden, weight, bias))

    assert ours.shape == () and abs(ours.item() - ref.item()) <= 1e-6 * ref.item()
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert _rel(g, r) < 1e-6, name


def test_shift_false_takes_aligned_labels():
    hidden, weight, _, labels = _inputs()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    ref = chunked.linear_cross_entropy(hidden, weight, labels)
    ours = chunked.linear_cross_entropy(hidden, weight, shifted, shift=False, chunk_size=5)
    assert abs(ours.item() - ref.item()) <= 1e-6 * ref.item()


def test_frozen_weight_gets_no_grad_and_trainable_weight_accumulates_once():
    hidden, weight, bias, labels = _inputs()
    frozen = weight.detach()
    loss = chunked.linear_cross_entropy(hidden, frozen, labels, chunk_size=4)
    loss.backward()
    assert frozen.grad is None and hidden.grad is not None

    # A trainable weight's AccumulateGrad (the node DDP hooks) runs once per backward, whatever the chunking.
    hidden, weight, bias, labels = _inputs()
    calls = {"weight": 0, "bias": 0}
    weight.register_post_accumulate_grad_hook(lambda p: calls.__setitem__("weight", calls["weight"] + 1))
    bias.register_post_accumulate_grad_hook(lambda p: calls.__setitem__("bias", calls["bias"] + 1))
    chunked.linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_size=4).backward()
    assert calls == {"weight": 1, "bias": 1}
    assert _rel(weight.grad, torch.autograd.grad(_reference(hidden, weight, bias, labels), weight)[0]) < 1e-5


def test_bf16_inputs_accumulate_in_fp32():
    hidden, weight, bias, labels = _inputs(seed=1)
    ref = _reference(hidden, weight, bias, labels, softcap=3.0)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))

    h16, w16 = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    ours = chunked.linear_cross_entropy(h16, w16, labels, bias=bias.detach().bfloat16(), softcap=3.0, chunk_size=4)
    grads = torch.autograd.grad(ours, (h16, w16))
    assert ours.dtype == torch.float32
    assert abs(ours.item() - ref.item()) < 2e-2 * ref.item()
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.bfloat16
    assert _rel(grads[0], ref_grads[0]) < 3e-2 and _rel(grads[1], ref_grads[1]) < 3e-2

    # Under autocast, fp32 weights are used in bf16 like an autocast lm_head would, grads stay fp32.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked.linear_cross_entropy(hidden, weight, labels, bias=bias, softcap=3.0)
    grads = torch.autograd.grad(ours, (hidden, weight))
    assert grads[0].dtype == torch.float32 and abs(ours.item() - ref.item()) < 2e-2 * ref.item()
    assert _rel(grads[0], ref_grads[0]) < 3e-2


@pytest.mark.parametrize("loss_scale", [1.0, 65536.0])
def test_fp16_gradients_are_finite_and_exact_under_a_loss_scale(loss_scale):
    """fp16 training (a T4) scales the loss by 65536 at first and divides the gradients afterwards; the gradient of
    each hidden state is about 1/tokens of the logits' and must not vanish or overflow in fp16 on its way."""
    tokens, hidden_size, vocab = 8192, 16, 97
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, tokens, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    h64 = hidden.double().requires_grad_()
    (reference,) = torch.autograd.grad(_reference(h64, weight.double(), None, labels), (h64,))

    h16 = hidden.half().requires_grad_()
    loss = chunked.linear_cross_entropy(h16, weight.half(), labels)
    (scaled,) = torch.autograd.grad(loss * loss_scale, (h16,))
    assert scaled.dtype == torch.float16 and torch.isfinite(scaled).all()
    assert _rel(scaled.double() / loss_scale, reference) < 1e-2


def test_never_allocates_full_logits():
    rows = 6
    hidden, weight, bias, labels = _inputs()
    n = B * S

    class LargestAllocation(TorchDispatchMode):
        """Largest tensor (in elements) any op creates; views share storage and do not count."""

        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        self.largest = max(self.largest, t.numel())
            return out

    # A frozen lm_head (LoRA): nothing of size (rows, vocab) beyond one chunk, forward and backward.
    with LargestAllocation() as ours:
        chunked.linear_cross_entropy(hidden, weight.detach(), labels, chunk_size=rows).backward()
    assert ours.largest == rows * V

    with LargestAllocation() as reference:
        _reference(hidden, weight.detach(), bias, labels).backward()
    assert reference.largest >= n * V


def test_one_chunk_of_logits_is_alive_at_a_time():
    # bf16 inputs: the logits come in bf16 and are widened to fp32, as on a GPU. Each storage an op makes for
    # rows of logits ([rows, V]) is counted from its making until torch frees it (a finalizer on the storage,
    # which outlives the tensor objects that view it). Ops inside a kernel are not seen: logsumexp's fp32
    # temporary, the other half of BYTES_PER_LOGIT, lives within the kernel's call.
    import weakref

    rows = 6
    hidden, weight, _, labels = _inputs(torch.bfloat16)

    class LiveChunks(TorchDispatchMode):
        """The most bytes of storages of logits alive at once."""

        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.seen: set[int] = set()

        def _freed(self, key: int, nbytes: int) -> None:
            self.seen.discard(key)
            self.live -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if not isinstance(t, torch.Tensor) or func.is_view or t.dim() != 2 or t.shape[1] != V:
                    continue
                storage = t.untyped_storage()
                if id(storage) not in self.seen:
                    self.seen.add(id(storage))
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
            return out

    with LiveChunks() as chunks:
        chunked.linear_cross_entropy(hidden, weight.detach(), labels, chunk_size=rows).backward()
    # The fp32 logits beside their 16-bit copy (while widening, then while narrowing the gradient), never
    # beside the last chunk's buffers (which took it to 12 bytes per logit).
    assert chunks.peak == (4 + 2) * rows * V


def test_errors_name_the_shapes():
    hidden, weight, _, labels = _inputs()
    with pytest.raises(ValueError, match=r"hidden_states \(3, 11, 16\) vs labels \(3, 10\)"):
        chunked.linear_cross_entropy(hidden, weight, labels[:, :10])
    with pytest.raises(ValueError, match="chunk_size"):
        chunked.linear_cross_entropy(hidden, weight, labels, chunk_size=0)


# ---------------------------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def qwen3(tiny_text_path):
    path = tiny_text_path  # nbkit.resolve_model("tiny:qwen3"), built once per session
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _step(model, **batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_same(ref, ours):
    (ref_out, ref_grads), (out, grads) = ref, ours
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-5 * abs(ref_out.loss.item())
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        assert _rel(grads[name], ref_grads[name]) < 1e-5, name


def _text_batch(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    return {"input_ids": ids, "labels": labels}


def test_model_loss_same_before_and_after_apply_and_remove_restores(qwen3):
    batch = _text_batch(qwen3.config)
    ref = _step(qwen3, **batch)
    ref_items = _step(qwen3, **batch, num_items_in_batch=torch.tensor(7))
    own_attrs = dict(vars(qwen3))
    try:
        chunked.apply(qwen3)
        chunked.apply(qwen3)  # idempotent
        assert len(qwen3._forward_pre_hooks) == 1 and len(qwen3.lm_head._forward_pre_hooks) == 1
        ours = _step(qwen3, **batch)
        _assert_same(ref, ours)
        assert ours[0].logits.shape == (2, 1, qwen3.config.vocab_size)
        assert torch.allclose(ours[0].logits, ref[0].logits[:, -1:], atol=1e-6)
        _assert_same(ref_items, _step(qwen3, **batch, num_items_in_batch=torch.tensor(7)))
        with torch.no_grad():  # evaluation keeps the full logits
            assert qwen3(**batch).logits.shape == (2, 12, qwen3.config.vocab_size)
    finally:
        chunked.remove(qwen3)
    assert not chunked.is_applied(qwen3)
    assert vars(qwen3).keys() == own_attrs.keys()
    assert not qwen3._forward_pre_hooks and not qwen3._forward_hooks and not qwen3.lm_head._forward_pre_hooks
    out = _step(qwen3, **batch)
    assert out[0].logits.shape == (2, 12, qwen3.config.vocab_size)
    _assert_same(ref, out)


def test_shift_labels_kwarg_is_used(qwen3):
    batch = _text_batch(qwen3.config, seed=1)
    shift = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:].contiguous()
    ref = _step(qwen3, input_ids=batch["input_ids"], labels=batch["labels"], shift_labels=shift)
    chunked.apply(qwen3)
    try:
        _assert_same(ref, _step(qwen3, input_ids=batch["input_ids"], labels=batch["labels"], shift_labels=shift))
    finally:
        chunked.remove(qwen3)


def test_peft_model(qwen3):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        qwen3, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    )
    try:
        batch = _text_batch(qwen3.config, seed=2)
        ref = _step(model, **batch)
        chunked.apply(model)
        ours = _step(model, **batch)
        _assert_same(ref, ours)
        assert all("lora_" in name for name in ours[1])
        assert ours[0].logits.shape[1] == 1
        chunked.remove(model)
        assert model(**batch).logits.shape[1] == 12
    finally:
        chunked.remove(model)
        model.unload()


def test_qwen3_vl_with_an_image(tiny_vl_path):
    path = tiny_vl_path
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    config, vision = model.config, model.config.vision_config
    grid = torch.tensor([[1, 4, 4]])
    patches = int(grid.prod())
    image_tokens = patches // vision.spatial_merge_size**2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, config.text_config.vocab_size, (1, 14), generator=g)
    ids[0, 2 : 2 + image_tokens] = config.image_token_id
    labels = ids.clone()
    labels[0, : 2 + image_tokens] = -100
    batch = dict(
        input_ids=ids,
        labels=labels,
        pixel_values=torch.randn(patches, 3 * vision.temporal_patch_size * vision.patch_size**2, generator=g),
        image_grid_thw=grid,
        mm_token_type_ids=(ids == config.image_token_id).long(),
    )
    ref = _step(model, **batch)
    chunked.apply(model)
    ours = _step(model, **batch)
    _assert_same(ref, ours)
    assert any("visual" in name for name in ours[1])
    chunked.remove(model)
    assert model(**batch).logits.shape == (1, 14, config.text_config.vocab_size)


def _tiny_text_model(cls_name: str, **overrides):
    config_cls = getattr(transformers, cls_name + "Config")
    config = config_cls(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        **overrides,
    )
    torch.manual_seed(0)
    return getattr(transformers, cls_name + "ForCausalLM")(config)


def test_gemma2_softcapping_follows_the_config():
    model = _tiny_text_model("Gemma2", final_logit_softcapping=0.5)  # small cap: clearly not the identity
    batch = _text_batch(model.config)
    ref = _step(model, **batch)
    chunked.apply(model)
    try:
        _assert_same(ref, _step(model, **batch))
    finally:
        chunked.remove(model)


def test_model_with_unknown_logit_transform_is_refused():
    # Cohere multiplies its logits by config.logit_scale, which the chunked loss does not reproduce.
    model = _tiny_text_model("Cohere", logit_scale=0.25)
    chunked.apply(model)
    try:
        with pytest.raises(RuntimeError, match="cannot reproduce CohereForCausalLM's logits.*chunked_loss=False"):
            model(**_text_batch(model.config))
    finally:
        chunked.remove(model)


def test_model_without_lm_head_is_refused(tiny_text_path):
    model = transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(tiny_text_path))
    with pytest.raises(ValueError, match="Qwen3Model has none.*chunked_loss=False"):
        chunked.apply(model)


def test_a_default_chunk_holds_about_256_mib_of_logits_at_their_width():
    """nbkit's loop keeps fp32 logits per chunk, Liger's fused loss 16-bit ones: the default chunk is about
    256 MiB of logits either way, so Liger's has twice the rows; an explicit chunk size wins."""
    vocab = 151_936
    for logit_bytes in (4, 2):
        rows = chunked.rows_per_chunk(vocab, logit_bytes=logit_bytes)
        assert rows * vocab * logit_bytes <= 256 * 2**20 < (rows + 1) * vocab * logit_bytes
    assert chunked.rows_per_chunk(vocab) == chunked.rows_per_chunk(vocab, logit_bytes=4)
    assert chunked.rows_per_chunk(vocab, 7, logit_bytes=2) == 7
