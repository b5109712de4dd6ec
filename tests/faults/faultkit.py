"""What the fault matrix checks around every case (used by conftest.py's `leftovers` fixture and
by the cases): snapshots of what a fault could leave behind (benchmarks.leftovers.Snapshot, shared
with the soak benchmark), timing, and the immediate rerun; for the cases in a notebook, a real
Jupyter kernel to run cells in and the checks that a live set ended.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

import psutil
from jupyter_client.manager import KernelManager

import nbkit

# The checkout's root, where benchmarks/ is a package (CI does not put the checkout on PYTHONPATH).
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
from benchmarks.leftovers import Snapshot  # noqa: E402  (soak.py samples the same snapshot)

__all__ = [
    "MARGIN_S",
    "SETTLE_S",
    "CellError",
    "Kernel",
    "Snapshot",
    "assert_reruns",
    "ended_the_set",
    "failed_within",
    "fresh_set",
    "nothing_left",
    "still_running",
]

# Kernel cases shut their kernel down asynchronously (jupyter_client), and the last reaping of a
# launch can trail its return by a scheduling slice on this loaded machine: what is still there
# after this long is a leftover.
SETTLE_S = 10.0

# A live set's targets are 2 s; the asserts allow for a loaded 2-core machine.
MARGIN_S = 6.0


@contextlib.contextmanager
def failed_within(seconds: float) -> Iterator[None]:
    """The block must end (by raising, normally) within `seconds` of wall time."""
    start = time.monotonic()
    yield
    took = time.monotonic() - start
    assert took < seconds, f"took {took:.1f} s, more than {seconds} s"


def _answer() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = __import__("torch").ones(1) * (nbkit.rank() + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def assert_reruns(gpus: int = 2) -> None:
    """The same kind of launch works at once after the fault."""
    assert nbkit.launch(_answer, gpus=gpus) == gpus * (gpus + 1) // 2


class CellError(NamedTuple):
    """The error a cell ended with, as the notebook shows it."""

    ename: str
    evalue: str
    traceback: str  # the lines of the traceback, joined

    @classmethod
    def of(cls, content: dict) -> CellError:
        """The error of a kernel's `error` message content."""
        return cls(content["ename"], content["evalue"], "\n".join(content["traceback"]))


class Kernel:
    """A Jupyter kernel of this interpreter and a blocking client (jupyter_client, as nbclient and the
    notebook front ends drive it), started in `cwd` with `env` added to the test's environment.

    `run` runs a cell (optionally interrupting it when a text appears); `start` and `wait` do the
    same in two steps, for a case that acts while the cell runs. A cell's outputs are a dict: stdout,
    stderr, error (a CellError, or None), result (the text/plain of its value, or None), and seconds
    from the interrupt `interrupt_on` sent (or from the cell's wait) to its end.
    """

    def __init__(self, kernel_name: str, cwd: str | Path, env: dict[str, str] | None = None):
        self.manager = KernelManager(kernel_name=kernel_name)
        self.manager.start_kernel(cwd=str(cwd), env={**os.environ, **(env or {})})
        self.client = self.manager.client()
        self.client.start_channels()
        try:
            self.client.wait_for_ready(timeout=120)  # a kernel's start takes seconds on a loaded machine
        except RuntimeError:
            self.close()
            raise
        self.pid: int = self.manager.provisioner.process.pid

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def start(self, code: str) -> str:
        """Send `code` to run; returns the cell's message id, for `wait` or `messages`."""
        return self.client.execute(code)

    def messages(self, msg_id: str, timeout: float = 300) -> Iterator[tuple[str, dict]]:
        """The cell's output messages, (type, content), up to the kernel being idle again; raises
        TimeoutError if that takes more than `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the cell did not finish within {timeout} s") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                return
            yield kind, content

    def wait(self, msg_id: str, *, interrupt_on: str | None = None, timeout: float = 300) -> dict:
        """The outputs of the cell `msg_id` (see the class); with `interrupt_on`, the kernel is
        interrupted once that text appears in its stdout. Raises AssertionError after `timeout` s."""
        out: dict = {"stdout": "", "stderr": "", "error": None, "result": None}
        start = time.monotonic()
        interrupted = None
        try:
            for kind, content in self.messages(msg_id, timeout):
                if kind == "stream":
                    out[content["name"]] += content["text"]
                    if interrupt_on and interrupted is None and interrupt_on in out["stdout"]:
                        interrupted = time.monotonic()
                        self.interrupt()
                elif kind == "error":
                    out["error"] = CellError.of(content)
                elif kind == "execute_result":
                    out["result"] = content["data"].get("text/plain")
        except TimeoutError as timed_out:
            raise AssertionError(f"{timed_out}; so far: {out}") from None
        out["seconds"] = time.monotonic() - (interrupted or start)
        return out

    def run(self, code: str, *, interrupt_on: str | None = None, timeout: float = 300) -> dict:
        """Run `code` and return its outputs (see `wait`)."""
        return self.wait(self.start(code), interrupt_on=interrupt_on, timeout=timeout)

    def interrupt(self) -> None:
        """Interrupt the kernel as the notebook's stop button does (SIGINT)."""
        self.manager.interrupt_kernel()

    def descendants(self) -> list[psutil.Process]:
        """Every process the kernel started, and theirs."""
        return psutil.Process(self.pid).children(recursive=True)

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def _left_after(find: Callable[[], Iterable[psutil.Process]], within: float) -> list[str]:
    """The command lines of the processes `find` returns that still run, polled for up to `within`
    seconds until there are none (zombies and processes that vanish while being looked at count as gone)."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for p in find():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(" ".join(p.cmdline()[:6]))
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def still_running(processes: list[psutil.Process], within: float = 5.0) -> list[str]:
    """The command lines of `processes` still running after up to `within` seconds."""
    return _left_after(lambda: processes, within)


def nothing_left(before: set[int], within: float = 5.0) -> list[str]:
    """The command lines of this process's processes, started since `before` (their pids), that still
    run after up to `within` seconds."""
    return _left_after(lambda: (p for p in psutil.Process().children(recursive=True) if p.pid not in before), within)


def ended_the_set(out: dict, procs: list[psutil.Process], *says: str, within_s: float | None = None) -> str:
    """Assert that the cell ended the live set: a LiveError whose traceback says each of `says`, the cell
    over within `within_s` seconds (where given), none of the set's processes left. Returns the traceback."""
    assert out["error"] is not None and out["error"][0] == "LiveError", out
    text = out["error"][2]
    for phrase in says:
        assert phrase in text, (phrase, text)
    if within_s is not None:
        assert out["seconds"] < within_s, out["seconds"]
    assert still_running(procs) == []
    return text


def fresh_set(kernel: Kernel) -> list[psutil.Process]:
    """A live set of 2 ranks in `kernel` (the running one, or a new one) with `x = 41` on both; returns
    the processes it runs in."""
    started = kernel.run("if nbkit.live.current() is None:\n    nbkit.start(gpus=2)")
    assert started["error"] is None, started
    defined = kernel.run("%%ddp\nx = 41")
    assert defined["error"] is None, defined
    procs = kernel.descendants()
    assert len(procs) >= 3  # controller, 2 engines (and their nannies)
    return procs
