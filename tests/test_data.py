"""nbkit.data: the vision notebooks' datasets. Only "synthetic" gives the synthetic set; a hub dataset that cannot
be loaded fails the cell, in a real kernel, with a message naming the dataset and what to check."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

import nbkit
from nbkit.platform.errors import DatasetError, NbkitError
from nbkit.training.data import image_text_dataset

REPO = Path(__file__).resolve().parents[1]


def test_synthetic_gives_images_and_their_words():
    dataset = image_text_dataset("synthetic", 6, image_size=32)
    assert dataset.column_names == ["image", "text"] and len(dataset) == 6
    assert dataset[0]["image"].size == (32, 32) and dataset[0]["text"]
    assert [row["text"] for row in image_text_dataset("synthetic", 6, image_size=32)] == dataset["text"]


def test_a_dataset_that_cannot_be_loaded_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DatasetError) as caught:
        image_text_dataset("someone/no-such-dataset", 4)
    message = str(caught.value)
    assert "'someone/no-such-dataset'" in message and "Internet on" in message and "HF_HUB_OFFLINE" in message
    assert "HF_TOKEN" in message and 'dataset_name = "synthetic"' in message
    assert isinstance(caught.value, NbkitError) and caught.value.__cause__ is not None


def test_a_local_dataset_without_the_columns_says_which_it_has(tmp_path):
    (tmp_path / "data.jsonl").write_text(json.dumps({"picture": "x", "latex": "y"}) + "\n")
    with pytest.raises(DatasetError, match=r"no column 'image', 'text' \(it has \['picture', 'latex'\]\)"):
        image_text_dataset(str(tmp_path), 1)
    renamed = image_text_dataset(str(tmp_path), 1, columns=("picture", "latex"))
    assert renamed.column_names == ["image", "text"] and renamed[0]["text"] == "y"


def test_in_a_kernel_the_cell_fails_with_the_message_and_the_kernel_stays_usable(tmp_path, monkeypatch):
    kernels = tmp_path / "jupyter" / "kernels" / "here"
    kernels.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"], "display_name": "here"}
    (kernels / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("import nbkit\ndataset_name = 'someone/no-such-dataset'"),
        nbformat.v4.new_code_cell("dataset = nbkit.data.image_text_dataset(dataset_name, 8)"),
        nbformat.v4.new_code_cell("print(nbkit.__file__, 'still here')"),
    ]
    client = NotebookClient(notebook, kernel_name="here", timeout=300, resources={"metadata": {"path": str(tmp_path)}})
    with pytest.raises(CellExecutionError):
        client.execute()
    (error,) = [o for o in notebook.cells[1].outputs if o.output_type == "error"]
    assert error.ename == "DatasetError" and "'someone/no-such-dataset'" in error.evalue
    assert "Internet on" in "".join(error.traceback)
    # the kernel is fine: the next cell runs there (and it is this checkout's nbkit)
    client = NotebookClient(
        notebook, kernel_name="here", timeout=300, allow_errors=True, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    assert f"{Path(nbkit.__file__)} still here" in "".join(o.get("text", "") for o in notebook.cells[2].outputs)


def test_chat_dataset_gives_first_turns_or_the_synthetic_instructions(tmp_path, monkeypatch):
    chats = nbkit.data.chat_dataset("synthetic", 3)
    assert len(chats) == 3 and [m["role"] for m in chats[0]["messages"]] == ["user", "assistant"]
    turns = [{"role": r, "content": c} for r, c in [("user", "q"), ("assistant", "a"), ("user", "more")]]
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    assert nbkit.data.chat_dataset(str(tmp_path), 1) == [{"messages": turns[:2]}]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetError, match="'someone/no-chats'"):
        nbkit.data.chat_dataset("someone/no-chats", 2)
