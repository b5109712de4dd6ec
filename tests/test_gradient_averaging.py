"""A Trainer's LoRA gradients averaged by one all-reduce per step in place of DDP's reducer
(nbkit.training.gradient_averaging), on 2 real gloo ranks through nbkit.launch.

What a user relies on: the weights after training are those DDP's reducer gives, bit for bit, with gradient
accumulation and clipping; the ranks stay identical; the models it does not fit keep DDP's reducer; a weight
without a gradient stops the run with a message that names it and what to do.
"""

from __future__ import annotations

import pytest
import torch
from tiny_training import same_on_all_ranks, tiny_lora, token_sequences

import nbkit


def _train(path: str, out_dir: str, reducer: str, **arguments) -> dict:
    """In each rank: 3 steps of Trainer (batch 2, gradient accumulation 2, clipping at 1.0: Trainer's default) of
    tiny_lora(path) with nbkit's ddp_reducer set to `reducer`, then train() again for 3 more, as a second training
    cell does; the LoRA weights after, whether they changed and are the same on both ranks, and whether the flat
    averaging stood in for DDP's reducer after the second train() (which may prepare the model again).
    """
    from transformers import Trainer, TrainingArguments

    from nbkit.training import gradient_averaging

    nbkit.configure(ddp_reducer=reducer)
    model = tiny_lora(path)
    before = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    args = TrainingArguments(
        output_dir=f"{out_dir}/{reducer}",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=5e-3,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **arguments,
    )
    trainer = Trainer(model=model, args=args, train_dataset=token_sequences(32, 20))
    trainer.train()
    trainer.train()
    after = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    return {
        "weights": after,
        "changed": all(not torch.equal(before[k], after[k]) for k in after if "lora_B" in k),
        "same_on_both_ranks": same_on_all_ranks(after),
        "flat": gradient_averaging.averager(trainer.accelerator) is not None,
        "reducer_idle": not trainer.model_wrapped.require_backward_grad_sync,
    }


def _three_runs(path: str, out_dir: str) -> dict:
    return {
        "flat": _train(path, out_dir, "flat", ddp_find_unused_parameters=False),
        "ddp": _train(path, out_dir, "ddp", ddp_find_unused_parameters=False),
        # DDP's search for unused weights: the reducer stays (a weight no rank used keeps no gradient there).
        "unused": _train(path, out_dir, "flat", ddp_find_unused_parameters=True),
    }


def _assert_runs(runs: dict, exact: bool) -> None:
    flat, ddp = runs["flat"], runs["ddp"]
    assert (flat["flat"], ddp["flat"], runs["unused"]["flat"]) == (True, False, False)
    assert (flat["reducer_idle"], ddp["reducer_idle"], runs["unused"]["reducer_idle"]) == (True, False, False)
    for run in runs.values():
        assert run["changed"] and run["same_on_both_ranks"]
    assert flat["weights"].keys() == ddp["weights"].keys()
    for name, weight in flat["weights"].items():
        if exact:
            assert torch.equal(weight, ddp["weights"][name]), name
        else:
            torch.testing.assert_close(weight, ddp["weights"][name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_trainers_lora_weights_equal_what_ddps_reducer_gives_bit_for_bit(tmp_path):
    _assert_runs(nbkit.launch(_three_runs, nbkit.resolve_model("tiny:qwen3"), str(tmp_path), gpus=2, timeout=300), True)


@pytest.mark.gpu
def test_over_nccl_on_two_gpus_the_weights_equal_what_ddps_reducer_gives(tmp_path):
    # The same runs on CUDA ranks: the averaging is as exact, but a GPU's backward kernels need not give the same
    # bits run after run (atomic adds), so the runs agree within rounding rather than bit for bit.
    runs = nbkit.launch(_three_runs, nbkit.resolve_model("tiny:qwen3"), str(tmp_path), gpus=2, timeout=300)
    _assert_runs(runs, exact=False)


def _train_with_a_weight_no_step_uses(path: str, out_dir: str) -> None:
    from transformers import Trainer, TrainingArguments

    model = tiny_lora(path)
    model.base_model.model.never_used = torch.nn.Linear(2, 2)  # trainable, outside every forward
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=2,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    Trainer(model=model, args=args, train_dataset=token_sequences(8, 20)).train()


def test_a_weight_without_a_gradient_is_named_with_what_to_do(tmp_path):
    with pytest.raises(nbkit.LaunchError) as caught:
        nbkit.launch(
            _train_with_a_weight_no_step_uses, nbkit.resolve_model("tiny:qwen3"), str(tmp_path), gpus=2, timeout=300
        )
    message = str(caught.value)
    assert "GradientError" in message and "2 trainable weight(s) got no gradient" in message
    assert "never_used.weight" in message and "ddp_find_unused_parameters=True" in message
