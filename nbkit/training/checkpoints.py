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

A session's files can also come back from elsewhere: `resume_point(output_dir, previous=...)`
also looks at a previous run's output attached read-only (Kaggle: a saved version's output added
as input, /kaggle/input/...; Colab: a folder on the mounted Drive), and on Kaggle it looks under
/kaggle/input by itself. When the newest complete checkpoint is there, it is copied into
output_dir first (into a temporary folder next to the checkpoints, then renamed: a copy cut off
half-way is never taken for a checkpoint). `hub_mirror(repo_id)` gives the TrainingArguments that
make Trainer itself push each checkpoint to the Hugging Face hub (`hub_strategy="checkpoint"`),
and `resume_point(output_dir, hub=repo_id)` downloads that `last-checkpoint` when nothing
complete exists locally or in the previous outputs.

Resuming a run of several CPU processes (nbkit.launch(gpus=N) without GPUs, as in CI) fails in
transformers itself when it loads the optimizer; the third patch here fixes that.

Inside nbkit.launch every Trainer gets the marker automatically (`enable()` runs in each rank).
A notebook that trains without launching (one process, a model split over GPUs) calls
`nbkit.checkpoints.enable()` once before creating its Trainer; `nbkit.checkpoints.disable()` (or
`nbkit.uninstall("checkpoints")`) undoes it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from nbkit.platform import distributed, host, notices, patching
from nbkit.platform.errors import CheckpointError
from nbkit.training import callbacks

__all__ = [  # noqa: F822 (names built on first use, see __getattr__)
    "MARKER",
    "CheckpointMarker",
    "disable",
    "enable",
    "hub_mirror",
    "is_complete",
    "resume_point",
]  # CheckpointMarker: built on first use

MARKER = "nbkit-complete.json"
_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
_STEP = re.compile(rf"^{_PREFIX}-(\d+)$")
# Copies and downloads in progress, in output_dir: a name that neither nbkit nor transformers
# (which globs "checkpoint-*") takes for a checkpoint.
_PARTIAL = ".nbkit-partial-"
_HUB_FOLDER = "last-checkpoint"  # where Trainer's hub_strategy="checkpoint" pushes the newest checkpoint


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


def resume_point(
    output_dir: str | os.PathLike[str],
    previous: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] | None = None,
    *,
    hub: str | None = None,
) -> str | None:
    """The checkpoint to resume training from: the newest complete one, or None.

    Looks in `output_dir`, then in the previous runs' outputs: `previous` (a path or glob, or
    several; each a run's output folder holding checkpoint-N folders, or a checkpoint-N folder
    itself; read-only is fine) and, on Kaggle (as nbkit.platform.host tells it, where /kaggle/input
    exists), the attached inputs: /kaggle/input/*/REL and /kaggle/input/*/*/REL, where REL is
    output_dir relative to the working directory (outputs/run for /kaggle/working/outputs/run),
    and checkpoint-N folders directly in /kaggle/input/*. The newest complete checkpoint of all
    wins (output_dir's own on a tie). One found elsewhere is first copied into output_dir (a
    temporary folder there, renamed to checkpoint-N once the copy is whole; a copy cut off
    half-way never counts and is removed by the next copy). With `hub` (a repo id) and no
    complete checkpoint anywhere else, the repo's `last-checkpoint` folder (what Trainer pushes
    with `hub_mirror(hub)`) is downloaded into output_dir the same way; a repo that does not exist
    yet means no checkpoint.

    Pass the result to `trainer.train(resume_from_checkpoint=...)`: None starts fresh. Prints one
    line (on the main rank only) saying which checkpoint and step training resumes from and where
    it came from, or that it starts fresh, and names the half-written checkpoints it skipped.
    Deletes no complete checkpoint (only a half-written checkpoint-N in output_dir that a copy of
    step N replaces); returns the same answer on every rank (a copy is made once: ranks take turns
    through a lock on output_dir, and the later ones find it). A missing output_dir means
    no checkpoint there. Raises CheckpointError when the hub cannot be read (other than a repo
    that does not exist: starting fresh then would push over the mirrored checkpoint), or when a
    checkpoint changed while it was copied.
    """
    root = Path(output_dir)
    found = [(step, path, is_complete(path)) for step, path in _checkpoints(root)]
    complete = [(_step(path), path) for _, path, ok in found if ok]
    local = max(complete, key=lambda c: c[0]) if complete else None
    source = _newest_elsewhere(root, previous)
    origin = ""
    if source is not None and (local is None or source[0] > local[0]):
        local, origin = _copied_in(root, *source), f", copied from {source[1].parent}"
    elif local is None and hub is not None:
        local = _downloaded(root, hub)
        origin = f", downloaded from {hub}/{_HUB_FOLDER} on the hub" if local is not None else ""
    newer_unmarked = [path.name for step, path, ok in found if not ok and (local is None or step > local[0])]
    if local is not None:
        line = f"nbkit: resuming from {local[1].name} (step {local[0]}) in {output_dir}{origin}."
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
        notices.logger(__name__).info(line)
    return str(local[1]) if local is not None else None


def hub_mirror(repo_id: str, *, private: bool = True) -> dict[str, Any]:
    """TrainingArguments keywords that make Trainer mirror each checkpoint to the hub repo `repo_id`.

    `TrainingArguments(..., **nbkit.checkpoints.hub_mirror("you/run-name"))`: Trainer itself
    (rank 0, in the background) pushes every checkpoint it saves to the repo's `last-checkpoint`
    folder and the final model to the repo's top level, creating the repo (private unless
    `private=False`) on first use. It needs a write token: HF_TOKEN in the environment, or
    huggingface_hub.login(); on Kaggle and Colab, read it from the platform's secrets. Resume from
    it with `resume_point(output_dir, hub="you/run-name")`. Returns a new dict; touches nothing.
    """
    return {"push_to_hub": True, "hub_model_id": repo_id, "hub_strategy": "checkpoint", "hub_private_repo": private}


def _step(checkpoint: Path) -> int:
    """The global step a complete checkpoint's marker records."""
    marker = _read_marker(checkpoint)
    assert marker is not None  # only called for complete checkpoints
    return int(marker["global_step"])


def _newest_elsewhere(
    output_dir: Path, previous: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] | None
) -> tuple[int, Path] | None:
    """(step, folder) of the newest complete checkpoint in the previous outputs, or None."""
    places: list[str] = []
    if isinstance(previous, (str, os.PathLike)):
        places.append(os.fspath(previous))
    elif previous is not None:
        places.extend(os.fspath(p) for p in previous)
    kaggle = host.kaggle_input()
    if kaggle is not None:
        # Two levels at most: a third would list every folder of a large dataset's top folders.
        relative = _relative(output_dir)
        places += [str(kaggle / "*" / relative), str(kaggle / "*" / "*" / relative)]
        places.append(str(kaggle / "*"))
    best: tuple[int, Path] | None = None
    for place in places:
        for match in sorted(glob.glob(os.path.expanduser(place), recursive=True)) or [place]:
            folder = Path(match)
            candidates = [folder] if _STEP.match(folder.name) else [path for _, path in _checkpoints(folder)]
            for path in candidates:
                if is_complete(path) and (best is None or _step(path) > best[0]):
                    best = (_step(path), path)
    return best


def _relative(output_dir: Path) -> Path:
    """output_dir relative to the working directory (on Kaggle, /kaggle/working), else its last part."""
    absolute = Path(os.path.abspath(output_dir))
    try:
        return absolute.relative_to(Path.cwd())
    except ValueError:
        return Path(absolute.name)


@contextlib.contextmanager
def _copying(output_dir: Path) -> Iterator[bool]:
    """Hold an exclusive lock on output_dir while copying into it (made if missing).

    Yields whether the lock is held. Ranks call resume_point at the same time: the first copies,
    the others wait here and then find its copy. The lock is flock on the folder itself, so the
    system releases it when its holder dies, and no lock file is left behind. Where flock is
    missing or refused (Windows, some network file systems) it yields False and copies go ahead
    unlocked: each still lands whole or not at all.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    descriptor: int | None = None
    try:
        import fcntl

        descriptor = os.open(output_dir, os.O_RDONLY)
        fcntl.flock(descriptor, fcntl.LOCK_EX)
    except (ImportError, OSError):
        if descriptor is not None:
            os.close(descriptor)
            descriptor = None
    try:
        yield descriptor is not None
    finally:
        if descriptor is not None:
            os.close(descriptor)  # releases the lock


def _newest_local(output_dir: Path) -> tuple[int, Path] | None:
    complete = [(_step(path), path) for _, path in _checkpoints(output_dir) if is_complete(path)]
    return max(complete, key=lambda c: c[0]) if complete else None


def _copied_in(output_dir: Path, step: int, source: Path) -> tuple[int, Path]:
    """Copy the complete checkpoint `source` into output_dir as checkpoint-<step>; (step, its path).

    When another rank made the copy while this one waited for the lock, that copy is used.
    """
    with _copying(output_dir) as locked:
        local = _newest_local(output_dir)
        if local is not None and local[0] >= step:
            return local
        if locked:
            _remove_partial_copies(output_dir)
        staging = Path(tempfile.mkdtemp(prefix=_PARTIAL, dir=output_dir))
        try:
            # copyfile, not copy2: files from a read-only input must not stay read-only here, where
            # the rotation deletes old checkpoints; copytree still copies folders' modes, fixed below.
            shutil.copytree(source, staging, copy_function=shutil.copyfile, dirs_exist_ok=True)
            _make_writable(staging)
            if not is_complete(staging):
                raise CheckpointError(
                    f"The copy of {source} into {output_dir} is not whole: the checkpoint changed while it "
                    "was copied. Run again once nothing writes to it."
                )
            return step, _put_in_place(staging, output_dir / f"{_PREFIX}-{step}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already when it was put in place


def _downloaded(output_dir: Path, repo_id: str) -> tuple[int, Path] | None:
    """Download the hub repo's last-checkpoint folder into output_dir as checkpoint-<step>; None
    when the repo or the folder does not exist.

    The hub keeps each push as one commit, so a folder that downloaded whole is a whole
    checkpoint (Trainer pushes it after writing it); nbkit marks it complete here, since the push
    may have started before Trainer's marker was written.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError

    with _copying(output_dir) as locked:
        local = _newest_local(output_dir)
        if local is not None:
            return local
        if locked:
            _remove_partial_copies(output_dir)
        staging = Path(tempfile.mkdtemp(prefix=_PARTIAL, dir=output_dir))
        try:
            try:
                snapshot_download(repo_id, allow_patterns=[f"{_HUB_FOLDER}/*"], local_dir=staging)
            except RepositoryNotFoundError:
                return None
            except Exception as exc:
                raise CheckpointError(
                    f"Cannot read {repo_id}/{_HUB_FOLDER} from the hub ({type(exc).__name__}: {exc}). "
                    "Check the connection and the token (HF_TOKEN), then run again; to start fresh instead, "
                    "leave out hub= (Trainer will then push the new run's checkpoints over the mirrored one)."
                ) from exc
            return _adopt_download(staging / _HUB_FOLDER, output_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _adopt_download(folder: Path, output_dir: Path) -> tuple[int, Path] | None:
    """Mark a whole downloaded checkpoint folder complete and put it in place as checkpoint-<step>
    (its trainer_state.json's global_step); None when it holds no trainer_state.json.
    """
    try:
        step = int(json.loads((folder / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    _mark_complete(folder, step)
    return step, _put_in_place(folder, output_dir / f"{_PREFIX}-{step}")


def _put_in_place(staging: Path, target: Path) -> Path:
    """Rename the whole copy `staging` to `target` (same folder, so atomic), after syncing it to
    disk. A half-written checkpoint already at `target` (same step, never marked) is set aside and
    deleted: the copy replaces it.
    """
    for path in sorted(staging.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    if target.exists():
        aside = Path(tempfile.mkdtemp(prefix=_PARTIAL, dir=target.parent))
        os.rename(target, aside / target.name)
        os.rename(staging, target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(staging, target)
    _fsync_dir(target.parent)
    return target


def _make_writable(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        if path.is_dir():
            path.chmod(path.stat().st_mode | stat.S_IWUSR | stat.S_IRUSR | stat.S_IXUSR)


def _remove_partial_copies(output_dir: Path) -> None:
    """Delete copies cut off half-way (their process died): called with the lock held, when no
    other copy can be in progress.
    """
    for path in output_dir.glob(f"{_PARTIAL}*"):
        shutil.rmtree(path, ignore_errors=True)


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
    "patched by nbkit.rank_side.reporting, and one attribute carries one patch)",
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
