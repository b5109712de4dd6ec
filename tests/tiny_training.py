"""Tiny training set-ups the tests share: a LoRA model of a tiny checkpoint, seeded random token
sequences, a Trainer of both that saves every 2 steps, and a 4-step Trainer run of a random tiny Qwen3.

They run in the test process and in ranks that nbkit.launch forks from it alike. transformers and
peft are imported inside the functions: peft imports bitsandbytes where it is installed, which a
process that launches ranks should not have done.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch


def tiny_lora(path: str) -> torch.nn.Module:
    """The causal LM at `path` with LoRA (r=4, alpha 8) on all linear layers, seeded: every call, on every
    rank, builds the same weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def token_sequences(count: int, length: int) -> list[dict[str, torch.Tensor]]:
    """`count` random sequences of `length` token ids (8 to 999), labels equal to the inputs; seeded, so
    every call returns the same data."""
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(8, 1000, (length,), generator=g)), "labels": ids} for _ in range(count)]


def same_on_all_ranks(weights: dict[str, torch.Tensor]) -> bool:
    """Whether every rank holds exactly these tensors (a collective: call on every rank)."""
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    # on the host: each CUDA rank's tensors would arrive on its own device, which torch.equal refuses
    dist.all_gather_object(gathered, {k: v.cpu() for k, v in weights.items()})
    return all(torch.equal(gathered[0][k], other[k]) for other in gathered[1:] for k in weights)


def saving_trainer(
    path: str, out: str, samples: int, max_steps: int, callbacks: list | None = None, **arguments: Any
) -> Any:
    """A Trainer of tiny_lora(path) on token_sequences(samples, 16), batch 2 per rank, learning rate 1e-3,
    saving a checkpoint to `out` every 2 steps, no progress bar. `arguments` add to TrainingArguments.
    """
    from transformers import Trainer, TrainingArguments

    model = tiny_lora(path)
    data = token_sequences(samples, 16)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=max_steps,
        learning_rate=1e-3,
        save_steps=2,
        report_to=[],
        disable_tqdm=True,
        **arguments,
    )
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def train_tiny_qwen3(use_cpu: bool = True, **arguments: Any) -> list[str]:
    """4 Trainer steps (batch 2) of a random tiny Qwen3 (tiny:qwen3's config) on random tokens; returns
    the class names of the Trainer's callbacks. `arguments` go to TrainingArguments (logging_steps, ...).
    """
    trainer = tiny_qwen3_trainer(use_cpu, **arguments)
    callbacks = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    trainer.train()
    return callbacks


def tiny_qwen3_trainer(use_cpu: bool = True, callbacks: list | None = None, **arguments: Any) -> Any:
    """The Trainer of train_tiny_qwen3 (max_steps 4 unless `arguments` say otherwise), not yet trained."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from nbkit.training.offline import load_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config("tiny:qwen3"))
    data = [{"input_ids": torch.randint(0, 100, (16,)), "labels": torch.randint(0, 100, (16,))} for _ in range(16)]
    options: dict[str, Any] = {"max_steps": 4, **arguments}
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="nbkit-test-"),
        per_device_train_batch_size=2,
        report_to="none",
        save_strategy="no",
        use_cpu=use_cpu,
        **options,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    # Trainer makes output_dir at once though save_strategy="no" writes nothing there, and ranks end by
    # os._exit, which runs no cleanup: the empty folder goes now (a save would make it again).
    os.rmdir(args.output_dir)
    return trainer
