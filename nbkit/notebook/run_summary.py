"""A notebook run's key figures, for the scripts and tests that read a run rather than watch it.

    figures = nbkit.run_summary.training(trainer, trainer_stats, resumed_from)   # on rank 0, after train()
    nbkit.run_summary.write(output_dir, train=figures, ...)                      # in the notebook: summary.json

The shipped notebooks end with these two calls, so that `notebooks/run.py` and the tests read one file
(output_dir/summary.json) instead of the notebook carrying that bookkeeping in its cells.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["training", "write"]


def training(trainer: Any, stats: Any, resumed_from: str | None) -> dict[str, Any]:
    """What one `trainer.train()` call did, as plain values (picklable, JSON-ready).

    Args:
        trainer: the transformers Trainer (or TRL's SFTTrainer) that trained.
        stats: what `trainer.train()` returned (its `.metrics["train_runtime"]` is this call's seconds).
        resumed_from: the checkpoint this call resumed from, or None.

    Returns:
        {"global_step", "resumed_from", "last_loss", "seconds_per_step" and "tokens_per_second" (this rank's
        steady pace: medians over the steps after this call's first, which holds compilation and warm-up; in a
        rank nbkit started, from the dashboard callback's clock), "first_step_seconds", "step_seconds" (each
        step's, in order; empty outside such a rank), "mean_seconds_per_step" (this call's run time over its
        steps, the first included), "batch": {"per_device", "accumulation", "processes"}, "gradient_averaging"
        ("flat": nbkit's one all-reduce per step; "ddp": DDP's reducer; None: one process, or a model that is not
        DDP-wrapped), "peak_memory_gib" (as the dashboard shows it)}. Outside a rank nbkit started, or after a
        single step, the steady figures fall back to the mean (tokens/s then None). Call it on any rank;
        each returns its own figures.
    """
    from nbkit.rank_side.reporting import peak_memory_gib, trainer_pace
    from nbkit.training import gradient_averaging

    state = trainer.state
    steps_run = state.global_step - (int(str(resumed_from).rsplit("-", 1)[1]) if resumed_from else 0)
    losses = [entry["loss"] for entry in state.log_history if "loss" in entry]
    mean = stats.metrics["train_runtime"] / max(1, steps_run)
    pace = trainer_pace(trainer)
    return {
        "global_step": state.global_step,
        "resumed_from": resumed_from,
        "last_loss": losses[-1] if losses else None,
        "seconds_per_step": pace.get("seconds_per_step") or mean,
        "tokens_per_second": pace.get("tokens_per_second"),
        "first_step_seconds": pace.get("first_step_seconds"),
        "step_seconds": [round(seconds, 3) for seconds in pace.get("step_seconds", [])],
        "mean_seconds_per_step": mean,
        "batch": {
            "per_device": trainer.args.per_device_train_batch_size,
            "accumulation": trainer.args.gradient_accumulation_steps,
            "processes": trainer.args.world_size,
        },
        "gradient_averaging": gradient_averaging.mode(trainer),
        "peak_memory_gib": peak_memory_gib(),
    }


def write(output_dir: str | os.PathLike[str], **fields: Any) -> dict[str, Any]:
    """Write output_dir/summary.json: `fields` plus the loss curve from output_dir/trainer_state.json.

    Returns the summary written ("steps" and "losses" are empty where trainer_state.json is missing).
    Raises OSError where output_dir cannot be written.
    """
    state = Path(output_dir) / "trainer_state.json"
    log = json.loads(state.read_text())["log_history"] if state.is_file() else []
    points = [(entry["step"], entry["loss"]) for entry in log if "loss" in entry]
    summary = {**fields, "steps": [step for step, _ in points], "losses": [loss for _, loss in points]}
    (Path(output_dir) / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary
