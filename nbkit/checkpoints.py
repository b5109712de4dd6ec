"""Checkpoints that survive a session ending in the middle of a save, and resuming from them.

Kaggle ends a session after 12 hours, wherever training is. transformers' Trainer writes
`checkpoint-N/` file by file (weights, optimizer, scheduler, RNG states, trainer_state.json); a
session that ends during a save leaves a directory that looks like a checkpoint but lacks files or
holds truncated ones, and `trainer.train(resume_from_checkpoint=True)` takes it anyway (it picks
the highest number). nbkit therefore marks a checkpoint complete only once every rank has
finished writing it, and resumes from the newest marked one:

    trainer.train(resume_from_checkpoint=nbkit.checkpoints.resume_point(output_dir))

The mark is a file, MARKER, that `CheckpointMarker` (a TrainerCallback) writes in `on_save`, which
transformers calls after the whole checkpoint is on disk. It lists every file of the checkpoint
with its size, after syncing them to disk, and is itself written under a temporary name and then
renamed, so it exists whole or not at all. A checkpoint is complete when its marker exists and
every file it lists still has the recorded size: this does not depend on the order in which
Trainer writes its files. Before Trainer writes into a directory that already has a marker (a
rerun reaching the same step), the marker is removed first.

With `save_total_limit`, transformers deletes older checkpoints right after writing a new one,
before the new one could be marked: a session ending there would leave no complete checkpoint.
nbkit's rotation counts and deletes complete checkpoints only, and runs again once the new one is
marked, so the newest complete checkpoint survives until its successor is complete.

Resuming a run of several CPU processes (nbkit.launch(gpus=N) without GPUs, as in CI) fails in
transformers itself when it loads the optimizer; the third patch here fixes that.

Inside nbkit.launch every Trainer gets the marker automatically (`enable()` runs in each rank).
A notebook that trains without launching (one process, a model split over GPUs) calls
`nbkit.checkpoints.enable()` once before creating its Trainer; `nbkit.checkpoints.disable()` (or
`nbkit.uninstall("checkpoints")`) undoes it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbkit import callbacks, distributed, patching

__all__ = [  # noqa: F822 (names built on first use, see __getattr__)
    "MARKER",
    "CheckpointMarker",
    "disable",
    "enable",
    "is_complete",
    "resume_point",
]  # CheckpointMarker: built on first use

MARKER = "nbkit-complete.json"
_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
_STEP = re.compile(rf"^{_PREFIX}-(\d+)$")


# --------------------------------------------------------------------------------------------
# Reading: which checkpoints are complete, and where to resume
# --------------------------------------------------------------------------------------------


def _checkpoints(output_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, directory) of every `checkpoint-<step>` directory under output_dir, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _read_marker(checkpoint: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((checkpoint / MARKER).read_text())
        files = marker["files"]
        if not isinstance(files, dict) or not isinstance(marker["global_step"], int):
            return None
        return marker
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_complete(checkpoint: str | os.PathLike[str]) -> bool:
    """Whether `checkpoint` (a checkpoint-N directory) was completely written.

    True when nbkit's marker is there and every file it lists has the size it had when the
    checkpoint was marked; False for a directory without a marker (a save that was interrupted,
    or one written without nbkit), with an unreadable marker, or with a listed file missing or
    changed in size. Reads only; safe on every rank.
    """
    path = Path(checkpoint)
    marker = _read_marker(path)
    if marker is None:
        return False
    for name, size in marker["files"].items():
        try:
            if (path / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def resume_point(output_dir: str | os.PathLike[str]) -> str | None:
    """The checkpoint to resume training from: the newest complete one in `output_dir`, or None.

    Pass the result to `trainer.train(resume_from_checkpoint=...)`: None starts fresh. Prints one
    line (on the main rank only) saying which checkpoint and step training resumes from, or that it
    starts fresh, and names the half-written checkpoints it skipped. Deletes nothing and returns
    the same answer on every rank (they read the same directory). A missing output_dir means no
    checkpoint.
    """
    found = [(step, path, is_complete(path)) for step, path in _checkpoints(output_dir)]
    complete = [(step, path) for step, path, ok in found if ok]
    chosen = complete[-1] if complete else None
    newer_unmarked = [path.name for step, path, ok in found if not ok and (chosen is None or step > chosen[0])]
    if chosen is not None:
        step = _read_marker(chosen[1])["global_step"]  # type: ignore[index]
        line = f"nbkit: resuming from {chosen[1].name} (step {step}) in {output_dir}."
    elif newer_unmarked:
        line = f"nbkit: no complete checkpoint in {output_dir}; starting fresh."
    else:
        line = f"nbkit: no checkpoint in {output_dir} yet; starting fresh."
    if newer_unmarked:
        line += (
            f" Skipped {', '.join(newer_unmarked)}: not marked complete (a save that was interrupted, "
            "or one written without nbkit)."
        )
    if distributed.is_main():
        print(line, flush=True)
    return str(chosen[1]) if chosen is not None else None


# --------------------------------------------------------------------------------------------
# Writing: the marker, the rotation
# --------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mark_complete(checkpoint: Path, global_step: int) -> None:
    """Write the marker of a checkpoint whose files are all written: sync the files, then the
    marker under a temporary name, then rename it into place (a crash leaves no partial marker).
    """
    files: dict[str, int] = {}
    for file in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        name = file.relative_to(checkpoint).as_posix()
        if name == MARKER or name.startswith(f".{MARKER}"):
            continue
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())  # on disk before the marker says so, also across an OS crash
        files[name] = file.stat().st_size
    marker = {"global_step": global_step, "time": time.time(), "files": files}
    temporary = checkpoint / f".{MARKER}.{os.getpid()}"
    with open(temporary, "w") as handle:
        json.dump(marker, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, checkpoint / MARKER)
    _fsync_dir(checkpoint)


def _unmark(checkpoint: Path) -> None:
    """Remove a checkpoint's marker before its files are overwritten."""
    try:
        (checkpoint / MARKER).unlink()
    except FileNotFoundError:
        return
    _fsync_dir(checkpoint)


def _rotate(output_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """Delete the oldest complete checkpoints until `save_total_limit` complete ones remain,
    keeping the newest complete one and the best one. Unmarked directories are never touched:
    one of them may be the checkpoint being written right now.
    """
    if not save_total_limit or save_total_limit <= 0:
        return
    complete = [path for _, path in _checkpoints(output_dir) if is_complete(path)]
    protected = set(complete[-1:])
    if best_model_checkpoint:
        protected.add(Path(best_model_checkpoint))
    excess = len(complete) - max(save_total_limit, len(protected & set(complete)))
    for path in complete:
        if excess <= 0:
            break
        if path not in protected:
            shutil.rmtree(path, ignore_errors=True)
            excess -= 1


def _barrier() -> None:
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class _Marking:
    """A transformers TrainerCallback that marks each checkpoint complete once it is written.

    on_save (every rank; transformers calls it after the checkpoint is written): waits for every
    rank (each writes its own RNG state), then the saving process writes the marker and applies
    save_total_limit to complete checkpoints. on_step_end / on_epoch_end: when a save is about to
    happen, removes a stale marker from the directory Trainer is about to write into. nbkit adds
    it to every Trainer once `enable()` has run; adding it by hand (`callbacks=[CheckpointMarker()]`)
    works anywhere.
    """

    def _target(self, args: Any, state: Any) -> Path:
        return Path(args.output_dir) / f"{_PREFIX}-{state.global_step}"

    def _before_save(self, args: Any, state: Any, control: Any) -> None:
        if control.should_save and args.should_save:
            _unmark(self._target(args, state))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._before_save(args, state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._before_save(args, state, control)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _barrier()
        checkpoint = self._target(args, state)
        if args.should_save and checkpoint.is_dir():
            _mark_complete(checkpoint, state.global_step)
            _rotate(args.output_dir, args.save_total_limit, state.best_model_checkpoint)


# CheckpointMarker subclasses transformers' TrainerCallback; building it on first use keeps
# `import nbkit.checkpoints` (done in every launched rank) from importing transformers.
__getattr__ = callbacks.lazy_module_attributes(__name__, CheckpointMarker=_Marking)


def _marker_callback() -> type:
    return callbacks.trainer_callback("CheckpointMarker", _Marking, __name__)


# --------------------------------------------------------------------------------------------
# The patches that give every Trainer the marker, and the rotation that spares complete checkpoints
# --------------------------------------------------------------------------------------------


def enable() -> None:
    """Give every transformers Trainer (and TRL trainer) created from now on in this process the
    CheckpointMarker, and make checkpoint rotation spare the newest complete checkpoint.

    Idempotent; imports nothing heavy: where transformers' trainer is not imported yet, the patches
    wait for it (nbkit.patching's import hook). nbkit.launch runs it in every rank; call it
    yourself in a process that trains without nbkit.launch. `disable()` undoes it.
    """
    patching.apply("checkpoints")


def disable() -> None:
    """Undo `enable()` in this process: Trainers created afterwards get no CheckpointMarker.

    Restores transformers' CallbackHandler.__init__, rotate_checkpoints and the optimizer loading
    exactly as they were, and drops the patches still waiting for transformers' trainer. Trainers
    that already exist keep the marker they were given. A no-op when not enabled.
    """
    patching.revert("checkpoints")


@patching.patch(
    "transformers.trainer_callback:CallbackHandler.__init__",
    reason="every Trainer must mark its checkpoints complete so that a session ending mid-save "
    "(Kaggle's 12 h limit) never resumes from a half-written checkpoint; the callback list "
    "is built here for Trainer and every TRL trainer (Trainer.__init__ itself is already "
    "patched by nbkit.reporting, and one attribute carries one patch)",
    upstream="transformers resumes from the highest-numbered checkpoint directory, complete or not: "
    "https://github.com/huggingface/transformers/issues/35782",
    group="checkpoints",
)
def _handler_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, callbacks: Any, *args: Any, **kwargs: Any) -> None:
        original(self, callbacks, *args, **kwargs)
        if not any(isinstance(cb, _Marking) for cb in self.callbacks):
            self.add_callback(_marker_callback()())

    return __init__


@patching.patch(
    "transformers.trainer:rotate_checkpoints",
    reason="with save_total_limit, Trainer deletes older checkpoints right after writing a new one "
    "and before it can be marked complete, so a session ending there leaves none to resume "
    "from; count and delete complete checkpoints only",
    upstream="nothing in transformers tells a complete checkpoint from a half-written one: "
    "https://github.com/huggingface/transformers/issues/35782",
    group="checkpoints",
)
def _complete_only_rotation(original: Callable[..., Any]) -> Callable[..., Any]:
    def rotate_checkpoints(
        output_dir: str,
        save_total_limit: int | None = None,
        best_model_checkpoint: str | None = None,
        use_mtime: bool = False,
        checkpoint_prefix: str = _PREFIX,
    ) -> None:
        if checkpoint_prefix != _PREFIX:
            return original(output_dir, save_total_limit, best_model_checkpoint, use_mtime, checkpoint_prefix)
        _rotate(output_dir, save_total_limit, best_model_checkpoint)

    return rotate_checkpoints


@patching.patch(
    "transformers.trainer:Trainer._rotate_checkpoints",
    reason="the same rotation of complete checkpoints only, for transformers 4.x, where rotation is this "
    "Trainer method (transformers 5 moved it to trainer_utils.rotate_checkpoints, patched above)",
    upstream="https://github.com/huggingface/transformers/issues/35782",
    group="checkpoints",
)
def _complete_only_rotation_4x(original: Callable[..., Any]) -> Callable[..., Any]:
    def _rotate_checkpoints(self: Any, use_mtime: bool = False, output_dir: str | None = None) -> None:
        _rotate(output_dir or self.args.output_dir, self.args.save_total_limit, self.state.best_model_checkpoint)

    return _rotate_checkpoints


def _indexed_cpu_device(trainer: Any) -> bool:
    device = trainer.args.device
    return trainer.args.world_size > 1 and device.type == "cpu" and device.index is not None


@patching.patch(
    "transformers.trainer:Trainer._load_optimizer_and_scheduler",
    reason="resuming a multi-process CPU run (CI, nbkit.launch(gpus=N) without GPUs) fails: with several "
    "processes Trainer loads optimizer.pt with map_location=args.device, accelerate makes that "
    "torch.device('cpu', rank) on CPU, and torch.load cannot map storages to 'cpu:0' (\"don't know "
    'how to restore data location"); load both states onto the plain CPU device instead',
    upstream="no upstream report yet; the map_location comes from "
    "https://github.com/huggingface/transformers/pull/22273",
    group="checkpoints",
)
def _cpu_resume(original: Callable[..., Any]) -> Callable[..., Any]:
    def _load_optimizer_and_scheduler(self: Any, checkpoint: str | None) -> None:
        if checkpoint is None or not _indexed_cpu_device(self) or self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return original(self, checkpoint)
        import torch

        optimizer, scheduler = Path(checkpoint) / "optimizer.pt", Path(checkpoint) / "scheduler.pt"
        if optimizer.is_file() and scheduler.is_file():
            self.optimizer.load_state_dict(torch.load(optimizer, map_location="cpu", weights_only=True))
            self.lr_scheduler.load_state_dict(torch.load(scheduler, map_location="cpu", weights_only=True))

    return _load_optimizer_and_scheduler
