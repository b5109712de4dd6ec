"""What the per-step stop agreement of a live set costs (nbkit.rank_side.live_stopping).

    python benchmarks/stop_agreement.py [--gpus 2] [--steps 300] [--elements 1000000] [--out stop_agreement.json]

Runs --gpus ranks under nbkit.launch (gloo on CPUs; on GPUs nccl, one per GPU). Each "step" stands in for a
DDP optimizer step: an all-reduce of --elements float32 values on the default group (the gradient
all-reduce; on GPUs followed by a CUDA synchronize), then, in the measured variant, the agreement exactly
as a live rank runs it at on_step_end (nbkit.rank_side.live_stopping._Run.step_end: wait for the previous step's
flag all-reduce on the run's gloo group, start this step's). Reports, on rank 0, per step: the host time
spent inside step_end (median, p90, max, in microseconds; and of it the wait for the previous step's
flag, timed on its own just before), the step's wall time with and without the agreement (medians,
alternating blocks of 50 steps so that load on a shared machine hits both alike), and the time to make
the run's gloo group (once per train()).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the benchmarks package lives in ROOT (the forked ranks inherit it)
    sys.path.insert(0, ROOT)

from benchmarks import host  # noqa: E402
from benchmarks.measures import step_stats  # noqa: E402


def measure(steps: int, elements: int) -> dict[str, Any]:
    """In each rank: the agreement's cost (see the module doc); rank 0's figures are returned."""
    import torch
    import torch.distributed as dist

    from nbkit.rank_side import live_stopping

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    grads = torch.ones(elements, device="cuda" if cuda else "cpu")
    made = time.perf_counter()
    run = live_stopping._Run()
    group_ms = (time.perf_counter() - made) * 1000
    control = SimpleNamespace(should_training_stop=False)
    inside: list[float] = []
    waited: list[float] = []
    with_agreement: list[float] = []
    without: list[float] = []
    for block in range(2 * max(1, steps // 50)):
        agree = block % 2 == 0
        for _ in range(50):
            start = time.perf_counter()
            dist.all_reduce(grads)
            if cuda:  # the step's GPU work done, as where Trainer reads the loss at a step's end
                torch.cuda.synchronize()
            if agree:
                before = time.perf_counter()
                if run._pending is not None:  # the previous flag's all-reduce: how long it is still awaited
                    run._pending.wait()
                waited.append((time.perf_counter() - before) * 1e6)
                before = time.perf_counter()
                run.step_end(0, control)
                inside.append((time.perf_counter() - before) * 1e6 + waited[-1])
            (with_agreement if agree else without).append((time.perf_counter() - start) * 1e3)
        if agree:  # the last flag all-reduce in flight is read before the next block without agreement
            run.end(failed=False)
            run = live_stopping._Run()
    run.end(failed=False)
    assert not control.should_training_stop
    inside_us, waited_us = step_stats(inside), step_stats(waited)
    return {
        "ranks": dist.get_world_size(),
        "gradient_all_reduce": "nccl" if cuda else "gloo",
        "elements": elements,
        "steps_each": len(inside),
        "step_end_us": {key: round(inside_us[key], 1) for key in ("median", "p90", "max")},
        "of_which_waiting_us": {key: round(waited_us[key], 1) for key in ("median", "p90")},
        "step_ms_with_agreement_median": round(step_stats(with_agreement)["median"], 3),
        "step_ms_without_median": round(step_stats(without)["median"], 3),
        "new_group_ms_first": round(group_ms, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2, help="ranks")
    parser.add_argument("--steps", type=int, default=300, help="steps with the agreement (as many without)")
    parser.add_argument("--elements", type=int, default=1_000_000, help="float32 values in the stand-in gradient")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    import nbkit

    host.publish(nbkit.launch(measure, args.steps, args.elements, gpus=args.gpus, dashboard=False), args.out)


if __name__ == "__main__":
    main()
