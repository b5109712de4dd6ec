"""The notebook side of a live set: training processes that stay up across notebook cells.

    ranks = nbkit.start(gpus=2)              # one process per GPU (gpus=N gloo processes on a CPU)
    ranks.exec("model = load()")             # every rank; `model` stays in each rank
    ranks.exec("trainer.train()")            # a later cell, same processes, same model
    answer = ranks.exec("generate(model)", ranks=0)
    ranks.stop()

Built on ipyparallel: its controller and engines (fresh processes, not forks of the notebook, so the
notebook keeps its own GPU and may import unsloth), its apply requests and its signals. nbkit adds
one engine per GPU with its device, the torch.distributed process group, nbkit's patches, rank-0
output, the dashboard, and what happens when things go wrong:

- an exception in a call fails the call with the rank's traceback (LiveError); every rank stays up
  with its names;
- an interrupt (the notebook's stop button) interrupts the call on every rank; when a rank does not
  respond within 2 s (it waits in a collective, where Python never sees the signal) the set is ended;
- an interrupt while every rank runs Trainer.train() stops training instead, at an optimizer step
  that every rank agrees on (nbkit.rank_side.live_stopping), so that no rank is left in a collective: train()
  returns, the cell ends, the set and its names stay. A second interrupt while that stop is pending
  interrupts as above;
- a call on some ranks only (%%ddp --rank 0) that waits in a collective waits for ranks that never
  join it: the message of an interrupt or a timeout that finds it so says that this is the likely cause;
- a rank that dies (killed, segfault, OOM) ends the set within a second, naming the rank and its
  signal or exit code; a call that passes its timeout ends it too (a process group with a rank stuck
  in a collective cannot be trusted);
- nothing outlives the set: the engines and the controller end with stop(), with a failure, and with
  the notebook kernel however it ends (nbkit.live._proc); so do the processes a rank's cells start,
  which stay in the engine's process group (each engine leads one), unless they leave it on purpose.

One live set per process (per notebook). The `%ddp start|stop|status` magics are thin layers over this
module; a `%%ddp` cell reaches it through nbkit.run_cell (nbkit.notebook.run_cell).

This module runs in the notebook; LiveRanks is the API, composed of parts with one job each, each in
a module of its own (all on the notebook's side of the wire), which talk through public methods:
nbkit.live.engines (the engines from start to end: start, connect, watch, interrupt, end),
nbkit.live.sending (the names each rank holds; the notebook names a call needs, sent ahead of its code),
and per call nbkit.live.calls (one call in flight: its request, wait, interrupts, timeouts, value or
error) with nbkit.live.cell_output (what the ranks send while it runs, shown in the cell). Inside each
engine runs nbkit.rank_side.live_engine.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbkit.launching import rank_contract
from nbkit.launching.rank_options import RankOptions, check_timeout
from nbkit.live.calls import Call
from nbkit.live.engines import Engines
from nbkit.live.sending import HeldNames, refuse_notebook_only
from nbkit.messages.live import Outcome
from nbkit.notebook import cell_code, one_gpu
from nbkit.platform import distributed
from nbkit.platform.errors import LiveError
from nbkit.rank_side import live_engine

__all__ = [
    "LiveRanks",
    "LiveStatus",
    "RankStatus",
    "connect",
    "current",
    "ended",
    "forget_ended",
    "start",
    "start_with",
]


_running: LiveRanks | None = None  # the set of this process, from the moment it starts starting
_ended: LiveRanks | None = None  # the last set a failure ended, until a new one starts or forget_ended()


def current() -> LiveRanks | None:
    """The live set of this process, or None when none is running."""
    return _running


def ended() -> LiveRanks | None:
    """The live set that a failure ended (a rank died, a timeout, an unanswered interrupt), until a new
    one starts or `forget_ended()`; None otherwise. %%ddp refuses to fall back to one-shot runs while
    there is one, since its cells expect the names that lived on the ranks.
    """
    return _ended


def forget_ended() -> None:
    """Forget the set that a failure ended (what `%ddp stop` does after one)."""
    global _ended
    _ended = None


@dataclass
class RankStatus:
    """One rank of a live set, as status() sees it."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    device: str
    alive: bool


@dataclass
class LiveStatus:
    """What ranks.status() returns.

    Attributes:
        running: False once the set was stopped or ended.
        world_size: number of ranks; nnodes: number of nodes (hosts).
        ranks: one RankStatus per rank.
        ended: why the set ended, when it did not end by stop() (else None).
        names: the names the set's cells defined on the ranks.
    """

    running: bool
    world_size: int
    nnodes: int
    ranks: list[RankStatus]
    ended: str | None = None
    names: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        if not self.running and self.ended:
            return (
                f"nbkit: the live set has ended: {self.ended} Its ranks and their names are gone. %ddp start (or "
                "nbkit.start()) starts a new set: then run the cells that load the model again. %ddp stop makes "
                "%%ddp cells one-shot again."
            )
        if not self.running:
            return "nbkit: the live set was stopped; %ddp start (or nbkit.start()) starts a new one."
        lines = [f"nbkit: live set of {self.world_size} rank(s) on {self.nnodes} node(s)"]
        for r in self.ranks:
            state = "alive" if r.alive else "DEAD"
            lines.append(f"  rank {r.rank}: {r.device} on {r.host} (node {r.node_rank}), pid {r.pid}, {state}")
        if self.names:
            lines.append("  names on the ranks: " + ", ".join(self.names))
        return "\n".join(lines)


def start(
    gpus: int | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    *,
    startup_timeout: float = 180.0,
    strategy: str | None = None,
    emulate: str | None = None,
) -> LiveRanks:
    """Start a live set on this machine: one process per GPU that stays up until stopped.

    Args:
        gpus: processes to start. None: one per visible GPU. Without CUDA, gpus=N starts N CPU
            processes that train together over gloo (for tests and CI); gpus=None then raises.
        timeout: default seconds a call may take (per call: the `timeout` argument of run/exec);
            a call that passes it ends the set. None: no limit.
        env: extra environment variables for the ranks.
        startup_timeout: seconds to wait for the processes to start and join the process group.
        strategy: as for nbkit.launch ("ddp" or "fsdp"; None: "ddp"; NBKIT_STRATEGY in the ranks).
        emulate: as for nbkit.launch (NBKIT_EMULATE in the ranks; checked here).
        (gpus, timeout, env, strategy and emulate are checked as nbkit.launch checks them, with the
        same messages: nbkit.launching.rank_options.)

    Returns:
        The LiveRanks (also `nbkit.live.current()`). On a machine with one GPU it says once (an INFO
        notice, nbkit.notebook.one_gpu) what the set does there and why it still helps.

    Raises:
        LiveError: a live set is already running in this process, or the processes failed to start
            (the message holds what they printed); nothing is left running.
        OptionsError (a ValueError; OptionTypeError, a TypeError too): an option out of range or of the
            wrong type; EmulationError: emulate names no profile.
        ValueError: more GPUs are asked for than exist, or more CPU ranks than rank_contract.cpu_rank_limit().
        RuntimeError: gpus=None on a machine without a GPU.
    """
    options = RankOptions.build(gpus=gpus, timeout=timeout, env=env, strategy=strategy, emulate=emulate)
    return start_with(options, startup_timeout=startup_timeout)


def start_with(options: RankOptions, *, startup_timeout: float = 180.0) -> LiveRanks:
    """nbkit.start with its options as one value (what `%ddp start` calls); returns and raises as start does."""
    _check_none_live()
    visible = distributed.visible_gpus()
    use_cuda, count = rank_contract.count_ranks(options.gpus, visible, api="nbkit.start")
    forget_ended()
    if len(visible) == 1:  # Colab
        one_gpu.say_once("live", visible[0].name)
    ranks = LiveRanks(options)
    try:
        ranks._start_local(count, use_cuda, startup_timeout)
    except BaseException:  # an interrupt (Ctrl-C) too: every process started so far ends
        ranks._abandon(kill=True)
        raise
    return ranks


def connect(
    client: Any,
    *,
    engines: Iterable[int] | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    notebook_address: str = "127.0.0.1",
    startup_timeout: float = 180.0,
    strategy: str | None = None,
    emulate: str | None = None,
) -> LiveRanks:
    """Make a live set of ipyparallel engines started outside nbkit (several machines).

    Start a controller and engines with ipyparallel (`ipcluster start`, or `ipcontroller` and
    `ipengine` on each host, SSH/MPI/Slurm launchers), one engine per GPU. nbkit groups the engines
    by host into nodes (in the order of their engine ids), numbers the ranks node by node, puts each
    on cuda:local_rank, and holds the rendezvous on rank 0's host.

    Args:
        client: an ipyparallel Client, a Cluster (connected here), or the path of a client
            connection file (ipcontroller-client.json).
        engines: the engine ids to use (default: all registered engines).
        timeout: as for start().
        env: as for start().
        startup_timeout: as for start().
        strategy: as for start().
        emulate: as for start().
        notebook_address: the address of this machine that the engines can reach (the ranks
            send their output and dashboard events there). 127.0.0.1 when all engines run here.

    Host names: an engine's node is NBKIT_HOST in its environment where set (two engine groups on
    one machine can stand in for two hosts), else its host name; its address is NBKIT_HOST_ADDRESS
    where set, else its host name resolved.

    Returns the LiveRanks. nbkit never stops engines it did not start: stop(), a failure of
    connect() itself and a failure that ends the set (a rank died, a timeout, an unanswered
    interrupt) all leave them running, each asked to leave the process group and forget the set's
    names; an engine stuck in a collective answers only when that collective fails (gloo: its
    timeout) and is better restarted (the message says which ranks).
    """
    options = RankOptions.build(timeout=timeout, env=env, strategy=strategy, emulate=emulate)
    _check_none_live()
    forget_ended()
    import ipyparallel as ipp

    if isinstance(client, str):
        client = ipp.Client(client)
    elif isinstance(client, ipp.Cluster):
        client = client.connect_client_sync()
    ranks = LiveRanks(options)
    try:
        ranks._connect(client, list(engines) if engines is not None else None, notebook_address, startup_timeout)
    except BaseException:
        ranks._abandon(kill=False)  # those that joined the group leave it: a retry can join
        raise
    return ranks


def _check_none_live() -> None:
    running = current()
    if running is not None:
        raise LiveError(
            f"A live set of {running.world_size} rank(s) is already running in this notebook; each notebook "
            "has one. Use it (%%ddp cells, ranks.exec/run), or stop it first (%ddp stop, or "
            "nbkit.live.current().stop())."
        )


class LiveRanks:
    """A live set of training processes (see the module doc). Made by nbkit.start / nbkit.connect.

    Every call blocks until every rank it runs on has finished, shows the output of the ranks it
    shows (rank 0 by default) as it happens, feeds the ranks' reports to a dashboard, and returns
    the value of one rank (rank 0, or the lowest rank it ran on).

    Attributes:
        timeout: the default limit of each call in seconds (None: none), the `timeout` of start().
    """

    def __init__(self, options: RankOptions):
        self.timeout = options.timeout
        self._engines = Engines(options, on_failure=self._ended_by_failure)
        self._names = HeldNames(self._engines)
        self._last_call = 0  # the number of the last call (the ranks' end-of-call marks name theirs)

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self._engines.world_size

    @property
    def nnodes(self) -> int:
        """The number of nodes (hosts) the ranks run on."""
        return self._engines.nnodes

    # ------------------------------------------------------------------------------------------
    # The API
    # ------------------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Call `fn(*args, **kwargs)` on every rank; return rank 0's value.

        `fn` and its arguments travel by value (cloudpickle), so a function defined in the notebook
        works, closures and lambdas included. Raises LiveError when a rank raises (the set stays up)
        or when the set ends (a rank died, the timeout passed, an interrupt got no answer).
        """
        import cloudpickle

        timeout = check_timeout(timeout)
        payload = cloudpickle.dumps((fn, args, kwargs))
        return self._run_call(live_engine.run_function, (payload,), self._targets("all"), timeout, show=None)

    def exec(
        self,
        code: str,
        ranks: str | int | Iterable[int] = "all",
        *,
        names: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        all_ranks: bool = False,
        filename: str | None = None,
        resend: bool | Iterable[str] = False,
    ) -> Any:
        """Run `code` like a notebook cell in the namespace of each rank in `ranks`.

        Args:
            code: Python source. What it defines stays in each rank for later calls.
            ranks: "all", one rank, or several.
            names: values to define on the ranks first (cloudpickled), e.g. notebook names the code
                uses. The %%ddp magic passes what `names_for(code, user_ns)` picks. A value travels
                once: a rank that got this very object under this name in an earlier call keeps its
                copy, and it is sent again only when `names` holds another object under the name (the
                notebook rebound it). So a change made in place to an object already sent (a list
                appended to, a dict updated) does not reach the ranks: rebind the name, or pass it in
                `resend`. Functions and classes defined in the notebook are the exception: they are sent
                every time, with the notebook values they read at that moment (they are small, and a
                notebook name they read may have been rebound since).
            timeout: seconds before the set is ended (default: the set's timeout); checked as
                nbkit.start checks it.
            all_ranks: show the output of every rank it runs on (prefixed "[rank N] " but rank 0's),
                not only the lowest one's.
            filename: the name tracebacks give the code (default "<live cell N>").
            resend: names of `names` to send even where a rank holds that object already; True: all.

        Returns:
            The value of the code's last expression on the lowest rank it ran on (None without one).

        Raises:
            CellSyntaxError: the code does not parse (before anything is sent or runs).
            LiveError: the code uses IPython's own syntax (a %magic, a !command, get_ipython()), which
                exists in the notebook only (before anything is sent or runs; the set stays).
            LiveError: a rank raised (the message holds its traceback; every rank stays up with its
                names), or the set ended.
            ValueError: `ranks` names a rank the set does not have.
        """
        timeout = check_timeout(timeout)
        targets = self._targets(ranks)
        tree = cell_code.parse(code, filename or "<live cell>")
        refuse_notebook_only(code, tree)
        given = dict(names or {})
        sending = self._names.missing(targets, given, set(given) if resend is True else set(resend or ()))
        number = self._last_call + 1
        try:
            self._names.send_ahead(number, sending)
        except KeyboardInterrupt:
            self._last_call = number  # the next call has a number of its own, which no data sent here is kept for
            raise
        binds = cell_code.usage(tree.body).binds

        def received(outcomes: dict[int, Outcome]) -> None:
            for rank, o in outcomes.items():
                if o.names_loaded:  # (a name the cell bound is the rank's own value now, whatever was sent)
                    self._names.hold(rank, {n: v for n, v in sending[rank].items() if n not in binds})

        return self._run_call(
            live_engine.run_code,
            (code, filename or f"<live cell {number}>"),
            targets,
            timeout,
            show=set(targets) if all_ranks else {targets[0]},
            after=lambda: self._names.bound(targets, binds),
            received=received,
        )

    def names_for(self, code: str, namespace: Mapping[str, Any]) -> dict[str, Any]:
        """The names of `namespace` (the notebook's) that `code` reads and that must be sent along.

        A name the set's own cells defined stays the rank's (it is not sent, so the model loaded on
        the ranks is not replaced by a notebook object of the same name); other names the code reads
        and the notebook has are picked with their current notebook value (exec() then sends only
        those a rank does not hold already). Raises CellSyntaxError when the code does not parse.
        """
        return self._names.needed(code, namespace)

    def pull(self, name: str, rank: int = 0) -> Any:
        """The value of `name` on `rank` (default rank 0), brought to the notebook (tensors on the CPU)."""
        return self._run_call(live_engine.pull, (name,), self._targets(rank), None, show=set())

    def status(self) -> LiveStatus:
        """The set's ranks (rank, device, host, pid, alive) and whether it is running."""
        engines = self._engines
        running = engines.running
        rows = [
            RankStatus(
                r.rank, r.local_rank, r.node_rank, r.info.host, r.info.pid, r.device, running and engines.alive(r)
            )
            for r in engines.ranks
        ]
        return LiveStatus(running, self.world_size, self.nnodes, rows, engines.ended, sorted(self._names.defined))

    def stop(self) -> None:
        """End the set: every rank and the controller end (engines from connect() stay up). Idempotent."""
        if self._engines.running:
            self._engines.stop()
            self._names.clear()  # the notebook objects held for the ranks' copies
        self._forget()

    def __repr__(self) -> str:
        state = "running" if self._engines.running else "ended"
        return f"<nbkit LiveRanks: {self.world_size} rank(s), {state}>"

    def __enter__(self) -> LiveRanks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------
    # Its parts at work
    # ------------------------------------------------------------------------------------------
    def _start_local(self, count: int, use_cuda: bool, startup_timeout: float) -> None:
        global _running
        _running = self
        self._engines.start(count, use_cuda, startup_timeout)

    def _connect(self, client: Any, engines: list[int] | None, notebook_address: str, startup_timeout: float) -> None:
        global _running
        _running = self
        self._engines.connect(client, engines, notebook_address, startup_timeout)

    def _abandon(self, *, kill: bool) -> None:
        """A start or connect that failed: end what it started (with `kill`: at once), forget the set."""
        self._engines.stop(kill=kill)
        self._forget()

    def _ended_by_failure(self) -> None:
        """The engines' word that a failure ended the set (from the thread that saw it)."""
        global _ended
        _ended = self
        # No longer the running set from this moment: the cell that reports the end can return while this
        # thread (the monitor's, often) still stops processes, and a new set may start meanwhile. Seen:
        # nbkit.live.current() still answered the ended set, so the next cell's start was skipped.
        self._forget()
        self._names.clear()

    def _forget(self) -> None:
        global _running
        if _running is self:
            _running = None

    def _targets(self, ranks: str | int | Iterable[int]) -> list[int]:
        self._engines.check_running()
        if ranks == "all":
            return list(range(self.world_size))
        chosen: list[int] = [ranks] if isinstance(ranks, int) else sorted({int(r) for r in ranks})
        bad = [r for r in chosen if not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad or not chosen:
            raise ValueError(f"ranks must be 'all' or ranks 0..{self.world_size - 1}; got {ranks!r}.")
        return chosen

    def _run_call(
        self,
        fn: Callable[..., Outcome],
        args: tuple,
        targets: list[int],
        timeout: float | None,
        *,
        show: set[int] | None,
        after: Callable[[], None] | None = None,
        received: Callable[[dict[int, Outcome]], None] | None = None,
    ) -> Any:
        """Run fn(call, *args, shown, wants_value) on `targets` as the next call (nbkit.live.calls.Call.run)."""
        self._engines.check_running()
        self._last_call += 1
        call = Call(self._engines, self._last_call, targets, {targets[0]} if show is None else show)
        return call.run(fn, args, timeout if timeout is not None else self.timeout, after=after, received=received)


@atexit.register
def _stop_at_exit() -> None:
    running = current()
    if running is not None:
        with contextlib.suppress(Exception):
            running.stop()
