"""A torch.profiler summary of a few training steps (kernel time by kind, host synchronisations)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.cases import Case, LaunchSpec
from benchmarks.stepping import Stepper, sync

# CUDA runtime calls that block the host until the device has caught up.
HOST_SYNCS = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"})


def profile(stepper: Stepper, batch: dict[str, torch.Tensor], spec: LaunchSpec, case: Case, rank: int) -> dict:
    """Profile spec.profile_steps more steps on every rank; rank 0 writes the tables and trace.

    Returns, per step and for this rank: the wall time under the profiler ("step_ms"); on GPUs the
    milliseconds of GPU kernels by kind ("nccl", "memcpy", "compute"), so NCCL time against compute
    and idle GPU time can be read off; "host_ops_ms_per_step", the self CPU time of every torch op
    and CUDA runtime call summed over all threads (the main thread and autograd's, so it is not a
    wall time; profiler annotations such as DistributedDataParallel.forward are left out, as their
    children are counted); "host_syncs_per_step", the calls that block the CPU until the GPU catches
    up, the harness's own one synchronisation per step included. The written file lists the ops by
    device time (on GPUs) and by self CPU time.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if stepper.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(spec.profile_steps):
            stepper.step(batch)
            sync(stepper.device)
    wall_ms = (time.perf_counter() - start) * 1000 / spec.profile_steps
    averages = prof.key_averages()
    summary: dict[str, Any] = {"step_ms": wall_ms}
    device_events, host_events = split_events(averages)
    if stepper.device.type == "cuda":
        kinds = kernel_ms(device_events)
        summary.update({f"{k}_ms_per_step": v / spec.profile_steps for k, v in kinds.items()})
        summary["compute_busy_pct"] = 100 * summary["compute_ms_per_step"] / wall_ms if wall_ms else 0.0
    # A step whose kernels take less than its wall time is bound by the host: the CPU side says where.
    summary["host_ops_ms_per_step"] = sum(e.self_cpu_time_total for e in host_events) / 1000 / spec.profile_steps
    summary["host_syncs_per_step"] = sum(e.count for e in host_events if e.key in HOST_SYNCS) / spec.profile_steps
    if rank == 0:
        out = Path(spec.profile_dir)
        out.mkdir(parents=True, exist_ok=True)
        slug = f"{spec.config}_{case.label()}".replace(":", "-").replace("@", "-").replace(" ", "_")
        slug = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in slug)
        sort = "self_cpu_time_total"
        if stepper.device.type == "cuda":  # torch < 2.4 named device times after CUDA
            sort = (
                "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
            )
        lines = [
            f"{spec.config} {case.label()}: {spec.profile_steps} steps, rank 0",
            json.dumps(summary, indent=1),
            f"By {sort}:",
            averages.table(sort_by=sort, row_limit=30),
        ]
        if sort != "self_cpu_time_total":
            lines += ["By self_cpu_time_total:", averages.table(sort_by="self_cpu_time_total", row_limit=30)]
        (out / f"{slug}.txt").write_text("\n".join(lines) + "\n")
        prof.export_chrome_trace(str(out / f"{slug}.trace.json.gz"))
        summary["files"] = [f"{slug}.txt", f"{slug}.trace.json.gz"]
    return summary


def summary(averages: Any, steps: int, wall_s: float, top: int = 12) -> dict[str, Any]:
    """Per step of a profiled span of `steps` steps that took `wall_s`: the step's wall ms, GPU kernel ms
    by kind (nccl, memcpy, compute), the host's self CPU ms in torch ops and CUDA runtime calls (all
    threads), host syncs, the `top` host ops by self CPU time and the `top` GPU kernels by device time (ms and calls
    per step).
    """
    steps = max(1, steps)
    device_events, host_events = split_events(averages)
    out: dict[str, Any] = {"steps": steps, "step_ms": 1000 * wall_s / steps}
    out.update({f"{k}_ms": round(v / steps, 2) for k, v in kernel_ms(device_events).items()})
    out["host_ops_ms"] = round(sum(e.self_cpu_time_total for e in host_events) / 1000 / steps, 2)
    out["host_syncs"] = sum(e.count for e in host_events if e.key in HOST_SYNCS) / steps
    busiest = sorted(host_events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    out["top_host_ops"] = [
        {"op": e.key, "ms": round(e.self_cpu_time_total / 1000 / steps, 2), "calls": e.count / steps} for e in busiest
    ]
    longest = sorted(device_events, key=device_us, reverse=True)[:top]
    out["top_kernels"] = [
        {"kernel": e.key[:120], "ms": round(device_us(e) / 1000 / steps, 2), "calls": e.count / steps} for e in longest
    ]
    return out


def kernel_ms(device_events: list[Any]) -> dict[str, float]:
    """Milliseconds of device time by kind: "nccl" (collectives), "memcpy" (copies, fills), "compute"."""
    kinds = {"nccl": 0.0, "memcpy": 0.0, "compute": 0.0}
    for event in device_events:
        name = event.key.lower()
        kind = "nccl" if "nccl" in name else "memcpy" if name.startswith(("memcpy", "memset")) else "compute"
        kinds[kind] += device_us(event) / 1000
    return kinds


def split_events(averages: Any) -> tuple[list[Any], list[Any]]:
    """A profiler's key_averages() as (device kernels and copies, host ops and runtime calls).

    Annotations ("DistributedDataParallel.forward", "nccl:all_reduce", "record_param_comms") are in neither:
    they span events that are counted on their own, and counting them too would double the time.
    """
    from torch.autograd import DeviceType

    events = [e for e in averages if not getattr(e, "is_user_annotation", False)]
    on_device = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
    return on_device, [e for e in events if getattr(e, "device_type", None) != DeviceType.CUDA]


def device_us(event: Any) -> float:
    """An event's own device time in microseconds, under the name this torch uses."""
    value = getattr(event, "self_device_time_total", None)
    return getattr(event, "self_cuda_time_total", 0.0) if value is None else value
