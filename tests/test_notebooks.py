"""The notebooks are integration tests: each one runs with papermill on CPU the way `make demo` and CI
run it (notebooks/run.py: tiny offline models, nbkit's synthetic data, 2 gloo processes, a few
steps), and the executed notebook and the files it wrote must show what a user relies on: no error,
the loss went down, the adapter exists, loads and was trained, inference produced text, and the
final checkpoint is marked complete."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import nbformat
import pytest
import torch
from kernel_cells import library_warnings

from nbkit.training.checkpoints import is_complete

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
# The notebooks whose training cell takes its batch from the planner (Plan.batch_settings).
BATCH_PLANNED = {"qwen3_vl_2xT4", "qwen3_vl_2xT4_oneshot", "text_llm_ddp", "long_context"}
# The notebooks whose choices (processes, backend, precision, 4-bit, batch) nbkit.recipe makes, once.
RECIPE = {"qwen3_vl_2xT4", "qwen3_vl_2xT4_oneshot", "text_llm_ddp", "long_context", "big_model_fsdp"}
# The notebooks whose `checkpointing` parameter reaches the recipe (transformers + peft under DDP) and their summary.
CHECKPOINTING = {"qwen3_vl_2xT4", "qwen3_vl_2xT4_oneshot", "text_llm_ddp"}
REQUIRED_PARAMETERS = {
    "model_name",
    "dataset_name",
    "max_steps",
    "gpus",
    "backend",
    "output_dir",
    "max_seq_length",
    "load_in_4bit",
}


def _load_runner():
    spec = importlib.util.spec_from_file_location("nbkit_notebook_runner", NOTEBOOKS_DIR / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = _load_runner()


def _outputs(nb) -> list:
    return [output for cell in nb.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]


def _text(nb) -> str:
    return "".join(o.get("text", "") for o in _outputs(nb) if o.output_type == "stream")


@pytest.mark.version_independent
def test_committed_notebooks_are_clean_and_share_their_parameters() -> None:
    for name in runner.NOTEBOOKS:
        nb = nbformat.read(NOTEBOOKS_DIR / f"{name}.ipynb", as_version=4)
        nbformat.validate(nb)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert not _outputs(nb) and all(cell.execution_count is None for cell in code), f"{name} has outputs"
        (parameters,) = [cell for cell in code if "parameters" in cell.metadata.get("tags", [])]
        names = {
            target.id
            for node in ast.parse(parameters.source).body
            if isinstance(node, ast.Assign)
            for target in node.targets
        }
        assert names >= REQUIRED_PARAMETERS, f"{name} lacks parameters {REQUIRED_PARAMETERS - names}"
        sources = "\n".join(cell.source for cell in code)
        for line in ("%load_ext nbkit", "%nbkit doctor", "nbkit.checkpoints.resume_point(output_dir)"):
            assert line in sources, f"{name} lacks {line!r}"
        if name in RECIPE:  # the run's choices made once; no cell branches on the backend
            assert "recipe = nbkit.recipe(" in sources and "**recipe.trainer_args" in sources, name
            assert "if backend" not in sources and "backend ==" not in sources, name
        else:  # the planner's verdict, shown
            assert "%nbkit plan" in sources, name
        if name in BATCH_PLANNED:  # the training cell's batch comes from the plan, and the user may fix the total
            assert "effective_batch" in names and "trainer_args" in sources, name
            assert "per_device_train_batch_size=batch_size" not in sources, name
        # Every step is explained: the first cell is markdown, and no more than 3 code cells follow each other.
        kinds = "".join("c" if cell.cell_type == "code" else "m" for cell in nb.cells)
        assert kinds.startswith("m") and "cccc" not in kinds, f"{name}: {kinds}"


@pytest.mark.version_independent
def test_cpu_parameters_replace_what_needs_a_gpu_or_the_hub(tmp_path: Path) -> None:
    cpu = runner.parameters("qwen3_vl_2xT4", tmp_path, gpu=False, hub=False, overrides={"max_steps": 3})
    assert cpu["model_name"] == "tiny:qwen3-vl" and cpu["dataset_name"] == "synthetic" and cpu["gpus"] == 2
    assert cpu["max_steps"] == 3 and cpu["output_dir"] == str(tmp_path.resolve() / "qwen3_vl_2xT4")
    gpu_offline = runner.parameters("text_llm_ddp", tmp_path, gpu=True, hub=False)
    assert gpu_offline == {
        "output_dir": str(tmp_path.resolve() / "text_llm_ddp"),
        "model_name": "random:qwen3-1.7b",
        "dataset_name": "synthetic",
    }
    assert runner.parameters("long_context", tmp_path, gpu=True, hub=True) == {
        "output_dir": str(tmp_path.resolve() / "long_context")
    }
    with pytest.raises(ValueError, match="no notebook 'flagship'"):
        runner.parameters("flagship", tmp_path, gpu=False, hub=False)


def _base_model(model_name: str):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    import nbkit

    loader = AutoModelForImageTextToText if "-vl" in model_name else AutoModelForCausalLM
    return loader.from_pretrained(nbkit.resolve_model(model_name))


@pytest.mark.parametrize("name", runner.NOTEBOOKS)
def test_notebook_trains_saves_and_answers_on_cpu(name: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    (executed,) = runner.run([name], tmp_path)
    nb = nbformat.read(executed, as_version=4)
    errors = [o for o in _outputs(nb) if o.output_type == "error"]
    assert not errors, errors
    run_dir = tmp_path / name
    summary = json.loads((run_dir / "summary.json").read_text())
    max_steps = runner.parameters(name, tmp_path, gpu=False, hub=False)["max_steps"]

    # Training ran every step and the loss went down.
    assert summary["train"]["global_step"] == max_steps and summary["steps"] == list(range(1, max_steps + 1))
    losses = summary["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses
    assert is_complete(run_dir / f"checkpoint-{max_steps}")
    if name in CHECKPOINTING:  # the recipe's checkpointing is in the summary: "auto" keeps it on CPU ranks
        assert summary["checkpointing"] == "offload"
    if name != "model_parallel":  # rank 0's peak, as its dashboard row shows it (on a CPU: peak RSS)
        assert summary["train"]["peak_memory_gib"] > 0

    # The adapter is on disk, loads onto the base model, and holds trained weights.
    adapter_dir = Path(summary["adapter_dir"])
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    assert saved and any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in saved.items())
    model = PeftModel.from_pretrained(_base_model(summary["model_name"]), adapter_dir)
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved)
    for key, value in saved.items():
        match = [v for k, v in loaded.items() if k.replace(".default", "") == key]
        assert len(match) == 1 and torch.equal(match[0], value), key

    # Inference in the notebook process produced text, and the adapter changed it.
    answers = summary["answers"]
    assert answers and all(isinstance(a["before"], str) and isinstance(a["after"], str) for a in answers)
    assert any(a["after"] for a in answers) and any(a["after"] != a["before"] for a in answers), answers

    text = _text(nb)
    assert f"nbkit: no checkpoint in {run_dir} yet; starting fresh." in text
    if name != "model_parallel":  # which trains in the notebook process, where nbkit leaves Trainer's defaults
        assert library_warnings(text) == [], "warnings the ranks avoid at their cause"
    if name in BATCH_PLANNED:
        # The planning cell prints the batch it chose in one line, and the trainer trained at it: on CPU
        # processes the asked batch per process, accumulation making up the effective batch.
        cpu = runner.parameters(name, tmp_path, gpu=False, hub=False)
        effective = cpu.get("effective_batch") or cpu["batch_size"] * 2
        accumulation = effective // (2 * cpu["batch_size"])
        assert summary["train"]["batch"] == {
            "per_device": cpu["batch_size"],
            "accumulation": accumulation,
            "processes": 2,
        }
        (line,) = [line for line in text.splitlines() if line.startswith("Trainer: ")]
        steps = f" x {accumulation} accumulation steps" if accumulation > 1 else ""
        assert line.startswith(
            f"Trainer: {cpu['batch_size']} per process{steps} x 2 processes = {effective} examples per optimizer step"
        ), line
        assert "The processes train on CPU cores: no GPU waits for the host" in line
    if name == "big_model_fsdp":  # FSDP shards and reduces the gradients itself
        assert summary["train"]["gradient_averaging"] is None
    if name == "model_parallel":
        # the planner's verdicts for Qwen3-8B on 2 x T4: sharded at 2K tokens, split at 8K
        assert "Strategy: fsdp" in text and "Strategy: model_parallel" in text
    if name != "model_parallel":  # the doctor knows that this run asked for CPU processes: not an error
        assert "[info] No GPU is visible: the 2 rank(s)" in text and "[error] No GPU" not in text
    if name == "qwen3_vl_2xT4":
        # Cell by cell on a live set: started, used by every GPU cell, stopped.
        assert "nbkit: live set of 2 rank(s) on cpu" in text and "nbkit: stopped the live set (2 rank(s))." in text
        # its ranks averaged the LoRA gradients by nbkit's one all-reduce per step, not by DDP's reducer
        assert summary["train"]["gradient_averaging"] == "flat"
        # A Kaggle session ended: the same notebook, run again, continues.
        runner.run([name], tmp_path, {"max_steps": max_steps + 4})
        again = json.loads((run_dir / "summary.json").read_text())
        assert again["train"]["resumed_from"] == str(run_dir / f"checkpoint-{max_steps}")
        assert again["train"]["global_step"] == max_steps + 4
        assert again["steps"] == list(range(1, max_steps + 5)) and again["losses"][:max_steps] == losses
    if name == "long_context":
        assert {(m["tokens"], m["savers"]) for m in summary["memory"]} == {
            (256, False),
            (256, True),
            (2048, False),
            (2048, True),
        }
        assert all(m["peak"] > 0 and m["added"] >= 0 for m in summary["memory"])
