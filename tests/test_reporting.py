"""nbkit.report and the Trainer callback: what the ranks send, in order, and what the notebook shows.

The distributed tests run real gloo ranks through nbkit.launch (2 CPU processes).
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from tiny_training import tiny_qwen3_trainer, train_tiny_qwen3

import nbkit
from nbkit.notebook import dashboard
from nbkit.platform import patching
from nbkit.rank_side import reporting


@pytest.fixture(autouse=True)
def text_dashboard(monkeypatch):
    monkeypatch.setenv("NBKIT_DASHBOARD", "text")
    monkeypatch.setenv("NBKIT_DASHBOARD_INTERVAL", "0")


@pytest.mark.version_independent
def test_report_outside_a_launch_feeds_a_local_text_dashboard(capsys):
    reporting.setup_rank()  # a fresh clock, as at the start of a run
    try:
        reporting.report(step=1, loss=torch.tensor(2.5), total_steps=2, tokens=torch.tensor(64))
        time.sleep(0.01)
        reporting.report(step=2, loss=1.5, total_steps=2, tokens=64, note=torch.ones(2))
    finally:
        reporting._local.close()
    events = dashboard.latest().events
    assert [e["step"] for _, e in events] == [1, 2]
    first, second = events[0][1], events[1][1]
    assert first["loss"] == 2.5 and isinstance(first["loss"], float)  # tensors become numbers
    assert second["tokens_seen"] == 128 and second["tokens_per_second"] > 0
    assert second["note"] == str(torch.ones(2))  # what is not a number travels as text
    assert first["memory_device"] == "cpu" and first["peak_memory_gib"] > 0
    out = capsys.readouterr().out
    assert "nbkit: step 2/2 (100%) | loss 1.5000" in out
    assert "final loss: 1.5000" in out


def test_custom_loop_reports_arrive_in_order_from_every_rank(capsys):
    def loop():
        import time

        import nbkit

        for step in range(1, 4):
            time.sleep(0.01)
            nbkit.report(step=step, loss=10.0 * (nbkit.rank() + 1) / step, total_steps=3, tokens=32)
        return "done"

    assert nbkit.launch(loop, gpus=2) == "done"
    events = dashboard.latest().events
    for rank in (0, 1):
        mine = [e for r, e in events if r == rank]
        assert [e["step"] for e in mine] == [1, 2, 3]
        assert [e["loss"] for e in mine] == pytest.approx([10.0 * (rank + 1) / s for s in (1, 2, 3)])
        assert all(e["tokens_per_second"] > 0 for e in mine[1:])
        assert [e["tokens_seen"] for e in mine] == [32, 64, 96]
    out = capsys.readouterr().out
    assert "nbkit: step 3/3 (100%)" in out
    assert "final loss: 5.0000" in out  # the ranks' step-3 losses averaged: (10/3 + 20/3) / 2
    assert "peak memory rank 1 (cpu)" in out


def test_trainer_in_a_launch_reports_every_step_and_draws_no_bars(capfd):
    import transformers.trainer  # noqa: F401  (imported once here, shared by the forked ranks)

    from nbkit.training.offline import load_config

    chance = math.log(load_config("tiny:qwen3").vocab_size)  # the loss of random weights
    callbacks = nbkit.launch(train_tiny_qwen3, gpus=2, logging_steps=2, learning_rate=1e-3)
    assert "DashboardCallback" in callbacks and "PrinterCallback" in callbacks
    assert "ProgressCallback" not in callbacks and "NotebookProgressCallback" not in callbacks
    assert patching.applied("reporting") == []  # the notebook process itself is never patched

    events = dashboard.latest().events
    for rank in (0, 1):
        steps = [e for r, e in events if r == rank and "loss" in e]
        assert [e["step"] for e in steps] == [1, 2, 3, 4]
        for e in steps:
            assert e["total_steps"] == 4
            assert abs(e["loss"] - chance) < 0.5
            assert e["learning_rate"] >= 0 and e["tokens_seen"] == 2 * 16 * e["step"]
            assert e["peak_memory_gib"] > 0 and e["elapsed"] > 0
        assert all(e["tokens_per_second"] > 0 for e in steps)
        logged = [e for r, e in events if r == rank and "grad_norm" in e]
        assert [e["step"] for e in logged] == [2, 4] and all(e["grad_norm"] > 0 for e in logged)
        assert events.index((rank, steps[0])) < events.index((rank, logged[0]))

    out = capfd.readouterr().out
    # rank 0's log lines appear once (PrinterCallback), no progress bar from any rank
    assert out.count("'train_runtime'") == 1
    assert out.count("'grad_norm'") == 2
    assert "it/s]" not in out
    assert "nbkit: step 4/4 (100%)" in out


def _train_with_a_slow_first_step() -> dict:
    from transformers import TrainerCallback

    class Slow(TrainerCallback):  # the first step's compilation, as torch.compile or unsloth would take it,
        def on_step_begin(self, args, state, control, **kwargs):  # and a checkpoint save after step 3
            if state.global_step in (0, 3):
                time.sleep(1.5 if state.global_step == 0 else 1.0)

    trainer = tiny_qwen3_trainer(max_steps=6, callbacks=[Slow()])
    stats = trainer.train()
    return nbkit.run_summary.training(trainer, stats, None)


def test_the_run_summary_gives_the_steady_pace_with_the_first_step_and_a_pause_apart():
    figures = nbkit.launch(_train_with_a_slow_first_step, gpus=2)
    assert figures["first_step_seconds"] >= 1.5
    seconds = figures["step_seconds"]
    assert len(seconds) == 6 and seconds[0] >= 1.5 and seconds[3] >= 1.0
    # the mean over all 6 steps carries both pauses; the steady pace of steps 2-6 is their median, without either
    assert figures["mean_seconds_per_step"] >= 2.5 / 6
    assert figures["seconds_per_step"] < 1.0 / 4
    assert figures["seconds_per_step"] == pytest.approx(sorted(seconds[1:])[2], abs=0.002)
    # 2 sequences of 16 tokens a step on rank 0, at the steady pace
    assert figures["tokens_per_second"] == pytest.approx(32 / figures["seconds_per_step"], rel=0.05)


def _train_after_a_library_replaced_training_step() -> dict:
    # unsloth replaces Trainer.training_step with its own copy of transformers' source when the rank imports
    # it, after nbkit's set-up: nothing of nbkit's runs in that copy
    from transformers import Trainer

    def replaced(self, model, inputs, num_items_in_batch=None):
        model.train()
        loss = self.compute_loss(model, self._prepare_inputs(inputs), num_items_in_batch=num_items_in_batch)
        self.accelerator.backward(loss)
        return loss.detach()

    Trainer.training_step = replaced
    trainer = tiny_qwen3_trainer(max_steps=3)
    stats = trainer.train()
    return nbkit.run_summary.training(trainer, stats, None)


def test_loss_and_tokens_reach_the_dashboard_when_a_library_replaced_training_step():
    figures = nbkit.launch(_train_after_a_library_replaced_training_step, gpus=2)
    assert figures["tokens_per_second"] is not None and figures["tokens_per_second"] > 0
    for rank in (0, 1):
        steps = [e for r, e in dashboard.latest().events if r == rank and "loss" in e]
        assert [e["step"] for e in steps] == [1, 2, 3]
        assert [e["tokens_seen"] for e in steps] == [32, 64, 96]


@pytest.mark.gpu
def test_trainer_on_gpus_reports_each_ranks_cuda_peak_memory():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    nbkit.launch(train_tiny_qwen3, False, gpus=2, logging_steps=2, learning_rate=1e-3)
    events = dashboard.latest().events
    for rank in (0, 1):
        steps = [e for r, e in events if r == rank and "loss" in e]
        assert [e["step"] for e in steps] == [1, 2, 3, 4]
        assert {e["memory_device"] for e in steps} == {f"cuda:{rank}"}
        assert all(0 < e["peak_memory_gib"] < 2 for e in steps)
    assert not torch.cuda.is_initialized()  # the notebook process never touched CUDA


def _progress_bars_enabled() -> tuple[bool, bool]:
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as transformers_logging

    return (not are_progress_bars_disabled(), transformers_logging.is_progress_bar_enabled())


def test_library_progress_bars_are_off_in_launched_ranks_only():
    # Widget bars from forked ranks are dropped by ipykernel with a warning per update; the dashboard
    # shows progress instead. The notebook process keeps its bars.
    assert _progress_bars_enabled() == (True, True)
    assert nbkit.launch(_progress_bars_enabled, gpus=2) == (False, False)
    assert _progress_bars_enabled() == (True, True)
