r"""The ops a LoRA step dispatches with one process, under DDP and under one flat all-reduce, on 2 gloo CPU ranks.

    python3 benchmarks/ddp_op_count.py [--layers 28] [--out ddp_ops.json]

Why: at 1K x 4 a two-GPU step is bound by host work, and DDP's reducer adds work per trainable tensor, which LoRA
has many of (392 for a 28-layer Qwen3: A and B of 7 projections). An op that moves data (a copy, a multiply) is a
kernel launch on a GPU, ~6-7 us of host time each on an H200 (RESULTS.md), so the count of them per step says what
each way of averaging gradients costs the host, on any machine. The model is benchmarks/layer_host_cost.py's (the
layers of Qwen3-VL-2B's language model, hidden size 64); the counts are of one step (forward, backward, averaging,
AdamW) under torch's profiler, after warm-up steps. Prints, and writes with --out, every op whose count differs.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: the package lives one level up
    sys.path.insert(0, str(HERE.parent))

MODES = ("one", "ddp", "flat")


def count_ops(mode: str, layers: int, warmup: int = 3) -> dict[str, Any]:
    """On each rank (or the one process for "one"): the aten and c10d ops of one step, {name: count}, and the
    number of trainable tensors.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.layer_host_cost import narrow_lora_model
    from benchmarks.ranks import setup_rank, teardown_rank
    from benchmarks.stepping import FlatGradients

    setup_rank("cpu")
    model, batch = narrow_lora_model(layers)
    params = [p for p in model.parameters() if p.requires_grad]
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif mode == "flat":
        model = FlatGradients(model)
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def step() -> None:
        model(**batch).loss.backward()
        if isinstance(model, FlatGradients):
            model.reduce_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = collections.Counter(e.name for e in prof.events() if e.name.startswith(("aten::", "c10d::")))
    teardown_rank()
    return {"trainable_tensors": len(params), "ops": dict(ops)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--out")
    a = p.parse_args(argv)
    import nbkit
    from benchmarks import host

    runs = {mode: nbkit.launch(count_ops, mode, a.layers, gpus=1 if mode == "one" else 2) for mode in MODES}
    names = sorted(set().union(*(r["ops"] for r in runs.values())))
    differing = {n: [runs[m]["ops"].get(n, 0) for m in MODES] for n in names}
    differing = {n: c for n, c in differing.items() if len(set(c)) > 1}
    print(f"trainable tensors: {runs['one']['trainable_tensors']}; ops per step (one / ddp / flat):")
    print(
        f"  all aten ops: {' / '.join(str(sum(v for k, v in runs[m]['ops'].items() if k.startswith('aten::'))) for m in MODES)}"
    )
    for name, counts in differing.items():
        print(f"  {name}: {' / '.join(map(str, counts))}")
    host.publish(
        {"layers": a.layers, "trainable_tensors": runs["one"]["trainable_tensors"], "differing": differing}, a.out
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
