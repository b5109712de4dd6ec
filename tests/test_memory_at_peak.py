"""benchmarks.memory_at_peak's replay of a torch memory snapshot's trace: the peak of the allocated bytes, what was
live then by the code that allocated it, and the part older than the recording. The traces are written in the
format torch.cuda.memory._snapshot() gives (the recording itself needs a CUDA GPU: benchmarks/gpu_suite.sh)."""

from __future__ import annotations

import pytest

from benchmarks import memory_at_peak

GIB = 2**30


def _frame(path: str, name: str) -> dict:
    return {"filename": path, "line": 1, "name": name}


def _alloc(addr: int, gib: float, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": int(gib * GIB), "frames": list(frames)}


def _free(addr: int, gib: float, action: str = "free_completed") -> dict:
    return {"action": action, "addr": addr, "size": int(gib * GIB)}


GATHER = _frame("/site/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_all_gather")
DEQUANT = _frame("/site/bitsandbytes/functional.py", "dequantize_4bit")
LOSS = _frame("/repo/nbkit/training/savers/loss.py", "chunked_loss")
MODULE = _frame("/site/torch/nn/modules/module.py", "_call_impl")  # not an origin: the frame inside it is


@pytest.mark.version_independent
def test_the_peak_and_what_was_live_then_by_origin() -> None:
    trace = [
        _alloc(1, 1.0, GATHER),
        _alloc(2, 0.5, DEQUANT, MODULE),
        _free(2, 0.5, "free_requested"),  # the count drops only once the free completes
        _alloc(3, 0.25, MODULE, DEQUANT),
        _free(2, 0.5),
        _alloc(4, 2.0, LOSS),  # the peak: 1 (older) + 1 + 0.25 + 2, then everything but the gather goes
        _free(4, 2.0),
        _free(3, 0.25),
        _alloc(5, 1.5),
    ]
    report = memory_at_peak.breakdown(trace, before=GIB, max_entries=100)
    assert report["peak_gib"] == 4.25
    assert report["before_gib"] == 1.0
    assert report["origins"] == [
        {"origin": "nbkit/training/savers/loss.py:chunked_loss", "gib": 2.0, "blocks": 1},
        {
            "origin": "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:foreach_all_gather",
            "gib": 1.0,
            "blocks": 1,
        },
        {"origin": "bitsandbytes/functional.py:dequantize_4bit", "gib": 0.25, "blocks": 1},
    ]
    assert report["other_gib"] == 0 and not report["truncated"]


@pytest.mark.version_independent
def test_older_allocations_freed_before_the_peak_leave_the_unattributed_part() -> None:
    # Address 9 was allocated before the recording: its free lowers the older part, not a recorded origin.
    trace = [_free(9, 0.5), _alloc(1, 0.75), _alloc(2, 0.5, DEQUANT), _alloc(3, 0.125, DEQUANT)]
    report = memory_at_peak.breakdown(trace, before=2 * GIB, max_entries=4, top=1)
    assert report["peak_gib"] == 2.875
    assert report["before_gib"] == 1.5
    assert report["origins"] == [{"origin": memory_at_peak.NO_FRAME, "gib": 0.75, "blocks": 1}]
    assert report["other_gib"] == 0.625  # bitsandbytes' two blocks, past the top 1
    assert report["truncated"]  # as many entries as the ring holds: the oldest may be lost


@pytest.mark.version_independent
def test_a_peak_before_the_recording_is_the_allocated_bytes_it_started_with() -> None:
    report = memory_at_peak.breakdown([_free(9, 1.0), _alloc(1, 0.5, LOSS)], before=3 * GIB, max_entries=10)
    assert report["peak_gib"] == 3.0 and report["before_gib"] == 3.0 and report["origins"] == []
