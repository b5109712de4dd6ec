"""nbkit: multi-GPU fine-tuning from inside a Jupyter notebook.

The plain Python API lives here; `%load_ext nbkit` adds magics that are thin layers over it.

    import nbkit

    def train(lr):
        ...                       # build model, Trainer, train; runs once per GPU
        return metrics            # rank 0's value comes back

    metrics = nbkit.launch(train, 2e-4)          # all visible GPUs (or gpus=N CPU processes)

    ranks = nbkit.start()                        # or: processes that stay up across cells (nbkit.live)
    ranks.exec("model = load()")                 # every rank; `model` stays there for later calls

    value = nbkit.run_cell(source, globals(), gpus=2)   # what a %%ddp cell does, from a script too

    recipe = nbkit.recipe("tiny:qwen3-vl", gpus=2)     # GPUs, backend, precision, 4-bit or not, batch: once

Names are imported lazily, so `import nbkit` stays cheap and never touches CUDA or IPython.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

__version__ = "0.2.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # launching
    "launch": "nbkit.launching.fork",
    # what a %%ddp cell does, for scripts too
    "run_cell": "nbkit.notebook.run_cell",
    # live sets: processes that stay up across cells
    "start": "nbkit.live",
    "connect": "nbkit.live",
    "LiveRanks": "nbkit.live",
    "LiveError": "nbkit.platform.errors",
    # errors: one family (nbkit.errors)
    "NbkitError": "nbkit.platform.errors",
    "LaunchError": "nbkit.platform.errors",
    "DeviceMapError": "nbkit.platform.errors",
    "BringAlongError": "nbkit.platform.errors",
    "CellSyntaxError": "nbkit.platform.errors",
    "ExportError": "nbkit.platform.errors",
    "EmulationError": "nbkit.platform.errors",
    "CheckpointError": "nbkit.platform.errors",
    "StrategyError": "nbkit.platform.errors",
    "RanksError": "nbkit.platform.errors",
    "DatasetError": "nbkit.platform.errors",
    "DatasetArgumentError": "nbkit.platform.errors",
    "ProcessGroupError": "nbkit.platform.errors",
    "GradientError": "nbkit.platform.errors",
    # where this process stands
    "rank": "nbkit.platform.distributed",
    "local_rank": "nbkit.platform.distributed",
    "world_size": "nbkit.platform.distributed",
    "is_main": "nbkit.platform.distributed",
    "is_distributed": "nbkit.platform.distributed",
    "device": "nbkit.platform.distributed",
    "precision": "nbkit.platform.distributed",
    "visible_gpus": "nbkit.platform.distributed",
    # a smaller GPU's limits on a larger one (nbkit.emulate("T4"))
    "emulate": "nbkit.training.emulation",
    # settings and patches
    "configure": "nbkit.platform.config",
    "install": "nbkit.platform.patch_groups",
    "uninstall": "nbkit.platform.patch_groups",
    # the guard and the planner
    "resolve_device_map": "nbkit.training.guard",
    "plan": "nbkit.notebook.planner",
    "Plan": "nbkit.notebook.planner",
    "BatchSettings": "nbkit.notebook.planner",
    # a run's choices, made once in the notebook, and the model steps for them (nbkit.recipe(...).from_pretrained)
    "recipe": "nbkit.notebook.recipes",
    "Recipe": "nbkit.notebook.recipes",
    # offline models and data
    "resolve_model": "nbkit.training.offline",
    "vision_dataset": "nbkit.training.synthetic",
    "text_dataset": "nbkit.training.synthetic",
    # live reporting
    "report": "nbkit.rank_side.reporting",
    "peak_memory_gib": "nbkit.rank_side.reporting",
    # diagnostics
    "doctor": "nbkit.notebook.diagnostics",
}

# submodules used as namespaces, imported on first use: nbkit.savers.apply(...),
# nbkit.checkpoints.resume_point(...), nbkit.dashboard.latest(), nbkit.export.export_script(...),
# nbkit.live.LiveRanks, nbkit.fsdp.qlora_config()
_SUBMODULES = (
    "checkpoints",
    "config",
    "data",
    "dashboard",
    "export",
    "fsdp",
    "integration",
    "live",
    "models",
    "offline",
    "patching",
    "run_summary",
    "savers",
    "synthetic",
)

# Module paths users import that moved into the folders by layer: each old path (and what lies under it)
# imports the module it names now, as the same module object, so that `from nbkit.offline import ...`, an
# exported script's `from nbkit.cell_group import joined` and a patch of `nbkit.savers.loss` keep working.
_MOVED: dict[str, str] = {
    "nbkit.cell_group": "nbkit.rank_side.cell_group",
    "nbkit.checkpoints": "nbkit.training.checkpoints",
    "nbkit.config": "nbkit.platform.config",
    "nbkit.dashboard": "nbkit.notebook.dashboard",
    "nbkit.data": "nbkit.training.data",
    "nbkit.distributed": "nbkit.platform.distributed",
    "nbkit.emulation": "nbkit.training.emulation",
    "nbkit.errors": "nbkit.platform.errors",
    "nbkit.export": "nbkit.notebook.export",
    "nbkit.fsdp": "nbkit.training.fsdp",
    "nbkit.integration": "nbkit.platform.patch_groups",
    "nbkit.magics": "nbkit.notebook.magics",
    "nbkit.models": "nbkit.training.models",
    "nbkit.offline": "nbkit.training.offline",
    "nbkit.patching": "nbkit.platform.patching",
    "nbkit.run_summary": "nbkit.notebook.run_summary",
    "nbkit.savers": "nbkit.training.savers",
    "nbkit.synthetic": "nbkit.training.synthetic",
}

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES or f"nbkit.{name}" in _MOVED:  # `nbkit.errors.X` as well as `from nbkit import errors`
        return importlib.import_module(_MOVED.get(f"nbkit.{name}", f"nbkit.{name}"))
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nbkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


def _moved_to(name: str) -> str | None:
    """The module an old path names now (`nbkit.savers.loss` -> `nbkit.training.savers.loss`), or None."""
    for old, new in _MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class _MovedPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module it names now (one object under both names, never a copy)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if _moved_to(name) else None

    def __init__(self) -> None:
        self._own: dict[str, Any] = {}

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(_moved_to(spec.name) or spec.name)
        self._own[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system gave the module the old path's spec: give it back its own
        module.__spec__ = self._own.pop(module.__spec__.name if module.__spec__ else "", module.__spec__)


sys.meta_path.insert(0, _MovedPaths())

# Before anything else imports torchao (transformers and peft do, where it is installed): its
# import-time device query would create a CUDA context here and make every launch fail.
importlib.import_module("nbkit.platform.forksafety").install()


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext nbkit`: registers the %%ddp and %nbkit magics."""
    from nbkit.notebook.magics import register

    register(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from nbkit.notebook.magics import unregister

    unregister(ipython)
