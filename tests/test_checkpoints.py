"""Checkpoints: a save that never finished is never resumed from, and training continues where the
last complete checkpoint left off (real Trainer runs over 2 gloo ranks, one killed mid-save)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

import nbkit
from nbkit import checkpoints
from nbkit.checkpoints import MARKER, is_complete, resume_point


def _write_checkpoint(root: Path, step: int, *, marked: bool) -> Path:
    path = root / f"checkpoint-{step}"
    (path / "sub").mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    (path / "sub" / "optimizer.pt").write_bytes(os.urandom(1024))
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if marked:
        checkpoints._mark_complete(path, step)
    return path


def test_the_marker_tells_complete_checkpoints_from_half_written_ones(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert resume_point(out) is None
    assert capsys.readouterr().out == f"nbkit: no checkpoint in {out} yet; starting fresh.\n"

    first = _write_checkpoint(out, 10, marked=True)
    second = _write_checkpoint(out, 20, marked=True)
    # Every file a save writes, trainer_state.json (Trainer's last) included, but no marker: the
    # session ended before on_save.
    unmarked = _write_checkpoint(out, 30, marked=False)
    truncated = _write_checkpoint(out, 40, marked=True)
    with open(truncated / "adapter_model.safetensors", "r+b") as handle:
        handle.truncate(100)
    missing = _write_checkpoint(out, 50, marked=True)
    (missing / "sub" / "optimizer.pt").unlink()
    (out / "checkpoint-60").mkdir()  # created, nothing written yet
    (out / "checkpoint-notes").mkdir()  # not a checkpoint at all

    assert [is_complete(p) for p in (first, second, unmarked, truncated, missing)] == [True, True, False, False, False]
    marker = json.loads((second / MARKER).read_text())
    assert marker["global_step"] == 20
    assert marker["files"] == {
        "adapter_model.safetensors": 4096,
        "sub/optimizer.pt": 1024,
        "trainer_state.json": len(json.dumps({"global_step": 20})),
    }
    assert not list(second.glob(f".{MARKER}*"))  # the temporary name was renamed away

    assert resume_point(out) == str(second)
    assert capsys.readouterr().out == (
        f"nbkit: resuming from checkpoint-20 (step 20) in {out}. Skipped checkpoint-30, checkpoint-40, "
        "checkpoint-50, checkpoint-60: not marked complete (a save that was interrupted, or one written "
        "without nbkit).\n"
    )
    assert sorted(p.name for p in out.iterdir()) == [  # resume_point deletes nothing
        "checkpoint-10",
        "checkpoint-20",
        "checkpoint-30",
        "checkpoint-40",
        "checkpoint-50",
        "checkpoint-60",
        "checkpoint-notes",
    ]

    only_partial = tmp_path / "partial"
    _write_checkpoint(only_partial, 5, marked=False)
    assert resume_point(only_partial) is None
    assert capsys.readouterr().out.startswith(
        f"nbkit: no complete checkpoint in {only_partial}; starting fresh. Skipped checkpoint-5:"
    )


def test_rotation_deletes_only_complete_checkpoints_and_keeps_the_newest_and_best(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        _write_checkpoint(tmp_path, step, marked=True)
    _write_checkpoint(tmp_path, 10, marked=False)  # the save in progress
    checkpoints._rotate(str(tmp_path), 1, best_model_checkpoint=str(tmp_path / "checkpoint-4"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-4", "checkpoint-8"]
    checkpoints._rotate(str(tmp_path), None, None)
    assert len(list(tmp_path.iterdir())) == 3


# ----------------------------------------------------------------------------------------------
# Real training: 2 gloo ranks, Trainer saving every 2 steps with save_total_limit=1.


class _Killed(Exception):
    pass


def _train(path: str, out: str, max_steps: int, kill_at: int | None) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    class StepsRun(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (ids := torch.randint(8, 1000, (16,), generator=g)), "labels": ids} for _ in range(64)]
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=max_steps,
        learning_rate=1e-3,
        save_steps=2,
        save_total_limit=1,
        report_to=[],
        disable_tqdm=True,
        logging_steps=1,
    )
    steps = StepsRun()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[steps])
    if kill_at is not None and nbkit.is_main():
        # The worst moment for a session to end: the checkpoint's files are all written and older
        # checkpoints already rotated away, but on_save (which marks it complete) has not run.
        on_save = trainer.callback_handler.on_save

        def on_save_then_die(args, state, control):
            if state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return on_save(args, state, control)

        trainer.callback_handler.on_save = on_save_then_die
    resumed_from = resume_point(out)
    trainer.train(resume_from_checkpoint=resumed_from)
    return {
        "marker_added": any(isinstance(cb, checkpoints._Marking) for cb in trainer.callback_handler.callbacks),
        "resumed_from": resumed_from,
        "steps_run": steps.steps,
        "global_step": trainer.state.global_step,
        "logged_steps": [log["step"] for log in trainer.state.log_history if "loss" in log],
    }


def test_a_run_killed_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path: Path, capfd) -> None:
    path = nbkit.resolve_model("tiny:qwen3")
    out = tmp_path / "run"

    with pytest.raises(nbkit.LaunchError):
        nbkit.launch(_train, path, str(out), 8, 6, gpus=2)
    assert "nbkit: no checkpoint in" in capfd.readouterr().out
    assert (out / "checkpoint-4" / MARKER).is_file(), (
        "Trainers in launched ranks mark no checkpoint: nbkit.launching._prepare_rank must call "
        "nbkit.checkpoints.enable()"
    )
    # checkpoint-2 was rotated away once checkpoint-4 was complete; checkpoint-6 is fully written
    # but was never marked, and transformers' own rotation would have deleted checkpoint-4 for it.
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert is_complete(out / "checkpoint-4") and not is_complete(out / "checkpoint-6")
    assert (out / "checkpoint-6" / "trainer_state.json").is_file()

    result = nbkit.launch(_train, path, str(out), 8, None, gpus=2)
    assert result["marker_added"]
    assert result["resumed_from"] == str(out / "checkpoint-4")
    assert "nbkit: resuming from checkpoint-4 (step 4)" in capfd.readouterr().out
    assert result["steps_run"] == [5, 6, 7, 8]  # global_step continues from the checkpoint
    assert result["global_step"] == 8
    assert result["logged_steps"] == [1, 2, 3, 4, 5, 6, 7, 8]  # the log history came back with it
    assert [p.name for p in out.iterdir()] == ["checkpoint-8"]
    assert is_complete(out / "checkpoint-8")
    assert json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())["global_step"] == 8
