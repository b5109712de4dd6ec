"""The live view of a launch in the notebook: one panel for all ranks.

nbkit.launch creates a `Dashboard(nprocs)` in the notebook process; the launcher's channel thread
passes it every event the ranks report (nbkit.report, the Trainer callback), and `close()` runs
when the launch ends. Nothing is shown until the first event, so a launch whose function reports
nothing shows nothing.

How it shows (decided when the dashboard is created, see `display_mode()`):

- "widget": an ipywidgets panel (progress bar, loss curve drawn with matplotlib, one row per
  rank), refreshed at most twice a second (the curve every 2 s). At the end the panel is
  replaced, in place, by a static HTML summary (final loss, total time, tokens/s, peak memory
  per GPU, the loss curve as an image) that a saved notebook keeps without any widget state.
- "text": one concise line every NBKIT_DASHBOARD_INTERVAL seconds (default 10) and a summary at
  the end: for papermill/nbclient runs, terminals and scripts.
- "off": nothing is shown; events are still recorded.

NBKIT_DASHBOARD=auto|widget|text|off chooses by hand (auto by default). The most recent
dashboard stays reachable as `nbkit.dashboard.latest()` (its `events`, `snapshot()`,
`summary()`), for a look at the run afterwards and for tests.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from nbkit.config import setting
from nbkit.shell import current as _shell

__all__ = ["Dashboard", "OutputCell", "Snapshot", "display_mode", "latest", "relay", "relay_to", "widget_frontend"]

_WIDGET_REFRESH_S = 0.5
_CURVE_REFRESH_S = 2.0

# Programs that execute notebooks without a person watching: their kernels have no widget frontend.
_HEADLESS_RUNNERS = ("papermill", "nbclient", "nbconvert", "jupyter-execute", "nbmake", "pytest", "testbook")

_latest: Dashboard | None = None
_relay: Any = None
_relay_lock = threading.Lock()


def latest() -> Dashboard | None:
    """The most recently created Dashboard in this process (None before the first launch)."""
    return _latest


def relay_to(connection: Any) -> None:
    """Make every Dashboard created afterwards in this process forward its events to `connection`
    (a multiprocessing Connection) as ("event", rank, metrics) instead of showing them. Used by
    nbkit.spawning's launcher process, whose dashboard lives in the notebook.
    """
    global _relay
    _relay = connection


def relay(message: tuple) -> None:
    """Send one message over the connection given to relay_to() (thread-safe)."""
    with _relay_lock:
        _relay.send(message)


# --------------------------------------------------------------------------------------------
# Where to show things
# --------------------------------------------------------------------------------------------


def display_mode() -> str:
    """How a dashboard created now would show: "widget", "text" or "off".

    NBKIT_DASHBOARD overrides ("widget", "text", "off"); otherwise "widget" when
    `widget_frontend()` says a person is watching a widget-capable frontend, else "text".
    """
    wanted = setting("dashboard")
    if wanted != "auto":
        return wanted
    return "widget" if widget_frontend() else "text"


def widget_frontend() -> bool:
    """Whether this process is a Jupyter kernel whose output a widget-capable frontend shows live.

    Widgets need a kernel (not plain IPython or a script), ipywidgets, and a frontend that renders
    them; papermill, nbclient, nbconvert and nbmake run kernels with none (widgets would show as
    "VBox(...)" and the log would stay silent). A person is taken to be watching only on positive
    evidence: Colab; a Kaggle interactive session (KAGGLE_KERNEL_RUN_TYPE=Interactive, not
    Batch, which is "Save & Run All"); a kernel started by a Jupyter server for a notebook
    (JPY_SESSION_NAME, set by jupyter_server 2+); or a request that names its cell (JupyterLab,
    Notebook 7 and VS Code send a cellId with every execution; nbclient sends none). Kernels under
    known headless runners (seen in the parent processes' command lines) never count.
    """
    shell = _shell()
    if shell is None or not hasattr(shell, "kernel"):
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    run_type = os.environ.get("KAGGLE_KERNEL_RUN_TYPE")
    if run_type is not None:
        return run_type.lower() != "batch"
    if os.environ.get("COLAB_RELEASE_TAG"):
        return True
    if any(runner in cmdline for cmdline in _ancestor_cmdlines() for runner in _HEADLESS_RUNNERS):
        return False
    return bool(os.environ.get("JPY_SESSION_NAME")) or _request_names_cell(shell)


def _request_names_cell(shell: Any) -> bool:
    try:
        request = shell.kernel.get_parent()
    except Exception:  # older ipykernel signatures: no evidence
        return False
    return isinstance(request, dict) and "cellId" in (request.get("metadata") or {})


def _ancestor_cmdlines(depth: int = 4) -> list[str]:
    """Command lines of this process's parents (Linux /proc; [] where unavailable)."""
    lines, pid = [], os.getppid()
    for _ in range(depth):
        if pid <= 1:
            break
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                lines.append(f.read().replace(b"\0", b" ").decode(errors="replace").lower())
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return lines


class OutputCell:
    """The notebook cell running when this object is created; `with cell.active():` makes output
    from another thread (display, print, widget updates) go to that cell.

    Needed because ipykernel 7 keeps the "parent" message per thread (a context variable) and a
    new thread has none. Outside a kernel, and in the main thread, `active()` does nothing.
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
    the ranks' latest losses. tokens_per_second: the ranks' latest rates, summed. eta: seconds
    left, from the pace since the first step event. peak_memory_gib: {rank: (GiB, device)}.
    curve: [(step, loss averaged over the ranks that reported that step)].
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

    Takes nprocs (how many ranks report) and, optionally, mode ("widget", "text", "off"; default
    `display_mode()`) and interval (seconds between text lines; default NBKIT_DASHBOARD_INTERVAL
    or 10). `event()` may be called from any thread; `close()` once, when the launch ends.
    Display errors are the caller's to swallow (the launcher logs and ignores them).
    """

    def __init__(self, nprocs: int, *, mode: str | None = None, interval: float | None = None):
        global _latest
        self.nprocs = nprocs
        self.events: list[tuple[int, dict[str, Any]]] = []
        self.mode = "relay" if _relay is not None else (mode or display_mode())
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
        # rank -> the first and the latest (tokens_seen, elapsed) it reported
        self._token_span: dict[int, tuple[tuple[float, float], tuple[float, float]]] = {}
        self._cell = OutputCell()
        self._stream = sys.stdout  # launch() silences sys.stdout while the ranks run
        self._view: _Panel | None = None
        self._last_line = float("-inf")
        _latest = self
        if self.mode == "relay":
            relay(("dashboard", nprocs))

    # -- receiving ---------------------------------------------------------------------------
    def event(self, rank: int, metrics: dict[str, Any]) -> None:
        """Record one event of `rank` and refresh the display (throttled)."""
        now = time.monotonic()
        with self._lock:
            self.events.append((rank, metrics))
            merged = self._ranks.setdefault(rank, {})
            merged.update(metrics)
            merged["_received"] = now
            step, loss = metrics.get("step"), metrics.get("loss")
            if isinstance(loss, (int, float)) and isinstance(step, int):
                self._losses.setdefault(step, {})[rank] = float(loss)
            if isinstance(step, int) and step > 0 and self._pace is None:
                self._pace = (now, step)
            seen, elapsed = metrics.get("tokens_seen"), metrics.get("elapsed")
            if isinstance(seen, (int, float)) and isinstance(elapsed, (int, float)):
                # The run's average rate counts from the first token report on: model loading and
                # imports before training do not dilute it.
                first = self._token_span.get(rank, ((seen, elapsed),))[0]
                self._token_span[rank] = (first, (seen, elapsed))
            memory = metrics.get("peak_memory_gib")
            if isinstance(memory, (int, float)):
                old = self._peaks.get(rank, (0.0, ""))[0]
                self._peaks[rank] = (max(old, float(memory)), str(metrics.get("memory_device", "")))
        if self.mode == "relay":
            relay(("event", rank, metrics))
        elif self.mode == "text":
            if now - self._last_line >= self.interval:
                self._last_line = now
                self._print(text_line(self.snapshot()))
        elif self.mode == "widget":
            with self._cell.active():
                if self._view is None:
                    self._view = _Panel(self)
                self._view.refresh()

    # -- reading -----------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The run as reported so far (see Snapshot)."""
        now = time.monotonic()
        with self._lock:
            ranks = {r: {k: v for k, v in m.items() if not k.startswith("_")} for r, m in sorted(self._ranks.items())}
            snap = Snapshot(ranks=ranks, peak_memory_gib=dict(sorted(self._peaks.items())), elapsed=now - self._created)
            steps = [m["step"] for m in ranks.values() if isinstance(m.get("step"), int)]
            totals = [m["total_steps"] for m in ranks.values() if isinstance(m.get("total_steps"), int)]
            snap.step = max(steps) if steps else None
            snap.total_steps = max(totals) if totals else None
            snap.loss = _mean(m.get("loss") for m in ranks.values())
            snap.learning_rate = _first(m.get("learning_rate") for m in ranks.values())
            snap.grad_norm = _first(m.get("grad_norm") for m in ranks.values())
            rates = [
                m["tokens_per_second"] for m in ranks.values() if isinstance(m.get("tokens_per_second"), (int, float))
            ]
            snap.tokens_per_second = sum(rates) if rates else None
            snap.curve = [(s, sum(by_rank.values()) / len(by_rank)) for s, by_rank in sorted(self._losses.items())]
            if self._pace is not None and snap.step and snap.total_steps and snap.step > self._pace[1]:
                t0, s0 = self._pace
                snap.eta = (now - t0) / (snap.step - s0) * max(snap.total_steps - snap.step, 0)
        return snap

    def summary(self, success: bool = True) -> dict[str, Any]:
        """What the run came to: final_loss, step, total_steps, total_time (s), tokens_per_second
        (all ranks, averaged from each rank's first token report to its last), peak_memory_gib
        ({rank: (GiB, device)}), success.
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
        elif self.mode == "widget" and self._view is not None:
            with self._cell.active():
                self._view.finish(summary_html(summary, self.snapshot().curve))

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
        parts.append("peak " + "/".join(f"{gib:.1f}" for gib, _ in snap.peak_memory_gib.values()) + " GiB")
    timing = f"{_duration(snap.elapsed)} elapsed"
    if snap.eta is not None:
        timing += f", ETA {_duration(snap.eta)}"
    parts.append(timing)
    return "nbkit: " + " | ".join(parts)


def summary_text(summary: dict[str, Any]) -> str:
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
    return "\n".join(lines)


def summary_html(summary: dict[str, Any], curve: list[tuple[int, float]]) -> str:
    """The static end-of-run panel: a small table and the loss curve as an embedded PNG."""
    rows = [
        ("result", "finished" if summary["success"] else "stopped (failed or interrupted)"),
        ("total time", _duration(summary["total_time"])),
    ]
    if summary["step"] is not None:
        total = f" / {summary['total_steps']}" if summary["total_steps"] else ""
        rows.append(("steps", f"{summary['step']}{total}"))
    if summary["final_loss"] is not None:
        rows.append(("final loss", f"{summary['final_loss']:.4f}"))
    if summary["tokens_per_second"] is not None:
        rows.append(("tokens/s (all ranks)", f"{summary['tokens_per_second']:,.0f}"))
    for rank, (gib, device) in summary["peak_memory_gib"].items():
        rows.append((f"peak memory, rank {rank} ({device})", f"{gib:.2f} GiB"))
    table = "".join(
        f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows
    )
    image = ""
    png = loss_curve_png(curve)
    if png:
        image = f"<img alt='loss curve' src='data:image/png;base64,{base64.b64encode(png).decode()}'/>"
    return f"<div class='nbkit-summary'><b>nbkit</b><table>{table}</table>{image}</div>"


def rank_table_html(snap: Snapshot) -> str:
    head = "<tr><th>rank</th><th>step</th><th>loss</th><th>tokens/s</th><th>peak memory</th><th>elapsed</th></tr>"
    body = []
    for rank, m in snap.ranks.items():
        peak = snap.peak_memory_gib.get(rank)
        cells = [
            str(rank),
            _fmt(m.get("step"), "{}"),
            _fmt(m.get("loss"), "{:.4f}"),
            _fmt(m.get("tokens_per_second"), "{:,.0f}"),
            f"{peak[0]:.2f} GiB ({peak[1]})" if peak else "",
            _duration(m["elapsed"]) if isinstance(m.get("elapsed"), (int, float)) else "",
        ]
        body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f"<table>{head}{''.join(body)}</table>"


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


class _Panel:
    """The live ipywidgets panel of one dashboard; created on the first event."""

    def __init__(self, board: Dashboard):
        import ipywidgets as w
        from IPython.display import display

        self.board = board
        self.title = w.HTML(f"<b>nbkit</b> · {board.nprocs} rank{'s' if board.nprocs != 1 else ''}")
        self.bar = w.IntProgress(value=0, min=0, max=1, bar_style="info", layout=w.Layout(width="50%"))
        self.status = w.HTML()
        self.curve = w.Image(format="png", layout=w.Layout(max_width="560px"))
        self.table = w.HTML()
        self.box = w.VBox([self.title, w.HBox([self.bar, self.status]), self.curve, self.table])
        self._drawn = self._curve_drawn = float("-inf")
        self._timer: threading.Timer | None = None
        self.handle = display(self.box, display_id=True)

    def refresh(self, force: bool = False) -> None:
        with self.board._lock:  # the channel thread and the trailing-refresh timer
            self._refresh(force)

    def _refresh(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._drawn < _WIDGET_REFRESH_S:
            self._refresh_later(_WIDGET_REFRESH_S - (now - self._drawn))
            return
        self._drawn = now
        snap = self.board.snapshot()
        if snap.total_steps:
            self.bar.max = snap.total_steps
        self.bar.value = min(snap.step or 0, self.bar.max)
        self.status.value = html.escape(text_line(snap).removeprefix("nbkit: "))
        self.table.value = rank_table_html(snap)
        if snap.curve and (force or now - self._curve_drawn >= _CURVE_REFRESH_S):
            self._curve_drawn = now
            self.curve.value = loss_curve_png(snap.curve)

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
        with self.board._cell.active():
            self.refresh(force=True)

    def finish(self, summary: str) -> None:
        from IPython.display import HTML

        if self._timer is not None:
            self._timer.cancel()
        # Replace the widget output in place: a saved notebook keeps this HTML, not the widgets.
        if self.handle is not None:
            self.handle.update(HTML(summary))
        for widget in (self.title, self.bar, self.status, self.curve, self.table, *self.box.children, self.box):
            widget.close()


def _mean(values: Any) -> float | None:
    numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(numbers) / len(numbers) if numbers else None


def _first(values: Any) -> float | None:
    return next((float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)), None)


def _fmt(value: Any, spec: str) -> str:
    return spec.format(value) if isinstance(value, (int, float)) else ""


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
