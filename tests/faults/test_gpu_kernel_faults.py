"""The fault matrix on two GPUs over NCCL, seen from a real Jupyter kernel during `trainer.train()` of a tiny
LoRA model: the stop button (an interrupt) in a one-shot %%ddp cell (forked, spawned) and on a live set,
`%ddp stop` right after it, and the kernel killed mid-training.

What the user relies on: the cell ends within seconds saying what stopped; a live set keeps its ranks and
names after the stop button and `%ddp stop` then ends them; nothing holds either GPU afterwards (NVML: no new
process, memory back to what it was); the next cell or `%ddp start` works at once.

`pytest -m gpu` on a machine with 2 GPUs; SUITE_DRY_RUN=1 runs the same cases on 2 CPU ranks (gloo).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from faultkit import MARGIN_S, Kernel, still_running

from benchmarks.gpu_state import GpuSample, still_held

ON_GPUS = torch.cuda.device_count() >= 2
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ON_GPUS or os.environ.get("SUITE_DRY_RUN")), reason="needs 2 CUDA GPUs"),
]

# From the interrupt (or the kill) to the cell's end (or the ranks' end): 2 s targets; CPU dry runs share
# a loaded machine.
STOP_S = 5.0 if ON_GPUS else 5.0 + MARGIN_S
MODES = {"fork": "%%ddp --gpus 2", "spawn": "%%ddp --gpus 2 --spawn", "live": "%%ddp"}

# Trains for minutes unless stopped; rank 0 says "training" at the end of step 3.
_TRAIN = """
import sys, nbkit
sys.path.insert(0, REPO)  # the ranks import the tests' shared set-up from the checkout
import tests.tiny_training as tiny
from transformers import TrainerCallback

class Announce(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3 and nbkit.rank() == 0:
            print("training", flush=True)

trainer = tiny.saving_trainer(
    PATH, OUT, samples=20000, max_steps=10000, callbacks=[Announce()], save_strategy="no", logging_steps=1000
)
trainer.train()
"""
_NEXT = "import nbkit, torch.distributed as dist\nnbkit.world_size() + nbkit.rank()"


def _prepare(kernel: Kernel, tiny_text_path: str, out: Path) -> None:
    repo = str(Path(__file__).resolve().parents[2])
    ready = kernel.run(f"%load_ext nbkit\nimport nbkit\nREPO, PATH, OUT = {repo!r}, {tiny_text_path!r}, {str(out)!r}")
    assert ready["error"] is None, ready


@pytest.fixture
def gpus() -> Iterator[GpuSample | None]:
    """The GPUs before the case (None on CPU ranks); nothing may hold either of them after it."""
    before = GpuSample.take()
    assert before is not None or not ON_GPUS, "neither NVML nor nvidia-smi answers: nothing could check the GPUs"
    yield before
    assert still_held(before) == {}


@pytest.fixture
def fresh_kernel(kernel_name: str, tmp_path: Path, tiny_text_path: str) -> Iterator[Kernel]:
    with Kernel(kernel_name, tmp_path) as k:
        _prepare(k, tiny_text_path, tmp_path / "out")
        yield k


@pytest.mark.parametrize("mode", ["fork", "spawn"])
def test_the_stop_button_during_training_stops_every_rank_and_frees_the_gpus(mode, fresh_kernel, gpus):
    out = fresh_kernel.run(f"{MODES[mode]}\n{_TRAIN}", interrupt_on="training", timeout=300)
    assert out["error"] is not None and out["error"].ename == "KeyboardInterrupt", out
    assert out["seconds"] < STOP_S, out["seconds"]
    assert "nbkit: interrupted; stopped ranks 0, 1." in out["stderr"], out
    assert still_held(gpus) == {}
    assert fresh_kernel.run(f"{MODES[mode]}\n{_NEXT}")["result"] == "2"


def test_the_stop_button_then_ddp_stop_during_training_of_a_live_set(fresh_kernel, gpus):
    assert fresh_kernel.run("%ddp start --gpus 2")["error"] is None
    engines = fresh_kernel.descendants()
    out = fresh_kernel.run(f"{MODES['live']}\n{_TRAIN}", interrupt_on="training", timeout=300)
    assert out["seconds"] < STOP_S, out["seconds"]
    assert re.search(r"training stopped at step \d+ on every rank; the live set and its names", out["stderr"]), out
    assert fresh_kernel.run("%%ddp\nint(trainer.state.global_step > 0)")["result"] == "1"  # the names stayed
    start = time.monotonic()
    stopped = fresh_kernel.run("%ddp stop")
    assert stopped["error"] is None, stopped
    assert still_running(engines, within=STOP_S) == [] and time.monotonic() - start < STOP_S + 1
    assert still_held(gpus) == {}
    started = fresh_kernel.run("%ddp start --gpus 2")  # at once, on the GPUs the last set had
    assert started["error"] is None and "live set of 2 rank(s)" in started["stdout"], started
    assert fresh_kernel.run(f"%%ddp\n{_NEXT}")["result"] == "2"
    assert fresh_kernel.run("%ddp stop")["error"] is None


@pytest.mark.parametrize("mode", list(MODES))
def test_a_kernel_killed_during_training_takes_its_ranks_and_frees_the_gpus(
    mode, kernel_name, tmp_path, tiny_text_path, gpus
):
    kernel = Kernel(kernel_name, tmp_path)
    try:
        _prepare(kernel, tiny_text_path, tmp_path / "out")
        if mode == "live":
            assert kernel.run("%ddp start --gpus 2")["error"] is None
        msg_id = kernel.start(f"{MODES[mode]}\n{_TRAIN}")
        seen = ""
        for kind, content in kernel.messages(msg_id, timeout=300):
            seen += content.get("text", "") if kind == "stream" else ""
            if "training" in seen:
                break
        assert "training" in seen, seen
        ranks = kernel.descendants()
        os.kill(kernel.pid, signal.SIGKILL)  # no atexit, no cleanup: only what nbkit set up beforehand
        assert still_running(ranks, within=STOP_S) == [], "processes outlived their kernel"
    finally:
        kernel.close()
    assert still_held(gpus) == {}
    with Kernel(kernel_name, tmp_path) as again:
        _prepare(again, tiny_text_path, tmp_path / "out")
        if mode == "live":
            assert again.run("%ddp start --gpus 2")["error"] is None
        assert again.run(f"{MODES[mode]}\n{_NEXT}")["result"] == "2"
        if mode == "live":
            assert again.run("%ddp stop")["error"] is None
