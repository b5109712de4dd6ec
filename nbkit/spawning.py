r"""Spawn mode: run a notebook cell's source in fresh processes when forking is not possible.

nbkit.launch forks the notebook process, which is fast and shares every name, but a process
that has initialised CUDA (say, after inference in an earlier cell), imported bitsandbytes, or
created an accelerate state cannot be forked into working training processes. `run_source`
then starts a fresh Python process (nothing inherited but the environment, the working directory
and sys.path) that runs nbkit.launch itself, so the ranks are forked from a clean process; each
rank rebuilds what the cell needs from the notebook and runs the cell:

- modules the cell (or a notebook function it calls) uses are imported again in each rank;
- functions and classes defined in the notebook are re-created from their source;
- every other value is pickled (tensors come along on the CPU) and unpickled in each rank.

A name that cannot be brought along raises BringAlongError naming it, before anything starts.
The ranks' reports reach this process's dashboard, rank 0's value comes back, and a failing rank
raises the same LaunchError as fork mode. Output of the ranks appears in the notebook.

    value = run_source("model = train(lr)\\nmodel.score", globals(), gpus=2)
"""

from __future__ import annotations

import ast
import builtins
import codecs
import collections
import contextlib
import importlib
import inspect
import io
import linecache
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
from collections.abc import Mapping
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from nbkit import cells, dashboard, distributed, launching
from nbkit.errors import BringAlongError, LaunchError

__all__ = ["BringAlongError", "bring_along", "fork_blocker", "run_source"]

# IPython's own names in a notebook namespace (history, output cache, helpers): never brought along.
_IPYTHON_NAME = re.compile(r"^(In|Out|get_ipython|exit|quit|_(i+|\d+|i\d+|oh|ih|dh)?|__+|__\w+__)$")
_INTERRUPT_GRACE_S = 15.0


def fork_blocker() -> str | None:
    """Why nbkit.launch cannot fork from this process now (the first sentence of its refusal),
    or None when it can. Never initialises CUDA.
    """
    try:
        launching.check_can_fork()
    except RuntimeError as exc:
        return str(exc).split(". ")[0].rstrip(".") + "."
    return None


def run_source(
    source: str,
    namespace: Mapping[str, Any],
    *,
    gpus: int | None = None,
    timeout: float | None = None,
    quiet: bool = False,
    env: Mapping[str, str] | None = None,
    dashboard: bool = True,
    filename: str = "<ddp cell>",
    reason: str | None = None,
) -> Any:
    """Run `source` (plain Python, as a notebook cell) on `gpus` fresh processes; return rank 0's
    value of its last expression (None if it ends with a statement).

    Takes the names of earlier cells from `namespace` (see the module doc for what is brought
    along); gpus/timeout/quiet/env/dashboard as in nbkit.launch. Prints one line saying that
    spawn mode runs, why (`reason`), and what is brought along.

    Raises BringAlongError (a needed name cannot be re-created; nothing started), LaunchError (a
    rank failed, the run timed out, or the launcher process died), KeyboardInterrupt (interrupted:
    every process was stopped), and the ValueError/RuntimeError nbkit.launch raises when it cannot
    start (for instance more GPUs than exist).
    """
    items = bring_along(source, namespace)
    brought = ", ".join(item[1] for item in items) or "nothing"
    why = f" Why: {reason.rstrip('.')}." if reason else ""
    print(f"nbkit: running in fresh processes (spawn mode).{why} Brought along: {brought}.", flush=True)
    job = {
        "source": source,
        "filename": filename,
        "items": items,
        "sys_path": list(sys.path),
        "gpus": gpus,
        "timeout": timeout,
        "quiet": quiet,
        "env": dict(env or {}),
        "dashboard": dashboard,
    }
    return _Coordinator(job, timeout).run()


# --------------------------------------------------------------------------------------------
# What to bring along
# --------------------------------------------------------------------------------------------


def bring_along(source: str, namespace: Mapping[str, Any]) -> list[tuple]:
    """The notebook names `source` needs, as items to re-create them, dependencies first.

    Items: ("import", name, module) for modules; ("source", name, code, defined_name) for
    functions and classes defined in the notebook; ("value", name, pickled bytes) for the rest.
    Raises BringAlongError for a needed name that cannot be re-created.
    """
    items: list[tuple] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen or name not in namespace or _IPYTHON_NAME.match(name):
            return
        seen.add(name)
        value = namespace[name]
        if isinstance(value, types.ModuleType):
            items.append(("import", name, value.__name__))
            return
        if isinstance(value, (type, types.FunctionType)) and value.__module__ == "__main__":
            code = _notebook_source(name, value, namespace)
            for dependency in sorted(cells.free_names(code) - {value.__name__}):
                visit(dependency)
            items.append(("source", name, code, value.__name__))
            return
        data, notebook_globals = _pickle(name, value)
        for dependency in sorted(notebook_globals):
            if namespace.get(dependency) is None:
                raise BringAlongError(
                    name, f"it refers to {dependency!r}, defined in the notebook but no longer under that name"
                )
            visit(dependency)
        items.append(("value", name, data))

    for name in sorted(cells.free_names(source)):
        visit(name)
    return items


def _notebook_source(name: str, value: Any, namespace: Mapping[str, Any]) -> str:
    if getattr(value, "__name__", "") == "<lambda>":
        raise BringAlongError(name, "it is a lambda; define it with def (in an earlier cell or in this one)")
    if getattr(value, "__closure__", None):
        raise BringAlongError(
            name, "it is a closure (a function made by another function), whose captured values have no source"
        )
    try:
        return textwrap.dedent(inspect.getsource(value))
    except (OSError, TypeError):
        pass
    # Python < 3.13 cannot find the source of a class defined in a notebook cell: look for the
    # latest definition in the notebook's input history.
    for cell in reversed(list(namespace.get("In") or [])):
        with contextlib.suppress(SyntaxError):
            tree = ast.parse(cell)
            for node in tree.body:
                if (
                    isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                    and node.name == value.__name__
                ):
                    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                    return "".join(cell.splitlines(True)[first - 1 : node.end_lineno])
    raise BringAlongError(name, "its source code cannot be found")


class _NotebookGlobals(launching.CpuPickler):
    """The launcher's pickler (tensors to the CPU) that also notes the functions and classes of
    the notebook (module __main__) a value refers to: those must exist in the rank before it is
    unpickled there.
    """

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.notebook_globals: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            self.notebook_globals.add(obj.__qualname__.split(".")[0])
        return super().reducer_override(obj)


def _pickle(name: str, value: Any) -> tuple[bytes, set[str]]:
    buf = io.BytesIO()
    pickler = _NotebookGlobals(buf)
    try:
        pickler.dump(value)
    except Exception as exc:
        raise BringAlongError(name, f"its value ({type(value).__name__}) cannot be pickled ({exc})") from exc
    return buf.getvalue(), pickler.notebook_globals


# --------------------------------------------------------------------------------------------
# The notebook side: start the launcher process, relay its messages
# --------------------------------------------------------------------------------------------


class _Coordinator:
    def __init__(self, job: dict[str, Any], timeout: float | None):
        self.job, self.timeout = job, timeout
        self.cell = dashboard.OutputCell()
        self.stdout, self.stderr = sys.stdout, sys.stderr
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self.board: dashboard.Dashboard | None = None

    def run(self) -> Any:
        reader, writer = Pipe(duplex=False)
        fd, path = tempfile.mkstemp(prefix="nbkit-spawn-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(self.job, f, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from nbkit.spawning import _coordinate; _coordinate()",
                    path,
                    str(writer.fileno()),
                ],
                pass_fds=(writer.fileno(),),
                stdin=subprocess.DEVNULL,
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
                outcome = self._wait(reader, proc)
            except KeyboardInterrupt:
                self._stop(proc)
                self._close_board(False)
                raise
            finally:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                for thread in forwarders:
                    thread.join(timeout=5)
                reader.close()
        finally:
            os.unlink(path)
        return self._finish(outcome, proc.returncode)

    def _wait(self, reader: Connection, proc: subprocess.Popen) -> tuple | None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout + 60
        while True:
            if reader.poll(0.2):
                try:
                    message = reader.recv()
                except (EOFError, OSError):
                    return None
                if isinstance(message, dashboard.DashboardOpened):
                    self.board = dashboard.Dashboard(message.nprocs) if self.job["dashboard"] else None
                elif isinstance(message, dashboard.DashboardEvent):
                    self._event(message.rank, message.metrics)
                else:
                    return message
            elif proc.poll() is not None and not reader.poll(0):
                return None
            if deadline is not None and time.monotonic() > deadline:
                # The launcher enforces `timeout` itself; this only catches a launcher that hangs.
                self._stop(proc)
                return (
                    "error",
                    "The launch did not finish within the timeout; all processes were stopped.",
                    {},
                    {},
                    True,
                )

    def _event(self, rank: int, metrics: dict[str, Any]) -> None:
        if self.board is None:
            return
        try:
            self.board.event(rank, metrics)
        except Exception:  # a display problem must never take the run down
            import logging

            logging.getLogger("nbkit").exception("nbkit: the dashboard failed")

    def _finish(self, outcome: tuple | None, returncode: int | None) -> Any:
        success = outcome is not None and outcome[0] == "result"
        self._close_board(success)
        if outcome is None:
            tail = "".join(self.stderr_tail).strip()
            raise LaunchError(
                f"The launcher process (spawn mode) exited with code {returncode} before "
                f"reporting a result.{' Its last output:' + chr(10) + tail if tail else ''}"
            )
        kind = outcome[0]
        if kind == "result":
            try:
                return pickle.loads(outcome[1])
            except Exception as exc:
                raise LaunchError(
                    f"Rank 0's value came back but cannot be rebuilt in the notebook ({exc}). "
                    "Return plain data (numbers, strings, dicts, lists, tensors)."
                ) from exc
        if kind == "error":
            _, message, failures, errors, timed_out = outcome
            raise LaunchError(message, failures=failures, errors=errors, timed_out=timed_out)
        if kind == "interrupted":
            raise KeyboardInterrupt
        _, type_name, message = outcome
        raise {"ValueError": ValueError, "TypeError": TypeError}.get(type_name, RuntimeError)(message)

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
        """Ask the launcher to stop its ranks (SIGINT, as an interrupt would), then insist."""
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=_INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()


def _child_environment() -> dict[str, str]:
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    """Entry point of the launcher process: argv = [payload path, writer fd]."""
    path, fd = sys.argv[1], int(sys.argv[2])
    conn = Connection(fd, readable=False)
    launching.die_with_parent()
    with open(path, "rb") as f:
        job = pickle.load(f)
    sys.path[:] = job["sys_path"] + [p for p in sys.path if p not in job["sys_path"]]
    linecache.cache[job["filename"]] = (len(job["source"]), None, job["source"].splitlines(True), job["filename"])
    dashboard.relay_to(conn)
    try:
        value = launching.launch(
            _run_rank,
            job,
            gpus=job["gpus"],
            timeout=job["timeout"],
            quiet=job["quiet"],
            env=job["env"],
            dashboard=job["dashboard"],
        )
        message: tuple = ("result", value)
    except LaunchError as exc:
        message = ("error", str(exc), exc.failures, exc.errors, exc.timed_out)
    except KeyboardInterrupt:
        message = ("interrupted",)
    except Exception as exc:
        message = ("exception", type(exc).__name__, str(exc))
    dashboard.relay(message)


def _run_rank(job: dict[str, Any]) -> bytes | None:
    """One rank: re-create the notebook's names in a fresh __main__, run the cell."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    # Notebook classes are pickled as __main__.Name: unpickling looks them up here.
    sys.modules["__main__"] = main
    namespace = main.__dict__
    for item in job["items"]:
        kind, name = item[0], item[1]
        if kind == "import":
            namespace[name] = importlib.import_module(item[2])
        elif kind == "source":
            code, defined = item[2], item[3]
            filename = f"<notebook: {name}>"
            linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
            exec(compile(code, filename, "exec"), namespace)
            namespace[name] = namespace[defined]
        else:
            namespace[name] = pickle.loads(item[2])
    value = cells.run_cell(job["source"], namespace, job["filename"])
    # Pickled here, unpickled in the notebook, where the notebook's own classes exist (the
    # launcher process in between has none of them).
    return launching.pickle_for_notebook(value) if distributed.rank() == 0 else None
