"""nbkit.bootstrap, the installer the notebooks' first cell runs from nbkit's wheel: what it installs on which machine,
and that it runs from a zip of the package in a Python that has nothing else installed (no torch, no pip even).

The real wheel, installed by the real cell against a foreign `nbkit`, is tests/test_packaging.py's slow tests.
"""

from __future__ import annotations

import subprocess
import venv
import zipfile
from pathlib import Path

import pytest

import nbkit
from nbkit import bootstrap
from nbkit.bootstrap import Machine, Step

PACKAGE = Path(nbkit.__file__).parent
WHEEL = "/kaggle/input/nbkit/nbkit_ddp-0.2.0-py3-none-any.whl"
KAGGLE_T4 = {"torch": "2.10.0+cu128", "transformers": "5.5.0", "trl": "0.24.0", "peft": "0.19.0"}


def _nbkit_step(extra: str) -> Step:
    return Step(("install", WHEEL + extra), hold=True)


@pytest.mark.version_independent
def test_a_gpu_machine_without_unsloth_gets_unsloths_kaggle_recipe_then_nbkit_with_what_is_installed_held():
    machine = Machine(host="kaggle", gpus=2, versions=KAGGLE_T4)
    assert bootstrap.steps(machine, WHEEL, "0.2.0") == [
        Step(("install", "unsloth", "transformers==4.57.1")),
        Step(("install", "--no-deps", "trl==0.22.2")),
        _nbkit_step("[unsloth]"),
    ]


@pytest.mark.version_independent
def test_unsloth_already_there_and_a_cpu_machine_get_nbkit_alone():
    with_unsloth = Machine(host="kaggle", gpus=2, versions={**KAGGLE_T4, "unsloth": "2026.10.9"})
    assert bootstrap.steps(with_unsloth, WHEEL, "0.2.0") == [_nbkit_step("[unsloth]")]
    cpu = Machine(host="local", gpus=0, versions={"torch": "2.13.0"})
    assert bootstrap.steps(cpu, WHEEL, "0.2.0") == [_nbkit_step("[peft]")]
    # a pip requirement (`nbkit-ddp[peft] @ git+...`) carries its own extras
    assert bootstrap.steps(cpu, "nbkit-ddp @ git+file:///clone", "0.2.0") == [
        Step(("install", "nbkit-ddp @ git+file:///clone"), hold=True)
    ]


@pytest.mark.version_independent
def test_a_foreign_nbkit_is_named_and_removed_before_nbkit_installs():
    machine = Machine(host="colab", gpus=0, versions={"nbkit": "0.0.10"}, foreign="jupyter notebook toolkit")
    uninstall, install = bootstrap.steps(machine, WHEEL, "0.2.0")
    assert uninstall == Step(
        ("uninstall", "-y", "nbkit"),
        says="Found nbkit 0.0.10 (jupyter notebook toolkit), not nbkit-ddp 0.2.0: replacing it.",
    )
    assert install == _nbkit_step("[peft]")


@pytest.mark.version_independent
def test_nothing_to_do_where_this_version_is_installed_or_there_is_nothing_to_install_from():
    installed = Machine(host="kaggle", gpus=2, versions={**KAGGLE_T4, "nbkit-ddp": "0.2.0"})
    assert bootstrap.steps(installed, WHEEL, "0.2.0") == []
    assert bootstrap.steps(installed, WHEEL, "0.3.0") == [
        *(Step(args) for args in bootstrap.UNSLOTH_RECIPE),
        _nbkit_step("[unsloth]"),
    ]
    # nbkit runs from an installed copy or a checkout (CI): no wheel, nothing to do
    assert bootstrap.steps(Machine(host="local", gpus=0, versions={}), None, "0.2.0") == []


def test_this_machine_as_surveyed():
    machine = bootstrap.survey()
    assert machine.host == "local" and machine.gpus >= len(nbkit.visible_gpus())
    assert machine.versions["torch"] == __import__("torch").__version__
    assert "unsloth" not in machine.versions and machine.foreign is None


def test_run_from_the_checkout_it_installs_nothing_and_says_nothing(capsys: pytest.CaptureFixture[str]):
    assert bootstrap.install() == []
    assert capsys.readouterr() == ("", "")


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A virtual environment with nothing installed (not even pip), and a zip of nbkit's package laid out as the
    wheel lays it out, named as the wheel is."""
    root = tmp_path_factory.mktemp("bare")
    venv.create(root / "env", with_pip=False, symlinks=True)
    wheel = root / f"nbkit_ddp-{nbkit.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in sorted(PACKAGE.rglob("*.py")):
            archive.write(path, path.relative_to(PACKAGE.parent))
        # the wheel's own metadata, which importlib.metadata finds on sys.path too: not an installed nbkit-ddp
        metadata = f"Metadata-Version: 2.4\nName: nbkit-ddp\nVersion: {nbkit.__version__}\n"
        archive.writestr(f"nbkit_ddp-{nbkit.__version__}.dist-info/METADATA", metadata)
    return root / "env" / "bin" / "python", wheel


def _run(python: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), *args], capture_output=True, text=True, cwd=cwd, env={"PATH": "/usr/bin:/bin", **env}, timeout=60
    )


@pytest.mark.version_independent
def test_it_runs_from_the_wheel_before_anything_is_installed(bare_python: tuple[Path, Path]):
    python, wheel = bare_python
    done = _run(python, "-m", "nbkit.bootstrap", "--dry-run", cwd=wheel.parent, PYTHONPATH=str(wheel))
    assert done.returncode == 0, done.stderr
    held = ", ".join(bootstrap.HELD)
    assert done.stdout == f"pip install -c <the installed versions of {held}> {wheel}[peft]\n"


@pytest.mark.version_independent
def test_the_cell_forgets_the_wheel_after_installing_so_the_next_import_finds_the_installed_copy(
    bare_python: tuple[Path, Path],
):
    python, wheel = bare_python
    cell = (
        "import glob, sys\n"
        'sys.path[:0] = sorted(glob.glob("/kaggle/input/*/nbkit_ddp-*.whl") + glob.glob("nbkit_ddp-*.whl"))[-1:]\n'
        "from nbkit import bootstrap\n"
        "bootstrap.install(dry_run=True)\n"
        "import nbkit\n"
    )
    done = _run(python, "-c", cell, cwd=wheel.parent)
    assert done.stdout.startswith("pip install -c <the installed versions of torch")
    # nothing was installed (a dry run), and the wheel is off the path: no nbkit to import any more
    assert done.stderr.strip().endswith("ModuleNotFoundError: No module named 'nbkit'"), done.stderr


@pytest.mark.version_independent
def test_a_failing_pip_ends_in_an_install_error_with_pips_words_and_kaggles_internet_setting(
    bare_python: tuple[Path, Path],
):
    python, wheel = bare_python
    done = _run(
        python, "-m", "nbkit.bootstrap", cwd=wheel.parent, PYTHONPATH=str(wheel), KAGGLE_KERNEL_RUN_TYPE="Batch"
    )
    assert done.returncode == 1 and done.stdout == ""
    first, *rest = done.stderr.splitlines()
    assert first == (
        f"pip install {wheel}[peft] failed (exit 1). On Kaggle, pip needs Settings > Internet on (a phone-verified "
        "account)."
    )
    assert "No module named pip" in "\n".join(rest)
