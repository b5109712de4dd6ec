"""What a trivial cell costs on a live set (nbkit.start), on the CPU.

    python benchmarks/live_overhead.py [--gpus 2] [--cells 50] [--starts 1] [--out live_overhead.json]

Measures, on one live set of N gloo ranks (CUDA ranks where GPUs are visible and --gpus is left
out), the wall time of
- `ranks.exec("1")`: the Python API, every rank, rank 0's value back;
- a `%%ddp` cell with the body `1`, run through IPython's own cell machinery in this process
  (InteractiveShell.run_cell: transforms, the magic, the names it sends along, the display hook);
- `ranks.exec("1", ranks=0)`: one rank.
Each: the median, 10th and 90th percentile of --cells runs after 5 warm-up runs, in milliseconds,
plus the seconds nbkit.start took (the median of --starts sets started one after another). Target:
the median of a trivial %%ddp cell <= 50 ms, so that a cell on a live set answers about as fast as
one in the kernel itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the benchmarks package lives in ROOT
    sys.path.insert(0, ROOT)

from benchmarks import host  # noqa: E402
from benchmarks.measures import step_stats  # noqa: E402


def _timed(fn: Callable[[], object], runs: int, warmup: int = 5) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    stats = step_stats(times)
    return {
        "median_ms": round(stats["median"], 2),
        "p10_ms": round(stats["p10"], 2),
        "p90_ms": round(stats["p90"], 2),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2, help="ranks (gloo CPU processes where there is no GPU)")
    parser.add_argument("--cells", type=int, default=50, help="timed runs of each kind")
    parser.add_argument("--starts", type=int, default=1, help="sets started (and stopped) to time nbkit.start")
    parser.add_argument("--out", default=None, help="write the figures as JSON here too")
    args = parser.parse_args()
    if args.starts < 1:
        parser.error("--starts must be at least 1")

    from IPython.core.interactiveshell import InteractiveShell

    import nbkit

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbkit", store_history=False)
    starts: list[float] = []
    for i in range(args.starts):
        start = time.perf_counter()
        ranks = nbkit.start(gpus=args.gpus)
        starts.append(round(time.perf_counter() - start, 2))
        if i < args.starts - 1:
            ranks.stop()
    try:

        def ddp_cell() -> None:
            result = shell.run_cell("%%ddp\n1", store_history=False, silent=True)
            result.raise_error()

        figures = {
            "ranks": ranks.world_size,
            "devices": sorted({r.device for r in ranks.status().ranks}),
            "start_s": round(step_stats(starts)["median"], 2),
            "start_runs_s": starts,
            "exec_all_ranks": _timed(lambda: ranks.exec("1"), args.cells),
            "ddp_cell": _timed(ddp_cell, args.cells),
            "exec_rank0": _timed(lambda: ranks.exec("1", ranks=0), args.cells),
        }
    finally:
        ranks.stop()
    figures["target_ddp_cell_median_ms"] = 50
    host.publish(figures, args.out)


if __name__ == "__main__":
    main()
