"""torch's profiler with with_stack=True in two gloo processes, without nbkit: how many runs end in a crash.

    python repro.py [--runs 8] [--windows 150] [--modes ddp+gather,plain,alone]

Each run starts two fresh Python processes (rank 0 and 1, gloo on this CPU). Each builds an 8-layer MLP and
profiles `--windows` windows of two training steps, with_stack=True, reading the events after each window.
Modes: "ddp+gather" (the model under DDP, an all_gather per step, as a Trainer step has), "plain" (the process
group set up, no collective in the window) and "alone" (one process, no process group). A run counts as crashed
when a process dies from a signal or raises.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys


def rank_main(mode: str, windows: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    if mode != "alone":
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model: torch.nn.Module = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    if mode == "ddp+gather":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(windows):
        prof = profile(activities=[ProfilerActivity.CPU], with_stack=True)
        prof.start()
        for _ in range(2):
            model(torch.randn(8, 64)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if mode == "ddp+gather":
                dist.all_gather([torch.zeros(1), torch.zeros(1)], torch.ones(1))
        prof.stop()
        len(prof.key_averages())
    if mode != "alone":
        dist.destroy_process_group()


def one_run(mode: str, windows: int) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-mode", mode, "--windows", str(windows)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in range(1 if mode == "alone" else 2)
    ]
    return [p.wait(timeout=600) for p in procs]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--windows", type=int, default=150)
    p.add_argument("--modes", default="ddp+gather,plain,alone")
    p.add_argument("--rank-mode", default=None)
    a = p.parse_args()
    if a.rank_mode:
        rank_main(a.rank_mode, a.windows)
        return
    import torch

    result: dict = {"torch": torch.__version__, "python": sys.version.split()[0], "windows": a.windows, "modes": {}}
    for mode in a.modes.split(","):
        codes = [one_run(mode, a.windows) for _ in range(a.runs)]
        result["modes"][mode] = {"exit_codes": codes, "crashed_runs": sum(any(c != 0 for c in run) for run in codes)}
        print(mode, result["modes"][mode], flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
