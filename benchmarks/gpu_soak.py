"""GPU soak of live sets: cycles of start a set, load a tiny model, 3 DDP training steps, stop; memory and
processes must stay flat.

    python benchmarks/gpu_soak.py [--cycles 20] [--gpus 2] [--model tiny:qwen3] [--out gpu_soak.json]

Each cycle is what a notebook does with `%ddp start`, a cell that loads the model, a cell of 3 steps and
`%ddp stop`, through the API those magics call (nbkit.start, LiveRanks.exec, LiveRanks.stop). After each
stop it records, once the GPUs are released or 10 s have passed: the memory in use on each GPU and the
processes with a context on them (NVML, benchmarks/gpu_state.py; none on CPU ranks), this process's
children, descriptors and threads (benchmarks/leftovers.py), the seconds of each phase and the losses.
The JSON (printed, and written to --out) holds every cycle, the growth from the first cycle's sample to
the last, and `flat`: no process left on a GPU, GPU memory back within gpu_state.TOLERANCE_MIB of what it
was before the first cycle, and no child process left behind. Exits 1 where it is not flat.

Runs on CPU ranks (gloo) too, for a dry run: `python benchmarks/gpu_soak.py --cycles 3`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the benchmarks package lives in ROOT
    sys.path.insert(0, str(ROOT))

import nbkit  # noqa: E402  (first: the notebook side must stay free of a CUDA context)
from benchmarks import host  # noqa: E402
from benchmarks.gpu_state import GpuSample, still_held  # noqa: E402
from benchmarks.leftovers import Snapshot  # noqa: E402

# The notebook's cells, run on every rank. The model goes on the rank's own device (nbkit's guard places
# a load without a device map there), wrapped in DDP over the set's process group.
_LOAD = """\
import torch, nbkit
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(PATH)
on_gpu = nbkit.device().startswith("cuda")
ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if on_gpu else None)
optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
str(next(model.parameters()).device)
"""
_TRAIN = """\
losses = []
g = torch.Generator().manual_seed(nbkit.rank())
for step in range(3):
    ids = torch.randint(8, 1000, (2, 32), generator=g).to(nbkit.device())
    loss = ddp(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(round(loss.item(), 4))
losses
"""


def cycle(path: str, gpus: int) -> dict[str, Any]:
    """One start, load, 3 steps, stop; returns its seconds per phase, the device, the losses and the GPUs
    while the set ran.
    """
    times = [time.monotonic()]
    ranks = nbkit.start(gpus=gpus)
    try:
        times.append(time.monotonic())
        device = ranks.exec(_LOAD, names={"PATH": path})
        times.append(time.monotonic())
        losses = ranks.exec(_TRAIN)
        times.append(time.monotonic())
        running = GpuSample.take()
    finally:
        ranks.stop()
    times.append(time.monotonic())
    phases = ("start", "load", "train", "stop")
    return {
        "seconds": {phase: round(b - a, 2) for phase, a, b in zip(phases, times, times[1:])},
        "device_rank0": device,
        "losses_rank0": losses,
        "gpus_while_running": running.as_dict() if running else None,
    }


def soak(cycles: int, gpus: int, model: str, out: str | None = None) -> dict[str, Any]:
    """`cycles` cycles (see the module doc); returns the JSON-ready result, also written to `out` after every
    cycle, so that a run cut short by its time limit (10 of 20 cycles fit 300 s on 2x H100) still says what
    the cycles it ran left behind.
    """
    path = nbkit.resolve_model(model)
    before_gpus = GpuSample.take()
    first: Snapshot | None = None
    records = []
    for i in range(cycles):
        record: dict[str, Any] = {"cycle": i, **cycle(path, gpus)}
        record["gpus_held_after_stop"] = still_held(before_gpus)
        after = GpuSample.take()
        record["gpus_after_stop"] = after.as_dict() if after else None
        snapshot = Snapshot.take()
        first = first or snapshot
        record["process"] = snapshot.counts()
        record["left_since_first_cycle"] = snapshot.grown_since(first)
        records.append(record)
        print(f"cycle {i}: {record['seconds']} held={record['gpus_held_after_stop']}", file=sys.stderr, flush=True)
        if out:
            Path(out).write_text(json.dumps(_result(cycles, gpus, model, before_gpus, records), indent=2, default=str))
    return _result(cycles, gpus, model, before_gpus, records)


def _result(cycles: int, gpus: int, model: str, before_gpus: GpuSample | None, records: list[dict]) -> dict[str, Any]:
    last = records[-1]
    growth = {k: round(v - records[0]["process"][k], 1) for k, v in last["process"].items()}
    flat = all(not r["gpus_held_after_stop"] for r in records) and not any(
        "child processes" in r["left_since_first_cycle"] for r in records
    )
    return {
        "cycles": cycles,
        "cycles_run": len(records),
        "gpus": gpus,
        "model": model,
        "gpus_before": before_gpus.as_dict() if before_gpus else None,
        "records": records,
        "process_growth_first_to_last": growth,
        "flat": flat,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--gpus", type=int, default=2, help="ranks per set (CPU: gloo processes)")
    parser.add_argument("--model", default="tiny:qwen3")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    result = soak(args.cycles, args.gpus, args.model, args.out)
    host.publish(result, args.out)
    sys.exit(0 if result["flat"] else 1)


if __name__ == "__main__":
    main()
