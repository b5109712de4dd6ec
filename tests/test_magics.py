"""%%ddp and %nbkit in a real Jupyter kernel (nbclient), with 2 gloo CPU processes per launch.

One notebook runs the whole story, the way papermill would: a value comes back, a failing rank
fails the cell and the next %%ddp works, the dashboard's events and text lines arrive, a real fork
blocker (an accelerate PartialState in the kernel) switches %%ddp to spawn mode, the widget panel
ends as static HTML, and %nbkit doctor / plan run.
"""

from __future__ import annotations

import json

import pytest
from kernel_cells import run_cells

SECRET = "hf_DoNotPrintMe_4242"

CELLS = {
    "setup": "%load_ext nbkit\nimport os, json\nos.environ['NBKIT_DASHBOARD_INTERVAL'] = '0'\nbase = 40",
    "names": "def helper(r):\n    return base + r\n\nclass Box:\n    def __init__(self, v):\n        self.v = v\n\nbox = Box(2)",
    "train": (
        "%%ddp --gpus 2 --out res\nimport nbkit\nfor s in range(1, 3):\n"
        "    nbkit.report(step=s, loss=1.0 / s, total_steps=2, tokens=10)\n"
        "print(f'rank {nbkit.rank()} says hi')\nhelper(nbkit.rank()) + box.v"
    ),
    "inspect": (
        "import nbkit.dashboard as d\nprint(json.dumps({'res': res, 'events': [[r, e] for r, e in d.latest().events]}))"
    ),
    "fail": "%%ddp --gpus 2\nimport nbkit\nif nbkit.rank() == 1:\n    raise ValueError('rank one is broken')\n1",
    "widgets": "os.environ['NBKIT_DASHBOARD'] = 'widget'",
    "again": "%%ddp --gpus 2 --out again\nimport nbkit\nnbkit.report(step=1, loss=0.5, total_steps=1)\nbase + 2",
    "text": "os.environ['NBKIT_DASHBOARD'] = 'text'\nprint(again)",
    "doctor": "%nbkit doctor",
    "doctor_cpu": "%nbkit doctor --gpus 2",
    "plan": "%nbkit plan tiny:qwen3 --gpus 2 --gpu-memory 15 --seq-len 256",
    "plan_zero": "%nbkit plan tiny:qwen3 --gpus 2 --gpu-memory 0",
    "plan_batch": (
        "model, workers, gpu_model = 'tiny:qwen3', 2, 'cpu'\n"
        '%nbkit plan $model --gpus $workers --gpu-memory 15 --seq-len 256 --batch-size 2 --gpu-model "$gpu_model" '
        "--effective-batch 8\n"
        "%nbkit plan tiny:qwen3 --gpus 2 --gpu-memory 15 --gpu-model 'Tesla T4' --effective-batch 3"
    ),
    # A user's mistakes on this machine without a GPU, in fork mode (before the blocker) and in spawn mode (after)
    "no_gpus_start": "%ddp start",
    "no_gpus_cell": "%%ddp\n1",
    "too_many_ranks": "%%ddp --gpus 1000\n1",
    "no_such_profile": "%ddp start --gpus 2 --emulate X100",
    "blocker": (
        "import threading\nlock = threading.Lock()\nfrom accelerate import PartialState\nstate = PartialState()"
    ),
    "unbringable": "%%ddp --gpus 2\nlock",
    "help": "%%ddp -h\nraise SystemExit('the body of a -h cell must not run')",
    "start_help": "%ddp start -h",
    "spawned": (
        "%%ddp --gpus 2 --out spawned\nimport nbkit, math\nnbkit.report(step=1, loss=0.25, total_steps=1)\n"
        "[helper(nbkit.rank()), box.v, math.floor(2.5), type(box).__name__]"
    ),
    "no_gpus_spawned": "%%ddp\n1",
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, kernel_name) -> dict[str, dict]:
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_TOKEN", SECRET)  # the kernel inherits it
    mp.delenv("NBKIT_DASHBOARD", raising=False)
    try:
        return run_cells(CELLS, tmp_path_factory.mktemp("nb"), kernel_name, timeout=300)
    finally:
        mp.undo()


def test_ddp_cell_returns_rank_0s_value_and_stores_it(outputs):
    train = outputs["train"]
    assert train["error"] is None, train["error"]
    assert train["result"] == "42"  # rank 0: helper(0) + box.v = 40 + 0 + 2
    assert "rank 0 says hi" in train["stdout"] and "rank 1 says hi" not in train["stdout"]  # quiet ranks
    assert json.loads(outputs["inspect"]["stdout"])["res"] == 42


def test_dashboard_events_arrive_in_order_and_the_text_fallback_prints_them(outputs):
    events = json.loads(outputs["inspect"]["stdout"])["events"]
    for rank in (0, 1):
        mine = [e for r, e in events if r == rank]
        assert [e["step"] for e in mine] == [1, 2]
        assert [e["loss"] for e in mine] == [1.0, 0.5]
        assert all(
            e["total_steps"] == 2 and e["tokens_seen"] > 0 and "peak_memory_gib" in e and "elapsed" in e for e in mine
        )
    text = outputs["train"]["stdout"]
    assert "nbkit: step 1/2 (50%) | loss 1.0000" in text
    assert "nbkit: step 2/2 (100%) | loss 0.5000" in text
    assert "nbkit: finished after" in text and "peak memory rank 1 (cpu)" in text
    assert outputs["train"]["displays"] == []  # nbclient has no widget frontend: no panel


def test_a_failing_rank_fails_the_cell_with_its_traceback_and_the_next_ddp_runs(outputs):
    error = outputs["fail"]["error"]
    assert error is not None and error.ename == "LaunchError"
    assert "[rank 1] ValueError: rank one is broken" in error.evalue
    shown = "\n".join(error.traceback)
    assert shown.count("ValueError: rank one is broken") == 2  # the header line and the rank's traceback
    assert "raise ValueError('rank one is broken')" in shown  # the cell's own line
    assert "nbkit/notebook/magics.py" not in shown and "nbkit/notebook/cell_code.py" not in shown
    assert outputs["again"]["error"] is None and outputs["again"]["result"] == "42"
    assert outputs["text"]["stdout"].strip() == "42"


def test_widget_panel_is_left_as_a_static_summary_in_the_saved_notebook(outputs):
    displays = outputs["again"]["displays"]
    assert len(displays) == 1
    # the live widget was replaced in place (update_display_data) by HTML that needs no widget state
    assert "application/vnd.jupyter.widget-view+json" not in displays[0]
    html = displays[0]["text/html"]
    assert "nbkit-summary" in html and "final loss" in html and "0.5000" in html
    assert "data:image/png;base64," in html


def test_doctor_runs_and_never_prints_a_secret(outputs):
    doctor = outputs["doctor"]
    assert doctor["error"] is None, doctor["error"]
    assert "nbkit doctor" in doctor["stdout"] and "platform: local (Jupyter kernel)" in doctor["stdout"]
    assert "secrets set: HF_TOKEN" in doctor["stdout"]
    everything = json.dumps({k: {**v, "error": str(v["error"])} for k, v in outputs.items()})
    assert SECRET not in everything


def test_doctor_told_of_cpu_ranks_reports_no_gpu_as_info(outputs):
    out = outputs["doctor_cpu"]
    assert out["error"] is None and out["stderr"] == "", out
    assert "[info] No GPU is visible: the 2 rank(s) asked for are CPU processes." in out["stdout"]
    assert "[error] No GPU is visible" not in out["stdout"]


def test_plan_prints_the_planners_verdict(outputs):
    plan = outputs["plan"]
    assert plan["error"] is None, plan["error"]
    assert "Strategy: ddp" in plan["stdout"] and "256 tokens per GPU" in plan["stdout"]


def test_plan_passes_zero_on_and_shows_the_planners_refusal_in_one_line(outputs):
    # `0 in (None, False)` is True: --gpu-memory 0 was once dropped and the planner's default used.
    zero = outputs["plan_zero"]
    assert zero["error"] is None and zero["stdout"] == "" and "Strategy" not in zero["stderr"]
    lines = zero["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("UsageError: ") and "gpu_memory_gib" in lines[0], lines


def test_plan_prints_the_trainer_batch_it_chose_and_refuses_an_effective_batch_the_gpus_cannot_share(outputs):
    out = outputs["plan_batch"]
    assert out["error"] is None, out["error"]
    lines = out["stdout"].strip().splitlines()
    assert "Batch: 2 per process. Keep 2: the processes train on CPU cores (gpu='cpu')" in lines[-2]
    assert lines[-1].startswith("Trainer: 2 per process x 2 accumulation steps x 2 processes = 8 examples per optim")
    refused = out["stderr"].strip().splitlines()
    assert len(refused) == 1 and refused[0].startswith("UsageError: effective_batch=3 is not a multiple of the 2")
    assert "Use 2 or 4." in refused[0]


def test_a_name_that_cannot_be_brought_along_is_named(outputs):
    error = outputs["unbringable"]["error"]
    assert error is not None and error.ename == "BringAlongError"
    assert "cannot bring 'lock' along" in error.evalue


@pytest.mark.parametrize(
    ("cell", "text"),
    [
        ("no_gpus_start", "No GPU is visible to this notebook"),
        ("no_gpus_cell", "No GPU is visible to this notebook"),
        ("no_gpus_spawned", "No GPU is visible to this notebook"),
        ("too_many_ranks", "--gpus 1000 would start 1000 CPU processes"),
        ("no_such_profile", "--emulate must name a GPU profile, one of 'T4'"),
    ],
)
def test_a_mistake_in_a_magic_is_one_usage_line_naming_the_option(outputs, cell, text):
    out = outputs[cell]
    assert out["error"] is None and out["stdout"] == "", out  # IPython shows a UsageError on stderr, alone
    lines = out["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"UsageError: {text}"), lines
    assert "gpus=" not in lines[0]  # the API's spelling, not the magic's
    if "No GPU" in text:
        assert "add --gpus N" in lines[0]


def test_spawn_mode_runs_after_a_real_fork_blocker_and_brings_names_along(outputs):
    spawned = outputs["spawned"]
    assert spawned["error"] is None, spawned["error"]
    assert spawned["result"] == "[40, 2, 2, 'Box']"
    line = next(line for line in spawned["stdout"].splitlines() if "spawn mode" in line)
    assert "accelerate" in line and "PartialState" in line  # why
    brought = line.split("Brought along: ")[1]
    assert all(name in brought for name in ("box", "helper", "Box", "base"))
    assert "nbkit: step 1/1 (100%) | loss 0.2500" in spawned["stdout"]  # the dashboard still gets the events


@pytest.mark.gpu
def test_after_cuda_is_initialised_in_the_kernel_ddp_spawns_and_uses_every_gpu(tmp_path, kernel_name):
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip("needs 2 GPUs")
    out = run_cells(
        {
            "setup": "%load_ext nbkit\nimport torch\nx = torch.ones(3, device='cuda')  # inference in the notebook",
            "train": (
                "%%ddp --out r\nimport torch, nbkit, torch.distributed as dist\n"
                "torch.cuda.set_device(nbkit.local_rank())\ndist.init_process_group('nccl')\n"
                "t = torch.ones(1, device='cuda') * (nbkit.rank() + 1)\ndist.all_reduce(t)\n"
                "nbkit.report(step=1, loss=t.item(), total_steps=1)\ndist.destroy_process_group()\n"
                "(t.item(), x.sum().item(), str(x.device))"
            ),
        },
        tmp_path,
        kernel_name,
        timeout=300,
    )
    train = out["train"]
    assert train["error"] is None, train["error"]
    assert "spawn mode" in train["stdout"] and "CUDA is already initialised" in train["stdout"]
    # every GPU took part; x came along on the CPU
    assert train["result"] == repr((float(gpus * (gpus + 1) // 2), 3.0, "cpu"))


_DDP_OPTIONS = ("--gpus N", "--out NAME", "--timeout S", "--all-ranks", "--env KEY=VALUE", "--spawn", "--rank N")
_NEW_OPTIONS = ("--strategy {ddp,fsdp}", "--emulate PROFILE")


def _one_line_each(text: str, options: tuple[str, ...]) -> None:
    for option in options:
        lines = [line for line in text.splitlines() if line.strip().startswith(option)]
        assert len(lines) == 1 and len(lines[0].split(None, 2)) >= 2, (option, text)
        assert len(lines[0].strip()) > len(option) + 5, (option, lines)  # its help is on the same line


def test_dash_h_lists_every_option_one_line_each_and_runs_nothing(outputs):
    shown = outputs["help"]
    assert shown["error"] is None, shown
    _one_line_each(shown["stdout"], (*_DDP_OPTIONS, *_NEW_OPTIONS, "--resend"))
    start = outputs["start_help"]
    assert start["error"] is None and "%ddp start" in start["stdout"], start
    _one_line_each(start["stdout"], ("--gpus N", "--timeout S", "--env KEY=VALUE", *_NEW_OPTIONS))


def test_question_mark_shows_the_options_of_each_magic(kernel_name, tmp_path):
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name=kernel_name, cwd=str(tmp_path))
    try:
        client.execute_interactive("%load_ext nbkit", timeout=60)
        pages = {}
        for query in ("%%ddp?", "%ddp?", "%nbkit?"):
            reply = client.execute_interactive(query, timeout=60)
            pages[query] = "\n".join(p["data"]["text/plain"] for p in reply["content"]["payload"])
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    _one_line_each(pages["%%ddp?"], (*_DDP_OPTIONS, *_NEW_OPTIONS))
    _one_line_each(pages["%ddp?"], ("--gpus N", "--timeout S", *_NEW_OPTIONS))
    _one_line_each(pages["%nbkit?"], ("--seq-len N", "--gpu-memory GIB", "--effective-batch N", "-o OUT"))


def test_cell_analysis_finds_the_names_a_cell_reads_before_binding_them():
    from nbkit.notebook.cell_code import free_names, run_cell

    source = (
        "import math as m\nx = y + 1\n"
        "def f(a, b=default):\n    return a + g(b) + z + m.pi\n"
        "def g(q):\n    return q\n"
        "class C(Base):\n    k = kval\n"
        "squares = [i * i for i in items]\n"
        "try:\n    pass\nexcept Err as e:\n    print(e)\n"
        "with open(path) as fh:\n    fh.read()\n"
        "f(x)\n"
    )
    # builtin names count: the notebook may bind them (the callers keep only the notebook's names)
    assert free_names(source) == {"y", "default", "z", "Base", "kval", "items", "Err", "path", "print", "open"}
    namespace = {"y": 1}
    assert run_cell("a = y + 1\na * 10", namespace) == 20 and namespace["a"] == 2
    assert run_cell("b = 3", namespace) is None


def test_bring_along_pickles_notebook_functions_by_value_and_names_what_it_cannot():
    import linecache
    import math
    import threading

    from nbkit.notebook.notebook_names import bring_along
    from nbkit.platform.errors import BringAlongError

    namespace = {"m": math, "scale": 3, "lock": threading.Lock(), "lam": lambda x: x * 2}
    # as IPython defines a function in a cell: source in linecache, module __main__
    source = "def helper(x):\n    return m.sqrt(x) * scale\n\ndef make(k):\n    return lambda x: x + k\n"
    linecache.cache["<cell 7>"] = (len(source), None, source.splitlines(True), "<cell 7>")
    exec(compile(source, "<cell 7>", "exec"), namespace)
    for name in ("helper", "make", "lam"):
        namespace[name].__module__ = "__main__"
    namespace["add3"] = namespace["make"](3)  # a closure
    brought = bring_along("helper(4) + lam(1) + add3(1)", namespace)
    assert brought.names == ("add3", "helper", "lam")
    assert set(brought.reached) == {"add3", "helper", "lam", "m", "scale"}  # helper's globals come too
    rank = {"__builtins__": __builtins__}
    brought.load_into(rank)
    assert rank["helper"](4) == 6.0 and rank["lam"](1) == 2 and rank["add3"](1) == 4
    assert rank["helper"].__globals__ is rank  # notebook functions read the rank's names, as in the notebook
    rank["scale"] = 10
    assert rank["helper"](4) == 20.0
    with pytest.raises(BringAlongError, match="cannot bring 'lock' along.*cannot be pickled"):
        bring_along("lock.acquire()", namespace)
