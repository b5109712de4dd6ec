"""Bad arguments: each refused with one message naming the argument and what it takes, before any
process starts (the leftovers fixture checks that none did), in well under a second's work.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
from faultkit import assert_reruns

import nbkit
from nbkit.launching import rank_contract
from nbkit.launching import spawn as spawning
from nbkit.launching.rank_options import RankOptions
from nbkit.notebook import ddp_options
from nbkit.notebook.planner import plan
from nbkit.platform.errors import BringAlongError, CellSyntaxError, DatasetArgumentError, DatasetError

pytestmark = pytest.mark.usefixtures("leftovers")


def _touch(path: str) -> None:
    Path(path).touch()


@pytest.mark.parametrize(
    ("timeout", "error", "text"),
    [
        ("5", TypeError, "timeout must be a number of seconds (or None for no limit); got str '5'"),
        (True, TypeError, "got bool True"),
        (-5, ValueError, "finite number of seconds above 0 (or None for no limit); got -5"),
        (0, ValueError, "got 0"),
        (math.nan, ValueError, "got nan"),
        (math.inf, ValueError, "got inf"),
    ],
)
def test_timeout_is_refused_before_anything_starts(tmp_path, timeout, error, text):
    ran = tmp_path / "ran"
    start = time.monotonic()
    with pytest.raises(error) as caught:
        nbkit.launch(_touch, str(ran), gpus=2, timeout=timeout)
    assert text in str(caught.value)
    with pytest.raises(error, match="timeout must be"):
        nbkit.run_cell("1", {}, gpus=2, timeout=timeout, spawn=True)
    assert time.monotonic() - start < 5
    assert not ran.exists()


@pytest.mark.parametrize("gpus", [0, -1, 1.5, "2", True])
def test_gpus_must_be_a_whole_number_of_at_least_one(gpus):
    with pytest.raises(ValueError, match=r"gpus must be a positive whole number or None .*; got"):
        nbkit.launch(print, gpus=gpus)
    with pytest.raises(ValueError, match="gpus must be a positive whole number"):
        nbkit.run_cell("1", {}, gpus=gpus, spawn=True)


@pytest.mark.parametrize(
    "start_ranks",
    [lambda: nbkit.launch(print, gpus=1000), lambda: nbkit.start(gpus=1000)],
    ids=["launch", "live-start"],
)
def test_cpu_ranks_are_capped_instead_of_forking_a_thousand(start_ranks):
    limit = rank_contract.cpu_rank_limit()
    assert limit >= 8
    start = time.monotonic()
    with pytest.raises(ValueError) as caught:
        start_ranks()
    assert time.monotonic() - start < 5
    message = str(caught.value)
    assert "gpus=1000 would start 1000 CPU processes" in message and f"limit of {limit}" in message
    # refused before anything started (the leftovers fixture checks that no process did)
    assert nbkit.live.current() is None
    assert_reruns(2)


def test_spawn_mode_points_at_the_line_that_does_not_parse():
    with pytest.raises(CellSyntaxError) as caught:
        spawning.run_source("x = 1\nif x:\n    y = (2,\n", {}, RankOptions(gpus=2))
    error = caught.value
    assert isinstance(error, ValueError) and isinstance(error, nbkit.NbkitError)
    assert error.lineno == 3
    rendered = "\n".join(error._render_traceback_())
    assert rendered.count("\n") <= 3  # one short message, no nbkit frames
    assert "line 3 of the cell does not parse: '(' was never closed" in rendered
    assert "y = (2," in rendered


def test_spawn_mode_names_a_value_it_cannot_send():
    import threading

    with pytest.raises(BringAlongError, match="cannot bring 'lock' along.*cannot be pickled"):
        spawning.run_source("lock.locked()", {"lock": threading.Lock()}, RankOptions(gpus=2))


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"gpu_memory_gib": 0}, "gpu_memory_gib must be a finite number of GiB above 0, not 0"),
        ({"gpu_memory_gib": math.nan}, "not nan"),
        ({"gpu_memory_gib": math.inf}, "not inf"),
        ({"gpu_memory_gib": "15"}, "not '15'"),
        ({"gpus": 0, "gpu_memory_gib": 15}, "gpus must be a positive whole number, not 0"),
        ({"gpus": True, "gpu_memory_gib": 15}, "not True"),
    ],
)
def test_plan_refuses_numbers_out_of_range(kwargs, text):
    with pytest.raises(ValueError) as caught:
        plan("tiny:qwen3", **{"gpus": 2, **kwargs})
    assert text in str(caught.value)


def test_plan_of_a_model_that_does_not_exist_offline_is_one_message():
    with pytest.raises(ValueError) as caught:
        plan("nobody/no-such-model-7B", gpus=2, gpu_memory_gib=15)
    message = str(caught.value)
    assert message.startswith("Cannot read the config of 'nobody/no-such-model-7B'")
    assert "HF_HUB_OFFLINE=1" in message and "Pass a local path" in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # not transformers' chain


@pytest.mark.parametrize(
    ("line", "text"),
    [
        ("--gpus 0", "gpus must be a positive whole number"),
        ("--timeout 0", "timeout"),
        ("--timeout -5", "timeout"),
        ("--timeout nan", "timeout"),
        ("--out class", "--out needs a Python name"),
    ],
)
def test_ddp_cell_options_out_of_range(line, text):
    with pytest.raises(ddp_options.OptionsError, match=text):
        ddp_options.parse(line)


@pytest.fixture
def ten_rows(tmp_path: Path) -> str:
    """A local dataset of 10 rows (the datasets library reads it as a hub dataset, without the hub)."""
    rows = [{"image": f"i{i}", "text": f"t{i}", "messages": [{"role": "user", "content": str(i)}]} for i in range(10)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(tmp_path)


# datasets' progress bars start tqdm's monitor thread once, for the process: tqdm's, not a leftover of the case.
@pytest.mark.leftovers_ignore("threads")
@pytest.mark.parametrize("n", [-3, 0, 2.5, True, "10", None])
@pytest.mark.parametrize("load", ["image_text_dataset", "chat_dataset"])
def test_a_dataset_count_that_is_not_rows_is_refused_naming_n(ten_rows, load, n):
    for name in (ten_rows, "synthetic"):
        with pytest.raises(DatasetArgumentError, match=rf"n={re.escape(repr(n))}: nbkit.data takes how many rows"):
            getattr(nbkit.data, load)(name, n)
    assert len(getattr(nbkit.data, load)(ten_rows, 3)) == 3


@pytest.mark.leftovers_ignore("threads")  # tqdm's monitor, as above
def test_a_split_the_dataset_does_not_have_is_named_not_blamed_on_the_hub(ten_rows):
    with pytest.raises(DatasetError) as caught:
        nbkit.data.chat_dataset(ten_rows, 3, split="test")
    message = str(caught.value)
    assert "has no split 'test'" in message and "'train'" in message and "Internet" not in message
    with pytest.raises(DatasetArgumentError, match=r"split='train\[:5\]': pass the name of a split"):
        nbkit.data.image_text_dataset(ten_rows, 3, split="train[:5]")
