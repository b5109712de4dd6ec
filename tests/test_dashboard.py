"""The dashboard in one process: events reaching its board, the text fallback, the widget and HTML
panels, the static summary, relaying, and how the display mode is chosen. The board's arithmetic
is tested in test_dashboard_board.py, the renderings' words in test_dashboard_rendering.py."""

from __future__ import annotations

import io

import pytest
from dashboard_events import step_event
from tiny_training import train_tiny_qwen3

from nbkit.messages.rank import Envelope, Report
from nbkit.messages.spawn import DashboardOpened
from nbkit.notebook import dashboard
from nbkit.notebook.dashboard import Dashboard


@pytest.mark.version_independent
def test_snapshot_sums_rates_averages_losses_and_keeps_peaks():
    board = Dashboard(2, mode="off")
    board.event(0, step_event(1, 2.0, rate=100.0, memory=1.5))
    board.event(1, step_event(1, 4.0, rate=300.0, memory=2.5))
    # a later, lower reading keeps the peak; 200 tokens in the 1 s since step 1: 200 tokens/s
    board.event(0, step_event(2, 1.0, rate=200.0, seen=300, memory=1.0))
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


@pytest.mark.version_independent
def test_text_fallback_prints_lines_at_most_every_interval_and_a_summary():
    out = io.StringIO()
    board = Dashboard(2, mode="text", interval=3600)
    board._stream = out
    board.event(0, step_event(1, 2.5, rate=1000.0))
    board.event(1, step_event(1, 2.5, rate=1000.0))
    board.event(0, step_event(2, 2.0, rate=1000.0))
    board.close(success=True)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("nbkit: step 1/10 (10%) | loss 2.5000 | lr 1.00e-04 | 1,000 tokens/s")
    assert not any(line.startswith("nbkit: step 2") for line in lines)  # throttled
    text = out.getvalue()
    assert "nbkit: finished after" in text
    assert "final loss: 2.0000" in text
    assert "peak memory rank 0 (cpu): 1.00 GiB" in text and "peak memory rank 1 (cpu): 1.00 GiB" in text


@pytest.mark.version_independent
def test_interval_zero_prints_every_event_and_failure_says_so():
    out = io.StringIO()
    board = Dashboard(1, mode="text", interval=0)
    board._stream = out
    for step in (1, 2, 3):
        board.event(0, step_event(step, 1.0 / step))
    board.close(success=False)
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines[:3]] == [
        "nbkit: step 1/10 (10%)",
        "nbkit: step 2/10 (20%)",
        "nbkit: step 3/10 (30%)",
    ]
    assert lines[3].startswith("nbkit: stopped (failed or interrupted)")


@pytest.mark.version_independent
def test_a_launch_that_reports_nothing_shows_nothing():
    out = io.StringIO()
    board = Dashboard(2, mode="text", interval=0)
    board._stream = out
    board.close(success=True)
    assert out.getvalue() == ""


@pytest.mark.version_independent
def test_widget_panel_is_created_on_the_first_event_and_ends_as_static_html(capsys):
    board = Dashboard(2, mode="widget")
    assert board._view is None
    board.event(0, step_event(1, 3.0))
    board.event(1, step_event(1, 1.0))
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


@pytest.mark.version_independent
def test_display_mode_override_and_no_widgets_outside_a_kernel(monkeypatch):
    assert not dashboard.widget_frontend()  # pytest is no Jupyter kernel
    monkeypatch.delenv("NBKIT_DASHBOARD", raising=False)
    assert dashboard.display_mode() == "text"
    monkeypatch.setenv("NBKIT_DASHBOARD", "widget")
    assert dashboard.display_mode() == "widget"
    monkeypatch.setenv("NBKIT_DASHBOARD", "html")
    assert dashboard.display_mode() == "html"
    monkeypatch.setenv("NBKIT_DASHBOARD", "off")
    assert Dashboard(1).mode == "off"
    monkeypatch.setenv("NBKIT_DASHBOARD", "fancy")
    with pytest.raises(ValueError, match="NBKIT_DASHBOARD='fancy' is not valid"):
        dashboard.display_mode()


@pytest.mark.version_independent
def test_widget_mode_with_ipywidgets_7_shows_the_html_panel_and_says_why(monkeypatch, capsys):
    # What Colab's ipywidgets 7.7.1 reports (tests/test_browser.py runs a real 7.7.1 in the classic Notebook 6.5)
    import ipywidgets

    monkeypatch.setenv("NBKIT_DASHBOARD", "widget")
    monkeypatch.setattr(ipywidgets, "__version__", "7.7.1")
    dashboard._widgets_too_old.cache_clear()
    assert dashboard.display_mode() == "html" and dashboard.display_mode() == "html"
    out = capsys.readouterr().out
    assert out.count("NBKIT_DASHBOARD=widget needs ipywidgets 8 or later (this kernel has 7.7.1)") == 1


# --------------------------------------------------------------------------------------------
# The HTML panel (the default where a person watches a notebook), in a real IPython shell whose
# display messages are kept
# --------------------------------------------------------------------------------------------


@pytest.fixture
def shell_displays():
    """An IPython shell for this test; yields the list of display messages it publishes."""
    from IPython.core.displaypub import CapturingDisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.display_pub = CapturingDisplayPublisher()
    try:
        yield shell.display_pub.outputs
    finally:
        InteractiveShell.clear_instance()


@pytest.mark.version_independent
def test_html_panel_shows_every_rank_from_the_first_frame_and_no_image_before_a_curve(shell_displays):
    board = Dashboard(2, mode="html")
    assert dashboard.panel_shown()
    board.event(1, {"step": 0, "total_steps": 40, "elapsed": 30.0, "peak_memory_gib": 0.44, "memory_device": "cpu"})
    first = shell_displays[0]
    assert not first["update"] and "display_id" in first["transient"]
    page = first["data"]["text/html"]
    assert "nbkit-panel" in page and "<img" not in page  # no curve yet: no (broken) image either
    rows = page.split("<table class='nbkit-ranks'>")[1].split("<tr>")[2:]
    assert len(rows) == 2 and "<td>0</td><td>starting</td>" in rows[0] and "0.44 GiB (cpu RSS)" in rows[1]
    assert "<progress value='0' max='40'" in page
    board.close(success=True)
    assert not dashboard.panel_shown()


@pytest.mark.version_independent
def test_html_panel_updates_one_output_in_place_and_its_last_frame_is_the_summary_of_the_last_step(shell_displays):
    board = Dashboard(2, mode="html")
    for step in range(1, 41):  # faster than the panel redraws: most frames are skipped
        for rank in (0, 1):
            board.event(
                rank,
                step_event(step, 3.0 - step / 20 + rank, seen=100 * step, elapsed=0.1 * step) | {"total_steps": 40},
            )
    board.event(0, {"step": 40, "train_loss": 2.5, "train_runtime": 4.0})  # Trainer's last log
    board.close(success=True)

    ids = {d["transient"]["display_id"] for d in shell_displays}
    assert len(ids) == 1 and [d["update"] for d in shell_displays] == [False] + [True] * (len(shell_displays) - 1)
    assert len(shell_displays) < 20  # throttled: at most two redraws a second, not one per event
    last = shell_displays[-1]["data"]["text/html"]
    assert "nbkit-summary" in last and "finished after" in last
    assert "<progress value='40' max='40'" in last and ">40 / 40</td>" in last
    assert "final loss" in last and f"{(1.0 + 2.0) / 2:.4f}" in last  # step 40: rank 0 1.0, rank 1 2.0
    assert "peak memory, rank 0 (cpu RSS)" in last and "peak memory, rank 1 (cpu RSS)" in last
    assert "last log (rank 0)" in last and "train_loss 2.5" in last
    assert last.count("data:image/png;base64,") == 1
    rows = last.split("<table class='nbkit-ranks'>")[1].split("<tr>")[2:]
    assert [row.split("</td>")[1] for row in rows] == ["<td>40", "<td>40"]  # each rank's last step


@pytest.mark.version_independent
def test_html_without_an_ipython_shell_falls_back_to_text_lines():
    out = io.StringIO()
    board = Dashboard(1, mode="html", interval=0)
    board._stream = out
    board.event(0, step_event(1, 2.0))
    board.close(success=True)
    assert board.shown_as == "text" and out.getvalue().startswith("nbkit: step 1/10")


@pytest.mark.version_independent
def test_widget_panel_shows_every_rank_and_hides_the_curve_until_there_is_one():
    board = Dashboard(2, mode="widget")
    board.event(1, {"step": 0, "total_steps": 10, "elapsed": 1.0})
    panel = board._view
    panel.refresh(force=True)
    assert panel.curve.layout.display == "none" and bytes(panel.curve.value) == b""
    assert panel.table.value.count("<tr>") == 3 and "starting" in panel.table.value
    board.event(0, step_event(1, 2.0))
    panel.refresh(force=True)
    assert panel.curve.layout.display is None and bytes(panel.curve.value).startswith(b"\x89PNG")
    board.close(success=True)


# --------------------------------------------------------------------------------------------
# Relaying (spawn mode's launcher process): typed messages
# --------------------------------------------------------------------------------------------


@pytest.mark.version_independent
def test_a_relaying_dashboard_sends_typed_messages_and_knows_how_the_notebook_shows(monkeypatch):
    from multiprocessing import Pipe

    reader, writer = Pipe(duplex=False)
    monkeypatch.setenv("NBKIT_DASHBOARD", "html")  # as nbkit.launching.spawn sets it for its launcher process
    dashboard.relay_to(writer)
    try:
        board = Dashboard(2)
        board.event(1, {"step": 3, "loss": 0.5})
        board.close(success=True)
    finally:
        dashboard.relay_to(None)
    assert board.mode == "relay" and board.shown_as == "html"
    assert reader.recv() == DashboardOpened(nprocs=2)
    assert reader.recv() == Envelope(rank=1, body=Report(metrics={"step": 3, "loss": 0.5}))
    assert not reader.poll(0.1)  # closing a relay sends nothing: the notebook closes its own


# --------------------------------------------------------------------------------------------
# A launch under a live panel: the ranks leave the numbers to the panel
# --------------------------------------------------------------------------------------------


def test_under_a_live_panel_rank_0_prints_no_log_lines_and_the_panel_shows_the_last_log(
    shell_displays, monkeypatch, capfd
):
    import transformers.trainer  # noqa: F401  (imported once here, shared by the forked ranks)

    import nbkit

    monkeypatch.setenv("NBKIT_DASHBOARD", "html")
    callbacks = nbkit.launch(train_tiny_qwen3, gpus=2, logging_steps=1)
    assert "DashboardCallback" in callbacks and "PrinterCallback" not in callbacks
    out = capfd.readouterr().out
    assert "'loss'" not in out and "'train_runtime'" not in out  # no log line piles up under the panel
    last = shell_displays[-1]["data"]["text/html"]
    assert "nbkit-summary" in last and ">4 / 4</td>" in last
    assert "last log (rank 0)" in last and "train_runtime" in last  # Trainer's final log, in the panel instead
    assert not dashboard.panel_shown()  # the launch is over
