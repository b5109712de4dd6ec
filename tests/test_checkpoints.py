"""Checkpoints: a save that never finished is never resumed from, and training continues where the
last complete checkpoint left off (real Trainer runs over 2 gloo ranks, one killed mid-save); a
previous session's output attached read-only (Kaggle's /kaggle/input, a Drive folder) is found and
copied in whole or not at all; the hub mirror's arguments are ones TrainingArguments takes."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest
from tiny_training import saving_trainer

import nbkit
from nbkit.platform import host as nbkit_platform
from nbkit.training import checkpoints
from nbkit.training.checkpoints import MARKER, hub_mirror, is_complete, resume_point


def _write_checkpoint(root: Path, step: int, *, marked: bool) -> Path:
    path = root / f"checkpoint-{step}"
    (path / "sub").mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    (path / "sub" / "optimizer.pt").write_bytes(os.urandom(1024))
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if marked:
        checkpoints._mark_complete(path, step)
    return path


@pytest.mark.version_independent
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


@pytest.mark.version_independent
def test_rotation_deletes_only_complete_checkpoints_and_keeps_the_newest_and_best(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        _write_checkpoint(tmp_path, step, marked=True)
    _write_checkpoint(tmp_path, 10, marked=False)  # the save in progress
    checkpoints._rotate(str(tmp_path), 1, best_model_checkpoint=str(tmp_path / "checkpoint-4"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-4", "checkpoint-8"]
    checkpoints._rotate(str(tmp_path), None, None)
    assert len(list(tmp_path.iterdir())) == 3


# ----------------------------------------------------------------------------------------------
# A previous session's output, attached read-only


def _read_only(root: Path) -> None:
    """chmod -w every folder and file under root (what Kaggle's /kaggle/input looks like)."""
    for path in sorted(root.rglob("*"), reverse=True) + [root]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _snapshot(root: Path) -> dict[str, tuple[bytes, int, float]]:
    """Every file under root: contents, mode, modification time."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mode, p.stat().st_mtime)
        for p in root.rglob("*")
        if p.is_file()
    }


def _previous_run(root: Path, *steps: int, unmarked: tuple[int, ...] = ()) -> Path:
    for step in steps:
        _write_checkpoint(root, step, marked=True)
    for step in unmarked:
        _write_checkpoint(root, step, marked=False)
    _read_only(root.parents[1])
    return root


@pytest.mark.version_independent
def test_the_newest_complete_checkpoint_of_a_read_only_previous_output_is_copied_in(tmp_path: Path, capsys) -> None:
    previous = _previous_run(tmp_path / "input" / "my-notebook" / "outputs" / "run", 10, 20, unmarked=(30,))
    before = _snapshot(tmp_path / "input")
    out = tmp_path / "working" / "outputs" / "run"

    resumed = resume_point(out, previous=previous)

    assert resumed == str(out / "checkpoint-20")
    assert capsys.readouterr().out == (
        f"nbkit: resuming from checkpoint-20 (step 20) in {out}, copied from {previous}.\n"
    )
    assert is_complete(resumed)
    # The same bytes, writable here (unlike the input).
    copied = {p.relative_to(out / "checkpoint-20").as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert copied == {
        name.split("checkpoint-20/", 1)[1]: data for name, (data, _, _) in before.items() if "/checkpoint-20/" in name
    }
    assert all(p.stat().st_mode & stat.S_IWUSR for p in [out, *out.rglob("*")])
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-20"]  # no partial copy left beside it
    assert _snapshot(tmp_path / "input") == before  # the input is untouched
    # The rotation can delete the copy later (a read-only folder would have stayed).
    _write_checkpoint(out, 22, marked=True)
    checkpoints._rotate(str(out), 1, None)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-22"]


@pytest.mark.version_independent
def test_the_newest_complete_checkpoint_wins_wherever_it_is(tmp_path: Path, capsys) -> None:
    old_run = _previous_run(tmp_path / "drive" / "MyDrive" / "run-1" / "ckpts", 4)
    new_run = _previous_run(tmp_path / "drive2" / "MyDrive" / "run-2" / "ckpts", 12, unmarked=(16,))
    out = tmp_path / "run"
    _write_checkpoint(out, 8, marked=True)
    _write_checkpoint(out, 12, marked=False)  # this session's save of step 12 was cut off

    # A glob, a folder, and one checkpoint folder given directly; the newest complete one is step 12.
    assert resume_point(out, previous=[str(tmp_path / "drive*" / "MyDrive" / "*" / "ckpts"), old_run]) == str(
        out / "checkpoint-12"
    )
    assert capsys.readouterr().out == (
        f"nbkit: resuming from checkpoint-12 (step 12) in {out}, copied from {new_run}.\n"
    )
    assert is_complete(out / "checkpoint-12")  # the half-written one was replaced by the whole copy
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-12", "checkpoint-8"]

    # Now output_dir's own is the newest: nothing is copied again.
    assert resume_point(out, previous=[new_run, old_run / "checkpoint-4"]) == str(out / "checkpoint-12")
    assert capsys.readouterr().out == f"nbkit: resuming from checkpoint-12 (step 12) in {out}.\n"
    # Nothing complete anywhere: fresh, and the previous output's unmarked step 16 is never copied.
    empty = tmp_path / "empty"
    assert resume_point(empty, previous=tmp_path / "nowhere" / "*") is None
    assert resume_point(tmp_path / "fresh", previous=new_run / "checkpoint-16") is None
    assert not (tmp_path / "fresh").exists()


@pytest.mark.version_independent
def test_on_kaggle_the_attached_inputs_are_searched_without_being_named(tmp_path: Path, monkeypatch, capsys) -> None:
    kaggle = tmp_path / "kaggle"
    (kaggle / "working").mkdir(parents=True)
    # A saved version's output attached as input: /kaggle/input/<notebook>/<output_dir>/checkpoint-N.
    _previous_run(kaggle / "input" / "train-qwen3" / "outputs" / "run", 8)
    # A dataset made of the output folder itself, one level down: step 12, the newest.
    _previous_run(kaggle / "input" / "owner" / "run-upload" / "outputs" / "run", 12)
    # An unrelated dataset.
    (kaggle / "input" / "latex-ocr" / "train").mkdir(parents=True)
    (kaggle / "input" / "latex-ocr" / "train" / "0.png").write_bytes(b"png")
    monkeypatch.setattr(nbkit_platform, "KAGGLE_INPUT", kaggle / "input")
    monkeypatch.chdir(kaggle / "working")

    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    assert resume_point("outputs/run") is None  # not on Kaggle: nothing is searched
    assert capsys.readouterr().out == "nbkit: no checkpoint in outputs/run yet; starting fresh.\n"

    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    assert resume_point("outputs/run") == "outputs/run/checkpoint-12"
    assert capsys.readouterr().out == (
        "nbkit: resuming from checkpoint-12 (step 12) in outputs/run, copied from "
        f"{kaggle / 'input' / 'owner' / 'run-upload' / 'outputs' / 'run'}.\n"
    )
    assert is_complete(kaggle / "working" / "outputs" / "run" / "checkpoint-12")


@pytest.mark.version_independent
def test_a_copy_cut_off_half_way_never_counts_and_the_next_copy_clears_it(tmp_path: Path, capsys) -> None:
    previous = _previous_run(tmp_path / "input" / "prev" / "run", 6)
    out = tmp_path / "run"
    # What a process killed during a copy leaves: a temporary folder holding part of a checkpoint,
    # marker included (copy order is the file system's).
    partial = out / ".nbkit-partial-k1ll3d"
    partial.mkdir(parents=True)
    (partial / MARKER).write_bytes((previous / "checkpoint-6" / MARKER).read_bytes())
    (partial / "trainer_state.json").write_text(json.dumps({"global_step": 6}))

    assert resume_point(out) is None  # neither nbkit nor transformers (globbing checkpoint-*) sees it
    assert not list(out.glob("checkpoint-*"))
    assert resume_point(out, previous=previous) == str(out / "checkpoint-6")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-6"]


def test_hub_mirroring_is_trainers_own_and_a_hub_that_cannot_be_read_stops_the_run(tmp_path: Path) -> None:
    from transformers import TrainingArguments
    from transformers.trainer_utils import HubStrategy

    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], **hub_mirror("someone/run-name"))
    assert args.push_to_hub and args.hub_model_id == "someone/run-name" and args.hub_private_repo
    assert args.hub_strategy == HubStrategy.CHECKPOINT  # Trainer pushes each checkpoint to last-checkpoint/
    assert hub_mirror("someone/run-name", private=False)["hub_private_repo"] is False

    # Offline (HF_HUB_OFFLINE=1 in the tests), the hub cannot say whether it holds a newer
    # checkpoint: starting fresh would push over it, so resume_point stops with what to do.
    out = tmp_path / "run"
    with pytest.raises(nbkit.CheckpointError, match=r"Cannot read someone/run-name/last-checkpoint.*leave out hub="):
        resume_point(out, hub="someone/run-name")
    assert list(out.iterdir()) == []  # the download's temporary folder is gone
    # A complete local checkpoint is used without asking the hub.
    _write_checkpoint(out, 3, marked=True)
    assert resume_point(out, hub="someone/run-name") == str(out / "checkpoint-3")


@pytest.mark.version_independent
def test_a_checkpoint_downloaded_from_the_hub_is_marked_and_put_in_place(tmp_path: Path) -> None:
    # What snapshot_download leaves of Trainer's last-checkpoint push: the files, no nbkit marker.
    download = tmp_path / "run" / ".nbkit-partial-download" / "last-checkpoint"
    _write_checkpoint(download.parent, 14, marked=False).rename(download)
    step, path = checkpoints._adopt_download(download, tmp_path / "run")
    assert (step, path) == (14, tmp_path / "run" / "checkpoint-14")
    assert is_complete(path) and not download.exists()
    assert json.loads((path / MARKER).read_text())["global_step"] == 14
    # A folder without trainer_state.json is no checkpoint.
    (tmp_path / "other").mkdir()
    assert checkpoints._adopt_download(tmp_path / "other", tmp_path / "run") is None


def _resume_in_rank(out: str, previous: str) -> str | None:
    resumed = resume_point(out, previous=previous)
    Path(out).parent.joinpath(f"rank-{nbkit.rank()}.txt").write_text(str(resumed))
    return resumed


def test_ranks_resuming_together_agree_on_one_whole_copy(tmp_path: Path, capfd) -> None:
    previous = _previous_run(tmp_path / "input" / "prev" / "run", 20)
    out = tmp_path / "work" / "run"
    assert nbkit.launch(_resume_in_rank, str(out), str(previous), gpus=2) == str(out / "checkpoint-20")
    assert {(tmp_path / "work" / f"rank-{r}.txt").read_text() for r in (0, 1)} == {str(out / "checkpoint-20")}
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-20"]
    assert is_complete(out / "checkpoint-20")
    assert capfd.readouterr().out.count("nbkit: resuming from checkpoint-20 (step 20)") == 1


# ----------------------------------------------------------------------------------------------
# Real training: 2 gloo ranks, Trainer saving every 2 steps with save_total_limit=1.


class _Killed(Exception):
    pass


def _train(path: str, out: str, max_steps: int, kill_at: int | None) -> dict:
    from transformers import TrainerCallback

    class StepsRun(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    steps = StepsRun()
    trainer = saving_trainer(path, out, 64, max_steps, callbacks=[steps], save_total_limit=1, logging_steps=1)
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
        "Trainers in launched ranks mark no checkpoint: nbkit.launching.fork._prepare_rank must call "
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
