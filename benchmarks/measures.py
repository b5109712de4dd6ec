"""What the benchmarks measure around their steps: statistics of repeated timings (every script's
medians and percentiles come from here, so that one figure means the same in every result),
garbage-collection pauses, peak memory.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where memory is read: a script that only times (soak.py) need not load torch
    import torch


@contextlib.contextmanager
def gc_pauses() -> Iterator[dict[str, Any]]:
    """Python's garbage collections while the block runs: yields a dict that fills with the
    collections per generation ("collections"), their total and longest pause in milliseconds.
    A host-bound step pays for them in full, and under DDP a pause on one rank stalls the others.
    """
    found: dict[str, Any] = {"collections": [0, 0, 0], "total_ms": 0.0, "max_ms": 0.0}
    started: list[float] = []

    def on_collect(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pause = (time.perf_counter() - started.pop()) * 1000
            found["collections"][info["generation"]] += 1
            found["total_ms"] += pause
            found["max_ms"] = max(found["max_ms"], pause)

    gc.callbacks.append(on_collect)
    try:
        yield found
    finally:
        gc.callbacks.remove(on_collect)


def percentile(values: Sequence[float], q: float) -> float:
    """The q quantile (0 <= q <= 1) of values, interpolated linearly between the two nearest
    (numpy's default method). Raises ValueError for no values.
    """
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def step_stats(times: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90, min, max, stdev and spread = (p90 - p10) / median in percent, in the
    unit of `times` (seconds for step times).
    """
    ordered = sorted(times)
    median = statistics.median(ordered)
    p10, p90 = percentile(ordered, 0.1), percentile(ordered, 0.9)
    return {
        "median": median,
        "p10": p10,
        "p90": p90,
        "min": ordered[0],
        "max": ordered[-1],
        "stdev": statistics.stdev(ordered) if len(ordered) > 1 else 0.0,
        "spread_pct": 100.0 * (p90 - p10) / median if median > 0 else 0.0,
    }


class HostClock:
    """What the host did between two marks, read from the kernel's own counters (no profiler).

    `sample()` returns, since the previous mark: the main thread's CPU seconds, the whole process's CPU
    seconds (every thread: autograd's, the OpenMP pool's spinning, a reader's), the main thread's
    involuntary context switches (the scheduler took its core: a host-bound step waits for it), its
    voluntary ones (it slept: waiting for the GIL, a lock, a read; CUDA's syncs spin and do not count),
    its page faults (memory the allocator handed back to the kernel and took again costs one per page, as
    CPU time on this thread) and the process's OS thread count now. Built and sampled in the thread that
    drives training.
    """

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, float, int, int, int]:
        import resource

        usage = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
        faults = usage.ru_minflt + usage.ru_majflt
        return time.thread_time(), time.process_time(), usage.ru_nivcsw, usage.ru_nvcsw, faults

    def sample(self) -> dict[str, float]:
        """The counters since the last call (or since the clock was built); marks now."""
        now = self._read()
        thread_s, process_s, switches, waits, faults = (b - a for a, b in zip(self._last, now))
        self._last = now
        try:
            threads = len(os.listdir("/proc/self/task"))
        except OSError:  # not Linux
            threads = 0
        return {
            "main_cpu_s": thread_s,
            "process_cpu_s": process_s,
            "main_involuntary_switches": switches,
            "main_voluntary_switches": waits,
            "main_page_faults": faults,
            "os_threads": threads,
        }


def interpreter_state() -> dict[str, Any]:
    """What in this Python process could make the same code run slower than in another: the tools that listen to
    sys.monitoring's events ({tool name: event mask}; None before Python 3.12, where it does not exist: a
    debugger's or coverage's way in since 3.12, which sys.gettrace() does not show), whether a trace or profile
    function is set (this thread's), the objects the garbage collector tracks and has frozen, and the modules loaded.
    """
    import sys

    monitoring = getattr(sys, "monitoring", None)
    tools = None
    if monitoring is not None:
        tools = {str(monitoring.get_tool(i)): monitoring.get_events(i) for i in range(6) if monitoring.get_tool(i)}
    return {
        "monitoring_tools": tools,
        "trace": sys.gettrace() is not None,
        "profile": sys.getprofile() is not None,
        "gc_tracked": len(gc.get_objects()),
        "gc_frozen": gc.get_freeze_count(),
        "modules": len(sys.modules),
    }


def thread_core() -> str | None:
    """The physical core the calling thread ran on last, as "package/core" (sysfs's ids), or None where the
    kernel does not say (not Linux). Two busy threads on one core's two hardware threads each run slower
    than alone, and neither HostClock's switches nor a profile shows it.
    """
    try:
        stat = Path("/proc/thread-self/stat").read_text()
        cpu = int(stat.rsplit(")", 1)[1].split()[36])  # field 39, "processor"; the split starts at field 3
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        return f"{(topology / 'physical_package_id').read_text().strip()}/{(topology / 'core_id').read_text().strip()}"
    except (OSError, ValueError, IndexError):
        return None


def _name_and_ticks(stat: str) -> tuple[str, int]:
    """A /proc/.../stat line's name and CPU clock ticks (user + system: fields 14 and 15; the split after the name's
    closing parenthesis starts at field 3).
    """
    after = stat.rsplit(")", 1)[1].split()
    return stat[stat.index("(") + 1 : stat.rindex(")")], int(after[11]) + int(after[12])


def thread_cpu_by_name() -> dict[str, tuple[int, float]]:
    """This process's OS threads grouped by name, digits folded ("pt_autograd_#": /proc/self/task/*/comm, the names
    torch, NCCL, ipykernel and the rest give theirs), the main thread as "(main)": {name: (threads, CPU seconds they
    have used)}, {} where the kernel does not say (not Linux). A thread that ended takes its CPU time with it.
    """
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    groups: dict[str, tuple[int, float]] = {}
    for tid in tids:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # it ended while we read
            continue
        comm, used = _name_and_ticks(stat)
        name = "(main)" if tid == str(os.getpid()) else re.sub(r"\d+", "#", comm)
        count, cpu = groups.get(name, (0, 0.0))
        groups[name] = (count + 1, cpu + used / ticks)
    return groups


def thread_cpu_between(
    start: dict[str, tuple[int, float]], end: dict[str, tuple[int, float]], steps: int
) -> dict[str, dict[str, float]]:
    """Each thread name's count at `end` and CPU milliseconds per step between two thread_cpu_by_name() readings
    `steps` steps apart, busiest first (a clock tick is 10 ms, so small figures are coarse).
    """
    rows = {
        name: {"threads": count, "cpu_ms_per_step": 1000 * (cpu - start.get(name, (0, 0.0))[1]) / max(steps, 1)}
        for name, (count, cpu) in end.items()
    }
    return dict(sorted(rows.items(), key=lambda item: -item[1]["cpu_ms_per_step"]))


def peak_memory_gib(device: torch.device) -> dict[str, float] | None:
    """Peak allocated and reserved GiB on `device` since the last reset; None on CPU."""
    if device.type != "cuda":
        return None
    import torch

    return {
        "allocated": torch.cuda.max_memory_allocated(device) / 2**30,
        "reserved": torch.cuda.max_memory_reserved(device) / 2**30,
    }


def reset_memory(device: torch.device) -> None:
    """Collect garbage and, on CUDA, empty the cache and reset the peak counters."""
    gc.collect()
    if device.type == "cuda":
        import torch

        # The peak counters live in the caching allocator, which exists only once CUDA is initialised: a
        # process that has not touched CUDA yet got "Invalid device argument" (4x H100, the balanced split).
        torch.cuda.init()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _schedstat() -> tuple[int, int, int]:
    """The calling thread's (ns on a CPU, ns runnable but waiting for one, timeslices) from the scheduler."""
    try:
        run, wait, slices = Path("/proc/thread-self/schedstat").read_text().split()[:3]
        return int(run), int(wait), int(slices)
    except (OSError, ValueError):  # not Linux, or schedstats off
        return 0, 0, 0


def _machine_cpu() -> tuple[dict[int, tuple[str, int]], list[int]]:
    """Every process's (name, CPU clock ticks) by pid, and /proc/stat's machine-wide CPU line (ticks by kind)."""
    processes: dict[int, tuple[str, int]] = {}
    with contextlib.suppress(OSError):
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:  # it ended while we read
                continue
            processes[int(pid)] = _name_and_ticks(stat)
    try:
        totals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        totals = []
    return processes, totals


def _command_line(pid: int) -> str:
    """A process's command line, shortened to what tells processes of one program apart ("" once it ended)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return ""
    words = [os.path.basename(words[0])] + [w for w in words[1:] if w and not w.startswith("/")][:3]
    return " ".join(words)[:60]


class HalfWatch:
    """What happened on the machine and in this rank's main thread over the timed half, beyond its own counters:
    how long the main thread waited for a CPU while runnable (its core taken by another thread of the guest), how
    busy the machine's CPUs were and which processes used them (a busy neighbour the rank does not see), and where
    the main thread's Python stack was (sampled every `interval` s by a thread: one stack walk a sample), so that
    two launchers' ranks that step at different speeds show whether they do other work or the same work slower.
    Start in the thread that drives training; stop there, `steps` steps later.
    """

    def __init__(self, interval: float = 0.005) -> None:
        import sys
        import threading

        self._thread_id = threading.get_ident()
        self._sched = _schedstat()
        self._machine = _machine_cpu()
        self._samples: dict[str, int] = {}
        self._taken = 0
        self._done = threading.Event()

        def sample() -> None:
            while not self._done.wait(interval):
                frame = sys._current_frames().get(self._thread_id)
                names = []
                while frame is not None and len(names) < 2:
                    code = frame.f_code
                    names.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
                    frame = frame.f_back
                key = " < ".join(names)
                self._samples[key] = self._samples.get(key, 0) + 1
                self._taken += 1

        self._sampler = threading.Thread(target=sample, name="nbkit-bench-sampler", daemon=True)
        self._sampler.start()

    def stop(self, steps: int) -> dict[str, Any]:
        """The watch's figures per step over `steps` steps; ends the sampler."""
        self._done.set()
        self._sampler.join()
        run, wait, slices = (b - a for a, b in zip(self._sched, _schedstat()))
        (before, totals_before), (after, totals_after) = self._machine, _machine_cpu()
        ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        per = max(steps, 1)
        busiest = sorted(
            ((after[pid][1] - before[pid][1], pid, after[pid][0]) for pid in after if pid in before),
            reverse=True,
        )[:6]
        kinds = [b - a for a, b in zip(totals_before, totals_after)]
        elapsed = sum(kinds) or 1
        # /proc/stat's columns: user nice system idle iowait irq softirq steal ...
        busy = sum(kinds[:3] + kinds[5:7]) if len(kinds) >= 8 else 0
        return {
            "main_run_ms": run / 1e6 / per,
            "main_runqueue_wait_ms": wait / 1e6 / per,
            "main_timeslices": slices / per,
            "machine_busy_cpus": busy / elapsed * (os.cpu_count() or 1),
            "machine_steal_pct": 100 * kinds[7] / elapsed if len(kinds) >= 8 else 0.0,
            "busiest_processes": [
                {
                    "pid": pid,
                    "name": _command_line(pid) or name,
                    "cpu_ms_per_step": 1000 * used / ticks / per,
                    "me": pid == os.getpid(),
                }
                for used, pid, name in busiest
            ],
            "samples_per_step": self._taken / per,
            "stacks": {
                key: count / per for key, count in sorted(self._samples.items(), key=lambda item: -item[1])[:25]
            },
        }
