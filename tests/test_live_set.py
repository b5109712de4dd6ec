"""nbkit.start / nbkit.connect from a plain Python process: 2 gloo CPU ranks, real processes.

The API a script or a notebook relies on: run() returns rank 0's value (notebook functions and
closures travel by value), exec() keeps names on the ranks, pull() brings a value back, names are
sent along, the ranks' reports reach the dashboard, status() describes the set, stop() leaves
nothing behind. The last test stands two engine groups, started separately on 127.0.0.1, in for
two hosts and makes one set of them with nbkit.connect.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

import nbkit
from nbkit.platform.errors import LiveError

pytestmark = [pytest.mark.slow, pytest.mark.version_independent]


@pytest.fixture(scope="module")
def ranks():
    live = nbkit.start(gpus=2)
    yield live
    live.stop()


def test_run_returns_rank_0s_value_and_takes_closures(ranks):
    offset = 100

    def where(extra):
        import torch
        import torch.distributed as dist

        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total)
        return {"rank": nbkit.rank(), "world": nbkit.world_size(), "sum": total.item(), "value": offset + extra}

    assert ranks.run(where, 1) == {"rank": 0, "world": 2, "sum": 1.0, "value": 101}
    assert ranks.run(lambda: os.environ["LOCAL_RANK"] + os.environ["MASTER_ADDR"]) == "0127.0.0.1"


def test_names_stay_on_each_rank_between_calls(ranks):
    ranks.exec("import nbkit\nmine = nbkit.rank() * 10")
    assert ranks.exec("mine + 1") == 1  # rank 0
    assert ranks.exec("mine + 1", ranks=1) == 11
    assert ranks.pull("mine") == 0 and ranks.pull("mine", rank=1) == 10
    with pytest.raises(LiveError, match="name 'missing' is not defined on rank 0"):
        ranks.pull("missing")


def test_names_are_sent_along_and_unsendable_ones_named(ranks):
    assert ranks.exec("y * 2", names={"y": 21}) == 42
    code = "ghost + 1"
    assert ranks.names_for(code, {"ghost": 1, "unused": 2}) == {"ghost": 1}
    ranks.exec("ghost = 5")  # defined on the ranks: from now on theirs, not the notebook's
    assert ranks.names_for(code, {"ghost": 1}) == {}
    with pytest.raises(LiveError, match="notebook's 'lock' \\(lock\\) cannot be sent to the ranks"):
        ranks.exec("lock", names={"lock": threading.Lock()})


def test_a_value_travels_once_and_again_when_rebound(ranks):
    data = [1, 2, 3]
    assert ranks.exec("len(data)", names={"data": data}) == 3
    data.append(4)  # in place: the ranks keep the copy they got, which shows that it was not sent again
    assert ranks.exec("len(data)", names={"data": data}) == 3
    assert ranks.exec("len(data)", ranks=1, names={"data": data}) == 3
    assert ranks.exec("len(data)", names={"data": data}, resend=["data"]) == 4  # forced
    data = data + [5]  # rebound to another object: it travels
    assert ranks.exec("len(data)", names={"data": data}) == 5
    assert ranks.exec("len(data)", ranks=1, names={"data": data}) == 5
    # Sent to rank 1 only, then read on every rank: rank 0 gets it too.
    data = [0]
    assert ranks.exec("len(data)", ranks=1, names={"data": data}) == 1
    assert ranks.exec("len(data)", names={"data": data}) == 1
    data.append(1)
    assert ranks.exec("len(data)", ranks=1, names={"data": data}, resend=True) == 2
    assert ranks.exec("len(data)", names={"data": data}) == 1  # rank 0's copy: sent before the change
    # A name a call binds is the rank's own: the same notebook object given again travels again.
    shared = {"v": 1}
    assert ranks.exec("shared['v']", names={"shared": shared}) == 1
    ranks.exec("shared = {'v': 2}")
    assert ranks.names_for("shared['v']", {"shared": shared}) == {}  # never replaced by a notebook object
    assert ranks.exec("shared['v']", names={"shared": shared}) == 1  # unless passed explicitly


def test_a_cell_that_does_not_parse_fails_before_anything_runs(ranks):
    from nbkit.platform.errors import CellSyntaxError

    ranks.exec("marker = 'before'")
    with pytest.raises(CellSyntaxError, match="line 2 of the cell does not parse") as info:
        ranks.exec("marker = 'after'\nif True\n    pass")
    assert info.value.lineno == 2 and info.value.text.startswith("if True")
    with pytest.raises(CellSyntaxError):
        ranks.names_for("y = (1,", {"y": 1})
    assert ranks.exec("marker") == "before"


def test_a_value_the_notebook_cannot_take_is_named(ranks):
    ranks.exec("class Point:\n    pass\np = Point()")
    with pytest.raises(LiveError, match=r"Rank 0's return value \(Point\) cannot be sent back to the notebook") as info:
        ranks.exec("p")
    assert not info.value.ended
    assert ranks.exec("type(p).__name__") == "Point"  # still there


def test_failure_keeps_the_ranks(ranks):
    ranks.exec("state = 'kept'")
    with pytest.raises(LiveError) as info:
        ranks.exec("import nbkit\nif nbkit.rank() == 1:\n    1 / 0")
    assert not info.value.ended and set(info.value.failures) == {1}
    assert "ZeroDivisionError" in str(info.value) and "1 / 0" in str(info.value)
    assert ranks.exec("state", ranks=1) == "kept"


def test_reports_reach_the_dashboard(ranks):
    import nbkit.dashboard

    ranks.exec("import nbkit\nnbkit.report(step=1, loss=0.5 + nbkit.rank(), total_steps=1)")
    board = nbkit.dashboard.latest()
    assert sorted(r for r, e in board.events if e.get("step") == 1) == [0, 1]
    assert board.snapshot().loss == 1.0  # the mean of 0.5 and 1.5


def test_status_and_bad_arguments(ranks):
    status = ranks.status()
    assert status.running and status.world_size == 2 and status.nnodes == 1
    assert [(r.rank, r.local_rank, r.device, r.alive) for r in status.ranks] == [
        (0, 0, "cpu", True),
        (1, 1, "cpu", True),
    ]
    assert "mine" in status.names
    with pytest.raises(ValueError, match="ranks must be 'all' or ranks 0..1"):
        ranks.exec("1", ranks=2)
    with pytest.raises(LiveError, match="already running"):
        nbkit.start(gpus=2)


C_LEVEL = (
    "import ctypes, os\nos.write(2, f'c-level {nbkit.rank()}\\n'.encode())\n"
    "ctypes.CDLL(None).printf(f'printf {nbkit.rank()}\\n'.encode())\nprint(f'py {nbkit.rank()}')"
)


def test_c_level_output_follows_the_ranks_a_call_shows(ranks, capsys):
    # What C and C++ code writes to descriptors 1 and 2 (torch's warnings) is shown like prints.
    ranks.exec("import nbkit\n" + C_LEVEL)
    out, err = capsys.readouterr()
    assert "c-level 0\n" in err and "printf 0\n" in out and "py 0\n" in out
    assert "c-level 1" not in err and "printf 1" not in out and "py 1" not in out
    ranks.exec(C_LEVEL, all_ranks=True)
    out, err = capsys.readouterr()
    assert "\nc-level 0\n" in "\n" + err and "\nprintf 0\n" in "\n" + out and "[rank 0]" not in out + err
    assert "[rank 1] c-level 1\n" in err and "[rank 1] printf 1\n" in out and "[rank 1] py 1\n" in out
    ranks.exec(C_LEVEL, ranks=1)  # the lowest rank a call runs on is shown as rank 0 is
    out, err = capsys.readouterr()
    assert "\nc-level 1\n" in "\n" + err and "\nprintf 1\n" in "\n" + out and "0" not in out + err


def test_display_of_the_shown_rank_reaches_the_notebook(ranks, capsys):
    # No kernel here: the notebook side prints what display() would show as text.
    ranks.exec("from IPython.display import display\nprint('before')\ndisplay({'shown by': nbkit.rank()})")
    out = capsys.readouterr().out
    assert out.splitlines() == ["before", "{'shown by': 0}"]


def test_stop_leaves_nothing_and_later_calls_say_so(ranks):
    live = ranks  # the module's set, stopped here (the tests before this one use it)
    # A DDP model that has just gathered a value stays on the ranks: their ends must not run its
    # destructors (nbkit.rank_side.teardown), and each rank ends by itself, at once.
    live.exec(
        "import torch, torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel\n"
        "ddp = DistributedDataParallel(torch.nn.Linear(4, 2))\nddp(torch.ones(2, 4)).sum().backward()\n"
        "got = [None, None]\ndist.all_gather_object(got, nbkit.rank())"
    )
    procs = psutil.Process().children(recursive=True)
    assert len(procs) >= 3
    tmpdir = live._engines.tmpdir
    engines = [r.process for r in live._engines.ranks]
    live.stop()
    _, alive = psutil.wait_procs(procs, timeout=3)
    assert [(p.pid, p.cmdline()) for p in alive] == []
    assert [e.returncode for e in engines] == [0, 0]  # ended themselves on SIGTERM (os._exit), none killed
    assert not os.path.exists(tmpdir)
    assert nbkit.live.current() is None
    with pytest.raises(LiveError, match="stopped"):
        live.exec("1")


@contextlib.contextmanager
def _engines_outside_nbkit(tmp_path, cluster_id: str, hosts: list[str | None]) -> Iterator[tuple[Any, list]]:
    """An ipyparallel controller and one engine per entry of `hosts` (its NBKIT_HOST, None for none),
    started the way a user starts them, not by nbkit; yields (client, engine processes) once all
    are up, and stops them all afterwards."""
    import ipyparallel as ipp

    cluster = ipp.Cluster(
        profile_dir=str(tmp_path), cluster_id=cluster_id, controller_ip="127.0.0.1", n=0, log_level=30
    )
    cluster.start_controller_sync()
    engines: list[subprocess.Popen] = []
    try:
        client = cluster.connect_client_sync()
        cmd = [sys.executable, "-m", "ipyparallel.engine", f"--file={cluster.controller.connection_files['engine']}"]
        for host in hosts:
            env = os.environ if host is None else {**os.environ, "NBKIT_HOST": host, "NBKIT_HOST_ADDRESS": "127.0.0.1"}
            engines.append(
                subprocess.Popen(
                    [*cmd, "--log-level=WARN"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        client.wait_for_engines(len(hosts), timeout=180)
        yield client, engines
    finally:
        for p in engines:
            p.kill()
            p.wait()
        cluster.stop_cluster_sync()


def test_two_engine_groups_make_one_set_of_two_nodes(tmp_path):
    """Two hosts, stood in for by two groups of 2 engines on 127.0.0.1 with their own NBKIT_HOST."""
    live = None
    with _engines_outside_nbkit(tmp_path, "t", ["node-a", "node-a", "node-b", "node-b"]) as (client, engines):
        try:
            live = nbkit.connect(client)
            status = live.status()
            assert status.world_size == 4 and status.nnodes == 2
            layout = [(r.rank, r.node_rank, r.local_rank, r.host) for r in status.ranks]
            first = layout[0][3]
            assert [row[:3] for row in layout] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
            assert {row[3] for row in layout[:2]} == {first}
            assert {row[3] for row in layout[2:]} == {"node-a", "node-b"} - {first}
            live.exec(
                "import os, json, torch, torch.distributed as dist\nt = torch.tensor([float(dist.get_rank())])\n"
                "dist.all_reduce(t)\nseen = json.dumps([t.item(), os.environ['GROUP_RANK'], os.environ['LOCAL_RANK'], "
                "os.environ['LOCAL_WORLD_SIZE'], os.environ['NBKIT_HOST']])",
                timeout=120,
            )
            seen = live.pull("seen", rank=2)
            assert json.loads(seen) == [6.0, "1", "0", "2", layout[2][3]]  # rank 2: node 1's first rank
            live.stop()
            # stop() leaves engines it did not start running, ready for another set.
            assert all(p.poll() is None for p in engines)
            live = nbkit.connect(client)
            assert live.run(lambda: nbkit.world_size()) == 4
        finally:
            if live is not None:
                live.stop()


def test_engines_started_outside_nbkit_outlive_a_failure_of_the_set(tmp_path):
    """A rank of a connected set dies mid-call: the set ends, and nbkit stops none of the user's engines."""
    live = None
    with _engines_outside_nbkit(tmp_path, "f", [None, None]) as (client, engines):
        try:
            live = nbkit.connect(client)
            victim = live.status().ranks[1].pid
            survivor = next(p for p in engines if p.pid == live.status().ranks[0].pid)
            threading.Timer(3, os.kill, (victim, 9)).start()
            with pytest.raises(LiveError) as info:
                live.exec("import time\ntime.sleep(60)", timeout=120)
            message = str(info.value)
            assert info.value.ended and "rank 1's connection to the notebook closed" in message, message
            assert "started outside nbkit and are left running" in message
            assert survivor.poll() is None  # not killed
            # It was interrupted and left the process group: it answers, ready for another set.
            engine = next(e for e in client.ids if client[e].apply_sync(os.getpid) == survivor.pid)
            left = client[engine].apply_async(eval, "__import__('torch.distributed').distributed.is_initialized()")
            assert left.get(timeout=30) is False
        finally:
            if live is not None:
                live.stop()


@pytest.mark.gpu
def test_one_rank_per_gpu_with_nccl_and_the_notebook_keeps_no_cuda_context():
    import torch

    gpus = len(nbkit.visible_gpus())
    if gpus < 2:
        pytest.skip("needs 2 GPUs")

    def reduce_on_the_gpu():
        import torch
        import torch.distributed as dist

        t = torch.ones(1, device=nbkit.device()) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return dist.get_backend(), str(t.device), t.item()

    with nbkit.start() as ranks:
        assert [r.device for r in ranks.status().ranks] == [f"cuda:{i}" for i in range(gpus)]
        backend, device, total = ranks.run(reduce_on_the_gpu)
        assert (backend, device, total) == ("nccl", "cuda:0", gpus * (gpus + 1) / 2)
        assert ranks.exec("str(torch.cuda.current_device())", ranks=1, names={"torch": torch}) == "1"
    assert not torch.cuda.is_initialized()  # the notebook process may still fork, or use its own GPU
