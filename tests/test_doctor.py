"""nbkit.doctor(): GPUs, fork state, version pins, secrets never shown."""

from __future__ import annotations

import importlib
import importlib.metadata

import pytest

from nbkit import distributed
from nbkit.diagnostics import doctor

doctor_module = importlib.import_module("nbkit.diagnostics")


def test_a_set_secret_is_reported_as_set_and_its_value_never_appears(monkeypatch):
    values = {
        "HF_TOKEN": "hf_SeCrEtVaLuE123",
        "WANDB_API_KEY": "wandb-0123456789abcdef",
        "MY_SERVICE_TOKEN": "tok-zzz-987",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("KAGGLE_KEY", raising=False)
    report = doctor()
    assert report.secrets["HF_TOKEN"] and report.secrets["WANDB_API_KEY"] and report.secrets["MY_SERVICE_TOKEN"]
    assert report.secrets["KAGGLE_KEY"] is False
    shown = "\n".join([str(report), repr(report)])
    for value in values.values():
        assert value not in shown
    assert "secrets set: " in str(report) and "HF_TOKEN" in str(report)


def test_reports_this_cpu_machine_and_what_to_do(monkeypatch):
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    monkeypatch.delenv("KAGGLE_URL_BASE", raising=False)
    report = doctor()
    text = str(report)
    import torch

    assert report.versions["torch"] == torch.__version__
    assert f"torch {torch.__version__}" in text
    assert report.platform == "local (script)"
    assert not report.cuda_initialized and report.fork_blocker is None
    assert "GPUs: none visible" in text
    assert "No GPU is visible" in text and "GPU T4 x2" in text  # the problem comes with its fix
    assert not report.ok


def test_gpus_shown_with_capability_and_precision(monkeypatch):
    t4 = distributed.GPU(0, "Tesla T4", 14.7, (7, 5))
    monkeypatch.setattr(distributed, "visible_gpus", lambda: [t4])
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    report = doctor()
    text = str(report)
    assert "0: Tesla T4, 14.7 GiB, sm_75, fp16 (no native bf16)" in text
    assert report.platform == "Kaggle (interactive session)"
    assert any("Only one GPU" in p.what and p.severity == "warning" for p in report.problems)


def test_a_fork_blocker_in_this_process_is_flagged_with_the_way_out():
    # An accelerate state created in the notebook process is a real reason nbkit.launch refuses to fork
    # (bitsandbytes alone no longer is: without a CUDA context nbkit forks anyway).
    from accelerate.state import AcceleratorState, PartialState

    PartialState(cpu=True)
    try:
        report = doctor()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert report.fork_blocker is not None and "Accelerator" in report.fork_blocker
    assert "spawn mode" in report.launch_mode
    problem = next(p for p in report.problems if "Accelerator" in p.what)
    assert "Restart the kernel" in problem.fix


@pytest.mark.parametrize(
    ("installed", "flagged"),
    [
        ({"unsloth": "2026.10.9", "unsloth_zoo": "2026.10.9", "transformers": "5.0.0"}, "transformers 5.0.0"),
        ({"unsloth": "2026.10.9", "unsloth_zoo": "2026.10.9", "trl": "1.16.0"}, "trl 1.16.0"),
        ({"unsloth": "2026.10.9", "unsloth_zoo": "2026.9.1"}, "unsloth_zoo 2026.9.1"),
        ({"torch": "2.13.0", "torchvision": "0.24.0"}, "torchvision 0.24.0 does not belong to torch 2.13.0"),
    ],
)
def test_known_bad_combinations_are_flagged(monkeypatch, installed, flagged):
    real = doctor_module._version
    monkeypatch.setattr(doctor_module, "_version", lambda name: installed.get(name, real(name)))
    problems = [p for p in doctor().problems if flagged in p.what]
    assert len(problems) == 1
    assert "pip install" in problems[0].fix


def test_a_supported_unsloth_stack_raises_no_version_problem(monkeypatch):
    good = {
        "unsloth": "2026.10.9",
        "unsloth_zoo": "2026.10.9",
        "torch": "2.13.0",
        "transformers": "5.17.0",
        "trl": "1.15.0",
        "peft": "0.21.0",
        "accelerate": "1.15.0",
        "bitsandbytes": "0.49.0",
        "datasets": "4.8.5",
        "torchvision": "0.28.0",
    }
    monkeypatch.setattr(doctor_module, "_version", lambda name: good.get(name))
    assert [p.what for p in doctor().problems if " is outside " in p.what or "torchvision" in p.what] == []


def test_nbkit_doctor_is_the_function_whichever_import_came_first():
    import nbkit

    importlib.import_module("nbkit.diagnostics")
    assert nbkit.doctor is doctor
    assert nbkit.doctor().versions == doctor().versions


def test_nbkit_imported_from_a_folder_still_gets_a_report(monkeypatch):
    # A Kaggle user who puts a checkout on sys.path instead of pip-installing it has no metadata.
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", not_installed)
    report = doctor()
    (problem,) = [p for p in report.problems if "not installed" in p.what]
    assert problem.severity == "warning" and "pip install -e" in problem.fix
