"""The fault matrix on two GPUs over NCCL, through the plain API: one-shot cells forked (nbkit.run_cell) and
spawned (run_cell(spawn=True)), and a live set (nbkit.start, LiveRanks.exec); the same cell in each.

On GPUs a dead rank leaves its peer blocked inside a collective's CUDA kernel, not in a Python call, and
GPU memory is free only once every process that held a context is gone. Each case checks what a user
relies on: the error names the rank and the cause, within 2 s of the rank's death (its timeout + 5 s
for a hang); nothing holds either GPU afterwards (NVML: no new process, memory back to what it was); the
next launch or nbkit.start works at once.

`pytest -m gpu` on a machine with 2 GPUs. With SUITE_DRY_RUN=1 the same cases run on 2 CPU ranks over gloo
(the GPU checks then have nothing to read), so that the matrix itself is tried before GPU time is spent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from faultkit import MARGIN_S

import nbkit
from benchmarks.gpu_state import GpuSample, still_held

ON_GPUS = torch.cuda.device_count() >= 2
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ON_GPUS or os.environ.get("SUITE_DRY_RUN")), reason="needs 2 CUDA GPUs"),
]

MODES = ["fork", "spawn", "live"]
# Issue 14's target from a rank's death to the error; on CPU ranks of a loaded machine (dry runs) more.
DEATH_TO_ERROR_S = 2.0 if ON_GPUS else 2.0 + MARGIN_S
HANG_TIMEOUT_S = 8
# A spawned cell's timeout starts in its launcher process, once that has imported torch afresh.
SPAWN_START_S = 20.0
# Starting the ranks before a fault can happen: a spawned launcher imports torch afresh, a live set's
# engines start and join NCCL, a Trainer case imports transformers and peft in every rank.
START_S = 90.0

REPO = str(Path(__file__).resolve().parents[2])

# Every case's cell starts here: the rank's GPU, its process group (a live set's exists already), and
# `about_to_die()`, which stamps the moment the fault is injected.
_SETUP = """\
import os, signal, time, torch, nbkit, torch.distributed as dist
from pathlib import Path
dev = nbkit.device()
if dev.startswith("cuda"):
    torch.cuda.set_device(dev)
if not dist.is_initialized():
    dist.init_process_group("nccl" if dev.startswith("cuda") else "gloo")
def about_to_die():
    Path(STAMP).write_text(repr(time.time()))
"""

# A plain training loop's collectives: rank 1 meets its fault at step 20, while rank 0 goes on into the
# next all-reduce (and waits inside its kernel: the host syncs on a value every 10 steps, as a logged loss does).
_ALL_REDUCE_LOOP = """\
t = torch.ones(1 << 20, device=dev)
for step in range(1_000_000):
    if step == 20 and nbkit.rank() == 1:
        about_to_die()
        {fault}
    dist.all_reduce(t)
    t /= 2
    if step % 10 == 0:
        float(t[0])
"""

_FAULTS = {
    "sigkill": "os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does",
    "raises": "raise ValueError('batch 7 has no labels')",
    # 4 TiB: more than any GPU (or this machine) has, on rank 1 only
    "oom": "torch.empty(1 << 42, dtype=torch.uint8, device=dev)",
    "exits0": "os._exit(0)",
}

# What the error must say for each fault, besides "rank 1": any one of the phrasings.
_SAYS = {
    "sigkill": ("died from signal SIGKILL",),
    "raises": ("ValueError: batch 7 has no labels",),
    "oom": ("A rank ran out of GPU memory",) if ON_GPUS else ("can't allocate memory",),
    # torch elastic may collect a rank that exited with 0 before nbkit reads its code
    "exits0": ("exited with code 0", "ended without returning"),
    "trainer": ("died from signal SIGKILL",),
}

# trainer.train() of a tiny LoRA model, rank 1 killed at the end of step 3: rank 0 is then inside step 4's
# gradient all-reduce.
_TRAINER = """\
import sys
sys.path.insert(0, REPO)
import tests.tiny_training as tiny
from transformers import TrainerCallback

class Fault(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3 and nbkit.rank() == 1:
            about_to_die()
            os.kill(os.getpid(), signal.SIGKILL)

trainer = tiny.saving_trainer(
    PATH, OUT, samples=4000, max_steps=1000, callbacks=[Fault()], save_strategy="no", logging_steps=1000
)
trainer.train()
"""

_ANSWER = _SETUP + "t = torch.ones(1, device=dev) * (nbkit.rank() + 1)\ndist.all_reduce(t)\nint(t.item())\n"


def _error_within(mode: str, fault: str) -> float:
    """Seconds from the fault to the error. A live rank that raises stays up, so its peer waits inside the
    collective's kernel, where no Python signal handler runs: the set ends once the peer missed its
    interrupt (nbkit.live.calls: 1 s for the failure to settle, 2 s for the interrupt), within 5 s."""
    if mode == "live" and fault in ("raises", "oom"):
        return DEATH_TO_ERROR_S + 3.0
    return DEATH_TO_ERROR_S


def _cell(body: str, **values: str) -> str:
    """`body` after the set-up, with `values` (STAMP, PATH, ...) defined first as text."""
    names = "".join(f"{name} = {value!r}\n" for name, value in values.items())
    return names + _SETUP + body


def _run(mode: str, cell: str, timeout: float | None = None) -> object:
    """Run `cell` on 2 ranks: one-shot (fork, spawn) or on the live set (started where none runs)."""
    if mode == "live":
        ranks = nbkit.live.current() or nbkit.start(gpus=2, startup_timeout=START_S)
        return ranks.exec(cell, timeout=timeout)
    return nbkit.run_cell(cell, {}, gpus=2, timeout=timeout, spawn=mode == "spawn", dashboard=False)


@pytest.fixture
def gpus(request: pytest.FixtureRequest) -> Iterator[GpuSample | None]:
    """The GPUs before the case (None on CPU ranks); afterwards any live set is stopped and nothing may
    still hold either GPU. Fork and spawn cases get the CPU matrix's leftover checks too."""
    # Read first: whatever NVML keeps open in this process once it has been used is not the case's leftover.
    before = GpuSample.take()
    assert before is not None or not ON_GPUS, "neither NVML nor nvidia-smi answers: nothing could check the GPUs"
    if request.node.callspec.params.get("mode") != "live":
        request.getfixturevalue("leftovers")
    yield before
    running = nbkit.live.current()
    if running is not None:
        running.stop()
    nbkit.live.forget_ended()
    assert still_held(before) == {}


def _check_rerun(mode: str, before: GpuSample | None) -> None:
    """Nothing of the failed run holds a GPU, and the same kind of run works at once."""
    assert still_held(before) == {}, "the failed run's processes still hold a GPU"
    nbkit.live.forget_ended()
    start = time.monotonic()
    assert _run(mode, _ANSWER) == 3
    assert time.monotonic() - start < START_S


def _error_of(mode: str, cell: str, timeout: float | None = None) -> nbkit.NbkitError:
    error = nbkit.LiveError if mode == "live" else nbkit.LaunchError
    with pytest.raises(error) as caught:
        _run(mode, cell, timeout)
    return caught.value


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", [*_FAULTS, "trainer"])
def test_a_rank_that_fails_is_named_at_once_and_frees_its_gpu(mode, fault, tmp_path, gpus, tiny_text_path):
    stamp = tmp_path / "died_at"
    if fault == "trainer":
        cell = _cell(_TRAINER, STAMP=str(stamp), REPO=REPO, PATH=tiny_text_path, OUT=str(tmp_path / "out"))
    else:
        cell = _cell(_ALL_REDUCE_LOOP.format(fault=_FAULTS[fault]), STAMP=str(stamp))
    if mode == "live":  # the set is up before the clock starts: its start is not the case's
        _run(mode, _ANSWER)
    started = time.monotonic()
    error = _error_of(mode, cell)
    noticed = time.time()
    message = str(error)
    assert time.monotonic() - started < START_S
    assert "rank 1" in message and any(says in message for says in _SAYS[fault]), message
    assert "rank 0" not in message.split("\n")[0], message  # the cause, not the peer it left waiting
    assert noticed - float(stamp.read_text()) < _error_within(mode, fault), message
    _check_rerun(mode, gpus)


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_hangs_before_a_collective_ends_at_the_timeout(mode, tmp_path, gpus):
    cell = _cell(
        "if nbkit.rank() == 1:\n    time.sleep(3600)\nt = torch.ones(1, device=dev)\ndist.all_reduce(t)\nfloat(t[0])\n",
        STAMP=str(tmp_path / "unused"),
    )
    if mode == "live":
        _run(mode, _ANSWER)
    start = time.monotonic()
    error = _error_of(mode, cell, timeout=HANG_TIMEOUT_S)
    took = time.monotonic() - start
    message = str(error)
    assert HANG_TIMEOUT_S <= took < HANG_TIMEOUT_S + 5 + (SPAWN_START_S if mode == "spawn" else 0), took
    assert f"timeout ({HANG_TIMEOUT_S} s)" in message and "collective" in message, message
    _check_rerun(mode, gpus)


NCCL_TIMEOUT_S = 5
BACKSTOP_S = 60


@pytest.mark.skipif(not ON_GPUS, reason="NCCL's watchdog: GPU ranks only")
@pytest.mark.parametrize("mode", ["fork", "live"])
def test_nccls_watchdog_ends_a_rank_whose_peer_never_comes_and_the_error_says_so(mode, gpus, monkeypatch):
    # The process group's own timeout (nbkit.configure(nccl_timeout=...) for a live set, the cell's
    # init_process_group for a one-shot run) ends rank 0, through NCCL's async error handling; nbkit's own
    # timeout is only a backstop far behind it, so that a watchdog that never fires fails the case in a
    # minute instead of hanging the GPU suite's part.
    monkeypatch.setenv("NBKIT_NCCL_TIMEOUT", str(NCCL_TIMEOUT_S))
    cell = (
        "import datetime, time, torch, nbkit, torch.distributed as dist\n"
        "torch.cuda.set_device(nbkit.device())\n"
        "if not dist.is_initialized():\n"
        f"    dist.init_process_group('nccl', timeout=datetime.timedelta(seconds={NCCL_TIMEOUT_S}))\n"
        "t = torch.ones(1, device=nbkit.device())\n"
        "dist.all_reduce(t)\n"  # both ranks: NCCL's communicator is up before rank 1 stops coming
        "if nbkit.rank() == 1:\n    time.sleep(3600)\n"
        "dist.all_reduce(t)\nfloat(t[0])\n"
    )
    if mode == "live":
        _run(mode, _ANSWER)
    start = time.monotonic()
    message = str(_error_of(mode, cell, timeout=BACKSTOP_S))
    took = time.monotonic() - start
    assert "rank 0" in message and "NCCL's watchdog ended the rank" in message, message
    assert took < NCCL_TIMEOUT_S + 5 + (0 if mode == "live" else 10), took  # one-shot: + the ranks' start
    _check_rerun(mode, gpus)
