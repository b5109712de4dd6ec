"""The launching side of a benchmark launch: each in a fresh process group, watched from outside.

bench.py and trainer_bench.py run every launch through `run_process`: a fresh Python process
standing in for a notebook kernel (it calls nbkit.launch or notebook_launcher, `launch_here`) or a
script launcher (`accelerate launch`, torchrun), its output echoed and its last lines kept, stopped
at a time limit with its whole process group. A launch that fails, hangs or is killed leaves its
reason, the tail of its output and the JSON-lines rows it wrote (`read_rows`), and nothing of it
runs on into the next launch.

Launching only: what runs inside a rank is in runner.py (bench.py) and trainer_bench.run.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 40


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a launcher's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(device: str, gpus: int | None = None) -> dict[str, str]:
    """This process's environment for a launch: offline hub, unbuffered output, the repository on
    PYTHONPATH (so `benchmarks` imports in every rank), and CPU ranks for accelerate on "cpu".

    On "cuda" with `gpus` given, the launch sees only the first `gpus` of this process's visible GPUs
    (CUDA_VISIBLE_DEVICES): a one-GPU configuration runs on one GPU of a several-GPU host, as it would
    on a one-GPU machine (Trainer wraps a model in nn.DataParallel where one process sees several GPUs,
    which SFTTrainer refuses), so both sides of a scaling ratio come from one call on one host.
    """
    env = dict(os.environ)
    if device == "cuda" and gpus is not None:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = [i for i in visible.split(",") if i.strip()] if visible else [str(i) for i in range(_gpu_count())]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:gpus])
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if device == "cpu":
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def accelerate_command(gpus: int, log_dir: Path, script: str, *script_args: str) -> list[str]:
    """`accelerate launch` of `script` on `gpus` processes of this machine, no mixed precision or dynamo
    of accelerate's own (the script decides), a free rendezvous port, torch elastic's log folder in
    `log_dir` (without one it makes a torchelastic_* folder in the temporary directory and never removes it).
    """
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(gpus), "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    cmd += ["--log_dir", str(log_dir)]
    if gpus > 1:
        cmd.append("--multi_gpu")  # with ACCELERATE_USE_CPU=true this is gloo on the CPU
    return cmd + [script, *script_args]


def torchrun_command(gpus: int, log_dir: Path, script: str, *script_args: str) -> list[str]:
    """The torchrun command of `script` on `gpus` processes of this machine, meeting on a free port of 127.0.0.1,
    its log folder in `log_dir` (as accelerate_command's).

    torchrun, like `accelerate launch`, gives every rank OMP_NUM_THREADS=1 where the environment does
    not set it.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(gpus)]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--log-dir", str(log_dir)]
    return cmd + [script, *script_args]


def launch_from_kernel(fn: Callable[[Any], Any], spec: Any, preload: Callable[[Any], None]) -> int:
    """The whole job of a process standing in for a notebook kernel: preload(spec) (what a notebook has
    imported in earlier cells), then fn(spec) on spec.gpus ranks under the notebook launcher that
    spec.launcher names ("nbkit": nbkit.launch, quiet and without a dashboard; "live": a live set,
    nbkit.start, whose ranks run fn(spec) as a cell would, then stop; "notebook": accelerate's
    notebook_launcher), spec.launched_at set just before the call. Returns 0; a failure is recorded in
    spec.results_path (`record_launch_error`) and re-raised, so the process exits non-zero.
    """
    try:
        preload(spec)
        spec.launched_at = time.time()
        if spec.launcher == "nbkit":
            import nbkit

            nbkit.launch(fn, spec, gpus=spec.gpus, quiet=True, dashboard=False)
        elif spec.launcher == "live":
            import nbkit

            live = nbkit.start(gpus=spec.gpus)
            try:
                live.run(fn, spec)
            finally:
                live.stop()
        else:
            from accelerate import notebook_launcher

            notebook_launcher(fn, args=(spec,), num_processes=spec.gpus, use_port=str(free_port()))
    except BaseException as exc:
        record_launch_error(spec.results_path, exc)
        raise
    return 0


def script_rank(fn: Callable[[Any], Any], spec: Any, *, exported: bool = False) -> int:
    """The whole job of one rank of a script launch (accelerate launch, torchrun), then fn(spec).

    `exported` False: nbkit's default patch groups only (`nbkit.install()`: unsloth's fixes and the
    device-map guard), the set-up a script that uses no nbkit but its fixes gets. True: what a notebook
    cell exported by `%nbkit export` does under torchrun, `nbkit.launch(fn, spec)` inside the
    launcher's rank, which runs nbkit's whole per-rank set-up (rank_side.setup.prepare_rank) and then fn.
    Returns 0; a failure is recorded by rank 0 in spec.results_path and re-raised.
    """
    import nbkit

    try:
        if exported:
            nbkit.launch(fn, spec)
        else:
            nbkit.install()
            fn(spec)
    except BaseException as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            record_launch_error(spec.results_path, exc)
        raise
    return 0


def record_launch_error(results_path: str, exc: BaseException) -> None:
    """Append a `launch_error` line for `exc` to a launch's results (read back by `read_rows`)."""
    with open(results_path, "a") as f:
        f.write(json.dumps({"launch_error": f"{type(exc).__name__}: {exc}"[-4000:]}) + "\n")


def read_rows(path: Path) -> tuple[list[dict], str | None]:
    """(result rows, the last launch error or None) of a launch's JSON-lines file; none if it is missing."""
    rows, launch_error = [], None
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "launch_error" in entry:
                launch_error = entry["launch_error"]
            else:
                rows.append(entry)
    return rows, launch_error


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process's whole group, then SIGKILL what is left after 10 s."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
            return


def run_process(command: list[str], env: dict[str, str], timeout: float, workdir: str) -> tuple[str | None, list[str]]:
    """Run one launch's command in a new process group; returns (why it failed or None, its last lines).

    Its stdout and stderr are echoed here line by line as they come; the last TAIL_LINES are kept for
    the report. It runs in `workdir` under the temporary directory (created if need be: unsloth writes
    its compile cache into the working directory). A launch still running after `timeout` seconds
    is stopped ("launch stopped after the N s timeout"), one that exits non-zero is "launch exited
    with code N". Whatever ends the wait (a KeyboardInterrupt too, which is re-raised), the group is
    stopped if it is still there: a rank left behind must not hold the GPUs for the next launch.
    """
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    cwd = Path(tempfile.gettempdir()) / workdir
    cwd.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=env,
        start_new_session=True,
        cwd=str(cwd),
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    reason = None
    try:
        code = proc.wait(timeout=timeout)
        if code != 0:
            reason = f"launch exited with code {code}"
    except subprocess.TimeoutExpired:
        reason = f"launch stopped after the {timeout:.0f} s timeout"
    finally:
        if proc.poll() is None:
            stop(proc)
    reader.join(timeout=10)
    return reason, list(tail)
