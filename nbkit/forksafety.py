"""Keeping the notebook process free of a CUDA context until it launches.

nbkit.launch forks the training processes, and a process that has created a CUDA context cannot
fork working children. Some libraries create one merely by being imported. The ones nbkit can
make harmless are patched here, as soon as `import nbkit` runs; the ones it cannot (bitsandbytes
initialises CUDA on import, and peft and unsloth import it) are named in the error that
nbkit.launch raises, and `%%ddp` then starts fresh processes instead of forking.
"""

from __future__ import annotations

from collections.abc import Callable

from nbkit import distributed, patching

__all__ = ["install"]


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

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

    patching.apply("forksafety")
