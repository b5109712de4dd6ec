"""TRL's SFTTrainer metrics averaged over the ranks once per log (nbkit.training.trl_metrics), on 2 real gloo ranks
through nbkit.launch.

What a user relies on: the entropy, token accuracy and token count that the log shows are those TRL's own gathers
give (the same on every rank, the count over all ranks), with gradient accumulation, a last step that does not
log, and a second training that a callback added since stops at a step that does not log, while a training step
no longer gathers them from every rank after each forward.
"""

from __future__ import annotations

import pytest
import torch

import nbkit

LENGTH = 24  # every sample as long: each rank has as many label tokens per micro-batch, where both ways agree
STEPS, BATCH, ACCUMULATION = 3, 2, 2


def _stop_at_first_step() -> object:
    from transformers import TrainerCallback

    class StopAtFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = True

    return StopAtFirstStep()


def _sft_run(path: str, out_dir: str, mode: str) -> dict:
    """In each rank: 3 steps of SFTTrainer (batch 2, accumulation 2, a log every 2 steps, so the third step's
    metrics reach only the log at the end of training) on fixed-length token sequences, with nbkit's trl_metrics
    set to `mode`. Returns the logged metrics, every rank's copy of them, the all-gathers made inside compute_loss, and
    the values left waiting for an average."""
    import torch.distributed as dist
    from datasets import Dataset
    from tiny_training import tiny_lora
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from nbkit.training import trl_metrics

    nbkit.configure(trl_metrics=mode)
    g = torch.Generator().manual_seed(2)
    data = Dataset.from_list(
        [{"input_ids": torch.randint(8, 1000, (LENGTH,), generator=g).tolist()} for _ in range(32)]
    )
    config = SFTConfig(
        output_dir=f"{out_dir}/{mode}",
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        logging_steps=2,
        learning_rate=5e-3,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataset_kwargs={"skip_prepare_dataset": True},
        bf16=nbkit.precision() == "bf16",
        fp16=nbkit.precision() == "fp16",
    )
    trainer = SFTTrainer(
        model=tiny_lora(path), args=config, processing_class=AutoTokenizer.from_pretrained(path), train_dataset=data
    )
    # All-gathers while compute_loss runs (Trainer's own, per step and per log, do not count).
    gathers, inside = 0, False
    real = {name: getattr(dist, name) for name in ("all_gather", "all_gather_into_tensor")}
    compute_loss = trainer.compute_loss

    def counted(name: str):
        def call(*args, **kwargs):
            nonlocal gathers
            gathers += inside
            return real[name](*args, **kwargs)

        return call

    def watched_compute_loss(*args, **kwargs):
        nonlocal inside
        inside = True
        try:
            return compute_loss(*args, **kwargs)
        finally:
            inside = False

    trainer.compute_loss = watched_compute_loss
    for name in real:
        setattr(dist, name, counted(name))
    try:
        trainer.train()
        history = list(trainer.state.log_history)
        # Trained again, stopped at its first step by a callback added since, a step that does not log: its
        # metrics reach the log at the end of training only, averaged there as well.
        trainer.add_callback(_stop_at_first_step())
        trainer.train()
        history += trainer.state.log_history
    finally:
        for name, function in real.items():
            setattr(dist, name, function)
    keys = ("loss", "train_loss", "entropy", "mean_token_accuracy", "num_tokens")
    logs = [{k: log[k] for k in keys if k in log} for log in history]
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, logs)
    return {"logs": logs, "every_rank": every_rank, "gathers": gathers, "waiting": trl_metrics.pending_values(trainer)}


def _both_modes(path: str, out_dir: str) -> dict:
    return {mode: _sft_run(path, out_dir, mode) for mode in ("per_batch", "at_log")}


def _assert_runs(runs: dict, exact: bool) -> None:
    trl_way, nbkit_way = runs["per_batch"], runs["at_log"]
    metrics = {"entropy", "mean_token_accuracy", "num_tokens"}
    for run in (trl_way, nbkit_way):
        # (the losses are not averaged over ranks at the end of training: train_loss is each rank's own)
        shown = [[{k: v for k, v in log.items() if k in metrics} for log in logs] for logs in run["every_rank"]]
        assert all(logs == shown[0] for logs in shown)
        assert [set(log) for log in run["logs"]] == [{"loss", *metrics}, *[{"train_loss", *metrics}] * 2]
    # The count covers every token of both ranks: at the log of step 2, at the end for all 3 steps, and after the
    # second training's one step.
    per_step = BATCH * ACCUMULATION * 2 * LENGTH
    counts = [2 * per_step, STEPS * per_step, (STEPS + 1) * per_step]
    assert [log["num_tokens"] for log in nbkit_way["logs"]] == counts
    assert [log["num_tokens"] for log in trl_way["logs"]] == counts
    # Two trainings of the same model on the same data: the same losses (on a GPU within rounding: atomic adds),
    # and the same metrics within the rounding of a mean taken another way.
    rel = 1e-5 if exact else 1e-3
    for ours, trls in zip(nbkit_way["logs"], trl_way["logs"]):
        for key in ("loss", "train_loss", "entropy", "mean_token_accuracy"):
            if key in trls and exact and "loss" in key:
                assert ours[key] == trls[key], key
            elif key in trls:
                assert ours[key] == pytest.approx(trls[key], rel=rel, abs=rel / 100), key
    assert nbkit_way["waiting"] == 0
    # TRL gathers 3 or 4 times after each of the 6 micro-batches' forwards; here none of them does.
    assert trl_way["gathers"] >= 6 * 3
    assert nbkit_way["gathers"] == 0


def test_sft_metrics_averaged_once_per_log_equal_trls_gathered_ones(tmp_path):
    runs = nbkit.launch(_both_modes, nbkit.resolve_model("tiny:qwen3"), str(tmp_path), gpus=2, timeout=300)
    _assert_runs(runs, exact=True)


@pytest.mark.gpu
def test_over_nccl_the_sft_metrics_averaged_once_per_log_equal_trls(tmp_path):
    runs = nbkit.launch(_both_modes, nbkit.resolve_model("tiny:qwen3"), str(tmp_path), gpus=2, timeout=300)
    _assert_runs(runs, exact=False)
