"""How a rank of an outside launcher ends (nbkit.rank_side.teardown.destroy_at_exit): a script run by torchrun
whose training function leaves its gloo group alive has the group destroyed at exit, its threads
joined before the interpreter's finalization, and every rank exits 0. Without that, such a script
aborted in about one run in three ("terminate called without an active exception", SIGABRT; the
measurements are in nbkit/rank_side/teardown.py's docstring)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from outside_launcher import torchrun

pytestmark = pytest.mark.version_independent

SCRIPT = textwrap.dedent(
    """
    import atexit
    import os

    import torch
    import torch.distributed as dist

    import nbkit


    # Registered before nbkit's handler, so it runs after it (atexit runs handlers last-in first-out).
    @atexit.register
    def _report() -> None:
        print(f"rank {os.environ['RANK']}: groups alive at exit: {dist.is_initialized()}", flush=True)
        # a group that is only unregistered keeps its worker threads, which can abort finalization
        names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
        print(f"rank {os.environ['RANK']}: gloo threads at exit: {sum('gloo' in n for n in names)}", flush=True)


    def train():
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, dist.get_rank())
        return gathered  # the group stays up: no destroy_process_group, as many scripts end


    if __name__ == "__main__":
        value = nbkit.launch(train, gpus=2, quiet=True)
        if nbkit.is_main():
            print(f"value: {value}", flush=True)
    """
)


def test_a_torchrun_rank_that_leaves_its_group_alive_has_it_destroyed_at_exit(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = torchrun(script, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    # (the ranks share torchrun's stdout, so their lines may interleave: each is looked for as a whole)
    assert "value: [0, 1]" in proc.stdout
    for rank in (0, 1):
        assert f"rank {rank}: groups alive at exit: False" in proc.stdout, proc.stdout
        assert f"rank {rank}: gloo threads at exit: 0" in proc.stdout, proc.stdout
