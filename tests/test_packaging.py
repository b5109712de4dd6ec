"""nbkit as a user installs it: the `nbkit-ddp` distribution, its metadata, and the notebooks' install cell.

The slow tests build the real sdist and wheel with `python -m build` (what `make dist` runs), check them
with twine, install the wheel into a fresh virtual environment and load it in a Jupyter kernel there,
and run the notebooks' install cell (nbkit.bootstrap, run from the wheel) in a kernel, and in IPython against
a foreign `nbkit` 0.0.10 (the shape of the unrelated 2023 project that owns the name on PyPI).
"""

from __future__ import annotations

import ast
import email
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

import nbkit
from nbkit.notebook import diagnostics

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
INSTALL_CELL = 2  # the first code cell of every notebook, after the title and "1. Install"

# Modules nbkit imports only where they are there, each behind a check, and so never requires:
# unsloth is an optional backend (its extra), bitsandbytes comes with unsloth or the quant extra,
# torchvision is optional for transformers, and the platforms' secret stores exist only on Kaggle/Colab.
# datasets and peft come with the peft and unsloth extras (nbkit.data needs datasets, the notebooks' data;
# nbkit.models' transformers backend adds LoRA with peft); tqdm with huggingface_hub (the live ranks' text bars
# patch tqdm.auto, skipped where it does not import).
OPTIONAL_IMPORTS = {
    "unsloth",
    "unsloth_zoo",
    "bitsandbytes",
    "torchvision",
    "kaggle_secrets",
    "google",
    "liger_kernel",
    "datasets",
    "peft",
    "tqdm",
}


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_modules() -> set[str]:
    """Top-level names of every module nbkit's code imports (absolute imports, anywhere in a file)."""
    found: set[str] = set()
    for path in (REPO / "nbkit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"nbkit", "__future__"}


@pytest.mark.version_independent
def test_the_distribution_is_nbkit_ddp_with_an_spdx_license_and_the_package_version():
    project = PYPROJECT["project"]
    assert project["name"] == "nbkit-ddp"
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0" in (REPO / "LICENSE").read_text()
    assert any(r.startswith("setuptools>=77") for r in PYPROJECT["build-system"]["requires"])
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "nbkit.__version__"}
    assert nbkit.__version__ == "0.2.0"
    # No project URLs until the project has an address of its own: a URL under an account it does not
    # control is a dead link at best and someone else's code at worst.
    assert "urls" not in project
    assert project["name"] == diagnostics.DISTRIBUTION


def test_dependencies_are_exactly_what_nbkit_imports():
    imported = _imported_modules()
    required = {_normal(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]}
    # module name -> distribution names (PIL -> pillow, IPython -> ipython, ...), from this environment
    distributions = importlib.metadata.packages_distributions()
    needed = set()
    for module in imported - OPTIONAL_IMPORTS:
        names = {_normal(d) for d in distributions.get(module, [])}
        assert names, f"nbkit imports {module}, which no installed distribution provides"
        needed |= names
    assert needed <= required, f"imported but not required: {sorted(needed - required)}"
    assert required <= needed, f"required but not imported: {sorted(required - needed)}"
    # papermill runs notebooks/run.py, which is not part of the package: an extra brings it.
    assert "papermill" not in required
    assert any(Requirement(r).name == "papermill" for r in PYPROJECT["project"]["optional-dependencies"]["notebooks"])


def test_tested_versions_are_the_constraint_files_and_the_lower_bounds():
    newest, oldest = _pins(REPO / "constraints.txt"), _pins(REPO / "constraints-oldest.txt")
    lower = {}
    for requirement in PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["peft"]:
        parsed = Requirement(requirement)
        floors = [s.version for s in parsed.specifier if s.operator == ">="]
        if floors:
            lower[_normal(parsed.name)] = floors[0]
    for name, (first, last) in diagnostics.TESTED_VERSIONS.items():
        if name != "torch":  # torch: the CPU build in CI, older builds on the GPU machines
            assert first == oldest[name], f"{name}: TESTED_VERSIONS says {first}, constraints-oldest.txt {oldest[name]}"
            assert Version(lower[name]) <= Version(first), f"{name}: the declared lower bound is below the tested"
        assert Version(newest[name].split("+")[0]) <= Version(last), f"{name}: constraints.txt is newer than tested"
    # the version range: unsloth's Kaggle pins through CI's newest set (what `make constraints` resolved)
    assert oldest["transformers"] == "4.57.1" and oldest["trl"] == "0.22.2"
    for name in ("transformers", "trl", "peft"):
        assert diagnostics.TESTED_VERSIONS[name][1] == newest[name], f"{name}: TESTED_VERSIONS is not constraints.txt"


def test_readme_and_docs_links_into_the_repository_are_relative_and_resolve():
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        links = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
        relative = [link.split("#")[0] for link in links if not link.startswith(("https://", "http://", "#"))]
        if page.name == "README.md":
            assert relative, "the README links to the notebooks and docs of this repository"
        missing = [link for link in relative if link and not (page.parent / link).exists()]
        assert missing == [], page


def test_no_install_line_or_link_names_an_address_the_project_does_not_control():
    texts = {path: path.read_text() for path in [REPO / "README.md", REPO / "pyproject.toml", *NOTEBOOKS]}
    texts.update({path: path.read_text() for path in (REPO / "tests").glob("*.py") if path != Path(__file__)})
    # the executed notebooks kept with measured results carry the install cell of their day
    kept = {path: path.read_text() for path in (REPO / "benchmarks" / "results").rglob("*.ipynb")}
    assert kept
    for path, text in {**texts, **kept}.items():
        assert "github.com/nbkit" not in text, path
        assert "@v0." not in text, path  # no git tag exists to pin


def _install_cell(notebook: Path) -> str:
    cell = json.loads(notebook.read_text())["cells"][INSTALL_CELL]
    assert cell["cell_type"] == "code"
    return "".join(cell["source"])


def test_every_notebook_has_the_same_short_install_cell_that_runs_nbkits_installer_from_the_wheel():
    cells = {notebook.name: _install_cell(notebook) for notebook in NOTEBOOKS}
    assert len(cells) == len(list(REPO.glob("notebooks/*.ipynb"))) >= 5, sorted(cells)
    assert len(set(cells.values())) == 1, "the install cells differ: " + ", ".join(cells)
    cell = next(iter(cells.values()))
    # As short as unsloth's (six pip lines): what to install where lives in nbkit.bootstrap, in the wheel.
    code = [line for line in cell.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(code) <= 4, cell
    assert '"/kaggle/input/*/nbkit_ddp-*.whl"' in cell and "from nbkit import bootstrap" in cell
    readme = (REPO / "README.md").read_text()
    assert 'pip install "nbkit-ddp[unsloth] @ git+<your clone\'s URL>"' in readme
    assert "make dist" in readme and "/kaggle/input" in readme


# --------------------------------------------------------------------------------------------
# Built, installed, run (slow)
# --------------------------------------------------------------------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment for another interpreter: without PYTHONPATH (which points at this checkout)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and wheel, built as `make dist` builds them, and checked by twine."""
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=600,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == [f"nbkit_ddp-{nbkit.__version__}-py3-none-any.whl", f"nbkit_ddp-{nbkit.__version__}.tar.gz"]
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, out.iterdir())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0 and checked.stdout.count("PASSED") == 2, checked.stdout + checked.stderr
    return out


def _wheel(dist: Path) -> Path:
    return next(dist.glob("*.whl"))


def _site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python3*/site-packages"))


@pytest.mark.slow
def test_the_wheel_has_the_metadata_users_and_the_package_index_read(dist: Path):
    with zipfile.ZipFile(_wheel(dist)) as wheel:
        names = wheel.namelist()
        info = f"nbkit_ddp-{nbkit.__version__}.dist-info"
        metadata = email.message_from_bytes(wheel.read(f"{info}/METADATA"))
    assert metadata["Name"] == "nbkit-ddp" and metadata["Version"] == nbkit.__version__
    assert metadata["License-Expression"] == "Apache-2.0" and metadata["License-File"] == "LICENSE"
    assert f"{info}/licenses/LICENSE" in names
    assert "nbkit/__init__.py" in names and "nbkit/training/savers/__init__.py" in names
    assert not any(n.startswith(("tests/", "notebooks/", "benchmarks/")) for n in names)
    requires = metadata.get_all("Requires-Dist")
    unconditional = {r for r in requires if ";" not in r}
    assert {_normal(Requirement(r).name) for r in unconditional} == {
        _normal(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]
    }
    assert 'papermill>=2.6; extra == "notebooks"' in requires
    assert any(r.startswith("unsloth>=2026.10.9") and 'extra == "unsloth"' in r for r in requires)
    assert metadata.get_all("Project-URL") is None
    assert metadata["Description-Content-Type"] == "text/markdown"


def _fresh_env(path: Path, *, borrow_site_packages: bool) -> Path:
    """A new virtual environment with pip. With borrow_site_packages, the libraries of the environment
    running the tests are importable after its own (a .pth file naming a folder of links to them: nothing is
    copied, nothing of theirs is shadowed), so a wheel installs without a download. nbkit itself is left out
    (the test environment holds this checkout as an editable install), so the new one has no nbkit-ddp."""
    venv.create(path, with_pip=True, symlinks=True)
    if borrow_site_packages:
        borrowed = path / "borrowed"
        borrowed.mkdir()
        for root in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
            for entry in Path(root).iterdir():
                name = entry.name.lower()
                if not name.startswith(("nbkit", "__editable__")) and not (borrowed / entry.name).exists():
                    (borrowed / entry.name).symlink_to(entry)
        (_site_packages(path) / "zz_borrowed.pth").write_text(f"{borrowed}\n")
        # the environment's own setuptools (what venv puts there) would shadow the newer one torch requires
        subprocess.run([path / "bin" / "python", "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=False)
    return path


def _pip_install(python: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m pip install ARGS` in the clean environment; asserts that it succeeded (showing pip's output)."""
    done = subprocess.run(
        [python, "-m", "pip", "install", *args], capture_output=True, text=True, env=_clean_env(), timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.slow
def test_the_wheel_installs_by_its_name_and_loads_as_nbkit_in_a_kernel(dist: Path, tmp_path: Path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    env = _fresh_env(tmp_path / "env", borrow_site_packages=True)
    python = str(env / "bin" / "python")
    installed = _pip_install(python, "--no-deps", "--no-index", str(_wheel(dist)), timeout=300)
    assert f"Successfully installed nbkit-ddp-{nbkit.__version__}" in installed.stdout
    assert (_site_packages(env) / "nbkit" / "__init__.py").is_file()

    # A kernel on that interpreter, as a user's notebook would have it.
    kernels = tmp_path / "jupyter" / "kernels" / "wheel-env"
    kernels.mkdir(parents=True)
    spec = {"argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"], "display_name": "wheel"}
    (kernels / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("%load_ext nbkit"),
        nbformat.v4.new_code_cell(
            "import importlib.metadata, nbkit\n"
            "dist = importlib.metadata.distribution('nbkit-ddp')\n"
            "print(nbkit.__file__, nbkit.__version__, dist.metadata['Name'], dist.metadata['License-Expression'])"
        ),
        nbformat.v4.new_code_cell("%nbkit doctor"),
    ]
    # Started in tmp_path, so the kernel's sys.path[0] is not this checkout.
    NotebookClient(
        notebook, kernel_name="wheel-env", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    out = ["".join(o.get("text", "") for o in cell.outputs) for cell in notebook.cells]
    location, version, name, license_ = out[1].split()
    assert Path(location).is_relative_to(env) and version == nbkit.__version__
    assert (name, license_) == ("nbkit-ddp", "Apache-2.0")
    assert "nbkit doctor" in out[2] and "platform: local (Jupyter kernel)" in out[2]


def _foreign_nbkit_wheel(out: Path) -> Path:
    """A wheel of the shape of PyPI's `nbkit` 0.0.10 (an nbdev "jupyter notebook toolkit", 2023): the same
    `nbkit` package name, no IPython extension."""
    wheel = out / "nbkit-0.0.10-py3-none-any.whl"
    info = "nbkit-0.0.10.dist-info"
    files = {
        "nbkit/__init__.py": '__version__ = "0.0.10"\n',
        "nbkit/core.py": "def hello():\n    return 'jupyter notebook toolkit'\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: nbkit\nVersion: 0.0.10\nSummary: jupyter notebook toolkit\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", record)
    return wheel


def _kaggle_inputs(dist: Path, tmp_path: Path) -> Path:
    """A stand-in for /kaggle/input with the wheel attached as a dataset (Kaggle mounts each at /kaggle/input/NAME)."""
    inputs = tmp_path / "kaggle-input"
    (inputs / "nbkit-wheel").mkdir(parents=True)
    (inputs / "nbkit-wheel" / _wheel(dist).name).symlink_to(_wheel(dist))
    return inputs


@pytest.mark.slow
def test_the_install_cell_installs_the_attached_wheel_and_load_ext_works(dist: Path, tmp_path: Path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    env = _fresh_env(tmp_path / "env", borrow_site_packages=True)
    python = str(env / "bin" / "python")
    kernels = tmp_path / "jupyter" / "kernels" / "fresh-env"
    kernels.mkdir(parents=True)
    spec = {"argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"], "display_name": "fresh"}
    (kernels / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # everything nbkit needs is there: pip must not need the index
    held = {name: importlib.metadata.version(name) for name in ("torch", "transformers", "trl", "peft")}
    # The cell as a Kaggle user runs it, with Kaggle's mount point moved to the stand-in.
    cell = _install_cell(NOTEBOOKS[0])
    assert cell.count('"/kaggle/input/') == 1
    inputs = _kaggle_inputs(dist, tmp_path)
    cell = cell.replace('"/kaggle/input/', f'"{inputs}/')

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(cell),
        nbformat.v4.new_code_cell("%load_ext nbkit"),
        nbformat.v4.new_code_cell(
            "import importlib.metadata, nbkit\n"
            "print(nbkit.__file__, *(importlib.metadata.version(n) for n in ('torch', 'transformers', 'trl', 'peft')))"
        ),
    ]
    NotebookClient(
        notebook,
        kernel_name="fresh-env",
        timeout=600,
        resources={"metadata": {"path": str(tmp_path)}},
        allow_errors=True,
    ).execute()
    shown = ["".join(o.get("text", "") or "".join(o.get("traceback", [])) for o in c.outputs) for c in notebook.cells]
    assert (_site_packages(env) / f"nbkit_ddp-{nbkit.__version__}.dist-info").is_dir(), shown[0]
    assert shown[0] == f"installed nbkit-ddp {nbkit.__version__} from {inputs}/nbkit-wheel/{_wheel(dist).name}\n"
    assert shown[1] == "", shown[1]
    location, *versions = "".join(o.get("text", "") for o in notebook.cells[2].outputs).split()
    assert Path(location).is_relative_to(env)
    assert dict(zip(held, versions)) == held  # nothing the platform (or unsloth's recipe) installed was replaced


@pytest.mark.slow
# version_independent: its environment has ipython and the wheel only, none of the test environment's libraries.
@pytest.mark.version_independent
def test_the_install_cell_names_a_foreign_nbkit_and_replaces_it(dist: Path, tmp_path: Path):
    # A fresh environment with IPython (to run the cell's %pip lines) and the foreign nbkit, nothing else:
    # nothing of the test environment is visible to it, so the cell sees only what a user's machine has.
    env = _fresh_env(tmp_path / "env", borrow_site_packages=False)
    python = str(env / "bin" / "python")
    _pip_install(python, "-q", "ipython", str(_foreign_nbkit_wheel(tmp_path)), timeout=600)
    site = _site_packages(env)
    assert (site / "nbkit-0.0.10.dist-info").is_dir()

    cell = tmp_path / "install_cell.ipy"
    cell.write_text(_install_cell(NOTEBOOKS[0]))
    # The wheel uploaded to the working folder, as on Colab (/content); installed without the index and without its
    # dependencies (torch & co.).
    uploaded = tmp_path / _wheel(dist).name
    uploaded.symlink_to(_wheel(dist))
    run_env = _clean_env(PIP_NO_INDEX="1", PIP_NO_DEPS="1")

    def run_cell() -> str:
        done = subprocess.run(
            [python, "-m", "IPython", "--quick", "--no-banner", str(cell)],
            capture_output=True,
            text=True,
            env=run_env,
            cwd=tmp_path,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    first = run_cell()
    assert f"Found nbkit 0.0.10 (jupyter notebook toolkit), not nbkit-ddp {nbkit.__version__}: replacing it." in first
    assert not (site / "nbkit-0.0.10.dist-info").exists() and not (site / "nbkit" / "core.py").exists()
    assert (site / f"nbkit_ddp-{nbkit.__version__}.dist-info").is_dir()
    assert "def load_ipython_extension" in (site / "nbkit" / "__init__.py").read_text()
    assert f"installed nbkit-ddp {nbkit.__version__} from {uploaded}\n" in first
    # Run again: the right version is there, so the cell does nothing.
    assert run_cell().strip() == ""
