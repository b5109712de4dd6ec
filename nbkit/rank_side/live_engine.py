"""The rank side of a live set: what runs inside each ipyparallel engine (nbkit.live).

LiveRanks calls these functions through ipyparallel's apply. `setup()` turns a fresh engine into a
rank (environment, device, process group, nbkit's patches, the relay to the notebook); the others
run one call each in the rank's own namespace, which lives as long as the rank and holds every name
the cells define.

Output: a rank's output, Python's streams and descriptors 1 and 2 alike (C++ warnings), goes over
the relay while a call that shows this rank runs (rank 0 by default), and is dropped otherwise:
nbkit.rank_side.output, the routine one-shot ranks use too, set up once for the rank's life (libraries keep
the stream they found at import, and those imports happen inside calls). What a shown rank passes
to IPython's display() (an image, HTML, a DataFrame) goes the same way, as display data the notebook
shows in the cell; widgets do not (their state lives in the engine, which has no frontend).

Ending: an engine nbkit started ends on SIGTERM (stop()) with os._exit, running no destructor: a
rank's models, DDP reducers and process groups are freed by the end of the process, not by C++
destructors that can hang (nbkit.rank_side.teardown). Engines started outside nbkit keep ipyparallel's own
SIGTERM handling; teardown() gives them back as they were.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import faulthandler
import gc
import linecache
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import connection
from typing import Any

from nbkit.launching import rank_contract
from nbkit.messages import rank as channel
from nbkit.messages.live import CallDone, Display, EngineInfo, Interrupted, Outcome, Output, RankPlan
from nbkit.platform import config
from nbkit.platform.config import setting
from nbkit.platform.errors import RankError
from nbkit.rank_side import output

__all__ = ["free_port", "identify", "pull", "receive", "run_code", "run_function", "setup", "teardown"]


_rank = -1
_shown = False
_namespace: dict[str, Any] = {}
_crash_log: Any = None
_output: output.RankOutput | None = None
_found_display: Any = None  # the engine's own display publisher, while nbkit's stands in for it
_call_now = -1  # the call running, for the Interrupted notice
_notice_thread: list[threading.Thread] = []  # started with the first call
_found_sigint: list[Any] = []  # the SIGINT handler the call found, which _on_sigint passes the signal on to
_heard = threading.Event()  # set by the SIGINT handler; the notice goes from a thread (see _on_sigint)
_staged: dict[int, dict[str, bytes]] = {}  # {call: notebook names sent ahead of that call's code}


def identify() -> EngineInfo:
    """This engine's pid, node name, address and GPU count (before it is given a rank)."""
    host = setting("host") or socket.gethostname()
    address = setting("host_address")
    if not address:
        try:
            address = socket.gethostbyname(socket.gethostname())
        except OSError:
            address = "127.0.0.1"
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return EngineInfo(pid=os.getpid(), host=host, address=address, gpus=gpus)


def free_port(address: str) -> int:
    """A TCP port free on `address` now (asked of rank 0's engine, which hosts the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address if address != "localhost" else "127.0.0.1", 0))
        return int(sock.getsockname()[1])


def setup(plan: RankPlan) -> str:
    """Make this engine rank `plan.rank`: returns its device ("cuda:1", "cpu").

    Sets the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
    GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; NODE_RANK too) and `plan.env`, nbkit's rank
    environment (nbkit.launching.rank_contract.rank_environment: NBKIT_LAUNCHED, ACCELERATE_USE_CPU on the CPU, ...);
    joins the process group (nccl on cuda:local_rank, or gloo); connects to the notebook's
    relay; installs nbkit's patches, the Trainer dashboard callback and checkpoint handling (what
    nbkit.launch does in its ranks).
    Blocks until every rank of the set has joined (the rendezvous).
    """
    global _rank, _namespace
    _rank = plan.rank
    os.environ.update(
        {
            "RANK": str(plan.rank),
            "LOCAL_RANK": str(plan.local_rank),
            "WORLD_SIZE": str(plan.world_size),
            "LOCAL_WORLD_SIZE": str(plan.local_world_size),
            "GROUP_RANK": str(plan.node_rank),
            "GROUP_WORLD_SIZE": str(plan.nnodes),
            "NODE_RANK": str(plan.node_rank),
            "MASTER_ADDR": plan.master_addr,
            "MASTER_PORT": str(plan.master_port),
        }
    )
    os.environ.update(plan.env)  # nbkit's rank environment, made by the notebook (rank_contract.rank_environment)
    import torch
    import torch.distributed as dist

    rank_contract.set_rank_threads(use_cuda=plan.use_cuda, local_world_size=plan.local_world_size)
    if plan.use_cuda:
        torch.cuda.set_device(plan.local_rank)
        device = f"cuda:{plan.local_rank}"
    else:
        device = "cpu"
    # A native crash (segfault, abort) leaves the Python stack in the log of an engine nbkit started,
    # which the notebook shows under the message naming the signal. (The engine's fd 2 is a pipe
    # that ipykernel reads on a thread, which dies with the process before passing it on.)
    global _crash_log
    if setting("live_log") and _crash_log is None:
        _crash_log = open(setting("live_log"), "a")  # noqa: SIM115 (open for the rank's life)
        faulthandler.enable(file=_crash_log, all_threads=False)  # the crashing thread: the cell's
    conn = connection.Client(plan.relay, authkey=plan.authkey)
    channel.attach_connection(conn, plan.rank)
    channel.send(channel.Started(os.getpid()))
    global _output
    if _output is None:
        _output = output.RankOutput(_send_output, shown=lambda: _shown)
        _relay_display()
    if plan.owned and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _end_now)
    dist.init_process_group(
        backend="nccl" if plan.use_cuda else "gloo",
        init_method=f"tcp://{plan.master_addr}:{plan.master_port}",
        rank=plan.rank,
        world_size=plan.world_size,
        # NCCL's watchdog ends a rank whose collective waits longer (rank_contract.nccl_environment); gloo keeps
        # torch's default, its collectives fail as soon as a peer's connection closes.
        timeout=config.nccl_timeout() if plan.use_cuda else None,
    )
    # A live rank's output is shown or not per call (see _call), so only the rest of a launched
    # rank's set-up applies here.
    from nbkit.platform import patch_groups
    from nbkit.rank_side.setup import prepare_rank

    prepare_rank()
    patch_groups.install(
        "live"
    )  # an interrupt stops Trainer at a step every rank agrees on (nbkit.rank_side.live_stopping)
    _namespace = {"__name__": "__main__", "__builtins__": builtins}
    return device


def teardown() -> None:
    """Forget the rank's names, leave the process group, and give the engine's output back as it was
    (engines started outside nbkit live on). The names go first: a DDP model freed after its group
    was destroyed could hang the rank (nbkit.rank_side.teardown).
    """
    import torch.distributed as dist

    global _output
    _namespace.clear()
    _staged.clear()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    if _output is not None:
        _output.close()
        _output = None
        _restore_display()


def _end_now(signum: int, frame: Any) -> None:
    """SIGTERM in an engine nbkit started: end now, without running destructors (see the module doc)."""
    os._exit(0)


def _send_output(name: str, text: str) -> None:
    channel.send(Output(name, text))


def _relay_display() -> None:
    """display() on a shown rank goes over the relay: the engine's IPython display publisher gets a
    publish() of nbkit's (on the instance: everything else about the publisher stays the engine's).
    """
    global _found_display
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or _found_display is not None:
        return

    def publish(
        data: dict,
        metadata: dict | None = None,
        *args: Any,
        transient: dict | None = None,
        update: bool = False,
        **kwargs: Any,
    ) -> None:
        if _shown:
            if _output is not None:  # the rank's lines before it stay before it
                _output.drain()
            channel.send(Display(dict(data), dict(metadata or {}), dict(transient or {}), update))

    _found_display = shell.display_pub
    _found_display.publish = publish


def _restore_display() -> None:
    global _found_display
    if _found_display is not None:
        with contextlib.suppress(AttributeError):
            del _found_display.publish  # the class's publish again
        _found_display = None


def receive(call: int, names: dict[str, bytes]) -> None:
    """Keep `names` ({name: cloudpickled value}) for call `call`'s code (run_code), without touching the
    namespace: the notebook sends a cell's data first, as a request of its own, so that an interrupt
    while it travels can drop it (the request is aborted, or its data never used) and leave the rank's
    names as they were. Only the latest call's data is kept.
    """
    _staged.clear()
    _staged[call] = names


def run_code(call: int, source: str, filename: str, show: bool, want_value: bool) -> Outcome:
    """Run notebook cell `source` in this rank's namespace, after adding the names `receive()` kept for
    this call (none where it got none).

    The Outcome says whether the names were defined (names_loaded) even when the cell then failed:
    the notebook does not send them again while it holds the same objects.
    """
    loaded = False
    names = _staged.pop(call, {})

    def body() -> Any:
        nonlocal loaded
        from nbkit.notebook.cell_code import run_cell

        if names:
            _namespace.update(_rebuild(names))
            loaded = True
        # So that tracebacks show the cell's lines.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        return run_cell(source, _namespace, filename)

    return dataclasses.replace(_call(call, show, want_value, body), names_loaded=loaded)


def _rebuild(names: dict[str, bytes]) -> dict[str, Any]:
    """{name: value} of the notebook's cloudpickled `names`, all or none. Raises ModuleNotFoundError
    naming the notebook variable where its value needs a module this rank cannot import.
    """
    import cloudpickle

    values = {}
    for name, value in names.items():
        try:
            values[name] = cloudpickle.loads(value)
        except ModuleNotFoundError as exc:
            error = ModuleNotFoundError(
                f"the notebook's {name!r} cannot be rebuilt on rank {_rank}: it needs the module {exc.name!r}, "
                f"which the rank cannot import ({exc}). The notebook imports it from a folder on its own path "
                "(sys.path) that the ranks' path lacks: add that folder on the ranks first (a %%ddp cell: import "
                "sys; sys.path.insert(0, FOLDER)), or start the set with env={'PYTHONPATH': FOLDER}.",
                name=exc.name,
            )
            error.nbkit_says_it_all = True  # type: ignore[attr-defined]  # (see rank_contract.rank_traceback)
            raise error from None
    return values


def run_function(call: int, payload: bytes, show: bool, want_value: bool) -> Outcome:
    """Call the cloudpickled (fn, args, kwargs) in `payload`."""

    def body() -> Any:
        import cloudpickle

        fn, args, kwargs = cloudpickle.loads(payload)
        return fn(*args, **kwargs)

    return _call(call, show, want_value, body)


def pull(call: int, name: str, show: bool, want_value: bool) -> Outcome:
    """This rank's value of `name` (NameError if the rank has none)."""

    def body() -> Any:
        if name not in _namespace:
            raise NameError(f"name {name!r} is not defined on rank {_rank}")
        return _namespace[name]

    return _call(call, show, want_value, body)


def _call(call: int, show: bool, want_value: bool, body: Callable[[], Any]) -> Outcome:
    global _shown
    _shown = show
    _staged.clear()  # data of a call whose send was interrupted: never used
    failed = False
    answer: channel.Result | channel.Raised | channel.Returned
    previous = _listen_for_interrupts(call)
    try:
        value = body()
        answer = channel.Result(rank_contract.pickle_for_notebook(value)) if want_value else channel.Returned()
    except BaseException as exc:  # KeyboardInterrupt included: the rank stays alive
        failed = True
        answer = channel.Raised(_rank_error(exc))
    finally:
        if _output is not None:  # the call's last lines, both levels, while still shown
            with contextlib.suppress(Exception):
                _output.drain()
        _shown = False
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        channel.send(CallDone(call, failed))
    return Outcome(answer)


def _listen_for_interrupts(call: int) -> Any:
    """For the length of call `call`: tell the notebook when Python here sees SIGINT (it then knows that
    a rank that goes on runs code that caught the KeyboardInterrupt, not a collective). Returns the
    handler to put back (None off the main thread, where no handler can be set).
    """
    global _call_now
    if threading.current_thread() is not threading.main_thread():
        return None
    _call_now = call
    if not _notice_thread:
        thread = threading.Thread(target=_send_notices, name="nbkit-live-interrupted", daemon=True)
        thread.start()
        _notice_thread.append(thread)
    previous = signal.signal(signal.SIGINT, _on_sigint)
    if previous is not _on_sigint:  # (still ours where the last call could not put the found one back)
        _found_sigint[:] = [previous]
    return previous


def _on_sigint(signum: int, frame: Any) -> None:
    # The notice goes from a thread: this handler may run while the main thread holds the channel's
    # lock in the middle of a message, and sending here would deadlock on it.
    _heard.set()
    found = _found_sigint[0] if _found_sigint else None
    (found if callable(found) else signal.default_int_handler)(signum, frame)


def _send_notices() -> None:
    while True:
        _heard.wait()
        _heard.clear()
        with contextlib.suppress(Exception):
            channel.send(Interrupted(_call_now))


def _rank_error(exc: BaseException) -> RankError:
    return RankError(
        rank=_rank,
        type=type(exc).__qualname__,
        message=str(exc),
        traceback=rank_contract.rank_traceback(exc),
        time=time.time(),
        secondary=isinstance(exc, KeyboardInterrupt),
    )
