"""nbkit.dashboard.board: the state a run's events add up to (rates, losses, the pace, the summary)."""

from __future__ import annotations

import pytest
from dashboard_events import step_event

from nbkit.notebook.dashboard.board import Board


@pytest.mark.version_independent
def test_eta_follows_the_steady_pace_not_the_first_step_or_a_pause():
    board = Board(1)
    # step 1 took 30 s (compilation), step 3 had a 10 s checkpoint save, the others 0.5 s each
    for step, elapsed in ((1, 30.0), (2, 30.5), (3, 40.5), (4, 41.0), (5, 41.5)):
        board.record(0, step_event(step, 1.0, elapsed=elapsed))
    # 5 steps are left at 0.5 s each
    assert board.snapshot().eta == pytest.approx(2.5)
    assert board.summary()["seconds_per_step"] == pytest.approx(0.5)


@pytest.mark.version_independent
def test_summary_rate_counts_from_the_first_token_report():
    board = Board(2)
    for rank in (0, 1):
        board.record(rank, {"step": 0, "total_steps": 10, "elapsed": 40.0})  # 40 s of imports first
        board.record(rank, step_event(1, 2.0, seen=100, elapsed=41.0))
        board.record(rank, step_event(2, 1.0, seen=300, elapsed=42.0))
    summary = board.summary(success=True)
    assert summary["tokens_per_second"] == pytest.approx(2 * 200.0)  # (300 - 100) tokens / 1 s, per rank
    assert summary["final_loss"] == pytest.approx(1.0)
    assert summary["step"] == 2 and summary["total_steps"] == 10


@pytest.mark.version_independent
def test_summary_pace_leaves_the_first_step_out():
    board = Board(2)
    for rank, pace in ((1, 0.5), (0, 0.25)):  # rank 0's clock decides, whichever rank reports first
        board.record(rank, {"step": 0, "total_steps": 10, "elapsed": 10.0})
        board.record(rank, step_event(1, 2.0, seen=100, elapsed=40.0))  # 30 s of compilation in step 1
        for step in range(2, 6):
            board.record(rank, step_event(step, 1.0, seen=100 * step, elapsed=40.0 + pace * (step - 1)))
    summary = board.summary()
    assert summary["seconds_per_step"] == pytest.approx(0.25)
    assert summary["tokens_per_second"] == pytest.approx(100 / 0.25 + 100 / 0.5)  # each rank at its own pace
    lone = Board(1)
    lone.record(0, step_event(1, 2.0, seen=100, elapsed=40.0))
    assert lone.summary()["seconds_per_step"] is None  # one step: no pace after it


@pytest.mark.version_independent
def test_tokens_per_second_is_smoothed_over_the_last_ten_seconds_of_each_rank():
    board = Board(2)
    seen = {0: 0, 1: 0}
    shown, instant = [], []
    # 0.1 s steps whose sizes alternate 85 / 299 tokens (850 / 2,990 tokens/s per step, the swing
    # seen in the browser), on both ranks
    for i in range(1, 201):
        for rank in (0, 1):
            tokens = 85 if i % 2 else 299
            seen[rank] += tokens
            board.record(
                rank, {"step": i, "tokens_seen": seen[rank], "elapsed": 0.1 * i, "tokens_per_second": tokens * 10}
            )
        if i > 100:
            shown.append(board.snapshot().tokens_per_second)
            instant.append(2 * (85 if i % 2 else 299) * 10)
    assert max(instant) / min(instant) > 3
    assert max(shown) / min(shown) < 1.05
    assert sum(shown) / len(shown) == pytest.approx(2 * (85 + 299) / 2 * 10, rel=0.03)
    # the pace halves: within the next 10 s of reports the figure follows
    for i in range(201, 311):
        for rank in (0, 1):
            seen[rank] += 96
            board.record(rank, {"step": i, "tokens_seen": seen[rank], "elapsed": 0.1 * i})
    assert board.snapshot().tokens_per_second == pytest.approx(2 * 960, rel=0.01)
