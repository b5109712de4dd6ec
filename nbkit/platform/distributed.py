"""Where this process stands in a distributed run: rank, world size, device and precision.

Everything here reads the environment that torch.distributed launchers set (RANK, LOCAL_RANK,
WORLD_SIZE), so the same answers come back under nbkit.launch, torchrun and `accelerate launch`.
Nothing here initialises CUDA in a process that has not done so already: the notebook process must
stay fork-safe until it launches.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "GPU",
    "cuda_initialized",
    "device",
    "is_distributed",
    "is_main",
    "launched",
    "local_rank",
    "machine_gpus",
    "precision",
    "rank",
    "visible_gpus",
    "world_size",
]


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def rank() -> int:
    """Global rank of this process (0 outside a distributed run)."""
    return _env_int("RANK", default=0)


def local_rank() -> int:
    """Rank of this process on its machine (0 outside a distributed run)."""
    return _env_int("LOCAL_RANK", default=0)


def world_size() -> int:
    """Number of processes in the run (1 outside a distributed run)."""
    return _env_int("WORLD_SIZE", default=1)


def is_main() -> bool:
    """True on global rank 0 and outside distributed runs: the process that saves and prints."""
    return rank() == 0


def launched() -> bool:
    """True in a process a launcher started as a rank (nbkit.launch, torchrun, accelerate launch), even
    the only one: RANK, WORLD_SIZE and MASTER_ADDR are in its environment, which torch's env://
    initialisation of a process group reads.
    """
    return all(os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def is_distributed() -> bool:
    """True inside a run of several processes (nbkit.launch, torchrun, accelerate launch, several nodes).

    A process counts as distributed when a launcher exported WORLD_SIZE > 1 with a rank, or when
    torch.distributed is already initialised with more than one process.
    """
    if world_size() > 1 and ("RANK" in os.environ or "LOCAL_RANK" in os.environ):
        return True
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def cuda_initialized() -> bool:
    """Whether this process has already created a CUDA context (which makes forking unsafe)."""
    import torch

    return torch.cuda.is_initialized()


def device() -> str:
    """This rank's device: "cuda:<local_rank>" where CUDA is available, else "cpu"."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{local_rank()}"
    return "cpu"


@dataclass(frozen=True)
class GPU:
    """One visible GPU, as reported without creating a CUDA context."""

    index: int
    name: str
    memory_gib: float
    capability: tuple[int, int]

    @property
    def bf16(self) -> bool:
        """Native bf16 (Ampere and newer). T4s (7.5) only emulate it, slowly."""
        return self.capability >= (8, 0)


def visible_gpus() -> list[GPU]:
    """The GPUs this process may use, honouring CUDA_VISIBLE_DEVICES, without initialising CUDA.

    In a process where CUDA is already initialised torch answers directly; otherwise nvidia-smi is
    asked (torch's own queries would create a context and make a later fork fail).

    Returns:
        One GPU per visible device, indexed as this process sees them; [] on a machine without
        NVIDIA GPUs.
    """
    import torch

    if not torch.cuda.is_available():
        return []
    if torch.cuda.is_initialized():
        gpus = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(GPU(i, props.name, props.total_memory / 2**30, (props.major, props.minor)))
        return gpus
    listed = _nvidia_smi_gpus()
    if listed is None:
        # No nvidia-smi: count through NVML (context-free) and leave the details unknown.
        return [GPU(i, "unknown", 0.0, (0, 0)) for i in range(torch.cuda.device_count())]
    gpus = listed
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() != "":
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        by_index = {str(g.index): g for g in gpus}
        gpus = [by_index[w] for w in wanted if w in by_index]
    return [GPU(i, g.name, g.memory_gib, g.capability) for i, g in enumerate(gpus)]


def machine_gpus() -> list[GPU]:
    """The machine's NVIDIA GPUs as nvidia-smi lists them ([] without nvidia-smi), CUDA_VISIBLE_DEVICES not applied.
    Needs no torch: nbkit.bootstrap asks before torch may be installed.
    """
    return list(_nvidia_smi_gpus() or [])


@lru_cache(maxsize=1)
def _nvidia_smi_gpus() -> list[GPU] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total,compute_cap", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    gpus = []
    for line in out.strip().splitlines():
        index, name, mem_mib, cap = (part.strip() for part in line.split(","))
        major, _, minor = cap.partition(".")
        gpus.append(GPU(int(index), name, float(mem_mib) / 1024, (int(major), int(minor or 0))))
    return gpus


def precision() -> str:
    """The training precision this process should use: "bf16", "fp16" or "fp32".

    "bf16" only where the GPU has native bf16 (compute capability >= 8.0); "fp16" on older GPUs such
    as Kaggle's T4 (where torch.cuda.is_bf16_supported() says True because it counts emulation);
    "fp32" on CPU. Under a GPU profile (nbkit.emulate("T4"), NBKIT_EMULATE) the profile's precision
    wherever a GPU is visible. Safe to call in the notebook process before launching: it does not
    create a CUDA context there.

    Raises:
        nbkit.errors.EmulationError: NBKIT_EMULATE names no profile.
    """
    from nbkit.training import emulation

    gpus = visible_gpus()
    if not gpus:
        return "fp32"
    profile = emulation.active()
    if profile is not None:
        return profile.precision
    gpu = gpus[min(local_rank(), len(gpus) - 1)]
    if gpu.capability == (0, 0):  # details unknown: only a live context can tell
        import torch

        if not torch.cuda.is_initialized():
            return "fp16"
        gpu = GPU(gpu.index, gpu.name, gpu.memory_gib, torch.cuda.get_device_capability(gpu.index))
    return "bf16" if gpu.bf16 else "fp16"
