r"""FSDP-QLoRA on N GPUs against the same model split over them in one process (device_map="balanced").

Two runs of transformers' Trainer on the same model, LoRA (r=16 on the q/k/v/o/gate/up/down projections),
sequence length and examples per optimizer step:

- `fsdp`: nbkit.launch(gpus=N) with NBKIT_STRATEGY=fsdp (nbkit.fsdp: accelerate's FSDP2, full sharding,
  activation checkpointing), each rank training `--batch` sequences per step; 4-bit weights stored in the
  compute dtype (nbkit.fsdp.qlora_config) so that FSDP shards them;
- `balanced`: one process, `device_map="balanced"` over the same N GPUs (unsloth's way for large models on
  Kaggle's 2x T4), `--batch` x N sequences per step, the GPUs taking turns.

Both use nbkit's chunked loss (no full logits), the planner's assumption. `--t4` is the T4 profile: fp16,
each GPU capped at 15 GiB (torch's per-process memory fraction; NBKIT_EMULATE=T4 is also set for what the
ranks read of it). Per run: the median step time over the timed steps (benchmarks.measures.step_stats; the
first `--warmup` steps are left out), tokens/s over all GPUs, peak allocated memory per GPU, and the
planner's estimate of that peak (Plan.fsdp_breakdown / model_parallel_gib without the CUDA overhead).
With `--gpus 1` it is a dry run: FSDP with world size 1 against the model on one GPU, which also checks
the planner's per-rank FSDP estimate against the measured peak (target: within 15%).

    python3 benchmarks/fsdp_vs_balanced.py --model random:qwen3-14b --gpus 2 --t4 --seq-len 1024 --batch 1 \
        --out $OUT/fsdp_vs_balanced.json --md $OUT/fsdp_vs_balanced.md

Rows go to --out as JSON lines as soon as each run ends (a run that fails is a row with its error).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: the package lives one level up
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from benchmarks import batches, host, measures  # noqa: E402
from benchmarks.trainer_bench import TEXT_LORA, _timer_callback  # noqa: E402

T4_MEMORY_GIB = 15.0
LORA_RANK = 16


@dataclass(frozen=True)
class Run:
    """One side of the comparison."""

    mode: str  # "fsdp" | "balanced"
    model: str
    gpus: int
    seq_len: int
    batch: int  # sequences per step per FSDP rank; the balanced process takes batch x gpus
    steps: int
    warmup: int
    load_in_4bit: bool
    t4: bool

    @property
    def precision(self) -> str:
        from nbkit import distributed

        return "fp16" if self.t4 else distributed.precision()


def _dtype(run: Run) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(run.precision, torch.float32)


def _cap(device: int) -> None:
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, T4_MEMORY_GIB * 2**30 / total), device)


def _model(run: Run, path: str) -> Any:
    """The model with LoRA and nbkit's chunked loss, loaded for `run.mode`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from nbkit import fsdp, savers

    dtype = _dtype(run)
    options: dict[str, Any] = {"dtype": dtype}
    if run.load_in_4bit:
        options["quantization_config"] = fsdp.qlora_config(dtype)
    if run.mode == "balanced":
        options["device_map"] = "balanced"
        if run.t4:
            options["max_memory"] = {i: f"{T4_MEMORY_GIB:g}GiB" for i in range(run.gpus)}
    base = AutoModelForCausalLM.from_pretrained(path, **options)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, target_modules=TEXT_LORA))
    # FSDP checkpoints the layers itself; the balanced run checkpoints them with nbkit's savers.
    checkpointing = None if run.mode == "fsdp" else "recompute"
    return savers.apply(model, checkpointing=checkpointing, tiled_mlp=False, chunked_loss=True)


def _train(run: Run, path: str, per_step: int) -> dict:
    """A Trainer run of run.steps steps of `per_step` sequences in this process; this process's figures."""
    from transformers import AutoConfig, Trainer, TrainingArguments

    cuda = torch.cuda.is_available()  # without: a CPU smoke run (gloo ranks, no peaks)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    model = _model(run, path)
    config = AutoConfig.from_pretrained(path)
    count = per_step * run.steps
    data = [
        {k: v[0] for k, v in batches.synthetic_batch(config, run.seq_len, 1, "cpu", seed=i).items()}
        for i in range(count)
    ]
    timer = _timer_callback(device)
    devices = [torch.device("cuda", i) for i in range(run.gpus)] if run.mode == "balanced" and cuda else [device]
    for each in devices:
        measures.reset_memory(each)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=run.steps,
            per_device_train_batch_size=per_step,
            learning_rate=2e-4,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            fp16=run.precision == "fp16",
            bf16=run.precision == "bf16",
            disable_tqdm=True,
            seed=0,
            use_cpu=not cuda,
        )
        Trainer(model=model, args=args, train_dataset=data, callbacks=[timer]).train()
    peaks = [measures.peak_memory_gib(each) for each in devices]
    return {"step_times_s": timer.times, "peak": peaks}


def _fsdp_rank(run: Run, path: str) -> list[dict]:
    """One FSDP rank (under nbkit.launch): capped like a T4 where asked; every rank's figures, on rank 0."""
    from benchmarks.ranks import gather

    if run.t4 and torch.cuda.is_available():
        _cap(int(os.environ.get("LOCAL_RANK", "0")))
    return gather(_train(run, path, run.batch))


def _measure(run: Run) -> dict:
    """Run one side; its row (status "ok", or "oom"/"error" with the message)."""
    import nbkit

    path = nbkit.resolve_model(run.model)
    row: dict[str, Any] = asdict(run) | {"precision": run.precision}
    try:
        if run.mode == "fsdp":
            env = {"NBKIT_STRATEGY": "fsdp", **({"NBKIT_EMULATE": "T4"} if run.t4 else {})}
            ranks = nbkit.launch(_fsdp_rank, run, path, gpus=run.gpus, env=env, timeout=3600, dashboard=False)
        else:
            if run.t4 and torch.cuda.is_available():
                for index in range(run.gpus):
                    _cap(index)
            ranks = [_train(run, path, run.batch * run.gpus)]
    except Exception as exc:  # recorded: the other side still runs
        oom = "out of memory" in str(exc).lower()
        return row | {"status": "oom" if oom else "error", "error": f"{type(exc).__name__}: {exc}"[-2000:]}
    finally:
        gc.collect()
    times = ranks[0]["step_times_s"][run.warmup :]
    stats = measures.step_stats(times)
    peaks = [p["allocated"] for rank in ranks for p in rank["peak"] if p is not None]
    return row | {
        "status": "ok",
        "median_step_s": stats["median"],
        "step_stats": stats,
        "tokens_per_s": run.seq_len * run.batch * run.gpus / stats["median"],  # the same tokens per step in both
        "peak_allocated_gib": peaks,
        "planned_gib": _planned(run),
    }


def _planned(run: Run) -> float:
    """The planner's peak allocated memory per GPU for this run (its estimate less the CUDA overhead)."""
    import nbkit

    plan = nbkit.plan(
        run.model,
        gpus=run.gpus,
        gpu_memory_gib=T4_MEMORY_GIB if run.t4 else 80.0,
        seq_len=run.seq_len,
        batch_size=run.batch,
        load_in_4bit=run.load_in_4bit,
        lora_rank=LORA_RANK,
        checkpointing="recompute",
    )
    if run.mode == "fsdp":
        return plan.fsdp_gib - plan.fsdp_breakdown["overhead"]
    return plan.model_parallel_gib - plan.breakdown["overhead"]


def markdown(rows: list[dict], command: str, env: dict) -> str:
    """The results as a markdown table, with the command and the machine."""
    v = env["versions"]
    lines = [
        f"`{command}`",
        "",
        f"{env['date']}, {env['gpu_count']} x {env['gpu']} ({env['gpu_memory_gib']} GiB), driver {env['driver']}; "
        f"torch {v['torch']}, transformers {v['transformers']}, accelerate {v['accelerate']}, peft {v['peft']}, "
        f"bitsandbytes {v['bitsandbytes']}, nbkit {v['nbkit']}.",
        "",
        "| run | model | GPUs | weights | seq x batch/GPU | s/step (median) | tokens/s (all GPUs) | peak GiB per GPU | "
        "planned GiB | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ok = r["status"] == "ok"
        peak = ", ".join(f"{p:.2f}" for p in r.get("peak_allocated_gib", [])) if ok else "-"
        lines.append(
            f"| {r['mode']} | {r['model']} | {r['gpus']} | {'4-bit' if r['load_in_4bit'] else '16-bit'} "
            f"{r['precision']} | {r['seq_len']} x {r['batch']} | "
            f"{r['median_step_s']:.3f} | {r['tokens_per_s']:,.0f} | {peak} | {r['planned_gib']:.2f} | ok |"
            if ok
            else f"| {r['mode']} | {r['model']} | {r['gpus']} | {'4-bit' if r['load_in_4bit'] else '16-bit'} | "
            f"{r['seq_len']} x {r['batch']} | - | - | - | - | {r['status']}: {r.get('error', '')[:120]} |"
        )
    fsdp, balanced = ({r["mode"]: r for r in rows if r["status"] == "ok"}.get(m) for m in ("fsdp", "balanced"))
    if fsdp and balanced:
        lines += ["", f"FSDP / balanced tokens/s: {fsdp['tokens_per_s'] / balanced['tokens_per_s']:.2f}x."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:qwen3-14b", help="nbkit name, hub id or path (a causal LM)")
    p.add_argument("--gpus", type=int, default=2, help="GPUs for both runs (1: the dry run)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1, help="sequences per FSDP rank per step (balanced: x gpus)")
    p.add_argument("--steps", type=int, default=8, help="Trainer steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    p.add_argument("--16bit", dest="four_bit", action="store_false", help="16-bit weights instead of 4-bit")
    p.add_argument("--t4", action="store_true", help="the T4 profile: fp16, 15 GiB per GPU")
    p.add_argument("--modes", default="fsdp,balanced", help="which runs, in order (fsdp first: no CUDA before it)")
    p.add_argument("--out", type=Path, required=True, help="JSON lines, one per run")
    p.add_argument("--md", type=Path, help="markdown table")
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        p.error("--warmup must be below --steps (the median needs timed steps)")
    rows = []
    for mode in args.modes.split(","):
        run = Run(
            mode, args.model, args.gpus, args.seq_len, args.batch, args.steps, args.warmup, args.four_bit, args.t4
        )
        row = _measure(run)
        rows.append(row)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k != "step_stats"}), flush=True)
    if args.md:
        args.md.write_text(markdown(rows, " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), host.environment()))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
