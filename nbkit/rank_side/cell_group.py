"""The default process group a %%ddp cell runs in: the same on every path (rank side).

A live set's ranks join the default group when they start (nbkit.rank_side.live_engine), so a cell can call
`dist.all_reduce(t)` at once. One-shot ranks (fork, spawn) and the functions of an exported script
join it here, before the cell runs (`join`, `joined`), so the same cell works there too. A cell
written for one-shot ranks calls `dist.init_process_group(...)` itself: that call then keeps the
group already joined (patch group "cell_group"), on a live set as well, so it works on every path;
a call that asks for another backend is refused with a message saying which backend the cell has.
accelerate (and so Trainer and TRL) takes an initialised default group as it is. Teardown is the
rank's as before (nbkit.rank_side.teardown): a rank nbkit ends itself keeps the group until then, a rank of an
outside launcher destroys it at exit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from nbkit.platform import config, distributed, patching
from nbkit.platform.errors import ProcessGroupError

__all__ = ["backend", "join", "joined"]


def backend() -> str:
    """The backend of a cell's default group: "nccl" on a rank with a GPU, "gloo" on a CPU rank (as a
    live set's ranks have it).
    """
    return "nccl" if distributed.device().startswith("cuda") else "gloo"


def join() -> None:
    """Join the default process group of the launch this rank is part of (its environment: RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT), on this rank's GPU where it has one; a no-op where the
    group exists already or outside a launch. A launch of one rank gets a group of one, as a live set
    of one rank has. Call it on every rank, before the cell runs.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized() or not distributed.launched():
        return
    if backend() == "nccl":
        torch.cuda.set_device(distributed.local_rank())
        # The same patience as a live set's group (nbkit.configure(nccl_timeout=...)): past it NCCL's
        # watchdog ends a rank whose peer never comes, and nbkit's message says so.
        dist.init_process_group("nccl", timeout=config.nccl_timeout())
    else:
        dist.init_process_group("gloo")


def joined(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run after `join()`: what an exported script hands nbkit.launch, so that the cell it holds
    finds the default group as in the notebook.
    """

    @functools.wraps(fn)
    def in_default_group(*args: Any, **kwargs: Any) -> Any:
        join()
        return fn(*args, **kwargs)

    return in_default_group


def _same_backend(asked: Any, current: str) -> bool:
    """Whether `init_process_group(backend=asked)` asks for the group that exists (`current`, as
    dist.get_backend() names it, e.g. "gloo" or "cpu:gloo,cuda:nccl").
    """
    if asked is None or str(asked).strip() == "" or str(asked).lower() == "undefined":
        return True
    parts = {p.split(":")[-1] for p in current.lower().split(",")}
    return {p.split(":")[-1] for p in str(asked).lower().split(",")} <= parts


def _keep_the_cells_group(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            return original(backend, *args, **kwargs)
        current = str(dist.get_backend())
        if not _same_backend(backend, current):
            raise ProcessGroupError(
                f"init_process_group({backend!r}): this cell runs in the default process group nbkit set up "
                f"({current}, {dist.get_world_size()} ranks), on every path: one-shot, live set and exported "
                f"script. Leave the call out, or ask for {current!r}."
            )
        return None

    return init_process_group


_REASON = (
    "a %%ddp cell runs in the default process group nbkit sets up (a live set's, or the one joined before a "
    "one-shot or exported cell), and a cell written for one-shot ranks calls dist.init_process_group() "
    "itself, which torch refuses on an initialised group: the call keeps the group the cell has"
)
# torch.distributed re-exports the function: cells call it through either module.
for _target in (
    "torch.distributed.distributed_c10d:init_process_group",
    "torch.distributed:init_process_group",
):
    patching.patch(
        _target,
        reason=_REASON,
        upstream="none: torch refuses a second default group on purpose; the call is kept in nbkit's ranks only",
        group="cell_group",
    )(_keep_the_cells_group)
