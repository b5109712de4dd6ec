"""Faults of a live set (%ddp start) in a real Jupyter kernel, 2 gloo CPU ranks, real signals.

Each test says what a user does or suffers and checks what they rely on: the message (which rank,
which signal), how soon the cell ends, that the ranks stay up (with their names) where they should,
that a new set starts at once where the old one ended, and that no process is left behind. Times
are asserted with a wide margin over the 2 s targets: the machine is shared and slow.
"""

from __future__ import annotations

import os
import signal

import pytest
from faultkit import MARGIN_S, Kernel, ended_the_set, fresh_set, still_running

pytestmark = pytest.mark.slow
# version_independent: live sets whose cells use torch alone. Not the timeout case, which ends in a one-shot
# %%ddp cell (accelerate's notebook_launcher).


@pytest.mark.version_independent
def test_interrupt_stops_the_cell_on_every_rank_and_keeps_them(kernel):
    procs = fresh_set(kernel)
    cell = "%%ddp\nprint('running', flush=True)\nwhile True:\n    time.sleep(0.05)"
    out = kernel.run(cell, interrupt_on="running")
    assert out["error"] is not None and out["error"][0] == "KeyboardInterrupt", out
    assert out["seconds"] < MARGIN_S, out["seconds"]
    assert "interrupted the cell on rank(s) 0, 1; every rank is alive" in out["stderr"]
    after = kernel.run("%%ddp\nx + 1 + nbkit.rank()")
    assert after["error"] is None and after["result"] == "42", after
    assert [p.pid for p in procs if not p.is_running()] == []  # the same processes


@pytest.mark.version_independent
def test_interrupt_of_a_rank_waiting_in_a_collective_ends_the_set(kernel):
    procs = fresh_set(kernel)
    cell = (
        "%%ddp\nimport torch.distributed as dist\nprint('running', flush=True)\n"
        "if nbkit.rank() == 0:\n    dist.barrier()  # rank 1 never comes\nelse:\n    time.sleep(3600)"
    )
    out = kernel.run(cell, interrupt_on="running")
    ended_the_set(out, procs, "rank(s) 0 did not answer the interrupt within 2 s", within_s=MARGIN_S)
    assert kernel.run("print(nbkit.live.current())")["stdout"].strip() == "None"


@pytest.mark.version_independent
def test_killed_rank_ends_the_set_naming_it_and_start_works_again(kernel):
    procs = fresh_set(kernel)
    cell = (
        "%%ddp\nprint('running', flush=True)\nif nbkit.rank() == 1:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(120)"
    )
    out = kernel.run(cell)
    says = ("rank 1 (pid ", "died from signal SIGKILL", "%ddp start")
    ended_the_set(out, procs, *says, within_s=MARGIN_S + 1)  # + 1: the cell itself printed first
    # The next %%ddp cell does not quietly become a one-shot run that lacks the set's names.
    orphan = kernel.run("%%ddp\nmodel")
    assert orphan["error"] is not None and orphan["error"][0] == "LiveError", orphan
    assert "The live set has ended: rank 1 (pid" in orphan["error"][1] and "%ddp start" in orphan["error"][1]
    assert "SIGKILL.) " not in orphan["error"][1]  # the reason is a sentence of its own, not nested in brackets
    # %ddp status says the same: that it ended, why, and what to do (not "no live set is running").
    status = kernel.run("%ddp status")["stdout"]
    assert "nbkit: the live set has ended: rank 1 (pid " in status and "died from signal SIGKILL" in status, status
    assert "%ddp start" in status and "%ddp stop makes %%ddp cells one-shot again" in status, status
    # A new set at once, with a clean namespace.
    again = kernel.run("%ddp start --gpus 2")
    assert again["error"] is None and "live set of 2 rank(s)" in again["stdout"], again
    fresh = kernel.run("%%ddp\n'x' in globals(), nbkit.rank()")
    assert fresh["result"] == "(False, 0)", fresh


@pytest.mark.version_independent
def test_segfault_names_the_signal(kernel):
    procs = fresh_set(kernel)
    out = kernel.run("%%ddp\nimport ctypes\nif nbkit.rank() == 0:\n    ctypes.string_at(0)\ntime.sleep(120)")
    text = ended_the_set(out, procs, "rank 0 (pid ", "died from signal SIGSEGV")
    # The ended set is not the running one any more, from the moment the cell says so (the monitor thread that
    # ended it may still be closing its connections): the next cell can start a new set.
    assert kernel.run("print(nbkit.live.current())")["stdout"].strip() == "None"
    # faulthandler's stack of the crashing rank comes with it: ctypes, then the cell's line 3 (under %%ddp).
    crash = text[text.index("Fatal Python error: Segmentation fault") :].splitlines()
    assert "in string_at" in crash[3] and "line 3 in <module>" in crash[4], crash


def test_cell_hanging_in_a_collective_ends_at_its_timeout(kernel):
    procs = fresh_set(kernel)
    cell = "%%ddp --timeout 4\nimport torch.distributed as dist\nif nbkit.rank() == 0:\n    dist.barrier()"
    out = kernel.run(cell)
    says = "did not finish within its timeout (4 s); rank(s) 0 were still running"
    ended_the_set(out, procs, says, within_s=4 + MARGIN_S)
    assert out["seconds"] >= 4
    # %ddp stop acknowledges the ended set; %%ddp is one-shot again.
    stopped = kernel.run("%ddp stop")
    assert "the live set had ended: the call did not finish" in stopped["stdout"], stopped
    assert "%%ddp cells are one-shot again" in stopped["stdout"]
    oneshot = kernel.run("%%ddp --gpus 2\nimport nbkit\nnbkit.world_size()")
    assert oneshot["error"] is None and oneshot["result"] == "2", oneshot


@pytest.mark.version_independent
def test_rank_failing_while_another_waits_in_a_collective_ends_the_set(kernel):
    procs = fresh_set(kernel)
    cell = (
        "%%ddp\nimport torch.distributed as dist\nif nbkit.rank() == 1:\n    raise RuntimeError('no data on rank 1')\n"
        "dist.barrier()"
    )
    out = kernel.run(cell)
    says = (
        "RuntimeError: no data on rank 1",
        "rank(s) 1 failed, and rank(s) 0 neither finished nor answered an interrupt",
    )
    ended_the_set(out, procs, *says, within_s=3 + MARGIN_S)


@pytest.mark.version_independent
def test_a_cell_that_does_not_parse_is_one_short_message_and_the_set_lives_on(kernel):
    procs = fresh_set(kernel)
    out = kernel.run("%%ddp\nx = 1\ny = (x,\n")
    assert out["error"] is not None and out["error"][0] == "CellSyntaxError", out
    shown = out["error"][2]
    assert "line 2 of the cell does not parse: '(' was never closed" in shown and "y = (x," in shown, shown
    assert len(shown.splitlines()) <= 4 and "nbkit/" not in shown  # none of nbkit's frames
    assert kernel.run("%%ddp\nx")["result"] == "41"  # nothing ran: line 1 did not either
    assert [p.pid for p in procs if not p.is_running()] == []


@pytest.mark.version_independent
def test_a_rank_the_set_does_not_have_is_a_one_line_usage_error(kernel):
    fresh_set(kernel)
    out = kernel.run("%%ddp --rank 1 5\nx = 0")
    assert out["error"] is None and out["result"] is None, out  # IPython shows a UsageError as one line
    assert "UsageError: --rank 5: the live set has 2 rank(s), numbered 0 to 1." in out["stderr"], out
    assert "Traceback" not in out["stderr"] and "notebook.py" not in out["stderr"]
    assert kernel.run("%%ddp --rank 1\nx")["result"] == "41"  # nothing ran, not even on rank 1


@pytest.mark.version_independent
def test_second_start_says_one_is_running(kernel):
    fresh_set(kernel)
    out = kernel.run("%ddp start --gpus 2")
    assert out["error"] is not None and out["error"][0] == "LiveError"
    assert "already running in this notebook" in out["error"][1]
    assert kernel.run("%%ddp\nx")["result"] == "41"  # the running set is untouched


@pytest.mark.version_independent
def test_kernel_death_leaves_no_process(kernel_name, tmp_path):
    k = Kernel(kernel_name, str(tmp_path))
    try:
        assert k.run("%load_ext nbkit\n%ddp start --gpus 2")["error"] is None
        procs = k.descendants()
        assert len(procs) >= 3
        os.kill(k.pid, signal.SIGKILL)  # no atexit, no cleanup: only the processes' own watch
        assert still_running(procs) == []
    finally:
        k.close()
