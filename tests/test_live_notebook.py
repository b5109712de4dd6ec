"""A live set (%ddp start) in a real Jupyter kernel run by nbclient, with 2 gloo CPU ranks.

One notebook tells the story a user lives: start the set; rank 0's download and loading bars (the hub's tqdm,
which transformers' "Loading weights" and datasets use) reach the cell as text, once, not one per rank and not as
widgets the ranks cannot drive; load tiny:qwen3 in one cell and train it
with Trainer in a later one (the same model object, its weights changed, the same on both ranks);
a notebook name used by a %%ddp cell, sent again after the notebook rebinds it (and only then, or with
--resend); a failing cell,
then a working one that still sees the model; --rank 0; --all-ranks; 50 cells in a row; the
dashboard getting the Trainer's events; %ddp status; %ddp stop leaving no process behind. The
fault cases (interrupts, killed ranks, timeouts, kernel death) are in tests/faults/test_live.py.
"""

from __future__ import annotations

import json

import pytest
from kernel_cells import run_cells

pytestmark = pytest.mark.slow

TRAIN = """%%ddp
import torch, torch.distributed as dist
from transformers import Trainer, TrainingArguments
before = {k: v.detach().clone() for k, v in model.named_parameters()}
g = torch.Generator().manual_seed(1)
data = [{"input_ids": (ids := torch.randint(8, 1000, (24,), generator=g)), "labels": ids} for _ in range(16)]
args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=steps, learning_rate=5e-3,
                         report_to=[], save_strategy="no", disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
changed = any(not torch.equal(before[k], v) for k, v in model.named_parameters())
weights = torch.cat([v.detach().flatten() for v in model.parameters()])
gathered = [torch.zeros_like(weights) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, weights)
json.dumps({"step": trainer.state.global_step, "world": args.world_size, "changed": changed,
            "same": all(torch.equal(gathered[0], w) for w in gathered[1:]), "model_id": id(model)})
"""

BARS = (
    "%%ddp\n"
    "import time\n"
    "from huggingface_hub.utils import tqdm\n"
    "for _ in tqdm(range(7), desc='Fetching 7 files'):\n"
    "    time.sleep(0.02)\n"
    "from transformers.utils import logging\n"
    "for _ in logging.tqdm(range(5), desc='Loading weights'):\n"
    "    time.sleep(0.02)\n"
    "nbkit.rank()"
)

CELLS = {
    "setup": "%load_ext nbkit\nimport os, json\nos.environ['NBKIT_DASHBOARD_INTERVAL'] = '0'\nscale = 10",
    "none_status": "%ddp status",
    "start": "%ddp start --gpus 2",
    "pids": "import nbkit\npids = [r.pid for r in nbkit.live.current().status().ranks]\nprint(json.dumps(pids))",
    # Right after the start, before anything is loaded or trained: only these cells' bars are drawn.
    "bars": BARS,
    "bars_all_ranks": BARS.replace("%%ddp", "%%ddp --all-ranks", 1),
    "load": (
        "%%ddp\nimport nbkit, json\nfrom transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(model_path)\n"
        "print(f'loaded on rank {nbkit.rank()}')\njson.dumps({'rank': nbkit.rank(), 'model_id': id(model)})"
    ),
    "train": TRAIN,
    "train_again": TRAIN,
    "events": (
        "import nbkit.dashboard as d\nprint(json.dumps(sorted({r for r, e in d.latest().events if 'loss' in e})))"
    ),
    "name": "%%ddp --out scaled\nnbkit.rank() * scale",
    "rename": "scale = 100",
    "name_again": "%%ddp\nscale * 2 + nbkit.rank()",
    "big": "big = list(range(5))\ndef times(x):\n    return x * factor\nfactor = 2",
    "big_read": "%%ddp\nlen(big), times(3)",
    "big_mutate": "big.append(5)\nfactor = 5",
    "big_read_again": "%%ddp\nlen(big), times(3)",
    "big_resend": "%%ddp --resend big\nlen(big)",
    "big_rebind": "big = big + [6]",
    "big_rebound": "%%ddp\nlen(big)",
    "big_on_ranks": "%%ddp\nbig = 'the ranks'",
    "big_in_notebook": "big = [0]",
    "big_kept": "%%ddp\nbig",
    "fail": "%%ddp\nkept = 'before the error'\nif nbkit.rank() == 1:\n    raise ValueError('rank one is broken')\n1",
    "after_fail": "%%ddp\njson.dumps({'kept': kept, 'has_model': model is not None, 'rank': nbkit.rank()})",
    "rank0": "%%ddp --rank 0\nprint('only on', nbkit.rank())\nnbkit.rank()",
    "rank1": "%%ddp --rank 1\nprint('only on', nbkit.rank())\nnbkit.rank()",
    "all_ranks": "%%ddp --all-ranks\nprint('hello from', nbkit.rank())",
    "display": "%%ddp\nfrom IPython.display import HTML, display\ndisplay(HTML(f'<b>rank {nbkit.rank()}</b>'))",
    "counter": "%%ddp\ncount = 0",
    **{f"cell{i}": "%%ddp\ncount += 1\ncount" for i in range(50)},
    "status": "%ddp status",
    "stop": "%ddp stop",
    "gone": "import psutil\nprint(json.dumps([p for p in pids if psutil.pid_exists(p)]))",
    "oneshot_rank": "%%ddp --rank 0 --gpus 2\n1",
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, kernel_name, tiny_text_path) -> dict[str, dict]:
    path = tmp_path_factory.mktemp("live-nb")
    cells = dict(CELLS)
    cells["setup"] += f"\nmodel_path = {tiny_text_path!r}\nout_dir = {str(path / 'out')!r}\nsteps = 3"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("NBKIT_DASHBOARD", raising=False)
        return run_cells(cells, path, kernel_name, timeout=600)


def _as_shown(text: str) -> list[str]:
    """The lines a frontend shows for stream text: each line as its last carriage return left it."""
    return [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n") if line.rstrip("\r")]


def _value(out: dict):
    assert out["error"] is None, out["error"] and "\n".join(out["error"].traceback)
    return json.loads(eval(out["result"]))  # the repr of the JSON text


def test_start_and_status(outputs):
    assert "no live set is running" in outputs["none_status"]["stdout"]
    assert outputs["start"]["error"] is None
    assert "live set of 2 rank(s) on cpu" in outputs["start"]["stdout"]
    status = outputs["status"]["stdout"]
    assert "rank 0: cpu" in status and "rank 1: cpu" in status and "alive" in status
    assert "model" in status  # the names the cells defined on the ranks


def test_rank_zeros_loading_bars_reach_the_cell_once_as_text(outputs):
    bars = outputs["bars"]
    assert bars["error"] is None, bars["error"] and "\n".join(bars["error"].traceback)
    text = bars["stdout"] + bars["stderr"]
    shown = _as_shown(bars["stderr"])
    assert [line.split("|")[0] for line in shown] == ["Fetching 7 files: 100%", "Loading weights: 100%"], shown
    assert "7/7" in shown[0] and "5/5" in shown[1]
    assert "[rank 1]" not in text
    # text, redrawn in place with "\r", not ipywidgets the frontend cannot get from a rank
    assert not [d for d in bars["displays"] if "application/vnd.jupyter.widget-view+json" in d]


def test_with_all_ranks_the_other_ranks_show_no_bars(outputs):
    shown = _as_shown(outputs["bars_all_ranks"]["stderr"])
    assert [line.split("|")[0] for line in shown] == ["Fetching 7 files: 100%", "Loading weights: 100%"], shown


def test_model_loaded_in_one_cell_is_trained_in_later_cells(outputs):
    loaded = _value(outputs["load"])
    assert loaded["rank"] == 0
    assert outputs["load"]["stdout"].strip() == "loaded on rank 0"  # only rank 0 prints by default
    first, second = _value(outputs["train"]), _value(outputs["train_again"])
    for run in (first, second):
        assert run["step"] == 3 and run["world"] == 2
        assert run["changed"] and run["same"]  # trained, and DDP kept the two ranks identical
        assert run["model_id"] == loaded["model_id"]  # the very object the load cell created
    assert json.loads(outputs["events"]["stdout"]) == [0, 1]  # the dashboard heard both ranks


def test_notebook_names_are_sent_with_their_current_value(outputs):
    assert outputs["name"]["result"] == "0"  # rank 0's value: 0 * 10
    assert outputs["name_again"]["result"] == "200"  # the changed notebook value, on rank 0


def test_a_notebook_value_travels_once_and_again_when_rebound(outputs):
    assert outputs["big_read"]["result"] == "(5, 6)"
    # `big` changed in place: the ranks keep the copy they got (it was not sent again); the notebook
    # function travels every time, with the notebook's current `factor`.
    assert outputs["big_read_again"]["result"] == "(5, 15)"
    assert outputs["big_resend"]["result"] == "6"  # --resend big
    assert outputs["big_rebound"]["result"] == "7"  # rebound in the notebook: sent again
    assert outputs["big_kept"]["result"] == "'the ranks'"  # a name the ranks bound is never replaced


def test_failing_cell_keeps_every_rank_and_its_names(outputs):
    error = outputs["fail"]["error"]
    assert error is not None and error.ename == "LiveError"
    text = "\n".join(error.traceback)
    assert "rank(s) 1 failed; the live set is still running" in text
    assert "ValueError: rank one is broken" in text and "raise ValueError" in text  # the rank's traceback
    after = _value(outputs["after_fail"])
    assert after == {"kept": "before the error", "has_model": True, "rank": 0}


def test_rank_selection_and_all_ranks(outputs):
    assert outputs["rank0"]["result"] == "0" and outputs["rank0"]["stdout"].strip() == "only on 0"
    assert outputs["rank1"]["result"] == "1" and outputs["rank1"]["stdout"].strip() == "only on 1"
    lines = outputs["all_ranks"]["stdout"].splitlines()
    assert sorted(lines) == ["[rank 1] hello from 1", "hello from 0"]


def test_display_of_rank_0_shows_in_the_cell(outputs):
    shown = outputs["display"]["displays"]
    assert [d.get("text/html") for d in shown] == ["<b>rank 0</b>"], shown  # rank 0's, once


def test_fifty_cells_in_a_row(outputs):
    assert [outputs[f"cell{i}"]["result"] for i in range(50)] == [str(i + 1) for i in range(50)]
    assert all(outputs[f"cell{i}"]["error"] is None for i in range(50))


def test_stop_leaves_no_process(outputs):
    assert "stopped the live set (2 rank(s))" in outputs["stop"]["stdout"]
    assert len(json.loads(outputs["pids"]["stdout"])) == 2
    assert json.loads(outputs["gone"]["stdout"]) == []


def test_one_shot_ddp_refuses_rank(outputs):
    out = outputs["oneshot_rank"]  # IPython shows a UsageError as one line on stderr
    assert "UsageError: %%ddp --rank runs a cell on some ranks of a live set, and none is running" in out["stderr"]
    assert out["result"] is None
