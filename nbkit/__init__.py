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
from typing import Any

__version__ = "0.2.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # launching
    "launch": "nbkit.launching",
    # what a %%ddp cell does, for scripts too
    "run_cell": "nbkit.cellrun",
    # live sets: processes that stay up across cells
    "start": "nbkit.live",
    "connect": "nbkit.live",
    "LiveRanks": "nbkit.live",
    "LiveError": "nbkit.errors",
    # errors: one family (nbkit.errors)
    "NbkitError": "nbkit.errors",
    "LaunchError": "nbkit.errors",
    "DeviceMapError": "nbkit.errors",
    "BringAlongError": "nbkit.errors",
    "CellSyntaxError": "nbkit.errors",
    "ExportError": "nbkit.errors",
    "EmulationError": "nbkit.errors",
    "CheckpointError": "nbkit.errors",
    "StrategyError": "nbkit.errors",
    "RanksError": "nbkit.errors",
    "DatasetError": "nbkit.errors",
    "DatasetArgumentError": "nbkit.errors",
    "ProcessGroupError": "nbkit.errors",
    # where this process stands
    "rank": "nbkit.distributed",
    "local_rank": "nbkit.distributed",
    "world_size": "nbkit.distributed",
    "is_main": "nbkit.distributed",
    "is_distributed": "nbkit.distributed",
    "device": "nbkit.distributed",
    "precision": "nbkit.distributed",
    "visible_gpus": "nbkit.distributed",
    # a smaller GPU's limits on a larger one (nbkit.emulate("T4"))
    "emulate": "nbkit.emulation",
    # settings and patches
    "configure": "nbkit.config",
    "install": "nbkit.integration",
    "uninstall": "nbkit.integration",
    # the guard and the planner
    "resolve_device_map": "nbkit.guard",
    "plan": "nbkit.planner",
    "Plan": "nbkit.planner",
    "BatchSettings": "nbkit.planner",
    # a run's choices, made once in the notebook, and the model steps for them (nbkit.recipe(...).from_pretrained)
    "recipe": "nbkit.recipes",
    "Recipe": "nbkit.recipes",
    # offline models and data
    "resolve_model": "nbkit.offline",
    "vision_dataset": "nbkit.synthetic",
    "text_dataset": "nbkit.synthetic",
    # live reporting
    "report": "nbkit.reporting",
    "peak_memory_gib": "nbkit.reporting",
    # diagnostics
    "doctor": "nbkit.diagnostics",
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

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"nbkit.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nbkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


# Before anything else imports torchao (transformers and peft do, where it is installed): its
# import-time device query would create a CUDA context here and make every launch fail.
importlib.import_module("nbkit.forksafety").install()


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext nbkit`: registers the %%ddp and %nbkit magics."""
    from nbkit.magics import register

    register(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from nbkit.magics import unregister

    unregister(ipython)
