"""How a rank ends: a DDP model that outlives its process group must not hang the rank, and a rank
that ends through the interpreter's shutdown must not abort in it.

Measured here (torch 2.13 CPU, 2 gloo ranks, nbkit.launch): a function that trains a DDP model,
gathers a value (`all_gather_object`), calls `dist.destroy_process_group()` and returns hung in
`return` in 1 of 12 launches of tests/test_savers_ddp.py's matrix, and in the first of 200 tries
when the model is deleted right after the group. The stacks (py-spy --native):

    main thread:   pybind11 dealloc of c10d::Reducer (the GIL held) -> ~Reducer -> ~ProcessGroupGloo
                   -> std::thread::join (the group's worker thread)
    gloo worker:   ~AsyncAllgatherWork -> decref of a tensor's Python object -> waits for the GIL

`destroy_process_group()` drops torch's own references to the group, so DDP's reducer holds the
last one, and the reducer is bound to Python without releasing the GIL in its destructor (unlike
the ProcessGroup object itself): the destructor joins a thread that waits for the GIL it holds.
Scripts often end exactly this way (destroy, then return with the model still a local), and the
model is freed at `return`, before nbkit can send rank 0's value, so no supervision after the
function can rescue the value.

nbkit therefore keeps every process group that `destroy_process_group` removes referenced from
Python until the rank ends (the "teardown" patch group, applied in every rank nbkit.launch starts
and every live rank). The group is still shut down and unregistered as before (a new
init_process_group works); only its C++ object is never destroyed by a reducer. A rank of
nbkit.launch ends with os._exit (multiprocessing's fork start), which runs no C++ destructor, so
what is kept costs nothing there; a live rank started by nbkit ends the same way
(nbkit.rank_side.live_engine), and one started outside nbkit keeps the retired group's idle threads until it
ends.

A rank of an outside launcher (torchrun running an exported script) ends through the interpreter's
shutdown instead, and there a group left alive aborts the rank: a gloo worker thread that frees a
finished collective's tensors after finalization has begun is stopped while it waits for the GIL,
inside a destructor that may not throw ("terminate called without an active exception", SIGABRT).
Measured (torch 2.13 CPU, torchrun, 2 gloo ranks: three DDP steps, all_gather_object and all_gather,
then the end of the script): 13 of 30 runs aborted, 7 of 20 through nbkit.launch. Such a rank gets
`destroy_at_exit` instead of the patch group: at exit, while the interpreter is whole, it collects
garbage (DDP models in reference cycles, as a Trainer keeps them, let go of the group) and then
destroys the process groups, which joins their threads. 0 of 30 runs aborted with both steps, 6 of
30 with the destroy alone. A DDP model a script keeps in a global still outlives the group.

One more holder kept the group alive through both steps: the first DDP model of a process imports
torch._dynamo, which imports torch.distributed.nn.functional, whose functions take `group=group.WORLD`
as default arguments, bound when the module is imported. Imported after init_process_group, they hold
the default group for the life of the process: destroy_process_group unregistered it, but its gloo
threads lived on, and on a loaded machine one of them still freeing the last collective's tensors when
finalization began aborted the rank (2 of 40, then 1 of 57, torchrun runs of tests/test_teardown.py's
script beside three busy processes on 2 cores; core dump: `~AsyncAllgatherWork` -> `decref_pyobject` ->
`take_gil` -> `pthread_exit` -> `std::terminate`). `destroy_at_exit` therefore imports that module
while no group exists yet, so its defaults hold None (the default group, looked up at each call).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import sys
from collections.abc import Callable
from typing import Any

from nbkit.platform import patching

__all__ = ["destroy_at_exit", "enable", "retired"]

# The process groups destroy_process_group removed in this process: never freed while it runs.
_retired: list[Any] = []


def enable() -> None:
    """Apply the teardown group in this rank (idempotent)."""
    patching.apply("teardown")


def destroy_at_exit() -> None:
    """Destroy this process's process groups when it exits (registered once; see the module docstring).

    For a rank that ends through the interpreter's shutdown (an outside launcher's); not together with
    `enable`, whose kept groups would then be destroyed by finalization after all. A script that
    destroys its groups itself leaves the handler nothing to do. Call it before the rank's process group
    exists (prepare_rank does).
    """
    atexit.unregister(_destroy_groups)
    atexit.register(_destroy_groups)
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        importlib.import_module("torch.distributed.nn.functional")  # its defaults bound to no group (above)


def _destroy_groups() -> None:
    dist = sys.modules.get("torch.distributed")  # a process that never imported it has no group
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    gc.collect()
    dist.destroy_process_group()


def retired() -> list[Any]:
    """The process groups that destroy_process_group removed in this process, oldest first."""
    return list(_retired)


def _groups_destroyed_by(group: Any) -> list[Any]:
    """The groups that `destroy_process_group(group)` is about to remove: every registered group for
    None or WORLD, else `group`.
    """
    from torch.distributed import distributed_c10d as c10d

    # torch keeps the registered groups in a private table; without it (another torch), the one named.
    registered = list(getattr(getattr(c10d, "_world", None), "pg_map", None) or [])
    if group is None or group == c10d.GroupMember.WORLD:
        return registered
    return [group]


def _retire_destroyed_groups(original: Callable[..., Any]) -> Callable[..., Any]:
    def destroy_process_group(group: Any = None) -> Any:
        leaving = _groups_destroyed_by(group)
        result = original(group)
        _retired.extend(pg for pg in leaving if pg is not None)
        return result

    return destroy_process_group


_REASON = (
    "a DDP model that outlives its process group (destroy_process_group() and then the model freed, as "
    "when a training function destroys the group and returns) hung its rank: DDP's reducer drops the last "
    "reference to the gloo group while holding the GIL, and the group's destructor joins a worker thread "
    "that waits for the GIL to free a finished all_gather's tensors (measured: 1 hang in 12 launches of a "
    "test, every time when the model is deleted right after the group). Keep the removed groups referenced "
    "until the rank ends, which in nbkit's ranks runs no C++ destructor"
)
_UPSTREAM = (
    "https://github.com/pytorch/pytorch/issues/56297 (blocking destructors of classes bound with pybind11 "
    "that keep the GIL; c10d::Reducer is still bound that way in torch 2.13)"
)

# torch.distributed re-exports the function: scripts call it through either module.
for _target in (
    "torch.distributed.distributed_c10d:destroy_process_group",
    "torch.distributed:destroy_process_group",
):
    patching.patch(_target, reason=_REASON, upstream=_UPSTREAM, group="teardown")(_retire_destroyed_groups)
