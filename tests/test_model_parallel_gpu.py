"""A model split over two GPUs in one process (model parallel, notebooks/model_parallel.ipynb) trains in fp16.

Kaggle's T4s have no bf16, so a model too large for one of them trains split over both in fp16, with
transformers' Trainer scaling the loss (GradScaler). The tiny Qwen3 is placed with its first layers on
GPU 0 and its last layers on GPU 1 and the output layer back on GPU 0, so that the hidden states, the
loss and the gradients all cross between the cards; with nbkit's savers (per-layer checkpointing and the
chunked loss), in 16-bit and in 4-bit (nbkit.fsdp.qlora_config, fp16 storage). Every logged loss and
gradient norm must be finite from the first step, and the loss must fall on a repeated batch.

Run on a machine with 2 GPUs: `python -m pytest -m gpu tests/test_model_parallel_gpu.py`.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_marks import two_gpus

pytestmark = [pytest.mark.gpu, two_gpus]


def _split_map(layers: int) -> dict[str, int]:
    """The first half of the layers on GPU 0, the rest on GPU 1, the output layer on GPU 0 again."""
    placement = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 0}
    placement.update({f"model.layers.{i}": int(i >= layers // 2) for i in range(layers)})
    return placement


@pytest.fixture(params=[None, "T4"], ids=["gpu", "t4_profile"])
def profile(request):
    """The GPU as it is, and under the T4 profile (no flash attention, no TF32), as the notebook's emulate runs it."""
    import nbkit

    nbkit.emulate(request.param)
    yield request.param
    nbkit.emulate(None)


@pytest.mark.parametrize("four_bit", [False, True], ids=["16bit", "4bit"])
def test_a_model_split_over_two_gpus_trains_in_fp16(tiny_text_path, tmp_path, four_bit, profile):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    import nbkit
    from nbkit.training import fsdp

    torch.manual_seed(0)
    layers = AutoConfig.from_pretrained(tiny_text_path).num_hidden_layers
    options = {"quantization_config": fsdp.qlora_config(torch.float16)} if four_bit else {}
    model = AutoModelForCausalLM.from_pretrained(
        tiny_text_path, dtype=torch.float16, device_map=_split_map(layers), **options
    )
    assert {p.device.index for p in model.parameters()} == {0, 1}
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    model = nbkit.savers.apply(model)  # per-layer checkpointing and the chunked loss, as the notebook does
    ids = torch.randint(8, 1000, (64,), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids, "labels": ids} for _ in range(48)]  # one batch, repeated: the loss must fall
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        fp16=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    losses = [e["loss"] for e in logged]
    norms = [e["grad_norm"] for e in logged]
    assert len(losses) == 12, logged
    assert all(math.isfinite(x) and x > 0 for x in losses), logged
    assert all(math.isfinite(x) for x in norms), logged
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses


def test_a_4bit_model_on_one_gpu_of_two_logs_the_loss_of_its_own_batch(tiny_text_path, tmp_path):
    """A 4-bit model that fits one GPU lands whole on one of two (accelerate's "balanced" map put Qwen3-1.7B's on
    the second): Trainer, in the notebook's process, counts one GPU with nbkit's trainer_defaults group installed,
    as the model_parallel notebook does, so the first logged loss is the batch's loss, not twice it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import nbkit
    from nbkit.training import fsdp

    model = AutoModelForCausalLM.from_pretrained(
        tiny_text_path, dtype=torch.float16, device_map={"": 1}, quantization_config=fsdp.qlora_config(torch.float16)
    )
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    ids = torch.randint(8, 1000, (64,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        forward = float(model(input_ids=ids[None].cuda(1), labels=ids[None].cuda(1)).loss)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=1,
        learning_rate=0.0,
        fp16=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    nbkit.install("trainer_defaults")
    try:
        trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": ids, "labels": ids}])
        trainer.train()
    finally:
        nbkit.uninstall("trainer_defaults")
    logged = next(e["loss"] for e in trainer.state.log_history if "loss" in e)
    assert trainer.args.n_gpu == 1
    assert logged == pytest.approx(forward, rel=1e-2), (logged, forward)
