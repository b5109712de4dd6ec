"""`python -m nbkit.live._proc PARENT_PID MODULE [ARGS...]`: run MODULE as `python -m` would, and end
when PARENT_PID is gone.

nbkit.start runs the ipyparallel controller and every engine through this, so that none of them
outlives the notebook kernel, however it ends (restart, crash, SIGKILL): the kernel's atexit handler
does not run when it is killed, and ipyparallel starts its processes in their own sessions, where
no signal of the kernel reaches them. A thread checks the parent every 0.2 s (PR_SET_PDEATHSIG
alone would not do: it fires when the *thread* that started the process ends, and ipyparallel
starts the controller from a helper thread). A process forked from it (the controller forks its
heart monitor) watches its own parent the same way, so the chain ends from the top. Processes that a
rank's cells start stay in the engine's process group, which the engine ends with itself.

An engine starts beside the controller, before the controller has written how to reach it: with
NBKIT_LIVE_CONNECTION_FILE set, this waits for that file and hands its content to the engine as
$IPP_CONNECTION_INFO; with NBKIT_LIVE_PRELOAD set, it imports those modules (torch) on a thread meanwhile,
and while the engine registers (see nbkit.live.engines).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import sys
import threading
import time

_POLL_S = 0.2
CONNECTION_FILE_ENV = "NBKIT_LIVE_CONNECTION_FILE"
PRELOAD_ENV = "NBKIT_LIVE_PRELOAD"


def watch_parent(parent_pid: int) -> None:
    """End this process (SIGKILL) as soon as `parent_pid` is no longer its parent; likewise every
    process forked from it, with its own parent. A process that leads its own process group (nbkit's
    engines, each in a session of its own) takes the whole group with it: the processes its cells
    started (subprocess.Popen, multiprocessing's spawn children), which no watch of their own covers.
    """
    if os.getppid() != parent_pid:  # the parent died before we got here
        _end_self()

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_POLL_S)
        _end_self()

    threading.Thread(target=watch, name="nbkit-watch-parent", daemon=True).start()


def _end_self() -> None:
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)  # this process too
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_after_fork() -> None:
    watch_parent(os.getppid())


def _preload(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # the call that needs it imports it again, and says what failed
            pass


def _connection_info(path: str) -> str:
    """The content of the controller's connection file `path`, once it is there and whole (the controller writes
    it in place: a read can find it half written).
    """
    while True:
        try:
            with open(path) as f:
                text = f.read()
            json.loads(text)
            return text
        except (OSError, ValueError):
            time.sleep(0.02)


def main() -> None:
    parent_pid, module = int(sys.argv[1]), sys.argv[2]
    watch_parent(parent_pid)
    os.register_at_fork(after_in_child=_watch_after_fork)
    # Read, then removed: processes that the engine's cells start inherit its environment.
    preload, connection_file = os.environ.pop(PRELOAD_ENV, ""), os.environ.pop(CONNECTION_FILE_ENV, "")
    if preload:
        # The module's own imports first: two threads importing the same modules at once is where a circular
        # import could deadlock; the preload's (torch's) and the engine's later ones (IPython's) do not meet.
        importlib.import_module(module)
        threading.Thread(target=_preload, args=(preload.split(","),), name="nbkit-preload", daemon=True).start()
    if connection_file:
        os.environ["IPP_CONNECTION_INFO"] = _connection_info(connection_file)
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
