"""nbkit.doctor(): GPUs, fork state, version pins, secrets never shown."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys

import pytest

from nbkit.notebook.diagnostics import doctor
from nbkit.platform import distributed
from nbkit.platform import shell as nbkit_shell

doctor_module = importlib.import_module("nbkit.notebook.diagnostics")


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
    assert report.secrets["HF_TOKEN"] and report.secrets["WANDB_API_KEY"]
    assert report.secrets["KAGGLE_KEY"] is False
    # Only the credentials these notebooks use are listed, not every variable that looks like one.
    assert "MY_SERVICE_TOKEN" not in report.secrets and "MY_SERVICE_TOKEN" not in str(report)
    shown = "\n".join([str(report), repr(report)])
    for value in values.values():
        assert value not in shown
    assert "secrets set: HF_TOKEN, WANDB_API_KEY; not set: KAGGLE_USERNAME, KAGGLE_KEY" in str(report)


def test_reports_this_cpu_machine_and_what_to_do(monkeypatch):
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    monkeypatch.delenv("KAGGLE_URL_BASE", raising=False)
    # a script: no IPython shell, whatever an earlier test in this process left behind (test_export makes one)
    monkeypatch.setattr(nbkit_shell, "current", lambda: None)
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
    # CPU processes asked for: worth a line, not an error
    cpu = doctor(gpus=2)
    assert cpu.ok and "[info] No GPU is visible: the 2 rank(s) asked for are CPU processes." in str(cpu)
    assert "[error]" not in str(cpu)


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


@pytest.mark.version_independent
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

    importlib.import_module("nbkit.notebook.diagnostics")
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


@pytest.mark.parametrize(
    ("installed", "relation"),
    [
        # (below nbkit's own lower bounds a version is an error from its requirements instead)
        ({"torch": "2.6.0+cu124"}, "torch 2.6.0+cu124 is older than the oldest"),
        ({"transformers": "5.25.0"}, "transformers 5.25.0 is newer than the newest"),
        ({"trl": "1.17.0"}, "trl 1.17.0 is newer than the newest"),
        ({"peft": "0.22.0"}, "peft 0.22.0 is newer than the newest"),
    ],
)
def test_versions_outside_the_tested_range_are_warned_about(monkeypatch, installed, relation):
    real = doctor_module._version
    monkeypatch.setattr(doctor_module, "_version", lambda name: installed.get(name, real(name)))
    report = doctor()
    (problem,) = [p for p in report.problems if relation in p.what]
    assert problem.severity == "warning" and "version nbkit is tested with" in problem.what
    name = next(iter(installed))
    oldest, newest = doctor_module.TESTED_VERSIONS[name]
    assert f'pip install "{name}>={oldest},<={newest}"' in problem.fix
    assert relation in str(report)


@pytest.mark.parametrize(
    "installed",
    [
        # both ends of the range, and patch releases of the newest tested minor line
        {"transformers": "4.57.1", "trl": "0.22.2", "accelerate": "1.12.0", "peft": "0.18.0", "datasets": "3.6.0"},
        {"transformers": "5.24.3", "trl": "1.16.1", "accelerate": "1.15.2", "peft": "0.21.5", "datasets": "4.8.5"},
    ],
)
def test_versions_inside_the_tested_range_raise_no_warning(monkeypatch, installed):
    real = doctor_module._version
    monkeypatch.setattr(doctor_module, "_version", lambda name: installed.get(name, real(name)))
    assert [
        p.what for p in doctor().problems if "version nbkit is tested with" in p.what and "torch" not in p.what
    ] == []


def test_a_version_outside_a_requirement_gets_one_problem_not_two(monkeypatch):
    # trl 1.16 is outside unsloth 2026.10.9's pins (an error) and newer than tested (a warning): one problem.
    installed = {"unsloth": "2026.10.9", "unsloth_zoo": "2026.10.9", "trl": "1.16.0"}
    real = doctor_module._version
    monkeypatch.setattr(doctor_module, "_version", lambda name: installed.get(name, real(name)))
    (problem,) = [p for p in doctor().problems if "trl 1.16.0" in p.what]
    assert problem.severity == "error" and "unsloth 2026.10.9" in problem.what


# Stand-ins for the platforms' own modules, with their shapes (Kaggle's docker-python
# patches/kaggle_secrets.py; Colab's google/colab/userdata.py): values come from a JSON file.
_KAGGLE_SECRETS = """
import json, os


class CredentialError(Exception):
    pass


class BackendError(Exception):
    pass


class UserSecretsClient:
    def __init__(self):
        if os.environ.get("KAGGLE_USER_SECRETS_TOKEN") is None:
            raise CredentialError("A JWT Token is required to use the UserSecretsClient")
        with open(os.environ["STANDIN_SECRETS"]) as f:
            self._secrets = json.load(f)

    def get_secret(self, label):
        if os.environ.get("STANDIN_OFFLINE"):
            raise ConnectionError("Connection error trying to communicate with service.")
        if label not in self._secrets:
            raise BackendError(f"Unexpected response from the service. Response: {{}}.")
        return self._secrets[label]
"""

_COLAB_USERDATA = """
import json, os


class NotebookAccessError(Exception):
    pass


class SecretNotFoundError(Exception):
    pass


def get(key):
    with open(os.environ["STANDIN_SECRETS"]) as f:
        secrets = json.load(f)
    if key in secrets.get("no_access", []):
        raise NotebookAccessError(key)
    if key not in secrets:
        raise SecretNotFoundError(key)
    return secrets[key]
"""


@pytest.fixture
def platform_modules(tmp_path, monkeypatch):
    """kaggle_secrets and google.colab.userdata importable from a temp dir; returns the secrets file."""
    root = tmp_path / "site"
    (root / "google" / "colab").mkdir(parents=True)  # `google` stays a namespace package
    (root / "kaggle_secrets.py").write_text(_KAGGLE_SECRETS)
    (root / "google" / "colab" / "__init__.py").write_text("")
    (root / "google" / "colab" / "userdata.py").write_text(_COLAB_USERDATA)
    monkeypatch.syspath_prepend(str(root))
    for name in ("kaggle_secrets", "google.colab", "google.colab.userdata"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name in ("KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE", "COLAB_RELEASE_TAG", "COLAB_GPU", "STANDIN_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    secrets = tmp_path / "secrets.json"
    monkeypatch.setenv("STANDIN_SECRETS", str(secrets))
    yield secrets
    for name in ("kaggle_secrets", "google.colab", "google.colab.userdata"):
        sys.modules.pop(name, None)


def test_kaggle_secrets_are_reported_as_set_or_not_set_never_shown(platform_modules, monkeypatch):
    platform_modules.write_text(json.dumps({"HF_TOKEN": "hf_KaggleSecret42", "KAGGLE_KEY": "kkey-777"}))
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    monkeypatch.setenv("KAGGLE_USER_SECRETS_TOKEN", "jwt-not-a-secret-of-the-user")
    report = doctor()
    store, states = report.platform_secrets
    assert store.startswith("Kaggle secrets")
    assert states == {"HF_TOKEN": "set", "WANDB_API_KEY": "not set", "KAGGLE_USERNAME": "not set", "KAGGLE_KEY": "set"}
    text = str(report)
    assert (
        "Kaggle secrets (Add-ons > Secrets): set: HF_TOKEN, KAGGLE_KEY; not set: WANDB_API_KEY, KAGGLE_USERNAME" in text
    )
    shown = text + repr(report)
    assert "hf_KaggleSecret42" not in shown and "kkey-777" not in shown


def test_kaggle_without_internet_or_secrets_token_says_it_could_not_ask(platform_modules, monkeypatch):
    platform_modules.write_text(json.dumps({"HF_TOKEN": "hf_x"}))
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    monkeypatch.delenv("KAGGLE_USER_SECRETS_TOKEN", raising=False)
    assert set(doctor().platform_secrets[1].values()) == {"unknown (CredentialError)"}
    monkeypatch.setenv("KAGGLE_USER_SECRETS_TOKEN", "jwt")
    monkeypatch.setenv("STANDIN_OFFLINE", "1")
    assert set(doctor().platform_secrets[1].values()) == {"unknown (internet off?)"}


def test_colab_userdata_is_reported_as_set_not_set_or_without_access(platform_modules, monkeypatch):
    platform_modules.write_text(
        json.dumps({"WANDB_API_KEY": "wb-colab-5150", "HF_TOKEN": "hf_c", "no_access": ["HF_TOKEN"]})
    )
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20261101-060000_RC00")
    report = doctor()
    assert report.platform == "Colab"
    store, states = report.platform_secrets
    assert store.startswith("Colab secrets")
    assert states["WANDB_API_KEY"] == "set" and states["KAGGLE_KEY"] == "not set"
    assert states["HF_TOKEN"].startswith("set, but this notebook has no access")
    assert "wb-colab-5150" not in str(report) + repr(report)


def test_off_the_platforms_no_secret_store_is_asked(platform_modules, monkeypatch):
    platform_modules.write_text(json.dumps({"HF_TOKEN": "hf_x"}))
    report = doctor()
    assert report.platform_secrets is None
    assert "kaggle_secrets" not in sys.modules and "google.colab.userdata" not in sys.modules


def test_a_distribution_named_nbkit_is_flagged_with_how_to_replace_it(tmp_path, monkeypatch):
    # The metadata of PyPI's unrelated `nbkit` 0.0.10, as pip leaves it in site-packages.
    info = tmp_path / "nbkit-0.0.10.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nbkit\nVersion: 0.0.10\nSummary: jupyter notebook toolkit\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (problem,) = [p for p in doctor().problems if "distribution named `nbkit`" in p.what]
    assert "0.0.10, 'jupyter notebook toolkit'" in problem.what and "nbkit-ddp" in problem.what
    assert "pip uninstall -y nbkit nbkit-ddp" in problem.fix
