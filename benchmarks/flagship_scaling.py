"""Two runs of a notebook side by side from their summary.json files: steady pace, and the second against the first.

    python benchmarks/flagship_scaling.py ONE/summary.json TWO/summary.json
    python benchmarks/flagship_scaling.py "16-bit=A/summary.json" "4-bit=B/summary.json"

A row is named for its summary's run folder (the one above the notebook's), or by LABEL=PATH.

Each summary is what nbkit.run_summary.write() left (the shipped notebooks' last cell). The steady figures are
medians over the steps after the first (which holds compilation and warm-up); tokens/s there is one rank's, so
a run's throughput is that times its processes. The last column is the throughput against the first file's.
A summary that is missing or has no steady tokens/s is named on stderr and left out of the table; the exit
status is then 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def throughput(summary: dict[str, Any]) -> float:
    """Tokens/s of the whole run: rank 0's steady tokens/s times the processes (ranks see like batches).

    Raises ValueError when the summary has no steady tokens/s (a run outside a rank nbkit started).
    """
    train = summary["train"]
    if not train.get("tokens_per_second"):
        raise ValueError("no steady tokens/s (train.tokens_per_second)")
    return float(train["tokens_per_second"]) * int(train["batch"]["processes"])


def table(summaries: list[tuple[str, dict[str, Any]]]) -> str:
    """Markdown: one row per run, its throughput against the first run's in the last column."""
    lines = [
        "| run | backend | precision | 4-bit | checkpointing | batch (per GPU x accumulation x processes) | "
        "steady s/step | first step s | mean s/step | tokens/s per GPU | tokens/s | peak GiB | against the first |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = throughput(summaries[0][1])
    for name, s in summaries:
        t, b, total = s["train"], s["train"]["batch"], throughput(s)
        lines.append(
            f"| {name} | {s.get('backend')} | {s.get('precision')} | {s.get('load_in_4bit')} | "
            f"{s.get('checkpointing', '')} | {b['per_device']} x {b['accumulation']} x {b['processes']} | "
            f"{t['seconds_per_step']:.3f} | "
            f"{t['first_step_seconds']:.1f} | {t['mean_seconds_per_step']:.3f} | {t['tokens_per_second']:,.0f} | "
            f"{total:,.0f} | {t['peak_memory_gib']:.2f} | {total / base:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summaries", nargs="+", help="summary.json files, each PATH or LABEL=PATH")
    args = parser.parse_args()
    loaded, failed = [], False
    for given in args.summaries:
        label, _, rest = given.rpartition("=")
        path = Path(rest)
        try:
            summary = json.loads(path.read_text())
            throughput(summary)
        except (OSError, ValueError, KeyError) as exc:
            print(f"{path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed = True
            continue
        loaded.append((label or path.parent.parent.name, summary))
    if loaded:
        print(table(loaded))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
