"""One benchmark launch on one rank: every case of a LaunchSpec, the same function under every launcher.

`run_launch(spec)` loads the model once per precision, runs every case of the spec (sequence length x
batch x precision x DDP options) and appends one JSON line per case to `spec.results_path` from
rank 0, so a launch that dies half-way still leaves the cases it finished. bench.py runs it under
nbkit.launch, accelerate's notebook_launcher, `accelerate launch` and torchrun.

Each case starts with a probe step on the bare model (no DDP, so no collective inside), the ranks
agree on its outcome over a gloo group (benchmarks/ranks.py), and only then train together; a case
that fails is a row with status "oom" or "error" on every rank, and the launch goes on.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from benchmarks.batches import synthetic_batch
from benchmarks.cases import Case, LaunchSpec, case_row
from benchmarks.measures import gc_pauses, peak_memory_gib, reset_memory, step_stats
from benchmarks.models import build_model
from benchmarks.profiling import profile
from benchmarks.ranks import agree, gather, setup_rank, teardown_rank
from benchmarks.stepping import Stepper, probe, timed_steps, unfreeze, wrap_ddp


def _describe(exc: BaseException) -> tuple[str, str, str]:
    """(status, one-line message, traceback tail) of a failed case."""
    oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
    first = (str(exc).strip().splitlines() or [""])[0]
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
    return ("oom" if oom else "error"), f"{type(exc).__name__}: {first}"[:400], tail


class Launch:
    """One benchmark launch on one rank: loads models, runs cases, records their rows.

    `run()` is run_launch's job (every case of the spec, grouped by precision). Harnesses that run
    another sequence (benchmarks/savers.py: one model under several saver configurations) use the
    same parts: `load()`, `run_case()`, `record()`, `failed()`, `row()`, and `labels`, fields that
    every row gets after the case's identity (they override it where they share a key).
    """

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.labels: dict[str, Any] = {}
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.device = setup_rank(spec.device, memory_cap_gib=spec.memory_cap_gib, timeout_s=spec.collective_timeout_s)
        self.first_step_s: float | None = None
        self.results: list[dict] = []

    def row(self, case: Case, **fields: Any) -> dict:
        """The result row of `case`: its identity, `labels`, then `fields`."""
        return case_row(self.spec, case, **{**self.labels, **fields})

    def record(self, row: dict) -> None:
        """Keep `row`; rank 0 appends it to spec.results_path and prints its progress line."""
        self.results.append(row)
        if self.rank != 0:
            return
        with open(self.spec.results_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(_progress_line(row), flush=True)

    def failed(self, case: Case, ok: bool, failure: tuple[str, str, str] | None, **fields: Any) -> dict:
        """The row of a case that failed on some rank: each failing rank's reason."""
        reasons = gather(None if ok else failure)
        failed = {r: f for r, f in enumerate(reasons) if f is not None}
        status = "oom" if any(f[0] == "oom" for f in failed.values()) else "error"
        first_rank, first = min(failed.items())
        return self.row(
            case,
            status=status,
            error=first[1],
            error_rank=first_rank,
            error_detail=first[2],
            failed_ranks=sorted(failed),
            **fields,
        )

    def run(self) -> list[dict]:
        """Every case of the spec; returns this rank's rows."""
        spec = self.spec
        groups: dict[str, list[Case]] = {}
        for case in spec.cases:
            groups.setdefault(case.precision, []).append(case)
        for precision, cases in groups.items():
            model, load_s, failure = self.load(precision, max(c.seq_len for c in cases))
            if not agree(failure is None):
                for case in cases:  # the same load failure stands for every case of this precision
                    self.record(self.failed(case, failure is None, failure, phase="load", load_s=load_s))
                del model
                reset_memory(self.device)
                continue
            runner = self._ladder if spec.ladder else self._each
            runner(model, cases, load_s)
            del model
            reset_memory(self.device)
        return self.results

    def load(self, precision: str, max_seq_len: int) -> tuple[nn.Module | None, float, tuple | None]:
        """(model or None, seconds, failure or None): the spec's model built in `precision`."""
        spec = self.spec
        start = time.perf_counter()
        try:
            model = build_model(
                spec.backend,
                spec.model_path,
                precision,
                self.device,
                lora_r=spec.lora_r,
                max_seq_len=max_seq_len,
                savers=spec.savers,
                unsloth_checkpointing=spec.unsloth_checkpointing,
                seed=spec.seed,
            )
            return model, time.perf_counter() - start, None
        except Exception as exc:  # recorded for every case of this precision; the launch goes on
            return None, time.perf_counter() - start, _describe(exc)

    def _each(self, model: nn.Module, cases: list[Case], load_s: float) -> None:
        for case in cases:
            self.record(self.run_case(model, case, load_s))

    def _ladder(self, model: nn.Module, cases: list[Case], load_s: float) -> None:
        """Ascending lengths until the first failure, then bisect between the last success and it."""
        cases = sorted(cases, key=lambda c: c.seq_len)
        longest, shortest_failed = 0, None
        for case in cases:
            row = self.run_case(model, case, load_s)
            self.record(row)
            if row["status"] != "ok":
                shortest_failed = case.seq_len
                break
            longest = case.seq_len
        template = cases[0]
        for _ in range(self.spec.ladder_bisect if shortest_failed is not None else 0):
            middle = (longest + shortest_failed) // 2 // 4096 * 4096
            if middle <= longest or middle >= shortest_failed:
                break
            row = self.run_case(model, replace(template, seq_len=middle), load_s)
            self.record(row)
            if row["status"] == "ok":
                longest = middle
            else:
                shortest_failed = middle

    def run_case(self, model: nn.Module, case: Case, load_s: float) -> dict:
        """Probe step (bare model), agreement, DDP warm-up and timed steps, optional profile."""
        spec, device = self.spec, self.device
        model.zero_grad(set_to_none=True)  # nothing left over from a case that failed half-way
        reset_memory(device)
        failure, unused, batch = None, [], None
        try:
            batch = synthetic_batch(
                model.config, case.seq_len, case.batch, device, image=spec.image, seed=spec.seed * 1000 + self.rank
            )
            unused = probe(Stepper(model, case.precision, device), batch)
        except Exception as exc:
            failure = _describe(exc)
        if self.first_step_s is None and failure is None and spec.launched_at:
            self.first_step_s = time.time() - spec.launched_at
        timing = dict(load_s=load_s, launch_to_first_step_s=self.first_step_s)
        if not agree(failure is None):
            batch = None
            return self.failed(case, failure is None, failure, phase="probe", **timing)

        wrapped: nn.Module = model
        stepper: Stepper | None = None
        figures: dict[str, Any] = {}
        try:
            wrapped = wrap_ddp(model, device, case.ddp, unused=unused)
            stepper = Stepper(wrapped, case.precision, device, grad_accum=spec.grad_accum)
            timed_steps(stepper, batch, max(0, spec.warmup - 1))
            with gc_pauses() as pauses:
                times, losses = timed_steps(stepper, batch, spec.steps)
            figures = self._figures(case, times, losses, unused)
            figures["gc"] = {**pauses, "ms_per_step": pauses["total_ms"] / spec.steps}  # per optimisation step
            if spec.profile_dir:
                figures["profile"] = profile(stepper, batch, spec, case, self.rank)
        except Exception as exc:
            failure = _describe(exc)
        finally:
            unfreeze(model, unused)  # also when wrap_ddp froze them and then failed
            stepper = wrapped = None
        ok = agree(failure is None)
        memory = gather(peak_memory_gib(device))
        gc_by_rank = gather(figures.get("gc"))
        if not ok:
            return self.failed(case, failure is None, failure, phase="train", **timing)
        # The slowest rank sets the pace of a DDP step, so its garbage collections are the ones that count.
        figures["gc"] = {
            "ms_per_step": max(p["ms_per_step"] for p in gc_by_rank),
            "per_rank": [{k: p[k] for k in ("collections", "total_ms", "max_ms", "ms_per_step")} for p in gc_by_rank],
        }
        if memory[0] is not None:
            figures["peak_allocated_gib"] = [m["allocated"] for m in memory]
            figures["peak_reserved_gib"] = [m["reserved"] for m in memory]
        return self.row(case, status="ok", **timing, **figures)

    def _figures(self, case: Case, times: list[float], losses: list[float], unused: list[str]) -> dict:
        stats = step_stats(times)
        tokens = case.tokens * self.spec.grad_accum  # per rank per optimisation step
        per_gpu = tokens / stats["median"]
        return {
            "step_time_s": stats,
            "step_times_s": times,
            "tokens_per_step": tokens * self.world,
            "tokens_per_s_per_gpu": per_gpu,
            "tokens_per_s_total": per_gpu * self.world,
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "loss_finite": all(map(math.isfinite, losses)),
            "unused_trainable_params": len(unused),
        }


def run_launch(spec: LaunchSpec) -> list[dict]:
    """The per-rank job of one benchmark launch; returns this rank's result rows.

    Runs every case of `spec` (see LaunchSpec and the module docstring), rank 0 appending one JSON
    line per case to spec.results_path and printing one progress line. Case failures are rows
    with status "oom" or "error" and the reason; the launch carries on. Tears the process group
    down at the end. Raises only for failures outside any case (the rank set-up itself).
    """
    launch = Launch(spec)
    try:
        return launch.run()
    finally:
        teardown_rank()


def _progress_line(row: dict) -> str:
    head = f"[{row['config']}] {row['precision']} {row['seq_len']}x{row['batch']}"
    if row.get("ddp"):
        head += f" [{row['ddp']}]"
    if row["status"] != "ok":
        return f"{head}: {row['status'].upper()} ({row.get('phase', '')}) {row.get('error', '')}"
    stats = row["step_time_s"]
    memory = row.get("peak_allocated_gib")
    mem = f", peak {max(memory):.2f} GiB/GPU" if memory else ""
    first = row.get("launch_to_first_step_s")
    first_text = f", first step {first:.1f} s after launch" if first is not None else ""
    gc_text = f", Python GC {row['gc']['ms_per_step']:.1f} ms/step" if "gc" in row else ""
    return (
        f"{head}: {stats['median']:.3f} s/step (spread {stats['spread_pct']:.1f}%), "
        f"{row['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, {row['tokens_per_s_total']:,.0f} total{mem}{first_text}"
        f"{gc_text}"
    )
