"""Whether a live rank's host runs Python and torch slower than a launched rank's on this machine, and why it might.

    python3 benchmarks/rank_host_probe.py [--rounds 3] [--out probe.json] [--md probe.md]

A live set's ranks stepped 5-35% slower than `nbkit.launch`'s on H200s for the same training, their main threads
using more CPU for the same work (benchmarks/RESULTS.md). This probe takes that apart from training: it runs
host_placement's measurement (host microseconds per tiny op and per small matrix product, nanoseconds per Python loop
iteration and per Python function call, and per forward and backward of a small MLP) in a rank of `nbkit.launch` (forked) and in a rank of a live set
(`nbkit.start`, an ipyparallel engine), taking turns `--rounds` times, with one live set kept for all its rounds as
the notebooks keep theirs. Each measurement also records what the process has hooked into the interpreter: a trace
or profile function, the tools registered with sys.monitoring (Python 3.12+; a debugger's would slow every call),
how many debugger modules (debugpy, pydevd) are imported, and its thread count. One rank each, on one GPU where one
is visible, else on the CPU (then the figures say whether the script works, not how the GPU host behaves).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the benchmarks package lives in ROOT
    sys.path.insert(0, ROOT)

KEYS = ("add_us", "mm_us", "python_ns", "call_ns", "module_us")


def measure() -> dict[str, Any]:
    """Runs in a rank: host_placement's figures on this rank's device, and the interpreter's hooks."""
    import threading

    import torch

    if ROOT not in sys.path:  # a live rank is a fresh process
        sys.path.insert(0, ROOT)
    from benchmarks import host_placement

    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    figures = host_placement._measure(device)
    figures["module_us"] = _module_step_us(torch.device(device))
    monitoring = getattr(sys, "monitoring", None)
    tools = {} if monitoring is None else {i: monitoring.get_tool(i) for i in range(6) if monitoring.get_tool(i)}
    return {
        **figures,
        "device": device,
        "trace": repr(sys.gettrace()),
        "profile": repr(sys.getprofile()),
        "thread_trace": repr(getattr(threading, "_trace_hook", None)),
        "monitoring_tools": tools,
        "debugger_modules": sum(1 for name in list(sys.modules) if "pydevd" in name or "debugpy" in name),
        "os_threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
        "python": sys.version.split()[0],
    }


def _module_step_us(device: Any, steps: int = 300) -> float:
    """Host microseconds per forward and backward of a small 8-layer MLP (module calls, autograd), the median of
    3 rounds: a training step's host path in miniature.
    """
    import time

    import torch

    layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(8)]
    model = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(16, 64, device=device)
    rounds = []
    for _ in range(3):
        model(x).sum().backward()
        start = time.perf_counter()
        for _ in range(steps):
            model(x).sum().backward()
        rounds.append((time.perf_counter() - start) / steps * 1e6)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return round(statistics.median(rounds), 1)


def run(rounds: int) -> dict[str, Any]:
    """`rounds` turns of (a launched rank, a live rank); returns every measurement and the medians per path."""
    import nbkit

    results: dict[str, list[dict[str, Any]]] = {"launch": [], "live": []}
    live = nbkit.start(gpus=1)
    try:
        for _ in range(rounds):
            results["launch"].append(nbkit.launch(measure, gpus=1))
            results["live"].append(live.run(measure))
    finally:
        live.stop()
    medians = {
        path: {key: round(statistics.median(m[key] for m in runs), 2) for key in KEYS} for path, runs in results.items()
    }
    return {"rounds": results, "medians": medians}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| path | host us per add_ | host us per mm | ns per loop iteration | ns per call | us per MLP step | "
        "sys.monitoring tools | debugger modules | OS threads |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for path, runs in report["rounds"].items():
        med, last = report["medians"][path], runs[-1]
        lines.append(
            f"| {path} | {med['add_us']} | {med['mm_us']} | {med['python_ns']} | {med['call_ns']} | {med['module_us']} | "
            f"{last['monitoring_tools'] or 'none'} | {last['debugger_modules']} | {last['os_threads']} |"
        )
    live = report["rounds"]["live"]
    lines.append(f"\nDevice {live[0]['device']}, Python {live[0]['python']}, medians of {len(live)} rounds.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--md")
    args = parser.parse_args(argv)
    report = run(args.rounds)
    text = markdown(report)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
