"""nbkit.supervisor: one cause, one story, whichever way the ranks were started.

Real processes on gloo: a rank that the kernel's OOM killer would end (SIGKILL) is named with the
same cause line and the same advice in a forked launch, a spawned launch and a live set.
"""

from __future__ import annotations

import signal

import pytest

import nbkit
from nbkit import spawning
from nbkit.supervisor import ExitStatus

# rank 1 dies as the OOM killer ends a process, while rank 0 waits for it in a collective
_CELL = (
    "import os, signal, torch.distributed as dist\n"
    "if not dist.is_initialized():\n    dist.init_process_group('gloo')\n"
    "if dist.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    "dist.barrier()\n"
)


def _killed_rank() -> None:
    exec(_CELL, {})


def _forked() -> str:
    with pytest.raises(nbkit.LaunchError) as caught:
        nbkit.launch(_killed_rank, gpus=2, dashboard=False)
    return str(caught.value)


def _spawned() -> str:
    with pytest.raises(nbkit.LaunchError) as caught:
        spawning.run_source(_CELL, {}, gpus=2, dashboard=False)
    return str(caught.value)


def _live() -> str:
    ranks = nbkit.start(gpus=2)
    try:
        with pytest.raises(nbkit.LiveError) as caught:
            ranks.exec(_CELL)
    finally:
        ranks.stop()
        nbkit.live.forget_ended()
    assert caught.value.ended
    return str(caught.value)


@pytest.mark.parametrize("run", [_forked, _spawned, _live], ids=["fork", "spawn", "live"])
def test_a_rank_killed_by_sigkill_gets_the_same_cause_and_advice_everywhere(run):
    message = run()
    killed = ExitStatus(signal=signal.SIGKILL)
    assert killed.cause == "died from signal SIGKILL"
    assert "rank 1" in message and killed.cause in message, message
    assert killed.hint in message, message  # the same advice, word for word
    assert "out of CPU memory" in killed.hint
