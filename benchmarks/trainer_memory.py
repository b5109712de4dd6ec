r"""Where a step's peak memory goes under SFTTrainer, against the same model stepped by hand (one GPU).

    python3 benchmarks/trainer_memory.py [--backend unsloth] [--shape 16384x1] [--out $OUT/trainer_memory.json]

Why: trainer_bench.py measured unsloth's peak at 16K tokens under TRL's SFTTrainer at 18.4 GiB, against
13.8 GiB for bench.py's plain loop on the same GPU type. This script takes the model of trainer_bench.py
(same loader, LoRA, collator, one small image per sample) and measures, in one process, the peak allocated
memory of one forward + backward:

1. `plain`: `model(**batch).loss.backward()`, as bench.py steps;
2. `plain_after_sft_init`: the same call once an SFTTrainer has been built on the model (TRL >= 1.15 wraps the
   model's forward with its fused LM head at __init__; unsloth replaces SFTTrainer.compute_loss);
3. `compute_loss`: `trainer.compute_loss(model, batch, num_items_in_batch=N)` + backward, as Trainer's
   training_step calls it (N: the batch's label count, as Trainer passes it);
4. `train`: `trainer.train()` for 3 steps.

For each: peak GiB, the size of `outputs.logits` (a full (tokens, vocab) tensor means the fused loss was not
taken), UNSLOTH_RETURN_LOGITS as the forward saw it, and the five largest tensors allocated during the phase
with the Python frames that allocated them (torch.cuda.memory._record_memory_history).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import host, trainer_bench  # noqa: E402

GIB = 2**30


def _largest_allocations(snapshot: dict, top: int = 5) -> list[dict]:
    """The `top` largest allocations recorded in `snapshot`, with their innermost Python frames."""
    allocs = [e for trace in snapshot.get("device_traces", []) for e in trace if e.get("action") == "alloc"]
    allocs.sort(key=lambda e: -e["size"])
    out = []
    for e in allocs[:top]:
        frames = [
            f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
            for f in e.get("frames", [])
            if f.get("filename", "").endswith(".py") and "/torch/" not in f["filename"]
        ]
        out.append({"gib": e["size"] / GIB, "frames": frames[:6]})
    return out


def _phase(name: str, device: torch.device, fn: Any) -> dict:
    """Run `fn` (returns the forward's logits) and measure it; on a CPU (a smoke run) only the logits' shape."""
    cuda = device.type == "cuda"
    snapshot: dict = {}
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    before = torch.cuda.memory_allocated(device) / GIB if cuda else None
    try:
        logits = fn()
        if cuda:
            torch.cuda.synchronize(device)
            snapshot = torch.cuda.memory._snapshot()
    finally:
        if cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
    row = {
        "phase": name,
        "allocated_before_gib": before,
        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
        "logits_shape": list(logits.shape) if isinstance(logits, torch.Tensor) else None,
        "unsloth_return_logits": os.environ.get("UNSLOTH_RETURN_LOGITS"),
        "largest_allocations": _largest_allocations(snapshot),
    }
    print(json.dumps(row, indent=1), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=trainer_bench.BACKENDS, default="unsloth")
    p.add_argument("--model", default=None, help="default: random:qwen3-vl-2b on GPUs, tiny:qwen3-vl on CPUs")
    p.add_argument("--shape", default=None, help="default: 16384x1 on GPUs, 128x1 on CPUs (a smoke run)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import nbkit

    nbkit.install()  # as nbkit.launch does in every rank
    cuda = torch.cuda.is_available()
    model_name = a.model or ("random:qwen3-vl-2b" if cuda else "tiny:qwen3-vl")
    seq_len, batch = trainer_bench._shape(a.shape or ("16384x1" if cuda else "128x1"))
    launch = trainer_bench.Launch(
        backend=a.backend,
        gpus=1,
        launcher="notebook",
        model=model_name,
        model_path=nbkit.resolve_model(model_name),
        device="cuda" if cuda else "cpu",
        precision="bf16" if cuda else "fp32",
        quant="16bit",
        shapes=[(seq_len, batch)],
        results_path="",
    )
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = trainer_bench.build_model(launch, device)
    collate = trainer_bench._Collator(trainer_bench.common_config(launch), seq_len, launch.sample_image)
    inputs = {k: v.to(device) for k, v in collate([0] * batch).items()}
    items = int((inputs["labels"][..., 1:] != -100).sum())
    rows = []

    model.train()  # as Trainer does before its first step

    def plain() -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out = model(**inputs)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        return out.logits

    rows.append(_phase("plain", device, plain))
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = trainer_bench._trainer(
            launch, model, seq_len, batch, 3, out_dir, trainer_bench._timer_callback(device)
        )
        rows.append(_phase("plain_after_sft_init", device, plain))

        def compute_loss() -> None:
            # As Trainer's training step calls it: without the outputs, which trl 1.16 builds with a second,
            # full-logits forward (deprecated there) where they are asked for.
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(
                    trainer.model, dict(inputs), num_items_in_batch=torch.tensor(items, device=device)
                )
            loss.backward()
            trainer.model.zero_grad(set_to_none=True)

        rows.append(_phase("compute_loss", device, compute_loss))
        rows.append(_phase("train", device, lambda: trainer.train() and None))
    text = json.dumps({"environment": host.environment(), "shape": [seq_len, batch], "rows": rows}, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    for r in rows:
        peak = "" if r["peak_gib"] is None else f"peak {r['peak_gib']:.2f} GiB, "
        print(f"{r['phase']:>22}: {peak}logits {r['logits_shape']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
