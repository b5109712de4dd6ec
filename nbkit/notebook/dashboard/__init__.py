"""The live view of a launch in the notebook: one panel for all ranks.

Every run that reports gets its dashboard from `create(nprocs)`, in the notebook process: a
forked launch (nbkit.launch), a spawned one (its launcher process relays, the notebook shows), a
call on a live set, and nbkit.report outside a launch. The caller passes it every event the ranks
report (nbkit.report, the Trainer callback) and calls `close()` when the run ends. Nothing is shown
until the first event, so a run whose function reports nothing shows nothing.

How it shows (decided when the dashboard is created, see `display_mode()`):

- "html" (the default where a person watches a notebook): one HTML output, replaced in place
  (`display(..., display_id=True)` and `.update()`) at most twice a second: a progress bar, one
  status line, the loss curve (an image, redrawn every 2 s, absent until there is a curve), and
  one row per rank from the first frame on. At the end the same output becomes the static summary
  (final step, final loss, total time, tokens/s, peak memory per rank, the curve, the rank table),
  which a saved notebook keeps as plain HTML.
- "widget": the same panel as ipywidgets, ending in the same static HTML summary (ipywidgets 8 or
  later; with ipywidgets 7, Colab's, nbkit says so and shows the HTML panel).
- "text": one concise line every NBKIT_DASHBOARD_INTERVAL seconds (default 10) and a summary at
  the end: for papermill/nbclient runs, terminals and scripts.
- "off": nothing is shown; events are still recorded.

NBKIT_DASHBOARD=auto|html|widget|text|off chooses by hand (auto by default). The most recent
dashboard stays reachable as `nbkit.dashboard.latest()` (its `events`, `snapshot()`,
`summary()`), for a look at the run afterwards and for tests.

While a live panel (html or widget) shows a launch, its ranks print no per-step Trainer log lines
(`panel_shown()`, read by nbkit.rank_side.reporting): the panel shows the same numbers, and the lines would
otherwise pile up below it, one per step, pushing it out of view.

Where the parts live: nbkit.dashboard.board (events -> state: Board, Snapshot),
nbkit.dashboard.rendering (text, HTML, PNG), nbkit.dashboard.panels (the live HTML and widget
panels), nbkit.dashboard.relaying (spawn mode's forwarding), nbkit.platform.host (who watches), and
here the Dashboard that ties them together.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

from nbkit.messages.rank import Envelope, Report
from nbkit.messages.spawn import DashboardOpened
from nbkit.notebook.dashboard.board import Board, Snapshot, other_metrics
from nbkit.notebook.dashboard.panels import HtmlPanel, LiveView, WidgetPanel
from nbkit.notebook.dashboard.relaying import connection as relay_connection
from nbkit.notebook.dashboard.relaying import relay, relay_to
from nbkit.notebook.dashboard.rendering import (
    loss_curve_png,
    panel_html,
    peak_memory_text,
    rank_table_html,
    summary_html,
    summary_text,
    text_line,
)
from nbkit.platform import host, notices
from nbkit.platform.config import setting
from nbkit.platform.shell import OutputCell
from nbkit.platform.shell import current as _shell

__all__ = [
    "Dashboard",
    "OutputCell",
    "Snapshot",
    "create",
    "display_mode",
    "latest",
    "loss_curve_png",
    "notebook_frontend",
    "other_metrics",
    "panel_html",
    "panel_shown",
    "peak_memory_text",
    "rank_table_html",
    "relay",
    "relay_to",
    "summary_html",
    "summary_text",
    "text_line",
    "widget_frontend",
]

_latest: Dashboard | None = None


def latest() -> Dashboard | None:
    """The most recently created Dashboard in this process (None before the first launch)."""
    return _latest


def panel_shown() -> bool:
    """Whether the reports of the launch this process belongs to are shown in a live panel.

    Read in a launched rank (forked from the process that holds the launch's dashboard, so that
    dashboard is `latest()` here and still open): True for "html" and "widget". In the launcher
    process of spawn mode, whose dashboard only relays, the notebook's choice arrives as
    NBKIT_DASHBOARD (nbkit.launching.spawn sets it). A rank of a live set makes no dashboard (the notebook
    makes one per call), so there the notebook's choice is NBKIT_DASHBOARD too, given at the set's
    start (nbkit.live.engines): a process without a dashboard reads it. False everywhere else.
    """
    board = _latest
    if board is None:
        return setting("dashboard") in ("html", "widget")
    return not board.closed and board.shown_as in ("html", "widget")


def create(nprocs: int, *, enabled: bool = True) -> Dashboard | None:
    """The dashboard of a run of `nprocs` ranks, or None when `enabled` is False (dashboard=False).

    The one place nbkit makes a dashboard, for every way a run reports: nbkit.launch (created
    before the ranks fork, so that they see it as `latest()`), the notebook side of a spawned launch
    (on its launcher's DashboardOpened), a call on a live set and nbkit.report outside a launch (on
    their first report). How it shows is decided here, once (see `display_mode()`); in a process
    set up with relay_to() it forwards instead.
    """
    return Dashboard(nprocs) if enabled else None


def display_mode() -> str:
    """How a dashboard created now would show: "html", "widget", "text" or "off".

    NBKIT_DASHBOARD overrides ("html", "widget", "text", "off"); otherwise "html" when
    `notebook_frontend()` says a person is watching a notebook, else "text".

    Why html and not widgets by default: an HTML output replaced in place renders in every
    frontend that shows notebook output (JupyterLab, Notebook 7, Colab, Kaggle, VS Code) with no
    widget manager, so it can never be stuck at "Loading widget..." (what Kaggle and mismatched
    frontends show for widgets, ipywidgets#2764 and #2360); transformers' NotebookProgressCallback
    shows its bar the same way. In headless Chromium against JupyterLab 4.6.6 and Notebook 7.6.5
    (tests/test_browser.py) the html panel updated live, ended as the summary, and the summary came
    back after save + reload, while widgets that forked ranks had drawn (datasets' bars) came back as
    "Loading widget...". Its cost: one display update per redraw, at most two a second, of 0.7 KB
    before there is a curve and ~18 KB with a 400-step curve image (re-drawn every 2 s, re-sent with
    each update). Widgets stay available with NBKIT_DASHBOARD=widget.

    NBKIT_DASHBOARD=widget with ipywidgets 7 (Colab's 7.7.1) gives "html", with a notice once: in the
    classic Notebook 6.5 with ipywidgets 7.7.1 a display that holds widgets was not replaced by a later
    update, so the widget panel would never have become its summary.

    Raises:
        ValueError: NBKIT_DASHBOARD holds something else.
    """
    wanted = setting("dashboard")
    if wanted == "widget":
        import ipywidgets

        if int(ipywidgets.__version__.split(".")[0]) < 8:
            _widgets_too_old(ipywidgets.__version__)
            return "html"
    if wanted != "auto":
        return wanted
    return "html" if notebook_frontend() else "text"


@functools.cache
def _widgets_too_old(version: str) -> None:
    notices.logger(__name__).info(
        f"nbkit: NBKIT_DASHBOARD=widget needs ipywidgets 8 or later (this kernel has {version}): "
        "the panel shows as HTML updated in place, as it does by default."
    )


def notebook_frontend() -> bool:
    """Whether this process is a Jupyter kernel whose output a person watches live in a notebook
    (`nbkit.platform.host.current().watched`: Kaggle's interactive sessions, Colab, VS Code, JupyterLab
    and Notebook; never a kernel under papermill, nbclient, nbconvert or nbmake, where a live panel
    would only leave the log silent).
    """
    return host.current().watched


def widget_frontend() -> bool:
    """Whether ipywidgets could show here: `notebook_frontend()` and ipywidgets is installed."""
    if not notebook_frontend():
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class Dashboard(Board):
    """Receives the ranks' events in the notebook process and shows them (see the module doc).

    Takes nprocs (how many ranks report) and, optionally, mode ("html", "widget", "text", "off";
    default `display_mode()`) and interval (seconds between text lines; default
    NBKIT_DASHBOARD_INTERVAL or 10). `event()` may be called from any thread; `close()` once, when
    the launch ends. Display errors are the caller's to swallow (the launcher logs and ignores them).
    In a process set up with relay_to() the dashboard only forwards (mode "relay"); `shown_as` is
    then how the notebook shows it, else the same as `mode`.
    """

    def __init__(self, nprocs: int, *, mode: str | None = None, interval: float | None = None):
        global _latest
        super().__init__(nprocs)
        relaying = relay_connection() is not None
        self.shown_as = mode or display_mode()
        if self.shown_as == "html" and not relaying and _shell() is None:
            self.shown_as = "text"  # HTML needs IPython's display; in a terminal or a script, text lines
        self.mode = "relay" if relaying else self.shown_as
        if interval is None:
            interval = float(setting("dashboard_interval"))
        self.interval = interval
        self.closed = False
        self._cell = OutputCell()
        self._stream = sys.stdout  # launch() silences sys.stdout while the ranks run
        self._view: LiveView | None = None
        self._last_line = float("-inf")
        _latest = self
        if self.mode == "relay":
            relay(DashboardOpened(nprocs))

    # -- receiving ---------------------------------------------------------------------------
    def event(self, rank: int, metrics: dict[str, Any]) -> None:
        """Record one event of `rank` and refresh the display (throttled)."""
        self.record(rank, metrics)
        now = time.monotonic()
        if self.mode == "relay":
            relay(Envelope(rank, Report(metrics)))
        elif self.mode == "text":
            if now - self._last_line >= self.interval:
                self._last_line = now
                self._print(text_line(self.snapshot()))
        elif self.mode in ("html", "widget"):
            with self._cell.active():
                if self._view is None:
                    self._view = (HtmlPanel if self.mode == "html" else WidgetPanel)(self, self._cell)
                self._view.refresh()

    # -- ending ------------------------------------------------------------------------------
    def close(self, success: bool) -> None:
        """The launch ended: leave a static summary (nothing if no event ever came). Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        if not self.events or self.mode in ("relay", "off"):
            return
        summary = self.summary(success)
        if self.mode == "text":
            self._print(summary_text(summary))
        elif self._view is not None:
            with self._cell.active():
                self._view.finish(summary_html(summary, self.snapshot(), nprocs=self.nprocs))

    def _print(self, text: str) -> None:
        with self._cell.active():
            print(text, file=self._stream, flush=True)
