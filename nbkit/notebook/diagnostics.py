"""nbkit.doctor(): what this notebook's machine and process look like to nbkit, and what to fix.

    print(nbkit.doctor())      # or %nbkit doctor

Reports the platform (Kaggle, Colab, local), the GPUs (name, memory, compute capability, bf16 or
fp16; read without initialising CUDA), whether this process could fork training processes now
(CUDA state, accelerate state, bitsandbytes), the versions of the libraries nbkit works with, with
known-bad combinations and versions outside the tested range flagged, and which of the secrets
these notebooks use (HF_TOKEN, WANDB_API_KEY, KAGGLE_USERNAME/KAGGLE_KEY) are set: in the
environment and, on Kaggle and Colab, in the platform's secret store. Secret values never reach
the report: only whether each is set.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbkit.bootstrap import DISTRIBUTION  # the distribution that installs `nbkit` (`nbkit` on the index is another)
from nbkit.platform import distributed, patching
from nbkit.platform import host as platform

__all__ = ["Problem", "Report", "doctor"]

LIBRARIES = (
    "nbkit-ddp",
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

# The versions CI tests nbkit with, per library: (oldest, newest) = the pins of constraints-oldest.txt
# and of constraints.txt or the GPU runs, whichever is newer (tests/test_packaging.py holds them to
# those files). A release of the newest tested minor line (5.24.x) counts as tested. Outside the
# range nbkit may well work, but nobody has run it: doctor says so, as a warning.
TESTED_VERSIONS: dict[str, tuple[str, str]] = {
    "torch": ("2.11.0", "2.13.0"),
    "transformers": ("4.57.1", "5.24.0"),
    "trl": ("0.22.2", "1.16.0"),
    "accelerate": ("1.12.0", "1.15.0"),
    "peft": ("0.18.0", "0.21.2"),
    "datasets": ("3.6.0", "4.8.5"),
}

# The credentials these notebooks use: the hub (models, push_to_hub), Weights & Biases, Kaggle's API.
# Only whether each is set is ever reported, from the environment and from the platform's own secret
# store (Kaggle: Add-ons > Secrets; Colab: the key icon), never a value.
SECRET_NAMES = ("HF_TOKEN", "WANDB_API_KEY", "KAGGLE_USERNAME", "KAGGLE_KEY")


@dataclass
class Problem:
    """One thing to fix: what is wrong, what to do, and how bad ("error" blocks training,
    "warning" costs speed or may break later, "info" is worth knowing and needs nothing).
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
    # The platform's secret store: where it is, and per name "set", "not set" or why it is not known.
    platform_secrets: tuple[str, dict[str, str]] | None = None
    problems: list[Problem] = field(default_factory=list)
    # nbkit's patches of other libraries, group -> targets: in place now, and waiting for an import.
    patches_applied: dict[str, list[str]] = field(default_factory=dict)
    patches_pending: dict[str, list[str]] = field(default_factory=dict)

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
        lines.append(f"  patches applied: {_groups(self.patches_applied)}")
        lines.append(f"  patches pending (applied when their module is imported): {_groups(self.patches_pending)}")
        lines.append("  versions: " + ", ".join(f"{k} {v or '-'}" for k, v in self.versions.items()))
        present = [k for k, v in self.secrets.items() if v]
        absent = [k for k, v in self.secrets.items() if not v]
        lines.append(f"  secrets set: {', '.join(present) or 'none'}; not set: {', '.join(absent) or 'none'}")
        if self.platform_secrets is not None:
            store, states = self.platform_secrets
            by_state: dict[str, list[str]] = {}
            for name, state in states.items():
                by_state.setdefault(state, []).append(name)
            lines.append(f"  {store}: " + "; ".join(f"{state}: {', '.join(n)}" for state, n in by_state.items()))
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


def doctor(gpus: int | None = None) -> Report:
    """Inspect this machine and process. Never initialises CUDA, never imports unsloth or
    bitsandbytes, never reads a secret's value. Safe in the notebook before launching.

    Args:
        gpus: the ranks the notebook is about to start (what nbkit.start / %ddp start --gpus gets), or None.
            Without a GPU, gpus=N asks for N CPU processes, so that no GPU is visible is then an info line,
            not an error.
    """
    from nbkit.notebook import dashboard
    from nbkit.platform import forksafety

    here = platform.current()
    versions = {name: _version(name) for name in LIBRARIES}
    visible = distributed.visible_gpus()
    cuda_initialized = "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()
    blocker = forksafety.fork_blocker()
    report = Report(
        platform=here.description,
        gpus=visible,
        cuda_initialized=cuda_initialized,
        fork_blocker=blocker.summary if blocker is not None else None,
        launch_mode=(
            "fork one process per GPU (fast start)"
            if blocker is None
            else "start fresh processes (%%ddp spawn mode); nbkit.launch refuses"
        ),
        dashboard=_dashboard_mode(dashboard),
        versions=versions,
        secrets=_secrets(),
        patches_applied=_by_group(patching.applied),
        patches_pending=_by_group(patching.pending),
        platform_secrets=_platform_secrets(here),
    )
    report.problems += _gpu_problems(visible, here, gpus)
    if blocker is not None:
        report.problems.append(
            Problem(
                blocker.summary,
                "Restart the kernel and keep GPU work (model loading, `import unsloth`/`bitsandbytes`, "
                "Trainer/Accelerator creation) inside the launched function or %%ddp cell. Until then %%ddp "
                "runs cells in fresh processes (slower to start; names must be picklable).",
                "warning",
            )
        )
    report.problems += _version_problems(versions)
    return report


def _by_group(targets: Callable[[str], list[str]]) -> dict[str, list[str]]:
    """Group -> targets, for the groups where `targets(group)` names any."""
    groups = dict.fromkeys(p.group for p in patching.registered())
    return {group: found for group in groups if (found := targets(group))}


def _groups(patches: dict[str, list[str]]) -> str:
    return "; ".join(f"{group} ({', '.join(targets)})" for group, targets in patches.items()) or "none"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


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
    found = {name: bool(os.environ.get(name)) for name in SECRET_NAMES}
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    found["HF_HOME/token (huggingface-cli login)"] = (hf_home / "token").is_file()
    return found


def _platform_secrets(here: platform.Platform) -> tuple[str, dict[str, str]] | None:
    """Which of SECRET_NAMES the platform's secret store holds for this notebook; None off Kaggle/Colab.

    Each store only answers with a value, so a value is fetched and dropped at once: only "set",
    "not set" or why the store could not be asked leaves this function. The stores' modules exist
    only on their platform and are imported here, never at nbkit's import.
    """
    if here.host == "kaggle":
        return "Kaggle secrets (Add-ons > Secrets)", _kaggle_secrets()
    if here.host == "colab":
        return "Colab secrets (the key icon)", _colab_secrets()
    return None


def _kaggle_secrets() -> dict[str, str]:
    try:
        from kaggle_secrets import UserSecretsClient  # Kaggle's image ships it
    except ImportError:
        return dict.fromkeys(SECRET_NAMES, "unknown (no kaggle_secrets module)")
    try:
        client = UserSecretsClient()
    except Exception as exc:  # CredentialError: no secrets token in this session
        return dict.fromkeys(SECRET_NAMES, f"unknown ({type(exc).__name__})")
    states: dict[str, str] = {}
    for name in SECRET_NAMES:
        try:
            states[name] = "set" if client.get_secret(name) else "not set"
        except ConnectionError:  # internet off: every further call would wait for its own timeout
            return {**states, **dict.fromkeys(SECRET_NAMES[len(states) :], "unknown (internet off?)")}
        except Exception:  # BackendError: no such secret, or not attached to this notebook
            states[name] = "not set"
    return states


def _colab_secrets() -> dict[str, str]:
    try:
        from google.colab import userdata  # Colab's runtime ships it
    except ImportError:
        return dict.fromkeys(SECRET_NAMES, "unknown (no google.colab.userdata)")
    states: dict[str, str] = {}
    for name in SECRET_NAMES:
        try:
            states[name] = "set" if userdata.get(name) else "not set"
        except userdata.NotebookAccessError:
            states[name] = "set, but this notebook has no access (turn on Notebook access)"
        except Exception:  # SecretNotFoundError, or no answer from the frontend
            states[name] = "not set"
    return states


def _gpu_problems(gpus: list[distributed.GPU], here: platform.Platform, ranks: int | None) -> list[Problem]:
    problems = []
    if not gpus and ranks is not None:  # CPU processes, as asked
        fix = "Nothing, to try code on CPU processes. To train on GPUs, run on a machine with GPUs."
        problems.append(Problem(f"No GPU is visible: the {ranks} rank(s) asked for are CPU processes.", fix, "info"))
        return problems
    if not gpus:
        fix = (
            "On Kaggle: Settings > Accelerator > GPU T4 x2. On Colab: Runtime > Change runtime type. "
            "On CPU, %ddp start --gpus N (nbkit.start(gpus=N)), nbkit.launch(gpus=N) or %%ddp --gpus N run N CPU "
            "processes (for trying code only)."
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
    if here.host == "kaggle" and len(gpus) == 1:
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

    requirements, installation = _installation_problems()
    problems += installation
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
    problems += _torchvision_problems(versions)
    # One problem per library: a version already outside a requirement needs no second warning.
    flagged = {p.what.split(" ", 1)[0] for p in problems}
    problems += [p for p in _untested_versions(versions) if p.what.split(" ", 1)[0] not in flagged]
    return problems


def _installation_problems() -> tuple[list[str], list[Problem]]:
    """(nbkit's own requirements, what is wrong with how nbkit is installed): a source folder on sys.path
    (the requirements cannot be read), or PyPI's unrelated `nbkit` sharing the `nbkit` folder.
    """
    problems: list[Problem] = []
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:  # imported from a source folder on sys.path
        requirements = []
        problems.append(
            Problem(
                "nbkit is imported from a folder, not installed, so the versions it needs are not checked.",
                "pip install the nbkit folder (pip install -e PATH) to have them checked.",
                "warning",
            )
        )
    other = _version("nbkit")  # a distribution named `nbkit`: PyPI's unrelated project, or nbkit before 0.2
    if other is not None:
        summary = importlib.metadata.metadata("nbkit").json.get("summary", "no description")
        problems.append(
            Problem(
                f"A distribution named `nbkit` ({other}, {summary!r}) is installed: it is PyPI's unrelated "
                f"`nbkit` project or an nbkit from before 0.2.0 (nbkit is now {DISTRIBUTION}), and it writes the "
                "same `nbkit` folder, so which files you run depends on the order of installs.",
                f"pip uninstall -y nbkit {DISTRIBUTION}, then install {DISTRIBUTION} again (the notebooks' "
                "install cell does both), and restart the kernel.",
                "warning",
            )
        )
    return requirements, problems


def _torchvision_problems(versions: dict[str, str | None]) -> list[Problem]:
    """A torchvision that does not belong to the installed torch (it imports, but its operators fail)."""
    problems: list[Problem] = []
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


def _untested_versions(versions: dict[str, str | None]) -> list[Problem]:
    """Warnings for libraries installed at a version outside TESTED_VERSIONS."""
    from packaging.version import InvalidVersion, Version

    problems = []
    for name, (oldest, newest) in TESTED_VERSIONS.items():
        installed = versions.get(name) if name in versions else _version(name)
        if installed is None:
            continue
        try:
            version = Version(installed)
        except InvalidVersion:
            continue
        newest_line = Version(newest).release[:2]
        if version < Version(oldest):
            relation = "older than the oldest"
        elif version.release[:2] > newest_line:
            relation = "newer than the newest"
        else:
            continue
        tested = f"{oldest} to {'.'.join(map(str, newest_line))}.x"
        problems.append(
            Problem(
                f"{name} {installed} is {relation} version nbkit is tested with ({tested}).",
                f"It may work. If something fails in {name}, install a tested one: "
                f'pip install "{name}>={oldest},<={newest}" and restart the kernel.',
                "warning",
            )
        )
    return problems


def _torchvision_for(torch_version: str) -> str | None:
    """Torchvision's release line for a torch 2.x release: 0.(minor + 15), e.g. 2.13 -> 0.28."""
    match = re.match(r"2\.(\d+)", torch_version)
    return f"0.{int(match.group(1)) + 15}" if match else None
