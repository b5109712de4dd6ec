"""What every rank gets and gives back, whichever way nbkit starts it (fork, spawn, live set).

Both sides of the process boundary use this module, each for its own part of one contract:

- notebook side, before anything starts: how many ranks (`count_ranks`: one count, one CPU limit,
  one message for nbkit.launch, %%ddp and nbkit.start alike) and the environment every rank gets
  (`rank_environment`: NBKIT_LAUNCHED, ACCELERATE_USE_CPU, GLOO_SOCKET_IFNAME, NBKIT_STRATEGY,
  NBKIT_EMULATE, and on GPUs torch's allocator settings and NCCL's error handling);
- rank side: rank 0's value pickled for the notebook (`pickle_for_notebook`: tensors on the CPU, so
  the notebook never initialises CUDA) and an exception as the traceback the user should see
  (`rank_traceback`: nbkit's own frames above the user's code left out);
- notebook side, afterwards: that value rebuilt (`load_value`), with one error, worded once, when it
  cannot be.

The rest of a rank's set-up is nbkit.rank_side.setup.prepare_rank, which every path calls in the rank.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nbkit.platform import config
from nbkit.platform.errors import LaunchError, RanksError

if TYPE_CHECKING:
    from nbkit.launching.rank_options import RankOptions

__all__ = [
    "ALLOC_CONF",
    "CpuPickler",
    "allocator_environment",
    "count_ranks",
    "cpu_rank_limit",
    "cpu_reduction",
    "load_value",
    "nccl_environment",
    "pickle_for_notebook",
    "rank_environment",
    "rank_traceback",
    "set_rank_threads",
]

# torch's caching-allocator settings: the variable torch reads first, and the one it reads where that is unset.
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
_ALLOC_CONF_FALLBACK = "PYTORCH_ALLOC_CONF"

_NBKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The files whose frames stand between a rank's entry point and the user's code in every path:
# the forked rank's wrapper, spawn mode's rank, the live rank's call, and running a cell.
_PLUMBING = frozenset(
    os.path.join(_NBKIT_DIR, *parts)
    for parts in (
        ("launching", "fork.py"),
        ("launching", "spawn.py"),
        ("notebook", "cell_code.py"),
        ("notebook", "run_cell.py"),
        ("rank_side", "cell_group.py"),
        ("rank_side", "live_engine.py"),
    )
)


# --------------------------------------------------------------------------------------------
# Notebook side, before starting: how many ranks, and their environment
# --------------------------------------------------------------------------------------------


def cpu_rank_limit() -> int:
    """The most CPU ranks nbkit starts on a machine without CUDA: the CPU count, at least 8.

    CPU ranks exist to try training code on gloo before the GPUs (tests, CI); more ranks than
    cores only make every collective wait for a core. The floor of 8 keeps 4- and 8-rank tests
    possible on small CI machines. Without a limit a typo such as gpus=1000 forked 1000 processes
    (52 s and 14 GiB measured).
    """
    return max(8, os.cpu_count() or 1)


def count_ranks(gpus: int | None, visible: Sequence[Any], *, api: str) -> tuple[bool, int]:
    """(whether the ranks use CUDA, how many ranks) for `gpus` on a machine showing `visible` GPUs.

    Takes `gpus` as RankOptions checked it (None: one rank per visible GPU), the visible GPUs
    (distributed.visible_gpus(): [] without CUDA) and the call's name for the messages
    ("nbkit.launch", "nbkit.start"). Runs in the notebook process, before anything starts.

    Raises:
        RanksError: gpus=None on a machine without a GPU, more GPUs than are visible, or, without a GPU,
            more CPU ranks than cpu_rank_limit() (its message names gpus=N, its `magic_text` --gpus N).
    """
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


def rank_environment(options: RankOptions, *, use_cpu: bool, loopback: bool = True) -> dict[str, str]:
    """The environment variables nbkit gives every rank (on top of torchrun's RANK, WORLD_SIZE, ...).

    NBKIT_LAUNCHED=1 (nbkit's code in the rank knows it is one); NBKIT_STRATEGY and NBKIT_EMULATE
    (`options.strategy_environment()`) for what the ranks do with them. Without CUDA (`use_cpu`):
    ACCELERATE_USE_CPU=true, so accelerate, transformers' Trainer and TRL run real gloo DDP across the
    processes instead of N independent runs, and, where the ranks meet on this machine (`loopback`)
    under Linux, GLOO_SOCKET_IFNAME=lo unless this process sets it already. With CUDA: NCCL's error
    handling (nccl_environment), so a collective that waits for a peer past the process group's timeout
    ends its rank instead of hanging, and torch's allocator settings with expandable segments
    (allocator_environment, merged into the user's). The user's `options.env` comes on top, but for the
    strategy and the profile, which RankOptions settled already. Computed in the notebook process; fork
    mode sets it around the fork only (the notebook's own environment is put back), a live rank applies
    it to itself before it first uses CUDA.
    """
    values = {"NBKIT_LAUNCHED": "1"}
    if use_cpu:
        values["ACCELERATE_USE_CPU"] = "true"
        if loopback and sys.platform.startswith("linux"):
            values["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    else:
        values.update(nccl_environment())
    values = {**values, **options.env_dict(), **options.strategy_environment()}
    if not use_cpu:
        values.update(allocator_environment({**os.environ, **values}))
    return values


def allocator_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The CUDA allocator settings (torch's) for a rank whose environment would be `environ`: expandable segments
    added to what is set there, or {} where nothing needs to change.

    Why: a rank that loads a model and then shards or frees most of it (FSDP's 4-bit loading, a
    checkpoint's temporary copies) leaves its cached memory in blocks too small for the next large
    buffer, and fails with most of its reserved memory free ("reserved but unallocated": 8.91 GiB of
    15 in a 2-GPU FSDP-QLoRA run, which trained with expandable segments). Segments that grow in
    place avoid that, for DDP as well (unsloth sets the same for its ranks).

    The settings given in `environ` are kept: PYTORCH_CUDA_ALLOC_CONF, or where that is unset
    PYTORCH_ALLOC_CONF (torch reads them in that order), gets ",expandable_segments:True" appended
    unless it names expandable_segments already, another allocator backend (cudaMallocAsync, whose
    own pool has no such option), or max_split_size_mb (the user's own answer to fragmentation; with
    expandable segments torch's allocator then lets reserved memory grow: pytorch issue 123548).
    Pure: reads only `environ`.
    """
    name = ALLOC_CONF if environ.get(ALLOC_CONF) is not None else _ALLOC_CONF_FALLBACK
    current = (environ.get(name) or "").strip()
    given: dict[str, str] = {}
    for item in current.split(","):
        key, _, value = item.partition(":")
        given.setdefault(key.strip(), value.strip())
    if {"expandable_segments", "max_split_size_mb"} & given.keys() or given.get("backend", "native") != "native":
        return {}
    if not current:
        name = ALLOC_CONF
    return {name: ",".join(part for part in (current, "expandable_segments:True") if part)}


_DUMP_WAIT = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
# How NCCL's watchdog (a thread in every GPU rank) ends a collective that waits too long or failed.
# The ranks inherit everything else the notebook's environment holds (NCCL_NVLS_ENABLE and the like).
_NCCL_ERROR_HANDLING = {
    # 1: abort the communicator, then end the process. torch's default (3) ends it without aborting,
    # so the collective's kernel can stay on the GPU while the process exits and the GPU stays held.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # The flight recorder's dump on a timeout writes a file per rank to /tmp and waits for the other
    # ranks' dumps before the abort; nbkit's message names the rank already. Set it to 1 to debug a desync.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # How long the watchdog waits for that dump before it ends the rank: torch's 60 s held a rank whose
    # peer had gone for a minute after its own timeout (2 GPUs, the first collective to time out) with
    # no dump coming. Where a user turns the dump on, torch's wait stays (nccl_environment).
    _DUMP_WAIT: "0",
    # The monitor ends a rank whose watchdog itself stopped (stuck in an NCCL or CUDA call, such as an
    # abort whose peer is gone) after this many seconds; torch's 480 leaves a notebook waiting 8 minutes.
    # The watchdog beats several times a second, so a minute without a beat is no slow step.
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60",
}
# TORCH_NCCL_BLOCKING_WAIT stays off: it makes every collective's wait hold the host until the GPU has
# finished it, losing DDP's overlap of communication and compute, and the watchdog above catches the
# same timeouts without that cost.


def nccl_environment() -> dict[str, str]:
    """The part of rank_environment for GPU ranks: NCCL's error handling (_NCCL_ERROR_HANDLING),
    each variable only where this process does not set it already (a user's choice stands).
    """
    chosen = {name: value for name, value in _NCCL_ERROR_HANDLING.items() if name not in os.environ}
    # A user who turns the dump on gets torch's wait for it; one who sets it off (0) still gets no wait.
    if config.flag("TORCH_NCCL_DUMP_ON_TIMEOUT"):
        chosen.pop(_DUMP_WAIT, None)
    return chosen


# --------------------------------------------------------------------------------------------
# Rank side: its CPU threads
# --------------------------------------------------------------------------------------------


def set_rank_threads(*, use_cuda: bool, local_world_size: int, forked: bool = False) -> int:
    """Size this rank's torch intra-op thread pool, once, early in the rank; returns the thread count.

    OMP_NUM_THREADS, where the rank's environment sets it (the user's env=, torchrun), decides. Otherwise
    a GPU rank gets one thread, as torchrun and `accelerate launch` give theirs: its CPU work is
    Python and kernel launches on the main thread, and every rank keeping a pool as large as the
    machine (2 ranks x 32 threads on a 32-core host) made the pools' spinning threads compete with
    the ranks' main threads (benchmarks/RESULTS.md, two GPUs). A CPU rank gets its share of the cores,
    except a rank forked from a notebook, which gets one whatever is set: with more it hangs in its
    first parallel op (the notebook's pool does not survive fork). The count is also exported as
    OMP_NUM_THREADS, so that accelerate does not resize a CPU rank's pool and what the rank starts
    inherits it.
    """
    import torch

    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if forked and not use_cuda:
        threads = 1
    elif given.isdigit() and int(given) > 0:
        threads = int(given)
    elif use_cuda:
        threads = 1
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // max(1, local_world_size))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # Set even where unchanged: a forked rank rebuilds the pool here, while it is its only thread
    # (rebuilt lazily, two threads that start at once could see it half-replaced: "Invalid thread pool").
    torch.set_num_threads(threads)
    return threads


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
