"""The errors nbkit raises on purpose: one family, each with structured fields.

Every error here derives from NbkitError, so `except nbkit.NbkitError` catches all of them, and each
also derives from the built-in type code outside nbkit already expects (LaunchError is a
RuntimeError, DeviceMapError a ValueError), so existing `except RuntimeError` blocks keep working.

Messages say what happened and what to do. In IPython, `_render_traceback_` shows the message
alone: it already holds what the user needs (for a LaunchError, the failing rank's traceback), and
the frames of nbkit's own plumbing in the notebook would add nothing.

This module imports nothing from nbkit, so every other module can import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "BackendError",
    "BringAlongError",
    "CellSyntaxError",
    "CheckpointError",
    "DatasetArgumentError",
    "DatasetError",
    "DeviceMapError",
    "EmulationError",
    "ExportError",
    "GradientError",
    "InstallError",
    "KernelsError",
    "LaunchError",
    "LiveError",
    "NbkitError",
    "OptionTypeError",
    "OptionsError",
    "ProcessGroupError",
    "RankError",
    "RanksError",
    "StrategyError",
]


class NbkitError(Exception):
    """The base of every error nbkit raises on purpose."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows in place of a traceback: the error's name and its message."""
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


@dataclass
class RankError:
    """An exception raised inside a rank, as text (the exception object may not survive pickling).

    Attributes:
        rank: the global rank that raised.
        type: the exception's qualified class name.
        message: str(exception).
        traceback: the formatted traceback, starting in the user's code.
        time: when it was raised (time.time() in the rank).
        secondary: True for exceptions that a stop request caused (SIGTERM/SIGINT turned into
            exceptions), which are never the root cause of a failed run.
    """

    rank: int
    type: str
    message: str
    traceback: str
    time: float
    secondary: bool = False

    @property
    def lost_a_peer(self) -> bool:
        """True when the error says another process of the group went away mid-collective.

        Such an error is the symptom of another rank's end, never its cause: a launch whose rank
        died and whose peer's "Connection closed by peer" reached the notebook first still names the
        rank that died (a CI run on a loaded machine blamed the survivor before this was checked).
        """
        return any(marker in self.message for marker in _PEER_LOSS_MARKERS)


# What a collective raises in a rank whose peer process is gone: gloo's TCP transport (torch 2.13:
# "Connection closed by peer", or "Read error ...: Connection reset by peer" when the peer's socket
# was reset; "Broken pipe" when the rank was writing), and NCCL's async error handling.
_PEER_LOSS_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited or there was a network error",
    # NCCL (GPU ranks): the watchdog aborted this rank's communicator, or timed its collective out.
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
)


class LaunchError(NbkitError, RuntimeError):
    """A launched run failed.

    Attributes:
        failures: {rank: description} for every rank that failed first-hand (raised, or died).
        errors: the RankError of each rank that raised.
        timed_out: True when the run was stopped because `timeout` passed.
    """

    def __init__(
        self,
        message: str,
        *,
        failures: Mapping[int, str] | None = None,
        errors: Mapping[int, RankError] | None = None,
        timed_out: bool = False,
    ):
        super().__init__(message)
        self.failures = dict(failures or {})
        self.errors = dict(errors or {})
        self.timed_out = timed_out


class LiveError(LaunchError):
    """A call on a live set (nbkit.start) failed, or the set could not start or has ended.

    Attributes (besides LaunchError's):
        ended: True when the live set is gone (a rank died, a timeout, an unanswered interrupt):
            start a new one. False when a rank raised and every rank is still up with its names.
    """

    def __init__(
        self,
        message: str,
        *,
        failures: Mapping[int, str] | None = None,
        errors: Mapping[int, RankError] | None = None,
        timed_out: bool = False,
        ended: bool = False,
    ):
        super().__init__(message, failures=failures, errors=errors, timed_out=timed_out)
        self.ended = ended


class DeviceMapError(NbkitError, ValueError):
    """A device map that cannot work in this distributed run; the message says what to do instead."""


class BackendError(NbkitError, ValueError):
    """A step only the other training backend has (unsloth's merged and GGUF savers under transformers + peft);
    the message says what to do instead.
    """


class BringAlongError(NbkitError, ValueError):
    """A name a cell uses cannot be re-created in fresh processes.

    Attributes:
        name: that name.
    """

    def __init__(self, name: str, why: str):
        super().__init__(
            f"%%ddp in spawn mode cannot bring {name!r} along to the fresh processes: {why}. Create it inside "
            "the cell instead, or restart the kernel and run %%ddp before anything initialises CUDA (fork "
            "mode shares every name)."
        )
        self.name = name


class OptionsError(NbkitError, ValueError):
    """An option that does not fit (nbkit.launch, nbkit.start, nbkit.run_cell, a %%ddp line, export): the
    message names the option and what to pass.
    """


class OptionTypeError(OptionsError, TypeError):
    """An option of the wrong type (timeout="5", env="A=1"); a TypeError as well as an OptionsError."""


class RanksError(OptionsError):
    """`gpus` asks for ranks this machine cannot give: none asked for and no GPU visible, more GPUs than are
    visible, or more CPU processes than the limit. The message names the API's argument (gpus=N).

    Attributes:
        magic_text: the same in the words of the magics' option (--gpus N), for %ddp start and %%ddp.
    """

    def __init__(self, message: str, magic_text: str = ""):
        super().__init__(message)
        self.magic_text = magic_text or message


class EmulationError(OptionsError):
    """A GPU profile to emulate (`nbkit.emulate(name)`, NBKIT_EMULATE) that nbkit does not have; the
    message names the profiles it has.
    """


class ExportError(NbkitError, ValueError):
    """A notebook cell that cannot be exported as a script; the message names the cell and what to change."""


class InstallError(NbkitError, RuntimeError):
    """nbkit.bootstrap could not install: pip failed (the message holds pip's output)."""


class KernelsError(NbkitError, RuntimeError):
    """Fused kernels were asked for (`nbkit.savers.apply(model, kernels=...)`) where they cannot run: the
    model family is not supported, the model is not on a CUDA GPU, or the kernel library is missing. The
    message names which and what to do; the model is left as it was.
    """


class CellSyntaxError(NbkitError, ValueError):
    """Code for the ranks that does not parse, reported before anything starts.

    Not a SyntaxError subclass on purpose: IPython shows those with the full stack of the code
    that raised them (nbkit's own frames), where this error is one short message, the line with a
    caret and Python's reason.

    Attributes:
        msg: Python's reason ("'(' was never closed").
        lineno: the line, counted in the code the ranks would run (a %%ddp cell's body).
        offset: the column (1-based) Python points at, or None.
        text: the line's text.
        filename: the name the code was compiled under.
    """

    def __init__(self, error: SyntaxError):
        self.msg = error.msg
        self.lineno = error.lineno
        self.offset = error.offset
        self.text = error.text
        self.filename = error.filename
        line = (error.text or "").rstrip("\n")
        stripped = line.lstrip()
        caret = " " * max((error.offset or 1) - 1 - (len(line) - len(stripped)), 0) + "^"
        super().__init__(f"line {error.lineno} of the cell does not parse: {error.msg}\n    {stripped}\n    {caret}")


class CheckpointError(NbkitError, OSError):
    """A checkpoint to resume from that could not be brought into output_dir; the message says why."""


class StrategyError(NbkitError, ValueError):
    """What was asked cannot work with the ranks' training strategy (fsdp): unsloth under FSDP, merging a
    sharded model, sharding outside an fsdp rank. The message says what to do instead.
    """


class GradientError(NbkitError, RuntimeError):
    """A rank cannot average its gradients with the others' (nbkit.training.gradient_averaging): trainable weights
    without a gradient in a step; the message names them and what to do.
    """


class ProcessGroupError(NbkitError, RuntimeError):
    """A cell asked for a process group other than the default one nbkit set up for it (another backend);
    the message names both.
    """


class DatasetError(NbkitError, OSError):
    """A dataset that could not be loaded (or lacks the columns asked for); the message names it and what to check."""


class DatasetArgumentError(DatasetError, ValueError):
    """An argument of nbkit.data that cannot name rows or a split (a count below 1, a split with a slice);
    the message names the argument and what to pass.
    """
