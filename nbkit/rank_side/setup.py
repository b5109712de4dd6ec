"""What every rank nbkit starts applies before the user's code runs (`prepare_rank`), on every path: forked and
spawned ranks, live ranks, and ranks of an outside launcher running an exported script. Runs in a rank.
"""

from __future__ import annotations

from nbkit.platform import compat, config, distributed, patch_groups
from nbkit.rank_side import reporting, teardown
from nbkit.training import attention, checkpoints, emulation, fsdp

__all__ = ["prepare_rank"]


def prepare_rank(*, owns_exit: bool = True) -> None:
    """What every rank nbkit starts applies before the user's code runs ("every rank nbkit starts"
    in GROUPS: forked and spawned ranks of nbkit.launch and one-shot %%ddp, live ranks, and ranks of
    an outside launcher running an exported script): the GPU profile NBKIT_EMULATE names (nbkit.emulate),
    the default groups, the dashboard's reporting, complete-checkpoint markers, the fixes for older
    transformers/trl, fp16-ready dtypes under TRL's SFTTrainer, grouped-query attention without flash
    attention on a GPU that lacks it (nbkit.training.attention.needed), Trainer's DDP and data loader defaults
    chosen for the model and machine, its DDP gradients averaged by one all-reduce per step
    (nbkit.training.gradient_averaging), TRL's metrics averaged over the ranks once per log
    (nbkit.training.trl_metrics), processors without torchvision, the FSDP set-up where the rank's
    environment asks for the fsdp strategy (nbkit.fsdp.setup_rank), and how the rank ends
    (nbkit.rank_side.teardown): where nbkit ends the process itself (`owns_exit`, with os._exit), the teardown
    group keeps destroyed process groups until then; a rank of an outside launcher (torchrun), which ends
    through the interpreter's shutdown, has its groups destroyed at exit instead, before finalization could
    abort it.

    Idempotent; imports none of the patched libraries. Call it only in a training process.

    Raises:
        nbkit.errors.EmulationError: NBKIT_EMULATE names no profile.
    """

    emulation.apply_from_env()  # first: a library imported later must see the profile (bf16, memory)
    extra_groups = (
        "mixed_precision",
        "cell_group",
        "trainer_defaults",
        "gradient_averaging",
        "trl_metrics",
        "offline",
    )
    patch_groups.install(*patch_groups.DEFAULT_GROUPS, *extra_groups)
    if attention.needed(distributed.visible_gpus(), distributed.local_rank()):
        patch_groups.install("attention")
    config.settle_fsdp_flag()  # before any library reads it: one answer to "does this rank shard?"
    if fsdp.requested():
        fsdp.setup_rank()
    reporting.setup_rank()
    checkpoints.enable()
    compat.enable()
    if owns_exit:
        teardown.enable()
    else:
        teardown.destroy_at_exit()
