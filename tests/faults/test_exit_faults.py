"""A rank whose function has returned cannot hang the launch: not in a destructor, not at exit.

Real ranks: forked processes talking gloo on this CPU machine (nbkit.launch, 2 ranks).
"""

from __future__ import annotations

import _thread
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from faultkit import Snapshot, failed_within

import nbkit
from nbkit.launching import fork, supervisor

pytestmark = pytest.mark.usefixtures("leftovers")

# A launch of 2 ranks that build a tiny DDP model a few dozen times: seconds here, with room for
# the shared 2-core machine. Without nbkit.rank_side.teardown the first launch hung at its first model
# (py-spy: the reducer's destructor joining a gloo worker that waits for the GIL).
LAUNCH_S = 60.0


def _ddp_step(group: object = None) -> float:
    """One DDP training step on `group`, then a gathered value: the all_gather leaves a finished
    gloo work whose tensors the group's worker thread frees moments later.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(8, 4), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.full((2, 8), float(nbkit.rank() + 1))).sum()
    loss.backward()
    optimizer.step()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, round(loss.item(), 4), group=group)
    return sum(gathered)


def _train_then_end(rounds: int, destroy: bool) -> float:
    """As scripts end: train, destroy the process group (or not), return with the model alive.

    Each round also frees a DDP model right after its own group was destroyed (the tightest form
    of the same race).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    for _ in range(rounds):
        group = dist.new_group(backend="gloo")
        model = DistributedDataParallel(torch.nn.Linear(4, 4), process_group=group)
        model(torch.ones(2, 4)).sum().backward()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, 1, group=group)
        if destroy:
            dist.destroy_process_group(group)
        del group, gathered
        del model  # with the group destroyed, the reducer held its last reference
    model = DistributedDataParallel(torch.nn.Linear(8, 4))
    loss = model(torch.ones(2, 8)).sum()
    loss.backward()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, os.getpid())
    if destroy:
        dist.destroy_process_group()
    return float(len(set(gathered)))  # `model` is freed at this return


@pytest.mark.parametrize("destroy", [True, False], ids=["destroy_process_group", "group_left_alive"])
def test_a_function_that_ends_with_its_ddp_model_alive_returns_every_time(leftovers, destroy):
    for _ in range(3):
        with failed_within(LAUNCH_S):
            # The timeout turns a hang back into a failure of this test instead of a stuck run.
            value = nbkit.launch(_train_then_end, 20, destroy, gpus=2, timeout=LAUNCH_S, dashboard=False)
        assert value == 2.0  # both ranks' pids were gathered: both ran to the end
        assert not Snapshot.take().grown_since(leftovers)


@contextlib.contextmanager
def _interrupted_after(seconds: float) -> Iterator[None]:
    """Interrupt the main thread (as the notebook's stop button does) if the block runs past
    `seconds`: a launch without a timeout that hangs fails the test instead of stalling the run.
    """
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()


def _returns_but_leaves_a_thread(pid_dir: str) -> int:
    Path(pid_dir, str(os.getpid())).touch()
    if nbkit.rank() == 1:
        # A non-daemon thread that never ends: the process would wait for it at exit forever.
        threading.Thread(target=threading.Event().wait, name="never-ends").start()
    return 7 + nbkit.rank()


@pytest.mark.parametrize("timeout", [None, 120])
def test_a_rank_that_returned_but_does_not_end_is_stopped_and_the_value_kept(
    tmp_path, leftovers, capsys, monkeypatch, timeout
):
    monkeypatch.setattr(fork, "_EXIT_GRACE_S", 2.0)
    start = time.monotonic()
    with _interrupted_after(90):
        value = nbkit.launch(_returns_but_leaves_a_thread, str(tmp_path), gpus=2, timeout=timeout, dashboard=False)
    took = time.monotonic() - start
    assert value == 7  # rank 0's value, not a timeout or a failure
    assert 2.0 <= took < 2.0 + 20, took  # the grace, then the stop (the start of 2 ranks included)
    err = capsys.readouterr().err  # a warning of the nbkit.launching.fork logger, shown as a notice
    assert "rank(s) 1 returned, but their processes were still running 2 s later" in err, err
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert len(pids) == 2 and not any(supervisor.pid_alive(pid) for pid in pids)
    assert not Snapshot.take().grown_since(leftovers)
