"""nbkit's multi-GPU benchmark harness: one command runs a matrix of configurations side by side.

    python benchmarks/bench.py --matrix default --out results.json --md results.md
    python benchmarks/bench.py --configs nbkit:2,plain:2@notebook --seq-lens 1024x4 --steps 20
    python benchmarks/bench.py --t4 --configs nbkit:2,unsloth:2 --out t4.json --md t4.md

A configuration is `backend:gpus[@launcher]`: backend unsloth / nbkit / plain (see benchmarks/models.py),
launcher nbkit (nbkit.launch, the default), notebook (accelerate's notebook_launcher), accelerate
(`accelerate launch` of this file as a script) or torchrun. Each configuration is one launch that
runs all its cases (sequence lengths, precisions, DDP variants), so unsloth's import and the model
load happen once per launch and per precision.

Every launch runs in a fresh Python process, as a fresh notebook kernel would (nbkit / notebook
launchers fork from it) or as a shell would start a script (accelerate / torchrun); a launch that
fails, hangs or is killed is recorded and the next one runs. Results go to --out (JSON: every
figure, every step time, the environment) and --md (the table), rewritten after each launch, so
an interrupted run still leaves what it measured. See benchmarks/README.md.

Internal modes (used by the launches themselves): `--run-launch SPEC.json` calls a notebook
launcher in this process; `--worker SPEC.json` is the script entry point on each rank.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script (python benchmarks/bench.py): the package lives in ROOT
    sys.path.insert(0, str(ROOT))

from benchmarks import cases, host, launching, models, runner  # noqa: E402

LAUNCHERS = ("nbkit", "notebook", "accelerate", "torchrun")

# In priority order: with --time-limit the later launches are the ones skipped.
MATRICES: dict[str, list[str]] = {
    # The comparison nbkit is built to win: unsloth on 1 GPU (reference) and under nbkit.launch, transformers+peft
    # with nbkit's savers, plain transformers+peft under notebook_launcher (the anchor), the same
    # function as a script (accelerate launch), then 4-GPU scaling and the remaining anchors.
    "default": [
        "unsloth:1@notebook",
        "unsloth:2",
        "nbkit:1@notebook",
        "nbkit:2",
        "plain:2@notebook",
        "nbkit:2@accelerate",
        "unsloth:4",
        "nbkit:4",
        "plain:1@notebook",
        "unsloth:2@notebook",
    ],
    "scaling": ["unsloth:1@notebook", "unsloth:2", "unsloth:4", "nbkit:1@notebook", "nbkit:2", "nbkit:4"],
    "launchers": ["nbkit:2", "nbkit:2@notebook", "nbkit:2@accelerate", "nbkit:2@torchrun"],
}
DEFAULT_SEQ_LENS = "1024x4,16384x1"
T4_LADDER = "16384,32768,49152,65536,98304,131072"
T4_MEMORY_GIB = 15.0


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--matrix", default="default", choices=sorted(MATRICES), help="named set of configurations")
    p.add_argument("--configs", help="comma-separated backend:gpus[@launcher] (replaces --matrix)")
    p.add_argument("--gpus", help="comma-separated GPU counts: keep only configurations with these")
    p.add_argument("--model", default="random:qwen3-vl-2b", help="nbkit model name or local path")
    p.add_argument(
        "--seq-lens",
        help=f"comma-separated LEN[xBATCH] (default {DEFAULT_SEQ_LENS}; batch defaults to max(1, min(4, 4096 // LEN)))",
    )
    p.add_argument(
        "--precisions",
        help="comma-separated bf16/fp16/fp32 for every length (default on GPUs: "
        "bf16 for every length plus fp16 at the shortest; on CPU: fp32)",
    )
    p.add_argument("--steps", type=int, help="timed steps per case (default 20; --t4: 2)")
    p.add_argument("--warmup", type=int, help="untimed steps per case, the probe step included (default 3; --t4: 1)")
    p.add_argument(
        "--ddp",
        action="append",
        default=[],
        metavar="K=V,...",
        help="DDP variant (repeatable: each is one more case per length): any DistributedDataParallel "
        "argument (bucket_cap_mb, gradient_as_bucket_view, static_graph, find_unused_parameters="
        "true/false/auto, broadcast_buffers, ...) plus freeze_unused and comm_hook=bf16/fp16",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches per optimisation step (DDP all-reduces on the last only, as Trainer's "
        "gradient_accumulation_steps); tokens/s count every micro-batch",
    )
    p.add_argument(
        "--savers",
        default="",
        metavar="K=V,...",
        help="nbkit.savers.apply options for the nbkit backend, e.g. checkpointing=recompute,tiled_mlp=false",
    )
    p.add_argument(
        "--unsloth-checkpointing", default="unsloth", help="unsloth's use_gradient_checkpointing (unsloth, true, false)"
    )
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--image", action="store_true", help="one small image in every sequence (Qwen-VL models)")
    p.add_argument(
        "--t4",
        action="store_true",
        help="T4 stand-in: fp16, memory capped per process, find the longest sequence (batch 1) that trains",
    )
    p.add_argument("--memory-cap-gib", type=float, help=f"per-process GPU memory cap (--t4: {T4_MEMORY_GIB})")
    p.add_argument("--profile", action="store_true", help="profile a few extra steps per case (torch profiler)")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--profile-dir", help="where profiles go (default: <out>_profile/ beside --out)")
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cpu: gloo ranks on the CPU (also automatic without CUDA)",
    )
    p.add_argument("--launch-timeout", type=float, default=480.0, help="seconds before a launch is stopped")
    p.add_argument("--time-limit", type=float, help="total seconds: launches that would start later are skipped")
    p.add_argument("--out", default="results.json", help="JSON results")
    p.add_argument("--md", help="markdown table (default: --out with .md)")
    p.add_argument("--run-launch", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def _parse_configs(text: str) -> list[tuple[str, int, str]]:
    configs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        head, _, launcher = item.partition("@")
        backend, sep, gpus = head.partition(":")
        launcher = launcher or "nbkit"
        if not sep or backend not in cases.BACKENDS or not gpus.isdigit() or int(gpus) < 1 or launcher not in LAUNCHERS:
            raise SystemExit(
                f"bench.py: configuration {item!r} is not backend:gpus[@launcher] with backend in "
                f"{'/'.join(cases.BACKENDS)}, gpus >= 1 and launcher in {'/'.join(LAUNCHERS)}."
            )
        configs.append((backend, int(gpus), launcher))
    return configs


def _parse_seq_lens(text: str) -> list[tuple[int, int]]:
    lengths = []
    for item in filter(None, (part.strip().lower() for part in text.split(","))):
        length, _, batch = item.partition("x")
        length = _tokens(length)
        lengths.append((length, int(batch) if batch else max(1, min(4, 4096 // length))))
    if not lengths:
        raise SystemExit("bench.py: --seq-lens names no length.")
    return lengths


def _tokens(text: str) -> int:
    """'1024', '16k' or '16K' -> tokens."""
    scale = 1024 if text.endswith("k") else 1
    value = int(text.rstrip("k")) * scale
    if value < 2:
        raise SystemExit(f"bench.py: sequence length {text!r} is too short.")
    return value


def _parse_savers(text: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("checkpointing", "tiled_mlp", "chunked_loss"):
            raise SystemExit(f"bench.py: --savers item {item!r} is not checkpointing=/tiled_mlp=/chunked_loss=.")
        options[key] = cases.parse_value(value)
    return options


def _cases(args: argparse.Namespace, device: str, gpus: int) -> list[cases.Case]:
    ddp_variants = [cases.parse_ddp_options(text) for text in args.ddp] or [cases.parse_ddp_options("")]
    if gpus == 1:  # one process trains without DDP
        ddp_variants = [cases.parse_ddp_options("")]
    elif args.t4:  # the ladder climbs with one variant
        ddp_variants = ddp_variants[:1]
    lengths = _parse_seq_lens(args.seq_lens or (T4_LADDER if args.t4 else DEFAULT_SEQ_LENS))
    if args.t4:
        pairs = [("fp16" if device == "cuda" else "fp32", length, 1) for length, _ in lengths]
    elif args.precisions:
        precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
        unknown = set(precisions) - set(cases.PRECISIONS)
        if unknown:
            raise SystemExit(f"bench.py: unknown precision(s) {', '.join(sorted(unknown))}; use bf16, fp16, fp32.")
        pairs = [(p, length, batch) for p in precisions for length, batch in lengths]
    elif device == "cuda":
        shortest = min(lengths)
        pairs = [("bf16", length, batch) for length, batch in lengths] + [("fp16", *shortest)]
    else:
        pairs = [("fp32", length, batch) for length, batch in lengths]
    return [cases.Case(length, batch, precision, ddp) for precision, length, batch in pairs for ddp in ddp_variants]


# ---------------------------------------------------------------------------------------------
# Running launches
# ---------------------------------------------------------------------------------------------


def _command(spec: cases.LaunchSpec, spec_path: Path) -> list[str]:
    me = str(Path(__file__).resolve())
    if spec.launcher in ("nbkit", "notebook"):
        return [sys.executable, me, "--run-launch", str(spec_path)]
    if spec.launcher == "accelerate":
        return launching.accelerate_command(spec.gpus, spec_path.parent, me, "--worker", str(spec_path))
    return launching.torchrun_command(spec.gpus, spec_path.parent, me, "--worker", str(spec_path))


def _placeholder(spec: cases.LaunchSpec, case: cases.Case, status: str, why: str, **extra: Any) -> dict:
    return cases.case_row(spec, case, status=status, error=why, **extra)


def run_one(spec: cases.LaunchSpec, workdir: Path, index: int, timeout: float) -> list[dict]:
    """Run one launch in a fresh process and return one row per case (failures included)."""
    slug = spec.config.replace(":", "-").replace("@", "-")
    spec_path = workdir / f"{index:02d}-{slug}.json"
    spec.results_path = str(workdir / f"{index:02d}-{slug}.jsonl")
    print(
        f"\n=== {spec.config}: {len(spec.cases)} case(s) on {spec.gpus} {'GPU' if spec.device == 'cuda' else 'CPU process'}"
        f"{'s' if spec.gpus > 1 else ''} via {spec.launcher} ===",
        flush=True,
    )
    start = time.monotonic()
    spec.launched_at = time.time()
    spec_path.write_text(spec.to_json())
    reason, tail = launching.run_process(
        _command(spec, spec_path), launching.child_env(spec.device), timeout, "nbkit-bench"
    )
    rows, launch_error = launching.read_rows(Path(spec.results_path))
    wall = time.monotonic() - start
    for row in rows:
        row["launch_wall_s"] = wall
    if reason is None and launch_error is None:
        missing = [] if spec.ladder else [c for c in spec.cases if not _has_row(spec, rows, c)]
        why = "the launch ended without reporting this case"
    else:
        why = launch_error or reason
        missing = [c for c in spec.cases if not _has_row(spec, rows, c)]
        if spec.ladder:
            done = max((r["seq_len"] for r in rows), default=0)
            missing = [c for c in missing if c.seq_len > done][:1]
    for case in missing:
        status = "timeout" if reason and "timeout" in reason else "error"
        rows.append(_placeholder(spec, case, status, why, output_tail="\n".join(tail), launch_wall_s=wall))
    print(
        f"=== {spec.config}: {wall:.0f} s{'' if why is None or not missing else ' -- ' + why.splitlines()[0]} ===",
        flush=True,
    )
    return rows


def _has_row(spec: cases.LaunchSpec, rows: list[dict], case: cases.Case) -> bool:
    wanted = cases.case_row(spec, case)
    return any(all(r[k] == wanted[k] for k in ("precision", "seq_len", "batch", "ddp")) for r in rows)


def _skip_reason(backend: str, gpus: int, device: str, gpu_count: int) -> str | None:
    if backend == "unsloth":
        if device != "cuda":
            return "unsloth trains only on GPUs"
        if importlib.util.find_spec("unsloth") is None:
            return "unsloth is not installed"
    if device == "cuda" and gpus > gpu_count:
        return f"needs {gpus} GPUs, this machine has {gpu_count}"
    return None


# ---------------------------------------------------------------------------------------------
# Internal modes: inside a launch
# ---------------------------------------------------------------------------------------------


def _run_launch_mode(spec_path: str) -> int:
    """A fresh process standing in for a notebook kernel: call the notebook launcher from here.

    models.preload: what a notebook has imported in earlier cells (never unsloth: it must be imported in the ranks).
    """
    return launching.launch_from_kernel(
        runner.run_launch, cases.LaunchSpec.from_json(Path(spec_path).read_text()), models.preload
    )


def _worker_mode(spec_path: str) -> int:
    """One rank of a script launch (accelerate launch / torchrun): the same function nbkit.launch runs."""
    return launching.script_rank(runner.run_launch, cases.LaunchSpec.from_json(Path(spec_path).read_text()))


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

# What makes two rows the same measured case (launcher, GPU count and DDP options aside).
_CASE_KEYS = ("precision", "seq_len", "batch", "grad_accum", "image", "memory_cap_gib")


def _case_label(r: dict) -> str:
    """ "bf16 1024x4", plus " GA4" with gradient accumulation and " [ddp options]" where they differ."""
    accum = f" GA{r['grad_accum']}" if r.get("grad_accum", 1) > 1 else ""
    return f"{r['precision']} {r['seq_len']}x{r['batch']}{accum}" + (f" [{r['ddp']}]" if r.get("ddp") else "")


def _reference(rows: list[dict], row: dict) -> dict | None:
    """The 1-GPU row of the same backend and case: notebook_launcher's preferred (it runs one process
    in the launching process itself, as a one-GPU notebook user trains), then nbkit.launch's.
    """
    same = [
        r
        for r in rows
        if r["status"] == "ok"
        and r["gpus"] == 1
        and r["backend"] == row["backend"]
        and all(r.get(k) == row.get(k) for k in _CASE_KEYS)
    ]
    same.sort(key=lambda r: {"notebook": 0, "nbkit": 1}.get(r["launcher"], 2))
    return same[0] if same else None


def add_comparisons(rows: list[dict]) -> None:
    """Scaling vs 1 GPU (total tokens/s ratio and efficiency) and peak memory vs 1 GPU, in place."""
    for row in rows:
        if row["status"] != "ok":
            continue
        ref = _reference(rows, row)
        if ref is None:
            continue
        row["scaling"] = row["tokens_per_s_total"] / ref["tokens_per_s_total"]
        row["scaling_efficiency"] = row["scaling"] / row["gpus"]
        if row.get("peak_allocated_gib") and ref.get("peak_allocated_gib"):
            row["memory_vs_1gpu"] = max(row["peak_allocated_gib"]) / max(ref["peak_allocated_gib"])


def _fmt(value: Any, spec: str = ",.0f", suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def markdown(report: dict) -> str:
    env, rows = report["environment"], report["results"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    machine = (
        f"{env['gpu_count']}x {env['gpu']} ({env['gpu_memory_gib']} GiB), driver {env['driver']}, CUDA {env['cuda']}"
        if env["gpu_count"]
        else f"CPU only ({env['cpu_count']} cores; gloo ranks)"
    )
    s = report["settings"]
    lines = [
        "# nbkit multi-GPU benchmark",
        "",
        f"- Machine: {machine}; host {env['host']}",
        f"- Versions: {versions}; Python {env['python']}",
        f"- Date: {env['date']}; total {report['wall_s']:.0f} s",
        f"- Model: {report['model']['name']} (LoRA r={s['lora_r']} on all linear layers"
        f"{', one image per sequence' if s['image'] else ', text tokens'}); steady state = median of "
        f"{s['steps']} steps after {s['warmup']} warm-up steps (probe included)",
        f"- Command: `{report['command']}`",
        "",
        "| config | case | status | tok/s/GPU | tok/s total | scaling vs 1 GPU | step s (median) | spread p10-p90 "
        "| peak GiB/GPU | mem vs 1 GPU | launch to 1st step s | Python GC ms/step (slowest rank) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        case = _case_label(r)
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {case} | {r['status']}: {_short(r.get('error', ''))} | | | | | | | | | |")
            continue
        stats = r["step_time_s"]
        scaling = (
            f"{r['scaling']:.2f}x ({100 * r['scaling_efficiency']:.0f}%)" if "scaling" in r and r["gpus"] > 1 else ""
        )
        peak = max(r["peak_allocated_gib"]) if r.get("peak_allocated_gib") else None
        lines.append(
            f"| {r['config']} | {case} | ok | {_fmt(r['tokens_per_s_per_gpu'])} | {_fmt(r['tokens_per_s_total'])} "
            f"| {scaling} | {stats['median']:.3f} | {stats['spread_pct']:.1f}% | {_fmt(peak, '.2f')} "
            f"| {_fmt(r.get('memory_vs_1gpu') if r['gpus'] > 1 else None, '.2f', 'x')} "
            f"| {_fmt(r.get('launch_to_first_step_s'), '.1f')} | {_fmt(r.get('gc', {}).get('ms_per_step'), '.1f')} |"
        )
    lines += _launcher_section(rows) + _ladder_section(report) + _profile_section(rows) + _failure_section(rows)
    return "\n".join(lines) + "\n"


def _short(text: str, limit: int = 90) -> str:
    text = (text or "").splitlines()[0] if text else ""
    text = text.replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _launcher_section(rows: list[dict]) -> list[str]:
    """Median step time of each non-nbkit launcher vs nbkit.launch for the same backend, GPUs and case."""
    out = []
    for r in rows:
        if r["status"] != "ok" or r["launcher"] == "nbkit":
            continue
        ref = next(
            (
                o
                for o in rows
                if o["status"] == "ok"
                and o["launcher"] == "nbkit"
                and all(o.get(k) == r.get(k) for k in ("backend", "gpus", "ddp", *_CASE_KEYS))
            ),
            None,
        )
        if ref is not None:
            ratio = r["step_time_s"]["median"] / ref["step_time_s"]["median"]
            out.append(
                f"| {r['backend']}:{r['gpus']} | {_case_label(r)} | {r['launcher']} "
                f"| {r['step_time_s']['median']:.3f} | {ref['step_time_s']['median']:.3f} | {100 * (ratio - 1):+.1f}% |"
            )
    if not out:
        return []
    return [
        "",
        "## Launchers: median step time vs nbkit.launch",
        "",
        "| backend:gpus | case | launcher | step s | nbkit.launch step s | difference |",
        "|---|---|---|---:|---:|---:|",
    ] + out


def _ladder_section(report: dict) -> list[str]:
    if not report["settings"]["ladder"]:
        return []
    out = [
        "",
        f"## Longest sequence that trains (batch 1, memory cap {report['settings']['memory_cap_gib']} GiB per process)",
        "",
        "| config | precision | longest that trained | shortest that failed | tried |",
        "|---|---|---:|---:|---|",
    ]
    by_config: dict[tuple[str, str], list[dict]] = {}
    for r in report["results"]:
        by_config.setdefault((r["config"], r["precision"]), []).append(r)
    for (config, precision), rows in by_config.items():
        ok = [r["seq_len"] for r in rows if r["status"] == "ok"]
        failed = [r["seq_len"] for r in rows if r["status"] not in ("ok", "skipped")]
        tried = ", ".join(f"{r['seq_len']}:{r['status']}" for r in sorted(rows, key=lambda r: r["seq_len"]))
        out.append(
            f"| {config} | {precision} | {max(ok) if ok else 'none'} | {min(failed) if failed else ''} | {tried} |"
        )
    return out


def _profile_section(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        prof = r.get("profile")
        if r["status"] == "ok" and prof:  # kernel figures exist on GPUs only
            out.append(
                f"| {r['config']} | {_case_label(r)} | {prof['step_ms']:.1f} "
                f"| {_fmt(prof.get('compute_ms_per_step'), '.1f')} | {_fmt(prof.get('nccl_ms_per_step'), '.1f')} "
                f"| {_fmt(prof.get('memcpy_ms_per_step'), '.1f')} | {_fmt(prof.get('compute_busy_pct'), '.0f', '%')} "
                f"| {_fmt(prof.get('host_ops_ms_per_step'), '.1f')} | {_fmt(prof.get('host_syncs_per_step'), '.1f')} "
                f"| {', '.join(prof.get('files', []))} |"
            )
    if not out:
        return []
    return [
        "",
        "## Profiles (per step, rank 0; GPU kernel time by kind, host time in torch ops)",
        "",
        "| config | case | step ms | compute ms | NCCL ms | memcpy ms | compute busy | host ops ms "
        "| host syncs | files |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ] + out


def _failure_section(rows: list[dict]) -> list[str]:
    failed = [r for r in rows if r["status"] not in ("ok", "skipped")]
    if not failed:
        return []
    out = ["", "## Failures", ""]
    for r in failed:
        where = f" (rank {r['error_rank']}, {r.get('phase', '')})" if "error_rank" in r else ""
        out.append(f"- {r['config']} {_case_label(r)}: {r['status']}{where}: {(r.get('error') or '').strip()}")
    return out


def _write(report: dict, out: Path, md: Path) -> None:
    add_comparisons(report["results"])
    out.write_text(json.dumps(report, indent=1) + "\n")
    md.write_text(markdown(report))


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.run_launch:
        return _run_launch_mode(args.run_launch)
    if args.worker:
        return _worker_mode(args.worker)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import nbkit
    from nbkit.platform.config import setting

    started = time.monotonic()
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    gpu_count = len(nbkit.visible_gpus()) if device == "cuda" else 0
    configs = _parse_configs(args.configs or (",".join(["nbkit:2"]) if args.t4 else ",".join(MATRICES[args.matrix])))
    if args.gpus:
        wanted = {int(g) for g in args.gpus.split(",") if g.strip()}
        configs = [c for c in configs if c[1] in wanted]
    if not configs:
        raise SystemExit("bench.py: no configuration left to run (check --configs / --gpus).")
    steps = args.steps if args.steps is not None else (2 if args.t4 else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.t4 else 3)
    if args.grad_accum < 1:
        raise SystemExit("bench.py: --grad-accum must be at least 1.")
    if steps < 1 or warmup < 1:
        raise SystemExit("bench.py: --steps and --warmup must be at least 1 (the first warm-up step is the probe).")
    memory_cap = args.memory_cap_gib if args.memory_cap_gib is not None else (T4_MEMORY_GIB if args.t4 else None)
    out = Path(args.out)
    md = Path(args.md) if args.md else out.with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    md.parent.mkdir(parents=True, exist_ok=True)
    profile_dir = (
        (Path(args.profile_dir) if args.profile_dir else out.parent / f"{out.stem}_profile").resolve()
        if args.profile
        else None
    )

    print(f"bench.py: resolving {args.model} ...", flush=True)
    t0 = time.monotonic()
    model_path = nbkit.resolve_model(args.model)
    resolve_s = time.monotonic() - t0
    print(f"bench.py: {args.model} -> {model_path} ({resolve_s:.1f} s)", flush=True)

    report = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "environment": host.environment(),
        "model": {"name": args.model, "path": model_path, "resolve_s": resolve_s},
        "settings": {
            "steps": steps,
            "warmup": warmup,
            "lora_r": args.lora_r,
            "image": args.image,
            "t4": args.t4,
            "ladder": args.t4,
            "memory_cap_gib": memory_cap,
            "device": device,
            "ddp": args.ddp,
            "grad_accum": args.grad_accum,
            "savers": _parse_savers(args.savers),
            "unsloth_checkpointing": args.unsloth_checkpointing,
            "nbkit_unsloth_vlm_ddp_checkpointing": setting("unsloth_vlm_ddp_checkpointing"),
            "profile_dir": str(profile_dir) if profile_dir else None,
        },
        "results": [],
        "wall_s": 0.0,
    }
    unsloth_checkpointing = cases.parse_value(args.unsloth_checkpointing)
    with tempfile.TemporaryDirectory(prefix="nbkit-bench-") as tmp:
        for index, (backend, gpus, launcher) in enumerate(configs):
            spec = cases.LaunchSpec(
                backend=backend,
                gpus=gpus,
                launcher=launcher,
                model=args.model,
                model_path=model_path,
                device=device,
                cases=_cases(args, device, gpus),
                results_path="",
                steps=steps,
                warmup=warmup,
                lora_r=args.lora_r,
                image=args.image,
                memory_cap_gib=memory_cap,
                ladder=args.t4,
                profile_dir=str(profile_dir) if profile_dir else None,
                profile_steps=args.profile_steps,
                grad_accum=args.grad_accum,
                savers=report["settings"]["savers"],
                unsloth_checkpointing=unsloth_checkpointing,
            )
            elapsed = time.monotonic() - started
            why = _skip_reason(backend, gpus, device, gpu_count)
            if why is None and args.time_limit is not None and elapsed > args.time_limit - 30:
                why = f"time limit ({args.time_limit:.0f} s) reached"
            if why is not None:
                print(f"\n=== {spec.config}: skipped ({why}) ===", flush=True)
                report["results"] += [
                    _placeholder(spec, case, "skipped", why) for case in spec.cases[: 1 if args.t4 else None]
                ]
            else:
                timeout = args.launch_timeout
                if args.time_limit is not None:
                    timeout = max(30.0, min(timeout, args.time_limit - elapsed))
                report["results"] += run_one(spec, Path(tmp), index, timeout)
            report["wall_s"] = time.monotonic() - started
            _write(report, out, md)
    print("\n" + markdown(report), flush=True)
    print(f"bench.py: wrote {out} and {md}", flush=True)
    return 0 if any(r["status"] == "ok" for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
