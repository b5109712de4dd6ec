"""The live panels of a dashboard in a notebook: one HTML output replaced in place (the default),
or ipywidgets (NBKIT_DASHBOARD=widget). Each redraws from the board's latest snapshot at most
twice a second and ends, in place, as the static summary.
"""

from __future__ import annotations

import html
import logging
import threading
import time

from nbkit.notebook.dashboard.board import Board, Snapshot, other_metrics
from nbkit.notebook.dashboard.rendering import (
    loss_curve_png,
    metrics_text,
    panel_html,
    rank_table_html,
    status_text,
    title_html,
)
from nbkit.platform.shell import OutputCell

__all__ = ["HtmlPanel", "LiveView", "WidgetPanel"]

_PANEL_REFRESH_S = 0.5
_CURVE_REFRESH_S = 2.0


class LiveView:
    """A live panel of one dashboard (created on its first event): throttled redraws, each with
    the latest snapshot, and a trailing redraw so that the last events of a burst are shown.
    """

    def __init__(self, board: Board, cell: OutputCell):
        self.board = board
        self.cell = cell
        self._finished = False
        self._drawn = self._curve_drawn = float("-inf")
        self._png = b""
        self._timer: threading.Timer | None = None

    def refresh(self, force: bool = False) -> None:
        """Redraw now if the last redraw is old enough (or force), else once a little later."""
        with self.board._lock:  # the channel thread and the trailing-refresh timer
            if self._finished:  # a timer's last redraw must not cover the summary
                return
            now = time.monotonic()
            if not force and now - self._drawn < _PANEL_REFRESH_S:
                self._refresh_later(_PANEL_REFRESH_S - (now - self._drawn))
                return
            self._drawn = now
            snap = self.board.snapshot()
            curve_due = force or now - self._curve_drawn >= _CURVE_REFRESH_S
            if snap.curve and curve_due:
                self._curve_drawn = now
                self._png = loss_curve_png(snap.curve)
            self.draw(snap, self._png)

    def draw(self, snap: Snapshot, png: bytes) -> None:
        """Show one frame."""
        raise NotImplementedError

    def finish(self, summary: str) -> None:
        """Replace the live panel, in place, by the static summary HTML."""
        with self.board._lock:
            self._finished = True
            if self._timer is not None:
                self._timer.cancel()
        self.replace(summary)

    def replace(self, summary: str) -> None:
        """Put the summary where the panel was."""
        raise NotImplementedError

    def _refresh_later(self, delay: float) -> None:
        # The last events of a burst would otherwise stay undrawn until the next event, which
        # may be a long step away.
        if self._timer is not None and self._timer.is_alive():
            return
        self._timer = threading.Timer(delay, self._refresh_from_timer)
        self._timer.daemon = True
        self._timer.start()

    def _refresh_from_timer(self) -> None:
        try:
            with self.cell.active():
                self.refresh(force=True)
        except Exception:  # a display problem must never surface in a timer thread's traceback
            logging.getLogger("nbkit").exception("nbkit: the dashboard failed")


class HtmlPanel(LiveView):
    """The live panel as one HTML output, replaced in place at each redraw."""

    def __init__(self, board: Board, cell: OutputCell):
        from IPython.display import HTML, display

        super().__init__(board, cell)
        self._html = HTML
        self.handle = display(HTML(panel_html(board.snapshot(), board.nprocs, b"")), display_id=True)
        self._drawn = time.monotonic()

    def draw(self, snap: Snapshot, png: bytes) -> None:
        """Replace the output by this frame."""
        self.handle.update(self._html(panel_html(snap, self.board.nprocs, png)))

    def replace(self, summary: str) -> None:
        """Replace the output by the summary."""
        self.handle.update(self._html(summary))


class WidgetPanel(LiveView):
    """The live panel as ipywidgets (NBKIT_DASHBOARD=widget)."""

    def __init__(self, board: Board, cell: OutputCell):
        import ipywidgets as w
        from IPython.display import display

        super().__init__(board, cell)
        self.title = w.HTML(title_html(board.nprocs, "training"))
        self.bar = w.IntProgress(value=0, min=0, max=1, bar_style="info", layout=w.Layout(width="50%"))
        self.status = w.HTML()
        # Hidden until there is a curve: an Image widget without a value is a broken-image icon.
        self.curve = w.Image(format="png", layout=w.Layout(max_width="560px", display="none"))
        self.table = w.HTML(rank_table_html(board.snapshot(), board.nprocs))
        self.latest = w.HTML()
        self.box = w.VBox([self.title, w.HBox([self.bar, self.status]), self.curve, self.table, self.latest])
        self.handle = display(self.box, display_id=True)

    def draw(self, snap: Snapshot, png: bytes) -> None:
        """Set the widgets' values to this frame's."""
        if snap.total_steps:
            self.bar.max = snap.total_steps
        self.bar.value = min(snap.step or 0, self.bar.max)
        self.status.value = html.escape(status_text(snap))
        self.table.value = rank_table_html(snap, self.board.nprocs)
        extra = other_metrics(snap)
        self.latest.value = html.escape(f"last log (rank 0): {metrics_text(extra)}") if extra else ""
        if png and bytes(self.curve.value) != png:
            self.curve.value = png
            self.curve.layout.display = None

    def replace(self, summary: str) -> None:
        """Replace the widgets' output by the summary HTML and close the widgets."""
        from IPython.display import HTML

        # Replace the widget output in place: a saved notebook keeps this HTML, not the widgets.
        if self.handle is not None:
            self.handle.update(HTML(summary))
        for widget in (*self.box.children, self.box):
            widget.close()
        for widget in (self.bar, self.status):  # inside the HBox
            widget.close()
