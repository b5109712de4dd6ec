"""Soak: many nbkit.launch calls (or live-set cells) in a row, alternating success and failure,
watching for growth.

    python benchmarks/soak.py [--n 200] [--gpus 2] [--out soak.json]
    python benchmarks/soak.py --kind live [--n 200] [--gpus 2] [--out soak-live.json]

Launch i succeeds when i is even; odd launches fail, cycling through the faults that end a rank
differently (an exception, os._exit(0), SIGKILL mid-all-reduce, a hang stopped by a 2 s timeout).
Every launch is checked: a success returns its value, a failure raises LaunchError naming the
rank and cause that was injected. After each launch the process's descriptors, Python threads,
child processes, /dev/shm entries and resident memory are sampled. The JSON printed (and written
to --out) holds the time per launch (median, p95, max, per outcome), the first and last sample
and the growth between them (taken after --warmup launches, which create what a process keeps
for good, such as torch's first TCPStore pipe), and any launch whose outcome was wrong.

`--kind live` runs cells on one live set (nbkit.start) instead: cell i succeeds when i is even (it
adds to a counter that stays on the ranks, and the value returned must be the number of successes
so far on this set); odd cells fail, cycling through eight: six cells that raise on rank 1 (the set stays
up and keeps its counter), one where rank 1 ends itself with os._exit(3) (the set ends, naming it)
and one stuck in a collective past a 2 s timeout (the set ends); after a set ends, the next cell
starts a new one (its start-up counted in that cell's time, reported as "restart + ..."). For the
live kind, samples are taken only after plain successes, so that every sample sees a running set.

Runs on CPU (gloo ranks) or GPUs alike.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the benchmarks package lives in ROOT
    sys.path.insert(0, str(ROOT))

import nbkit  # noqa: E402
from benchmarks import host  # noqa: E402
from benchmarks.leftovers import Snapshot  # noqa: E402
from benchmarks.measures import percentile, step_stats  # noqa: E402


def _group() -> Any:
    import torch.distributed as dist

    backend = "nccl" if __import__("torch").cuda.is_available() else "gloo"
    if backend == "nccl":
        __import__("torch").cuda.set_device(nbkit.local_rank())
    dist.init_process_group(backend)
    return dist


def succeeds() -> int:
    dist = _group()
    t = __import__("torch").ones(1, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def raises() -> None:
    dist = _group()
    if nbkit.rank() == 1:
        raise ValueError("soak: injected failure")
    dist.barrier()


def exits() -> None:
    dist = _group()
    if nbkit.rank() == 1:
        os._exit(0)
    dist.barrier()


def killed() -> None:
    dist = _group()
    t = __import__("torch").ones(1024, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    for step in range(1000):
        if step == 2 and nbkit.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)


def hangs() -> None:
    dist = _group()
    if nbkit.rank() == 0:
        dist.barrier()
    time.sleep(60)


# (function, timeout, what the LaunchError must start with; None: it must succeed)
FAULTS: list[tuple[Callable[[], Any], float | None, str]] = [
    (raises, None, "rank 1 failed"),
    (exits, None, "rank 1 exited with code 0"),
    (killed, None, "rank 1 died from signal SIGKILL"),
    (hangs, 2.0, "The launch did not finish within the timeout"),
]


def launch_iteration(i: int, gpus: int) -> tuple[str, str | None]:
    """One launch: even i succeeds, odd i fails with the next fault. Returns (kind, problem)."""
    if i % 2 == 0:
        value = nbkit.launch(succeeds, gpus=gpus, dashboard=False)
        expected = gpus
        return "success", None if value == expected else f"returned {value!r}, expected {expected}"
    fn, timeout, lead = FAULTS[(i // 2) % len(FAULTS)]
    try:
        nbkit.launch(fn, gpus=gpus, timeout=timeout, dashboard=False)
    except nbkit.LaunchError as exc:
        return fn.__name__, None if str(exc).startswith(lead) else f"message {str(exc)[:200]!r}"
    return fn.__name__, "did not fail"


# --kind live: (code for the failing cell, timeout, text the LiveError must contain, the set survives)
_RAISES = (
    "import nbkit\nif nbkit.rank() == 1:\n    raise ValueError('cell fails')",
    None,
    "ValueError: cell fails",
    True,
)
LIVE_FAULTS = [
    _RAISES,
    _RAISES,
    _RAISES,
    ("import os, nbkit\nif nbkit.rank() == 1:\n    os._exit(3)", None, "exited with code 3", False),
    _RAISES,
    _RAISES,
    _RAISES,
    (
        "import time, nbkit, torch.distributed as dist\nif nbkit.rank() == 1:\n    time.sleep(60)\ndist.barrier()",
        2.0,
        "timeout",
        False,
    ),
]
_live: dict[str, Any] = {"ranks": None, "successes": 0}


def live_iteration(i: int, gpus: int) -> tuple[str, str | None]:
    """One cell on the live set (started anew where the last one ended). Returns (kind, problem)."""
    restarted = _live["ranks"] is None
    if restarted:
        _live["ranks"], _live["successes"] = nbkit.start(gpus=gpus), 0
    ranks = _live["ranks"]
    if i % 2 == 0:
        value = ranks.exec("counter = globals().get('counter', 0) + 1\ncounter")
        _live["successes"] += 1
        kind = "restart + success" if restarted else "success"
        return kind, None if value == _live["successes"] else f"returned {value!r}, expected {_live['successes']}"
    code, timeout, expected, survives = LIVE_FAULTS[(i // 2) % len(LIVE_FAULTS)]
    kind = ("restart + " if restarted else "") + ("raises" if survives else "ends the set")
    try:
        ranks.exec(code, timeout=timeout)
    except nbkit.LiveError as exc:
        if not survives:
            ranks.stop()
            _live["ranks"] = None
        elif not ranks.status().running:
            return kind, "the set ended after a cell that only raised"
        return kind, None if expected in str(exc) else f"message {str(exc)[:300]!r}"
    return kind, "did not fail"


ITERATIONS = {"launch": launch_iteration, "live": live_iteration}


def sample() -> dict[str, float]:
    """What a leak would grow: descriptors, threads, children, /dev/shm entries, ..., RSS (MiB):
    the counts of the snapshot the fault tests compare before and after each case.
    """
    return Snapshot.take().counts()


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "median_s": round(step_stats(values)["median"], 3),
        "p95_s": round(percentile(values, 0.95), 3),
        "max_s": round(max(values), 3),
    }


def soak(n: int, gpus: int, warmup: int, kind: str = "launch") -> dict[str, Any]:
    """Run `n` iterations of `kind`; return the report (see the module doc)."""
    iteration = ITERATIONS[kind]
    times: dict[str, list[float]] = {}
    problems = []
    first: dict[str, float] = {}
    peak: dict[str, float] = {}
    last: dict[str, float] = {}
    for i in range(n):
        start = time.monotonic()
        outcome, problem = iteration(i, gpus)
        times.setdefault(outcome, []).append(time.monotonic() - start)
        if problem:
            problems.append({"iteration": i, "kind": outcome, "problem": problem})
        if kind == "live" and outcome != "success":
            continue  # a sample with the set running, or with it ended, would not compare
        now = sample()
        if not first and i + 1 >= warmup:
            first = now
        if i + 1 >= warmup:
            peak = {k: max(v, peak.get(k, v)) for k, v in now.items()}
            last = now
    if _live["ranks"] is not None:
        _live["ranks"].stop()
        _live["ranks"] = None
    gc.collect()
    after_gc = sample()
    return {
        "kind": kind,
        "iterations": n,
        "gpus": gpus,
        "warmup": warmup,
        "time_per_launch": {k: _stats(v) for k, v in times.items()},
        "all_launches": _stats([t for v in times.values() for t in v]),
        "first_sample": first,
        "last_sample": last,
        "peak_sample": peak,
        "after_gc": after_gc,
        "growth": {k: round(last[k] - first[k], 1) for k in first},
        "wrong_outcomes": problems,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="iterations (default 200)")
    parser.add_argument("--gpus", type=int, default=2, help="ranks per launch (CPU: gloo processes)")
    parser.add_argument("--warmup", type=int, default=4, help="iterations before the first sample")
    parser.add_argument("--kind", choices=sorted(ITERATIONS), default="launch")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    host.publish(soak(args.n, args.gpus, min(args.warmup, args.n), args.kind), args.out)


if __name__ == "__main__":
    main()
