"""The engines of a live set, from start to end (the notebook side): start-up step by step, the processes
nbkit started and their process groups, the relay's own messages (a rank connected, a connection lost),
interrupts, a failure that ends the set, and what is left when it ends.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from nbkit.launching import rank_contract, supervisor
from nbkit.launching.rank_options import RankOptions
from nbkit.live.relay import Relay
from nbkit.messages import rank as channel
from nbkit.messages.live import EngineInfo, Lost, RankPlan
from nbkit.platform import config
from nbkit.platform.errors import LiveError
from nbkit.rank_side import live_engine

__all__ = ["Engines", "Rank", "ranks_text"]


@dataclass
class Rank:
    """One rank of a live set: its numbers, its ipyparallel engine, and its process where nbkit started it."""

    rank: int
    local_rank: int
    node_rank: int
    engine: int
    info: EngineInfo
    device: str = "?"
    process: subprocess.Popen | None = None  # engines nbkit started (start(), not connect())


def ranks_text(ranks: Iterable[int]) -> str:
    """'0, 1' (or 'none'): ranks as the messages name them."""
    return ", ".join(str(r) for r in ranks) or "none"


class Engines:
    """The engines of one live set: start them (nbkit.start) or connect to them (nbkit.connect), watch them,
    run a function on one, interrupt them, and end them, after a failure or by stop().

    `on_failure` is called once when a failure ends the set (a rank died, a timeout, an unanswered
    interrupt), from the thread that saw it (the monitor's or the notebook's), once the reason is recorded
    and before the processes stop.
    """

    def __init__(self, options: RankOptions, on_failure: Callable[[], None]):
        self._options = options  # how the ranks are set up (gpus, env, strategy, emulate)
        self._on_failure = on_failure
        self.world_size = 0
        self.nnodes = 0
        self.ranks: list[Rank] = []
        self.relay: Relay | None = None  # the ranks' connections back to the notebook
        self.tmpdir: str | None = None  # the set's folder (nbkit's engines: the ipyparallel profile, each rank's log)
        self._client: Any = None
        self._cluster: Any = None
        self._owned = False  # whether nbkit started the engines (start) or found them (connect)
        self._ended: str | None = None
        self._ended_log = ""  # the tail of a dead rank's own output, when it left one
        self._stopped = False
        self._lock = threading.Lock()
        self._processes: list[subprocess.Popen] = []  # engines nbkit started, from the moment each starts
        self._connected: set[int] = set()  # ranks whose relay connection is up (start-up step 2)

    @property
    def ended(self) -> str | None:
        """Why a failure ended the set (a sentence), or None: it runs, or stop() ended it."""
        return self._ended

    @property
    def stopped(self) -> bool:
        """Whether stop() ended the set (a failed start counts)."""
        return self._stopped

    @property
    def running(self) -> bool:
        """Whether calls can run: neither stop() nor a failure ended the set."""
        return not self._stopped and self._ended is None

    def start(self, count: int, use_cuda: bool, startup_timeout: float) -> None:
        """Start `count` engines on this machine and make them ranks; raises LiveError (see nbkit.start)."""
        import ipyparallel as ipp

        self._owned = True
        _remove_orphaned_dirs()
        self.tmpdir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        parent = str(os.getpid())
        self._cluster = ipp.Cluster(
            profile_dir=self.tmpdir,
            cluster_id="nbkit",
            controller_ip="127.0.0.1",
            log_level=logging.WARNING,
            shutdown_atexit=False,  # nbkit's own atexit handler, and _proc, end it
            cluster_file="",
            load_profile=False,
        )
        try:
            with _interrupt_held():
                self._cluster.start_controller_sync(controller_cmd=_controller_command(parent))
            self._client = self._cluster.connect_client_sync()
        except BaseException as exc:  # an interrupt (the stop button) too
            _finalise_abandoned(exc)
            raise
        with open(self._cluster.controller.connection_files["engine"]) as f:
            engine_info = f.read()
        self.relay = Relay("127.0.0.1")
        engine_env = {**os.environ, "IPP_CONNECTION_INFO": engine_info, "PYTHONUNBUFFERED": "1"}
        cmd = [
            sys.executable,
            "-m",
            "nbkit.live._proc",
            parent,
            "ipyparallel.engine",
            f"--profile-dir={self.tmpdir}",
            "--cluster-id=nbkit",
            "--log-level=ERROR",  # its start-up warnings would bury what a crashing rank wrote
            # No nanny process per engine: nbkit signals its engines by pid and watches them itself,
            # and a nanny notices its engine's end only later (it outlived stop() by up to a second).
            "--IPEngine.enable_nanny=False",
            # each check waits a beat and 0.5 s (ipyparallel's rule)
            f"--IPEngine.max_heartbeat_misses={175_000 // (_HEARTBEAT_MS + 500)}",
        ]
        # Kept on self as each starts: an interrupt or a failure while they start must end them all.
        processes = self._processes
        for i in range(count):
            log_path = os.path.join(self.tmpdir, f"rank{i}.log")
            with open(log_path, "wb") as log, _interrupt_held():
                processes.append(
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env={**engine_env, config.SETTINGS["live_log"].env: log_path},
                        start_new_session=True,
                    )  # interrupts come from nbkit
                )
        found = _wait_for_engines(self._client, startup_timeout, processes, self.tmpdir)
        # rank i = the i-th engine started, so rank i's log is rank{i}.log
        self.ranks = [
            Rank(rank=i, local_rank=i, node_rank=0, engine=eid, info=info, process=processes[i])
            for i, (eid, info) in sorted(found.items())
        ]
        self.world_size, self.nnodes = count, 1
        threading.Thread(target=self._monitor, name="nbkit-live-monitor", daemon=True).start()
        port = live_engine.free_port("127.0.0.1")
        self._setup_ranks("127.0.0.1", port, use_cuda, startup_timeout)

    def connect(self, client: Any, engines: list[int] | None, notebook_address: str, startup_timeout: float) -> None:
        """Make ranks of the engines `engines` (None: all) of `client`; raises LiveError (see nbkit.connect)."""
        self._client = client
        ids = sorted(engines if engines is not None else client.ids)
        if not ids:
            raise LiveError("No ipyparallel engines are registered with this controller; start them first (ipengine).")
        infos = _identify(client, ids, startup_timeout)
        hosts: dict[str, list[tuple[int, EngineInfo]]] = {}
        for eid, info in zip(ids, infos):
            hosts.setdefault(info.host, []).append((eid, info))
        use_cuda = all(info.gpus > 0 for info in infos)
        rank = 0
        for node_rank, members in enumerate(hosts.values()):
            for local_rank, (eid, info) in enumerate(members):
                if use_cuda and local_rank >= info.gpus:
                    raise LiveError(
                        f"Host {info.host} runs {len(members)} engines but shows {info.gpus} GPU(s); start one "
                        "engine per GPU there."
                    )
                self.ranks.append(Rank(rank, local_rank, node_rank, eid, info))
                rank += 1
        self.world_size, self.nnodes = rank, len(hosts)
        self.relay = Relay(notebook_address)
        master = self.ranks[0]
        port = (
            client[master.engine].apply_async(live_engine.free_port, master.info.address).get(timeout=startup_timeout)
        )
        self._setup_ranks(master.info.address, port, use_cuda, startup_timeout)

    def _setup_ranks(
        self,
        master_addr: str,
        port: int,
        use_cuda: bool,
        startup_timeout: float,
    ) -> None:
        assert self.relay is not None
        from nbkit.notebook import dashboard

        # How this notebook shows the dashboard: the ranks print Trainer's log lines only without a live panel.
        env = {
            "NBKIT_DASHBOARD": dashboard.display_mode(),
            **rank_contract.rank_environment(
                self._options, use_cpu=not use_cuda, loopback=master_addr in ("127.0.0.1", "localhost")
            ),
        }
        local_sizes: dict[int, int] = {}
        for r in self.ranks:
            local_sizes[r.node_rank] = local_sizes.get(r.node_rank, 0) + 1
        results = []
        for r in self.ranks:
            plan = RankPlan(
                rank=r.rank,
                local_rank=r.local_rank,
                world_size=self.world_size,
                local_world_size=local_sizes[r.node_rank],
                node_rank=r.node_rank,
                nnodes=self.nnodes,
                master_addr=master_addr,
                master_port=port,
                relay=self.relay.address,
                authkey=self.relay.authkey,
                use_cuda=use_cuda,
                owned=self._owned,
                env=env,
            )
            results.append(self._client[r.engine].apply_async(live_engine.setup, plan))
        connecting = _Arrivals(range(self.world_size), startup_timeout, step=2)
        joining = _Arrivals(range(self.world_size), startup_timeout, step=3)
        while not all(ar.ready() for ar in results):
            self.pump(0.05)
            if self._ended is not None:
                raise LiveError(f"The live set could not start: {self._ended}")
            connecting.arrived(self._connected)
            joining.arrived(r.rank for r, ar in zip(self.ranks, results) if ar.ready())
            missing = connecting.overdue() or joining.overdue()
            if missing:
                step = connecting if connecting.overdue() else joining
                pids = [r.process for r in self.ranks]
                raise LiveError(step.text(missing, pids) + "\n" + _log_tail(self.tmpdir, missing[0]))
        for r, ar in zip(self.ranks, results):
            try:
                r.device = ar.get()
            except Exception as exc:
                raise LiveError(f"Rank {r.rank} failed to start: {exc}") from None

    def pump(self, wait: float, handle: Callable[[channel.Envelope], None] | None = None) -> None:
        """Handle the relay's messages for up to `wait` s, on the calling thread (the notebook's main thread,
        so that output and the dashboard land in the cell that runs): a rank that connected and a lost
        connection (which ends the set) here, every other message by `handle` (dropped without one).
        """
        assert self.relay is not None
        try:
            item = self.relay.messages.get(timeout=wait)
        except queue.Empty:
            return
        while True:
            body: object = item.body
            if isinstance(body, Lost):
                self._on_lost(body)
            elif isinstance(body, channel.Started):
                self._connected.add(item.rank)
            elif handle is not None:
                handle(item)
            try:
                item = self.relay.messages.get_nowait()
            except queue.Empty:
                return

    def apply(self, rank: int, fn: Callable[..., Any], *args: Any) -> Any:
        """Queue fn(*args) on `rank`'s engine; returns ipyparallel's AsyncResult."""
        return self._client[self.ranks[rank].engine].apply_async(fn, *args)

    def abort(self, pending: list[Any], ranks: Iterable[int]) -> None:
        """Abort the requests `pending` (AsyncResults of apply) not yet run on `ranks`, without waiting."""
        with contextlib.suppress(Exception):
            self._client.abort(pending, targets=[self.ranks[r].engine for r in ranks], block=False)

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to what runs on `ranks` (nbkit's engines by pid, others through the controller)."""
        if self._owned:
            for r in ranks:
                proc = self.ranks[r].process
                if proc is not None and proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGINT)
        elif ranks:
            with contextlib.suppress(Exception):
                self._client.send_signal("SIGINT", targets=[self.ranks[r].engine for r in ranks], block=False)

    def check_running(self) -> None:
        """Raise the LiveError of a set that ended (a failure, or stop()): nothing runs on it any more."""
        if self._ended is not None:
            raise LiveError(
                f"The live set has ended: {self._ended} Start a new one (%ddp start / nbkit.start()).", ended=True
            )
        if self._stopped:
            raise LiveError(_STOPPED, ended=True)

    def check_not_gone(self, ranks: list[int]) -> None:
        """Raise the LiveError of a set that a failure ended or that stop() ended (from any thread) while
        a call on `ranks` waited: the call cannot finish, and waiting would hang.
        """
        if self._ended is not None:
            raise LiveError(self.ended_text(), ended=True)
        if self._stopped:
            raise LiveError(
                f"LiveRanks.stop() ended the live set while this call ran on rank(s) {ranks_text(ranks)}: its "
                f"ranks are gone, and the call did not finish. {_STOPPED}",
                ended=True,
            )

    def ended_text(self) -> str:
        """The message of a set that a failure ended: why, what was done with the engines, what to do."""
        log = f"\n{self._ended_log}" if self._ended_log else ""
        if not self._owned:
            return (
                f"The live set has ended: {self._ended} Its engines were started outside nbkit and are left "
                "running, each asked to leave the process group; one that waits in a collective answers only "
                "when the collective fails, so restart those engines before nbkit.connect() again." + log
            )
        return (
            f"The live set has ended: {self._ended} Every rank was stopped; start a new set with %ddp start "
            "(or nbkit.start())." + log
        )

    def alive(self, r: Rank) -> bool:
        """Whether rank `r`'s process runs (nbkit's engines), or its engine is registered (others)."""
        if r.process is not None:
            return r.process.poll() is None
        return r.engine in (self._client.ids if self._client is not None else [])

    def end(self, reason: str) -> None:
        """End the set after a failure: record why, then stop everything, killing what is left. Once only;
        nothing after stop().
        """
        with self._lock:
            if self._ended is not None or self._stopped:
                return
            self._ended = reason
        self._on_failure()
        if not self._owned and self._client is not None:
            # Engines started outside nbkit stay up: what still runs there is interrupted, then each
            # leaves the broken process group (queued behind a call that waits in a collective).
            alive = [r.rank for r in self.ranks if r.engine in self._client.ids]
            self.interrupt(alive)
            self._release_engines(wait=None)
        self._shutdown(kill=True)

    def stop(self, *, kill: bool = False) -> None:
        """End the set on purpose (stop(), or a start that failed): engines nbkit started end (SIGTERM, then
        SIGKILL after a grace; at once with `kill`), others are asked to leave the process group (waiting
        up to 10 s for their answers) and stay up.
        """
        self._stopped = True  # first: the monitor must not take the engines that end here for a failure
        self._release_engines(wait=10.0)
        self._shutdown(kill=kill)

    def _on_lost(self, lost: Lost) -> None:
        if self._stopped or self._ended is not None:
            return
        # nbkit's own engines: the process whose connection closed ends in a moment, and its exit status
        # names the signal or exit code. Which one it is: the rank's, or any, for a connection that
        # closed before it said which rank it was.
        if lost.rank is None:
            suspects = [r for r in self.ranks if r.process is not None]
        else:
            suspects = [r for r in self.ranks[lost.rank : lost.rank + 1] if r.process is not None]
        deadline = time.monotonic() + 1.0
        while suspects:
            dead = next((r for r in suspects if r.process is not None and r.process.poll() is not None), None)
            if dead is not None:
                self.end(self._death_text(dead))
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        self.end(f"{lost.what}: its process died, or its host went away.")

    def _monitor(self) -> None:
        """Watch nbkit's engine processes and the controller; a death ends the set at once."""
        controller = self._cluster.controller if self._cluster is not None else None
        while not self._stopped and self._ended is None:
            for r in self.ranks:
                if r.process is not None and r.process.poll() is not None:
                    self.end(self._death_text(r))
                    return
            if controller is not None and controller.pid > 0 and not supervisor.pid_alive(controller.pid):
                self.end("the ipyparallel controller process ended.")
                return
            time.sleep(_POLL_S)

    def _death_text(self, r: Rank) -> str:
        assert r.process is not None
        status = supervisor.ExitStatus.from_returncode(r.process.returncode)
        # What the process wrote outside Python's streams (a native crash, a CUDA or NCCL abort),
        # shown after the message (the set's files are removed when it ends).
        self._ended_log = _log_tail(self.tmpdir, r.rank, lines=10)
        return f"rank {r.rank} (pid {r.info.pid}) {status.cause}. {status.hint}"

    def _release_engines(self, *, wait: float | None) -> None:
        """Engines started outside nbkit: ask each to forget the set's names and leave the process
        group (live_engine.teardown); wait up to `wait` seconds for the answers (None: do not wait).
        Nothing for nbkit's own engines, which end with the set.
        """
        if self._owned or self._client is None or not self.ranks:
            return
        with contextlib.suppress(Exception):
            engines = [r.engine for r in self.ranks if r.engine in self._client.ids]
            ar = self._client[engines].apply_async(live_engine.teardown)
            if wait is not None:
                ar.get(timeout=wait)

    def _shutdown(self, *, kill: bool) -> None:
        """Stop the engines nbkit started (SIGTERM, then SIGKILL after _ENGINE_GRACE_S; SIGKILL at once with
        kill) and what their cells started, the controller, the client and the relay; remove the set's
        files. Safe to call twice.
        """
        procs = list(self._processes)  # every engine nbkit started, also those not yet given a rank
        supervisor.stop({proc.pid: proc for proc in procs}, 0 if kill else _ENGINE_GRACE_S)
        for proc in procs:
            _end_group(proc.pid)
        if self._cluster is not None and self._cluster.controller is not None:
            # SIGTERM: the controller ends its heart monitor process itself; SIGKILL if it hangs. ipyparallel's
            # own wait for it (psutil) only sees it gone when stop() collected it first.
            pid = self._cluster.controller.pid
            if pid > 0:
                supervisor.stop({pid: pid}, _ENGINE_GRACE_S)
        if self._cluster is not None:
            _stop_loop_thread(self._cluster)
        if self._client is not None and self._owned:
            with contextlib.suppress(Exception):
                self._client.close()
        if self.relay is not None:
            self.relay.close()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


_STOPPED = "The live set was stopped. Start a new one (%ddp start / nbkit.start())."

_POLL_S = 0.1  # how often the monitor looks at the engine processes
_HEARTBEAT_MS = 500  # the controller's heartbeat period for a set nbkit starts (see _controller_command)
# Between SIGTERM and SIGKILL for an engine or the controller that nbkit started. An engine ends with
# os._exit as soon as Python runs its SIGTERM handler (nbkit.rank_side.live_engine); one busy in native code (a
# collective waiting for a dead peer) never gets there, so the grace is short: stopping a set must
# not hang on such a rank. The controller gets the same for ending its heart monitor process itself.
_ENGINE_GRACE_S = 3.0


def _wait_for_engines(
    client: Any, timeout: float, processes: list[subprocess.Popen], tmpdir: str | None
) -> dict[int, tuple[int, EngineInfo]]:
    """Wait until each engine nbkit started (`processes`, their logs in `tmpdir`) has registered with the
    controller and said who it is (start-up step 1); returns {rank: (engine id, its EngineInfo)}, rank i
    being processes[i].

    Raises LiveError naming the ranks that did not arrive: at once when one's process ended, after
    _STALL_S without a new arrival once some did, after `timeout` at the latest.
    """
    by_pid = {p.pid: i for i, p in enumerate(processes)}
    asked: dict[int, Any] = {}  # engine id: its identify() request
    found: dict[int, tuple[int, EngineInfo]] = {}
    count = len(processes)
    arrivals = _Arrivals(range(count), timeout, step=1)
    while len(found) < count:
        for eid in client.ids:
            if eid not in asked:
                asked[eid] = client[eid].apply_async(live_engine.identify)
        failed = []  # engines that registered but could not say who they are: waiting longer would not help
        for eid, ar in asked.items():
            if not ar.ready():
                continue
            if not ar.successful():
                failed.append((eid, ar))
                continue
            info = ar.get()
            if info.pid in by_pid:
                found[by_pid[info.pid]] = (eid, info)
        arrivals.arrived(found)
        for i, proc in enumerate(processes):
            if proc.poll() is not None:
                status = supervisor.ExitStatus.from_returncode(proc.returncode)
                raise LiveError(f"Rank {i}'s process ended while starting ({status.cause}).\n" + _log_tail(tmpdir, i))
        if failed:  # after the processes: one that ended names the cause of its request's failure
            eid, ar = failed[0]
            raise LiveError(f"Engine {eid} could not start as a rank: {_remote_error(ar)}")
        missing = arrivals.overdue()
        if missing:
            raise LiveError(arrivals.text(missing, processes) + "\n" + _log_tail(tmpdir, missing[0]))
        time.sleep(0.05)
    return found


def _remote_error(ar: Any) -> str:
    """The error an engine raised for the request `ar` (ready and failed), as "Name: message"."""
    try:
        ar.get()
    except Exception as exc:  # ipyparallel's RemoteError, carrying the engine's exception
        name, value = getattr(exc, "ename", type(exc).__name__), getattr(exc, "evalue", str(exc))
        return f"{name}: {value}"
    return "no error was reported"


def _log_tail(tmpdir: str | None, rank: int, lines: int = 20) -> str:
    """The end of what rank `rank`'s process wrote outside Python's streams (its log in the set's folder
    `tmpdir`); for a native crash, the Python stack faulthandler wrote (from its "Fatal Python error"
    line, the cell's frame first).
    """
    if tmpdir is None:
        return ""
    try:
        with open(os.path.join(tmpdir, f"rank{rank}.log"), errors="replace") as f:
            text = f.read().splitlines()
    except OSError:
        return ""
    crash = [i for i, line in enumerate(text) if line.startswith("Fatal Python error")]
    if crash:
        text = [line for line in text[crash[-1] :] if not line.startswith("Extension modules:")][:30]
    else:
        text = text[-lines:]
    return "Its last output:\n" + "\n".join(text) if text else ""


def _identify(client: Any, ids: list[int], timeout: float) -> list[EngineInfo]:
    """Each engine's EngineInfo; raises LiveError naming the engines that did not answer within `timeout` s."""
    pending = {eid: client[eid].apply_async(live_engine.identify) for eid in ids}
    deadline = time.monotonic() + timeout
    while not all(ar.ready() for ar in pending.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    silent = [eid for eid, ar in pending.items() if not ar.ready()]
    if silent:
        raise LiveError(
            f"Engine(s) {ranks_text(silent)} did not answer within the start-up timeout ({timeout:.0f} s) when asked "
            "who they are (before any became a rank): they are busy or stuck; restart them (or leave them out "
            "with engines=[...])."
        )
    return [ar.get() for ar in pending.values()]


# Start-up, step by step: once a rank has done a step, the others have this long after the last one
# that did (not the whole start-up timeout) before the start fails naming them: on a loaded machine the
# ranks arrive seconds apart, but a rank that is this far behind its peers is stuck.
_STALL_S = 30.0


_STEPS = {
    1: "start and register with the ipyparallel controller",
    2: "connect to the notebook",
    3: "join the process group",
}


class _Arrivals:
    """Which ranks have done one start-up step, and whether the rest are overdue."""

    def __init__(self, ranks: Iterable[int], timeout: float, *, step: int):
        self.expected = sorted(ranks)
        self.step = step
        self.timeout = timeout
        self._done: set[int] = set()
        self._began = self._last = time.monotonic()

    def arrived(self, ranks: Iterable[int]) -> None:
        new = set(ranks) - self._done
        if new:
            self._done |= new
            self._last = time.monotonic()

    def overdue(self) -> list[int]:
        """The ranks still missing where the step is overdue (else [])."""
        missing = [r for r in self.expected if r not in self._done]
        now = time.monotonic()
        late = now - self._began > self.timeout or (bool(self._done) and now - self._last > _STALL_S)
        return missing if missing and late else []

    def text(self, missing: list[int], processes: list[Any]) -> str:
        """The message for `missing` ranks (processes[rank]: its Popen, where nbkit started it)."""
        who = ", ".join(
            f"{r} (pid {processes[r].pid})" if r < len(processes) and processes[r] is not None else str(r)
            for r in missing
        )
        waited = time.monotonic() - self._began
        if self._done:
            after = f"within {_STALL_S:.0f} s of rank(s) {ranks_text(sorted(self._done))}, which did"
        else:
            after = f"within the start-up timeout ({self.timeout:.0f} s)"
        return (
            f"The live set could not start: rank(s) {who} did not {_STEPS[self.step]} (start-up step {self.step} "
            f"of {len(_STEPS)}) {after}; waited {waited:.0f} s. Every process was stopped. A rank that is this "
            "far behind is stuck or starved (out of memory, a full disk, a machine too loaded): its last output "
            "is below; start again (%ddp start / nbkit.start())."
        )


_DIR_PREFIX = "nbkit-live-"  # then the notebook's pid: nbkit-live-PID-XXXXXXXX, a set's folder


def _remove_orphaned_dirs() -> None:
    """Remove the folders of sets whose notebook process is gone (a kernel that was killed runs no
    clean-up; its ranks end by themselves, but their folder stays until the next start removes it).
    """
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_DIR_PREFIX}*-*")):
        pid = os.path.basename(path)[len(_DIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not supervisor.pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _interrupt_held() -> Iterator[None]:
    """Hold a SIGINT (the stop button) that comes while the block runs, and deliver it when the block ends: for
    starting a process and keeping its pid, which an interrupt between the two would leave running with nothing to
    end it. ipyparallel's controller launcher keeps the pid on the line after its Popen: an interrupt there left the
    controller running until the kernel ended (a stop pressed as it started, tests/faults/test_live_start.py). A
    live set's stop ends only the engines in self._processes; one left out ended by itself once the controller was
    gone (0.3 s), but by nbkit's kill it ends at once. The block is a process start, well under a second, so the held
    interrupt comes as soon. Outside the main thread, where Python runs no signal handler, nothing to hold.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[FrameType | None] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
    if held and callable(previous):
        previous(signal.SIGINT, held[0])
    elif held and previous != signal.SIG_IGN:
        raise KeyboardInterrupt


def _finalise_abandoned(exc: BaseException) -> None:
    """Finalise now what an ipyparallel `*_sync` call that `exc` ended left behind: its coroutine, pending on an
    event loop that ipyparallel closed, reachable only through the frames of `exc`'s traceback.

    Left to the garbage collector, it is finalised wherever a collection next runs (its clean-up code, and
    asyncio's "Task was destroyed but it is pending!"), inside whatever the notebook does then, a cell later. The
    frames' variables go (the traceback still shows where it stopped), and asyncio's message, which tells a user
    nothing to do, is not shown.
    """
    import gc
    import traceback

    traceback.clear_frames(exc.__traceback__)
    log = logging.getLogger("asyncio")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        gc.collect()
    finally:
        log.setLevel(level)


def _stop_loop_thread(cluster: Any) -> None:
    """End the event-loop thread that an ipyparallel Cluster starts for its `*_sync` methods when they are
    called where an event loop runs (a notebook kernel) and never ends itself: one thread, an epoll
    descriptor and a socket pair per set, measured here (5 start/stop cycles: 5 of each left). ipyparallel
    has no public call for it, so this reads its attributes, and does nothing where they are not found.
    """
    thread, loop = getattr(cluster, "_async_thread", None), getattr(cluster, "_thread_loop", None)
    if thread is None or loop is None:
        return
    with contextlib.suppress(Exception):
        loop.add_callback(loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()
            cluster._async_thread = None


def _end_group(pgid: int) -> None:
    """SIGKILL what is left of an engine's process group: the processes its cells started (subprocess.Popen,
    multiprocessing's spawn and fork children, and theirs), which stay in the engine's group, as nbkit
    starts each engine in a session of its own. (Linux gives no new process the number of a group that
    still has members, so the number cannot name another group.) A process that left the group
    (setsid, start_new_session=True) is out of reach: see docs/guide.md.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _controller_command(parent: str) -> list[str]:
    """The command of the controller of a set nbkit starts, watched by nbkit.live._proc (`parent`: the notebook's pid).

    --usethreads: the schedulers run as threads of the controller, not as processes it forks, which the parent
    watch of nbkit.live._proc would not cover (seen: 8 orphans per set).
    The heartbeat every 0.5 s, not 3 s: the controller finishes an engine's registration at a heartbeat after it.
    A set of 2 CPU ranks started in 8.5 s, 5 s of it waiting for the engines to register; 3.4 s with 0.5 s beats
    (medians of 5, benchmarks/live_overhead.py --starts 5). The misses allowed (here, and the engines' for the
    controller's pings) keep ipyparallel's default tolerances of 30 s and 175 s.
    """
    return [
        sys.executable,
        "-m",
        "nbkit.live._proc",
        parent,
        "ipyparallel.controller",
        "--usethreads",
        f"--HeartMonitor.period={_HEARTBEAT_MS}",
        f"--HeartMonitor.max_heartmonitor_misses={30_000 // _HEARTBEAT_MS}",
    ]
