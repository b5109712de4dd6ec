"""What the ranks send while a call runs, shown in the notebook's running cell: their output, display()
data and dashboard events (the notebook side of the relay; nbkit.rankoutput is the rank side).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sys
from typing import TYPE_CHECKING, Any

from nbkit import channel
from nbkit.live.messages import CallDone, Display, Interrupted, Lost, Output, Training
from nbkit.live.state import SetState
from nbkit.rankoutput import Prefixed


class CellOutput(SetState):
    """The relay's messages during a call: output to the cell, the dashboard, end-of-call marks."""

    if TYPE_CHECKING:  # methods of the other parts of LiveRanks that this part calls

        def _on_lost(self, lost: Lost) -> None: ...

    def _pump(self, wait: float) -> None:
        """Handle the relay's messages for up to `wait` s (on the notebook's main thread, so that output
        and the dashboard land in the cell that runs).
        """
        assert self._relay is not None
        try:
            item = self._relay.messages.get(timeout=wait)
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._relay.messages.get_nowait()
            except queue.Empty:
                return

    def _handle(self, message: channel.Envelope) -> None:
        body: object = message.body
        if isinstance(body, Output):
            if body.rank in self._shown:
                self._stream(body.rank, body.stream).write(body.text)
        elif isinstance(body, Display):
            if body.rank in self._shown:
                self._display(body)
        elif isinstance(body, CallDone):
            if body.call == self._call:
                self._done[body.rank] = body
        elif isinstance(body, Training):
            self._training[body.rank] = body
        elif isinstance(body, Interrupted):
            if body.call == self._call:
                self._heard.add(body.rank)
        elif isinstance(body, channel.Report):
            if self._board is None:
                from nbkit import dashboard

                self._board = dashboard.create(self.world_size)
            try:
                self._board.event(message.rank, body.metrics)
            except Exception:  # a display problem must never fail the call
                logging.getLogger("nbkit").exception("nbkit: the dashboard failed")
        elif isinstance(body, Lost):
            self._on_lost(body)
        elif isinstance(body, channel.Started):
            self._connected.add(message.rank)

    def _stream(self, rank: int, name: str) -> Any:
        stream = self._streams.get((rank, name))
        if stream is None:
            target = sys.stdout if name == "stdout" else sys.stderr
            if rank != min(self._shown):
                target = Prefixed(target, f"[rank {rank}] ")
            stream = self._streams[(rank, name)] = target
        return stream

    def _display(self, body: Display) -> None:
        """Show a rank's display() in the running cell: as display data in a kernel, else its text."""
        self._flush_streams()  # the rank's lines before it stay before it
        try:
            from IPython import get_ipython
        except ImportError:
            shell = None
        else:
            shell = get_ipython()
        if shell is None:  # a script: what display() prints outside a notebook
            text = body.data.get("text/plain")
            if text:
                self._stream(body.rank, "stdout").write(f"{text}\n")
            return
        try:
            shell.display_pub.publish(
                data=body.data, metadata=body.metadata, transient=body.transient, update=body.update
            )
        except Exception:  # a display problem must never fail the call
            logging.getLogger("nbkit").exception("nbkit: a rank's display() could not be shown")

    def _flush_streams(self) -> None:
        for stream in self._streams.values():
            with contextlib.suppress(Exception):
                stream.flush()
