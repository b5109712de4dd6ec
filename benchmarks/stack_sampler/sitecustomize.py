"""A sampling profiler for every Python process of a run, training processes included, with nothing installed.

Put this folder first on PYTHONPATH and set NBKIT_STACK_SAMPLES to a folder: every Python process started
with that environment (pytest, papermill's kernel, a live set's engines, launched ranks) then records, every
NBKIT_STACK_INTERVAL seconds (default 0.2), its main thread's Python stack while that thread is inside
transformers' training loop, one line per sample in NBKIT_STACK_SAMPLES/stacks-PID.txt:
"seconds<TAB>outermost;...;innermost" (frames as file:function). `python benchmarks/stack_report.py FOLDER`
summarises them.

Why not py-spy or torch's profiler: py-spy needs ptrace, which a container may not grant, and torch's profiler
has to be started inside the training code, which a notebook run under test does not offer; a thread that reads
sys._current_frames() needs neither, and costs one stack walk per sample.
"""

from __future__ import annotations

import os
import sys
import threading
import time

# The frame whose presence marks a sample as training: Trainer's loop (transformers 4.57 and 5).
_TRAINING = "_inner_training_loop"


def _frames(frame: object) -> list[str]:
    names = []
    while frame is not None:
        code = frame.f_code  # type: ignore[attr-defined]
        names.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back  # type: ignore[attr-defined]
    names.reverse()
    return names


def _sample(folder: str, interval: float) -> None:
    main = threading.main_thread()
    path = os.path.join(folder, f"stacks-{os.getpid()}.txt")
    began = time.monotonic()
    out = None
    # Ends when the main thread does, before the interpreter finalises: as a daemon thread, asleep when the
    # interpreter ended, it aborted processes at exit on the GPU host ("terminate called without an active
    # exception"; benchmarks/RESULTS.md).
    while main.is_alive():
        time.sleep(interval)
        frame = sys._current_frames().get(main.ident)  # type: ignore[arg-type]
        if frame is None:
            break
        names = _frames(frame)
        if not any(_TRAINING in name for name in names):
            continue
        if out is None:
            out = open(path, "a", buffering=1)  # noqa: SIM115 (open for the life of the process)
        out.write(f"{time.monotonic() - began:.2f}\t{';'.join(names)}\n")


def _start() -> None:
    folder = os.environ.get("NBKIT_STACK_SAMPLES")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    interval = float(os.environ.get("NBKIT_STACK_INTERVAL", "0.2"))
    threading.Thread(target=_sample, args=(folder, interval), name="nbkit-stack-sampler", daemon=False).start()


_start()
# A forked child (nbkit.launch's ranks) has no threads but the one that forked: it starts its own sampler.
os.register_at_fork(after_in_child=_start)
