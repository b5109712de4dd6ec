"""The README's five cells run as written, in a real Jupyter kernel, on 2 gloo CPU ranks.

The cells are read from the README itself (every ```python block of its "Five cells" section), so
the first example a user copies cannot drift from what works: a tiny offline model, nbkit's synthetic
data, transformers + peft, `%ddp start --gpus 2`. What the user relies on: no cell fails, training ran
its steps on both ranks, and rank 0 wrote a LoRA adapter that was trained. The Kaggle line the README
gives in place of the CPU names is checked to be a one-line change of the first cell; on 2 GPUs the
cells run with Qwen3-VL-2B's shapes (random weights, offline).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from gpu_marks import two_gpus
from kernel_cells import run_cells
from safetensors.torch import load_file

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Five cells"
CPU_NAMES = 'model_name, dataset_name, max_steps = "tiny:qwen3-vl", "synthetic", 5'


def readme_cells() -> list[str]:
    """The ```python blocks of the README's "Five cells" section, in order."""
    text = README.read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```python\n(.*?)```", section, re.DOTALL)]


def kaggle_names() -> str:
    """The line the README tells a Kaggle user to put in place of the CPU names."""
    section = README.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    (line,) = re.findall(r"`(model_name, dataset_name, max_steps = [^`]+)`", section)
    return line


def _run(cells: list[str], path: Path, kernel_name: str) -> dict[str, dict]:
    named = {f"cell{i + 1}": source for i, source in enumerate(cells)}
    named["stop"] = "%ddp stop"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("NBKIT_DASHBOARD", raising=False)
        return run_cells(named, path, kernel_name, timeout=600)


def _assert_trained(outputs: dict[str, dict], path: Path, steps: int) -> None:
    for name, out in outputs.items():
        assert out["error"] is None, f"{name}: " + "\n".join(out["error"].traceback)
    assert f"global_step={steps}" in outputs["cell4"]["result"], outputs["cell4"]
    adapter = load_file(path / "lora_model" / "adapter_model.safetensors")
    lora_b = [tensor for name, tensor in adapter.items() if "lora_B" in name]
    assert lora_b and any(torch.count_nonzero(t) for t in lora_b), "the adapter's B matrices are still zero"


@pytest.mark.version_independent
def test_the_readme_gives_five_cells_and_a_one_line_change_for_kaggle() -> None:
    cells = readme_cells()
    assert len(cells) == 5
    assert [line.split("  #")[0] for line in cells[0].splitlines()].count(CPU_NAMES) == 1
    assert "%ddp start --gpus 2" in cells[0]
    assert "unsloth/Qwen3-VL-2B-Instruct" in kaggle_names() and "unsloth/LaTeX_OCR" in kaggle_names()


@pytest.mark.slow
def test_the_readme_cells_run_as_written_on_cpu_ranks(tmp_path: Path, kernel_name: str) -> None:
    outputs = _run(readme_cells(), tmp_path, kernel_name)
    _assert_trained(outputs, tmp_path, steps=5)


@pytest.mark.gpu
@two_gpus
def test_the_readme_cells_train_qwen3_vl_2b_shapes_on_two_gpus(tmp_path: Path, kernel_name: str) -> None:
    """The Kaggle line with Qwen3-VL-2B's shapes (random weights: no hub here) and the synthetic data."""
    line = kaggle_names().replace('"unsloth/Qwen3-VL-2B-Instruct"', '"random:qwen3-vl-2b"')
    line = line.replace('"unsloth/LaTeX_OCR"', '"synthetic"')
    line = re.sub(r"\d+$", "3", line)
    cells = readme_cells()
    cells[0] = cells[0].replace(CPU_NAMES, line)
    outputs = _run(cells, tmp_path, kernel_name)
    _assert_trained(outputs, tmp_path, steps=3)
