"""nbkit.savers benchmark: peak GPU memory and step time of each memory saver under 2-GPU DDP.

    python benchmarks/savers.py --out savers.json                    # default matrix, < 8 min on 2x H200
    python benchmarks/savers.py --unsloth --out savers.json          # + unsloth FastVisionModel
    python benchmarks/savers.py --configs all,offload --seq-lens 64k --time-budget 900 --out long.json

Model: --model (default random:qwen3-vl-2b: Qwen3-VL-2B shapes, random bf16 weights, built locally),
LoRA r=16 on all linear layers, bf16 weights trained under bf16 autocast, DDP over --gpus GPUs,
batch 1 per GPU of --seq-lens tokens each with one small image (64 image tokens), median step time
over --steps steps after --warmup warm-up steps, peak memory = torch.cuda.max_memory_allocated per GPU.

Configurations (--configs):
  plain         transformers' non-reentrant gradient checkpointing, no savers (the baseline)
  recompute     nbkit checkpointing="recompute"
  offload       nbkit checkpointing="offload" (layer inputs in pinned host memory)
  tiled_mlp     recompute + tiled MLP      (tiling's cost: tiled_mlp vs recompute)
  chunked_loss  recompute + chunked loss
  all           offload + tiled MLP + chunked loss (nbkit.savers.apply defaults)
  unsloth       unsloth FastVisionModel, use_gradient_checkpointing="unsloth" (also with --unsloth)
Savers change only the language model: the vision tower keeps transformers' checkpointing everywhere.
A saver "alone" runs on top of recompute checkpointing, as a saver without any checkpointing would
only measure the activations of 28 unsaved layers.

How it runs: one launch trains every transformers configuration on one loaded model, switching with
nbkit.savers.apply / remove between cases; unsloth gets its own launch in a fresh process (its import
patches transformers). Cases run shortest first, all configurations at up to 16K tokens, then `all`
and `plain` at the longer lengths, then the rest. Each case starts with a probe step on the bare
model and the ranks agree on its outcome before DDP (benchmarks/runner.py), so an OOM is recorded
and the run goes on; longer lengths of a configuration that ran out of memory are not tried. A case
whose predicted time no longer fits in --time-budget is recorded as skipped, and the command that
measures what was skipped is printed. Results: --out (JSON, rewritten as cases finish) and a
markdown table (--md, default --out with .md), also printed, with the savers' targets at 16K.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script (python benchmarks/savers.py): the package lives there
    sys.path.insert(0, str(HERE.parent))

from benchmarks import bench, cases, host, launching, models, ranks, runner  # noqa: E402

# name -> nbkit.savers.apply options (None: the plain model, savers removed)
SAVER_CONFIGS: dict[str, dict[str, Any] | None] = {
    "all": dict(checkpointing="offload", tiled_mlp=True, chunked_loss=True),
    "plain": None,
    "recompute": dict(checkpointing="recompute", tiled_mlp=False, chunked_loss=False),
    "offload": dict(checkpointing="offload", tiled_mlp=False, chunked_loss=False),
    "tiled_mlp": dict(checkpointing="recompute", tiled_mlp=True, chunked_loss=False),
    "chunked_loss": dict(checkpointing="recompute", tiled_mlp=False, chunked_loss=True),
}
ALL_CONFIGS = list(SAVER_CONFIGS) + ["unsloth"]
DEFAULT_CONFIGS = list(SAVER_CONFIGS)
# Configurations measured at every length before the others get the longer lengths.
PRIMARY = ("all", "plain", "unsloth")
EVERY_CONFIG_UP_TO = 16384
TARGET_LEN = 16384
DEFAULT_BUDGET_S = 450.0
UNSLOTH_SHARE_S = 240.0
# Step time grows between linearly (projections) and quadratically (attention) with the length.
_TIME_EXPONENT = 1.5
_CASE_OVERHEAD_S = 8.0


# ---------------------------------------------------------------------------------------------
# What runs in each rank
# ---------------------------------------------------------------------------------------------


def predict_step_s(history: dict[tuple[str, int], float], config: str, seq_len: int) -> float | None:
    """Expected seconds per step of `config` at `seq_len` from the medians measured so far, or None.

    From the same configuration at its longest shorter length; else the slowest configuration
    measured at this length; else the slowest at the longest shorter length measured.
    """
    own = [(length, t) for (name, length), t in history.items() if name == config and length < seq_len]
    if own:
        length, t = max(own)
        return t * (seq_len / length) ** _TIME_EXPONENT
    same = [t for (_, length), t in history.items() if length == seq_len]
    if same:
        return max(same)
    shorter = [length for (_, length) in history if length < seq_len]
    if not shorter:
        return None
    longest = max(shorter)
    return max(t for (_, length), t in history.items() if length == longest) * (seq_len / longest) ** _TIME_EXPONENT


def _run_ranks(spec: cases.LaunchSpec, plan: list[tuple[str, int]], deadline: float) -> list[dict]:
    """The per-rank job: one loaded model trained under every saver configuration of `plan` in turn."""
    import nbkit.savers

    launch = runner.Launch(spec)
    try:

        def case_of(seq_len: int) -> cases.Case:
            precision = "bf16" if launch.device.type == "cuda" else "fp32"
            return cases.Case(seq_len, 1, precision, cases.parse_ddp_options(""))

        def label(config: str) -> None:
            launch.labels = {"config": config, "savers": SAVER_CONFIGS[config]}

        first = case_of(plan[0][1])
        model, load_s, failure = launch.load(first.precision, max(length for _, length in plan))
        if not ranks.agree(failure is None):
            for config, length in plan:
                label(config)
                launch.record(launch.failed(case_of(length), failure is None, failure, phase="load", load_s=load_s))
            return launch.results
        history: dict[tuple[str, int], float] = {}
        out_of_memory: dict[str, int] = {}
        for config, length in plan:
            label(config)
            case = case_of(length)
            predicted = predict_step_s(history, config, length)
            needed = None if predicted is None else (spec.warmup + spec.steps) * predicted + _CASE_OVERHEAD_S
            skip = None
            if config in out_of_memory:
                skip = f"not tried: out of memory at {out_of_memory[config]} tokens"
            elif needed is not None and time.time() + needed > deadline:
                skip = f"time budget: needs about {needed:.0f} s"
            skip = ranks.gather(skip)[0]  # rank 0 decides for everyone
            if skip is not None:
                launch.record(launch.row(case, status="skipped", error=skip))
                continue
            options = SAVER_CONFIGS[config]
            if options is None:
                nbkit.savers.remove(model)
            else:
                nbkit.savers.apply(model, **options)
            row = launch.run_case(model, case, load_s)
            launch.record(row)
            if row["status"] == "ok":
                history[(config, length)] = row["step_time_s"]["median"]
            elif row["status"] == "oom":
                out_of_memory[config] = length
        return launch.results
    finally:
        ranks.teardown_rank()


# ---------------------------------------------------------------------------------------------
# The driver (no CUDA here: the ranks are forked from this process)
# ---------------------------------------------------------------------------------------------


def _tokens(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def plan_cases(configs: list[str], seq_lens: list[int]) -> list[tuple[str, int]]:
    """(configuration, length) in the order they run: every configuration up to 16K tokens, then
    the primary ones (all, plain) at the longer lengths, then the rest; shortest first in each tier.
    """

    def key(pair: tuple[str, int]) -> tuple[int, int, int]:
        config, length = pair
        tier = 0 if length <= EVERY_CONFIG_UP_TO or config in PRIMARY else 1
        return tier, length, configs.index(config)

    return sorted(((c, n) for c in configs for n in seq_lens), key=key)


def _spec(
    args: argparse.Namespace,
    backend: str,
    model_path: str,
    device: str,
    spec_cases: list[cases.Case],
    results_path: str = "",
    **fields: Any,
) -> cases.LaunchSpec:
    """A LaunchSpec under nbkit.launch with the command line's GPUs, model, steps, LoRA rank and images."""
    return cases.LaunchSpec(
        backend=backend,
        gpus=args.gpus,
        launcher="nbkit",
        model=args.model,
        model_path=model_path,
        device=device,
        cases=spec_cases,
        results_path=results_path,
        steps=args.steps,
        warmup=args.warmup,
        lora_r=args.lora_r,
        image=not args.no_image,
        **fields,
    )


def _main_launch(
    args: argparse.Namespace, plan: list[tuple[str, int]], model_path: str, device: str, deadline: float, workdir: Path
) -> list[dict]:
    """Run `plan` in as few launches as it takes: a launch that dies (a hang after an OOM on one rank
    only, a crash) costs the case it was on, and the rest runs in a new launch.
    """
    import nbkit

    rows: list[dict] = []
    for attempt in range(3):
        if not plan or time.time() > deadline - 30:
            break
        spec = _spec(
            args,
            "plain",
            model_path,
            device,
            [],
            results_path=str(workdir / f"main-{attempt}.jsonl"),
            collective_timeout_s=120.0,
        )
        models.preload(spec)  # what a notebook would have imported before launching
        spec.launched_at = time.time()
        failure = None
        try:
            nbkit.launch(
                _run_ranks,
                spec,
                plan,
                deadline,
                gpus=args.gpus,
                quiet=True,
                dashboard=False,
                timeout=max(60.0, deadline - time.time() + 90),
            )
        except Exception as exc:  # a failed launch: keep what it recorded, go on without its current case
            failure = f"{type(exc).__name__}: {exc}"
        done, _ = launching.read_rows(Path(spec.results_path))
        rows += done
        finished = {(r["config"], r["seq_len"]) for r in done}
        plan = [pair for pair in plan if pair not in finished]
        if failure is None or not plan:
            break
        config, length = plan.pop(0)
        status = "oom" if "out of memory" in failure.lower() else "error"
        print(
            f"savers.py: the launch failed during {config} at {length} tokens ({status}); {len(plan)} case(s) left",
            flush=True,
        )
        rows.append(
            {
                "config": config,
                "seq_len": length,
                "batch": 1,
                "status": status,
                "error": failure[:4000],
                "phase": "launch",
            }
        )
        if status == "oom":
            plan = [(c, n) for c, n in plan if not (c == config and n > length)]
    for config, length in plan:
        rows.append(
            {
                "config": config,
                "seq_len": length,
                "batch": 1,
                "status": "skipped",
                "error": "time budget: the launch ended before this case",
            }
        )
    return rows


def _unsloth_launch(
    args: argparse.Namespace, seq_lens: list[int], model_path: str, deadline: float, workdir: Path
) -> list[dict]:
    spec = _spec(
        args, "unsloth", model_path, "cuda", [cases.Case(n, 1, "bf16", cases.parse_ddp_options("")) for n in seq_lens]
    )
    timeout = max(60.0, min(UNSLOTH_SHARE_S, deadline - time.time()))
    rows = bench.run_one(spec, workdir, 0, timeout)
    for row in rows:
        row["config"] = "unsloth"
    return rows


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _ok(rows: list[dict], config: str, length: int) -> dict | None:
    return next((r for r in rows if r["config"] == config and r["seq_len"] == length and r["status"] == "ok"), None)


def _peak(row: dict | None) -> float | None:
    return max(row["peak_allocated_gib"]) if row and row.get("peak_allocated_gib") else None


def _median(row: dict | None) -> float | None:
    return row["step_time_s"]["median"] if row else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(rows: list[dict], length: int = TARGET_LEN) -> list[dict]:
    """The savers' performance targets at `length` tokens: what was measured and whether it holds."""

    def target(name: str, value: float | None, limit: float, shown: str) -> dict:
        verdict = "n/a" if value is None else ("PASS" if value <= limit else "FAIL")
        return {
            "target": name,
            "value": value,
            "limit": limit,
            "shown": "" if value is None else shown.format(value),
            "verdict": verdict,
        }

    everything, unsloth = _ok(rows, "all", length), _ok(rows, "unsloth", length)
    recompute = _ok(rows, "recompute", length)
    return [
        target("all savers: peak memory <= 1.1x unsloth's", _ratio(_peak(everything), _peak(unsloth)), 1.1, "{:.2f}x"),
        target("all savers: step time <= unsloth's", _ratio(_median(everything), _median(unsloth)), 1.0, "{:.2f}x"),
        target(
            "tiled MLP: step time <= 1.10x recompute-only",
            _ratio(_median(_ok(rows, "tiled_mlp", length)), _median(recompute)),
            1.10,
            "{:.3f}x",
        ),
        target(
            "offload: step time <= 1.05x recompute-only",
            _ratio(_median(_ok(rows, "offload", length)), _median(recompute)),
            1.05,
            "{:.3f}x",
        ),
    ]


def markdown(report: dict) -> str:
    env, rows, s = report["environment"], report["results"], report["settings"]
    machine = (
        f"{env['gpu_count']}x {env['gpu']} ({env['gpu_memory_gib']} GiB), driver {env['driver']}, CUDA {env['cuda']}"
        if env["gpu_count"]
        else f"CPU only ({env['cpu_count']} cores; gloo ranks)"
    )
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    lines = [
        "# nbkit.savers benchmark",
        "",
        f"- Machine: {machine}; host {env['host']}",
        f"- Versions: {versions}; Python {env['python']}",
        f"- Date: {env['date']}; total {report['wall_s']:.0f} s (time budget {s['time_budget_s']:.0f} s)",
        f"- Model: {s['model']}, LoRA r={s['lora_r']} on all linear layers, {s['gpus']}-GPU DDP, batch 1 per GPU"
        f"{', one 64-token image per sequence' if s['image'] else ', text only'}; median of {s['steps']} steps after "
        f"{s['warmup']} warm-up steps (probe included); peak = max over GPUs of torch.cuda.max_memory_allocated",
        f"- Command: `{report['command']}`",
        "",
        "| config | tokens | status | s/step (median) | spread p10-p90 | tok/s/GPU | peak GiB/GPU | peak vs plain "
        "| step vs recompute |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["seq_len"], ALL_CONFIGS.index(r["config"]))):
        if r["status"] != "ok":
            why = (r.get("error") or "").strip().splitlines()[0:1]
            lines.append(
                f"| {r['config']} | {r['seq_len']} | {r['status']}: {bench._short(why[0] if why else '')} | | | | | | |"
            )
            continue
        peak = _peak(r)
        vs_plain = _ratio(peak, _peak(_ok(rows, "plain", r["seq_len"])))
        vs_recompute = _ratio(_median(r), _median(_ok(rows, "recompute", r["seq_len"])))
        lines.append(
            f"| {r['config']} | {r['seq_len']} | ok | {_median(r):.3f} | {r['step_time_s']['spread_pct']:.1f}% "
            f"| {r['tokens_per_s_per_gpu']:,.0f} | {bench._fmt(peak, '.2f')} | {bench._fmt(vs_plain, '.2f', 'x')} "
            f"| {bench._fmt(vs_recompute, '.3f', 'x')} |"
        )
    lines += [
        "",
        f"## Targets at {TARGET_LEN} tokens",
        "",
        "| target | measured | verdict |",
        "|---|---:|---|",
    ]
    lines += [f"| {t['target']} | {t['shown']} | {t['verdict']} |" for t in report["targets"]]
    if report.get("follow_up"):
        lines += ["", "## Not measured in this run's time budget", "", f"`{report['follow_up']}`"]
    failed = [r for r in rows if r["status"] in ("oom", "error", "timeout")]
    if failed:
        lines += ["", "## Failures", ""]
        lines += [
            f"- {r['config']} {r['seq_len']}: {r['status']}: {(r.get('error') or '').strip()[:600]}" for r in failed
        ]
    return "\n".join(lines) + "\n"


def follow_up(rows: list[dict], argv: list[str]) -> str | None:
    """The command that measures the cases this run skipped for time."""
    skipped = [r for r in rows if r["status"] == "skipped" and r.get("error", "").startswith("time budget")]
    if not skipped:
        return None
    configs = ",".join(dict.fromkeys(r["config"] for r in skipped))
    lengths = ",".join(str(n) for n in sorted({r["seq_len"] for r in skipped}))
    kept, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        if arg in ("--configs", "--seq-lens", "--time-budget", "--out", "--md"):
            skip_next = True
            continue
        if arg.startswith(("--configs=", "--seq-lens=", "--time-budget=", "--out=", "--md=")) or arg == "--unsloth":
            continue
        kept.append(arg)
    return " ".join(
        shlex.quote(a)
        for a in [
            "python",
            "benchmarks/savers.py",
            *kept,
            "--configs",
            configs,
            "--seq-lens",
            lengths,
            "--time-budget",
            "1800",
            "--out",
            "savers_rest.json",
        ]
    )


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="random:qwen3-vl-2b", help="nbkit model name or local path")
    p.add_argument("--seq-lens", default="8k,16k,32k,64k", help="comma-separated tokens per sequence (16k = 16384)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated, of {', '.join(ALL_CONFIGS)}")
    p.add_argument("--unsloth", action="store_true", help="add the unsloth configuration (own launch)")
    p.add_argument("--gpus", type=int, default=2, help="DDP processes, one per GPU")
    p.add_argument("--steps", type=int, default=10, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per case, the probe step included")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--no-image", action="store_true", help="text tokens only (the vision tower then does not run)")
    p.add_argument(
        "--time-budget",
        type=float,
        help=f"seconds for the whole run (default {DEFAULT_BUDGET_S:.0f}, +{UNSLOTH_SHARE_S:.0f} with unsloth)",
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="cpu: gloo ranks (smoke test)")
    p.add_argument("--out", default="savers.json", help="JSON results")
    p.add_argument("--md", help="markdown table (default: --out with .md)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    started = time.time()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    import nbkit

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.unsloth and "unsloth" not in configs:
        configs.append("unsloth")
    unknown = [c for c in configs if c not in ALL_CONFIGS]
    if unknown or not configs:
        raise SystemExit(
            f"savers.py: unknown configuration(s) {', '.join(unknown) or '(none)'}; use {', '.join(ALL_CONFIGS)}."
        )
    seq_lens = sorted({_tokens(n) for n in args.seq_lens.split(",") if n.strip()})
    if not seq_lens or args.steps < 1 or args.warmup < 1:
        raise SystemExit("savers.py: give at least one length, --steps >= 1 and --warmup >= 1 (the probe).")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if device == "cuda" and len(nbkit.visible_gpus()) < args.gpus:
        raise SystemExit(f"savers.py: --gpus {args.gpus} but this machine shows {len(nbkit.visible_gpus())} GPU(s).")
    if device == "cpu" and "unsloth" in configs:
        raise SystemExit("savers.py: unsloth trains only on GPUs; drop it from --configs on this machine.")
    budget = args.time_budget or DEFAULT_BUDGET_S + (UNSLOTH_SHARE_S if "unsloth" in configs else 0.0)
    deadline = started + budget
    out = Path(args.out)
    md = Path(args.md) if args.md else out.with_suffix(".md")
    for path in (out, md):
        path.parent.mkdir(parents=True, exist_ok=True)

    print(f"savers.py: resolving {args.model} ...", flush=True)
    model_path = nbkit.resolve_model(args.model)
    report: dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/savers.py", *argv]),
        "environment": host.environment(),
        "settings": {
            "model": args.model,
            "model_path": model_path,
            "configs": configs,
            "seq_lens": seq_lens,
            "gpus": args.gpus,
            "steps": args.steps,
            "warmup": args.warmup,
            "lora_r": args.lora_r,
            "image": not args.no_image,
            "time_budget_s": budget,
            "device": device,
            "saver_options": {c: SAVER_CONFIGS.get(c) for c in configs},
        },
        "results": [],
        "targets": [],
        "follow_up": None,
        "wall_s": 0.0,
    }

    def write() -> None:
        report["wall_s"] = time.time() - started
        report["targets"] = targets(report["results"])
        report["follow_up"] = follow_up(report["results"], argv)
        out.write_text(json.dumps(report, indent=1) + "\n")
        md.write_text(markdown(report))

    with tempfile.TemporaryDirectory(prefix="nbkit-savers-") as tmp:
        if "unsloth" in configs:  # first: its launch is bounded by its share, the rest by the deadline
            report["results"] += _unsloth_launch(args, seq_lens, model_path, deadline, Path(tmp))
            write()
        plan = plan_cases([c for c in configs if c != "unsloth"], seq_lens)
        if plan:
            report["results"] += _main_launch(args, plan, model_path, device, deadline, Path(tmp))
        write()
    print("\n" + markdown(report), flush=True)
    print(f"savers.py: wrote {out} and {md} in {report['wall_s']:.0f} s", flush=True)
    return 0 if any(r["status"] == "ok" for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
