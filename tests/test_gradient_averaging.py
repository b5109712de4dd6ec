"""A Trainer's LoRA gradients averaged by one all-reduce per step in place of DDP's reducer
(nbkit.training.gradient_averaging), on 2 real gloo ranks through nbkit.launch.

What a user relies on: the weights after training are those DDP's reducer gives, bit for bit, with gradient
accumulation, clipping and weight decay, whether or not DDP is told to search for unused weights (a weight one
rank used, a weight no rank used); the ranks stay identical; a weight without a gradient where DDP was told every
weight gets one stops the run with a message that names it and what to do.
"""

from __future__ import annotations

import pytest
import torch
from tiny_training import same_on_all_ranks, tiny_lora, token_sequences

import nbkit


class _PartlyUsed(torch.nn.Module):
    """tiny_lora(path) with two more trainable weights: one that only rank 0's steps use, one that no step uses
    (what DDP's find_unused_parameters=True is for)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.lora = tiny_lora(path)
        self.rank0_only = torch.nn.Linear(4, 1)
        self.never_used = torch.nn.Linear(4, 1)

    def forward(self, input_ids, labels, **kwargs):
        import torch.distributed as dist

        loss = self.lora(input_ids=input_ids, labels=labels).loss
        if dist.get_rank() == 0:
            loss = loss + self.rank0_only(torch.ones(4, device=loss.device)).pow(2).sum()
        return {"loss": loss}


def _train(path: str, out_dir: str, reducer: str, find_unused: bool) -> dict:
    """In each rank: 3 steps of Trainer (batch 2, gradient accumulation 2, clipping at 1.0: Trainer's default,
    weight decay, which moves a weight with a zero gradient but not one without) with nbkit's ddp_reducer set to
    `reducer`, then train() again for 3 more, as a second training cell does. The model: tiny_lora(path), or with
    `find_unused` _PartlyUsed(path) under DDP's find_unused_parameters=True. Returns the trainable weights after
    (on the host), which of them changed, whether they are the same on both ranks, and whether the flat averaging
    stood in for DDP's reducer after the second train() (which may prepare the model again).
    """
    from transformers import Trainer, TrainingArguments

    from nbkit.training import gradient_averaging

    nbkit.configure(ddp_reducer=reducer)
    model = _PartlyUsed(path) if find_unused else tiny_lora(path)
    before = {k: v.detach().cpu().clone() for k, v in model.named_parameters() if v.requires_grad}
    args = TrainingArguments(
        output_dir=f"{out_dir}/{reducer}-{find_unused}",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=5e-3,
        weight_decay=0.1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        ddp_find_unused_parameters=find_unused,
    )
    trainer = Trainer(model=model, args=args, train_dataset=token_sequences(32, 20))
    trainer.train()
    trainer.train()
    after = {k: v.detach().cpu().clone() for k, v in model.named_parameters() if v.requires_grad}
    return {
        "weights": after,
        "changed": {k for k in after if not torch.equal(before[k], after[k])},
        "same_on_both_ranks": same_on_all_ranks(after),
        "flat": gradient_averaging.averager(trainer.accelerator) is not None,
        "reducer_idle": not trainer.model_wrapped.require_backward_grad_sync,
    }


def _four_runs(path: str, out_dir: str) -> dict:
    return {
        (reducer, find_unused): _train(path, out_dir, reducer, find_unused)
        for find_unused in (False, True)
        for reducer in ("flat", "ddp")
    }


def _assert_runs(runs: dict, exact: bool) -> None:
    for (reducer, find_unused), run in runs.items():
        assert run["flat"] == run["reducer_idle"] == (reducer == "flat"), (reducer, find_unused)
        assert run["same_on_both_ranks"]
        lora_b = {k for k in run["weights"] if "lora_B" in k}
        assert lora_b and lora_b <= run["changed"]
        if find_unused:  # a weight one rank used trained on both; one no rank used has no gradient, so no decay
            assert {"rank0_only.weight", "rank0_only.bias"} <= run["changed"]
            assert not {"never_used.weight", "never_used.bias"} & run["changed"]
    for find_unused in (False, True):
        flat, ddp = runs["flat", find_unused]["weights"], runs["ddp", find_unused]["weights"]
        assert flat.keys() == ddp.keys()
        for name, weight in flat.items():
            if exact:
                assert torch.equal(weight, ddp[name]), (name, find_unused)
            else:
                torch.testing.assert_close(weight, ddp[name], rtol=1e-4, atol=1e-6, msg=f"{name} {find_unused}")


def test_a_trainers_lora_weights_equal_what_ddps_reducer_gives_bit_for_bit(tmp_path):
    _assert_runs(nbkit.launch(_four_runs, nbkit.resolve_model("tiny:qwen3"), str(tmp_path), gpus=2, timeout=300), True)


@pytest.mark.gpu
def test_over_nccl_on_two_gpus_the_weights_equal_what_ddps_reducer_gives(tmp_path):
    # The same runs on CUDA ranks: the averaging is as exact, but a GPU's backward kernels need not give the same
    # bits run after run (atomic adds), so the runs agree within rounding rather than bit for bit.
    runs = nbkit.launch(_four_runs, nbkit.resolve_model("tiny:qwen3"), str(tmp_path), gpus=2, timeout=300)
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
