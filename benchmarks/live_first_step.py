"""Live set vs one-shot launch on GPUs: seconds from a training cell's start to its first step, and
steady tokens/s per GPU: what a live set must save over a fresh launch to be worth keeping.

    python benchmarks/live_first_step.py --out live_first_step.json            # 2 GPUs, the lead's run
    python benchmarks/live_first_step.py --gpus 2 --model tiny:qwen3-vl --seq-len 128 --batch 2 \
        --steps 4 --out /tmp/smoke.json                                        # CPU smoke test (gloo)

What runs (each rank: the same code, the benchmarks package's model building and synthetic batches):

- live: nbkit.start(gpus); cell "load": import the backend and build the LoRA model (unsloth when
  importable and on GPUs, else transformers+peft), kept on the ranks; cells "train 1" and "train 2":
  a transformers Trainer of --steps steps each, on the model already in memory. For each train cell:
  seconds from the cell's start to the end of its first optimizer step, and the steady step time
  (median of the steps after the first 2) as tokens/s per GPU.
- one-shot: nbkit.launch(fn) where fn imports, builds the model and trains the same way, as one
  %%ddp cell does today: seconds from the launch call to the first step, and tokens/s.

Each phase is recorded even when another fails (its error text in the JSON). Target, what makes a
live set worth keeping: the second live train cell reaches its first step within 5 s; tokens/s
within 3% of one-shot.
Timestamps are time.time() on one host, so ranks and the driver compare directly.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import traceback
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)  # the benchmarks package lives here


# --- what the ranks run (sent by value with cloudpickle: plain functions of this script) ----------


def _backend(device_type: str) -> str:
    if device_type != "cuda":
        return "nbkit"
    try:
        import importlib.util

        return "unsloth" if importlib.util.find_spec("unsloth") is not None else "nbkit"
    except Exception:
        return "nbkit"


def load(settings: dict) -> dict:
    """Build the LoRA model on this rank; keep it (and the batches) in a module for later calls."""
    sys.path.insert(0, settings["bench_dir"])
    import torch

    import nbkit
    from benchmarks import batches, models

    device = torch.device(nbkit.device())
    backend = settings["backend"] or _backend(device.type)
    precision = settings["precision"] if device.type == "cuda" else "fp32"
    start = time.time()
    model = models.build_model(backend, settings["path"], precision, device, max_seq_len=settings["seq_len"])
    config = model.config
    rows = [
        batches.synthetic_batch(config, settings["seq_len"], 1, "cpu", image=settings["image"], seed=i)
        for i in range(settings["batch"] * nbkit.world_size() * (settings["steps"] + 1))
    ]
    sys.modules["_nbkit_bench_state"] = type(sys)("_nbkit_bench_state")
    state = sys.modules["_nbkit_bench_state"]
    state.model, state.rows, state.backend, state.precision = model, rows, backend, precision
    return {"backend": backend, "precision": precision, "load_s": time.time() - start}


def train(settings: dict, cell_start: float) -> dict:
    """A short Trainer run on the model load() left on this rank; when its steps ended."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from benchmarks.measures import step_stats  # importable: load() put the checkout on sys.path

    state = sys.modules["_nbkit_bench_state"]
    step_ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, control_state: Any, control: Any, **kwargs: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_ends.append(time.time())

    def collate(items: list[dict]) -> dict:
        return {k: torch.cat([item[k] for item in items]) for k in items[0]}

    args = TrainingArguments(
        output_dir=settings["out_dir"],
        per_device_train_batch_size=settings["batch"],
        max_steps=settings["steps"],
        learning_rate=1e-4,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        remove_unused_columns=False,
        bf16=state.precision == "bf16",
        fp16=state.precision == "fp16",
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(
        model=state.model, args=args, train_dataset=state.rows, data_collator=collate, callbacks=[Clock()]
    )
    trainer.train()
    gaps = [b - a for a, b in itertools.pairwise(step_ends)][1:]  # after the first 2 steps
    step_s = step_stats(gaps)["median"] if gaps else None
    tokens = settings["batch"] * settings["seq_len"]
    return {
        "first_step_s": step_ends[0] - cell_start if step_ends else None,
        "steps": len(step_ends),
        "median_step_s": step_s,
        "tokens_per_s_per_gpu": tokens / step_s if step_s else None,
    }


def one_shot(settings: dict, cell_start: float) -> dict:
    """What a one-shot %%ddp cell does: import, build, train, all in one launch."""
    loaded = load(settings)
    return {**train(settings, cell_start), "load_s": loaded["load_s"], "backend": loaded["backend"]}


# --- the driver -------------------------------------------------------------------------------


def _phase(results: dict, name: str, fn: Any) -> None:
    start = time.time()
    try:
        results[name] = fn(start)
    except BaseException as exc:  # recorded; the next phase still runs
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        if isinstance(exc, KeyboardInterrupt):
            raise
    results[name]["wall_s"] = time.time() - start
    print(f"{name}: {json.dumps({k: v for k, v in results[name].items() if k != 'traceback'})}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--model", default="random:qwen3-vl-2b")
    parser.add_argument(
        "--backend", choices=["unsloth", "nbkit", "plain"], default=None, help="default: unsloth if importable"
    )
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    parser.add_argument("--steps", type=int, default=12, help="steps per training cell")
    parser.add_argument("--no-image", dest="image", action="store_false", help="text-only sequences")
    parser.add_argument("--skip-one-shot", action="store_true")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()

    import nbkit

    path = nbkit.resolve_model(args.model)
    settings = {
        "bench_dir": ROOT,
        "path": path,
        "backend": args.backend,
        "precision": args.precision,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "steps": args.steps,
        "image": args.image,
        "out_dir": os.path.join(os.path.dirname(os.path.abspath(args.out)), "live_first_step_trainer"),
    }
    results: dict[str, Any] = {"settings": {k: v for k, v in settings.items() if k != "bench_dir"}, "gpus": args.gpus}
    sys.path.insert(0, ROOT)
    from benchmarks import host

    results["environment"] = host.environment()

    ranks = None
    try:

        def start_set(_: float) -> dict:
            nonlocal ranks
            ranks = nbkit.start(gpus=args.gpus, timeout=540)
            return {"devices": [r.device for r in ranks.status().ranks]}

        _phase(results, "live_start", start_set)
        if ranks is not None:
            _phase(results, "live_load", lambda start: ranks.run(load, settings))
            _phase(results, "live_train_1", lambda start: ranks.run(train, settings, start))
            _phase(results, "live_train_2", lambda start: ranks.run(train, settings, start))
    finally:
        if ranks is not None:
            ranks.stop()
    if not args.skip_one_shot:
        _phase(results, "one_shot", lambda start: nbkit.launch(one_shot, settings, start, gpus=args.gpus, timeout=540))

    live, once = results.get("live_train_2", {}), results.get("one_shot", {})
    if live.get("tokens_per_s_per_gpu") and once.get("tokens_per_s_per_gpu"):
        results["live_vs_one_shot_tokens"] = live["tokens_per_s_per_gpu"] / once["tokens_per_s_per_gpu"]
    results["targets"] = {"live_train_2_first_step_s": 5.0, "tokens_ratio_at_least": 0.97}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
