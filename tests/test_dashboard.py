"""The dashboard in one process: aggregation over ranks, the text fallback, the widget panel, the
static summary, and how the display mode is chosen."""

from __future__ import annotations

import io
import time

import pytest

from nbkit import dashboard
from nbkit.dashboard import Dashboard


def _step(
    step: int,
    loss: float,
    *,
    rate: float = 100.0,
    seen: int | None = None,
    elapsed: float | None = None,
    memory: float = 1.0,
) -> dict:
    return {
        "step": step,
        "total_steps": 10,
        "loss": loss,
        "learning_rate": 1e-4,
        "tokens_per_second": rate,
        "tokens_seen": seen if seen is not None else 100 * step,
        "elapsed": elapsed if elapsed is not None else step,
        "peak_memory_gib": memory,
        "memory_device": "cpu",
    }


def test_snapshot_sums_rates_averages_losses_and_keeps_peaks():
    board = Dashboard(2, mode="off")
    board.event(0, _step(1, 2.0, rate=100.0, memory=1.5))
    board.event(1, _step(1, 4.0, rate=300.0, memory=2.5))
    board.event(0, _step(2, 1.0, rate=200.0, memory=1.0))  # a later, lower reading keeps the peak
    board.event(1, {"step": 2, "grad_norm": 0.5})

    snap = board.snapshot()
    assert snap.step == 2 and snap.total_steps == 10
    assert snap.tokens_per_second == pytest.approx(200.0 + 300.0)
    assert snap.loss == pytest.approx((1.0 + 4.0) / 2)  # each rank's latest loss
    assert snap.grad_norm == pytest.approx(0.5)
    assert snap.curve == [(1, pytest.approx(3.0)), (2, pytest.approx(1.0))]
    assert snap.peak_memory_gib == {0: (1.5, "cpu"), 1: (2.5, "cpu")}
    assert [rank for rank, _ in board.events] == [0, 1, 0, 1]
    assert dashboard.latest() is board


def test_eta_follows_the_pace_since_the_first_step():
    board = Dashboard(1, mode="off")
    board.event(0, _step(1, 1.0))
    time.sleep(0.2)
    board.event(0, _step(3, 1.0))
    eta = board.snapshot().eta
    # 2 steps took ~0.2 s, 7 steps are left
    assert eta == pytest.approx(0.7, rel=0.5)


def test_summary_rate_counts_from_the_first_token_report():
    board = Dashboard(2, mode="off")
    for rank in (0, 1):
        board.event(rank, {"step": 0, "total_steps": 10, "elapsed": 40.0})  # 40 s of imports first
        board.event(rank, _step(1, 2.0, seen=100, elapsed=41.0))
        board.event(rank, _step(2, 1.0, seen=300, elapsed=42.0))
    summary = board.summary(success=True)
    assert summary["tokens_per_second"] == pytest.approx(2 * 200.0)  # (300 - 100) tokens / 1 s, per rank
    assert summary["final_loss"] == pytest.approx(1.0)
    assert summary["step"] == 2 and summary["total_steps"] == 10


def test_text_fallback_prints_lines_at_most_every_interval_and_a_summary():
    out = io.StringIO()
    board = Dashboard(2, mode="text", interval=3600)
    board._stream = out
    board.event(0, _step(1, 2.5, rate=1000.0))
    board.event(1, _step(1, 2.5, rate=1000.0))
    board.event(0, _step(2, 2.0, rate=1000.0))
    board.close(success=True)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("nbkit: step 1/10 (10%) | loss 2.5000 | lr 1.00e-04 | 1,000 tokens/s")
    assert not any(line.startswith("nbkit: step 2") for line in lines)  # throttled
    text = out.getvalue()
    assert "nbkit: finished after" in text
    assert "final loss: 2.0000" in text
    assert "peak memory rank 0 (cpu): 1.00 GiB" in text and "peak memory rank 1 (cpu): 1.00 GiB" in text


def test_interval_zero_prints_every_event_and_failure_says_so():
    out = io.StringIO()
    board = Dashboard(1, mode="text", interval=0)
    board._stream = out
    for step in (1, 2, 3):
        board.event(0, _step(step, 1.0 / step))
    board.close(success=False)
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines[:3]] == [
        "nbkit: step 1/10 (10%)",
        "nbkit: step 2/10 (20%)",
        "nbkit: step 3/10 (30%)",
    ]
    assert lines[3].startswith("nbkit: stopped (failed or interrupted)")


def test_a_launch_that_reports_nothing_shows_nothing():
    out = io.StringIO()
    board = Dashboard(2, mode="text", interval=0)
    board._stream = out
    board.close(success=True)
    assert out.getvalue() == ""


def test_widget_panel_is_created_on_the_first_event_and_ends_as_static_html(capsys):
    board = Dashboard(2, mode="widget")
    assert board._view is None
    board.event(0, _step(1, 3.0))
    board.event(1, _step(1, 1.0))
    panel = board._view
    assert panel is not None
    panel.refresh(force=True)
    assert (panel.bar.value, panel.bar.max) == (1, 10)
    assert "loss 2.0000" in panel.status.value and "200 tokens/s" in panel.status.value
    assert panel.table.value.count("<tr>") == 3  # header + one row per rank
    assert bytes(panel.curve.value).startswith(b"\x89PNG")

    summary = board.summary(success=True)
    html = dashboard.summary_html(summary, board.snapshot().curve)
    assert "final loss" in html and "2.0000" in html and "data:image/png;base64," in html
    board.close(success=True)
    assert panel.box.comm is None  # widgets closed: the live panel is gone, the HTML stays


def test_display_mode_override_and_no_widgets_outside_a_kernel(monkeypatch):
    assert not dashboard.widget_frontend()  # pytest is no Jupyter kernel
    monkeypatch.delenv("NBKIT_DASHBOARD", raising=False)
    assert dashboard.display_mode() == "text"
    monkeypatch.setenv("NBKIT_DASHBOARD", "widget")
    assert dashboard.display_mode() == "widget"
    monkeypatch.setenv("NBKIT_DASHBOARD", "off")
    assert Dashboard(1).mode == "off"
    monkeypatch.setenv("NBKIT_DASHBOARD", "fancy")
    with pytest.raises(ValueError, match="NBKIT_DASHBOARD='fancy' is not valid"):
        dashboard.display_mode()
