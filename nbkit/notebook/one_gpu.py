"""What nbkit says when one GPU is all there is (Colab, a single-GPU box): what `%ddp start` and `%%ddp` do
there, and why they still help. One place for the text, said once per process.

    one_gpu.say_once("live", "Tesla T4")      # in the start path of a live set, when one GPU is visible
    one_gpu.say_once("one-shot", "Tesla T4")  # in the one-shot path of a %%ddp cell (nbkit.run_cell)
"""

from __future__ import annotations

from typing import Literal

from nbkit.platform import notices

__all__ = ["message", "say_once"]

Kind = Literal["live", "one-shot"]

_said: set[Kind] = set()


def message(kind: Kind, gpu: str) -> str:
    """The notice for one visible GPU: what `kind` of run does there, and why it still helps.

    Args:
        kind: "live" (`%ddp start`, nbkit.start) or "one-shot" (`%%ddp` without a live set, nbkit.run_cell).
        gpu: the GPU's name, as nvidia-smi gives it.

    Returns:
        The text, one paragraph starting "nbkit: ".

    Raises:
        ValueError: for another kind.
    """
    if kind == "live":
        what = (
            f"nbkit: one GPU is visible ({gpu}), so the live set has one rank: one process on cuda:0 that "
            "trains as on one GPU (no DDP). It still helps: that process keeps the model between %%ddp cells, "
            "so a cell that fails or is interrupted leaves it loaded, and this notebook stays free of CUDA, so "
            "`%ddp stop` frees all GPU memory without restarting the kernel."
        )
    elif kind == "one-shot":
        what = (
            f"nbkit: one GPU is visible ({gpu}), so %%ddp runs the cell in one fresh process on cuda:0 (no DDP). "
            "It still helps: the notebook stays free of CUDA, so unsloth and bitsandbytes load in that process "
            "without the notebook's CUDA state, and every byte of GPU memory is given back when the cell ends. "
            "`%ddp start` keeps such a process, and the model in it, across cells."
        )
    else:
        raise ValueError(f"kind must be 'live' or 'one-shot', not {kind!r}.")
    return what + " The same notebook runs unchanged on 2 or more GPUs, with one rank per GPU."


def say_once(kind: Kind, gpu: str) -> bool:
    """Give `message(kind, gpu)` as an INFO notice (the `nbkit.notebook.one_gpu` logger), the first time in this
    process.

    Returns True when it was given now, False when it had been given already. Call it on the notebook's side.
    """
    if kind in _said:
        return False
    text = message(kind, gpu)  # raises for an unknown kind before anything is remembered
    _said.add(kind)
    notices.logger(__name__).info(text)
    return True
