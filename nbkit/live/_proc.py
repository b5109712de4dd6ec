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
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

_POLL_S = 0.2


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


def main() -> None:
    parent_pid, module = int(sys.argv[1]), sys.argv[2]
    watch_parent(parent_pid)
    os.register_at_fork(after_in_child=_watch_after_fork)
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
