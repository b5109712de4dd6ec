"""The live view of a launch in the notebook (minimal first version; issue 5 builds the panel)."""

from __future__ import annotations

from typing import Any

__all__ = ["Dashboard"]


class Dashboard:
    """Receives the ranks' events in the notebook process and shows them."""

    def __init__(self, nprocs: int):
        self.nprocs = nprocs
        self.events: list[tuple[int, dict[str, Any]]] = []

    def event(self, rank: int, metrics: dict[str, Any]) -> None:
        self.events.append((rank, metrics))

    def close(self, success: bool) -> None:
        pass
