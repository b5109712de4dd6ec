"""What a training cell shows a user, in a real Jupyter kernel, with the HTML panel a JupyterLab, Kaggle or Colab user
sees (NBKIT_DASHBOARD=html, as those front ends choose): the same training on a live set (`%ddp start --gpus 2`)
and as a one-shot `%%ddp --gpus 2` cell, 2 gloo CPU ranks, TRL's SFTTrainer on tiny:qwen3-vl with peft LoRA and
the flagship's settings (logging every step).

Both cells show the panel and nothing under it: no per-step `{'loss': ...}` log lines (the panel shows those
numbers) and none of the warnings the libraries print on every run of such a cell.
"""

from __future__ import annotations

import re

import pytest
from kernel_cells import library_warnings, run_cells

pytestmark = pytest.mark.slow

STEPS = 4

LOAD = """
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForImageTextToText
processor = nbkit.offline.load_processor(path)
model = AutoModelForImageTextToText.from_pretrained(path, device_map={"": nbkit.device()})
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=r".*language_model.*\\.(q|v)_proj"))
"""

TRAIN = f"""
from datasets import Dataset
from trl import SFTConfig, SFTTrainer
trainer = SFTTrainer(model=model, processing_class=processor, train_dataset=Dataset.from_list(train_data),
                     args=SFTConfig(per_device_train_batch_size=2, max_steps={STEPS}, logging_steps=1,
                                    output_dir="outputs", report_to="none", save_strategy="no", bf16=False))
trainer.train().global_step
"""

DATA = """
dataset = nbkit.data.image_text_dataset("synthetic", 16, image_size=64)
ask = [{"type": "image"}, {"type": "text", "text": "What does the image say?"}]
train_data = [{"prompt": [{"role": "user", "content": ask}],
               "completion": [{"role": "assistant", "content": [{"type": "text", "text": row["text"]}]}],
               "images": [row["image"].convert("RGB")]} for row in dataset]
"""

CELLS = {
    "setup": "%load_ext nbkit\nimport nbkit\n" + DATA,
    "start": "%ddp start --gpus 2",
    "live_load": "%%ddp" + LOAD,
    "live_train": "%%ddp" + TRAIN,
    "stop": "%ddp stop",
    "oneshot_train": "%%ddp --gpus 2" + LOAD + TRAIN,
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, kernel_name, tiny_vl_path) -> dict[str, dict]:
    path = tmp_path_factory.mktemp("training-cell")
    cells = dict(CELLS)
    cells["setup"] += f"\npath = {tiny_vl_path!r}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NBKIT_DASHBOARD", "html")
        return run_cells(cells, path, kernel_name, timeout=600)


@pytest.mark.parametrize("cell", ["live_train", "oneshot_train"])
def test_the_training_cell_shows_the_panel_and_no_log_lines(outputs, cell):
    for name in ("setup", "start", "live_load", "stop", cell):
        out = outputs[name]
        assert out["error"] is None, f"{name}: " + "\n".join(out["error"].traceback)
    out = outputs[cell]
    assert out["result"] == str(STEPS)
    assert any("text/html" in shown for shown in out["displays"]), out["displays"]
    lines = [line for line in (out["stdout"] + out["stderr"]).splitlines() if re.match(r"\s*\{'(loss|train_)", line)]
    assert lines == [], "Trainer's log lines under the panel"


@pytest.mark.parametrize("cell", ["live_train", "oneshot_train"])
def test_the_training_cell_prints_no_library_warnings(outputs, cell):
    text = outputs[cell]["stdout"] + outputs[cell]["stderr"]
    assert library_warnings(text) == [], text
