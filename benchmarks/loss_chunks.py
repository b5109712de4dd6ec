r"""The causal-LM loss by rows per chunk: time and peak memory of nbkit's chunked loss and of Liger's fused one.

    python3 benchmarks/loss_chunks.py [--tokens 4096,16384] [--rows auto,1,64,256,512,1024,4096] \
        [--kernels nbkit,liger] [--dtypes bf16,fp16] [--out loss_chunks.json] [--md loss_chunks.md]

Why: a chunked loss reads the whole lm_head weight twice per chunk (the logits, then the hidden states'
gradient). Liger sizes its chunks by the tokens alone (1/75 of them for a 152K vocabulary and hidden size
2048: 64 rows at 4K tokens), so at 1K x 4 its 64 chunks read Qwen3-VL-2B's 622 MB head 128 times. nbkit
gives each kernel chunks of about 256 MiB of logits (nbkit.savers.loss.rows_per_chunk).

One GPU, Qwen3-VL-2B's head shape (vocab x hidden, frozen as under LoRA), random hidden states that require
grad, labels with every tenth ignored (image and prompt tokens). Each case goes through
nbkit.savers.loss.linear_cross_entropy with `chunk_size` rows: `auto` is the kernel's default as nbkit
sets it, a number is that many rows (for Liger: its chunks' bound, rounded down to a power of two; 1
gives Liger's own choice). Per case, after 3 warm-up calls:
the median wall time of forward + backward over 10 calls (CUDA synchronised around each), and the peak
memory above what was allocated before the call.

On a CPU (`--device cpu`, nbkit's loop only) it runs the same cases small: a smoke test of the script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: the package lives in ROOT
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import host  # noqa: E402
from nbkit.training.savers import liger, loss  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def rows_for(spec: str) -> int | None:
    """Rows per chunk for a --rows entry: `auto` (None: the kernel's default as nbkit sets it) or a number."""
    return None if spec == "auto" else int(spec)


def measure(kernel: str, tokens: int, rows: int | None, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, Any]:
    """One case: forward + backward of the loss over `tokens` rows in chunks of `rows`; times and peak."""
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, args.hidden, device=device, dtype=dtype, generator=g).requires_grad_()
    weight = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype, generator=g) / args.hidden**0.5
    labels = torch.randint(0, args.vocab, (tokens,), device=device, generator=g)
    labels[::10] = -100
    fused = liger.fused_linear_cross_entropy if kernel == "liger" else None

    def call() -> float:
        hidden.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss.linear_cross_entropy(hidden, weight, labels, chunk_size=rows, shift=False, kernel=fused).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for _ in range(args.warmup):
        call()
    peak = None
    if device.type == "cuda":
        hidden.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        call()
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    times = [call() for _ in range(args.repeats)]
    return {"ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times), "peak_extra_gib": peak}


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        f"Machine: {env['gpu_count']}x {env['gpu']} ({env['gpu_memory_gib']} GiB), {env['cpu_count']} CPUs; "
        f"torch {env['versions']['torch']}, liger-kernel {_liger_version()}; {env['date']}.",
        "",
        f"Command: `{' '.join(env.get('argv', []))}`",
        "",
        f"vocab {result['vocab']} x hidden {result['hidden']}; forward + backward, median of {result['repeats']}.",
        "",
        "| kernel | dtype | tokens | rows asked | chunks | ms | peak extra GiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["cases"]:
        peak = "" if r.get("peak_extra_gib") is None else f"{r['peak_extra_gib']:.2f}"
        ms = f"{r['ms']:.1f}" if "ms" in r else r.get("error", "")[:80]
        lines.append(
            f"| {r['kernel']} | {r['dtype']} | {r['tokens']} | {r['rows_spec']} ({r['rows']}) | {r['chunks']} "
            f"| {ms} | {peak} |"
        )
    return "\n".join(lines) + "\n"


def _liger_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None


def chunks_of(kernel: str, tokens: int, rows: int, vocab: int, hidden: int) -> int:
    """How many chunks the kernel makes of `tokens` rows when bounded by `rows` (Liger: its own sizing rule)."""
    if kernel != "liger":
        return -(-int(tokens * 0.9) // rows)  # nbkit's loop skips the ignored tenth
    c = liger.chunk_mem_const(rows, tokens, vocab, hidden)
    per = -(-tokens // -(-vocab // (c * hidden)))
    size = min(1 << (per - 1).bit_length(), tokens)
    return -(-tokens // size)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--rows", default="auto,1,64,256,512,1024,4096")
    p.add_argument("--kernels", default="nbkit,liger")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out")
    p.add_argument("--md")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cases = []
    for dtype_name in a.dtypes.split(","):
        for tokens in (int(t) for t in a.tokens.split(",")):
            for kernel in a.kernels.split(","):
                for spec in a.rows.split(","):
                    if kernel == "nbkit" and spec == "1":
                        continue  # Liger's own choice; one-row chunks of nbkit's loop are not a setting anyone uses
                    rows = rows_for(spec)
                    row: dict[str, Any] = {"kernel": kernel, "dtype": dtype_name, "tokens": tokens, "rows_spec": spec}
                    bound = rows or loss.rows_per_chunk(
                        a.vocab, logit_bytes=4 if kernel == "nbkit" else DTYPES[dtype_name].itemsize
                    )
                    row.update(rows=bound, chunks=chunks_of(kernel, tokens, bound, a.vocab, a.hidden))
                    try:
                        row.update(measure(kernel, tokens, rows, DTYPES[dtype_name], a))
                    except Exception as exc:  # an OOM or a kernel failure is a result; the next case runs
                        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    print(row, flush=True)
                    cases.append(row)
    result = {"vocab": a.vocab, "hidden": a.hidden, "repeats": a.repeats, "cases": cases}
    host.publish(result, a.out)
    if a.md:
        Path(a.md).write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
