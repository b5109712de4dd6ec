r"""Spawn mode: run a notebook cell's source in fresh processes when forking is not possible.

nbkit.launch forks the notebook process, which is fast and shares every name, but a process
that has initialised CUDA (say, after inference in an earlier cell), imported bitsandbytes, or
created an accelerate state cannot be forked into working training processes. `run_source`
then starts a fresh Python process (nothing inherited but the environment, the working directory
and sys.path) that runs nbkit.launch itself, so the ranks are forked from a clean process; each
rank gets the notebook names the cell needs (chosen and pickled by nbkit.notebook.notebook_names, the rule a
live set follows too) and runs the cell:

- the values are pickled by value with cloudpickle, all in one go (tensors come along on the CPU):
  functions, classes, lambdas and closures defined in the notebook included, with the notebook
  names they use; modules are imported again by name;
- the notebook's functions run with the rank's namespace as their globals, as in the notebook.

A name that cannot be brought along raises BringAlongError naming it, and code that does not
parse raises CellSyntaxError pointing at its line, before anything starts. The job travels to the
launcher process over a pipe (its stdin), never through a file, so a kernel killed mid-cell leaves
none of the cell's values (secrets included) on disk. The ranks' reports reach this process's
dashboard, rank 0's value comes back, and a failing rank raises the same LaunchError as fork mode
(the messages of that pipe: nbkit.messages.spawn). Output of the ranks appears in the notebook.

    value = run_source("model = train(lr)\\nmodel.score", globals(), RankOptions(gpus=2))
"""

from __future__ import annotations

import builtins
import codecs
import collections
import contextlib
import linecache
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Mapping
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from nbkit.launching import fork, rank_contract, supervisor
from nbkit.launching.rank_options import RankOptions
from nbkit.messages.spawn import DashboardOpened, Envelope, Job, LaunchRaised, Report, Result
from nbkit.notebook import cell_code, dashboard
from nbkit.notebook.notebook_names import bring_along
from nbkit.platform import distributed, forksafety, notices
from nbkit.platform.errors import LaunchError
from nbkit.rank_side import cell_group

__all__ = ["run_source"]

_log = notices.logger(__name__)
# After SIGINT, how long the launcher process gets to stop its ranks (each SIGTERM, then SIGKILL after
# 5 s: fork._LEFTOVER_GRACE_S) and report, before it is killed: more than those 5 s, as it
# also sends its report and ends its interpreter.
_LAUNCHER_STOP_GRACE_S = 15.0
# Once it has reported, how long the launcher process gets to end by itself before it is killed. Its
# ranks are gone by then, so this only bounds the wait for a launcher that hangs at exit.
_LAUNCHER_EXIT_GRACE_S = 30.0
# The launcher process enforces `timeout` itself; the notebook side stops it only if it hangs past
# this much more (its start, importing torch, takes seconds on a loaded machine).
_LAUNCHER_SLACK_S = 60.0


def run_source(
    source: str,
    namespace: Mapping[str, Any],
    options: RankOptions,
    *,
    filename: str = "<ddp cell>",
    reason: str | forksafety.ForkBlocker | None = None,
) -> Any:
    """Run `source` (plain Python, as a notebook cell) on `options.gpus` fresh processes; return rank 0's
    value of its last expression (None if it ends with a statement).

    Takes the names of earlier cells from `namespace` (see the module doc for what is brought
    along) and the ranks' set-up as checked already (RankOptions: gpus, timeout, env, strategy,
    emulate, all_ranks, dashboard, as in nbkit.launch). Prints one line saying that spawn mode runs,
    why (`reason`), and what is brought along.

    Raises CellSyntaxError (the source does not parse), BringAlongError (a needed name cannot be
    pickled), RanksError (gpus asks for ranks this machine cannot give), all before anything starts;
    LaunchError (a rank failed, the run timed out, or the launcher process died), KeyboardInterrupt
    (interrupted: every process was stopped), and the ValueError/RuntimeError nbkit.launch raises when it
    cannot start.
    """
    # Counted here too, before the launcher process starts: a gpus this machine cannot give is the RanksError
    # of fork mode (which %%ddp shows as a usage error), not text relayed from the launcher.
    rank_contract.count_ranks(options.gpus, distributed.visible_gpus(), api="nbkit.launch")
    cell_code.parse(source, filename)  # a cell that does not parse fails here, pointing at its line
    brought = bring_along(source, namespace)
    why = f" Why: {str(reason).rstrip('.')}." if reason else ""
    names = ", ".join(brought.reached) or "nothing"
    _log.info(f"nbkit: running in fresh processes (spawn mode).{why} Brought along: {names}.")
    job = Job(source=source, filename=filename, brought=brought, sys_path=list(sys.path), options=options)
    return _Coordinator(job).run()


# How the launch ended, as the launcher process reports it last.
_Outcome = Result | LaunchRaised


# --------------------------------------------------------------------------------------------
# The notebook side: start the launcher process, relay its messages
# --------------------------------------------------------------------------------------------


class _Coordinator:
    """Runs one job: starts the launcher process, sends the job, relays its output and reports."""

    def __init__(self, job: Job):
        self.job = job
        self.cell = dashboard.OutputCell()
        self.stdout, self.stderr = sys.stdout, sys.stderr
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self.board: dashboard.Dashboard | None = None

    def run(self) -> Any:
        reader, writer = Pipe(duplex=False)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from nbkit.launching.spawn import _coordinate; _coordinate()",
                str(writer.fileno()),
            ],
            pass_fds=(writer.fileno(),),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_child_environment(),
            cwd=os.getcwd(),
        )
        writer.close()  # the child holds the only writer: EOF means it is gone
        forwarders = [
            self._forward(proc.stdout, self.stdout, keep=False),
            self._forward(proc.stderr, self.stderr, keep=True),
        ]
        try:
            self._send_job(proc)
            outcome = self._wait(reader, proc)
        except KeyboardInterrupt:
            self._stop(proc)
            self._close_board(False)
            raise
        finally:
            # it has reported (or was stopped) and ends by itself: SIGKILL only if it hangs on its way out
            supervisor.stop({"launcher": proc}, _LAUNCHER_EXIT_GRACE_S, first=None)
            for thread in forwarders:
                thread.join(timeout=5)
            reader.close()
            with contextlib.suppress(OSError):  # closed already unless the job never went out
                proc.stdin.close()  # type: ignore[union-attr]
        return self._finish(outcome, proc.returncode)

    def _send_job(self, proc: subprocess.Popen) -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(pickle.dumps(self.job, protocol=pickle.HIGHEST_PROTOCOL))
            proc.stdin.close()
        except BrokenPipeError:  # the launcher died before reading it: reported with its exit status
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()

    def _wait(self, reader: Connection, proc: subprocess.Popen) -> _Outcome | None:
        timeout = self.job.options.timeout
        deadline = None if timeout is None else time.monotonic() + timeout + _LAUNCHER_SLACK_S
        while True:
            if reader.poll(0.2):
                try:
                    message = reader.recv()
                except (EOFError, OSError):
                    return None
                if isinstance(message, (DashboardOpened, Envelope)):
                    self._dashboard_message(message)
                else:
                    return message
            elif proc.poll() is not None and not reader.poll(0):
                return None
            if deadline is not None and time.monotonic() > deadline:
                self._stop(proc)
                return LaunchRaised.of(
                    LaunchError(
                        f"The launch did not finish within the timeout ({timeout:g} s) and the launcher process "
                        f"did not stop it; all processes were stopped. {supervisor.hang_hint()}",
                        timed_out=True,
                    )
                )

    def _dashboard_message(self, message: DashboardOpened | Envelope) -> None:
        if isinstance(message, DashboardOpened):
            self.board = dashboard.create(message.nprocs, enabled=self.job.options.dashboard)
        elif self.board is not None and isinstance(message.body, Report):
            try:
                self.board.event(message.rank, message.body.metrics)
            except Exception:  # a display problem must never take the run down
                _log.exception("nbkit: the dashboard failed")

    def _finish(self, outcome: _Outcome | None, returncode: int | None) -> Any:
        self._close_board(isinstance(outcome, Result))
        if outcome is None:
            tail = "".join(self.stderr_tail).strip()
            how = supervisor.ExitStatus.from_returncode(returncode)
            # what a signal means is the same for any process nbkit watches; an exit code of nbkit's own
            # launcher process means nothing a user did, so no advice comes with one
            hint = f" {how.hint}" if how.signal is not None else ""
            raise LaunchError(
                f"The launcher process (spawn mode) {how.cause} before reporting a result; its ranks were stopped "
                f"with it.{hint}{' Its last output:' + chr(10) + tail if tail else ''}"
            )
        if isinstance(outcome, Result):
            return rank_contract.load_value(outcome.payload)
        raise outcome.exception()

    def _close_board(self, success: bool) -> None:
        if self.board is not None:
            self.board.close(success=success)

    def _forward(self, pipe: Any, stream: Any, keep: bool) -> threading.Thread:
        """Copy a pipe of the launcher process to the notebook as it arrives (progress bars and
        partial lines included).
        """

        def copy() -> None:
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            while chunk := os.read(pipe.fileno(), 65536):
                text = decoder.decode(chunk)
                if keep:
                    self.stderr_tail.append(text)
                with self.cell.active():
                    stream.write(text)
                    stream.flush()
            pipe.close()

        thread = threading.Thread(target=copy, name="nbkit-spawn-output", daemon=True)
        thread.start()
        return thread

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        """Ask the launcher to stop its ranks (SIGINT, as an interrupt would), then insist (SIGKILL)."""
        supervisor.stop({"launcher": proc}, _LAUNCHER_STOP_GRACE_S, first=signal.SIGINT)


def _child_environment() -> dict[str, str]:
    env = dict(os.environ)
    # the folder that holds nbkit/ (this file is nbkit/launching/spawn.py)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    # How this notebook shows the dashboard: the ranks print Trainer's log lines only without a live panel.
    env["NBKIT_DASHBOARD"] = dashboard.display_mode()
    # ipykernel points matplotlib at its inline backend, which needs a kernel: not in a rank.
    if env.get("MPLBACKEND", "").startswith("module://"):
        del env["MPLBACKEND"]
    return env


# --------------------------------------------------------------------------------------------
# The launcher process and its ranks
# --------------------------------------------------------------------------------------------


def _coordinate() -> None:
    """Entry point of the launcher process: the job on stdin, argv = [writer fd]."""
    job: Job = pickle.load(sys.stdin.buffer)
    conn = Connection(int(sys.argv[1]), readable=False)
    fork.die_with_parent()
    sys.path[:] = job.sys_path + [p for p in sys.path if p not in job.sys_path]
    linecache.cache[job.filename] = (len(job.source), None, job.source.splitlines(True), job.filename)
    dashboard.relay_to(conn)
    outcome: _Outcome
    try:
        outcome = Result(fork.launch_with(job.options, _run_rank, job))
    except (KeyboardInterrupt, Exception) as exc:  # a failed rank, an interrupt, or a launch that could not start
        outcome = LaunchRaised.of(exc)
    conn.send(outcome)  # the launch is over: nothing else writes to the connection now


def _run_rank(job: Job) -> bytes | None:
    """One rank: the notebook's names in a fresh __main__, then the cell."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    # rank 0's value is pickled with references to notebook classes as __main__.Name: found here
    sys.modules["__main__"] = main
    job.brought.load_into(main.__dict__)
    cell_group.join()  # the cell's default process group, as on a live set
    value = cell_code.run_cell(job.source, main.__dict__, job.filename)
    # Pickled here, unpickled in the notebook, where the notebook's own classes exist (the
    # launcher process in between has none of them).
    return rank_contract.pickle_for_notebook(value) if distributed.rank() == 0 else None
