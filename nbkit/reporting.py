"""Metrics from the training ranks to the notebook (nbkit.report and the Trainer callback).

Minimal first version: report() sends an event over the launch channel. The Trainer callback and
the per-rank set-up are being built (issue 5).
"""

from __future__ import annotations

from typing import Any

from nbkit import channel

__all__ = ["report", "setup_rank"]


def report(step: int | None = None, loss: float | None = None, **metrics: Any) -> None:
    """Send metrics to the notebook's dashboard. Call it from any rank inside nbkit.launch."""
    channel.send("event", {"step": step, "loss": loss, **metrics})


def setup_rank() -> None:
    """Per-rank set-up run by nbkit.launch before the user's function."""
