"""A benchmark rank's set-up and teardown, and the collectives by which ranks agree.

Every rank runs the same sequence of collectives whatever fails, so one case's failure (an OOM, an
exception) is recorded on every rank: `agree()` and `gather()` go over a gloo group, which still
works right after a CUDA out-of-memory error.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch

_control_group: Any = None


def setup_rank(
    device_kind: str | None = None, *, memory_cap_gib: float | None = None, timeout_s: float = 300.0
) -> torch.device:
    """Set this rank up: its device, an optional memory cap, the process group for several ranks.

    Takes "cuda" / "cpu" (None: cuda where available), a per-process cap in GiB (the T4 stand-in;
    torch.cuda.set_per_process_memory_fraction, so allocations past it raise OutOfMemoryError) and
    the collective timeout (a rank left waiting for a failed peer errors out after it instead of
    hanging). Initialises torch.distributed (NCCL on GPUs, gloo on CPU) when WORLD_SIZE > 1, plus a
    gloo group for the ranks' agreements. Returns this rank's device. Call once per rank, first.
    """
    import torch.distributed as dist

    global _control_group
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device_kind is None:
        device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if memory_cap_gib is not None:
            total = torch.cuda.get_device_properties(local_rank).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, memory_cap_gib * 2**30 / total), local_rank)
    else:
        device = torch.device("cpu")
        # Forked CPU ranks hang in their first parallel op when the parent had started torch's
        # thread pool, and two ranks on a small machine only fight over cores anyway.
        torch.set_num_threads(1)
    if world == int(os.environ.get("LOCAL_WORLD_SIZE", "0")) and sys.platform.startswith("linux"):
        # Every rank is on this machine: gloo (the agreements, CPU runs) over loopback, whatever
        # the host name resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    if world > 1 and _control_group is None:
        _control_group = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
    return device


def teardown_rank() -> None:
    """Destroy the process group set up by setup_rank (a no-op in a single process)."""
    import torch.distributed as dist

    global _control_group
    _control_group = None
    if dist.is_initialized():
        dist.destroy_process_group()


def gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank ([value] in a single process). Collective."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=_control_group)
    return out


def agree(ok: bool) -> bool:
    """True when `ok` is True on every rank. Collective, over gloo: works right after a CUDA OOM."""
    return all(gather(bool(ok)))
