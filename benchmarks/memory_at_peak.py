"""Where a GPU's peak allocated memory goes: record the CUDA caching allocator's history over a few training steps,
replay it, and group what was live at the peak by the code that allocated it.

The planner's estimates are checked against `torch.cuda.max_memory_allocated`, which says how much but not what.
torch's snapshot (`torch.cuda.memory._snapshot`, the format torch's memory visualiser reads) holds every allocation and
free with the Python stack that made it; replaying it gives the bytes live at the highest point and their origins
(nbkit's savers, bitsandbytes' dequantisation, FSDP's all-gathers, the loss...). Allocations older than the
recording (the loaded or sharded weights) have no stack: they are reported together, as `before_gib`.

Recording a Python stack per allocation slows a step down, so a benchmark records its first steps only, before the
timed ones.
"""

from __future__ import annotations

from typing import Any

import torch

# Code whose allocations are worth telling apart, looked for in each frame's file name, innermost frame first.
ORIGINS = (
    "/nbkit/",
    "/bitsandbytes/",
    "/peft/",
    "/liger_kernel/",
    "/transformers/",
    "/accelerate/",
    "/torch/distributed/fsdp/",
    "/torch/utils/checkpoint",
    "/trl/",
)
NO_FRAME = "(no Python frame: autograd's backward or C++)"
# Trace entries the recording keeps (a ring: the oldest go first; breakdown() says when it filled).
MAX_ENTRIES = 2_000_000
GIB = 2**30


def start(devices: list[torch.device]) -> dict[int, int]:
    """Start recording allocations with their Python stacks; returns the bytes allocated on each device now (what the
    replay cannot attribute). Every process records for all its devices; call stop() to end it.
    """
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)
    return {d.index: torch.cuda.memory_allocated(d) for d in devices}


def stop(before: dict[int, int], top: int = 25) -> dict[int, dict[str, Any]]:
    """End the recording that start() began; {device index: breakdown(...)} for each device start() was given."""
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    traces = snapshot["device_traces"]
    return {
        index: breakdown(traces[index] if index < len(traces) else [], allocated, MAX_ENTRIES, top)
        for index, allocated in before.items()
    }


def breakdown(trace: list[dict[str, Any]], before: int, max_entries: int, top: int = 25) -> dict[str, Any]:
    """The peak of a device's allocated bytes over `trace` (its entries of a torch memory snapshot, oldest first),
    starting from `before` bytes allocated when the recording began, and what was live then: the bytes by origin
    (the innermost frame in ORIGINS' code, as "path:function"), the `top` largest, the rest summed as other_gib.
    A trace of max_entries entries lost its oldest ones (the recording is a ring): `truncated` says so.
    """
    peak_at, allocated, peak = -1, before, before
    for index, entry in enumerate(trace):
        allocated += _change(entry)
        if allocated > peak:
            peak_at, peak = index, allocated
    live: dict[int, tuple[int, str]] = {}
    older = before
    for entry in trace[: peak_at + 1]:
        if entry["action"] == "alloc":
            live[entry["addr"]] = (entry["size"], origin(entry.get("frames", [])))
        elif entry["action"] == "free_completed" and live.pop(entry["addr"], None) is None:
            older -= entry["size"]  # made before the recording began
    groups: dict[str, list[int]] = {}
    for size, where in live.values():
        bytes_and_blocks = groups.setdefault(where, [0, 0])
        bytes_and_blocks[0] += size
        bytes_and_blocks[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    return {
        "peak_gib": peak / GIB,
        "before_gib": older / GIB,
        "entries": len(trace),
        "truncated": len(trace) >= max_entries,
        "origins": [{"origin": o, "gib": b / GIB, "blocks": n} for o, (b, n) in ranked[:top]],
        "other_gib": sum(b for _, (b, _n) in ranked[top:]) / GIB,
    }


def _change(entry: dict[str, Any]) -> int:
    """The entry's change to the allocated bytes: the allocator's count drops at free_completed, not free_requested."""
    if entry["action"] == "alloc":
        return int(entry["size"])
    return -int(entry["size"]) if entry["action"] == "free_completed" else 0


def origin(frames: list[dict[str, Any]]) -> str:
    """The allocation's origin: the innermost frame in ORIGINS' code, else the innermost frame, as path:function."""
    for frame in frames:
        name = frame["filename"]
        for code in ORIGINS:
            if code in name:
                return f"{name[name.index(code) + 1 :]}:{frame['name']}"
    return f"{frames[0]['filename']}:{frames[0]['name']}" if frames else NO_FRAME
