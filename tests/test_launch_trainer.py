"""Trainer and TRL's SFTTrainer inside nbkit.launch run real DDP over gloo on CPU."""

from __future__ import annotations

import torch
from tiny_training import same_on_all_ranks, tiny_lora, token_sequences

import nbkit


def _lora_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


def _train_both(path: str, out_dir: str) -> dict:
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoTokenizer, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    report = {}
    # The same short run for both trainers: 3 steps of batch 2 per rank, nothing saved, no progress bar.
    common = dict(
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=5e-3,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    # transformers' Trainer on random token ids (each rank gets its own shard of the data).
    model = tiny_lora(path)
    before = _lora_weights(model)
    args = TrainingArguments(output_dir=f"{out_dir}/trainer", **common)
    Trainer(model=model, args=args, train_dataset=token_sequences(16, 24)).train()
    after = _lora_weights(model)
    report["trainer"] = {
        "args_world_size": args.world_size,
        "process_group_size": dist.get_world_size(),
        "identical_across_ranks": same_on_all_ranks(after),
        "changed": any(not torch.equal(before[k], after[k]) for k in after),
    }

    # TRL's SFTTrainer on the synthetic chat dataset.
    model = tiny_lora(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = SFTConfig(
        output_dir=f"{out_dir}/sft",
        **common,
        max_length=64,
        logging_steps=1,
        bf16=nbkit.precision() == "bf16",
        fp16=nbkit.precision() == "fp16",
    )
    trainer = SFTTrainer(
        model=model, args=config, processing_class=tokenizer, train_dataset=Dataset.from_list(nbkit.text_dataset(24))
    )
    trainer.train()
    report["sft"] = {
        "args_world_size": config.world_size,
        "identical_across_ranks": same_on_all_ranks(_lora_weights(model)),
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
    }
    return report


def test_trainer_and_sft_trainer_run_ddp_over_gloo(tmp_path):
    path = nbkit.resolve_model("tiny:qwen3")
    report = nbkit.launch(_train_both, path, str(tmp_path), gpus=2)
    assert report["trainer"] == {
        "args_world_size": 2,
        "process_group_size": 2,
        "identical_across_ranks": True,
        "changed": True,
    }
    assert report["sft"]["args_world_size"] == 2
    assert report["sft"]["identical_across_ranks"] is True
    assert report["sft"]["losses"] and all(loss == loss for loss in report["sft"]["losses"])  # logged, not NaN
