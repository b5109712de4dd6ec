"""The board: a run's events, as the ranks reported them, turned into its state (a Snapshot) and
its end-of-run summary. No display here: nbkit.dashboard shows what this computes.
"""

from __future__ import annotations

import collections
import itertools
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

__all__ = ["Board", "Snapshot", "is_number", "other_metrics"]

# tokens/s is measured over each rank's reports of the last 10 s (at least its last two reports):
# the rate of single steps swung between 852 and 2,992 tokens/s between frames on 2 CPU ranks
# (tiny:qwen3-vl, landscape.md). Measured here, 2 CPU ranks of tiny:qwen3 with batches of 8-63
# tokens and ~0.1 s steps, after the first quarter of 150 steps: the sum of the ranks' per-step
# rates ranged 149-1,024 tokens/s (coefficient of variation 0.32), the 10 s window 497-587 (0.04).
_RATE_WINDOW_S = 10.0
# Keys of an event that have their own place in the panel; any other number is shown on the
# "latest log" line (SFTTrainer's entropy, mean_token_accuracy, eval_loss, ...).
_SHOWN_KEYS = frozenset(
    {
        "step",
        "total_steps",
        "loss",
        "learning_rate",
        "grad_norm",
        "epoch",
        "tokens_per_second",
        "tokens_seen",
        "peak_memory_gib",
        "memory_device",
        "elapsed",
        "time",
    }
)


@dataclass
class Snapshot:
    """The run as it stands: what the panel, the text line and the summary show.

    step/total_steps: the furthest step any rank reported, and the run's length. loss: mean of
    the ranks' latest losses. tokens_per_second: all ranks together, each rank's rate measured over
    its reports of the last 10 s. eta: seconds left at the median step after the first (a save or a
    recompilation inside the run does not stretch it).
    ranks: {rank: its latest value of every key, tokens_per_second smoothed as above}.
    peak_memory_gib: {rank: (GiB, device)}; device "cuda:N" means torch's peak allocation on that
    GPU, "cpu" the process's peak resident memory. curve: [(step, loss averaged over the ranks that
    reported that step)].
    """

    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None
    tokens_per_second: float | None = None
    elapsed: float = 0.0
    eta: float | None = None
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    peak_memory_gib: dict[int, tuple[float, str]] = field(default_factory=dict)
    curve: list[tuple[int, float]] = field(default_factory=list)


class Board:
    """The state of one run, fed event by event.

    Takes nprocs (how many ranks report). `record()` may be called from any thread; `snapshot()`
    and `summary()` read the state at any time. `events` keeps every (rank, metrics) in order.
    """

    def __init__(self, nprocs: int):
        self.nprocs = nprocs
        self.events: list[tuple[int, dict[str, Any]]] = []
        self._lock = threading.RLock()
        self._created = time.monotonic()
        self._ranks: dict[int, dict[str, Any]] = {}
        self._peaks: dict[int, tuple[float, str]] = {}
        self._losses: dict[int, dict[int, float]] = {}  # step -> {rank: loss}
        # rank -> (elapsed, step, tokens_seen or None) of each of its step events after step 0: the pace
        self._step_marks: dict[int, list[tuple[float, int, float | None]]] = {}
        # rank -> its (elapsed, tokens_seen) reports: all but the window's are dropped as they age
        self._token_reports: dict[int, collections.deque[tuple[float, float]]] = {}

    def record(self, rank: int, metrics: dict[str, Any]) -> None:
        """Add one event of `rank` to the state."""
        with self._lock:
            self.events.append((rank, metrics))
            merged = self._ranks.setdefault(rank, {})
            merged.update(metrics)
            step, loss = metrics.get("step"), metrics.get("loss")
            if is_number(loss) and isinstance(step, int):
                self._losses.setdefault(step, {})[rank] = float(loss)
            seen, elapsed = metrics.get("tokens_seen"), metrics.get("elapsed")
            if isinstance(step, int) and step > 0 and is_number(elapsed):
                marks = self._step_marks.setdefault(rank, [])
                if not marks or step > marks[-1][1]:
                    marks.append((float(elapsed), step, float(seen) if is_number(seen) else None))
            if is_number(seen) and is_number(elapsed):
                reports = self._token_reports.setdefault(rank, collections.deque())
                reports.append((float(elapsed), float(seen)))
                while len(reports) > 2 and reports[1][0] <= elapsed - _RATE_WINDOW_S:
                    reports.popleft()
            memory = metrics.get("peak_memory_gib")
            if is_number(memory):
                old = self._peaks.get(rank, (0.0, ""))[0]
                self._peaks[rank] = (max(old, float(memory)), str(metrics.get("memory_device", "")))

    def snapshot(self) -> Snapshot:
        """The run as reported so far (see Snapshot)."""
        now = time.monotonic()
        with self._lock:
            ranks = {r: dict(m) for r, m in sorted(self._ranks.items())}
            for rank, reports in self._token_reports.items():
                (t0, seen0), (t1, seen1) = reports[0], reports[-1]
                if t1 > t0:
                    ranks[rank]["tokens_per_second"] = (seen1 - seen0) / (t1 - t0)
            snap = Snapshot(ranks=ranks, peak_memory_gib=dict(sorted(self._peaks.items())), elapsed=now - self._created)
            steps = [m["step"] for m in ranks.values() if isinstance(m.get("step"), int)]
            totals = [m["total_steps"] for m in ranks.values() if isinstance(m.get("total_steps"), int)]
            snap.step = max(steps) if steps else None
            snap.total_steps = max(totals) if totals else None
            snap.loss = _mean(m.get("loss") for m in ranks.values())
            snap.learning_rate = _first(m.get("learning_rate") for m in ranks.values())
            snap.grad_norm = _first(m.get("grad_norm") for m in ranks.values())
            rates = [m["tokens_per_second"] for m in ranks.values() if is_number(m.get("tokens_per_second"))]
            snap.tokens_per_second = sum(rates) if rates else None
            snap.curve = [(s, sum(by_rank.values()) / len(by_rank)) for s, by_rank in sorted(self._losses.items())]
            per_step = self._steady_step_seconds()
            if per_step is not None and snap.step and snap.total_steps:
                snap.eta = per_step * max(snap.total_steps - snap.step, 0)
        return snap

    def _steady_step_seconds(self) -> float | None:
        """The lowest rank's steady seconds per step (rank 0's where it reports): `steady_pace` of its marks."""
        return steady_pace(self._step_marks[min(self._step_marks)])[0] if self._step_marks else None

    def summary(self, success: bool = True) -> dict[str, Any]:
        """What the run came to.

        Returns:
            {"success", "final_loss", "step", "total_steps", "total_time" (s), "seconds_per_step" (the
            median step after the first, which holds compilation and warm-up, on the lowest rank's clock;
            None before two steps), "tokens_per_second" (all ranks, each its median rate from one step
            to the next; the last 10 s where a rank reported one step), "peak_memory_gib"
            ({rank: (GiB, device)}), "metrics" (the other numbers of rank 0's latest reports, e.g.
            eval_loss, mean_token_accuracy)}.
        """
        snap = self.snapshot()
        rates = []
        with self._lock:
            for rank in snap.ranks:
                rate = steady_pace(self._step_marks.get(rank, []))[1]
                if rate is None:
                    rate = snap.ranks[rank].get("tokens_per_second")
                if is_number(rate):
                    rates.append(float(rate))
            per_step = self._steady_step_seconds()
        return {
            "success": success,
            "final_loss": snap.curve[-1][1] if snap.curve else snap.loss,
            "step": snap.step,
            "total_steps": snap.total_steps,
            "total_time": snap.elapsed,
            "seconds_per_step": per_step,
            "tokens_per_second": sum(rates) if rates else None,
            "peak_memory_gib": snap.peak_memory_gib,
            "metrics": other_metrics(snap),
        }


def steady_pace(marks: Sequence[tuple[float, int, float | None]]) -> tuple[float | None, float | None]:
    """A run's steady pace from (time, step, tokens seen so far or None) at the end of its steps, the first
    step's end first: (the median seconds per step, the median tokens per second), each from one mark to the
    next, so that the first step (compilation, warm-up), a checkpoint save or a recompilation inside the run is
    not the pace; None where fewer than two marks (for tokens, two that carry a count and a rise in it).
    The dashboard's summary and a rank's own figures (nbkit.rank_side.reporting) both come from here.
    """
    spans = [(t1 - t0) / (s1 - s0) for (t0, s0, _), (t1, s1, _) in itertools.pairwise(marks)]
    counted = [(t, seen) for t, _, seen in marks if seen is not None]
    rates = [(n1 - n0) / (t1 - t0) for (t0, n0), (t1, n1) in itertools.pairwise(counted) if t1 > t0 and n1 > n0]
    return (statistics.median(spans) if spans else None, statistics.median(rates) if rates else None)


def other_metrics(snap: Snapshot) -> dict[str, float]:
    """Rank 0's (else the lowest rank's) latest numbers that have no column of their own."""
    if not snap.ranks:
        return {}
    latest_values = snap.ranks.get(0, next(iter(snap.ranks.values())))
    return {k: float(v) for k, v in sorted(latest_values.items()) if k not in _SHOWN_KEYS and is_number(v)}


def is_number(value: Any) -> TypeGuard[int | float]:
    """Whether value is a number (an int or a float, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _mean(values: Any) -> float | None:
    numbers = [float(v) for v in values if is_number(v)]
    return sum(numbers) / len(numbers) if numbers else None


def _first(values: Any) -> float | None:
    return next((float(v) for v in values if is_number(v)), None)
