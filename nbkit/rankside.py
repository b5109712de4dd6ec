"""What every rank gets and gives back, whichever way nbkit starts it (fork, spawn, live set).

Both sides of the process boundary use this module, each for its own part of one contract:

- notebook side, before anything starts: how many ranks (`count_ranks`: one count, one CPU limit,
  one message for nbkit.launch, %%ddp and nbkit.start alike) and the environment every rank gets
  (`rank_environment`: NBKIT_LAUNCHED, ACCELERATE_USE_CPU, GLOO_SOCKET_IFNAME, NBKIT_STRATEGY,
  NBKIT_EMULATE);
- rank side: rank 0's value pickled for the notebook (`pickle_for_notebook`: tensors on the CPU, so
  the notebook never initialises CUDA) and an exception as the traceback the user should see
  (`rank_traceback`: nbkit's own frames above the user's code left out);
- notebook side, afterwards: that value rebuilt (`load_value`), with one error, worded once, when it
  cannot be.

The rest of a rank's set-up is nbkit.integration.prepare_rank, which every path calls in the rank.
"""

from __future__ import annotations

import io
import numbers
import os
import pickle
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from nbkit.errors import LaunchError, RanksError

__all__ = [
    "STRATEGIES",
    "CpuPickler",
    "check_gpus",
    "check_strategy",
    "count_ranks",
    "cpu_rank_limit",
    "cpu_reduction",
    "load_value",
    "pickle_for_notebook",
    "rank_environment",
    "rank_traceback",
    "strategy_environment",
]

# How the ranks share the model: "ddp" (a full copy on every rank) or "fsdp" (sharded).
STRATEGIES = ("ddp", "fsdp")

_NBKIT_DIR = os.path.dirname(os.path.abspath(__file__))
# The files whose frames stand between a rank's entry point and the user's code in every path:
# the forked rank's wrapper, spawn mode's rank, the live rank's call, and running a cell.
_PLUMBING = frozenset(
    os.path.join(_NBKIT_DIR, *parts)
    for parts in (("launching.py",), ("spawning.py",), ("cells.py",), ("cellrun.py",), ("live", "engine.py"))
)


# --------------------------------------------------------------------------------------------
# Notebook side, before starting: how many ranks, and their environment
# --------------------------------------------------------------------------------------------


def check_gpus(gpus: Any) -> int | None:
    """`gpus` as an int, or None; raises ValueError for anything but a whole number >= 1 or None."""
    if gpus is None:
        return None
    if not isinstance(gpus, numbers.Integral) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"gpus must be a positive whole number or None (all visible GPUs); got {gpus!r}.")
    return int(gpus)


def check_strategy(strategy: Any) -> str:
    """`strategy` if it is one of STRATEGIES; ValueError naming them otherwise."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}; got {strategy!r}.")
    return str(strategy)


def cpu_rank_limit() -> int:
    """The most CPU ranks nbkit starts on a machine without CUDA: the CPU count, at least 8.

    CPU ranks exist to try training code on gloo before the GPUs (tests, CI); more ranks than
    cores only make every collective wait for a core. The floor of 8 keeps 4- and 8-rank tests
    possible on small CI machines. Without a limit a typo such as gpus=1000 forked 1000 processes
    (52 s and 14 GiB measured).
    """
    return max(8, os.cpu_count() or 1)


def count_ranks(gpus: Any, visible: Sequence[Any], *, api: str) -> tuple[bool, int]:
    """(whether the ranks use CUDA, how many ranks) for `gpus` on a machine showing `visible` GPUs.

    Takes `gpus` as the user gave it (None: one rank per visible GPU), the visible GPUs
    (distributed.visible_gpus(): [] without CUDA) and the call's name for the messages
    ("nbkit.launch", "nbkit.start"). Runs in the notebook process, before anything starts.

    Raises:
        ValueError: gpus is not a whole number >= 1.
        RanksError: gpus=None on a machine without a GPU, more GPUs than are visible, or, without a GPU,
            more CPU ranks than cpu_rank_limit() (its message names gpus=N, its `magic_text` --gpus N).
    """
    gpus = check_gpus(gpus)
    if not visible:
        if gpus is None:
            raise RanksError(
                f"No GPU is visible to this notebook, so {api}(gpus=None) has nothing to run on. {_NO_GPU_FIX} "
                "To try the code on the CPU, pass gpus=N: N CPU processes then train together over gloo.",
                f"No GPU is visible to this notebook, so there is nothing to start a rank on. {_NO_GPU_FIX} "
                "To try the code on the CPU, add --gpus N: N CPU processes then train together over gloo.",
            )
        if gpus > cpu_rank_limit():
            too_many = (
                f"would start {gpus} CPU processes (no GPU is visible), more than this machine's limit of "
                f"{cpu_rank_limit()} (its CPU count, at least 8)."
            )
            raise RanksError(
                f"gpus={gpus} {too_many} Use a smaller gpus=N to try the code on the CPU, or run on a machine "
                "with GPUs.",
                f"--gpus {gpus} {too_many} Use a smaller --gpus N to try the code on the CPU, or run on a "
                "machine with GPUs.",
            )
        return False, gpus
    if gpus is None:
        return True, len(visible)
    if gpus > len(visible):
        shown = f"this machine shows {len(visible)} ({', '.join(f'{g.index}: {g.name}' for g in visible)})"
        raise RanksError(
            f"Asked for {gpus} GPUs but {shown}. Use gpus={len(visible)} or gpus=None for all of them; "
            "CUDA_VISIBLE_DEVICES limits which ones are visible.",
            f"--gpus {gpus} asks for more GPUs than {shown}. Use --gpus {len(visible)}, or leave --gpus out for "
            "all of them; CUDA_VISIBLE_DEVICES limits which ones are visible.",
        )
    return True, gpus


_NO_GPU_FIX = "On Kaggle, choose Settings > Accelerator > GPU T4 x2; on Colab, Runtime > Change runtime type."


def rank_environment(
    *,
    use_cpu: bool,
    strategy: str = "ddp",
    emulate: str | None = None,
    extra: Mapping[str, str] | None = None,
    loopback: bool = True,
) -> dict[str, str]:
    """The environment variables nbkit gives every rank (on top of torchrun's RANK, WORLD_SIZE, ...).

    NBKIT_LAUNCHED=1 (nbkit's code in the rank knows it is one); NBKIT_STRATEGY (`strategy`) and
    NBKIT_EMULATE (`emulate`, when given) for what the ranks do with them. Without CUDA
    (`use_cpu`): ACCELERATE_USE_CPU=true, so accelerate, transformers' Trainer and TRL run real gloo
    DDP across the processes instead of N independent runs, and, where the ranks meet on this
    machine (`loopback`) under Linux, GLOO_SOCKET_IFNAME=lo unless this process sets it already.
    `extra` (the user's env=) comes last and wins. Computed in the notebook process; fork mode sets
    it before forking, a live rank applies it to itself.
    """
    values = {"NBKIT_LAUNCHED": "1", **strategy_environment(strategy, emulate)}
    if use_cpu:
        values["ACCELERATE_USE_CPU"] = "true"
        if loopback and sys.platform.startswith("linux"):
            values["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    values.update(extra or {})
    return values


def strategy_environment(strategy: str = "ddp", emulate: str | None = None) -> dict[str, str]:
    """NBKIT_STRATEGY and (when `emulate` is given) NBKIT_EMULATE: the part of rank_environment that
    ranks of an outside launcher (torchrun running an exported script) get too, from nbkit.launch
    in the rank. Raises ValueError for a strategy not in STRATEGIES, EmulationError (a ValueError) for
    a profile nbkit.emulation does not have.
    """
    values = {"NBKIT_STRATEGY": check_strategy(strategy)}
    if emulate is not None:
        # Checked here, before any process starts, so a misspelt profile fails in the notebook.
        from nbkit.emulation import lookup

        values["NBKIT_EMULATE"] = lookup(emulate).name
    return values


# --------------------------------------------------------------------------------------------
# Rank side: what goes back to the notebook
# --------------------------------------------------------------------------------------------


def pickle_for_notebook(value: Any) -> bytes:
    """Rank 0's return value pickled for the notebook, every tensor moved to the CPU.

    Raises TypeError (saying what to return instead) when the value cannot be pickled.
    """
    buf = io.BytesIO()
    try:
        CpuPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception as exc:
        raise TypeError(
            f"Rank 0's return value ({type(value).__name__}) cannot be sent back to the notebook: {exc}. "
            "Return plain data (numbers, strings, dicts, lists, CPU tensors) or save large objects to disk "
            "and return the path."
        ) from exc
    return buf.getvalue()


class CpuPickler(pickle.Pickler):
    """Pickles tensors from any device as CPU tensors, so unpickling never initialises CUDA."""

    def reducer_override(self, obj: Any) -> Any:
        """A tensor's CPU copy (cpu_reduction); anything else pickled as usual."""
        return cpu_reduction(obj)


def cpu_reduction(obj: Any) -> Any:
    """For a tensor on an accelerator, the pickle reduction of its CPU copy; NotImplemented for
    anything else (a pickler's reducer_override then pickles it as usual).
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
        return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return NotImplemented


def rank_traceback(exc: BaseException) -> str:
    """`exc`'s formatted traceback from the user's code on: nbkit's frames above it are left out
    (all of them kept when nothing else is there: an error of nbkit's own plumbing, whose frames say
    where, unless the error sets `nbkit_says_it_all`, whose message is the whole story). Runs in the rank.
    """
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _PLUMBING:
        tb = tb.tb_next
    if tb is None and not getattr(exc, "nbkit_says_it_all", False):
        tb = exc.__traceback__
    return "".join(traceback.format_exception(type(exc), exc, tb))


# --------------------------------------------------------------------------------------------
# Notebook side, afterwards: the value rebuilt
# --------------------------------------------------------------------------------------------


def load_value(payload: bytes, rank: int = 0, *, error: type[LaunchError] = LaunchError) -> Any:
    """Rebuild a rank's value from pickle_for_notebook's bytes, in the notebook process.

    Raises `error` (LaunchError, or LiveError for a live set) saying why and what to return instead
    when it cannot be rebuilt, typically a class that exists on the ranks only.
    """
    try:
        return pickle.loads(payload)
    except Exception as exc:
        raise error(
            f"Rank {rank}'s value came back but cannot be rebuilt in the notebook ({type(exc).__name__}: {exc}); "
            "a class defined in a %%ddp cell or inside the launched function exists on the ranks only. Return "
            "plain data (numbers, strings, lists, dicts, tensors), or keep the object on the ranks (a live set: "
            "use it in later %%ddp cells)."
        ) from None
