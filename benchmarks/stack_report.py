"""Where the training processes' main threads spent their time, from the samples of stack_sampler/.

    python benchmarks/stack_report.py FOLDER [--top N] [--timeline SECONDS] [--md OUT.md]

FOLDER holds the stacks-PID.txt files that benchmarks/stack_sampler/sitecustomize.py wrote. For each process
with samples: their count and span, the frames most often on the stack (inclusive: a frame counts once per
sample), and the innermost frames (where the thread was). Each sample stands for the sampling interval, so a
frame's share of the samples is its share of the training loop's wall time on that thread. --timeline adds,
for each window of that many seconds, the share of samples inside torch.compile's compiler (TorchDynamo's
frame conversion or Inductor) and the most common innermost frames: a rank that compiles while the other
waits in a collective shows there.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

# Frames of torch.compile's compiler: a sample with one of them on the stack is compiling.
_COMPILER = ("convert_frame.py:", "compile_fx.py:")


def timeline(times: list[float], stacks: list[list[str]], window: float) -> list[str]:
    """Markdown rows: per window, its samples, the share compiling and the most common innermost frames."""
    windows: dict[int, list[list[str]]] = collections.defaultdict(list)
    for seconds, frames in zip(times, stacks):
        windows[int(seconds // window)].append(frames)
    rows = ["", "| from s | samples | compiling | innermost (3 frames, most common) |", "|---:|---:|---:|---|"]
    for index in sorted(windows):
        samples = windows[index]
        compiling = sum(any(f.startswith(_COMPILER) for f in frames) for frames in samples) / len(samples)
        inner = collections.Counter(" < ".join(reversed(frames[-3:])) for frames in samples).most_common(1)[0]
        share = inner[1] / len(samples)
        rows.append(f"| {index * window:g} | {len(samples)} | {compiling:.0%} | `{inner[0]}` ({share:.0%}) |")
    return rows


def summarise(path: Path, top: int, window: float | None = None) -> str:
    """One process's tables in markdown."""
    stacks = []
    times = []
    for line in path.read_text().splitlines():
        seconds, _, stack = line.partition("\t")
        if stack:
            times.append(float(seconds))
            stacks.append(stack.split(";"))
    if not stacks:
        return ""
    inclusive: collections.Counter[str] = collections.Counter()
    innermost: collections.Counter[str] = collections.Counter()
    for frames in stacks:
        inclusive.update(set(frames))
        innermost[frames[-1]] += 1
    n = len(stacks)
    lines = [
        f"### {path.name}: {n} samples over {times[-1] - times[0]:.1f} s",
        "",
        "| frame (on the stack) | share |",
        "|---|---:|",
    ]
    lines += [f"| `{frame}` | {count / n:.0%} |" for frame, count in inclusive.most_common(top)]
    lines += ["", "| frame (innermost) | share |", "|---|---:|"]
    lines += [f"| `{frame}` | {count / n:.0%} |" for frame, count in innermost.most_common(top)]
    if window:
        lines += timeline(times, stacks, window)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--timeline", type=float, metavar="SECONDS")
    parser.add_argument("--md", type=Path)
    args = parser.parse_args()
    tables = [summarise(path, args.top, args.timeline) for path in sorted(args.folder.glob("stacks-*.txt"))]
    text = "\n".join(t for t in tables if t) or f"no samples in {args.folder}\n"
    if args.md:
        args.md.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
