"""Keeping the notebook process free of a CUDA context until it launches, and saying why not.

nbkit.launch forks the training processes, and a process that has created a CUDA context cannot
fork working children. Some libraries create one merely by being imported. The ones nbkit can
make harmless are patched here, as soon as `import nbkit` runs; the ones it cannot (bitsandbytes
initialises CUDA on import, and peft and unsloth import it) are named by `fork_blocker()`, whose
answer nbkit.launch raises, `%%ddp` reads to start fresh processes instead of forking, and
`nbkit.doctor()` reports.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from nbkit.platform import distributed, patching

__all__ = ["ForkBlocker", "fork_blocker", "install"]

# Whether torchao was imported before `import nbkit` installed the context-free queries: only then
# can its import-time device query be what created a CUDA context (None until install() runs).
_imported_before_nbkit: frozenset[str] | None = None


@dataclass(frozen=True)
class ForkBlocker:
    """Why this process cannot fork working training processes now.

    Attributes:
        code: "cuda-initialized" (a CUDA context exists here) or "accelerate-state" (an accelerate
            Accelerator/PartialState exists here).
        summary: one sentence naming what happened (what %%ddp prints as its reason for spawn mode).
        message: the full explanation with what to do (what nbkit.launch raises).
    """

    code: str
    summary: str
    message: str

    def __str__(self) -> str:
        return self.summary


def fork_blocker() -> ForkBlocker | None:
    """Why ranks cannot be forked from this process now, or None when they can.

    Never initialises CUDA (torch.cuda.is_initialized() only reads a flag).
    """
    import torch

    if torch.cuda.is_initialized():
        summary = "CUDA is already initialised in this notebook process."
        return ForkBlocker(
            "cuda-initialized",
            summary,
            "CUDA is already initialised in this notebook process, so the training processes cannot be "
            f"forked from it (CUDA does not survive fork). Likely cause: {_likely_cuda_cause()}. "
            "Restart the kernel and keep everything that touches the GPU inside the launched function "
            "(import unsloth/bitsandbytes there, load the model there). The %%ddp magic can instead "
            "start fresh processes when this happens.",
        )
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None and (
        accelerate_state.PartialState._shared_state or accelerate_state.AcceleratorState._shared_state
    ):
        return ForkBlocker(
            "accelerate-state",
            "An accelerate Accelerator (or PartialState) already exists in this notebook process.",
            "An accelerate Accelerator (or PartialState) already exists in this notebook process, often "
            "because a Trainer, TrainingArguments.device or Accelerator() ran in an earlier cell. Each "
            "launched process must create its own. Restart the kernel and create Trainer/TrainingArguments/"
            "Accelerator only inside the launched function.",
        )
    return None


def _likely_cuda_cause() -> str:
    for module, why in (
        ("unsloth", "unsloth was imported in this notebook process (importing it initialises CUDA)"),
        (
            "bitsandbytes",
            "bitsandbytes was imported in this notebook process (unless nbkit was imported first, "
            "its import initialises CUDA; peft and unsloth import it wherever it is installed, as "
            "on Kaggle)",
        ),
        (
            "torchao",
            "torchao was imported before nbkit (transformers, peft and trl import it wherever it is "
            "installed, as unsloth installs it, and its import queries the GPU); `import nbkit` in the "
            "first cell, before them, makes that harmless",
        ),
    ):
        if module in sys.modules and (module != "torchao" or module in (_imported_before_nbkit or ())):
            return why
    return (
        "a tensor or model was put on a GPU, or a CUDA query such as torch.cuda.get_device_name() "
        "ran, in an earlier cell"
    )


@patching.patch(
    "torch.utils._triton:has_triton",
    reason="has_triton() asks the current CUDA device for its compute capability, which creates a CUDA "
    "context; torchao calls it at import time, and transformers and peft import torchao wherever it is "
    "installed (unsloth installs it). Measured on 2x H200: resolving a model path then initialised "
    "CUDA in the notebook process. nvidia-smi gives the same answer without a context.",
    upstream="none filed yet: torchao/prototype/mx_formats/kernels.py calls has_triton() at import "
    "(torchao 0.18.0); torch/utils/_triton.py asks the device for its properties",
    group="forksafety",
)
def _context_free_has_triton(original: Callable[[], bool]) -> Callable[[], bool]:
    def has_triton() -> bool:
        import torch

        if torch.cuda.is_initialized() or not torch.cuda.is_available():
            return original()
        gpus = distributed.visible_gpus()
        if not gpus or any(gpu.capability == (0, 0) for gpu in gpus):
            return original()  # capabilities unknown without a context: ask the usual way
        from torch._inductor.config import triton_disable_device_detection
        from torch.utils._triton import has_triton_package

        if triton_disable_device_detection or not has_triton_package():
            return False
        return any(gpu.capability[0] >= 7 for gpu in gpus)  # triton's own bar for CUDA devices

    return has_triton


@patching.patch(
    "torch.cuda:get_device_capability",
    reason="asking for a GPU's compute capability creates a CUDA context; torchao's is_sm_at_least_*() "
    "helpers do it at import time (torchao/prototype/mx_formats/kernels.py), and transformers and "
    "peft import torchao wherever it is installed. Measured on 2x H200. nvidia-smi answers the same "
    "question without a context.",
    upstream="none filed yet: torchao 0.18.0 queries the device while its modules import",
    group="forksafety",
)
def _context_free_capability(original: Callable[..., tuple[int, int]]) -> Callable[..., tuple[int, int]]:
    def get_device_capability(device: object = None) -> tuple[int, int]:
        import torch

        if torch.cuda.is_initialized() or not torch.cuda.is_available():
            return original(device)
        gpus = distributed.visible_gpus()
        index = _index(device)
        if index is None or index >= len(gpus) or gpus[index].capability == (0, 0):
            return original(device)
        return gpus[index].capability

    return get_device_capability


def _index(device: object) -> int | None:
    """The visible-device index a torch device argument names (None: current device, which is 0
    before CUDA is initialised); None when it cannot be told without CUDA.
    """
    import torch

    if device is None:
        return 0
    if isinstance(device, torch.cuda.device):  # the context manager bitsandbytes passes
        device = device.idx
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device) and device.type == "cuda":
        return 0 if device.index is None else device.index
    return None


def install() -> None:
    """Make this process's CUDA queries context-free until it initialises CUDA itself.

    Called by `import nbkit`; imports nothing heavy itself. torch.cuda.is_available() and
    device_count() ask the CUDA runtime by default, which initialises the driver and "poisons"
    fork: every forked rank then fails with "Cannot re-initialize CUDA in forked subprocess"
    (measured on 2x H200). torch's own switch makes them ask NVML instead. The patches below then
    apply now, or right after their modules are first imported.
    """
    import os

    global _imported_before_nbkit
    if _imported_before_nbkit is None:  # the first install(), at `import nbkit`
        _imported_before_nbkit = frozenset(name for name in ("torchao",) if name in sys.modules)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

    patching.apply("forksafety")
