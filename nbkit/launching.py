"""nbkit.launch: run a training function on every GPU from inside a notebook.

The processes are forked by accelerate's `notebook_launcher` (torch elastic underneath), so a
function defined in a notebook cell runs as is, closures and all. Around that launcher nbkit adds
what a notebook user needs: rank 0's return value comes back, failures raise one LaunchError that
names the rank and carries its traceback, hung runs time out, interrupts stop every rank, nothing is
left running, and the same call can run again at once.

Environment handling (each rank): RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT come from torch elastic; nbkit adds NBKIT_LAUNCHED=1 and, on machines without CUDA,
ACCELERATE_USE_CPU=true (so accelerate, transformers' Trainer and TRL run real gloo DDP across the
processes instead of N independent runs) and GLOO_SOCKET_IFNAME=lo.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import io
import logging
import multiprocessing
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbkit import channel, distributed, patching
from nbkit.config import environment
from nbkit.dashboard import Dashboard
from nbkit.errors import LaunchError, RankError

__all__ = ["LaunchError", "launch"]


def launch(
    fn: Callable[..., Any],
    *args: Any,
    gpus: int | None = None,
    timeout: float | None = None,
    quiet: bool = False,
    env: Mapping[str, str] | None = None,
    dashboard: bool = True,
    **kwargs: Any,
) -> Any:
    """Run `fn(*args, **kwargs)` in one process per GPU and return rank 0's return value.

    Args:
        fn: the training function. It runs in forked processes, so it may be defined in the
            notebook and use names from earlier cells. Import CUDA-initialising libraries
            (unsloth, bitsandbytes) inside it, never before launching.
        *args: positional arguments for `fn`.
        gpus: how many processes. None: one per visible GPU. On a machine without CUDA, `gpus=N`
            runs N CPU processes that train with real gloo DDP (for tests and CI).
        timeout: seconds after which a run that has not finished is stopped (LaunchError).
        quiet: silence ranks other than 0 (by default their output is prefixed "[rank N] ").
        env: extra environment variables for the launched processes.
        dashboard: show the ranks' reports (nbkit.report, the Trainer callback that nbkit adds to
            every Trainer in the ranks) as one live panel, or text lines without a widget frontend.
        **kwargs: passed to `fn`. (Names above are taken by launch itself; pass such arguments
            to fn through `args` or functools.partial.)

    Returns:
        Rank 0's return value, sent back by pickling; tensors come back on the CPU so that the
        notebook process never initialises CUDA.

    Raises:
        LaunchError: a rank raised or died, the run timed out, or rank 0's value could not be
            sent back. The message names the failing rank(s) and holds their traceback.
        RuntimeError / ValueError / TypeError: the run could not start (CUDA already initialised
            here, an Accelerator created here, more GPUs than exist, a function that cannot run in
            a child); nothing was started and the message says what to do.

    Inside a distributed run already (torchrun, accelerate launch, several nodes), `fn` is called
    directly on each rank and its value returned there.
    """
    if distributed.is_distributed():
        _prepare_rank(quiet=False, rank=distributed.rank())
        return fn(*args, **kwargs)

    _check_function(fn)
    has_cuda = _has_cuda()
    nprocs = _count_processes(gpus, has_cuda)
    check_can_fork()
    board = Dashboard(nprocs) if dashboard else None
    run = _Run(nprocs, board.event if board is not None else None)
    child = _Child(fn, args, kwargs, run.channel, quiet=quiet, use_cpu=not has_cuda)
    succeeded = False
    try:
        run.execute(child, timeout=timeout, env=dict(env or {}))
        value = run.result()
        succeeded = True
    finally:
        if board is not None:
            board.close(success=succeeded)
    return value


# --------------------------------------------------------------------------------------------
# Checks before launching: each error says what happened and what to do.
# --------------------------------------------------------------------------------------------


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


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


def _count_processes(gpus: int | None, has_cuda: bool) -> int:
    if gpus is not None and (not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1):
        raise ValueError(f"gpus must be a positive whole number or None (all visible GPUs); got {gpus!r}.")
    if not has_cuda:
        if gpus is None:
            raise RuntimeError(
                "No GPU is visible to this notebook, so nbkit.launch(gpus=None) has nothing to run on. "
                "On Kaggle, choose Settings > Accelerator > GPU T4 x2; on Colab, Runtime > Change runtime type. "
                "To try the code on the CPU, pass gpus=N: N CPU processes then train together over gloo."
            )
        return gpus
    visible = distributed.visible_gpus()
    if gpus is None:
        return len(visible)
    if gpus > len(visible):
        names = ", ".join(f"{g.index}: {g.name}" for g in visible)
        raise ValueError(
            f"Asked for {gpus} GPUs but this machine shows {len(visible)} ({names}). Use gpus={len(visible)} "
            "or gpus=None for all of them; CUDA_VISIBLE_DEVICES limits which ones are visible."
        )
    return gpus


def check_can_fork() -> None:
    """Raise RuntimeError, saying what to do, if ranks cannot be forked from this process now."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA is already initialised in this notebook process, so the training processes cannot be "
            f"forked from it (CUDA does not survive fork). Likely cause: {_likely_cuda_cause()}. "
            "Restart the kernel and keep everything that touches the GPU inside the launched function "
            "(import unsloth/bitsandbytes there, load the model there). The %%ddp magic can instead "
            "start fresh processes when this happens."
        )
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None and (
        accelerate_state.PartialState._shared_state or accelerate_state.AcceleratorState._shared_state
    ):
        raise RuntimeError(
            "An accelerate Accelerator (or PartialState) already exists in this notebook process, often "
            "because a Trainer, TrainingArguments.device or Accelerator() ran in an earlier cell. Each "
            "launched process must create its own. Restart the kernel and create Trainer/TrainingArguments/"
            "Accelerator only inside the launched function."
        )


def _likely_cuda_cause() -> str:
    for module, why in (
        ("unsloth", "unsloth was imported in this notebook process (importing it initialises CUDA)"),
        (
            "bitsandbytes",
            "bitsandbytes was imported in this notebook process (unless nbkit was imported first, "
            "its import initialises CUDA; peft and unsloth import it wherever it is installed, as "
            "on Kaggle)",
        ),
        (
            "torchao",
            "torchao was imported before nbkit (transformers and peft import it wherever it is "
            "installed, and its import queries the GPU); `import nbkit` first makes that harmless",
        ),
    ):
        if module in sys.modules:
            return why
    return (
        "a tensor or model was put on a GPU, or a CUDA query such as torch.cuda.get_device_name() "
        "ran, in an earlier cell"
    )


# --------------------------------------------------------------------------------------------
# The notebook side of one launch.
# --------------------------------------------------------------------------------------------

# (text in a rank's error, what it means and what to do): added to the LaunchError of such a run.
_FAILURE_HINTS = (
    (
        "Cannot re-initialize CUDA in forked subprocess",
        "The notebook process touched the CUDA driver before launching (torch.cuda.is_available() "
        "or device_count() before `import nbkit`, or a library that queries the GPU on import), so "
        "forked ranks cannot use CUDA. Import nbkit first in the notebook, or restart the kernel and "
        "keep GPU work inside the launched function; %%ddp can start fresh processes instead.",
    ),
    (
        "Expected to have finished reduction in the prior iteration",
        "DDP found trainable weights that got no gradient in a step. A common cause is a VLM's "
        "LoRA'd vision tower on a batch without images; others are experts a step does not route to, "
        "or outputs the loss does not use. Train only what every batch uses (unsloth: "
        "get_peft_model(..., finetune_vision_layers=False) for text-only data), or give every batch an "
        "image. With unsloth vision models nbkit keeps unsloth's faster single-GPU checkpointing, which "
        "needs this; nbkit.configure(unsloth_vlm_ddp_checkpointing='unsloth') before loading the model "
        "trains such data with unsloth's slower DDP checkpointing instead.",
    ),
)


@dataclass
class _Run:
    nprocs: int
    on_event: Callable[[int, dict], None] | None
    channel: channel.Channel = field(init=False)
    pids: dict[int, int] = field(default_factory=dict)
    errors: dict[int, RankError] = field(default_factory=dict)
    payload: bytes | None = None
    timed_out: bool = False
    interrupted: bool = False

    def __post_init__(self) -> None:
        self.channel = channel.Channel(self.nprocs)

    def _handle(self, kind: str, rank: int, payload: Any) -> None:
        if kind == "started":
            self.pids[rank] = payload
        elif kind == "error":
            self.errors.setdefault(rank, payload)
        elif kind == "result":
            self.payload = payload
        elif kind == "event" and self.on_event is not None:
            try:
                self.on_event(rank, payload)
            except Exception:  # a display problem must never take the training run down
                logging.getLogger("nbkit").exception("nbkit: the event handler failed")

    def execute(self, child: _Child, *, timeout: float | None, env: dict[str, str]) -> None:
        """Run the ranks to completion; raise LaunchError or KeyboardInterrupt when they do not."""
        # Objects left over from an earlier launch (torch elastic's store and its threads) must be
        # destroyed here, where their threads exist; collected in a child they abort it.
        gc.collect()
        self.channel.start(self._handle)
        watchdog = threading.Timer(timeout, self._on_timeout) if timeout else None
        failure: BaseException | None = None
        try:
            with (
                _launch_environment(child.use_cpu, env),
                _loopback_rendezvous() as port,
                _elastic_quiet(),
                _kernel_signals_kept(),
            ):
                if watchdog is not None:
                    watchdog.daemon = True
                    watchdog.start()
                _start(child, self.nprocs, port)
        except KeyboardInterrupt:
            self.interrupted = True
        except Exception as exc:  # ChildFailedError, SignalException, anything elastic raises
            if _is_interrupt(exc):
                self.interrupted = True
            else:
                failure = exc
        finally:
            if watchdog is not None:
                watchdog.cancel()
            self._stop_leftovers()
            self.channel.stop()
        if self.interrupted:
            print(f"nbkit: interrupted; stopped ranks {', '.join(map(str, sorted(self.pids)))}.", file=sys.stderr)
            raise KeyboardInterrupt
        if self.timed_out:
            raise LaunchError(
                self._timeout_message(),
                failures={r: "timed out" for r in self.pids},
                errors=self.errors,
                timed_out=True,
            )
        if failure is not None or self.errors:
            raise self._failure_error(failure)

    def result(self) -> Any:
        if self.payload is None:
            raise LaunchError(
                "Rank 0 finished without sending its return value back (it may have called "
                "sys.exit or os._exit). Return from the function instead."
            )
        return pickle.loads(self.payload)

    # -- stopping ---------------------------------------------------------------------------
    def _on_timeout(self) -> None:
        self.timed_out = True
        # SIGKILL: a rank stuck in a collective sits in C code, where SIGTERM handlers never run.
        for pid in self.pids.values():
            _kill(pid, signal.SIGKILL)

    def _stop_leftovers(self) -> None:
        """Make sure no rank outlives the launch: SIGTERM, a short grace, then SIGKILL."""
        alive = [pid for pid in self.pids.values() if _alive(pid)]
        for pid in alive:
            _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in alive if _alive(pid)]
            time.sleep(0.05)
        for pid in alive:
            _kill(pid, signal.SIGKILL)
        for pid in self.pids.values():
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)

    # -- messages ---------------------------------------------------------------------------
    def _timeout_message(self) -> str:
        hint = (
            "A rank that waits in a collective (all-reduce, barrier) for a peer that never arrives hangs "
            "like this: check that every rank runs the same steps on the same number of batches."
        )
        return f"The launch did not finish within the timeout; all {self.nprocs} ranks were stopped. {hint}"

    def _failure_error(self, failure: BaseException | None) -> LaunchError:
        failures: dict[int, str] = {}
        primary = {r: e for r, e in self.errors.items() if not e.secondary}
        for rank, err in sorted(primary.items(), key=lambda item: item[1].time):
            failures[rank] = f"{err.type}: {err.message}"
        for rank, why in _elastic_failures(failure).items():
            if rank not in primary:  # died without raising: a signal or a hard exit
                failures.setdefault(rank, why)
        if not failures:  # only stop-induced errors: report them rather than nothing
            failures = {r: f"{e.type}: {e.message}" for r, e in self.errors.items()}
        if not failures:
            return LaunchError(f"The launch failed before any rank ran: {type(failure).__name__}: {failure}")
        ranks = ", ".join(f"rank {r}" for r in failures)
        lines = [f"{ranks} failed ({self.nprocs} processes launched; the others were stopped)."]
        for marker, hint in _FAILURE_HINTS:
            if any(marker in e.message for e in self.errors.values()):
                lines.append(hint)
        for rank, why in failures.items():
            lines.append(f"\n[rank {rank}] {why}")
            err = self.errors.get(rank)
            if err is not None:
                lines.append(err.traceback.rstrip())
            elif "SIGKILL" in why:
                lines.append(
                    "SIGKILL usually means the machine ran out of CPU memory (the OOM killer): "
                    "use a smaller batch or fewer dataloader workers."
                )
        return LaunchError("\n".join(lines), failures=failures, errors=self.errors)


def _elastic_failures(failure: BaseException | None) -> dict[int, str]:
    """{rank: why} from torch elastic's ChildFailedError, for ranks that died without raising."""
    described: dict[int, str] = {}
    for rank, proc in getattr(failure, "failures", {}).items():
        if proc.exitcode is not None and proc.exitcode < 0:
            described[rank] = f"died from signal {proc.signal_name()}"
        else:
            described[rank] = f"exited with code {proc.exitcode}"
    return described


def _is_interrupt(exc: BaseException) -> bool:
    """Torch elastic turns SIGINT into SignalException while its handlers are installed."""
    sigval = getattr(exc, "sigval", None)
    return sigval is not None and sigval in (signal.SIGINT, signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
    except OSError:  # no /proc (macOS): fall back to a signal probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _kill(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


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
def _launch_environment(use_cpu: bool, extra: dict[str, str]) -> Iterator[None]:
    values = {"NBKIT_LAUNCHED": "1", **extra}
    if use_cpu:
        values["ACCELERATE_USE_CPU"] = "true"
        if sys.platform.startswith("linux"):
            values.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    with environment(values):
        yield


@contextlib.contextmanager
def _elastic_quiet() -> Iterator[None]:
    """Torch elastic logs every failure at length; nbkit reports it once, as a LaunchError."""
    logs = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


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


@patching.patch(
    "accelerate.launchers:are_libraries_initialized",
    reason="notebook_launcher refuses to fork once bitsandbytes is merely imported, and peft imports it "
    "wherever it is installed (Kaggle), so `import peft` in a notebook blocked every launch. The "
    "real hazard is a CUDA context in the parent, which nbkit checks itself (check_can_fork).",
    upstream="https://github.com/huggingface/accelerate/issues/1807",
    group="launch",
)
def _fork_hazards_are_checked_by_nbkit(original: Callable[..., list[str]]) -> Callable[..., list[str]]:
    def are_libraries_initialized(*names: str) -> list[str]:
        return [name for name in original(*names) if name != "bitsandbytes"]

    return are_libraries_initialized


def _start(child: _Child, nprocs: int, port: int) -> None:
    if nprocs > 1:
        from accelerate import notebook_launcher

        patching.apply("launch")
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its "Launching training on N GPUs." line
                notebook_launcher(child, num_processes=nprocs, use_port=str(port), master_addr="127.0.0.1")
        finally:
            patching.revert("launch")
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
    with contextlib.redirect_stdout(io.StringIO()):
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
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdout, sys.stderr = self.stdout, self.stderr
        self.channel.attach(local_rank, rank)
        channel.send("started", os.getpid())
        import torch

        # The notebook's torch thread pools do not survive fork. On CPU a child that uses more than
        # one intra-op thread hangs in its first parallel op (landscape.md, "fork"), so it gets one.
        # On GPUs the child keeps its threads, but the pool is rebuilt here, while this is the only
        # thread: rebuilt lazily, two threads that start at once (autograd's device threads) can see
        # it half-replaced and abort with "Invalid thread pool" (seen with unsloth on 2 H200s).
        torch.set_num_threads(1 if self.use_cpu else torch.get_num_threads())
        try:
            _prepare_rank(quiet=self.quiet, rank=rank)
            value = self.fn(*self.args, **self.kwargs)
            if rank == 0:
                channel.send("result", pickle_for_notebook(value))
        except BaseException as exc:
            channel.send(
                "error",
                RankError(
                    rank=rank,
                    type=type(exc).__qualname__,
                    message=str(exc),
                    # tb_next: start the traceback in the user's function, not in this wrapper
                    traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next)),
                    time=time.time(),
                    secondary=isinstance(exc, KeyboardInterrupt) or _is_interrupt(exc),
                ),
            )
            raise
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()


def _prepare_rank(*, quiet: bool, rank: int) -> None:
    """Per-rank set-up shared by forked ranks and ranks of an outside launcher."""
    _route_output(rank, quiet)
    from nbkit import checkpoints, compat, integration, reporting

    integration.install()
    reporting.setup_rank()
    checkpoints.enable()
    compat.enable()


def _route_output(rank: int, quiet: bool) -> None:
    if rank == 0:
        return
    if quiet:
        devnull = open(os.devnull, "w")  # noqa: SIM115 (the rank's stdout for the rest of its life)
        sys.stdout = sys.stderr = devnull
        return
    sys.stdout = _Prefixed(sys.stdout, f"[rank {rank}] ")
    sys.stderr = _Prefixed(sys.stderr, f"[rank {rank}] ")


class _Prefixed(io.TextIOBase):
    r"""A text stream that starts every line written to `target` with `prefix`.

    Lines end at "\n" or at "\r" (progress bars redraw a line with "\r"); text is passed on at
    once, so the notebook sees a rank's output as it happens.
    """

    def __init__(self, target: Any, prefix: str):
        self._target, self._prefix, self._at_line_start = target, prefix, True

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        out = []
        for piece in re.split(r"(?<=[\r\n])", text):
            if not piece:
                continue
            if self._at_line_start:
                out.append(self._prefix)
            out.append(piece)
            self._at_line_start = piece.endswith(("\n", "\r"))
        self._target.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._target.fileno()


def pickle_for_notebook(value: Any) -> bytes:
    """Pickle rank 0's return value with every tensor moved to the CPU."""
    buf = io.BytesIO()
    try:
        CpuPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception as exc:
        raise TypeError(
            f"Rank 0's return value ({type(value).__name__}) cannot be sent back to the notebook: {exc}. "
            "Return plain data (numbers, strings, dicts, lists, CPU tensors) or save large objects to disk "
            "and return the path."
        ) from exc
    return buf.getvalue()


class CpuPickler(pickle.Pickler):
    """Pickles tensors from any device as CPU tensors, so unpickling never initialises CUDA."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def die_with_parent() -> None:
    """If the notebook kernel dies, take this rank down too (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
