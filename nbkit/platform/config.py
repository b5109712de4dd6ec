"""nbkit's settings: every NBKIT_* and ACCELERATE_* environment variable nbkit reads is read here.

Each setting lives in an environment variable, so launched processes (forked or freshly started)
see what the notebook configured without anything being passed along. `nbkit.configure(...)`
changes them for this process and every process it launches afterwards; `setting(name)` reads one.
(NBKIT_LAUNCHED is written, not read, by nbkit: nbkit.launch sets it to 1 in every rank it starts,
for the user's code to see.)

Besides the settings, a rank reads what nbkit put into its environment (nbkit.launching.rank_options): the
strategy (`strategy()`, NBKIT_STRATEGY) and the GPU profile (`emulated()`, NBKIT_EMULATE); and
accelerate's ACCELERATE_USE_FSDP, read one way by `flag()` and settled by `settle_fsdp_flag()`, so
that nbkit, transformers and accelerate agree whether a rank shards (`fsdp_rank()`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from nbkit.platform import notices

__all__ = [
    "EMULATE",
    "SETTINGS",
    "STRATEGY",
    "USE_FSDP",
    "Setting",
    "configure",
    "emulated",
    "environment",
    "flag",
    "fsdp_rank",
    "nccl_timeout",
    "setting",
    "settle_fsdp_flag",
    "strategy",
]

# What nbkit puts into the environment of the ranks it starts (nbkit.launching.rank_options), read in the rank.
STRATEGY = "NBKIT_STRATEGY"
EMULATE = "NBKIT_EMULATE"
# accelerate's switch for FSDP (`accelerate launch --use_fsdp`, and nbkit.fsdp in an fsdp rank).
USE_FSDP = "ACCELERATE_USE_FSDP"

# The spellings accelerate's str_to_bool takes for true and false (accelerate.utils.environment).
# Written out rather than imported: importing accelerate pulls in torch, and this module is read at
# `import nbkit` in the notebook.
_TRUE = ("1", "y", "yes", "t", "true", "on")
_FALSE = ("0", "n", "no", "f", "false", "off")


@dataclass(frozen=True)
class Setting:
    """One setting.

    Attributes:
        env: the environment variable that holds it.
        default: its value where the variable is unset or empty.
        choices: the values it may take (compared lower-cased, without surrounding spaces), or None
            for free text.
        number: whether it must be a number (`setting()` still returns the text).
    """

    env: str
    default: str
    choices: tuple[str, ...] | None = None
    number: bool = False


SETTINGS: dict[str, Setting] = {
    # What nbkit.training.guard does with a device map that would split a model inside a DDP rank.
    "device_map_policy": Setting("NBKIT_DEVICE_MAP_POLICY", "data_parallel", ("data_parallel", "error")),
    # "reentrant": unsloth VLMs keep unsloth's single-GPU (reentrant, offloading) checkpointing under
    # DDP, with find_unused_parameters=False; "unsloth": unsloth's own DDP choice (non-reentrant).
    "unsloth_vlm_ddp_checkpointing": Setting(
        "NBKIT_UNSLOTH_VLM_DDP_CHECKPOINTING", "reentrant", ("reentrant", "unsloth")
    ),
    # How DDP ranks average a Trainer's gradients: "flat", one all-reduce after the step's backward where that
    # gives DDP's result (nbkit.training.gradient_averaging says where); "ddp", DDP's own reducer everywhere.
    "ddp_reducer": Setting("NBKIT_DDP_REDUCER", "flat", ("flat", "ddp")),
    # When TRL's SFTTrainer averages its metrics over several ranks: "at_log", once at each step that logs
    # (nbkit.training.trl_metrics); "per_batch", TRL's own gathers after every training forward.
    "trl_metrics": Setting("NBKIT_TRL_METRICS", "at_log", ("at_log", "per_batch")),
    # How a launch's dashboard shows (nbkit.dashboard.display_mode): "auto" picks the HTML panel
    # where a person watches a notebook and text lines elsewhere (papermill, terminals).
    "dashboard": Setting("NBKIT_DASHBOARD", "auto", ("auto", "html", "widget", "text", "off")),
    # Seconds between the text dashboard's lines.
    "dashboard_interval": Setting("NBKIT_DASHBOARD_INTERVAL", "10", number=True),
    # Where nbkit.offline keeps the checkpoints it builds ("" : ~/.cache/nbkit).
    "cache": Setting("NBKIT_CACHE", ""),
    # A live-set engine's node name ("": the host name) and the address other nodes reach it at ("": the
    # host name resolved); set per engine group, e.g. two groups on one machine standing in for two hosts.
    "host": Setting("NBKIT_HOST", ""),
    "host_address": Setting("NBKIT_HOST_ADDRESS", ""),
    # Set by nbkit.live for each engine it starts: the file a native crash's stack is written to.
    "live_log": Setting("NBKIT_LIVE_LOG", ""),
    # Where an fsdp rank keeps a 4-bit model's quantised weights between loading and sharding: "gpu" the whole
    # model on its GPU; "host" only the rows its shard will hold, in CPU memory; "auto" the host where the planner
    # finds that the whole quantised model would not fit one GPU (nbkit.fsdp.load_4bit_on_host).
    "fsdp_4bit_load": Setting("NBKIT_FSDP_4BIT_LOAD", "auto", ("auto", "host", "gpu")),
    # Seconds a collective of GPU ranks may wait for a peer before NCCL's watchdog ends the rank (the
    # process group's timeout where nbkit creates the group: a live set's; torch's own default for NCCL).
    # nbkit names a rank that dies within a second either way; this ends a rank whose peer hangs.
    "nccl_timeout": Setting("NBKIT_NCCL_TIMEOUT", "600", number=True),
}


def setting(name: str) -> str:
    """The current value of one setting: its environment variable where set, else its default.

    Args:
        name: a key of SETTINGS.

    Returns:
        The value as text (lower-cased for settings with choices).

    Raises:
        ValueError: where the environment variable holds a value the setting does not allow.
    """
    spec = SETTINGS[name]
    value = os.environ.get(spec.env, "").strip() or spec.default
    problem = _problem(spec, value)
    if problem:
        raise ValueError(f"{spec.env}={os.environ.get(spec.env)!r} is not valid for nbkit's {name}; {problem}.")
    return value.lower() if spec.choices is not None else value


def nccl_timeout() -> datetime.timedelta:
    """The nccl_timeout setting as the process-group timeout nbkit gives the NCCL groups it creates (a live
    set's, and the default group a one-shot or exported cell joins).
    """
    return datetime.timedelta(seconds=float(setting("nccl_timeout")))


def flag(name: str) -> bool | None:
    """A boolean environment variable read as accelerate reads its flags: True for 1/y/yes/t/true/on,
    False for 0/n/no/f/false/off (any case, surrounding spaces ignored), None where it is unset or empty.

    Raises:
        ValueError: for any other value, naming the variable and the spellings it takes.
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(
        f"{name}={os.environ[name]!r} is neither true nor false; use one of {', '.join(_TRUE)} or {', '.join(_FALSE)}."
    )


def strategy() -> str | None:
    """The strategy nbkit started this rank with (NBKIT_STRATEGY: "ddp" or "fsdp", lower-cased), or None
    where it is unset (not a rank of nbkit's, or one of an outside launcher that named none).
    """
    return os.environ.get(STRATEGY, "").strip().lower() or None


def emulated() -> str | None:
    """The GPU profile named for this process (NBKIT_EMULATE, as written), or None where it is unset or empty."""
    return os.environ.get(EMULATE, "").strip() or None


def fsdp_rank() -> bool:
    """Whether this process shards under FSDP, the one reading nbkit uses everywhere: where nbkit set a
    strategy (NBKIT_STRATEGY), that strategy decides; elsewhere ACCELERATE_USE_FSDP (`flag`) does.
    """
    chosen = strategy()
    if chosen is not None:
        return chosen == "fsdp"
    return bool(flag(USE_FSDP))


def settle_fsdp_flag() -> None:
    """Write ACCELERATE_USE_FSDP, where it is set, as "true" or "false" by `fsdp_rank()`, with a notice
    where that changes what it says.

    accelerate's Accelerator takes only "true" for FSDP while transformers (and `flag`) take 1, yes or
    on as well: settled before either reads it, every reader in the rank comes to `fsdp_rank()`'s answer.
    Called in every rank nbkit starts (nbkit.rank_side.setup.prepare_rank).
    """
    written = os.environ.get(USE_FSDP, "").strip()
    if not written:
        return
    settled = fsdp_rank()
    try:
        said = flag(USE_FSDP)
    except ValueError:
        said = None
    if said != settled:
        notices.logger(__name__).warning(
            f"nbkit: {USE_FSDP}={written} in this rank's environment, and the rank's strategy is {strategy()!r}: "
            f"nbkit set {USE_FSDP}={'true' if settled else 'false'}, as the strategy decides whether ranks shard: "
            f"pass strategy='fsdp' (%%ddp --strategy fsdp) to shard, and leave {USE_FSDP} unset."
        )
    os.environ[USE_FSDP] = "true" if settled else "false"


def configure(**settings: str) -> dict[str, str]:
    """Change nbkit settings for this process and every process it launches afterwards.

    Args:
        **settings: values named after the settings: device_map_policy ("data_parallel" or
            "error"; see nbkit.training.guard), unsloth_vlm_ddp_checkpointing ("reentrant" or "unsloth"; see
            docs/unsloth_patches.md, fix 4), ddp_reducer ("flat" or "ddp"; see
            nbkit.training.gradient_averaging), trl_metrics ("at_log" or "per_batch"; see
            nbkit.training.trl_metrics), dashboard ("auto", "html", "widget", "text" or "off"),
            dashboard_interval (seconds between text lines), cache (a folder for nbkit's offline
            models), nccl_timeout (seconds a GPU rank's collective waits for a peer).

    Returns:
        All settings as they now stand.

    Raises:
        ValueError: for an unknown setting or value; nothing is changed then.
    """
    for name, value in settings.items():
        if name not in SETTINGS:
            raise ValueError(f"nbkit has no setting {name!r}; known settings: {', '.join(SETTINGS)}.")
        problem = _problem(SETTINGS[name], str(value).strip())
        if problem:
            raise ValueError(f"{name}={value!r} is not valid; {problem}.")
    for name, value in settings.items():
        os.environ[SETTINGS[name].env] = str(value)
    return {name: setting(name) for name in SETTINGS}


def _problem(spec: Setting, value: str) -> str | None:
    """What is wrong with `value` for `spec`, or None."""
    if spec.choices is not None and value.lower() not in spec.choices:
        return f"use one of {', '.join(map(repr, spec.choices))}"
    if spec.number:
        try:
            float(value)
        except ValueError:
            return "use a number"
    return None


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of a `with` block, then put back exactly what was there before.

    Args:
        values: variable -> value; variables that were unset are unset again afterwards.

    Yields:
        None, with the variables set.
    """
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
