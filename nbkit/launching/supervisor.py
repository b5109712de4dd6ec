"""How nbkit tells what happened to ranks it watches: one story for fork, spawn and live sets.

Runs in the process that watches the ranks (the notebook, or spawn mode's launcher process), never
in a rank. One cause gets the same words and the same advice whichever way the rank was started:

- how a process ended (`ExitStatus`: an exit code or a signal; its `cause` line and its `hint`),
  read without reaping (`exit_status`) or from a Popen return code (`ExitStatus.from_returncode`);
- errors whose text nbkit recognises (`FAILURE_HINTS`), added to any message that shows them;
- the text for a run that hangs in a collective (`hang_hint`);
- a list of rank failures rendered for a LaunchError / LiveError (`render_failures`);
- probing and signalling processes by pid (`pid_alive`, `kill`);
- stopping processes: ask, wait a grace period, then SIGKILL (`stop`), the one way every part of
  nbkit ends the processes it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from nbkit.platform.errors import RankError

__all__ = ["FAILURE_HINTS", "ExitStatus", "exit_status", "hang_hint", "kill", "pid_alive", "render_failures", "stop"]

# What a GPU rank's collective ends with when NCCL's watchdog stopped it (rankside.nccl_environment).
_NCCL_ADVICE = (
    "NCCL's watchdog ended the rank: one of its collectives (all-reduce, barrier, broadcast) waited for "
    "a peer past the process group's timeout, or NCCL failed. Look at what the other ranks did at that "
    "step: a rank that died or raised first is the cause; a rank that skipped a collective or ran a "
    "different number of steps leaves its peers waiting. Where one rank legitimately takes longer (saving "
    "a checkpoint on rank 0 only), give the others a longer timeout: nbkit.configure(nccl_timeout=SECONDS) "
    "before starting a live set, TrainingArguments(ddp_timeout=SECONDS) for Trainer."
)

# (text in a rank's error, what it means and what to do): added to the message of such a failure.
FAILURE_HINTS = (
    (
        "Cannot re-initialize CUDA in forked subprocess",
        "The notebook process touched the CUDA driver before launching (torch.cuda.is_available() "
        "or device_count() before `import nbkit`, or a library that queries the GPU on import), so "
        "forked ranks cannot use CUDA. Import nbkit first in the notebook, or restart the kernel and "
        "keep GPU work inside the launched function; %%ddp can start fresh processes instead.",
    ),
    (
        "Expected to have finished reduction in the prior iteration",
        "DDP found trainable weights that got no gradient in a step. A common cause is a VLM's "
        "LoRA'd vision tower on a batch without images; others are experts a step does not route to, "
        "or outputs the loss does not use. Train only what every batch uses (unsloth: "
        "get_peft_model(..., finetune_vision_layers=False) for text-only data), or give every batch an "
        "image. With unsloth vision models nbkit keeps unsloth's faster single-GPU checkpointing, which "
        "needs this; nbkit.configure(unsloth_vlm_ddp_checkpointing='unsloth') before loading the model "
        "trains such data with unsloth's slower DDP checkpointing instead.",
    ),
    (
        "CUDA out of memory",
        "A rank ran out of GPU memory (the others were stopped with it): train with a smaller "
        "per_device_train_batch_size or max_seq_length (gradient accumulation keeps the effective batch), "
        "gradient checkpointing, or the model in 4-bit; nbkit.plan(model, gpus=N, seq_len=...) estimates "
        "what fits.",
    ),
    ("Watchdog caught collective operation timeout", _NCCL_ADVICE),
    ("NCCL communicator was aborted", _NCCL_ADVICE),
    ("ProcessGroupNCCL's watchdog got stuck", _NCCL_ADVICE),
)

_CRASH_SIGNALS = {getattr(signal, name) for name in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE")}


@dataclass(frozen=True)
class ExitStatus:
    """How a rank process ended: an exit code, a signal, or unknown (its status was collected by
    someone else before nbkit looked, e.g. torch elastic).

    str() is the one-shot wording ("died from signal SIGKILL", "exited with code 3 without returning
    from the function"); `cause` the same without the function ("exited with code 3"); `hint` what
    it usually means and what to do. All three are the same for fork, spawn and live sets.
    """

    code: int | None = None
    signal: int | None = None

    @classmethod
    def from_returncode(cls, returncode: int | None) -> ExitStatus:
        """The status of a subprocess.Popen return code (negative: the signal that ended it)."""
        if returncode is not None and returncode < 0:
            return cls(signal=-returncode)
        return cls(code=returncode)

    @property
    def cause(self) -> str:
        """How it ended, in a few words: "died from signal SIGKILL", "exited with code 3", "ended"."""
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = str(self.signal)
            return f"died from signal {name}"
        if self.code is not None:
            return f"exited with code {self.code}"
        return "ended"

    def __str__(self) -> str:
        if self.signal is not None:
            return self.cause
        if self.code is not None:
            return f"{self.cause} without returning from the function"
        return "ended without returning from the function"

    @property
    def hint(self) -> str:
        """What this way of ending usually means, and what to do."""
        if self.signal == signal.SIGKILL:
            return (
                "SIGKILL, unless someone killed the process by hand, usually means the machine ran out of CPU "
                "memory (the OOM killer): use a smaller batch or fewer dataloader workers."
            )
        if self.signal in _CRASH_SIGNALS:
            crash = (
                "A crash in native code (a C/C++/CUDA extension, or a library built for another CPU or "
                "driver); the rank's own output shows where, when Python's fault handler got to print."
            )
            if self.signal == signal.SIGABRT:  # how NCCL's watchdog ends a GPU rank
                return f"{crash} On GPUs, SIGABRT may instead mean that {_NCCL_ADVICE}"
            return crash
        if self.signal is not None:
            return "The signal came from outside the rank's code: another program, or the machine, stopped the rank."
        return (
            "The process ended without returning or raising: something called os._exit() or exited the "
            "process from native code. Return from the function (or raise) instead."
        )


def exit_status(pid: int) -> ExitStatus | None:
    """How child process `pid` ended, or None while it runs. Never reaps it: whoever started it (torch
    elastic) still collects its status (os.waitid with WNOWAIT reads it and leaves it there).
    """
    if not hasattr(os, "waitid"):  # macOS: alive or not, nothing more
        return None if pid_alive(pid) else ExitStatus()
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # collected already (or not ours): it has ended, the status is gone
        return ExitStatus()
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return ExitStatus(code=info.si_status)
    return ExitStatus(signal=info.si_status)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not), for any process, child or not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
    except OSError:  # no /proc (macOS): fall back to a signal probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def kill(pid: int, sig: signal.Signals) -> None:
    """Send `sig` to `pid`; a process that is gone already is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


_K = TypeVar("_K", bound=Hashable)

# How often stop() looks whether the processes have ended: a waitpid or a /proc read each, cheap
# enough that a process that ends at once is seen within a few hundredths of a second.
_STOP_POLL_S = 0.02
# How long stop() waits for a SIGKILLed process to be gone. SIGKILL takes effect within milliseconds
# unless the process sits in an uninterruptible call in the kernel (a GPU driver call, a hung network
# file system), which ends only when that call returns: such a process is reported, not waited for
# forever, so the notebook stays usable.
_KILLED_WAIT_S = 10.0


# psutil.wait_procs does this waiting too, but psutil is no dependency of nbkit (of its tests only),
# and a loop of a few lines is all of it that stop() needs.
def stop(
    processes: Mapping[_K, int | subprocess.Popen],
    grace_s: float,
    *,
    first: signal.Signals | None = signal.SIGTERM,
) -> dict[_K, ExitStatus | None]:
    """Stop `processes` (each a pid or a subprocess.Popen, under a key of the caller's: a rank, a
    pid): send each that still runs `first`, wait up to `grace_s` seconds for all of them together,
    then SIGKILL those still running. `first=None`: they are ending by themselves (nothing is sent
    before the SIGKILL); `grace_s=0`: SIGKILL at once.

    Returns how each ended, under its key in `processes`' order: its ExitStatus (the signal that
    ended it, or its exit code); ExitStatus() where the status is not ours to read (a process that
    is not a child of this one, or that its owner collected first); None for one still running
    _KILLED_WAIT_S after SIGKILL (stuck in the kernel, see there). Collects (reaps) every child it
    reports on, so none is left as a zombie: a Popen through the Popen (its returncode is set), a
    child given by pid with waitpid (pass a pid only where nobody else needs its status). A process
    that ended before the call is reported, never signalled. Never raises for a process that is gone.
    """
    ended: dict[_K, ExitStatus | None] = {}
    running: dict[_K, int | subprocess.Popen] = {}
    for key, proc in processes.items():
        status = _collected(proc)
        if status is None:
            running[key] = proc
        else:
            ended[key] = status
    if first is not None and grace_s > 0:
        for proc in running.values():
            _send(proc, first)
    _wait(running, ended, grace_s)
    for proc in running.values():
        _send(proc, signal.SIGKILL)
    _wait(running, ended, _KILLED_WAIT_S)
    ended.update(dict.fromkeys(running))
    return {key: ended[key] for key in processes}


def _wait(running: dict[_K, int | subprocess.Popen], ended: dict[_K, ExitStatus | None], seconds: float) -> None:
    """Move the processes of `running` that end within `seconds` (at least one look) to `ended`."""
    deadline = time.monotonic() + seconds
    while True:
        for key, proc in list(running.items()):
            status = _collected(proc)
            if status is not None:
                ended[key] = status
                del running[key]
        if not running or time.monotonic() >= deadline:
            return
        time.sleep(_STOP_POLL_S)


def _send(proc: int | subprocess.Popen, sig: signal.Signals) -> None:
    if isinstance(proc, subprocess.Popen):
        # Popen.send_signal signals no process it has collected (whose pid may be another's by now)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    else:
        kill(proc, sig)


def _collected(proc: int | subprocess.Popen) -> ExitStatus | None:
    """How `proc` ended, collecting it if it is a child of this process; None while it runs."""
    if isinstance(proc, subprocess.Popen):
        returncode = proc.poll()
        return None if returncode is None else ExitStatus.from_returncode(returncode)
    try:
        pid, status = os.waitpid(proc, os.WNOHANG)
    except ChildProcessError:  # not our child, or collected by its owner: alive or not is all we can tell
        return None if pid_alive(proc) else ExitStatus()
    if pid == 0:
        return None
    return ExitStatus.from_returncode(os.waitstatus_to_exitcode(status))


def hang_hint(cause: str = "") -> str:
    """The sentence for a run stopped while a rank still ran: `cause` when the caller knows a likelier
    one (a call on some ranks only), else the usual one.
    """
    return "A rank that waits in a collective (all-reduce, barrier) for a peer that never arrives hangs like this: " + (
        cause or "check that every rank runs the same steps on the same number of batches."
    )


def failure_hints(errors: Iterable[RankError]) -> list[str]:
    """The FAILURE_HINTS whose text appears in any of `errors`, in FAILURE_HINTS' order."""
    messages = [e.message for e in errors]
    return [hint for marker, hint in FAILURE_HINTS if any(marker in m for m in messages)]


def render_failures(failures: Mapping[int, RankError | ExitStatus], errors: Iterable[RankError] = ()) -> list[str]:
    """The lines under a failure message's head: the hints for known errors (of `failures` and of
    `errors`, the other ranks' errors), then one section per failed rank, in `failures`' order:
    "[rank N] Type: message" and its traceback, or "[rank N] how it ended" and what that means.
    """
    raised = [f for f in failures.values() if isinstance(f, RankError)]
    lines = failure_hints([*raised, *errors])
    for rank, failure in failures.items():
        if isinstance(failure, RankError):
            lines.append(f"\n[rank {rank}] {failure.type}: {failure.message}")
            lines.append(failure.traceback.rstrip())
        else:
            lines.append(f"\n[rank {rank}] {failure}")
            lines.append(failure.hint)
    return lines
