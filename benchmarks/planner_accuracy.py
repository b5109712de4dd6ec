"""How close is nbkit.plan's memory estimate to the real peak? (one GPU, one command)

    python benchmarks/planner_accuracy.py --out planner_accuracy.json
    python benchmarks/planner_accuracy.py --seq-lens 1024,4096,16384 --checkpointing recompute --out p.json

For each sequence length: LoRA training of random:qwen3-vl-2b (nbkit.resolve_model; real shapes,
random bf16 weights) on cuda:0, bf16 weights trained under bf16 autocast, LoRA r=16 (alpha 16, no
dropout) on the language model's q/k/v/o/gate/up/down projections (the modules the planner counts),
nbkit's default savers (nbkit.savers.apply: offloaded checkpointing, tiled MLP, chunked loss; if
nbkit.savers is missing, transformers' non-reentrant gradient checkpointing instead, recorded as
such), batch 1 of synthetic tokens with one small image, AdamW. One warm-up step (AdamW's states
then exist, as in any step after the first), then one measured forward + backward + AdamW step:
torch.cuda.max_memory_allocated against Plan.peak_allocated_gib (the estimate without the CUDA
context, which the allocator never sees). Target: within +-20%.

Prints a table and a markdown block for benchmarks/RESULTS.md; writes every figure to --out.
A configuration that runs out of memory is recorded as "OOM" and the next one runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402

import nbkit  # noqa: E402
from benchmarks import host  # noqa: E402
from nbkit.notebook.planner import LORA_TARGET_MODULES  # noqa: E402

TARGET = 0.20
GIB = 2**30


def build(path: str, lora_rank: int, checkpointing: str | None) -> tuple[Any, str]:
    """The LoRA model on cuda:0 with nbkit's savers; returns (model, what saved memory)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa", device_map="cuda:0")
    model.config.use_cache = False
    torch.manual_seed(0)
    lora = LoraConfig(r=lora_rank, lora_alpha=lora_rank, lora_dropout=0.0, target_modules=list(LORA_TARGET_MODULES))
    model = get_peft_model(model, lora)
    try:
        import nbkit.savers
    except ImportError:
        if checkpointing is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        savers = "transformers non-reentrant checkpointing (nbkit.savers missing)"
    else:
        nbkit.savers.apply(model, checkpointing=checkpointing)
        savers = f"nbkit.savers.apply(checkpointing={checkpointing!r}, tiled_mlp=True, chunked_loss=True)"
    model.train()
    return model, savers


def batch_for(config: Any, seq_len: int, image: bool) -> dict[str, torch.Tensor]:
    import common  # benchmarks/common.py: the synthetic batches every nbkit benchmark uses

    return common.synthetic_batch(config, seq_len, 1, "cuda:0", image=image)


def step(model: Any, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def measure(model: Any, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    step(model, optimizer, batch)  # warm-up: AdamW's states are created here
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated() / GIB
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss = step(model, optimizer, batch)
    torch.cuda.synchronize()
    return {
        "measured_gib": torch.cuda.max_memory_allocated() / GIB,
        "resident_gib": resident,
        "reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "step_s": time.perf_counter() - start,
        "loss": loss,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:qwen3-vl-2b")
    parser.add_argument("--seq-lens", default="1024,16384", help="comma-separated token counts (batch 1)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--checkpointing", default="offload", choices=["offload", "recompute", "none"])
    parser.add_argument("--no-image", action="store_true", help="text-only batches")
    parser.add_argument("--out", default="planner_accuracy.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("planner_accuracy needs a CUDA GPU.", file=sys.stderr)
        return 2
    checkpointing = None if args.checkpointing == "none" else args.checkpointing
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    gpu = torch.cuda.get_device_properties(0)
    gpu_gib = gpu.total_memory / GIB
    result: dict[str, Any] = {
        "model": args.model,
        "gpu": gpu.name,
        "gpu_memory_gib": gpu_gib,
        "lora_rank": args.lora_rank,
        "lora_modules": list(LORA_TARGET_MODULES),
        "checkpointing": checkpointing,
        "environment": host.environment(),
        "target": f"+-{TARGET:.0%}",
        "rows": [],
    }
    path = nbkit.resolve_model(args.model)
    model, result["savers"] = build(path, args.lora_rank, checkpointing)
    config = model.config
    image = not args.no_image and getattr(config, "vision_config", None) is not None
    result["image"] = image
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    print(f"{args.model} on {gpu.name} ({gpu_gib:.1f} GiB), {result['savers']}")
    print(f"{'tokens':>8} {'estimate GiB':>13} {'measured GiB':>13} {'error':>8}  within +-{TARGET:.0%}")
    for seq_len in seq_lens:
        estimate = nbkit.plan(
            args.model,
            gpus=1,
            gpu_memory_gib=gpu_gib,
            seq_len=seq_len,
            batch_size=1,
            lora_rank=args.lora_rank,
            checkpointing=checkpointing,
        )
        row: dict[str, Any] = {
            "seq_len": seq_len,
            "estimate_gib": estimate.peak_allocated_gib,
            "estimate_breakdown_gib": estimate.breakdown,
            "plan": str(estimate),
        }
        try:
            row.update(measure(model, optimizer, batch_for(config, seq_len, image)))
        except torch.cuda.OutOfMemoryError as exc:
            row.update(measured_gib="OOM", error=str(exc).splitlines()[0])
            optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        if isinstance(row["measured_gib"], float):
            row["relative_error"] = row["estimate_gib"] / row["measured_gib"] - 1
            row["within_target"] = abs(row["relative_error"]) <= TARGET
            print(
                f"{seq_len:>8} {row['estimate_gib']:>13.2f} {row['measured_gib']:>13.2f} "
                f"{row['relative_error']:>+8.1%}  {'yes' if row['within_target'] else 'NO'}"
            )
        else:
            print(f"{seq_len:>8} {row['estimate_gib']:>13.2f} {'OOM':>13}")
        result["rows"].append(row)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print("\nFor benchmarks/RESULTS.md:\n")
    print(f"planner accuracy, {args.model} LoRA r={args.lora_rank}, {gpu.name}, {result['savers']}\n")
    print("| tokens | estimate (GiB) | measured max_memory_allocated (GiB) | error |")
    print("| --- | --- | --- | --- |")
    for row in result["rows"]:
        measured = row["measured_gib"]
        cells = (f"{measured:.2f}", f"{row['relative_error']:+.1%}") if isinstance(measured, float) else ("OOM", "-")
        print(f"| {row['seq_len']} | {row['estimate_gib']:.2f} | {cells[0]} | {cells[1]} |")
    print(f"\nwrote {args.out}")
    return 0 if all(row.get("within_target") for row in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
