"""Interrupting a training cell of a live set: Trainer stops at an optimizer step every rank agrees on.

What goes wrong without it: the notebook's stop button sends SIGINT to every rank, and Python raises
KeyboardInterrupt in a rank only when it runs Python code. During DDP training a rank waits in a
collective (the gradient all-reduce) most of the time, so one rank raises and leaves training while
its peer waits for it in a collective forever; the notebook then had to end the set, and the model
with it (a reviewer's 2 of 3 tries, 2 gloo ranks, tiny:qwen3).

What this module does instead, in every rank of a live set (patch group "live", applied by
nbkit.rank_side.live_engine.setup):

- While Trainer.train() runs, SIGINT raises nothing: the first one records a stop request on this
  rank (the handler only sets a flag: it may run while the rank is sending on its relay connection,
  whose lock it must not take). A second one raises KeyboardInterrupt as before: the hard path, for a
  stop that never comes (a peer stuck elsewhere).
- Agreement on the step, from the ranks themselves: the ranks see the signal at different steps (the
  notebook signals them one after another, and a rank in a collective sees it only when the
  collective returns). At the end of each optimizer step every rank starts an all-reduce (MAX) of its
  request flag, asynchronously, on a gloo group of its own (CPU: no CUDA sync on the GPU path), and at
  the end of the next step reads the previous step's result. Every rank has started that all-reduce by
  then (each rank's step k+1 needs every rank's step-k+1 gradients, which come after its step k), so
  reading it hardly waits; and every rank reads the same result at the same step, so every rank sets
  control.should_training_stop at the same step: a stop requested at step k's end on any rank stops
  every rank at step k+1. Cost per step (benchmarks/stop_agreement.py, 2 gloo ranks on a shared
  2-core CPU box, benchmarks/RESULTS.md): 70-250 µs of host time, of which 2-10 µs waiting.
  Why not agree through the notebook, which sees every rank's step in the dashboard reports: a step
  it picks may already be behind a rank by the time that rank hears of it, so the ranks would have to
  wait at a step's end for the notebook's word, and a rank that hears of the stop only after entering
  the next step's collective would wait there for a peer that waits for the notebook. The all-reduce
  cannot disagree and needs no round trip.
- The group is made per train() run (dist.new_group, a few ms): a run that ended with an exception
  can leave one rank with one all-reduce more in flight than another, and a group reused after that
  would pair different steps' flags.
- Trainer then ends the run as usual (on_train_end, the model's hooks taken off, the last checkpoint
  kept) and returns; the wrapper sends a Training message saying at which step it stopped and raises
  TrainingStopped (a KeyboardInterrupt), so that the rest of the cell does not run, as with a
  notebook's own interrupt. The model keeps the weights of that step; the notebook side
  (nbkit.live.notebook) waits for every rank and says so in one line.

Outside Trainer.train() (a plain loop in a cell) SIGINT acts as before.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any

from nbkit.messages import rank as channel
from nbkit.messages.live import Training
from nbkit.platform import patching
from nbkit.training import callbacks

__all__ = ["StopCallback", "TrainingStopped"]  # noqa: F822 (StopCallback: built on first use)


class TrainingStopped(KeyboardInterrupt):
    """Raised by Trainer.train() in a live rank that stopped training because the notebook was
    interrupted; every rank of the run stopped at the same step, `step`.
    """

    def __init__(self, step: int):
        super().__init__(f"training stopped at step {step} because the notebook was interrupted")
        self.step = step


class _Run:
    """One Trainer.train() run in a live rank: the stop request, the agreement, the SIGINT handler."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.requested = False
        self.stopped_at: int | None = None
        self._group: Any = None
        self._flag: Any = None  # one tensor for every step: it holds 0 until a stop is agreed, when the run ends
        self._pending: Any = None  # the work of the flag's all-reduce started at the last step's end
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            self._group = dist.new_group(backend="gloo")
            self._flag = torch.zeros(1, dtype=torch.int32)
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested:  # the second press: the hard path
            signal.signal(signal.SIGINT, self._previous)
            raise KeyboardInterrupt
        self.requested = True

    def step_end(self, step: int, control: Any) -> None:
        """At the end of optimizer step `step`: stop here if the ranks agreed to (see the module doc)."""
        agreed = self.requested if self._group is None else False
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            agreed = bool(self._flag.item())
        if agreed:
            control.should_training_stop = True
        if control.should_training_stop:
            # Every rank ends here (the agreement, or Trainer's own end, the same on every rank):
            # no all-reduce is started that a rank would read after training.
            if agreed or self.requested:
                self.stopped_at = step
            return
        if self._group is not None:
            import torch.distributed as dist

            if self.requested:
                self._flag.fill_(1)
            self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def end(self, *, failed: bool) -> None:
        """Put the SIGINT handler back; wait for an all-reduce still in flight (every rank started it)
        unless the run failed, when a peer may never start it; let go of the group.
        """
        if signal.getsignal(signal.SIGINT) == self._on_sigint:
            signal.signal(signal.SIGINT, self._previous)
        if self._pending is not None and not failed:
            self._pending.wait()
        if self._group is not None and not failed:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._group)
        self._pending = self._group = self._flag = None


_current: _Run | None = None


class _StopAtAgreedStep:
    """A transformers TrainerCallback: ends training at the step the live set's ranks agreed on
    after an interrupt (nbkit.rank_side.live_stopping); added by the wrapped Trainer.train() for one run.
    """

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if _current is not None:
            _current.step_end(state.global_step, control)


def _stop_callback() -> type:
    return callbacks.trainer_callback("StopCallback", _StopAtAgreedStep, __name__)


__getattr__ = callbacks.lazy_module_attributes(__name__, StopCallback=_StopAtAgreedStep)


@patching.patch(
    "transformers.trainer:Trainer.train",
    reason="in a live set, an interrupt must stop training at a step every rank agrees on: a KeyboardInterrupt "
    "raised in one rank while its peer waits in the gradient all-reduce leaves the peer there for good, and the "
    "set (with the model) had to be ended; while train() runs, SIGINT becomes a stop request that a callback "
    "honours at an agreed step end, and train() returns before TrainingStopped ends the cell",
    upstream="no upstream issue: Trainer has no stop request other than control.should_training_stop, which "
    "each process sets on its own",
    group="live",
)
def _train(original):
    def train(self, *args, **kwargs):
        global _current
        if _current is not None or threading.current_thread() is not threading.main_thread():
            # A nested train() (a subclass calling super().train()) is the same run; signal
            # handlers can only be set on the main thread.
            return original(self, *args, **kwargs)
        callback = _stop_callback()()
        self.add_callback(callback)
        run: _Run | None = None
        failed = True
        try:
            run = _current = _Run()
            channel.send(Training(running=True, step=self.state.global_step))
            output = original(self, *args, **kwargs)
            failed = False
        finally:
            _current = None
            self.remove_callback(callback)
            if run is not None:
                run.end(failed=failed)
                with contextlib.suppress(OSError):
                    stopped = run.stopped_at is not None
                    channel.send(Training(running=False, step=self.state.global_step, stopped=stopped))
        if run.stopped_at is not None:
            raise TrainingStopped(run.stopped_at)
        return output

    return train
