"""What the ranks send while one call runs, shown in the notebook's running cell: their output, display()
data and dashboard events (the notebook side of the relay; nbkit.rank_side.output is the rank side).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

from nbkit.messages.live import Display
from nbkit.rank_side.output import Prefixed

__all__ = ["CellOutput"]


class CellOutput:
    """One call's output in the running cell: what the ranks it shows (`shown`) print and display(), the
    lowest of them as is and the others prefixed "[rank N] ", and a dashboard of every rank's reports,
    made at the first one. Made per call; close() ends it.
    """

    def __init__(self, shown: set[int], world_size: int):
        self._shown = shown
        self._world_size = world_size
        self._streams: dict[tuple[int, str], Any] = {}
        self._board: Any = None

    def write(self, rank: int, stream: str, text: str) -> None:
        """Show `text` that `rank` wrote to its `stream` ("stdout" or "stderr"), where the call shows it."""
        if rank in self._shown:
            self._stream(rank, stream).write(text)

    def display(self, rank: int, body: Display) -> None:
        """Show what `rank` passed to IPython's display, where the call shows that rank: as display data in
        a kernel, else its text.
        """
        if rank not in self._shown:
            return
        self._flush()  # the rank's lines before it stay before it
        try:
            from IPython import get_ipython
        except ImportError:
            shell = None
        else:
            shell = get_ipython()
        if shell is None:  # a script: what display() prints outside a notebook
            text = body.data.get("text/plain")
            if text:
                self._stream(rank, "stdout").write(f"{text}\n")
            return
        try:
            shell.display_pub.publish(
                data=body.data, metadata=body.metadata, transient=body.transient, update=body.update
            )
        except Exception:  # a display problem must never fail the call
            logging.getLogger("nbkit").exception("nbkit: a rank's display() could not be shown")

    def report(self, rank: int, metrics: dict[str, Any]) -> None:
        """Feed a rank's dashboard event to the call's dashboard (made at the first one)."""
        if self._board is None:
            from nbkit.notebook import dashboard

            self._board = dashboard.create(self._world_size)
        try:
            self._board.event(rank, metrics)
        except Exception:  # a display problem must never fail the call
            logging.getLogger("nbkit").exception("nbkit: the dashboard failed")

    def close(self, *, success: bool) -> None:
        """The call ended (`success`: without an error): close its dashboard, flush what it showed."""
        if self._board is not None:
            with contextlib.suppress(Exception):
                self._board.close(success=success)
        self._flush()

    def _stream(self, rank: int, name: str) -> Any:
        stream = self._streams.get((rank, name))
        if stream is None:
            target = sys.stdout if name == "stdout" else sys.stderr
            if rank != min(self._shown):
                target = Prefixed(target, f"[rank {rank}] ")
            stream = self._streams[(rank, name)] = target
        return stream

    def _flush(self) -> None:
        for stream in self._streams.values():
            with contextlib.suppress(Exception):
                stream.flush()
