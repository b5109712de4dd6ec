"""The renderings of a board's state: a text line, the live HTML panel, the static summary (HTML or
text), the rank table and the loss curve as PNG. Pure functions of a Snapshot or a summary: no
display, no state.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import replace
from typing import Any

from nbkit.notebook.dashboard.board import Snapshot, is_number, other_metrics

__all__ = [
    "loss_curve_png",
    "metrics_text",
    "panel_html",
    "peak_memory_text",
    "rank_table_html",
    "status_text",
    "summary_html",
    "summary_text",
    "text_line",
    "title_html",
]


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


def summary_text(summary: dict[str, Any]) -> str:
    """The end-of-run summary as lines of text (the text mode's last output)."""
    head = "finished" if summary["success"] else "stopped (failed or interrupted)"
    lines = [f"nbkit: {head} after {_duration(summary['total_time'])}"]
    if summary["step"] is not None:
        total = f"/{summary['total_steps']}" if summary["total_steps"] else ""
        lines.append(f"  steps: {summary['step']}{total}")
    if summary["final_loss"] is not None:
        lines.append(f"  final loss: {summary['final_loss']:.4f}")
    if summary.get("seconds_per_step") is not None:
        lines.append(f"  seconds per step (after the first): {summary['seconds_per_step']:.3f}")
    if summary["tokens_per_second"] is not None:
        lines.append(f"  tokens/s (all ranks, after the first step): {summary['tokens_per_second']:,.0f}")
    for rank, (gib, device) in summary["peak_memory_gib"].items():
        lines.append(f"  peak memory rank {rank} ({device}): {gib:.2f} GiB")
    if summary.get("metrics"):
        lines.append(f"  last log (rank 0): {metrics_text(summary['metrics'])}")
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
    if summary.get("seconds_per_step") is not None:
        rows.append(("seconds per step (after the first)", f"{summary['seconds_per_step']:.3f}"))
    if summary["tokens_per_second"] is not None:
        rows.append(("tokens/s (all ranks, after the first step)", f"{summary['tokens_per_second']:,.0f}"))
    for rank, (gib, device) in summary["peak_memory_gib"].items():
        rows.append((f"peak memory, rank {rank} ({_memory_kind(device)})", f"{gib:.2f} GiB"))
    if summary.get("metrics"):
        rows.append(("last log (rank 0)", metrics_text(summary["metrics"])))
    table = "".join(
        f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>{html.escape(v)}</td></tr>"
        for k, v in rows
    )
    parts = [
        title_html(max(nprocs, len(snap.ranks)), head + f" after {_duration(summary['total_time'])}"),
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
        title_html(nprocs, "training"),
        _progress_html(snap),
        f"<div class='nbkit-status'>{html.escape(status_text(snap))}</div>",
        _curve_img(curve_png),
        rank_table_html(snap, nprocs),
    ]
    if extra:
        parts.append(f"<div class='nbkit-latest'>last log (rank 0): {html.escape(metrics_text(extra))}</div>")
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
                _duration(m["elapsed"]) if is_number(m.get("elapsed")) else "",
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


def status_text(snap: Snapshot) -> str:
    """The panel's status line: the text line without the peak memory, which the rank table shows
    rank by rank.
    """
    return text_line(replace(snap, peak_memory_gib={})).removeprefix("nbkit: ")


def metrics_text(metrics: dict[str, float]) -> str:
    """'entropy 1.234 · mean_token_accuracy 0.5' (numbers of 1000 and more without decimals)."""
    return " · ".join(f"{name} {_number(value)}" for name, value in metrics.items())


def title_html(nprocs: int, state: str) -> str:
    """The panel's first line: 'nbkit · 2 ranks · training'."""
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


def _fmt(value: Any, spec: str) -> str:
    return spec.format(value) if is_number(value) else ""


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
