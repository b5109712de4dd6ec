"""The live view of a launch in the notebook: one panel for all ranks.

nbkit.launch creates a `Dashboard(nprocs)` in the notebook process; the launcher's channel thread
passes it every event the ranks report (nbkit.report, the Trainer callback), and `close()` runs
when the launch ends. Nothing is shown until the first event, so a launch whose function reports
nothing shows nothing.

How it shows (decided when the dashboard is created, see `display_mode()`):

- "html" (the default where a person watches a notebook): one HTML output, replaced in place
  (`display(..., display_id=True)` and `.update()`) at most twice a second: a progress bar, one
  status line, the loss curve (an image, redrawn every 2 s, absent until there is a curve), and
  one row per rank from the first frame on. At the end the same output becomes the static summary
  (final step, final loss, total time, tokens/s, peak memory per rank, the curve, the rank table),
  which a saved notebook keeps as plain HTML.
- "widget": the same panel as ipywidgets, ending in the same static HTML summary.
- "text": one concise line every NBKIT_DASHBOARD_INTERVAL seconds (default 10) and a summary at
  the end: for papermill/nbclient runs, terminals and scripts.
- "off": nothing is shown; events are still recorded.

NBKIT_DASHBOARD=auto|html|widget|text|off chooses by hand (auto by default). The most recent
dashboard stays reachable as `nbkit.dashboard.latest()` (its `events`, `snapshot()`,
`summary()`), for a look at the run afterwards and for tests.

While a live panel (html or widget) shows a launch, its ranks print no per-step Trainer log lines
(`panel_shown()`, read by nbkit.reporting): the panel shows the same numbers, and the lines would
otherwise pile up below it, one per step, pushing it out of view.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import html
import io
import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeGuard

from nbkit import platform
from nbkit.config import setting
from nbkit.shell import current as _shell

__all__ = [
    "Dashboard",
    "DashboardEvent",
    "DashboardOpened",
    "OutputCell",
    "Snapshot",
    "display_mode",
    "latest",
    "notebook_frontend",
    "panel_shown",
    "relay",
    "relay_to",
    "widget_frontend",
]

_PANEL_REFRESH_S = 0.5
_CURVE_REFRESH_S = 2.0
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

_latest: Dashboard | None = None
_relay: Any = None
_relay_lock = threading.Lock()


def latest() -> Dashboard | None:
    """The most recently created Dashboard in this process (None before the first launch)."""
    return _latest


def panel_shown() -> bool:
    """Whether the reports of the launch this process belongs to are shown in a live panel.

    Read in a launched rank (forked from the process that holds the launch's dashboard, so that
    dashboard is `latest()` here and still open): True for "html" and "widget". In the launcher
    process of spawn mode, whose dashboard only relays, the notebook's choice arrives as
    NBKIT_DASHBOARD (nbkit.spawning sets it). False everywhere else.
    """
    board = _latest
    if board is None or board.closed:
        return False
    return board.shown_as in ("html", "widget")


# --------------------------------------------------------------------------------------------
# Relaying: a launcher process (spawn mode) forwards its dashboard to the notebook's
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DashboardOpened:
    """Relayed when the launcher process creates its dashboard: the notebook creates its own."""

    nprocs: int


@dataclass(frozen=True)
class DashboardEvent:
    """Relayed for every event a rank reports: the notebook passes it to its dashboard."""

    rank: int
    metrics: dict[str, Any]


def relay_to(connection: Any) -> None:
    """Make every Dashboard created afterwards in this process forward its events to `connection`.

    Takes a multiprocessing Connection; the dashboard sends DashboardOpened once and a
    DashboardEvent per event over it instead of showing anything. Used by nbkit.spawning's
    launcher process, whose dashboard lives in the notebook.
    """
    global _relay
    _relay = connection


def relay(message: Any) -> None:
    """Send one message (a picklable object) over the connection given to relay_to(); thread-safe."""
    with _relay_lock:
        _relay.send(message)


# --------------------------------------------------------------------------------------------
# Where to show things
# --------------------------------------------------------------------------------------------


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

    Raises:
        ValueError: NBKIT_DASHBOARD holds something else.
    """
    wanted = setting("dashboard")
    if wanted != "auto":
        return wanted
    return "html" if notebook_frontend() else "text"


def notebook_frontend() -> bool:
    """Whether this process is a Jupyter kernel whose output a person watches live in a notebook
    (`nbkit.platform.current().watched`: Kaggle's interactive sessions, Colab, VS Code, JupyterLab
    and Notebook; never a kernel under papermill, nbclient, nbconvert or nbmake, where a live panel
    would only leave the log silent).
    """
    return platform.current().watched


def widget_frontend() -> bool:
    """Whether ipywidgets could show here: `notebook_frontend()` and ipywidgets is installed."""
    if not notebook_frontend():
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class OutputCell:
    """The notebook cell running when this object is created.

    `with cell.active():` makes output from another thread (display, print, widget updates) go to
    that cell. Needed because ipykernel 7 keeps the "parent" message per thread (a context variable)
    and a new thread has none. Outside a kernel, and in the main thread, `active()` does nothing.
    """

    def __init__(self) -> None:
        shell = _shell()
        self.shell = shell if hasattr(shell, "get_parent") else None
        self.parent = self.shell.get_parent() if self.shell is not None else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, output of this (non-main) thread goes to the cell that started the run."""
        if self.shell is None or not self.parent or threading.current_thread() is threading.main_thread():
            yield
            return
        if hasattr(self.shell, "set_thread_parent"):  # ipykernel >= 7
            tokens = self.shell.set_thread_parent(self.parent)
            try:
                yield
            finally:
                self.shell.reset_thread_parent(tokens)
        else:
            self.shell.set_parent(self.parent)
            yield


# --------------------------------------------------------------------------------------------
# The state of a run, as the ranks reported it
# --------------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """The run as it stands: what the panel, the text line and the summary show.

    step/total_steps: the furthest step any rank reported, and the run's length. loss: mean of
    the ranks' latest losses. tokens_per_second: all ranks together, each rank's rate measured over
    its reports of the last 10 s. eta: seconds left, from the pace since the first step event.
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


class Dashboard:
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
        self.nprocs = nprocs
        self.events: list[tuple[int, dict[str, Any]]] = []
        self.shown_as = mode or display_mode()
        if self.shown_as == "html" and _relay is None and _shell() is None:
            self.shown_as = "text"  # HTML needs IPython's display; in a terminal or a script, text lines
        self.mode = "relay" if _relay is not None else self.shown_as
        if interval is None:
            interval = float(setting("dashboard_interval"))
        self.interval = interval
        self.closed = False
        self._lock = threading.RLock()
        self._created = time.monotonic()
        self._ranks: dict[int, dict[str, Any]] = {}
        self._peaks: dict[int, tuple[float, str]] = {}
        self._losses: dict[int, dict[int, float]] = {}  # step -> {rank: loss}
        self._pace: tuple[float, int] | None = None  # (time, step) of the first step event
        # rank -> its (elapsed, tokens_seen) reports: all but the window's are dropped as they age
        self._token_reports: dict[int, collections.deque[tuple[float, float]]] = {}
        # rank -> the first and the latest (tokens_seen, elapsed) it reported
        self._token_span: dict[int, tuple[tuple[float, float], tuple[float, float]]] = {}
        self._cell = OutputCell()
        self._stream = sys.stdout  # launch() silences sys.stdout while the ranks run
        self._view: _LiveView | None = None
        self._last_line = float("-inf")
        _latest = self
        if self.mode == "relay":
            relay(DashboardOpened(nprocs))

    # -- receiving ---------------------------------------------------------------------------
    def event(self, rank: int, metrics: dict[str, Any]) -> None:
        """Record one event of `rank` and refresh the display (throttled)."""
        now = time.monotonic()
        with self._lock:
            self.events.append((rank, metrics))
            merged = self._ranks.setdefault(rank, {})
            merged.update(metrics)
            step, loss = metrics.get("step"), metrics.get("loss")
            if _is_number(loss) and isinstance(step, int):
                self._losses.setdefault(step, {})[rank] = float(loss)
            if isinstance(step, int) and step > 0 and self._pace is None:
                self._pace = (now, step)
            seen, elapsed = metrics.get("tokens_seen"), metrics.get("elapsed")
            if _is_number(seen) and _is_number(elapsed):
                # The run's average rate counts from the first token report on: model loading and
                # imports before training do not dilute it.
                first = self._token_span.get(rank, ((seen, elapsed),))[0]
                self._token_span[rank] = (first, (seen, elapsed))
                reports = self._token_reports.setdefault(rank, collections.deque())
                reports.append((float(elapsed), float(seen)))
                while len(reports) > 2 and reports[1][0] <= elapsed - _RATE_WINDOW_S:
                    reports.popleft()
            memory = metrics.get("peak_memory_gib")
            if _is_number(memory):
                old = self._peaks.get(rank, (0.0, ""))[0]
                self._peaks[rank] = (max(old, float(memory)), str(metrics.get("memory_device", "")))
        if self.mode == "relay":
            relay(DashboardEvent(rank, metrics))
        elif self.mode == "text":
            if now - self._last_line >= self.interval:
                self._last_line = now
                self._print(text_line(self.snapshot()))
        elif self.mode in ("html", "widget"):
            with self._cell.active():
                if self._view is None:
                    self._view = _HtmlPanel(self) if self.mode == "html" else _WidgetPanel(self)
                self._view.refresh()

    # -- reading -----------------------------------------------------------------------------
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
            rates = [m["tokens_per_second"] for m in ranks.values() if _is_number(m.get("tokens_per_second"))]
            snap.tokens_per_second = sum(rates) if rates else None
            snap.curve = [(s, sum(by_rank.values()) / len(by_rank)) for s, by_rank in sorted(self._losses.items())]
            if self._pace is not None and snap.step and snap.total_steps and snap.step > self._pace[1]:
                t0, s0 = self._pace
                snap.eta = (now - t0) / (snap.step - s0) * max(snap.total_steps - snap.step, 0)
        return snap

    def summary(self, success: bool = True) -> dict[str, Any]:
        """What the run came to.

        Returns:
            {"success", "final_loss", "step", "total_steps", "total_time" (s), "tokens_per_second"
            (all ranks, averaged from each rank's first token report to its last), "peak_memory_gib"
            ({rank: (GiB, device)}), "metrics" (the other numbers of rank 0's latest reports, e.g.
            eval_loss, mean_token_accuracy)}.
        """
        snap = self.snapshot()
        rates = []
        with self._lock:
            for rank, (first, last) in self._token_span.items():
                if last[1] > first[1]:
                    rates.append((last[0] - first[0]) / (last[1] - first[1]))
                elif "tokens_per_second" in snap.ranks.get(rank, {}):
                    rates.append(snap.ranks[rank]["tokens_per_second"])
        return {
            "success": success,
            "final_loss": snap.curve[-1][1] if snap.curve else snap.loss,
            "step": snap.step,
            "total_steps": snap.total_steps,
            "total_time": snap.elapsed,
            "tokens_per_second": sum(rates) if rates else None,
            "peak_memory_gib": snap.peak_memory_gib,
            "metrics": other_metrics(snap),
        }

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


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def text_line(snap: Snapshot) -> str:
    """One line: 'nbkit: step 12/100 (12%) | loss 2.3456 | ... | 0:12 elapsed, ETA 1:28'."""
    parts = []
    if snap.step is not None:
        progress = f"step {snap.step}"
        if snap.total_steps:
            progress += f"/{snap.total_steps} ({100 * snap.step / snap.total_steps:.0f}%)"
        parts.append(progress)
    if snap.loss is not None:
        parts.append(f"loss {snap.loss:.4f}")
    if snap.learning_rate is not None:
        parts.append(f"lr {snap.learning_rate:.2e}")
    if snap.grad_norm is not None:
        parts.append(f"grad norm {snap.grad_norm:.3g}")
    if snap.tokens_per_second is not None:
        parts.append(f"{snap.tokens_per_second:,.0f} tokens/s")
    if snap.peak_memory_gib:
        parts.append(peak_memory_text(snap.peak_memory_gib))
    timing = f"{_duration(snap.elapsed)} elapsed"
    if snap.eta is not None:
        timing += f", ETA {_duration(snap.eta)}"
    parts.append(timing)
    return "nbkit: " + " | ".join(parts)


def peak_memory_text(peaks: dict[int, tuple[float, str]]) -> str:
    """'peak memory rank 0: 0.51 GiB, rank 1: 0.50 GiB' (up to 4 ranks), else the highest rank's.

    Each figure names its rank, so that two of them never read like "used/total".
    """
    if len(peaks) > 4:
        rank, (gib, _) = max(peaks.items(), key=lambda item: item[1][0])
        return f"peak memory {gib:.2f} GiB (highest, rank {rank} of {len(peaks)})"
    return "peak memory " + ", ".join(f"rank {rank}: {gib:.2f} GiB" for rank, (gib, _) in peaks.items())


def other_metrics(snap: Snapshot) -> dict[str, float]:
    """Rank 0's (else the lowest rank's) latest numbers that have no column of their own."""
    if not snap.ranks:
        return {}
    latest_values = snap.ranks.get(0, next(iter(snap.ranks.values())))
    return {k: float(v) for k, v in sorted(latest_values.items()) if k not in _SHOWN_KEYS and _is_number(v)}


def summary_text(summary: dict[str, Any]) -> str:
    """The end-of-run summary as lines of text (the text mode's last output)."""
    head = "finished" if summary["success"] else "stopped (failed or interrupted)"
    lines = [f"nbkit: {head} after {_duration(summary['total_time'])}"]
    if summary["step"] is not None:
        total = f"/{summary['total_steps']}" if summary["total_steps"] else ""
        lines.append(f"  steps: {summary['step']}{total}")
    if summary["final_loss"] is not None:
        lines.append(f"  final loss: {summary['final_loss']:.4f}")
    if summary["tokens_per_second"] is not None:
        lines.append(f"  tokens/s (all ranks): {summary['tokens_per_second']:,.0f}")
    for rank, (gib, device) in summary["peak_memory_gib"].items():
        lines.append(f"  peak memory rank {rank} ({device}): {gib:.2f} GiB")
    if summary.get("metrics"):
        lines.append(f"  last log (rank 0): {_metrics_text(summary['metrics'])}")
    return "\n".join(lines)


def summary_html(summary: dict[str, Any], snap: Snapshot | list[tuple[int, float]], *, nprocs: int = 0) -> str:
    """The static end-of-run panel: the last frame (progress bar, rank table), a table of results
    and the loss curve as an embedded PNG. Takes the summary, the final Snapshot (or only the loss
    curve) and how many ranks ran.
    """
    if not isinstance(snap, Snapshot):
        snap = Snapshot(curve=list(snap))
    head = "finished" if summary["success"] else "stopped (failed or interrupted)"
    rows = [("result", head), ("total time", _duration(summary["total_time"]))]
    if summary["step"] is not None:
        total = f" / {summary['total_steps']}" if summary["total_steps"] else ""
        rows.append(("steps", f"{summary['step']}{total}"))
    if summary["final_loss"] is not None:
        rows.append(("final loss", f"{summary['final_loss']:.4f}"))
    if summary["tokens_per_second"] is not None:
        rows.append(("tokens/s (all ranks, whole run)", f"{summary['tokens_per_second']:,.0f}"))
    for rank, (gib, device) in summary["peak_memory_gib"].items():
        rows.append((f"peak memory, rank {rank} ({_memory_kind(device)})", f"{gib:.2f} GiB"))
    if summary.get("metrics"):
        rows.append(("last log (rank 0)", _metrics_text(summary["metrics"])))
    table = "".join(
        f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>{html.escape(v)}</td></tr>"
        for k, v in rows
    )
    parts = [
        _title(max(nprocs, len(snap.ranks)), head + f" after {_duration(summary['total_time'])}"),
        _progress_html(snap),
        f"<table class='nbkit-results'>{table}</table>",
        _curve_img(loss_curve_png(snap.curve)),
    ]
    if snap.ranks:
        parts.append(rank_table_html(snap, nprocs))
    return f"<div class='nbkit-summary' style='{_PANEL_STYLE}'>{''.join(parts)}</div>"


def panel_html(snap: Snapshot, nprocs: int, curve_png: bytes) -> str:
    """One live frame: title, progress bar and status line, the loss curve (once there is one),
    a row per rank (every rank from the first frame on), and the other metrics of the latest log.
    """
    extra = other_metrics(snap)
    parts = [
        _title(nprocs, "training"),
        _progress_html(snap),
        f"<div class='nbkit-status'>{html.escape(_status(snap))}</div>",
        _curve_img(curve_png),
        rank_table_html(snap, nprocs),
    ]
    if extra:
        parts.append(f"<div class='nbkit-latest'>last log (rank 0): {html.escape(_metrics_text(extra))}</div>")
    return f"<div class='nbkit-panel' style='{_PANEL_STYLE}'>{''.join(parts)}</div>"


def rank_table_html(snap: Snapshot, nprocs: int = 0) -> str:
    """A table with one row per rank: every rank below nprocs (those yet to report say so) and
    any other rank that reported.
    """
    head = "<tr><th>rank</th><th>step</th><th>loss</th><th>tokens/s</th><th>peak memory</th><th>elapsed</th></tr>"
    body = []
    for rank in sorted(set(range(nprocs)) | set(snap.ranks)):
        m = snap.ranks.get(rank)
        if m is None:
            cells = [str(rank), "starting", "", "", "", ""]
        else:
            peak = snap.peak_memory_gib.get(rank)
            cells = [
                str(rank),
                _fmt(m.get("step"), "{}"),
                _fmt(m.get("loss"), "{:.4f}"),
                _fmt(m.get("tokens_per_second"), "{:,.0f}"),
                f"{peak[0]:.2f} GiB ({_memory_kind(peak[1])})" if peak else "",
                _duration(m["elapsed"]) if _is_number(m.get("elapsed")) else "",
            ]
        body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f"<table class='nbkit-ranks'>{head}{''.join(body)}</table>"


def loss_curve_png(curve: list[tuple[int, float]]) -> bytes:
    """The loss curve as PNG bytes (b"" without matplotlib or without points)."""
    if not curve:
        return b""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return b""
    # A bare Figure (no pyplot): no global state, safe to draw from the channel thread.
    fig = Figure(figsize=(6, 2.4), dpi=90)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([s for s, _ in curve], [v for _, v in curve], color="#1f77b4", marker="." if len(curve) < 50 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


_PANEL_STYLE = "font-size:13px;line-height:1.5"


def _status(snap: Snapshot) -> str:
    # The text line without the peak memory, which the rank table shows rank by rank.
    return text_line(replace(snap, peak_memory_gib={})).removeprefix("nbkit: ")


def _metrics_text(metrics: dict[str, float]) -> str:
    return " · ".join(f"{name} {_number(value)}" for name, value in metrics.items())


def _title(nprocs: int, state: str) -> str:
    return f"<div><b>nbkit</b> · {nprocs} rank{'s' if nprocs != 1 else ''} · {html.escape(state)}</div>"


def _progress_html(snap: Snapshot) -> str:
    # <progress>, as transformers' notebook bar: it survives the sanitiser of an untrusted
    # (reopened) notebook, where inline styles of a hand-made bar may not.
    if not snap.total_steps:
        return ""
    value = min(snap.step or 0, snap.total_steps)
    return (
        f"<div><progress value='{value}' max='{snap.total_steps}' style='width:50%;height:14px'></progress> "
        f"{value}/{snap.total_steps}</div>"
    )


def _curve_img(png: bytes) -> str:
    # No <img> at all until there is a curve: an empty image is a broken-image icon.
    if not png:
        return ""
    return f"<img alt='loss curve' src='data:image/png;base64,{base64.b64encode(png).decode()}'/>"


class _LiveView:
    """A live panel of one dashboard (created on its first event): throttled redraws, each with
    the latest snapshot, and a trailing redraw so that the last events of a burst are shown.
    """

    def __init__(self, board: Dashboard):
        self.board = board
        self._drawn = self._curve_drawn = float("-inf")
        self._png = b""
        self._timer: threading.Timer | None = None

    def refresh(self, force: bool = False) -> None:
        """Redraw now if the last redraw is old enough (or force), else once a little later."""
        with self.board._lock:  # the channel thread and the trailing-refresh timer
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
        if self.board.closed:
            return
        try:
            with self.board._cell.active():
                self.refresh(force=True)
        except Exception:  # a display problem must never surface in a timer thread's traceback
            logging.getLogger("nbkit").exception("nbkit: the dashboard failed")


class _HtmlPanel(_LiveView):
    """The live panel as one HTML output, replaced in place at each redraw."""

    def __init__(self, board: Dashboard):
        from IPython.display import HTML, display

        super().__init__(board)
        self._html = HTML
        self.handle = display(HTML(panel_html(board.snapshot(), board.nprocs, b"")), display_id=True)
        self._drawn = time.monotonic()

    def draw(self, snap: Snapshot, png: bytes) -> None:
        self.handle.update(self._html(panel_html(snap, self.board.nprocs, png)))

    def replace(self, summary: str) -> None:
        self.handle.update(self._html(summary))


class _WidgetPanel(_LiveView):
    """The live panel as ipywidgets (NBKIT_DASHBOARD=widget)."""

    def __init__(self, board: Dashboard):
        import ipywidgets as w
        from IPython.display import display

        super().__init__(board)
        self.title = w.HTML(_title(board.nprocs, "training"))
        self.bar = w.IntProgress(value=0, min=0, max=1, bar_style="info", layout=w.Layout(width="50%"))
        self.status = w.HTML()
        # Hidden until there is a curve: an Image widget without a value is a broken-image icon.
        self.curve = w.Image(format="png", layout=w.Layout(max_width="560px", display="none"))
        self.table = w.HTML(rank_table_html(board.snapshot(), board.nprocs))
        self.latest = w.HTML()
        self.box = w.VBox([self.title, w.HBox([self.bar, self.status]), self.curve, self.table, self.latest])
        self.handle = display(self.box, display_id=True)

    def draw(self, snap: Snapshot, png: bytes) -> None:
        if snap.total_steps:
            self.bar.max = snap.total_steps
        self.bar.value = min(snap.step or 0, self.bar.max)
        self.status.value = html.escape(_status(snap))
        self.table.value = rank_table_html(snap, self.board.nprocs)
        extra = other_metrics(snap)
        self.latest.value = html.escape(f"last log (rank 0): {_metrics_text(extra)}") if extra else ""
        if png and bytes(self.curve.value) != png:
            self.curve.value = png
            self.curve.layout.display = None

    def replace(self, summary: str) -> None:
        from IPython.display import HTML

        # Replace the widget output in place: a saved notebook keeps this HTML, not the widgets.
        if self.handle is not None:
            self.handle.update(HTML(summary))
        for widget in (*self.box.children, self.box):
            widget.close()
        for widget in (self.bar, self.status):  # inside the HBox
            widget.close()


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _mean(values: Any) -> float | None:
    numbers = [float(v) for v in values if _is_number(v)]
    return sum(numbers) / len(numbers) if numbers else None


def _first(values: Any) -> float | None:
    return next((float(v) for v in values if _is_number(v)), None)


def _fmt(value: Any, spec: str) -> str:
    return spec.format(value) if _is_number(value) else ""


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _memory_kind(device: str) -> str:
    """'cuda:0' (torch's peak allocation on that GPU) or 'cpu RSS' (the process's peak resident memory)."""
    return "cpu RSS" if device == "cpu" else device


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
