"""One call on a live set (the notebook side): sending it to the ranks, waiting for it, interrupts,
timeouts and failures while it runs, and its value or error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NoReturn

from nbkit.launching import rank_contract, supervisor
from nbkit.live.cell_output import CellOutput
from nbkit.live.engines import Engines, ranks_text
from nbkit.messages import rank as channel
from nbkit.messages.live import CallDone, Display, Interrupted, Outcome, Output, Training
from nbkit.platform import notices
from nbkit.platform.errors import LiveError, RankError

__all__ = ["Call"]

_log = notices.logger(__name__)


class Call:
    """One call in flight on the ranks `targets` of a live set, with the failure rules of nbkit.live.notebook:
    what the ranks said about it (finished, training, heard the interrupt) and its output in the cell.
    Made per call, numbered `number` (the ranks' end-of-call marks name it); run() runs it once.
    """

    def __init__(self, engines: Engines, number: int, targets: list[int], shown: set[int]):
        self.number = number
        self._engines = engines
        self._targets = targets
        self._shown = shown
        self._output = CellOutput(shown, engines.world_size)
        self._done: dict[int, CallDone] = {}
        self._training: dict[int, Training] = {}  # each rank's last Trainer.train() state in this call
        self._heard: set[int] = set()  # ranks where Python saw this call's interrupt (Interrupted)

    def run(
        self,
        fn: Callable[..., Outcome],
        args: tuple,
        timeout: float | None,
        *,
        after: Callable[[], None] | None = None,
        received: Callable[[dict[int, Outcome]], None] | None = None,
    ) -> Any:
        """Run fn(number, *args, shown, wants_value) on each target and wait; returns the value of
        the lowest target. `received` sees every rank's Outcome ({rank: outcome}) before errors are raised,
        `after` runs however the call ends. Raises LiveError (a rank failed, or the set ended).
        """
        ar = self._apply_each(fn, args)
        success = False
        try:
            try:
                outcomes = self._wait(ar, timeout)
            finally:
                if after is not None:  # what the code bound before it failed is on the ranks too
                    after()
            if received is not None:
                received(outcomes)
            value = self._result(outcomes)
            success = True
            return value
        finally:
            self._output.close(success=success)

    def _apply_each(self, fn: Callable[..., Outcome], args: tuple) -> _Gathered:
        value_rank = self._targets[0]
        return _Gathered(
            {
                r: self._engines.apply(r, fn, self.number, *args, r in self._shown, r == value_rank)
                for r in self._targets
            }
        )

    def _pump(self, wait: float) -> None:
        self._engines.pump(wait, self._handle)

    def _handle(self, message: channel.Envelope) -> None:
        """One of the relay's messages about calls (nbkit.live.engines handles the set's own)."""
        rank, body = message.rank, message.body
        if isinstance(body, Output):
            self._output.write(rank, body.stream, body.text)
        elif isinstance(body, Display):
            self._output.display(rank, body)
        elif isinstance(body, CallDone):
            if body.call == self.number:
                self._done[rank] = body
        elif isinstance(body, Training):
            self._training[rank] = body
        elif isinstance(body, Interrupted):
            if body.call == self.number:
                self._heard.add(rank)
        elif isinstance(body, channel.Report):
            self._output.report(rank, body.metrics)

    def _wait(self, ar: _Gathered, timeout: float | None) -> dict[int, Outcome]:
        deadline = time.monotonic() + timeout if timeout else None
        failed_at: float | None = None
        interrupted_at: float | None = None
        hard_again = False  # ranks in Trainer.train() got the second signal that interrupts them at once
        ready_at: float | None = None
        try:
            while True:
                self._pump(0.01)
                self._engines.check_not_gone(self._targets)
                unfinished = [r for r in self._targets if r not in self._done]
                now = time.monotonic()
                if ar.ready():
                    # Every rank answered. A rank whose end-of-call mark is missing failed before
                    # nbkit's code ran there (ipyparallel could not unpickle the call): its answer
                    # says why, so waiting longer would only hang.
                    ready_at = ready_at or now
                    if not unfinished or now - ready_at > _FAILURE_GRACE_S:
                        break
                if failed_at is None and any(d.failed for d in self._done.values()):
                    failed_at = now
                if failed_at is not None and interrupted_at is None and now - failed_at > _FAILURE_GRACE_S:
                    self._engines.interrupt(unfinished)
                    interrupted_at = now
                if interrupted_at is not None and not hard_again and now - interrupted_at > _SECOND_SIGNAL_S:
                    # A peer failed, so no step will be agreed: where the first signal became a stop
                    # request (nbkit.rank_side.live_stopping), a second one interrupts. Sent apart, since two
                    # signals that arrive before Python runs the handler count as one.
                    hard_again = True
                    self._engines.interrupt(
                        [r for r in unfinished if r in self._training and self._training[r].running]
                    )
                if interrupted_at is not None and now - interrupted_at > _INTERRUPT_GRACE_S:
                    self._end_after_failure(ar, sorted(r for r, d in self._done.items() if d.failed), unfinished)
                if deadline is not None and now > deadline:
                    self._end_at_timeout(timeout, unfinished)
        except KeyboardInterrupt:
            self._on_interrupt(ar, deadline, timeout)
            raise
        return ar.get()

    def _end_after_failure(self, ar: _Gathered, failed: list[int], still: list[int]) -> NoReturn:
        """End the set because ranks `still` neither finished nor answered an interrupt after ranks `failed`
        failed; raises the LiveError with the failures.
        """
        self._engines.end(
            f"rank(s) {ranks_text(failed)} failed, and rank(s) {ranks_text(still)} neither finished nor answered an "
            f"interrupt within {_INTERRUPT_GRACE_S:.0f} s (most likely waiting in a collective for the rank that "
            "failed)."
        )
        raise self._call_error(ar.finished_errors(), ended=True)

    def _end_at_timeout(self, timeout: float | None, unfinished: list[int]) -> NoReturn:
        """End the set because the call passed its timeout; raises the LiveError that says so."""
        self._engines.end(
            f"the call did not finish within its timeout ({timeout:g} s); rank(s) {ranks_text(unfinished)} were still "
            f"running. {supervisor.hang_hint(self._some_ranks_hint())}"
        )
        if self._engines.ended is None:  # stop() came first, from another thread
            self._engines.check_not_gone(self._targets)
        raise LiveError(self._engines.ended_text(), ended=True, timed_out=True)

    def _some_ranks_hint(self) -> str:
        """For a call on some ranks only: the likely cause of a rank that waits ("" for a call on every rank)."""
        if len(self._targets) == self._engines.world_size:
            return ""
        return (
            f"a cell run on rank(s) {ranks_text(self._targets)} only called a collective (evaluate(), barrier, "
            "all_reduce) that the other ranks never join: run it on every rank (%%ddp without --rank)."
        )

    def _on_interrupt(self, ar: _Gathered, deadline: float | None, timeout: float | None) -> None:
        """The notebook was interrupted during a call: stop training at an agreed step where every rank
        runs Trainer.train(), else interrupt the call on every rank; end the set where a rank does not
        answer (see the module doc). Returns when every rank has finished the call; raises LiveError
        when the set was ended.
        """
        unfinished = [r for r in self._targets if r not in self._done]
        self._engines.interrupt(unfinished)
        hard = False  # a second press during a pending stop: interrupt as for any other code
        said_stopping = False
        grace_until = time.monotonic() + _INTERRUPT_GRACE_S
        while self._engines.running:
            try:
                self._pump(0.01)
                if all(r in self._done for r in self._targets) and ar.ready():
                    if self._failed_otherwise(ar):  # a rank's own error says more than the interrupt
                        raise self._call_error(ar.finished_errors(), ended=False)
                    _log.warning(self._interrupted_text(unfinished))
                    return
                now = time.monotonic()
                still = [r for r in self._targets if r not in self._done]
                if said_stopping and not hard and self._failed_otherwise(ar):
                    # A rank failed on its own while the stop was pending: no step will be agreed, so
                    # the ranks still training get the signal that interrupts them.
                    hard = True
                    self._engines.interrupt(still)
                    grace_until = now + _INTERRUPT_GRACE_S
                # A rank in train() answers at the next agreed step end, however long a step takes; a
                # rank that says so only after the signal (train() just began) still counts.
                if not hard and self._all_training(ar, still):
                    grace_until = now + _INTERRUPT_GRACE_S
                    if not said_stopping:
                        said_stopping = True
                        _log.warning(
                            "nbkit: stopping training at the next step that every rank agrees on (the model keeps "
                            "its weights); interrupt again to stop at once, which may end the live set."
                        )
                if deadline is not None and now > deadline:
                    self._end_at_timeout(timeout, still)
                if now > grace_until:
                    failed = self._failed_otherwise(ar)
                    if failed:
                        self._end_after_failure(ar, failed, still)
                    self._engines.end(self._unanswered_text(still))
            except KeyboardInterrupt:
                if said_stopping and not hard:  # the stop is pending: the second press interrupts at once
                    hard = True
                    self._engines.interrupt([r for r in self._targets if r not in self._done])
                    grace_until = time.monotonic() + _INTERRUPT_GRACE_S
                # else: a further press while the ranks are being interrupted
        self._engines.check_not_gone(self._targets)

    def _unanswered_text(self, still: list[int]) -> str:
        """Why ranks `still` did not end the call within the grace after an interrupt: the code caught the
        KeyboardInterrupt where Python saw the signal (Interrupted), else most likely a collective.
        """
        caught = [r for r in still if r in self._heard]
        deaf = [r for r in still if r not in self._heard]
        parts = []
        if caught:
            parts.append(
                f"rank(s) {ranks_text(caught)} got the interrupt but went on running: the cell's code caught the "
                "KeyboardInterrupt (an `except KeyboardInterrupt:` or a bare `except:` that carries on). Let it "
                "propagate (re-raise it), so that the stop button ends the cell and keeps the set"
            )
        if deaf:
            hint = self._some_ranks_hint()
            parts.append(
                f"rank(s) {ranks_text(deaf)} did not answer the interrupt within {_INTERRUPT_GRACE_S:.0f} s "
                + (
                    f"(waiting in a collective, where Python never sees the signal): {hint}"
                    if hint
                    else "(most likely waiting in a collective, where Python never sees the signal)"
                )
            )
        return "; ".join(parts) + ("" if parts[-1].endswith(".") else ".")

    def _all_training(self, ar: _Gathered, unfinished: list[int]) -> bool:
        """Whether a call on every rank has each unfinished rank inside Trainer.train() now, and no
        rank failed otherwise than by the agreed stop.
        """
        return (
            len(self._targets) == self._engines.world_size
            and bool(unfinished)
            and all(r in self._training and self._training[r].running for r in unfinished)
            and not self._failed_otherwise(ar)
        )

    def _failed_otherwise(self, ar: _Gathered) -> list[int]:
        """The ranks that finished this call with an error of their own: not an interrupt, nor the agreed
        stop of their training (both KeyboardInterrupts).
        """
        if not any(done.failed for done in self._done.values()):
            return []
        return sorted(r for r, error in ar.finished_errors().items() if not error.secondary)

    def _interrupted_text(self, unfinished: list[int]) -> str:
        stops = {
            self._training[r].step if r in self._training and self._training[r].stopped else -1 for r in self._targets
        }
        if len(stops) == 1 and -1 not in stops:
            step = stops.pop()
            return (
                f"nbkit: interrupted: training stopped at step {step} on every rank; the live set and its names are "
                f"kept, and the model has the weights of step {step}. trainer.train(resume_from_checkpoint=True) "
                "goes on from the last saved checkpoint."
            )
        return f"nbkit: interrupted the cell on rank(s) {ranks_text(unfinished)}; every rank is alive with its names."

    def _result(self, outcomes: dict[int, Outcome]) -> Any:
        errors = _errors(outcomes)
        if errors:
            raise self._call_error(errors, ended=False)
        answer = outcomes[self._targets[0]].answer
        if not isinstance(answer, channel.Result):  # its value was not asked for
            return None
        return rank_contract.load_value(answer.payload, self._targets[0], error=LiveError)

    def _call_error(self, errors: dict[int, RankError], *, ended: bool) -> LiveError:
        primary = {r: e for r, e in errors.items() if not e.secondary} or errors
        ranks = ranks_text(sorted(primary))
        if ended:
            head = f"rank(s) {ranks} failed, and the live set was ended: {self._engines.ended}"
        else:
            head = f"rank(s) {ranks} failed; the live set is still running, every rank with its names."
        lines = [head, *supervisor.render_failures(dict(sorted(primary.items())), errors.values())]
        return LiveError(
            "\n".join(lines),
            failures={r: f"{e.type}: {e.message}" for r, e in primary.items()},
            errors=errors,
            ended=ended,
        )


# How long ranks that have not finished get after another rank failed, before they are interrupted
# (they may still be finishing on their own), and after an interrupt, before the set is ended.
_FAILURE_GRACE_S = 1.0


_INTERRUPT_GRACE_S = 2.0


_SECOND_SIGNAL_S = 0.3  # after a peer failed: when ranks in Trainer.train() get the signal that interrupts them


class _Gathered:
    """Several ipyparallel AsyncResults (one per rank, each with its own arguments) as one."""

    def __init__(self, results: dict[int, Any]):
        self._results = results  # {rank: its AsyncResult}

    def ready(self) -> bool:
        return all(ar.ready() for ar in self._results.values())

    def get(self) -> dict[int, Outcome]:
        """Each rank's Outcome; an error ipyparallel itself raised (before nbkit's code ran in the
        rank) becomes that rank's Outcome with the error.
        """
        outcomes: dict[int, Outcome] = {}
        for rank, ar in self._results.items():
            try:
                outcomes[rank] = ar.get()
            except Exception as exc:
                text = getattr(exc, "render_traceback", None)
                tb = "\n".join(text()) if callable(text) else str(exc)
                error = RankError(rank, type(exc).__name__, str(exc), tb, time.time())
                outcomes[rank] = Outcome(channel.Raised(error))
        return outcomes

    def finished_errors(self) -> dict[int, RankError]:
        """The errors of the ranks that have finished (the others are still running)."""
        return _errors({r: ar.get() for r, ar in self._results.items() if ar.ready() and ar.successful()})


def _errors(outcomes: dict[int, Outcome]) -> dict[int, RankError]:
    """{rank: its error} of the ranks whose call raised."""
    return {r: o.answer.error for r, o in outcomes.items() if isinstance(o.answer, channel.Raised)}
