"""Events as the Trainer callback reports them, for the dashboard's tests."""

from __future__ import annotations


def step_event(
    step: int,
    loss: float,
    *,
    rate: float = 100.0,
    seen: int | None = None,
    elapsed: float | None = None,
    memory: float = 1.0,
) -> dict:
    """One optimizer step's report: 10 steps in all, memory on the CPU, 100 tokens a step unless told."""
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
