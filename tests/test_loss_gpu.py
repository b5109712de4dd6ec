"""nbkit.savers.loss on GPUs: hidden states and lm_head on different GPUs, a model split over two GPUs,
and the memory claim at a real vocabulary size. Run on a GPU machine with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_marks import one_gpu, two_gpus

from nbkit.training.savers import loss as chunked

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32")]  # the references below are plain fp32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()  # the two may sit on different GPUs
    return ((a - b).abs().max() / b.abs().max()).item()


@two_gpus
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_hidden_on_cuda1_head_on_cuda0_matches_single_device(softcap):
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(0)
    B, S, H, V = 2, 300, 64, 1000
    hidden = torch.randn(B, S, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    bias = torch.randn(V, generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[:, :50] = -100

    # Reference: everything on cuda:0, transformers' loss over full logits.
    h0, w0, b0 = (t.to("cuda:0").requires_grad_() for t in (hidden, weight, bias))
    logits = F.linear(h0, w0, b0)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    ref = ForCausalLMLoss(logits, labels.to("cuda:0"), V, num_items_in_batch=torch.tensor(321))
    ref.backward()

    # Split: hidden states and labels on cuda:1, lm_head on cuda:0.
    h1 = hidden.to("cuda:1").requires_grad_()
    w, b = weight.to("cuda:0").requires_grad_(), bias.to("cuda:0").requires_grad_()
    ours = chunked.linear_cross_entropy(
        h1,
        w,
        labels.to("cuda:1"),
        bias=b,
        softcap=softcap,
        chunk_size=128,
        num_items_in_batch=torch.tensor(321, device="cuda:1"),
    )
    ours.backward()

    assert ours.device == torch.device("cuda:0")
    assert abs(ours.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert h1.grad.device == torch.device("cuda:1")
    assert _rel(h1.grad, h0.grad) < 1e-5
    assert _rel(w.grad, w0.grad) < 1e-5 and _rel(b.grad, b0.grad) < 1e-5


@two_gpus
def test_model_split_over_two_gpus(tiny_text_path):
    from accelerate import dispatch_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_text_path, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    # The decoder on cuda:1, the head on cuda:0: hidden states reach the loss on another GPU.
    device_map = {"model": 1, "lm_head": 0}
    model = dispatch_model(model, device_map)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=g).to("cuda:1")
    labels = ids.clone()
    labels[:, :10] = -100

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = step()
    chunked.apply(model)
    try:
        loss, grads = step()
    finally:
        chunked.remove(model)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert model.lm_head.weight.grad.device == torch.device("cuda:0")
    assert model.model.norm.weight.grad.device == torch.device("cuda:1")
    for name in grads:
        assert _rel(grads[name], ref_grads[name]) < 1e-4, name


@one_gpu
def test_peak_memory_is_a_chunk_not_the_logits():
    # Qwen3-VL-2B's head (151936 x 2048, bf16) over 8K tokens: full fp32 logits alone are 4.6 GiB.
    N, H, V = 8192, 2048, 151936
    device = torch.device("cuda:0")
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(N, H, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    weight = torch.randn(V, H, device=device, dtype=torch.bfloat16, generator=g) / H**0.5
    labels = torch.randint(0, V, (N,), device=device, generator=g)

    def peak_extra(fn) -> float:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**30

    ours = peak_extra(lambda: chunked.linear_cross_entropy(hidden, weight, labels).backward())
    hidden.grad = None
    reference = peak_extra(
        lambda: F.cross_entropy(F.linear(hidden, weight).float(), F.pad(labels, (0, 1), value=-100)[1:]).backward()
    )
    print(f"peak extra memory: chunked {ours:.2f} GiB, full logits {reference:.2f} GiB")
    assert reference > 4.5
    assert ours < 1.5
