"""nbkit.doctor(): what this notebook's machine and process look like to nbkit, and what to fix.

    print(nbkit.doctor())      # or %nbkit doctor

Reports the platform (Kaggle, Colab, local), the GPUs (name, memory, compute capability, bf16 or
fp16; read without initialising CUDA), whether this process could fork training processes now
(CUDA state, accelerate state, bitsandbytes), the versions of the libraries nbkit works with, with
known-bad combinations flagged, and which secrets are set. Secret values are never read into the
report: only whether each is set.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbkit import distributed

__all__ = ["Problem", "Report", "doctor"]

LIBRARIES = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "trl",
    "datasets",
    "unsloth",
    "unsloth_zoo",
    "bitsandbytes",
    "torchvision",
    "ipywidgets",
    "ipykernel",
)

# unsloth's own requirements, release by release (from its package metadata; landscape.md). A
# version outside them is the usual cause of unsloth failing at import or at its first step.
UNSLOTH_PINS: dict[str, dict[str, str]] = {
    "2026.10.9": {
        "torch": ">=2.4,<2.15",
        "transformers": ">=4.52.4,<=5.17.0,!=4.53.0,!=4.54.0,!=4.55.*,!=4.57.0,!=4.57.4,!=4.57.5,!=5.0.0,!=5.1.0",
        "trl": ">=0.18.2,<=1.15.0",
        "peft": ">=0.18",
        "accelerate": ">=0.34.1",
        "bitsandbytes": ">=0.45.5",
        "datasets": ">=3.4.1,<5,!=4.0.*,!=4.1.0,!=4.4.*,!=4.5.0",
        "unsloth_zoo": "==2026.10.9",
    },
}

# Environment variables that hold credentials. Only their presence is ever reported.
SECRET_VARIABLES = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "KAGGLE_KEY",
    "KAGGLE_USERNAME",
    "WANDB_API_KEY",
    "OPENAI_API_KEY",
    "COMET_API_KEY",
    "NEPTUNE_API_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
)
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY)", re.IGNORECASE)


@dataclass
class Problem:
    """One thing to fix: what is wrong, what to do, and how bad ("error" blocks training,
    "warning" costs speed or may break later).
    """

    what: str
    fix: str
    severity: str = "error"


@dataclass
class Report:
    """doctor()'s findings. `str(report)` is the readable form; `ok` is True without errors."""

    platform: str
    gpus: list[distributed.GPU]
    cuda_initialized: bool
    fork_blocker: str | None
    launch_mode: str
    dashboard: str
    versions: dict[str, str | None]
    secrets: dict[str, bool]
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem is an error."""
        return not any(p.severity == "error" for p in self.problems)

    def __str__(self) -> str:
        lines = ["nbkit doctor", f"  platform: {self.platform}"]
        if self.gpus:
            lines.append(f"  GPUs ({len(self.gpus)} visible):")
            for g in self.gpus:
                cap = f"sm_{g.capability[0]}{g.capability[1]}" if g.capability != (0, 0) else "capability unknown"
                precision = "bf16" if g.bf16 else "fp16 (no native bf16)"
                lines.append(f"    {g.index}: {g.name}, {g.memory_gib:.1f} GiB, {cap}, {precision}")
        else:
            lines.append("  GPUs: none visible")
        state = "initialised" if self.cuda_initialized else "not initialised"
        lines.append(f"  this process: CUDA {state}; %%ddp / nbkit.launch would {self.launch_mode}")
        lines.append(f"  dashboard: {self.dashboard}")
        lines.append("  versions: " + ", ".join(f"{k} {v or '-'}" for k, v in self.versions.items()))
        present = [k for k, v in self.secrets.items() if v]
        absent = [k for k, v in self.secrets.items() if not v]
        lines.append(f"  secrets set: {', '.join(present) or 'none'}; not set: {', '.join(absent) or 'none'}")
        if self.problems:
            lines.append(f"Problems ({len(self.problems)}):")
            for p in self.problems:
                lines.append(f"  [{p.severity}] {p.what}")
                lines.append(f"      fix: {p.fix}")
        else:
            lines.append("No problems found.")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython shows the readable form
        printer.text(str(self))


def doctor() -> Report:
    """Inspect this machine and process. Never initialises CUDA, never imports unsloth or
    bitsandbytes, never reads a secret's value. Safe in the notebook before launching.
    """
    from nbkit import dashboard, spawning

    versions = {name: _version(name) for name in LIBRARIES}
    gpus = distributed.visible_gpus()
    cuda_initialized = "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()
    blocker = spawning.fork_blocker()
    report = Report(
        platform=_platform(),
        gpus=gpus,
        cuda_initialized=cuda_initialized,
        fork_blocker=blocker,
        launch_mode=(
            "fork one process per GPU (fast start)"
            if blocker is None
            else "start fresh processes (%%ddp spawn mode); nbkit.launch refuses"
        ),
        dashboard=_dashboard_mode(dashboard),
        versions=versions,
        secrets=_secrets(),
    )
    report.problems += _gpu_problems(gpus, report.platform)
    if blocker is not None:
        report.problems.append(
            Problem(
                blocker,
                "Restart the kernel and keep GPU work (model loading, `import unsloth`/`bitsandbytes`, "
                "Trainer/Accelerator creation) inside the launched function or %%ddp cell. Until then %%ddp "
                "runs cells in fresh processes (slower to start; names must be picklable).",
                "warning",
            )
        )
    report.problems += _version_problems(versions)
    return report


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _platform() -> str:
    run_type = os.environ.get("KAGGLE_KERNEL_RUN_TYPE")
    if run_type is not None or os.environ.get("KAGGLE_URL_BASE"):
        return f"Kaggle ({'batch run: Save & Run All' if run_type == 'Batch' else 'interactive session'})"
    if os.environ.get("COLAB_RELEASE_TAG") or os.environ.get("COLAB_GPU") is not None:
        return "Colab"
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    where = "Jupyter kernel" if hasattr(shell, "kernel") else ("IPython" if shell is not None else "script")
    return f"local ({where})"


def _dashboard_mode(dashboard: Any) -> str:
    try:
        mode = dashboard.display_mode()
    except ValueError as exc:
        return str(exc)
    return {
        "html": "live HTML panel, updated in place",
        "widget": "live ipywidgets panel",
        "text": "text lines (no live notebook frontend seen)",
        "off": "off (NBKIT_DASHBOARD=off)",
    }[mode]


def _secrets() -> dict[str, bool]:
    names = set(SECRET_VARIABLES) | {k for k in os.environ if _SECRET_NAME.search(k)}
    found = {name: bool(os.environ.get(name)) for name in sorted(names)}
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    found["HF_HOME/token (huggingface-cli login)"] = (hf_home / "token").is_file()
    return found


def _gpu_problems(gpus: list[distributed.GPU], platform: str) -> list[Problem]:
    problems = []
    if not gpus:
        fix = (
            "On Kaggle: Settings > Accelerator > GPU T4 x2. On Colab: Runtime > Change runtime type. "
            "On CPU, nbkit.launch(gpus=N) / %%ddp --gpus N run N CPU processes (for trying code only)."
        )
        problems.append(Problem("No GPU is visible to this process.", fix))
        return problems
    if len({(g.name, round(g.memory_gib)) for g in gpus}) > 1:
        problems.append(
            Problem(
                "The visible GPUs differ (" + ", ".join(g.name for g in gpus) + "): DDP runs at the pace of "
                "the slowest and must fit in the smallest.",
                "Set CUDA_VISIBLE_DEVICES to identical GPUs before anything imports torch.",
                "warning",
            )
        )
    if platform.startswith("Kaggle") and len(gpus) == 1:
        problems.append(
            Problem(
                f"Only one GPU ({gpus[0].name}) is visible on Kaggle.",
                "For two GPUs choose Settings > Accelerator > GPU T4 x2.",
                "warning",
            )
        )
    return problems


def _version_problems(versions: dict[str, str | None]) -> list[Problem]:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    problems: list[Problem] = []

    def check(name: str, spec: str, whose: str) -> None:
        installed = versions.get(name) if name in versions else _version(name)
        if installed is None:
            return
        try:
            ok = SpecifierSet(spec).contains(Version(installed), prereleases=True)
        except InvalidVersion:
            return
        if not ok:
            problems.append(
                Problem(
                    f"{name} {installed} is outside what {whose} supports ({name}{spec}).",
                    f'pip install "{name}{spec}" and restart the kernel.',
                )
            )

    try:
        requirements = importlib.metadata.requires("nbkit") or []
    except importlib.metadata.PackageNotFoundError:  # imported from a source folder on sys.path
        requirements = []
        problems.append(
            Problem(
                "nbkit is imported from a folder, not installed, so the versions it needs are not checked.",
                "pip install the nbkit folder (pip install -e PATH) to have them checked.",
                "warning",
            )
        )
    for requirement in requirements:
        parsed = Requirement(requirement)
        if parsed.marker is None and parsed.specifier:  # extras come with a marker
            check(parsed.name, str(parsed.specifier), "nbkit")
    unsloth = versions.get("unsloth")
    if unsloth is not None:
        pins = UNSLOTH_PINS.get(unsloth)
        if pins is None:
            known = ", ".join(UNSLOTH_PINS)
            problems.append(
                Problem(
                    f"unsloth {unsloth}: nbkit knows the requirements of unsloth {known} only, so combinations "
                    "with it are not checked.",
                    "If unsloth fails at import, install the versions its release notes name.",
                    "warning",
                )
            )
        else:
            for name, spec in pins.items():
                check(name, spec, f"unsloth {unsloth}")
    torch, vision = versions.get("torch"), versions.get("torchvision")
    if torch and vision:
        expected = _torchvision_for(torch)
        if expected is not None and not vision.startswith(expected):
            problems.append(
                Problem(
                    f"torchvision {vision} does not belong to torch {torch} (expected {expected}.x): it imports "
                    "but its operators fail, which breaks transformers' image processors.",
                    f'pip install "torchvision=={expected}.*" matching your torch build, or pip uninstall torchvision '
                    "(transformers then uses its PIL image processors).",
                )
            )
    return problems


def _torchvision_for(torch_version: str) -> str | None:
    """Torchvision's release line for a torch 2.x release: 0.(minor + 15), e.g. 2.13 -> 0.28."""
    match = re.match(r"2\.(\d+)", torch_version)
    return f"0.{int(match.group(1)) + 15}" if match else None
