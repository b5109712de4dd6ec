r"""Where a GPU process's host thread runs, and what a kernel launch costs there.

A step that the host bounds (1K tokens x 4 on an H100 or H200) is as fast as its main thread can call
torch ops. This probe measures that speed in short-lived processes placed in different ways, alone and
two at once (as two DDP ranks run), so that a slower rank can be told apart from a slower placement:

- the machine's layout: CPUs per core, package and NUMA node; each GPU's PCI address, its NUMA node and
  the CPUs local to it (sysfs), and `nvidia-smi topo -m`;
- per process: microseconds of host time per tiny CUDA op (`add_`) and per small matrix product, and
  nanoseconds per iteration of a pure Python loop (the CPU's own speed), each the median of 3 rounds;
- scenarios: one process unpinned (three times: where the scheduler puts it varies), pinned to each
  NUMA node's CPUs, two processes at once unpinned, on their GPUs' own nodes, on two threads of one
  core, and two ranks joined by an NCCL process group (its threads running beside the main one).

    python3 benchmarks/host_placement.py --out $OUT/placement.json --md $OUT/placement.md

On a machine without GPUs it prints the layout and stops (`--dry-run` runs the scenarios on the CPU's
own ops, to check the script).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the package lives in ROOT
    sys.path.insert(0, str(ROOT))

from benchmarks.launching import free_port  # noqa: E402


def _cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def topology() -> dict[str, Any]:
    """CPUs (core, package, node, SMT siblings), NUMA nodes and GPUs (PCI address, node, local CPUs) from sysfs."""
    cpus: dict[int, dict[str, Any]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        cpus[cpu] = {
            "core": _read(f"{base}/core_id"),
            "package": _read(f"{base}/physical_package_id"),
            "siblings": _cpulist(_read(f"{base}/thread_siblings_list") or str(cpu)),
        }
    nodes = {}
    for node_dir in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        node_cpus = [c for c in _cpulist(_read(node_dir / "cpulist") or "") if c in cpus]
        nodes[int(node_dir.name[4:])] = node_cpus
        for c in node_cpus:
            cpus[c]["node"] = int(node_dir.name[4:])
    gpus = []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        for line in out.strip().splitlines():
            index, bus = (s.strip() for s in line.split(","))
            # nvidia-smi writes an 8-digit domain; sysfs uses 4 digits, lower case.
            address = bus[-12:].lower()
            device = Path("/sys/bus/pci/devices") / address
            gpus.append(
                {
                    "index": int(index),
                    "pci": address,
                    "numa_node": _read(device / "numa_node"),
                    "local_cpus": _cpulist(_read(device / "local_cpulist") or ""),
                }
            )
    topo_text = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        topo_text = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    return {"cpus": cpus, "nodes": nodes, "gpus": gpus, "nvidia_smi_topo": topo_text}


# --------------------------------------------------------------------------------------------
# One measuring process
# --------------------------------------------------------------------------------------------


def _python_loop_ns(n: int) -> float:
    """Nanoseconds per iteration of a pure Python loop of `n` iterations: the speed of the CPU this thread is on."""
    start, total = time.perf_counter(), 0
    for i in range(n):
        total += i
    return (time.perf_counter() - start) / n * 1e9


def _python_call_ns(n: int) -> float:
    """Nanoseconds per call of a small Python function: what a tracer or a sys.monitoring tool would slow first."""

    def step(i: int) -> int:
        return i + 1

    start, total = time.perf_counter(), 0
    for _ in range(n):
        total = step(total)
    return (time.perf_counter() - start) / n * 1e9


def _current_cpu() -> int:
    # Field 39 of /proc/self/stat: the CPU this thread last ran on.
    return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])


def _measure(device: str, rounds: int = 3) -> dict[str, Any]:
    import torch

    dev = torch.device(device)
    x = torch.zeros(256, device=dev)
    a = torch.randn(64, 64, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)

    def per_call_us(fn: Any, calls: int) -> float:
        for _ in range(200):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = time.perf_counter() - start  # host time only: the GPU runs behind
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return host / calls * 1e6

    rows = [
        {
            "add_us": per_call_us(lambda: x.add_(1.0), 20_000),
            "mm_us": per_call_us(lambda: torch.mm(a, a), 10_000),
            "python_ns": _python_loop_ns(1_000_000),
            "call_ns": _python_call_ns(1_000_000),
            "cpu": _current_cpu(),
        }
        for _ in range(rounds)
    ]
    keys = ("add_us", "mm_us", "python_ns", "call_ns")
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in rows), 2) for k in keys}
    out["cpus_seen"] = sorted({r["cpu"] for r in rows})
    return out


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in its own process: pin (before torch starts threads), optionally join an NCCL group, wait
    for the scenario's other processes, measure.
    """
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    import torch

    torch.set_num_threads(1)  # as nbkit's GPU ranks have it
    device = "cpu"
    if spec["gpu"] is not None:
        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES names the one GPU
        device = "cuda:0"
    import torch.distributed as dist

    group = spec.get("group")
    if group:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(group["port"]))
        dist.init_process_group("nccl" if device != "cpu" else "gloo", rank=group["rank"], world_size=group["world"])
        t = torch.ones(1 << 20, device=device)
        dist.all_reduce(t)  # the communicator and its threads exist from here on
        if device != "cpu":
            torch.cuda.synchronize()
    # Every process of the scenario measures at once: each says it is ready, then waits for the others.
    barrier = Path(spec["barrier"])
    (barrier / f"{os.getpid()}").touch()
    while len(list(barrier.iterdir())) < spec["count"]:
        time.sleep(0.01)
    result = _measure(device)
    result["affinity"] = len(os.sched_getaffinity(0))
    if group:
        dist.destroy_process_group()
    return result


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------


def run_scenario(name: str, procs: list[dict[str, Any]], gpu_env: bool) -> dict[str, Any]:
    """Start every process of a scenario at once; they measure at the same time."""
    barrier = tempfile.mkdtemp(prefix="placement-")
    port = free_port()
    children = []
    for i, proc in enumerate(procs):
        spec = dict(proc, barrier=barrier, count=len(procs))
        if proc.get("nccl"):
            spec["group"] = {"port": port, "rank": i, "world": len(procs)}
        env = dict(os.environ)
        if gpu_env and proc["gpu"] is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(proc["gpu"])
        children.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(spec)],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    results = []
    for child in children:
        out, _ = child.communicate(timeout=180)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        results.append(json.loads(lines[-1]) if child.returncode == 0 and lines else {"exit": child.returncode})
    shutil.rmtree(barrier, ignore_errors=True)
    row = {"scenario": name, "procs": [{**p, **r} for p, r in zip(procs, results)]}
    print(json.dumps(row), flush=True)
    return row


def scenarios(topo: dict[str, Any], gpus: list[int | None]) -> list[tuple[str, list[dict[str, Any]]]]:
    nodes = {n: c for n, c in topo["nodes"].items() if c}
    local = {g["index"]: g["local_cpus"] for g in topo["gpus"]}
    first, second = gpus[0], gpus[-1]
    out: list[tuple[str, list[dict[str, Any]]]] = []
    for i in range(3):
        out.append((f"one process, unpinned ({i + 1})", [{"gpu": first}]))
    if len(nodes) > 1:
        for node, cpus in nodes.items():
            out.append((f"one process on GPU {first}, pinned to node {node}", [{"gpu": first, "cpus": cpus}]))
    # A core and its SMT sibling, and two cores apart.
    cpu0 = min(topo["cpus"])
    sibling = next((c for c in topo["cpus"][cpu0]["siblings"] if c != cpu0), None)
    other_core = next((c for c in sorted(topo["cpus"]) if c not in topo["cpus"][cpu0]["siblings"]), cpu0)
    out.append((f"one process pinned to CPU {cpu0}", [{"gpu": first, "cpus": [cpu0]}]))
    for i in range(2):
        out.append((f"two processes, unpinned ({i + 1})", [{"gpu": first}, {"gpu": second}]))
    out.append(("two NCCL ranks, unpinned", [{"gpu": first, "nccl": True}, {"gpu": second, "nccl": True}]))
    if local.get(first) and local.get(second) and local[first] != local[second]:
        out.append(
            (
                "two processes, each on its GPU's local CPUs",
                [{"gpu": first, "cpus": local[first]}, {"gpu": second, "cpus": local[second]}],
            )
        )
        out.append(
            (
                "two processes, each on the other GPU's local CPUs",
                [{"gpu": first, "cpus": local[second]}, {"gpu": second, "cpus": local[first]}],
            )
        )
    if sibling is not None:
        out.append(
            (
                f"two processes on one core's two threads (CPUs {cpu0}, {sibling})",
                [{"gpu": first, "cpus": [cpu0]}, {"gpu": second, "cpus": [sibling]}],
            )
        )
    out.append(
        (
            f"two processes on two cores (CPUs {cpu0}, {other_core})",
            [{"gpu": first, "cpus": [cpu0]}, {"gpu": second, "cpus": [other_core]}],
        )
    )
    return out


def _spin_python(cpu: int, seconds: float) -> None:
    os.sched_setaffinity(0, [cpu])
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def smt_scan(cpus: list[int]) -> list[dict[str, Any]]:
    """A virtual machine can hide which of its CPUs share a physical core. With a busy process on the
    first CPU, time a Python loop on each other CPU: a CPU that shares the busy one's core runs slower.
    """
    import multiprocessing

    def loop_ns(cpu: int) -> float:
        os.sched_setaffinity(0, [cpu])
        return min(_python_loop_ns(300_000) for _ in range(3))

    first, rows = cpus[0], []
    for cpu in cpus[1:]:
        quiet = loop_ns(cpu)
        busy = multiprocessing.Process(target=_spin_python, args=(first, 1.0))
        busy.start()
        time.sleep(0.1)
        loaded = loop_ns(cpu)
        busy.join()
        rows.append({"busy_cpu": first, "cpu": cpu, "quiet_ns": round(quiet, 2), "beside_busy_ns": round(loaded, 2)})
    os.sched_setaffinity(0, cpus)
    return rows


def markdown(topo: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    cpus = topo["cpus"]
    smt = max(len(c["siblings"]) for c in cpus.values())
    lines = [
        f"CPUs: {len(cpus)}, {smt} thread(s) per core, NUMA nodes: "
        + "; ".join(f"{n}: {len(c)} CPUs" for n, c in topo["nodes"].items()),
        "GPUs: "
        + "; ".join(
            f"{g['index']} at {g['pci']}, node {g['numa_node']}, {len(g['local_cpus'])} local CPUs"
            for g in topo["gpus"]
        ),
        "",
        "| scenario | process | GPU | CPUs allowed | ran on | add_ us | mm us | Python ns/iter |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        for i, p in enumerate(row["procs"]):
            lines.append(
                f"| {row['scenario']} | {i} | {p['gpu']} | {p.get('affinity', '')} | {p.get('cpus_seen', p.get('exit'))} "
                f"| {p.get('add_us', '')} | {p.get('mm_us', '')} | {p.get('python_ns', '')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--md")
    p.add_argument("--dry-run", action="store_true", help="no GPU: run the scenarios on CPU ops")
    p.add_argument("--smt-scan", action="store_true", help="only: which CPUs slow down beside a busy first CPU")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))), flush=True)
        return 0
    topo = topology()
    if a.smt_scan:
        scan = smt_scan(sorted(topo["cpus"]))
        text = "\n".join(
            f"CPU {r['cpu']}: {r['quiet_ns']} ns/iter alone, {r['beside_busy_ns']} beside a busy CPU {r['busy_cpu']}"
            for r in scan
        )
        print(text)
        if a.out:
            Path(a.out).write_text(json.dumps({"smt_scan": scan, "topology": topo}, indent=1, default=str) + "\n")
        return 0
    print(json.dumps({k: v for k, v in topo.items() if k != "cpus"}, indent=1), flush=True)
    gpus: list[int | None] = [g["index"] for g in topo["gpus"]]
    if not gpus and not a.dry_run:
        print("No GPU: the layout only.")
        return 0
    plan = scenarios(topo, gpus or [None, None])
    rows = [run_scenario(name, procs, gpu_env=bool(gpus)) for name, procs in plan]
    result = {"topology": topo, "rows": rows, "command": " ".join(["python3", *sys.argv])}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    md = markdown(topo, rows)
    print(md)
    if a.md:
        Path(a.md).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
