"""nbkit's chunked loss on an unsloth model: it takes over from unsloth's own loss, same loss and gradients.

Why it can: unsloth's compiled forward takes its fused loss only while the model's loss_function is
transformers' ForCausalLMLoss; with nbkit's chunked loss applied, the forward calls the lm_head (which
nbkit hands the last position only) and then the model's loss_function (nbkit's), so no full logits
exist in any trainer (under SFTTrainer unsloth's own path kept fp32 logits of seq x vocab: the T4 profile
rows of benchmarks/RESULTS.md). A file of its own: importing unsloth patches transformers for the process.
"""

from __future__ import annotations

import pytest
import torch
from gpu_marks import one_gpu
from test_savers import GPU_TOLERANCE, loss_and_grads, make_batch, relative_error

from nbkit.training import savers

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32")]


@one_gpu
def test_nbkits_chunked_loss_takes_over_from_unsloths_with_the_same_gradients(tiny_vl_path):
    unsloth = pytest.importorskip("unsloth")

    model, _ = unsloth.FastVisionModel.from_pretrained(tiny_vl_path, load_in_4bit=False, dtype=torch.float32)
    model = unsloth.FastVisionModel.get_peft_model(model, r=8, finetune_vision_layers=False, random_state=0)
    batch = {k: v.to("cuda") for k, v in make_batch(model, [96, 70], seed=3).items()}
    reference_loss, reference = loss_and_grads(model, batch)

    savers.apply(model, checkpointing=None, tiled_mlp=False)  # the chunked loss only; unsloth keeps the rest
    assert not savers._model.base_model(model).loss_function.__name__.endswith("ForCausalLMLoss")
    out = model(**batch)
    assert out.logits.shape[1] == 1  # the last position only: no (tokens, vocab) logits
    loss, grads = loss_and_grads(model, batch)
    assert relative_error(loss, reference_loss) < GPU_TOLERANCE
    assert grads.keys() == reference.keys()
    assert max(relative_error(grads[n], reference[n]) for n in reference) < GPU_TOLERANCE

    savers.remove(model)
    again, _ = loss_and_grads(model, batch)
    assert relative_error(again, reference_loss) < GPU_TOLERANCE
