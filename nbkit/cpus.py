"""Which CPUs each launched rank runs on, and how many threads torch gives it.

A forked rank inherits the notebook's CPU set and torch's full thread pool, so two or four ranks
on one machine each believe they own every core. Their host work (Python, kernel launches,
autograd) then competes for the same cores: on 2 H200s a 1K-token unsloth step spent ~35% more
host time per torch op under two ranks than under one, with no communication involved (see
benchmarks/RESULTS.md). torchrun avoids part of this by setting OMP_NUM_THREADS=1;
notebook_launcher does nothing.

`plan` splits the CPUs this process may use into one block of whole physical cores per local rank,
inside the NUMA node of the rank's GPU where the machine says which that is; `place` applies a
block to the calling process. The setting `cpu_affinity` (nbkit.configure, NBKIT_CPU_AFFINITY)
picks the policy: "auto" (pin and size the thread pool), "threads" (size the thread pool only),
"off" (leave both as inherited).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Placement", "plan", "place", "gpu_numa_nodes"]

_SYS_CPU = Path("/sys/devices/system/cpu")
_SYS_PCI = Path("/sys/bus/pci/devices")


@dataclass(frozen=True)
class Placement:
    """One rank's share: the logical CPUs to run on (None: leave the CPU set alone) and the size of
    torch's intra-op thread pool (one thread per physical core of the share)."""

    cpus: tuple[int, ...] | None
    threads: int


def plan(nprocs: int, policy: str, *, cpus: list[int] | None = None, cores: dict[int, tuple] | None = None,
         numa: dict[int, int] | None = None, gpu_nodes: list[int | None] | None = None) -> list[Placement] | None:
    """One Placement per local rank, or None to leave every rank as it is.

    Takes the number of ranks on this machine and the policy ("auto", "threads" or "off"). The
    machine is read from Linux's sysfs unless given (tests pass their own): `cpus` the logical CPUs
    this process may use, `cores` {cpu: physical core key}, `numa` {cpu: NUMA node}, `gpu_nodes`
    the NUMA node of each rank's GPU (None where unknown or for CPU ranks; see gpu_numa_nodes).
    Ranks get disjoint blocks of whole
    cores; when every rank's GPU node is known and each node has a core per rank placed on it, a
    rank's block lies in its GPU's node. With fewer cores than ranks there is nothing to split and
    the answer is None. Raises ValueError for an unknown policy.
    """
    if policy not in ("auto", "threads", "off"):
        raise ValueError(f"cpu_affinity={policy!r} is not valid; use 'auto', 'threads' or 'off'.")
    if policy == "off" or nprocs < 1:
        return None
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    cores = _physical_cores(cpus) if cores is None else cores
    groups = _group_by_core(cpus, cores)
    if len(groups) < nprocs:
        return None
    blocks = _split_by_node(groups, nprocs, numa, gpu_nodes) or _split(groups, nprocs)
    return [Placement(tuple(sorted(c for core in block for c in core)) if policy == "auto" else None, len(block))
            for block in blocks]


def place(placement: Placement | None) -> None:
    """Apply a Placement to the calling process: its CPU set, then torch's thread pool size (after
    the CPU set, so that the pool's threads start inside it). None changes nothing."""
    if placement is None:
        return
    import torch

    if placement.cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, placement.cpus)
    torch.set_num_threads(placement.threads)


def gpu_numa_nodes() -> list[int | None] | None:
    """The NUMA node of each visible GPU (CUDA_VISIBLE_DEVICES order), None for one the machine
    does not say; None when nvidia-smi is missing. Creates no CUDA context."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    bus = {}
    for line in out.strip().splitlines():
        index, _, bus_id = (part.strip() for part in line.partition(","))
        bus[index] = bus_id
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    order = [v.strip() for v in visible.split(",") if v.strip()] if visible else sorted(bus, key=int)
    return [_pci_numa_node(bus[i]) if i in bus else None for i in order]


# -- the machine, from sysfs --------------------------------------------------------------------

def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _physical_cores(cpus: list[int]) -> dict[int, tuple]:
    """{cpu: (package, core)}; a CPU whose topology cannot be read is a core of its own."""
    found = {}
    for cpu in cpus:
        package = _read(_SYS_CPU / f"cpu{cpu}" / "topology" / "physical_package_id")
        core = _read(_SYS_CPU / f"cpu{cpu}" / "topology" / "core_id")
        found[cpu] = (package, core) if package is not None and core is not None else ("cpu", cpu)
    return found


def _cpu_numa_nodes(cpus: list[int]) -> dict[int, int]:
    found = {}
    for cpu in cpus:
        nodes = [p.name for p in (_SYS_CPU / f"cpu{cpu}").glob("node[0-9]*")]
        if len(nodes) == 1:
            found[cpu] = int(nodes[0][4:])
    return found


def _pci_numa_node(bus_id: str) -> int | None:
    # nvidia-smi writes an 8-digit PCI domain ("00000000:18:00.0"), sysfs a 4-digit one.
    domain, _, rest = bus_id.lower().partition(":")
    value = _read(_SYS_PCI / f"{domain[-4:]}:{rest}" / "numa_node")
    return int(value) if value is not None and value.lstrip("-").isdigit() and int(value) >= 0 else None


# -- splitting -----------------------------------------------------------------------------------

def _group_by_core(cpus: list[int], cores: dict[int, tuple]) -> list[list[int]]:
    """Logical CPUs grouped by physical core, cores in the order of their first CPU."""
    groups: dict[tuple, list[int]] = {}
    for cpu in cpus:
        groups.setdefault(cores.get(cpu, ("cpu", cpu)), []).append(cpu)
    return list(groups.values())


def _split(groups: list[list[int]], parts: int) -> list[list[list[int]]]:
    """`parts` contiguous runs of cores, sizes differing by at most one."""
    return [groups[i * len(groups) // parts:(i + 1) * len(groups) // parts] for i in range(parts)]


def _split_by_node(groups: list[list[int]], nprocs: int, numa: dict[int, int] | None,
                   gpu_nodes: list[int | None] | None) -> list[list[list[int]]] | None:
    if gpu_nodes is None or len(gpu_nodes) < nprocs or any(n is None for n in gpu_nodes[:nprocs]):
        return None
    if numa is None:
        numa = _cpu_numa_nodes([c for g in groups for c in g])
    by_node: dict[int, list[list[int]]] = {}
    for group in groups:
        if group[0] in numa:
            by_node.setdefault(numa[group[0]], []).append(group)
    ranks_on: dict[int, list[int]] = {}
    for rank, node in enumerate(gpu_nodes[:nprocs]):
        ranks_on.setdefault(node, []).append(rank)
    if len(by_node) < 2 or any(len(by_node.get(node, [])) < len(r) for node, r in ranks_on.items()):
        return None  # one node (nothing to choose) or a node too small for its ranks
    blocks: list[list[list[int]]] = [[] for _ in range(nprocs)]
    for node, ranks in ranks_on.items():
        for rank, block in zip(ranks, _split(by_node[node], len(ranks))):
            blocks[rank] = block
    return blocks
