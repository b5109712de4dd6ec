"""nbkit.launch: run a training function on every GPU from inside a notebook.

The processes are forked by accelerate's `notebook_launcher` (torch elastic underneath), so a
function defined in a notebook cell runs as is, closures and all. Around that launcher nbkit adds
what a notebook user needs: rank 0's return value comes back, failures raise one LaunchError that
names the rank and carries its traceback, hung runs time out, interrupts stop every rank, nothing is
left running, and the same call can run again at once.

Environment handling (each rank): RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT come from torch elastic; nbkit adds the rank environment of nbkit.launching.rank_contract (NBKIT_LAUNCHED,
NBKIT_STRATEGY, and on machines without CUDA ACCELERATE_USE_CPU and GLOO_SOCKET_IFNAME), set in this
process for the fork and put back afterwards.

Sides of the process boundary: `launch` and `_Run` (its supervisor thread) run in the notebook
process, and word failures with nbkit.launching.supervisor; `_Child` is the first code of every forked rank.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import dataclasses
import gc
import inspect
import io
import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbkit.launching import rank_contract
from nbkit.launching.rank_options import RankOptions
from nbkit.launching.supervisor import ExitStatus, exit_status, hang_hint, kill, render_failures, stop
from nbkit.messages import rank as channel
from nbkit.notebook import dashboard as dashboards
from nbkit.platform import config, distributed, forksafety, notices, patching
from nbkit.platform.config import environment
from nbkit.platform.errors import LaunchError, RankError
from nbkit.rank_side import output as rankoutput
from nbkit.rank_side.setup import prepare_rank

__all__ = ["LaunchError", "launch", "launch_with"]

# Notices about a launch (an interrupt, ranks stopped after returning): the nbkit logger shows them
# under the cell (warnings on stderr), filterable as every nbkit notice is.
_log = notices.logger(__name__)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    gpus: int | None = None,
    timeout: float | None = None,
    quiet: bool = True,
    env: Mapping[str, str] | None = None,
    dashboard: bool = True,
    strategy: str | None = None,
    emulate: str | None = None,
    **kwargs: Any,
) -> Any:
    """Run `fn(*args, **kwargs)` in one process per GPU and return rank 0's return value.

    Args:
        fn: the training function. It runs in forked processes, so it may be defined in the
            notebook and use names from earlier cells. Import CUDA-initialising libraries
            (unsloth, bitsandbytes) inside it, never before launching.
        *args: positional arguments for `fn`.
        gpus: how many processes. None: one per visible GPU. On a machine without CUDA, `gpus=N`
            runs N CPU processes that train with real gloo DDP (for tests and CI), N at most
            `nbkit.launching.rank_contract.cpu_rank_limit()`.
        timeout: seconds (a finite number > 0) after which a run whose function has not returned
            on every rank is stopped (LaunchError); None waits as long as the ranks run.
        quiet: show rank 0's output only (the default, as in %%ddp); False shows the other ranks' too,
            each line prefixed "[rank N] " (%%ddp --all-ranks).
        env: extra environment variables for the launched processes.
        dashboard: show the ranks' reports (nbkit.report, the Trainer callback that nbkit adds to
            every Trainer in the ranks) as one live panel, or text lines without a widget frontend.
        strategy: how the ranks share the model, "ddp" or "fsdp"; the ranks find it in NBKIT_STRATEGY.
            None: "ddp", except in a rank of an outside launcher, where its environment's stands.
        emulate: the name of a GPU profile the ranks emulate (NBKIT_EMULATE), or None.
        **kwargs: passed to `fn`. (Names above are taken by launch itself; pass such arguments
            to fn through `args` or functools.partial.)

    Returns:
        Rank 0's return value, sent back by pickling; tensors come back on the CPU so that the
        notebook process never initialises CUDA. Once the function has returned on every rank, the
        ranks' processes get 30 s to end (threads they started finish); one still running then is
        stopped, named in a notice on stderr, and the value is returned all the same. Process
        groups that the function destroys are kept until the rank ends (nbkit.rank_side.teardown), so a DDP
        model freed after its group cannot hang the rank at `return`.

    Raises:
        LaunchError: a rank raised, ended without returning (os._exit, a signal, an exit code), the
            run timed out, or rank 0's value could not be sent back. The message leads with the
            rank that failed first and how, and holds its traceback. Every rank is stopped and
            every resource of the launch (pipes, the rendezvous socket, threads) released first.
        OptionsError (a ValueError; OptionTypeError, a TypeError too): an option out of range or of
            the wrong type, named with what to pass (nbkit.launching.rank_options), before anything starts.
        RuntimeError / ValueError / TypeError: the run could not start (CUDA already initialised here,
            an Accelerator created here, more GPUs than exist, a function that cannot run in a
            child); nothing was started and the message says what to do.

    Inside a distributed run already (torchrun, accelerate launch, several nodes), `fn` is called
    directly on each rank and its value returned there (with NBKIT_STRATEGY / NBKIT_EMULATE set);
    the process groups still up when that process exits are destroyed then (nbkit.rank_side.teardown).

    There is no `max_restarts` (accelerate's notebook_launcher has one, tested by its
    `test_fault_tolerant`): a restart re-forks the same notebook state, so what fails on one
    machine (a bug, an OOM, a hung collective) fails again, and the user learns it only after
    every attempt has run. Training that should survive a failure resumes from its checkpoint,
    which a retry around the call does in plain sight:
    `for attempt in range(3): try: return nbkit.launch(...) except nbkit.LaunchError: ...`
    (every failed launch leaves nothing behind, so the next one starts at once).
    """
    options = RankOptions.build(
        gpus=gpus,
        timeout=timeout,
        all_ranks=not quiet,
        env=env,
        dashboard=dashboard,
        strategy=strategy,
        emulate=emulate,
    )
    return launch_with(options, fn, *args, **kwargs)


def launch_with(options: RankOptions, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """nbkit.launch with its options as one value (what nbkit.run_cell and spawn's launcher process call).

    Returns and raises as nbkit.launch does.
    """
    if distributed.is_distributed():
        _join_outside_launcher(options)
        return fn(*args, **kwargs)

    _check_function(fn)
    use_cuda, nprocs = rank_contract.count_ranks(options.gpus, distributed.visible_gpus(), api="nbkit.launch")
    rank_env = rank_contract.rank_environment(options, use_cpu=not use_cuda)
    _check_can_fork()
    run = _Run(nprocs, None, options.timeout)
    child = _Child(fn, args, kwargs, run.pipes, quiet=not options.all_ranks, use_cpu=not use_cuda)
    return _run_ranks(run, child, env=rank_env, dashboard=options.dashboard)


def _run_ranks(run: _Run, child: _Child, *, env: dict[str, str], dashboard: bool) -> Any:
    """Run the launch `run` with its dashboard; rank 0's value (see launch)."""
    board = dashboards.create(run.nprocs, enabled=dashboard)
    run.on_event = board.event if board is not None else None
    succeeded = False
    try:
        run.execute(child, env=env)
        value = run.result()
        succeeded = True
    finally:
        if board is not None:
            board.close(success=succeeded)
    return value


# --------------------------------------------------------------------------------------------
# Checks before launching: each error says what happened and what to do.
# --------------------------------------------------------------------------------------------


def _join_outside_launcher(options: RankOptions) -> None:
    """Set up this process as a rank of an outside launcher (torchrun running an exported script): what
    the launch call names is set; a strategy it leaves out stays as that launcher's environment has it.
    """
    given = options.strategy_environment()
    if options.strategy is None:
        del given[config.STRATEGY]
    os.environ.update(given)
    _prepare_rank(quiet=False, rank=distributed.rank(), descriptors=False)


def _check_function(fn: Callable[..., Any]) -> None:
    if not callable(fn):
        raise TypeError(f"nbkit.launch needs a function to run on each GPU; got {type(fn).__name__} {fn!r}.")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(
            f"{fn.__qualname__} is an async function: each launched process would only create a coroutine "
            "and never run it. Launch a plain function that calls asyncio.run(...) itself."
        )
    if inspect.isgeneratorfunction(fn):
        raise TypeError(
            f"{fn.__qualname__} is a generator function: calling it in a launched process would run none of "
            "its body. Launch a plain function (collect what you need in a list and return it)."
        )
    if "fork" not in multiprocessing.get_all_start_methods():
        raise RuntimeError(
            "nbkit.launch forks one process per GPU, and this platform cannot fork (Windows). Export the "
            "training code as a script (%nbkit export) and run it with torchrun or accelerate launch."
        )


def _check_can_fork() -> None:
    blocker = forksafety.fork_blocker()
    if blocker is not None:
        raise RuntimeError(blocker.message)


# --------------------------------------------------------------------------------------------
# The notebook side of one launch.
# --------------------------------------------------------------------------------------------

# How often the supervisor looks at the ranks: a rank that ends is named within this (plus the
# time to stop the others), far inside the 2 s a user waits before suspecting a hang.
_WATCH_INTERVAL_S = 0.05
# How long an error waits for a peer's death that caused it (see _Run._settle_errors).
_CAUSE_WINDOW_S = 0.3
# After the supervisor has stopped every rank, how long torch elastic gets to notice on its own
# (it polls every 0.1 s) before the supervisor ends its wait (see _Run._abandon_launcher).
_LAUNCHER_GRACE_S = 0.5
# How long ranks that have all returned get to end their processes (threads they started finish,
# multiprocessing's exit handlers run) before the supervisor stops those still running, keeps rank
# 0's value and says so. A rank's own ending runs no C++ destructor (os._exit) and takes well under
# a second; what remains past this is a thread that never ends or a hang at exit.
_EXIT_GRACE_S = 30.0
# How long a rank still running once torch elastic is done (interrupted, abandoned) gets between
# SIGTERM and SIGKILL. A rank ends on SIGTERM at once (it restores the default action, see _Child);
# this is for one whose own code installed a handler (a library that saves or flushes on SIGTERM),
# short enough that an interrupted cell still returns within seconds.
_LEFTOVER_GRACE_S = 5.0
# The signal number whose Python handler ends torch elastic's wait. It is never sent to any
# process: _thread.interrupt_main(signum) only runs that handler in the main thread. SIGUSR2 because
# nothing in a notebook process handles it; the handler is installed for the launch only.
_ABANDON_SIGNAL = signal.SIGUSR2


class _LauncherAbandoned(Exception):
    """Raised in the main thread to end torch elastic's wait for ranks that are all gone."""


@dataclass
class _Run:
    """One launch, seen from the notebook process.

    A supervisor thread reads the ranks' messages and watches their processes (their pids arrive
    in Started): the first rank that raises, or ends without returning for any reason (a signal,
    an exit code, os._exit, KeyboardInterrupt), is recorded as the failure, and the others are
    stopped at once. A run past its timeout is stopped the same way. Torch elastic, which forked
    the ranks, then returns; where it cannot notice (every rank ended with code 0 without a
    result, which it takes for success still in progress), the supervisor ends its wait.
    """

    nprocs: int
    on_event: Callable[[int, dict], None] | None
    timeout: float | None
    pipes: channel.Channel = field(init=False)
    pids: dict[int, int] = field(default_factory=dict)
    returned: set[int] = field(default_factory=set)
    errors: dict[int, RankError] = field(default_factory=dict)
    exits: dict[int, ExitStatus] = field(default_factory=dict)
    failed: list[int] = field(default_factory=list)  # first-hand failures, in the order they happened
    killed: set[int] = field(default_factory=set)
    payload: bytes | None = None
    lingered: set[int] = field(default_factory=set)  # returned, then stopped after _EXIT_GRACE_S
    timed_out: bool = False
    interrupted: bool = False
    stopped_at: float | None = None

    def __post_init__(self) -> None:
        self.pipes = channel.Channel(self.nprocs)
        self._lock = threading.Lock()
        self._unsettled: dict[int, float] = {}  # rank -> when its error arrived (monotonic)
        self._collected: list[int] = []  # ranks whose status torch elastic collected before nbkit read it
        self._in_launcher = False
        self._abandoned_at = -math.inf
        self._all_returned_at: float | None = None
        self.abandoned = False
        self._done = threading.Event()

    # -- the launch -------------------------------------------------------------------------
    def execute(self, child: _Child, *, env: dict[str, str]) -> None:
        """Run the ranks to completion; raise LaunchError or KeyboardInterrupt when they do not.

        Whatever happens, no rank, pipe, thread or listening socket of the launch is left behind.
        """
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        watcher = threading.Thread(target=self._watch, args=(deadline,), name="nbkit-supervisor", daemon=True)
        failure: BaseException | None = None
        launcher_failures: dict[int, ExitStatus] = {}
        watcher.start()
        froze = _freeze_existing_objects()
        try:
            with (
                environment(env),
                _loopback_rendezvous() as port,
                _elastic_quiet(),
                _kernel_signals_kept(),
                _abandon_handler(self._on_abandon),
                _launcher_banner_muted(),
            ):
                self._set_in_launcher(True)
                try:
                    _start(child, self.nprocs, port)
                finally:
                    self._set_in_launcher(False)
        except _LauncherAbandoned:
            pass
        except KeyboardInterrupt:
            self.interrupted = True
        except Exception as exc:  # ChildFailedError, SignalException, anything elastic raises
            if self.abandoned:
                pass
            elif _is_interrupt(exc):
                self.interrupted = True
            else:
                launcher_failures = _elastic_failures(exc)
                if not (self.lingered and launcher_failures.keys() <= self.lingered):
                    failure = exc
                launcher_failures = {r: s for r, s in launcher_failures.items() if r not in self.lingered}
        finally:
            self._done.set()
            watcher.join()
            self._stop_leftovers()
            self.pipes.close()
            # Torch elastic's agent, store and their threads sit in reference cycles (the store's
            # listening socket, ~17 descriptors and a thread stayed until the next collection):
            # collect them now, in this process where their threads exist.
            failure_text = f"{type(failure).__name__}: {failure}" if failure is not None else ""
            failure = None
            _collect_the_launchs_garbage(froze)
        self._conclude(launcher_failures, failure_text)

    def _conclude(self, launcher_failures: dict[int, ExitStatus], failure_text: str) -> None:
        """After every rank has ended: raise what the launch came to (KeyboardInterrupt, LaunchError),
        from what the supervisor saw and what only torch elastic saw (`launcher_failures`, its error's
        text `failure_text`); return for a launch whose every rank returned.
        """
        if self.interrupted:
            _log.warning("nbkit: interrupted; stopped ranks %s.", ", ".join(map(str, sorted(self.pids))))
            raise KeyboardInterrupt
        if self.lingered:
            _log.warning(
                "nbkit: rank(s) %s returned, but their processes were still running %g s later (a thread that does "
                "not end, or a hang at exit); nbkit stopped them and kept rank 0's value. Join the threads a "
                "function starts before it returns.",
                ", ".join(map(str, sorted(self.lingered))),
                _EXIT_GRACE_S,
            )
        for rank, status in launcher_failures.items():  # what only torch elastic saw
            if self.exits.get(rank, ExitStatus()) == ExitStatus():
                self.exits[rank] = status
        # A status torch elastic collected before the supervisor read it, without reporting it as a
        # failure, was code 0: any other code ends elastic's wait with that rank's failure.
        self.exits = {r: ExitStatus(code=0) if s == ExitStatus() else s for r, s in self.exits.items()}
        if not self.failed:
            # A rank elastic collected first, with no error of its own, ended before its peers: where every
            # failure elastic reports only says that a peer went away (gloo: "Connection reset by peer"),
            # that silent end is the cause (a rank that exited 0 mid-run lost the race to elastic).
            silent = self._silent_ends()
            reported = _first_hand(launcher_failures, self.killed)
            if silent and reported and all(r in self.errors and self.errors[r].lost_a_peer for r in reported):
                reported = []
            self.failed = reported or silent
        if self.failed:
            raise self._failure_error()
        if self.timed_out:
            raise LaunchError(
                self._timeout_message(),
                failures={r: "timed out" for r in self.pids},
                errors=self.errors,
                timed_out=True,
            )
        if failure_text:
            raise LaunchError(f"The launch failed before any rank ran: {failure_text}")

    def result(self) -> Any:
        """Rank 0's return value (after a successful execute)."""
        if self.payload is None:
            raise LaunchError("Rank 0 finished without its return value reaching the notebook.")
        return rank_contract.load_value(self.payload)

    # -- the supervisor thread --------------------------------------------------------------
    def _watch(self, deadline: float | None) -> None:
        while not self._done.is_set():
            self.pipes.receive(self._handle, timeout=_WATCH_INTERVAL_S)
            self._check_exits(drain=True)
            if len(self.returned) == self.nprocs:
                self._stop_lingering()
            elif deadline is not None and time.monotonic() > deadline and self.stopped_at is None:
                self.timed_out = True
                self._stop_ranks()
            self._settle_errors(time.monotonic() - _CAUSE_WINDOW_S)
            if self.stopped_at is not None and time.monotonic() - self.stopped_at > _LAUNCHER_GRACE_S:
                self._stop_ranks(failed_too=True)  # a failed rank that hangs on its way out
                self._abandon_launcher()
        # What the ranks wrote before they ended, and how they ended, now that all have.
        self._check_exits(drain=True)
        self._settle_errors(math.inf)

    def _handle(self, message: channel.Envelope) -> None:
        rank, body = message.rank, message.body
        if isinstance(body, channel.Started):
            self.pids[rank] = body.pid
            if self.stopped_at is not None:  # started after the run was stopped
                self.killed.add(rank)
                kill(body.pid, signal.SIGKILL)
        elif isinstance(body, channel.Returned):
            self.returned.add(rank)
        elif isinstance(body, channel.Result):
            self.payload = body.payload
        elif isinstance(body, channel.Raised):
            if rank in self.errors:
                return
            if self.stopped_at is not None:  # caused by the stop (or an interrupt), not a cause
                self.errors[rank] = dataclasses.replace(body.error, secondary=True)
                return
            self.errors[rank] = body.error
            self._unsettled[rank] = time.monotonic()
        elif isinstance(body, channel.Report) and self.on_event is not None:
            try:
                self.on_event(rank, body.metrics)
            except Exception:  # a display problem must never take the training run down
                _log.exception("nbkit: the event handler failed")

    def _check_exits(self, *, drain: bool) -> None:
        """Record ranks that ended without returning; a rank's first-hand end is a failure."""
        ended = {}
        for rank, pid in self.pids.items():
            if rank not in self.exits and rank not in self.returned:
                status = exit_status(pid)
                if status is not None:
                    ended[rank] = status
        if not ended:
            return
        if drain:  # messages a rank wrote before it ended (its Raised, its Returned) come first
            self.pipes.receive(self._handle, timeout=0)
        # torch elastic answers one rank's failure with SIGTERM to the others: those come last.
        for rank, status in sorted(ended.items(), key=lambda item: item[1].signal == signal.SIGTERM):
            if rank in self.returned or rank in self.exits:
                continue
            self.exits[rank] = status
            if status == ExitStatus():
                # Torch elastic collected it first: after stopping the others for one rank's failure
                # (then every status is unknown here, in no telling order: 2 GPUs, a rank's NCCL
                # watchdog abort took the blame to its sleeping peer), or a rank's code 0. Elastic's
                # report decides which (_conclude); the other ranks stop now either way.
                self._collected.append(rank)
                if rank not in self.errors:
                    self._stop_ranks()
                continue
            # Once a rank exited with an error, torch elastic stops the others with SIGTERM and
            # collects their status (unknown here): such ends are consequences, not causes. An error
            # that only says a peer went away is no such failure: this end is what it reports.
            by_elastic = status.signal == signal.SIGTERM
            others_failed = any(r != rank for r in self.failed) or any(
                r != rank and not e.lost_a_peer for r, e in self.errors.items()
            )
            consequence = rank in self.killed or (by_elastic and others_failed)
            if rank not in self.errors and not consequence and self.stopped_at is None:
                self._fail(rank)

    def _silent_ends(self) -> list[int]:
        """Ranks that ended without an error of their own, their status collected by torch elastic first."""
        return [r for r in self._collected if r not in self.errors and r not in self.killed]

    def _settle_errors(self, arrived_before: float) -> None:
        """Decide about the errors that arrived before `arrived_before` (monotonic time).

        A rank whose peer dies raises moments later (gloo: "Connection closed by peer"), and its
        error can reach the notebook before the dead peer's process is seen to have ended: an
        error waits _CAUSE_WINDOW_S for such a death, which is then the cause, and the error a
        consequence. The first error without a death before it is the failure; errors after it
        are its consequences too (the peers of a rank that raised lose it in their next collective).
        An error that says a peer went away is also a consequence where a rank ended silently, its
        status collected by torch elastic first (a rank that exited 0): _conclude names that rank.
        """
        for rank, arrived in sorted(self._unsettled.items(), key=lambda item: item[1]):
            if arrived >= arrived_before:
                break
            del self._unsettled[rank]
            if self.failed or (self.errors[rank].lost_a_peer and self._silent_ends()):
                self.errors[rank] = dataclasses.replace(self.errors[rank], secondary=True)
            else:
                self._fail(rank)

    def _fail(self, rank: int) -> None:
        if rank not in self.failed:
            self.failed.append(rank)
        self._stop_ranks()

    def _stop_ranks(self, *, failed_too: bool = False) -> None:
        """Stop every rank still running (SIGKILL: a rank blocked in a collective sits in C code).

        A rank that failed itself is left to end on its own (its output flushed) unless `failed_too`.
        """
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
        for rank, pid in self.pids.items():
            if rank in self.exits or (rank in self.failed and not failed_too):
                continue
            if exit_status(pid) is None:
                self.killed.add(rank)
                kill(pid, signal.SIGKILL)

    def _stop_lingering(self) -> None:
        """Every rank returned: stop those whose processes have not ended within _EXIT_GRACE_S.

        Torch elastic waits for every process to end and reports one that was killed as failed;
        execute() keeps the value (the function returned on every rank) and names the ranks.
        """
        now = time.monotonic()
        if self._all_returned_at is None:
            self._all_returned_at = now
        if self.stopped_at is not None or now - self._all_returned_at < _EXIT_GRACE_S:
            return
        self.lingered = {rank for rank, pid in self.pids.items() if exit_status(pid) is None}
        self._stop_ranks(failed_too=True)  # sets stopped_at: torch elastic's wait is ended if need be

    def _abandon_launcher(self) -> None:
        """End torch elastic's wait once every rank is gone after a stop.

        Torch elastic takes a rank that ended with code 0 for one whose return value is still on
        its way, so a launch whose ranks all ended that way (os._exit(0), or one rank doing it)
        would wait forever. The supervisor runs a handler in the main thread that raises there.
        """
        if len(self.pids) < self.nprocs or any(exit_status(pid) is None for pid in self.pids.values()):
            return
        now = time.monotonic()
        with self._lock:
            if self._in_launcher and now - self._abandoned_at > _LAUNCHER_GRACE_S:
                self._abandoned_at = now  # asked again a while later should the first ask be swallowed
                self.abandoned = True
                _thread.interrupt_main(_ABANDON_SIGNAL)

    def _set_in_launcher(self, value: bool) -> None:
        with self._lock:
            self._in_launcher = value

    def _on_abandon(self) -> None:
        """The abandon handler, in the main thread: raise only while torch elastic still waits."""
        if self._in_launcher:
            raise _LauncherAbandoned

    # -- stopping ---------------------------------------------------------------------------
    def _stop_leftovers(self) -> None:
        """Make sure no rank outlives the launch, nor stays as a zombie once torch elastic is done:
        SIGTERM, up to _LEFTOVER_GRACE_S, then SIGKILL; every rank's process collected.
        """
        stop(self.pids, _LEFTOVER_GRACE_S)

    # -- messages ---------------------------------------------------------------------------
    def _timeout_message(self) -> str:
        return (
            f"The launch did not finish within the timeout ({self.timeout:g} s); all {self.nprocs} ranks "
            f"were stopped. {hang_hint()}"
        )

    def _failure_error(self) -> LaunchError:
        failures: dict[int, str] = {}
        for rank in self.failed:
            err = self.errors.get(rank)
            failures[rank] = f"{err.type}: {err.message}" if err is not None else str(self.exits.get(rank, ""))
        heads = [
            f"rank {r} failed" if r in self.errors else f"rank {r} {self.exits.get(r, ExitStatus())}" for r in failures
        ]
        launched = (
            "1 process launched" if self.nprocs == 1 else f"{self.nprocs} processes launched; the others were stopped"
        )
        lines = [f"{', then '.join(heads)} ({launched})."]
        lines += render_failures(
            {r: self.errors.get(r) or self.exits.get(r, ExitStatus()) for r in failures}, self.errors.values()
        )
        after = [e for r, e in sorted(self.errors.items()) if r not in failures and e.secondary]
        for err in after:
            first = err.message.strip().splitlines()[0] if err.message.strip() else ""
            lines.append(f"\n(then rank {err.rank} raised {err.type}: {first})")
        return LaunchError("\n".join(lines), failures=failures, errors=self.errors)


def _elastic_failures(failure: BaseException) -> dict[int, ExitStatus]:
    """{rank: how it ended} from torch elastic's ChildFailedError."""
    described: dict[int, ExitStatus] = {}
    for rank, proc in getattr(failure, "failures", {}).items():
        if proc.exitcode is not None and proc.exitcode < 0:
            described[rank] = ExitStatus(signal=-proc.exitcode)
        else:
            described[rank] = ExitStatus(code=proc.exitcode)
    return described


def _first_hand(failures: dict[int, ExitStatus], killed: set[int]) -> list[int]:
    """The ranks of torch elastic's report that failed on their own: not stopped by nbkit (`killed`),
    and, where any other is there, not ended by the SIGTERM elastic stops the rest with.
    """
    own = [rank for rank in failures if rank not in killed]
    return [rank for rank in own if failures[rank].signal != signal.SIGTERM] or own


def _is_interrupt(exc: BaseException) -> bool:
    """Torch elastic turns SIGINT into SignalException while its handlers are installed."""
    sigval = getattr(exc, "sigval", None)
    return sigval is not None and sigval in (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _abandon_handler(handler: Callable[[], None]) -> Iterator[None]:
    """Run `handler` in the main thread when the supervisor asks (see _Run._abandon_launcher)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread: a launch from another one cannot be ended early
        return
    previous = signal.signal(_ABANDON_SIGNAL, lambda signum, frame: handler())
    try:
        yield
    finally:
        signal.signal(_ABANDON_SIGNAL, previous)


@contextlib.contextmanager
def _launcher_banner_muted() -> Iterator[None]:
    """Drop what this thread prints while the launcher runs (notebook_launcher's "Launching
    training on N GPUs." line) and nothing else: other threads of the notebook process keep
    printing (a global redirect lost their output), and the ranks restore their streams.
    """
    stream = sys.stdout
    muted = _MutedInThread(stream, threading.get_ident())
    _MUTED_KEPT.append(muted)
    sys.stdout = muted
    try:
        yield
    finally:
        sys.stdout = stream


# print() reads sys.stdout without taking a reference (CPython issue 130163), so a thread inside print() when
# the launch puts the stream back may still write through the wrapper. Freed at that moment, it was written through
# after its memory was gone, and a later gc.collect() crashed on what that left (1 run in ~150-700 of a test whose
# thread prints every 50 ms). So the last wrapper stays alive until the next launch replaces it.
_MUTED_KEPT: collections.deque[_MutedInThread] = collections.deque(maxlen=1)


class _MutedInThread(io.TextIOBase):
    """`target`, except that writes from thread `ident` are dropped."""

    def __init__(self, target: Any, ident: int):
        self._target, self._ident = target, ident

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if threading.get_ident() != self._ident:
            self._target.write(text)
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def fileno(self) -> int:
        return self._target.fileno()


@contextlib.contextmanager
def _loopback_rendezvous() -> Iterator[int]:
    """A rendezvous store that listens on 127.0.0.1 only, on a fresh port, for one launch.

    torch's TCPStore server binds every interface whatever host it is given, but it accepts an
    already-listening socket, and torch elastic's static rendezvous asks for a multi-tenant store,
    which reuses a server this process already runs on the same port. So the launch's store is
    ours, bound to loopback. A new port each time: a re-run right after a failure never meets
    "address already in use".
    """
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, multi_tenant=True, master_listen_fd=sock.detach(), wait_for_workers=False
    )  # the store owns the fd now
    try:
        yield port
    finally:
        del store


@contextlib.contextmanager
def _elastic_quiet() -> Iterator[None]:
    """Torch elastic logs every failure at length; nbkit reports it once, as a LaunchError.

    Its module loggers set their own level (torch.distributed.elastic.utils.logging), so quieting the
    package's logger alone left "Received 2 death signal, shutting down workers" in the notebook on
    an interrupt: every logger under the two packages is quieted, once the launcher's modules (which
    create theirs on import) are imported.
    """
    import torch.distributed.launcher.api  # noqa: F401

    roots = ("torch.distributed.elastic", "torch.multiprocessing")
    names = [name for name in logging.root.manager.loggerDict if name.startswith(tuple(f"{r}." for r in roots))]
    with notices.quieted([logging.getLogger(name) for name in (*roots, *names)], logging.CRITICAL):
        yield


_HANDLED_SIGNALS = [s for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, s)]


@contextlib.contextmanager
def _kernel_signals_kept() -> Iterator[None]:
    """Torch elastic installs its own SIGINT/SIGTERM handlers and never restores them, which
    would change how the kernel reacts to the next interrupt; put the kernel's back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {name: signal.getsignal(getattr(signal, name)) for name in _HANDLED_SIGNALS}
    try:
        yield
    finally:
        for name, handler in saved.items():
            if handler is not None:
                signal.signal(getattr(signal, name), handler)


def _freeze_existing_objects() -> bool:
    """Set the notebook's objects aside for the launch's collection (gc.freeze), unless something froze objects
    already (then the collection walks what is not frozen, as before); returns whether it did. Only objects made
    during a launch form the cycles it must collect (torch elastic's), and a full collection in a notebook that
    holds a model and its libraries walks ~500,000 objects: 0.27 s after every launch on 2 cores.
    """
    if gc.get_freeze_count():
        return False
    gc.freeze()
    return True


def _collect_the_launchs_garbage(froze: bool) -> None:
    """Collect the garbage made during the launch, then put back what _freeze_existing_objects set aside."""
    gc.collect()
    if froze:
        gc.unfreeze()


@patching.patch(
    "accelerate.launchers:are_libraries_initialized",
    reason="notebook_launcher refuses to fork once bitsandbytes is merely imported, and peft imports it "
    "wherever it is installed (Kaggle), so `import peft` in a notebook blocked every launch. The "
    "real hazard is a CUDA context in the parent, which nbkit checks itself (forksafety.fork_blocker).",
    upstream="https://github.com/huggingface/accelerate/issues/1807",
    group="launch",
)
def _fork_hazards_are_checked_by_nbkit(original: Callable[..., list[str]]) -> Callable[..., list[str]]:
    def are_libraries_initialized(*names: str) -> list[str]:
        return [name for name in original(*names) if name != "bitsandbytes"]

    return are_libraries_initialized


@patching.patch(
    "torch.distributed.launcher.api:LaunchConfig.__post_init__",
    reason="torch elastic's default log specs create a torchelastic_* directory in the temporary directory for "
    "every launch and never remove it (measured: one per nbkit.launch, error files inside after a failure); "
    "notebook_launcher offers no way to pass log specs. nbkit's ranks report through their own pipes and "
    "print to the notebook, so the launch gets log specs with log_dir=os.devnull, which torch documents as "
    "writing no files.",
    upstream="none filed yet: torch/distributed/elastic/multiprocessing/api.py DefaultLogsSpecs(log_dir=None) "
    "calls tempfile.mkdtemp(prefix='torchelastic_'); accelerate's notebook_launcher builds LaunchConfig "
    "without logs_specs",
    group="launch",
)
def _no_elastic_log_directory(original: Callable[..., None]) -> Callable[..., None]:
    def __post_init__(self: Any) -> None:
        if self.logs_specs is None:
            from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

            self.logs_specs = DefaultLogsSpecs(log_dir=os.devnull)
        original(self)

    return __post_init__


def _start(child: _Child, nprocs: int, port: int) -> None:
    patching.apply("launch")
    try:
        _start_ranks(child, nprocs, port)
    finally:
        patching.revert("launch")


def _start_ranks(child: _Child, nprocs: int, port: int) -> None:
    if nprocs > 1:
        from accelerate import notebook_launcher

        notebook_launcher(child, num_processes=nprocs, use_port=str(port), master_addr="127.0.0.1")
        return
    # notebook_launcher runs a single process inside the notebook itself, which would create the
    # CUDA context and an Accelerator here and make every later launch fail; fork one rank instead.
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=1,
        run_id="nbkit",
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"rank": 0},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="fork",
    )
    elastic_launch(config=config, entrypoint=child)()


# --------------------------------------------------------------------------------------------
# The rank side: what runs first in every forked process.
# --------------------------------------------------------------------------------------------


class _Child:
    """The function notebook_launcher forks: sets the rank up, runs fn, reports back."""

    def __init__(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, chan: channel.Channel, *, quiet: bool, use_cpu: bool
    ):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.channel, self.quiet, self.use_cpu = chan, quiet, use_cpu
        # The notebook's streams, taken before launch() hides the launcher's own banner.
        self.stdout, self.stderr = sys.stdout, sys.stderr
        # torch elastic names the run after the entrypoint
        self.__name__ = self.__qualname__ = getattr(fn, "__name__", "fn")

    def __call__(self) -> None:
        rank, local_rank = distributed.rank(), distributed.local_rank()
        # Never run the destructors of objects inherited from the notebook (C++ objects whose
        # threads were not forked abort the process when collected here).
        gc.freeze()
        die_with_parent()
        # Default signal behaviour: torch elastic's handlers (inherited through fork) would turn
        # SIGTERM into an exception that a rank blocked in a collective never gets to raise.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(_ABANDON_SIGNAL, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdout, sys.stderr = self.stdout, self.stderr
        self.channel.attach(local_rank, rank)
        channel.send(channel.Started(os.getpid()))
        rank_contract.set_rank_threads(
            use_cuda=not self.use_cpu, local_world_size=distributed.world_size(), forked=True
        )
        output = None
        try:
            output = _prepare_rank(quiet=self.quiet, rank=rank, descriptors=True)
            value = self.fn(*self.args, **self.kwargs)
            if rank == 0:
                channel.send(channel.Result(rank_contract.pickle_for_notebook(value)))
            channel.send(channel.Returned())
        except BaseException as exc:
            channel.send(
                channel.Raised(
                    RankError(
                        rank=rank,
                        type=type(exc).__qualname__,
                        message=str(exc),
                        traceback=rank_contract.rank_traceback(exc),
                        time=time.time(),
                    )
                )
            )
            # The notebook has the error now. End with code 1 rather than re-raising: torch would
            # write the traceback to a pytorch-errorfile-* left in the temporary directory, and
            # turn KeyboardInterrupt into code 0, which torch elastic takes for a rank whose
            # result is on its way.
            raise SystemExit(1) from exc
        finally:
            # The process ends with os._exit: what C code printed to a piped stdout (a kernel's) sits
            # in libc's buffer, and a routed rank's reader threads hold what they have not passed on.
            if output is not None:
                output.drain()
            else:
                rankoutput.flush_c_streams()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()


def _prepare_rank(*, quiet: bool, rank: int, descriptors: bool) -> rankoutput.RankOutput | None:
    """Per-rank set-up shared by forked ranks and ranks of an outside launcher (`descriptors`
    False: that launcher owns them, and the process's exit); returns the rank's routed output, if it
    has one to drain.
    """
    rankoutput.write_whole_lines()  # ranks that share a stdout (a script's, torchrun's) keep lines whole
    output = rankoutput.route_launched(rank, quiet, sys.stdout, sys.stderr, descriptors=descriptors)
    prepare_rank(owns_exit=descriptors)
    return output


def die_with_parent() -> None:
    """If the notebook kernel dies, take this rank down too (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
