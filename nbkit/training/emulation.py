"""`nbkit.emulate("T4")`: make a larger GPU behave like a smaller one, as far as software can.

Kaggle's 2x T4 is where most users of nbkit train: sm_75, 15 GiB usable per card, fp16 only (no bf16,
no FlashAttention), PCIe. A profile reproduces on an H100/H200 what a T4 refuses or runs out of:

- memory: each process may allocate at most `memory_gib` (torch's per-process memory fraction,
  set when the process first initialises CUDA, so that calling this in the notebook process
  creates no CUDA context there);
- precision: `nbkit.precision()` answers the profile's ("fp16"), and `torch.cuda.is_bf16_supported()`
  says False (a patch of group "emulate"), which is what transformers, TRL and unsloth ask before
  choosing bf16;
- kernels: flash (and cuDNN) scaled-dot-product attention off, TF32 matmuls off, as on sm_75;
- planning: `nbkit.plan` plans for the profile's memory and its GPU (FLOP rate, name).

It cannot make the GPU slower, run sm_75 kernels (a library that picks kernels by compute capability
still sees the real GPU) or put PCIe between the GPUs: timings under a profile are not a T4's, and
the profile says so once when it is switched on.

`emulate()` also sets NBKIT_EMULATE in os.environ, so every process nbkit starts (and any process
started from this one) inherits it; `nbkit.rank_side.setup.prepare_rank()` applies the named profile in
each rank. `emulate(None)` undoes everything in this process.

The module is `nbkit.emulation`, not `nbkit.emulate`: importing a submodule of that name would set
`nbkit.emulate` to the module and hide the function. `nbkit.emulate.PROFILES` is the table below,
attached to the function.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbkit.platform import config, notices, patching
from nbkit.platform.errors import EmulationError

__all__ = ["ENV", "PROFILES", "Profile", "active", "apply_from_env", "emulate", "lookup", "usable_bytes"]

ENV = config.EMULATE

_log = notices.logger(__name__)


@dataclass(frozen=True)
class Profile:
    """What a GPU model allows, as far as software can impose it on a larger GPU.

    Attributes:
        name: the profile's name, as emulate() and NBKIT_EMULATE take it.
        gpu: the GPU's name as nvidia-smi reports it (the planner reads its FLOP rate from it).
        memory_gib: what one process may allocate on it.
        precision: the training precision nbkit.precision() answers ("fp16" where there is no bf16).
        bf16: whether torch.cuda.is_bf16_supported() may say True.
        flash_attention: whether flash / cuDNN scaled-dot-product attention may run.
        tf32: whether fp32 matmuls may use TF32 tensor cores.
        cannot: what the profile does not reproduce (logged once when it is switched on).
    """

    name: str
    gpu: str
    memory_gib: float
    precision: str
    bf16: bool
    flash_attention: bool
    tf32: bool
    cannot: tuple[str, ...]


PROFILES: dict[str, Profile] = {
    "T4": Profile(
        name="T4",
        gpu="Tesla T4",
        # 16 GB on the box; Kaggle and Colab report 15 GiB of it to torch.
        memory_gib=15.0,
        precision="fp16",
        bf16=False,
        flash_attention=False,
        tf32=False,
        cannot=(
            "speed (a T4 has about 1/15 of an H100's 16-bit FLOP/s and 1/10 of its memory bandwidth)",
            "sm_75 kernels (libraries that choose kernels by compute capability still see this GPU)",
            "PCIe between the GPUs (NCCL uses this machine's links)",
            "the CUDA context's own memory (outside the 15 GiB the allocator may use)",
        ),
    ),
}


def active() -> Profile | None:
    """The profile NBKIT_EMULATE names in this process, or None when it is unset or empty.

    Raises:
        EmulationError: NBKIT_EMULATE names no profile.
    """
    name = config.emulated()
    return lookup(name) if name else None


def emulate(profile: str | None) -> Profile | None:
    """Make this process, and every process nbkit starts from it, behave like the named GPU.

    Safe in the notebook process before launching: it creates no CUDA context (the memory cap waits
    for CUDA's initialisation). Calling it again with another name switches; None undoes it here and
    removes NBKIT_EMULATE (ranks already running keep their profile).

    Args:
        profile: a name from PROFILES ("T4"), case-insensitive, or None.

    Returns:
        The Profile now in effect, or None.

    Raises:
        EmulationError: for a name that is not in PROFILES; nothing changes then.
    """
    if profile is None:
        _undo()
        os.environ.pop(ENV, None)
        return None
    chosen = lookup(profile)
    _undo()
    os.environ[ENV] = chosen.name
    _apply(chosen)
    return chosen


emulate.PROFILES = PROFILES  # type: ignore[attr-defined]  # nbkit.emulate.PROFILES


def apply_from_env() -> Profile | None:
    """Apply the profile NBKIT_EMULATE names, if any (every rank nbkit starts calls this). Idempotent.

    Raises:
        EmulationError: NBKIT_EMULATE names no profile.
    """
    chosen = active()
    if chosen is not None and _state.profile != chosen:
        _undo()
        _apply(chosen)
    return chosen


def lookup(name: str) -> Profile:
    """The profile called `name` (case-insensitive); EmulationError naming the known ones otherwise."""
    for key, value in PROFILES.items():
        if key.lower() == str(name).strip().lower():
            return value
    raise EmulationError(
        f"nbkit has no GPU profile {name!r} to emulate; the profiles are {', '.join(PROFILES)} "
        f"(nbkit.emulate('T4'), or {ENV}=T4 in the environment). Unset {ENV} to train without one."
    )


def usable_bytes(device: Any) -> int | None:
    """The memory this process may use on `device`: the emulated GPU's under a profile, else the card's.

    Takes a torch.device (or anything torch.device() accepts). Returns None for a device that is not a
    CUDA GPU. The savers size their automatic chunks and shards from it, so that a T4 profile on an
    H100 chooses what a T4 would.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    profile = active()
    if profile is not None:
        return int(profile.memory_gib * 2**30)
    return int(torch.cuda.get_device_properties(device).total_memory)


# ---------------------------------------------------------------------------------------------
# Switching a profile on and off in this process


@dataclass
class _State:
    profile: Profile | None = None
    restore: list[Callable[[], None]] | None = None
    queued: bool = False  # the memory cap waits for CUDA's initialisation in this process
    logged: bool = False


_state = _State()


@patching.patch(
    "torch.cuda:is_bf16_supported",
    reason="under a GPU profile without bf16 (nbkit.emulate('T4')), libraries that ask torch whether bf16 "
    "works (transformers, TRL, unsloth choose their dtype from it) must hear no, as on the emulated GPU",
    upstream="no upstream change wanted: torch reports the real GPU; only the emulation says otherwise",
    group="emulate",
)
def _no_bf16(original: Callable[..., bool]) -> Callable[..., bool]:
    def is_bf16_supported(*args: Any, **kwargs: Any) -> bool:
        return False

    return is_bf16_supported


def _apply(profile: Profile) -> None:
    import torch

    restore: list[Callable[[], None]] = []
    if not profile.bf16:
        patching.apply("emulate")
        restore.append(lambda: patching.revert("emulate"))
    cuda = torch.backends.cuda
    if not profile.flash_attention:
        flash, cudnn_sdp = cuda.flash_sdp_enabled(), cuda.cudnn_sdp_enabled()
        cuda.enable_flash_sdp(False)
        cuda.enable_cudnn_sdp(False)
        restore.append(lambda: cuda.enable_flash_sdp(flash))
        restore.append(lambda: cuda.enable_cudnn_sdp(cudnn_sdp))
    if not profile.tf32:
        matmul, conv = cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        restore.append(lambda: _set_tf32(matmul, conv))
    restore.append(_uncap_memory)
    restore.extend(_fixes_for(profile))
    _state.profile, _state.restore = profile, restore
    if torch.cuda.is_initialized():
        _cap_memory()
    elif not _state.queued:
        # torch.cuda._lazy_call runs the cap when this process initialises CUDA: setting it now would
        # create a CUDA context in the notebook process, which must stay fork-safe until it launches.
        _state.queued = True
        torch.cuda._lazy_call(_cap_memory)
    if not _state.logged:
        _state.logged = True
        _log.warning(_notice(profile))


def _notice(profile: Profile) -> str:
    """What nbkit says once when a profile goes on: what it emulates, or, where no GPU is visible, that CPU
    ranks train as they would without it (fp32: saying "fp16" there would promise what cannot hold).
    """
    import torch

    if torch.cuda.device_count() == 0:  # NVML's count where it can: no CUDA context in the notebook
        return (
            f"nbkit: the {profile.name} profile is on (NBKIT_EMULATE) for ranks on GPUs; no GPU is visible here, so "
            "CPU ranks train as they would without it (fp32, no memory cap)."
        )
    kernels = "no flash attention, no TF32" if not profile.flash_attention else "flash attention"
    return (
        f"nbkit: emulating a {profile.gpu}: {profile.memory_gib:.0f} GiB per process, {profile.precision}, "
        f"{'no bf16' if not profile.bf16 else 'bf16'}, {kernels}. Not emulated: {'; '.join(profile.cannot)}."
    )


def _fixes_for(profile: Profile) -> list[Callable[[], None]]:
    """Apply here nbkit's fixes for what the profile's GPU lacks; returns how to revert those applied now.

    Every rank nbkit starts has them (nbkit.rank_side.setup.prepare_rank); a process that trains itself
    under the profile (accelerate's notebook_launcher with one GPU runs the function in place, or a
    plain script) did not: on an H100 under the T4 profile it ran transformers' grouped-query
    attention in the math kernel and ran out of the 15 GiB at 16K tokens (allocating 16 GiB), where
    the same model in a launched rank trained at 64K. Groups applied before stay as they are.
    """
    # The modules that declare the two groups (nbkit.platform.patch_groups.GROUPS names them), imported here and not
    # through patch_groups.install: the rank set-up (nbkit.rank_side.setup) imports this module.
    from nbkit.training import attention, mixed_precision  # noqa: F401  (declares the groups' patches)

    reverts: list[Callable[[], None]] = []
    for group, lacking in (("attention", not profile.flash_attention), ("mixed_precision", not profile.bf16)):
        if lacking and not (patching.applied(group) or patching.pending(group)):
            patching.apply(group)
            reverts.append(functools.partial(patching.revert, group))
    return reverts


def _set_tf32(matmul: bool, conv: bool) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = conv


def _cap_memory() -> None:
    """Cap every visible GPU at the profile's memory (none while no profile is on)."""
    import torch

    _state.queued = False
    if _state.profile is None:
        return
    for index in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = min(1.0, _state.profile.memory_gib * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, index)


def _uncap_memory() -> None:
    import torch

    if torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(1.0, index)


def _undo() -> None:
    for step in reversed(_state.restore or []):
        step()
    _state.profile, _state.restore = None, None
