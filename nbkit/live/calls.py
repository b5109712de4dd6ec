"""One call on a live set (the notebook side): sending it to the ranks, waiting for it, interrupts,
timeouts and failures while it runs, and its value or error.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from nbkit import notices, rankside, supervisor
from nbkit.errors import LiveError, RankError
from nbkit.live.messages import Outcome
from nbkit.live.state import SetState, _join

_log = notices.logger(__name__)


class Calls(SetState):
    """One call at a time: run it on some ranks and wait, with the failure rules of nbkit.live.notebook."""

    if TYPE_CHECKING:  # methods of the other parts of LiveRanks that this part calls

        def _end(self, reason: str) -> None: ...
        def _ended_text(self) -> str: ...
        def _flush_streams(self) -> None: ...
        def _interrupt(self, ranks: list[int]) -> None: ...
        def _pump(self, wait: float) -> None: ...

    def _targets(self, ranks: str | int | Iterable[int]) -> list[int]:
        self._check_running()
        if ranks == "all":
            return list(range(self.world_size))
        chosen: list[int] = [ranks] if isinstance(ranks, int) else sorted({int(r) for r in ranks})
        bad = [r for r in chosen if not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad or not chosen:
            raise ValueError(f"ranks must be 'all' or ranks 0..{self.world_size - 1}; got {ranks!r}.")
        return chosen

    def _check_running(self) -> None:
        if self._ended is not None:
            raise LiveError(
                f"The live set has ended: {self._ended} Start a new one (%ddp start / nbkit.start()).", ended=True
            )
        if self._stopped:
            raise LiveError(_STOPPED, ended=True)

    def _check_not_gone(self, targets: list[int]) -> None:
        """Raise the LiveError of a set that a failure ended or that stop() ended (from any thread) while
        a call on `targets` waited: the call cannot finish, and waiting would hang.
        """
        if self._ended is not None:
            raise LiveError(self._ended_text(), ended=True)
        if self._stopped:
            raise LiveError(
                f"LiveRanks.stop() ended the live set while this call ran on rank(s) {_join(targets)}: its ranks "
                f"are gone, and the call did not finish. {_STOPPED}",
                ended=True,
            )

    def _run_call(
        self,
        fn: Callable[..., Outcome],
        args: tuple | Mapping[int, tuple],
        targets: list[int],
        timeout: float | None,
        *,
        show: set[int] | None,
        after: Callable[[], None] | None = None,
        received: Callable[[list[Outcome]], None] | None = None,
    ) -> Any:
        """Run fn on `targets` (args: the same for each, or {rank: args}); `received` sees every rank's
        Outcome before errors are raised, `after` runs however the call ends.
        """
        self._check_running()
        self._call += 1
        call = self._call
        shown = {targets[0]} if show is None else show
        self._done, self._shown, self._streams, self._board = {}, shown, {}, None
        self._training, self._heard = {}, set()
        ar = self._apply_each(fn, call, args, targets, shown)
        success = False
        try:
            try:
                outcomes = self._wait(call, ar, targets, timeout if timeout is not None else self.timeout)
            finally:
                if after is not None:  # what the code bound before it failed is on the ranks too
                    after()
            if received is not None:
                received(outcomes)
            value = self._result(outcomes, targets)
            success = True
            return value
        finally:
            if self._board is not None:
                with contextlib.suppress(Exception):
                    self._board.close(success=success)
            self._flush_streams()

    def _apply_each(
        self,
        fn: Callable[..., Outcome],
        call: int,
        args: tuple | Mapping[int, tuple],
        targets: list[int],
        shown: set[int],
    ) -> _Gathered:
        value_rank = targets[0]
        results = [
            self._client[self._ranks[r].engine].apply_async(
                fn, call, *(args[r] if isinstance(args, Mapping) else args), r in shown, r == value_rank
            )
            for r in targets
        ]
        return _Gathered(results)

    def _wait(self, call: int, ar: _Gathered, targets: list[int], timeout: float | None) -> list[Outcome]:
        deadline = time.monotonic() + timeout if timeout else None
        failed_at: float | None = None
        interrupted_at: float | None = None
        hard_again = False  # ranks in Trainer.train() got the second signal that interrupts them at once
        ready_at: float | None = None
        try:
            while True:
                self._pump(0.01)
                self._check_not_gone(targets)
                unfinished = [r for r in targets if r not in self._done]
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
                    self._interrupt(unfinished)
                    interrupted_at = now
                if interrupted_at is not None and not hard_again and now - interrupted_at > _SECOND_SIGNAL_S:
                    # A peer failed, so no step will be agreed: where the first signal became a stop
                    # request (nbkit.live.stopping), a second one interrupts. Sent apart, since two
                    # signals that arrive before Python runs the handler count as one.
                    hard_again = True
                    self._interrupt([r for r in unfinished if r in self._training and self._training[r].running])
                if interrupted_at is not None and now - interrupted_at > _INTERRUPT_GRACE_S:
                    failed = sorted(r for r, d in self._done.items() if d.failed)
                    self._end(
                        f"rank(s) {_join(failed)} failed, and rank(s) {_join(unfinished)} neither finished nor "
                        f"answered an interrupt within {_INTERRUPT_GRACE_S:.0f} s (most likely waiting in a "
                        "collective for the rank that failed)."
                    )
                    raise self._call_error(ar.finished_errors(), ended=True)
                if deadline is not None and now > deadline:
                    self._end_at_timeout(timeout, unfinished, targets)
        except KeyboardInterrupt:
            self._on_interrupt(ar, targets, deadline, timeout)
            raise
        return ar.get(targets)

    def _end_at_timeout(self, timeout: float | None, unfinished: list[int], targets: list[int]) -> None:
        """End the set because the call passed its timeout; raises the LiveError that says so."""
        self._end(
            f"the call did not finish within its timeout ({timeout:g} s); rank(s) {_join(unfinished)} were still "
            f"running. {supervisor.hang_hint(self._some_ranks_hint(targets))}"
        )
        if self._ended is None:  # stop() came first, from another thread
            self._check_not_gone(targets)
        raise LiveError(self._ended_text(), ended=True, timed_out=True)

    def _some_ranks_hint(self, targets: list[int]) -> str:
        """For a call on some ranks only: the likely cause of a rank that waits ("" for a call on every rank)."""
        if len(targets) == self.world_size:
            return ""
        return (
            f"a cell run on rank(s) {_join(targets)} only called a collective (evaluate(), barrier, all_reduce) that "
            "the other ranks never join: run it on every rank (%%ddp without --rank)."
        )

    def _on_interrupt(self, ar: _Gathered, targets: list[int], deadline: float | None, timeout: float | None) -> None:
        """The notebook was interrupted during a call: stop training at an agreed step where every rank
        runs Trainer.train(), else interrupt the call on every rank; end the set where a rank does not
        answer (see the module doc). Returns when every rank has finished the call; raises LiveError
        when the set was ended.
        """
        unfinished = [r for r in targets if r not in self._done]
        self._interrupt(unfinished)
        hard = False  # a second press during a pending stop: interrupt as for any other code
        said_stopping = False
        grace_until = time.monotonic() + _INTERRUPT_GRACE_S
        while self._ended is None and not self._stopped:
            try:
                self._pump(0.01)
                if all(r in self._done for r in targets) and ar.ready():
                    if self._failed_otherwise(ar):  # a rank's own error says more than the interrupt
                        raise self._call_error(ar.finished_errors(), ended=False)
                    _log.warning(self._interrupted_text(targets, unfinished))
                    return
                now = time.monotonic()
                still = [r for r in targets if r not in self._done]
                if said_stopping and not hard and self._failed_otherwise(ar):
                    # A rank failed on its own while the stop was pending: no step will be agreed, so
                    # the ranks still training get the signal that interrupts them.
                    hard = True
                    self._interrupt(still)
                    grace_until = now + _INTERRUPT_GRACE_S
                # A rank in train() answers at the next agreed step end, however long a step takes; a
                # rank that says so only after the signal (train() just began) still counts.
                if not hard and self._all_training(ar, targets, still):
                    grace_until = now + _INTERRUPT_GRACE_S
                    if not said_stopping:
                        said_stopping = True
                        _log.warning(
                            "nbkit: stopping training at the next step that every rank agrees on (the model keeps "
                            "its weights); interrupt again to stop at once, which may end the live set."
                        )
                if deadline is not None and now > deadline:
                    self._end_at_timeout(timeout, still, targets)
                if now > grace_until:
                    failed = self._failed_otherwise(ar)
                    if failed:
                        self._end(
                            f"rank(s) {_join(failed)} failed, and rank(s) {_join(still)} neither finished nor answered "
                            f"an interrupt within {_INTERRUPT_GRACE_S:.0f} s (most likely waiting in a collective for "
                            "the rank that failed)."
                        )
                        raise self._call_error(ar.finished_errors(), ended=True)
                    self._end(self._unanswered_text(targets, still))
            except KeyboardInterrupt:
                if said_stopping and not hard:  # the stop is pending: the second press interrupts at once
                    hard = True
                    self._interrupt([r for r in targets if r not in self._done])
                    grace_until = time.monotonic() + _INTERRUPT_GRACE_S
                # else: a further press while the ranks are being interrupted
        self._check_not_gone(targets)

    def _unanswered_text(self, targets: list[int], still: list[int]) -> str:
        """Why ranks `still` did not end the call within the grace after an interrupt: the code caught the
        KeyboardInterrupt where Python saw the signal (Interrupted), else most likely a collective.
        """
        caught = [r for r in still if r in self._heard]
        deaf = [r for r in still if r not in self._heard]
        parts = []
        if caught:
            parts.append(
                f"rank(s) {_join(caught)} got the interrupt but went on running: the cell's code caught the "
                "KeyboardInterrupt (an `except KeyboardInterrupt:` or a bare `except:` that carries on). Let it "
                "propagate (re-raise it), so that the stop button ends the cell and keeps the set"
            )
        if deaf:
            hint = self._some_ranks_hint(targets)
            parts.append(
                f"rank(s) {_join(deaf)} did not answer the interrupt within {_INTERRUPT_GRACE_S:.0f} s "
                + (
                    f"(waiting in a collective, where Python never sees the signal): {hint}"
                    if hint
                    else "(most likely waiting in a collective, where Python never sees the signal)"
                )
            )
        return "; ".join(parts) + ("" if parts[-1].endswith(".") else ".")

    def _all_training(self, ar: _Gathered, targets: list[int], unfinished: list[int]) -> bool:
        """Whether a call on every rank has each unfinished rank inside Trainer.train() now, and no
        rank failed otherwise than by the agreed stop.
        """
        return (
            len(targets) == self.world_size
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

    def _interrupted_text(self, targets: list[int], unfinished: list[int]) -> str:
        stops = {self._training[r].step if r in self._training and self._training[r].stopped else -1 for r in targets}
        if len(stops) == 1 and -1 not in stops:
            step = stops.pop()
            return (
                f"nbkit: interrupted: training stopped at step {step} on every rank; the live set and its names are "
                f"kept, and the model has the weights of step {step}. trainer.train(resume_from_checkpoint=True) "
                "goes on from the last saved checkpoint."
            )
        return f"nbkit: interrupted the cell on rank(s) {_join(unfinished)}; every rank is alive with its names."

    def _result(self, outcomes: list[Outcome], targets: list[int]) -> Any:
        errors = {o.rank: o.error for o in outcomes if o.error is not None}
        if errors:
            raise self._call_error(errors, ended=False)
        value = outcomes[0].value
        if value is None:
            return None
        return rankside.load_value(value, targets[0], error=LiveError)

    def _call_error(self, errors: dict[int, RankError], *, ended: bool) -> LiveError:
        primary = {r: e for r, e in errors.items() if not e.secondary} or errors
        ranks = _join(sorted(primary))
        if ended:
            head = f"rank(s) {ranks} failed, and the live set was ended: {self._ended}"
        else:
            head = f"rank(s) {ranks} failed; the live set is still running, every rank with its names."
        lines = [head, *supervisor.render_failures(dict(sorted(primary.items())), errors.values())]
        return LiveError(
            "\n".join(lines),
            failures={r: f"{e.type}: {e.message}" for r, e in primary.items()},
            errors=errors,
            ended=ended,
        )


_STOPPED = "The live set was stopped. Start a new one (%ddp start / nbkit.start())."

# How long ranks that have not finished get after another rank failed, before they are interrupted
# (they may still be finishing on their own), and after an interrupt, before the set is ended.
_FAILURE_GRACE_S = 1.0


_INTERRUPT_GRACE_S = 2.0


_SECOND_SIGNAL_S = 0.3  # after a peer failed: when ranks in Trainer.train() get the signal that interrupts them


class _Gathered:
    """Several ipyparallel AsyncResults (one per rank, each with its own arguments) as one."""

    def __init__(self, results: list[Any]):
        self._results = results

    def ready(self) -> bool:
        return all(ar.ready() for ar in self._results)

    def get(self, ranks: list[int]) -> list[Outcome]:
        """Each rank's Outcome; an error ipyparallel itself raised (before nbkit's code ran in the
        rank) becomes that rank's Outcome with the error.
        """
        outcomes = []
        for rank, ar in zip(ranks, self._results):
            try:
                outcomes.append(ar.get())
            except Exception as exc:
                text = getattr(exc, "render_traceback", None)
                tb = "\n".join(text()) if callable(text) else str(exc)
                error = RankError(rank, type(exc).__name__, str(exc), tb, time.time())
                outcomes.append(Outcome(rank, error=error))
        return outcomes

    def finished_errors(self) -> dict[int, RankError]:
        """The errors of the ranks that have finished (the others are still running)."""
        outcomes = [ar.get() for ar in self._results if ar.ready() and ar.successful()]
        return {o.rank: o.error for o in outcomes if o.error is not None}
