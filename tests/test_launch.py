"""nbkit.launch with real forked processes talking gloo on this CPU machine."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import nbkit
from nbkit.launching import supervisor


def _alive(pid: int) -> bool:
    return supervisor.pid_alive(pid)


def _allreduce_rank_sum(scale: float, *, offset: float = 0.0) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(nbkit.rank() + 1)])
    dist.all_reduce(t)
    info = {
        "sum": t.item() * scale + offset,
        "rank": nbkit.rank(),
        "local_rank": nbkit.local_rank(),
        "world_size": nbkit.world_size(),
        "is_main": nbkit.is_main(),
        "precision": nbkit.precision(),
        "env": {k: os.environ.get(k) for k in ("MASTER_ADDR", "ACCELERATE_USE_CPU", "NBKIT_LAUNCHED")},
        "tensor": torch.arange(3.0),
        "pid": os.getpid(),
    }
    dist.destroy_process_group()
    return info


def test_returns_rank0_value_and_sets_up_each_rank(capfd):
    torch.ones(64, 64) @ torch.ones(64, 64)  # a parent that has used torch's thread pool must still fork safely
    out = nbkit.launch(_allreduce_rank_sum, 10.0, gpus=2, offset=1.0)
    assert out["sum"] == 31.0  # (1 + 2) * 10 + 1: both ranks took part in the all-reduce
    assert (out["rank"], out["local_rank"], out["world_size"], out["is_main"]) == (0, 0, 2, True)
    assert out["precision"] == "fp32"
    assert out["env"] == {"MASTER_ADDR": "127.0.0.1", "ACCELERATE_USE_CPU": "true", "NBKIT_LAUNCHED": "1"}
    assert torch.equal(out["tensor"], torch.arange(3.0))
    assert out["pid"] != os.getpid()
    assert not _alive(out["pid"])
    # Nothing of the launch leaks into the notebook process's environment.
    assert "NBKIT_LAUNCHED" not in os.environ and "ACCELERATE_USE_CPU" not in os.environ


def _rank() -> int:
    return nbkit.rank()


def _raises_on_rank1() -> None:
    if nbkit.rank() == 1:
        raise ValueError("rank 1 fails")


def test_a_launch_leaves_the_collectors_frozen_objects_as_it_found_them():
    # A launch sets the notebook's objects aside (gc.freeze) so that its collection walks only what it made;
    # whatever way it ends, nothing stays frozen after it, and what the notebook froze itself stays frozen.
    assert gc.get_freeze_count() == 0
    assert nbkit.launch(_rank, gpus=2) == 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(nbkit.LaunchError):
        nbkit.launch(_raises_on_rank1, gpus=2)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        assert nbkit.launch(_rank, gpus=2) == 0
        assert gc.get_freeze_count() > 0  # not unfrozen by the launch
    finally:
        gc.unfreeze()


def _print_from_each_rank() -> None:
    print(f"hello from {nbkit.rank()}")
    print(f"second line {nbkit.rank()}", file=sys.stderr)
    # What C++ code writes (torch's DDP warnings) goes to the file descriptor, past sys.stderr;
    # C's stdout is a buffered pipe here, let go when the function ends.
    os.write(2, f"c-level {nbkit.rank()}\n".encode())
    ctypes.CDLL(None).printf(f"printf {nbkit.rank()}\n".encode())


def test_rank0_output_only_by_default_other_ranks_prefixed_on_request(capfd):
    nbkit.launch(_print_from_each_rank, gpus=2)  # the default, as in %%ddp: rank 0 only
    out, err = capfd.readouterr()
    assert "hello from 0" in out and "c-level 0" in err
    assert "rank 1" not in out + err and "from 1" not in out and "c-level 1" not in err

    nbkit.launch(_print_from_each_rank, gpus=2, quiet=False)
    out, err = capfd.readouterr()
    assert "hello from 0\n" in out and "printf 0\n" in out and "[rank 0]" not in out + err
    assert "[rank 1] hello from 1\n" in out
    assert "[rank 1] second line 1\n" in err
    # The descriptor level of rank 1 is prefixed too (it went to the notebook bare before).
    assert "[rank 1] c-level 1\n" in err and "[rank 1] printf 1\n" in out
    assert "\nc-level 1" not in "\n" + err and "\nprintf 1" not in "\n" + out


def _ddp_step_with_nothing_unused() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(4, 2), find_unused_parameters=True)
    model(torch.ones(3, 4)).sum().backward()  # torch's C++ reducer warns on stderr, from autograd's thread
    dist.destroy_process_group()


def test_a_torch_cpp_warning_of_rank_1_is_hidden_or_prefixed_like_its_prints(capfd):
    warning = "find_unused_parameters=True was specified in DDP constructor"
    nbkit.launch(_ddp_step_with_nothing_unused, gpus=2, dashboard=False)
    err = capfd.readouterr().err
    assert err.count(warning) == 1 and "[rank0]:" in err and "[rank1]:" not in err, err

    nbkit.launch(_ddp_step_with_nothing_unused, gpus=2, quiet=False, dashboard=False)
    lines = [line for line in capfd.readouterr().err.splitlines() if warning in line]
    assert len(lines) == 2, lines
    assert any(line.startswith("[rank 1] [rank1]:") for line in lines), lines
    assert any(line.startswith("[rank0]:") for line in lines), lines


def _fail_on_rank1(pid_dir: str) -> None:
    Path(pid_dir, str(os.getpid())).touch()
    if nbkit.rank() == 1:
        # once rank 0 has written its pid too: on a loaded machine rank 0 was stopped before it did
        deadline = time.monotonic() + 60
        while len(list(Path(pid_dir).iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        raise ValueError("batch 7 has no labels")
    time.sleep(60)  # rank 0 would go on; the launcher must stop it


def test_exception_on_rank1_names_it_and_leaves_nothing_behind(tmp_path):
    start = time.monotonic()
    with pytest.raises(nbkit.LaunchError) as info:
        nbkit.launch(_fail_on_rank1, str(tmp_path), gpus=2)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert message.startswith("rank 1 failed")
    assert "ValueError: batch 7 has no labels" in message
    assert 'raise ValueError("batch 7 has no labels")' in message  # the rank's own traceback
    assert list(info.value.failures) == [1]
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert len(pids) == 2
    assert not any(_alive(pid) for pid in pids)
    # The very same call can run again at once.
    assert nbkit.launch(_allreduce_rank_sum, 1.0, gpus=2)["sum"] == 3.0


def _killed_on_rank1() -> None:
    if nbkit.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_rank_killed_by_a_signal():
    with pytest.raises(nbkit.LaunchError) as info:
        nbkit.launch(_killed_on_rank1, gpus=2)
    assert "rank 1" in str(info.value) and "SIGKILL" in str(info.value)
    assert "out of CPU memory" in str(info.value)


class _TowerNeverUsed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.tower = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _ddp_with_a_weight_no_step_uses() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    ddp = torch.nn.parallel.DistributedDataParallel(_TowerNeverUsed(), find_unused_parameters=False)
    for _ in range(2):  # DDP notices in the second step that "tower" got no gradient in the first
        ddp(torch.ones(2, 4)).sum().backward()


def test_ddp_weights_without_gradient_get_an_explanation():
    with pytest.raises(nbkit.LaunchError) as caught:
        nbkit.launch(_ddp_with_a_weight_no_step_uses, gpus=2, timeout=120)
    message = str(caught.value)
    assert "Expected to have finished reduction" in message  # DDP's own error, kept
    assert "finetune_vision_layers=False" in message and "unsloth_vlm_ddp_checkpointing" in message


def _hang_in_collective() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if nbkit.rank() == 0:
        dist.barrier()  # rank 1 never joins
    time.sleep(120)


def test_timeout_stops_a_hung_run():
    start = time.monotonic()
    with pytest.raises(nbkit.LaunchError) as info:
        nbkit.launch(_hang_in_collective, gpus=2, timeout=4)
    assert info.value.timed_out
    assert "did not finish within the timeout" in str(info.value)
    assert 4 <= time.monotonic() - start < 20
    assert nbkit.launch(_allreduce_rank_sum, 2.0, gpus=2)["sum"] == 6.0


def _listening_addresses() -> list[str]:
    port = int(os.environ["MASTER_PORT"])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_rendezvous_listens_on_loopback_only():
    assert nbkit.launch(_listening_addresses, gpus=2) == ["0100007F"]  # 127.0.0.1, nothing on 0.0.0.0 / ::


def test_single_process_runs_in_a_child_too():
    out = nbkit.launch(_allreduce_rank_sum, 5.0, gpus=1)
    assert out["sum"] == 5.0 and out["world_size"] == 1 and out["pid"] != os.getpid()


def test_unpicklable_return_value_is_explained():
    with pytest.raises(nbkit.LaunchError, match="cannot be sent back to the notebook"):
        nbkit.launch(lambda: (x for x in range(3)), gpus=1)


@pytest.mark.version_independent
def test_checks_before_launching():
    with pytest.raises(nbkit.RanksError, match="No GPU is visible.*gpus=N"):
        nbkit.launch(print)
    with pytest.raises(ValueError, match="positive whole number"):
        nbkit.launch(print, gpus=0)
    with pytest.raises(TypeError, match="needs a function"):
        nbkit.launch("train", gpus=2)

    async def train_async():
        pass

    with pytest.raises(TypeError, match="async function.*asyncio.run"):
        nbkit.launch(train_async, gpus=2)

    def train_gen():
        yield 1

    with pytest.raises(TypeError, match="generator function"):
        nbkit.launch(train_gen, gpus=2)


def test_bitsandbytes_imported_without_cuda_does_not_block_forking(monkeypatch):
    # peft imports bitsandbytes wherever it is installed; accelerate alone would refuse to fork.
    # What breaks fork is a CUDA context, and there is none here.
    monkeypatch.setitem(sys.modules, "bitsandbytes", type(sys)("bitsandbytes"))
    assert nbkit.launch(_allreduce_rank_sum, 1.0, gpus=2)["sum"] == 3.0
    from accelerate import launchers

    assert launchers.are_libraries_initialized("bitsandbytes") == ["bitsandbytes"]  # patch reverted


def test_accelerator_created_in_the_notebook_is_refused():
    from accelerate.state import AcceleratorState, PartialState

    PartialState(cpu=True)
    try:
        with pytest.raises(RuntimeError, match="Accelerator .* already exists.*inside the launched function"):
            nbkit.launch(print, gpus=2)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert nbkit.launch(_allreduce_rank_sum, 1.0, gpus=2)["sum"] == 3.0


@pytest.mark.version_independent
def test_inside_an_outside_distributed_run_fn_is_called_directly(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        assert nbkit.launch(lambda a, b=0: (os.getpid(), nbkit.rank(), a + b), 2, b=3) == (os.getpid(), 1, 5)
    finally:  # the rank set-up ran in this test process: leave it as other tests expect it
        nbkit.uninstall()


_INTERRUPT_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import nbkit

    def hang(pid_dir):
        import torch.distributed as dist
        dist.init_process_group("gloo")
        Path(pid_dir, str(os.getpid())).touch()
        if nbkit.rank() == 0:
            dist.barrier()
        time.sleep(300)

    try:
        nbkit.launch(hang, sys.argv[1], gpus=2)
    except KeyboardInterrupt:
        print(f"interrupted at {time.time()}", flush=True)
        print("again", nbkit.launch(lambda: 42, gpus=2), flush=True)
    """
)


def test_interrupt_stops_every_rank_and_the_process_stays_usable(tmp_path):
    script = tmp_path / "interrupt.py"
    script.write_text(_INTERRUPT_SCRIPT)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(pid_dir)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(pid_dir.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p.name) for p in pid_dir.iterdir()]
        assert len(pids) == 2, "the ranks did not start"
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    stopped = float(out.split("interrupted at ")[1].split()[0])
    assert stopped - sent < 10
    assert not any(_alive(pid) for pid in pids)
    assert "again 42" in out
