"""Loading progress on a live set, in a real kernel with 2 gloo ranks: rank 0's download and loading bars (the
hub's tqdm, which transformers' "Loading weights" and datasets use) reach the cell as text, once, not one per
rank and not as widgets the ranks cannot drive; training progress stays the dashboard's alone."""

from __future__ import annotations

import pytest
from kernel_cells import run_cells

BAR = (
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
    "start": "%load_ext nbkit\nimport nbkit\n%ddp start --gpus 2",
    "bars": BAR,
    "all_ranks": BAR.replace("%%ddp", "%%ddp --all-ranks", 1),
    "stop": "%ddp stop",
}


def _as_shown(text: str) -> list[str]:
    """The lines a frontend shows for stream text: each line as its last carriage return left it."""
    return [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n") if line.rstrip("\r")]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, kernel_name) -> dict[str, dict]:
    return run_cells(CELLS, tmp_path_factory.mktemp("live-progress"), kernel_name, timeout=300)


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
    shown = _as_shown(outputs["all_ranks"]["stderr"])
    assert [line.split("|")[0] for line in shown] == ["Fetching 7 files: 100%", "Loading weights: 100%"], shown
