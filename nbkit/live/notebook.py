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
  that every rank agrees on (nbkit.live.stopping), so that no rank is left in a collective: train()
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
module; a `%%ddp` cell reaches it through nbkit.run_cell (nbkit.cellrun).

This module runs in the notebook; LiveRanks is the API, over its parts, each in a module of its own
(all on the notebook's side of the wire): nbkit.live.engines (start, connect, watch and end the
engines), nbkit.live.calls (one call: its request, wait, interrupts, timeouts, value or error),
nbkit.live.cell_output (what the ranks send while a call runs, shown in the cell) and
nbkit.live.sending (which notebook names travel, sent ahead of the code); nbkit.live.state holds
what they share. Inside each engine runs nbkit.live.rank_side.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbkit import cells, distributed, notebook_names, one_gpu, rankside
from nbkit.errors import LiveError
from nbkit.live import rank_side, registry
from nbkit.live.calls import Calls
from nbkit.live.cell_output import CellOutput
from nbkit.live.engines import Engines
from nbkit.live.messages import Outcome
from nbkit.live.sending import Sending, _refuse_notebook_only
from nbkit.rank_options import RankOptions, check_timeout

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


def current() -> LiveRanks | None:
    """The live set of this process, or None when none is running."""
    return registry.running


def ended() -> LiveRanks | None:
    """The live set that a failure ended (a rank died, a timeout, an unanswered interrupt), until a new
    one starts or `forget_ended()`; None otherwise. %%ddp refuses to fall back to one-shot runs while
    there is one, since its cells expect the names that lived on the ranks.
    """
    return registry.ended


def forget_ended() -> None:
    """Forget the set that a failure ended (what `%ddp stop` does after one)."""
    registry.ended = None


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
        same messages: nbkit.rank_options.)

    Returns:
        The LiveRanks (also `nbkit.live.current()`). On a machine with one GPU it says once (an INFO
        notice, nbkit.one_gpu) what the set does there and why it still helps.

    Raises:
        LiveError: a live set is already running in this process, or the processes failed to start
            (the message holds what they printed); nothing is left running.
        OptionsError (a ValueError; OptionTypeError, a TypeError too): an option out of range or of the
            wrong type; EmulationError: emulate names no profile.
        ValueError: more GPUs are asked for than exist, or more CPU ranks than rankside.cpu_rank_limit().
        RuntimeError: gpus=None on a machine without a GPU.
    """
    options = RankOptions.build(gpus=gpus, timeout=timeout, env=env, strategy=strategy, emulate=emulate)
    return start_with(options, startup_timeout=startup_timeout)


def start_with(options: RankOptions, *, startup_timeout: float = 180.0) -> LiveRanks:
    """nbkit.start with its options as one value (what `%ddp start` calls); returns and raises as start does."""
    _check_none_live()
    visible = distributed.visible_gpus()
    use_cuda, count = rankside.count_ranks(options.gpus, visible, api="nbkit.start")
    forget_ended()
    if len(visible) == 1:  # Colab
        one_gpu.say_once("live", visible[0].name)
    ranks = LiveRanks(options)
    try:
        ranks._start_local(count, use_cuda, startup_timeout)
    except BaseException:  # an interrupt (Ctrl-C) too: every process started so far ends
        ranks._stopped = True  # the monitor must not take the killed engines for a set that ended
        ranks._shutdown(kill=True)
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
        ranks._release_engines(wait=10.0)  # those that joined the group leave it: a retry can join
        ranks._shutdown(kill=False)
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


class LiveRanks(Sending, Calls, CellOutput, Engines):
    """A live set of training processes (see the module doc). Made by nbkit.start / nbkit.connect.

    Every call blocks until every rank it runs on has finished, shows the output of the ranks it
    shows (rank 0 by default) as it happens, feeds the ranks' reports to a dashboard, and returns
    the value of one rank (rank 0, or the lowest rank it ran on).
    """

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
        return self._run_call(rank_side.run_function, (payload,), self._targets("all"), timeout, show=None)

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
        tree = cells.parse(code, filename or "<live cell>")
        _refuse_notebook_only(code, tree)
        given = dict(names or {})
        forced = set(given) if resend is True else set(resend or ())
        wanted = {r: {n for n, v in given.items() if n in forced or not self._holds(r, n, v)} for r in targets}
        self._send_ahead(self._call + 1, {r: {n: given[n] for n in sorted(wanted[r])} for r in targets})
        filename = filename or f"<live cell {self._call + 1}>"
        show = set(targets) if all_ranks else {targets[0]}
        binds = cells.usage(tree.body).binds

        def received(outcomes: list[Outcome]) -> None:
            for o in outcomes:
                if o.names_loaded:
                    # (a name the cell bound is the rank's own value now, whatever was sent)
                    self._sent.setdefault(o.rank, {}).update({n: given[n] for n in wanted[o.rank] - binds})

        def after() -> None:
            self._defined.update(binds)
            for r in targets:  # a rank's own value now; a later notebook value must travel again
                for n in binds & self._sent.get(r, {}).keys():
                    del self._sent[r][n]

        value = self._run_call(
            rank_side.run_code,
            (code, filename),
            targets,
            timeout,
            show=show,
            after=after,
            received=received,
        )
        return value

    def names_for(self, code: str, namespace: Mapping[str, Any]) -> dict[str, Any]:
        """The names of `namespace` (the notebook's) that `code` reads and that must be sent along.

        A name the set's own cells defined stays the rank's (it is not sent, so the model loaded on
        the ranks is not replaced by a notebook object of the same name); other names the code reads
        and the notebook has are picked with their current notebook value (exec() then sends only
        those a rank does not hold already). Raises CellSyntaxError when the code does not parse.
        """
        return {n: namespace[n] for n in notebook_names.needed(code, namespace, kept=self._defined)}

    def pull(self, name: str, rank: int = 0) -> Any:
        """The value of `name` on `rank` (default rank 0), brought to the notebook (tensors on the CPU)."""
        return self._run_call(rank_side.pull, (name,), self._targets(rank), None, show=set())

    def status(self) -> LiveStatus:
        """The set's ranks (rank, device, host, pid, alive) and whether it is running."""
        running = not self._stopped and self._ended is None
        rows = [
            RankStatus(r.rank, r.local_rank, r.node_rank, r.info.host, r.info.pid, r.device, running and self._alive(r))
            for r in self._ranks
        ]
        return LiveStatus(running, self.world_size, self.nnodes, rows, self._ended, sorted(self._defined))

    def stop(self) -> None:
        """End the set: every rank and the controller end (engines from connect() stay up). Idempotent."""
        if self._stopped or self._ended is not None:
            self._forget()
            return
        self._stopped = True
        self._release_engines(wait=10.0)
        self._shutdown(kill=False)

    def __repr__(self) -> str:
        state = "running" if not self._stopped and self._ended is None else "ended"
        return f"<nbkit LiveRanks: {self.world_size} rank(s), {state}>"

    def __enter__(self) -> LiveRanks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@atexit.register
def _stop_at_exit() -> None:
    running = current()
    if running is not None:
        with contextlib.suppress(Exception):
            running.stop()
