"""The flagship notebook on 2 GPUs standing in for Kaggle's 2x T4 (pytest -m gpu; needs 2 GPUs and unsloth).

Qwen3-VL-2B's shapes with random weights (random:qwen3-vl-2b, nothing downloaded), unsloth, fp16 (a T4
has no bf16) and every process emulating a T4 (`emulate="T4"`: 15 GiB of its GPU, a T4's usable memory). Records what the
run measured (seconds per step, rank 0's peak memory, the loss) as JSON in $NBKIT_RESULTS_DIR (else
the test's temporary directory) for benchmarks/RESULTS.md, and prints it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path

import nbformat
import pytest

import nbkit

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
T4_USABLE_GIB = 15
STEPS = 12


def _load_runner():
    spec = importlib.util.spec_from_file_location("nbkit_notebook_runner", NOTEBOOKS_DIR / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code_outputs(nb: nbformat.NotebookNode) -> list:
    """Every output of the executed notebook's code cells, in order."""
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


@pytest.mark.gpu
@pytest.mark.parametrize("load_in_4bit", [None, True], ids=["16bit-by-the-planner", "4bit"])
def test_flagship_trains_on_two_capped_gpus_with_unsloth_in_fp16(tmp_path: Path, load_in_4bit: bool | None) -> None:
    if len(nbkit.visible_gpus()) < 2:
        pytest.skip("needs 2 GPUs")
    if importlib.util.find_spec("unsloth") is None:
        pytest.skip("needs unsloth")
    missing = [m for m in ("papermill", "ipykernel", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"running notebooks needs {', '.join(missing)} here: pip install {' '.join(missing)}")
    runner = _load_runner()
    # Build the random checkpoint here, once, before the notebook's kernel starts (the kernel and its
    # training processes inherit NBKIT_CACHE and find it).
    nbkit.resolve_model("random:qwen3-vl-2b")

    start = time.monotonic()
    (executed,) = runner.run(
        ["qwen3_vl_2xT4"],
        tmp_path,
        dict(
            model_name="random:qwen3-vl-2b",
            dataset_name="synthetic",
            backend="unsloth",
            precision="fp16",
            emulate="T4",
            gpus=2,
            max_steps=STEPS,
            save_steps=STEPS // 2,
            batch_size=2,
            effective_batch=4,  # 2 per GPU, as on a T4: the planner sees the H200 behind the cap and would raise it
            num_samples=128,
            image_size=448,
            max_seq_length=1024,
            learning_rate=1e-3,
            load_in_4bit=load_in_4bit,
        ),
        timeout=600,
    )
    wall = time.monotonic() - start

    nb = nbformat.read(executed, as_version=4)
    errors = [o for o in _code_outputs(nb) if o.output_type == "error"]
    assert not errors, errors
    summary = json.loads((tmp_path / "qwen3_vl_2xT4" / "summary.json").read_text())
    train = summary["train"]
    assert summary["backend"] == "unsloth" and summary["precision"] == "fp16" and summary["gpus"] == 2
    # None: the planner decides, and 16-bit LoRA of a 2B model fits a T4; True: QLoRA, as unsloth's Kaggle notebook
    assert summary["load_in_4bit"] is bool(load_in_4bit)
    assert train["global_step"] == STEPS and all(math.isfinite(loss) for loss in summary["losses"])
    losses = summary["losses"]
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    assert 0 < train["peak_memory_gib"] <= T4_USABLE_GIB
    assert train["batch"] == {"per_device": 2, "accumulation": 1, "processes": 2}
    # the fast path by default: one all-reduce per step in place of DDP's reducer (fp16's scaled gradients included)
    assert train["gradient_averaging"] == "flat"

    record = {
        "what": "notebooks/qwen3_vl_2xT4.ipynb on 2 GPUs capped at 15 GiB each (a T4's usable memory), "
        "random:qwen3-vl-2b, unsloth, fp16, LoRA r=16 on the language model, batch 2 per GPU without gradient accumulation, "
        "synthetic 448x448 images, " + ("4-bit (QLoRA)" if load_in_4bit else "16-bit LoRA"),
        "gpu": nbkit.visible_gpus()[0].name,
        "steps": train["global_step"],
        "seconds_per_step_steady": train["seconds_per_step"],
        "step_seconds": train["step_seconds"],
        "tokens_per_second_rank0_steady": train["tokens_per_second"],
        "first_step_seconds": train["first_step_seconds"],
        "seconds_per_step_mean_incl_first": train["mean_seconds_per_step"],
        "peak_memory_gib_rank0": train["peak_memory_gib"],
        "gradient_averaging": train["gradient_averaging"],
        "loss_first": summary["losses"][0],
        "loss_last": summary["losses"][-1],
        "notebook_wall_seconds": wall,
    }
    results_dir = Path(os.environ.get("NBKIT_RESULTS_DIR", tmp_path))
    results_dir.mkdir(parents=True, exist_ok=True)
    out = results_dir / f"notebook_qwen3_vl_2xT4_gpu_{'4bit' if load_in_4bit else '16bit'}.json"
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    print(f"written to {out}")


def _llama_cpp_converter_here() -> bool:
    """Whether llama.cpp's GGUF converter is where unsloth looks for it (UNSLOTH_LLAMA_CPP_PATH, else
    ~/.unsloth/llama.cpp); without it unsloth fetches llama.cpp from the internet."""
    home = os.environ.get("UNSLOTH_LLAMA_CPP_PATH") or str(Path.home() / ".unsloth" / "llama.cpp")
    return any((Path(home) / name).is_file() for name in ("convert_hf_to_gguf.py", "convert-hf-to-gguf.py"))


@pytest.mark.gpu
@pytest.mark.parametrize("saving", ["merged", "gguf"])
def test_flagship_saves_merged_or_gguf_with_unsloth(tmp_path: Path, saving: str) -> None:
    """The flagship's saving cell as a user runs it with save_merged or save_gguf (unsloth's savers, rank 0).

    GGUF needs llama.cpp's converter, which unsloth fetches from the internet where it is not installed: on an
    offline host (HF_HUB_OFFLINE) without it, the GGUF case skips, saying so; merged 16-bit weights need nothing.
    """
    if not nbkit.visible_gpus():
        pytest.skip("needs a GPU")
    if importlib.util.find_spec("unsloth") is None:
        pytest.skip("needs unsloth")
    if saving == "gguf" and os.environ.get("HF_HUB_OFFLINE") == "1" and not _llama_cpp_converter_here():
        pytest.skip(
            "GGUF needs llama.cpp's converter, which unsloth downloads: offline here and none installed "
            "(UNSLOTH_LLAMA_CPP_PATH or ~/.unsloth/llama.cpp)"
        )
    runner = _load_runner()
    nbkit.resolve_model("random:qwen3-vl-2b")
    (executed,) = runner.run(
        ["qwen3_vl_2xT4"],
        tmp_path,
        dict(
            model_name="random:qwen3-vl-2b",
            dataset_name="synthetic",
            backend="unsloth",
            gpus=1,
            max_steps=2,
            save_steps=2,
            num_samples=16,
            image_size=224,
            max_seq_length=512,
            save_merged=saving == "merged",
            save_gguf="q8_0" if saving == "gguf" else None,
        ),
        timeout=1200,
    )
    nb = nbformat.read(executed, as_version=4)
    errors = [o for o in _code_outputs(nb) if o.output_type == "error"]
    assert not errors, errors
    out = tmp_path / "qwen3_vl_2xT4"
    if saving == "merged":
        merged = out / "merged_16bit"
        assert (merged / "config.json").is_file() and list(merged.glob("*.safetensors")), sorted(out.iterdir())
    else:
        assert list(out.rglob("*.gguf")), sorted(p.name for p in out.rglob("*"))


@pytest.mark.gpu
def test_model_parallel_notebook_trains_a_4bit_model_on_two_gpus_in_fp16(tmp_path: Path) -> None:
    """notebooks/model_parallel.ipynb with load_in_4bit=True under the T4 profile, two GPUs visible: Qwen3-1.7B's
    shapes in 4-bit, which fit one GPU, so accelerate's "balanced" map puts them whole on one (2x H100; the split
    itself is tests/test_model_parallel_gpu.py's and fsdp_vs_balanced.py's); the planner asked about 4-bit; a
    finite, falling loss that is the batch's own (Trainer counted both GPUs for a 4-bit model and logged twice it)."""
    if len(nbkit.visible_gpus()) < 2:
        pytest.skip("needs 2 GPUs")
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("needs bitsandbytes")
    runner = _load_runner()
    nbkit.resolve_model("random:qwen3-1.7b")
    (executed,) = runner.run(
        ["model_parallel"],
        tmp_path,
        dict(model_name="random:qwen3-1.7b", dataset_name="synthetic", load_in_4bit=True, emulate="T4", max_steps=8),
        timeout=400,
    )
    nb = nbformat.read(executed, as_version=4)
    errors = [o for o in _code_outputs(nb) if o.output_type == "error"]
    assert not errors, errors
    text = "\n".join(o.get("text", "") for o in _code_outputs(nb))
    assert "(4-bit)" in text, "the planning cell planned for 16-bit weights"
    (layout,) = [line for line in text.splitlines() if line.startswith("layout:")]
    assert layout.startswith("layout: ['cuda:"), layout  # the weights on GPUs, none left on the CPU
    summary = json.loads((tmp_path / "model_parallel" / "summary.json").read_text())
    assert summary["load_in_4bit"] is True and summary["precision"] == "fp16"
    losses = summary["losses"]
    assert all(math.isfinite(loss) for loss in losses) and sum(losses[-3:]) < sum(losses[:3]), losses
    # A random model starts near ln(vocabulary) = 11.9 (151,936 tokens); counted twice it logged about 24.
    assert losses[0] < 1.3 * math.log(151936), losses


@pytest.mark.gpu
def test_big_model_fsdp_notebook_trains_in_4bit_on_two_capped_gpus_loading_on_the_host(tmp_path, monkeypatch):
    """notebooks/big_model_fsdp.ipynb on two GPUs under the T4 profile in 4-bit (FSDP-QLoRA), its ranks keeping their
    shares of the quantised weights on the host until sharding, as for a model too big for one T4
    (fsdp_4bit_load="host"; Qwen3-VL-2B's shapes stand in for the big model): every step, a falling finite loss,
    a saved adapter, and answers generated on the sharded model after training."""
    if len(nbkit.visible_gpus()) < 2:
        pytest.skip("needs 2 GPUs")
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("needs bitsandbytes")
    monkeypatch.setenv("NBKIT_FSDP_4BIT_LOAD", "host")  # the kernel and the ranks it starts read it
    runner = _load_runner()
    nbkit.resolve_model("random:qwen3-vl-2b")
    steps = 8
    (executed,) = runner.run(
        ["big_model_fsdp"],
        tmp_path,
        dict(
            model_name="random:qwen3-vl-2b",
            dataset_name="synthetic",
            load_in_4bit=True,
            emulate="T4",
            gpus=2,
            max_steps=steps,
            save_steps=steps,
            num_samples=32,
            image_size=128,
            max_seq_length=512,
            learning_rate=1e-3,
        ),
        timeout=420,
    )
    nb = nbformat.read(executed, as_version=4)
    errors = [o for o in _code_outputs(nb) if o.output_type == "error"]
    assert not errors, errors
    summary = json.loads((tmp_path / "big_model_fsdp" / "summary.json").read_text())
    assert summary["strategy"] == "fsdp" and summary["load_in_4bit"] is True and summary["precision"] == "fp16"
    assert summary["train"]["global_step"] == steps
    losses = summary["losses"]
    assert all(math.isfinite(loss) for loss in losses) and sum(losses[-3:]) < sum(losses[:3]), losses
    assert 0 < summary["train"]["peak_memory_gib"] <= T4_USABLE_GIB
    assert (Path(summary["adapter_dir"]) / "adapter_model.safetensors").is_file()
    assert summary["answers"] and all(isinstance(a["after"], str) for a in summary["answers"])
