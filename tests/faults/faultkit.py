"""What the fault matrix checks around every case (used by conftest.py's `leftovers` fixture and
by the cases): snapshots of what a fault could leave behind (benchmarks.leftovers.Snapshot, shared
with the soak benchmark), timing, and the immediate rerun.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nbkit

# The checkout's root, where benchmarks/ is a package (CI does not put the checkout on PYTHONPATH).
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
from benchmarks.leftovers import Snapshot  # noqa: E402  (soak.py samples the same snapshot)

__all__ = ["SETTLE_S", "Snapshot", "assert_reruns", "failed_within"]

# Kernel cases shut their kernel down asynchronously (jupyter_client), and the last reaping of a
# launch can trail its return by a scheduling slice on this loaded machine: what is still there
# after this long is a leftover.
SETTLE_S = 10.0


@contextlib.contextmanager
def failed_within(seconds: float) -> Iterator[None]:
    """The block must end (by raising, normally) within `seconds` of wall time."""
    start = time.monotonic()
    yield
    took = time.monotonic() - start
    assert took < seconds, f"took {took:.1f} s, more than {seconds} s"


def _answer() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = __import__("torch").ones(1) * (nbkit.rank() + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def assert_reruns(gpus: int = 2) -> None:
    """The same kind of launch works at once after the fault."""
    assert nbkit.launch(_answer, gpus=gpus) == gpus * (gpus + 1) // 2
