"""nbkit.install() / nbkit.uninstall(): the table of patch groups, and switching them on and off (also
importable as nbkit.integration).

Every change nbkit makes to another library belongs to one group of GROUPS below, declared (with
nbkit.patching's `@patch`) in the module the table names, next to the code it serves. This table is
the one place that lists them and says when each is applied; `install()` and `uninstall()` switch
any of them on and off by name, and nbkit.patching keeps the state (applied, or pending until the
patched library is imported).

A patch is applied when its library is imported, never by importing it here: `import unsloth`
takes ~25 s and initialises CUDA, so installing in every launched rank must not import it for a
user who trains with plain transformers, and must still catch the user who imports it later,
inside the launched function.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from nbkit.platform import patching

__all__ = ["DEFAULT_GROUPS", "GROUPS", "Group", "describe", "install", "uninstall"]


@dataclass(frozen=True)
class Group:
    """One group of patches.

    Attributes:
        name: the group's name, as the patches declare it and install()/uninstall() take it.
        module: the nbkit module that declares the group's patches.
        applied: when nbkit applies the group by itself.
    """

    name: str
    module: str
    applied: str


GROUPS: dict[str, Group] = {
    g.name: g
    for g in (
        Group(
            "forksafety",
            "nbkit.platform.forksafety",
            "by `import nbkit`, in every process, so that the notebook never creates a CUDA context before launching",
        ),
        Group(
            "guard",
            "nbkit.training.guard",
            "by `nbkit.install()`, which every rank nbkit starts runs: device maps that would split a model "
            "inside a DDP rank",
        ),
        Group(
            "unsloth_savers",
            "nbkit.training.savers.unsloth",
            "by `nbkit.install()`, which every rank nbkit starts runs; each fix only where the installed "
            "unsloth lacks it ([unsloth_patches.md](unsloth_patches.md))",
        ),
        Group(
            "reporting",
            "nbkit.rank_side.reporting",
            "in every rank nbkit starts (the dashboard callback); its patches act only there",
        ),
        Group(
            "checkpoints",
            "nbkit.training.checkpoints",
            "in every rank nbkit starts, and by `nbkit.checkpoints.enable()` elsewhere "
            "(complete-checkpoint markers; `nbkit.checkpoints.disable()` reverts it)",
        ),
        Group(
            "teardown",
            "nbkit.rank_side.teardown",
            "in every rank nbkit starts: process groups that destroy_process_group "
            "removes stay referenced until the rank ends, so a DDP model freed after them cannot hang the rank",
        ),
        Group(
            "cell_group",
            "nbkit.rank_side.cell_group",
            "in every rank nbkit starts: a cell's own dist.init_process_group() keeps the default group nbkit "
            "set up for the cell (a live set's, or the one joined before a one-shot or exported cell)",
        ),
        Group(
            "launch",
            "nbkit.launching.fork",
            "only while nbkit.launch starts its ranks through accelerate's notebook_launcher",
        ),
        Group(
            "kernels",
            "nbkit.training.savers.liger",
            "while a model given `nbkit.savers.apply(model, kernels='liger')` exists: Liger's fused RoPE, "
            "inside that model's attention only",
        ),
        Group(
            "compat",
            "nbkit.platform.compat",
            "in every rank nbkit starts, on transformers/trl/peft releases older than 5 / 1 / 0.21: "
            "their defaults and bugs that break DDP, nbkit's chunked loss, QLoRA of a peft model or LoRA "
            "beside a newer torchao; on transformers 5.23 and newer: the checkpointing names it renamed, which "
            "peft and trl still use, without a deprecation notice",
        ),
        Group(
            "live",
            "nbkit.rank_side.live_stopping",
            "in every rank of a live set (nbkit.start): an interrupt stops Trainer.train() at a step every rank "
            "agrees on",
        ),
        Group(
            "mixed_precision",
            "nbkit.training.mixed_precision",
            "in every rank nbkit starts: TRL's SFTTrainer leaves a quantised model's trainable weights in bf16 "
            "even under fp16, which the fp16 GradScaler cannot unscale",
        ),
        Group(
            "trainer_defaults",
            "nbkit.training.trainer_defaults",
            "in every rank nbkit starts, and by `nbkit.install('trainer_defaults')` in a process that trains "
            "itself (the model_parallel notebook): Trainer's find_unused_parameters for a peft model as for the "
            "model it wraps (and TRL's for a vision-language model whose vision weights do not train), no pinned "
            "memory without an accelerator, where the user left them at their defaults, one GPU counted for a "
            "quantised model Trainer does not replicate, and nbkit.precision()'s precision for an SFTConfig whose "
            "user set none (TRL's default is bf16 everywhere, a T4 included)",
        ),
        Group(
            "gradient_averaging",
            "nbkit.training.gradient_averaging",
            "in every rank nbkit starts: a LoRA model a Trainer wraps in DDP has its gradients averaged by one "
            "all-reduce per step in place of DDP's reducer, where that gives DDP's result; "
            '`nbkit.configure(ddp_reducer="ddp")` keeps DDP\'s reducer',
        ),
        Group(
            "trl_metrics",
            "nbkit.training.trl_metrics",
            "in every rank nbkit starts: on several ranks TRL's SFTTrainer keeps each rank's entropy, token accuracy "
            "and token count until the step that logs, where one all-reduce averages them, in place of its gathers "
            'after every training forward; `nbkit.configure(trl_metrics="per_batch")` keeps TRL\'s gathers',
        ),
        Group(
            "attention",
            "nbkit.training.attention",
            "in every rank nbkit starts on a GPU without flash attention (a T4), and under a profile that turns "
            "flash attention off: grouped-query attention uses the memory-efficient kernel instead of seq x seq "
            "math attention",
        ),
        Group(
            "emulate",
            "nbkit.training.emulation",
            "by `nbkit.emulate(profile)`, and in every rank nbkit starts while NBKIT_EMULATE names a profile "
            "without bf16 (a T4)",
        ),
        Group(
            "fsdp",
            "nbkit.training.fsdp",
            "in ranks of the fsdp strategy (NBKIT_STRATEGY=fsdp): peft's adapter keys under FSDP2's activation "
            "checkpointing, generation on a sharded model refused on some ranks only, save_pretrained of a sharded "
            "model refused before it writes, a sharded model trained again as it is, no zero-filled copy of the "
            "model in the RAM of ranks that do not read the checkpoint, and accelerate's FSDP state on ranks "
            "without CUDA",
        ),
        Group(
            "offline",
            "nbkit.training.offline",
            "in every rank nbkit starts, and when nbkit.offline builds a Qwen3-VL processor, on a machine "
            "without torchvision: AutoProcessor and nbkit.offline.load_processor build an image-and-text processor",
        ),
    )
}

# What `install()` applies when no group is named: the groups every launched rank gets from it.
DEFAULT_GROUPS = ("guard", "unsloth_savers")


def install(*groups: str) -> list[str]:
    """Apply nbkit's patches of the named groups (default: the model-loading guard and unsloth's savers fixes).

    Idempotent: a second call changes nothing. Safe on every rank and in the notebook process; it
    imports none of the patched libraries: patches of libraries not imported yet (unsloth,
    typically) wait and are applied right after their import (`nbkit.patching.pending()`). A group
    whose declaring module is not part of this installation is skipped. nbkit.launch calls
    `install()` in every rank it starts.

    Args:
        *groups: names from GROUPS; none means DEFAULT_GROUPS.

    Returns:
        The targets ("module:Class.attr") of the named groups that are patched now.

    Raises:
        ValueError: for a name that is not a group; nothing is applied then.
    """
    names = _checked(groups or DEFAULT_GROUPS)
    return [target for name in names if _declare(GROUPS[name]) for target in patching.apply(name)]


def uninstall(group: str | None = None) -> None:
    """Revert one group of nbkit's patches, or all of them, restoring the original attributes exactly.

    Also drops patches still waiting for their library's import. A no-op for what is not applied.

    Args:
        group: a name from GROUPS, or None for every group (including those applied by
            `import nbkit`, nbkit.launch and nbkit.checkpoints.enable()).

    Raises:
        ValueError: for a name that is not a group.
    """
    if group is not None:
        _checked((group,))
    patching.revert(group)


def describe() -> str:
    """The markdown table of the groups: name, declaring module, and when nbkit applies it.

    Returns:
        The table that docs/patches.md shows above nbkit.patching.describe()'s list of patches.
    """
    rows = ["| group | declared in | applied |", "| --- | --- | --- |"]
    rows += [f"| `{g.name}` | `{g.module}` | {g.applied} |" for g in GROUPS.values()]
    return "\n".join(rows) + "\n"


def _checked(names: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [name for name in names if name not in GROUPS]
    if unknown:
        raise ValueError(
            f"nbkit has no patch group {', '.join(map(repr, unknown))}; the groups are {', '.join(GROUPS)}."
        )
    return names


def _declare(group: Group) -> bool:
    """Import the module that declares `group`'s patches; False where it is not installed."""
    try:
        importlib.import_module(group.module)
    except ModuleNotFoundError as error:
        if error.name != group.module:
            raise  # the module exists but something it needs does not: a real error
        return False
    return True
