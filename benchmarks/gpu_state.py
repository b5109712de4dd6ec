"""What the visible GPUs hold now (memory in use, processes with a context on them), read through NVML
(nvidia-ml-py, or nvidia-smi where it is missing), which creates no CUDA context: the process that asks can
still fork ranks.

Two users: the GPU fault matrix (tests/faults/test_gpu_faults.py, test_gpu_kernel_faults.py) compares a
sample taken before a case with one taken after it, where a process or memory still held is a leftover;
gpu_soak.py records one per cycle.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass

__all__ = ["GpuSample", "still_held"]

# Memory NVML reports in use moves by a few MiB with nothing running (the driver's own bookkeeping); a
# process's CUDA context alone takes 300 MiB or more on an H100, so a leftover context is far above this.
TOLERANCE_MIB = 128.0


@dataclass(frozen=True)
class GpuSample:
    """The visible GPUs at one moment: `used_mib` per GPU (as this process numbers them, honouring
    CUDA_VISIBLE_DEVICES), `pids`, the processes with a compute context on any of them (empty where
    the container's process namespace hides them; `used_mib` still shows what they hold), and `indices`,
    the same GPUs' NVML (nvidia-smi) indices.
    """

    used_mib: tuple[float, ...]
    pids: frozenset[int]
    indices: tuple[int, ...]

    @classmethod
    def take(cls) -> GpuSample | None:
        """The GPUs now; None where neither NVML (nvidia-ml-py) nor nvidia-smi finds an NVIDIA GPU."""
        try:
            import pynvml
        except ImportError:
            return _from_nvidia_smi()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            return None
        try:
            indices = tuple(visible_indices(pynvml.nvmlDeviceGetCount()))
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
            used = tuple(pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20 for h in handles)
            pids = frozenset(p.pid for h in handles for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h))
        finally:
            pynvml.nvmlShutdown()
        return cls(used, pids, indices) if handles else None

    def held_since(self, before: GpuSample) -> dict[str, list]:
        """What is held now that was not in `before`: {"processes": [pids]} and {"memory_mib": [(gpu,
        MiB more than before)]} beyond TOLERANCE_MIB; only kinds with items.
        """
        held: dict[str, list] = {}
        if self.pids - before.pids:
            held["processes"] = sorted(self.pids - before.pids)
        grown = [(i, round(now - then)) for i, (now, then) in enumerate(zip(self.used_mib, before.used_mib))]
        grown = [(i, mib) for i, mib in grown if mib > TOLERANCE_MIB]
        if grown:
            held["memory_mib"] = grown
        return held

    def as_dict(self) -> dict:
        """The sample as JSON-ready data."""
        values = asdict(self)
        values["pids"] = sorted(self.pids)
        values["used_mib"] = [round(mib, 1) for mib in self.used_mib]
        return values


def still_held(before: GpuSample | None, within: float = 10.0) -> dict[str, list]:
    """What the GPUs still hold `within` seconds from now beyond `before` (polled; {} as soon as nothing
    is): a SIGKILLed process frees its GPU memory only once the driver has torn its context down.
    """
    if before is None:
        return {}
    deadline = time.monotonic() + within
    while True:
        now = GpuSample.take()
        held = now.held_since(before) if now is not None else {}
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def _from_nvidia_smi() -> GpuSample | None:
    """The same sample from nvidia-smi's CSV (memory per GPU; the processes of every GPU), where the NVML
    bindings are not installed.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None

    def query(*args: str) -> list[str]:
        out = subprocess.run([exe, *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
        return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []

    used = query("--query-gpu=memory.used")
    if not used:
        return None
    pids = frozenset(int(line) for line in query("--query-compute-apps=pid") if line.isdigit())
    indices = tuple(visible_indices(len(used)))
    return GpuSample(tuple(float(used[i]) for i in indices), pids, indices)


def visible_indices(count: int) -> list[int]:
    """The NVML indices of the GPUs CUDA_VISIBLE_DEVICES leaves visible (all where unset or not numeric)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    if not wanted or not all(v.isdigit() for v in wanted):
        return list(range(count))
    return [int(v) for v in wanted if int(v) < count]
