"""The model-loading guard: device maps that are safe in a data-parallel (DDP) run.

Inside DDP every rank trains its own full copy of the model. A device map that splits the model
over all GPUs ("auto", "balanced", ...) is then wrong in every rank at once: all ranks spread over
the same cards and training dies with tensors on different devices, and 4/8-bit weights refuse to
train "on a different device than the one you're training on". `resolve_device_map` turns such a
request into "this rank's own device" (or raises, under the "error" policy), and the patches at
the bottom apply it to the loaders users call (transformers and unsloth `from_pretrained`).
`nbkit.install()` activates the patches; outside a distributed run they change nothing.

Under the fsdp strategy (nbkit.fsdp) a rank holds a shard, not a copy: the loaders then get the
device map FSDP needs (CPU for 16-bit weights, which accelerate shards onto the GPUs; the rank's own
GPU for 4-bit ones), and unsloth, which has no FSDP, is refused.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nbkit.platform import distributed, notices
from nbkit.platform.config import fsdp_rank, setting
from nbkit.platform.errors import DeviceMapError
from nbkit.platform.patching import patch
from nbkit.training import fsdp

if TYPE_CHECKING:
    from nbkit.notebook import planner

__all__ = ["AUTOMATIC_DEVICE_MAPS", "FIT_CHECK_SEQ_LEN", "DeviceMapError", "fit_error", "resolve_device_map"]

# Names that let the loader place the model itself. transformers routes the first four through
# accelerate's infer_auto_device_map; unsloth 2026.10.9 adds its head-aware planner under "unsloth"
# and "unsloth_balanced" (unsloth/models/loader_utils.py, AUTOMATIC_DEVICE_MAPS).
AUTOMATIC_DEVICE_MAPS = frozenset({"auto", "balanced", "balanced_low_0", "sequential", "unsloth", "unsloth_balanced"})

SEED_DDP_DEVICE_MAP = "https://github.com/unslothai/unsloth/pull/3809"

_notice_printed = False


def resolve_device_map(device_map: Any, *, quantized: bool = False) -> Any:
    """The device map to load a model with, given where this process runs.

    Outside a distributed run: `device_map` unchanged (model parallelism in one process and
    inference keep working).

    Inside one (nbkit.launch, torchrun, accelerate launch), on every rank:

    - None, or a bare accelerator type such as "cuda": {"": <this rank's device>}.
    - an automatic strategy (AUTOMATIC_DEVICE_MAPS): {"": <this rank's device>} under the
      "data_parallel" policy, and rank 0 prints a notice once per process; under the "error" policy
      DeviceMapError explaining the two strategies. A quantized load is always placed on the
      rank's own device, whatever the policy.
    - an explicit device or dict: returned unchanged, unless it puts modules on an accelerator
      another rank owns.

    "This rank's device" is "cuda:<LOCAL_RANK>" where CUDA is available and "cpu" in a CPU launch.

    Args:
        device_map: what the user passed (None, a strategy name, a device as str/int/torch.device,
            or a dict module -> device).
        quantized: whether the load is 4/8-bit quantized.

    Returns:
        The device map to pass on to the loader.

    Raises:
        DeviceMapError: under the "error" policy for an automatic map, or for a map that uses
            another rank's accelerator (naming the modules and devices).
        ValueError: if NBKIT_DEVICE_MAP_POLICY holds an unknown value.
    """
    if not distributed.is_distributed():
        return device_map
    own = distributed.device()
    if device_map is None or _is_bare_accelerator(device_map, own):
        return {"": own}
    if isinstance(device_map, str) and device_map in AUTOMATIC_DEVICE_MAPS:
        if not quantized and setting("device_map_policy") == "error":
            raise DeviceMapError(_strategy_error(device_map))
        _notice(device_map, own, quantized)
        return {"": own}
    foreign = _modules_on_other_ranks(device_map)
    if foreign:
        raise DeviceMapError(_foreign_error(foreign, own))
    return device_map


def _is_bare_accelerator(device_map: Any, own: str) -> bool:
    # "cuda" names the device type but not the index: filling in this rank's index honours it,
    # while torch would read it as the current device (cuda:0 on every rank).
    return isinstance(device_map, str) and ":" not in device_map and own.startswith(device_map + ":")


def _accelerator_index(device: Any) -> int | None:
    """Index of an accelerator named by a device-map value, None for cpu/disk/meta/bare types."""
    if isinstance(device, bool):
        return None
    if isinstance(device, int):
        return device  # transformers reads a bare int as that accelerator's index
    if isinstance(device, torch.device):
        return None if device.type in ("cpu", "meta") else device.index
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind not in ("cpu", "disk", "meta") and index.isdigit():
            return int(index)
    return None


def _modules_on_other_ranks(device_map: Any) -> dict[str, str]:
    placements = device_map if isinstance(device_map, dict) else {"": device_map}
    mine = distributed.local_rank()
    return {
        module: str(device if not isinstance(device, int) else f"cuda:{device}")
        for module, device in placements.items()
        if _accelerator_index(device) not in (None, mine)
    }


def _notice(asked: str, own: str, quantized: bool) -> None:
    global _notice_printed
    if _notice_printed or distributed.rank() != 0:
        return
    _notice_printed = True
    why = (
        "4/8-bit weights cannot move once loaded, so each rank loads them on its own device"
        if quantized
        else f"splitting the model inside every one of the {distributed.world_size()} DDP ranks would "
        "put all ranks on the same GPUs"
    )
    notices.logger(__name__).info(
        f"nbkit: device_map={asked!r} was asked for, but this is a data-parallel run: {why}. "
        f"Loading with device_map={{'': '{own}'}} on rank 0 (each rank on its own device) instead, "
        "so every GPU now holds a full copy of the model. To split one model over several GPUs, load "
        "it in the notebook without nbkit.launch; to get an error instead of this switch, "
        "nbkit.configure(device_map_policy='error')."
    )


def _strategy_error(asked: str) -> str:
    return (
        f"device_map={asked!r} splits one model over all visible GPUs, but this process is rank "
        f"{distributed.rank()} of {distributed.world_size()} in a data-parallel (DDP) run: every rank "
        "would split its own copy over the same GPUs, and training fails with tensors on different "
        "devices (4/8-bit models refuse to train at all).\n"
        "Pick one of two strategies:\n"
        "  * data parallel (DDP, what nbkit.launch runs): one full copy of the model per GPU, each GPU "
        "trains on its share of the batches. Load with device_map=None (nbkit places each rank on "
        "its own GPU), or let nbkit switch automatic maps for you: "
        "nbkit.configure(device_map_policy='data_parallel') or NBKIT_DEVICE_MAP_POLICY=data_parallel.\n"
        "  * model parallel: one process, the model split over the GPUs (for a model that does not fit "
        "on one GPU). Load with device_map='balanced' in the notebook itself, outside nbkit.launch.\n"
        "nbkit.plan(model, gpus=N) estimates which one fits. This error is raised because "
        "device_map_policy is 'error' (nbkit.configure or NBKIT_DEVICE_MAP_POLICY)."
    )


def _foreign_error(foreign: dict[str, str], own: str) -> str:
    shown = ", ".join(f"{module or '<whole model>'!r} -> {device}" for module, device in list(foreign.items())[:6])
    more = f" and {len(foreign) - 6} more" if len(foreign) > 6 else ""
    return (
        f"The device_map puts modules of rank {distributed.rank()} (local rank {distributed.local_rank()}) "
        f"on devices other ranks own: {shown}{more}. In a data-parallel run each rank trains a full "
        f"copy on its own device, {own}. Load with device_map=None or {{'': nbkit.device()}}; to split "
        "one model over several GPUs, load it in one process outside nbkit.launch."
    )


# ---------------------------------------------------------------------------------------------
# The loaders. Each patched from_pretrained resolves the device map first when, and only when, it
# runs inside a distributed run; everything else reaches the original untouched.

# Sequence length for the "does it fit on one GPU" check when the loader does not say (transformers
# loaders know nothing of it): short, so the check only fires when even modest training cannot fit.
FIT_CHECK_SEQ_LEN = 512

_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "trust_remote_code")


@dataclass(frozen=True)
class _Loader:
    """How to read one family of loaders' arguments."""

    model_arg: str  # the parameter naming the checkpoint
    quantized: Callable[[dict[str, Any]], bool]
    apply_defaults: bool  # whether the signature's defaults are part of the request (unsloth: 4-bit by default)


def _transformers_quantized(args: dict[str, Any]) -> bool:
    return bool(args.get("load_in_4bit") or args.get("load_in_8bit") or args.get("quantization_config") is not None)


def _unsloth_quantized(args: dict[str, Any]) -> bool:
    # unsloth defaults to load_in_4bit=True; 16-bit, full fine-tuning and fp8 override that default.
    if args.get("quantization_config") is not None or args.get("load_in_8bit"):
        return True
    overridden = args.get("load_in_16bit") or args.get("full_finetuning") or args.get("load_in_fp8")
    return bool(args.get("load_in_4bit")) and not overridden


_TRANSFORMERS = _Loader("pretrained_model_name_or_path", _transformers_quantized, apply_defaults=False)
_UNSLOTH = _Loader("model_name", _unsloth_quantized, apply_defaults=True)


def _placement_managed_elsewhere(args: dict[str, Any]) -> bool:
    """DeepSpeed ZeRO-3, FSDP and tensor parallelism place (and shard) the weights themselves."""
    if any(args.get(name) is not None for name in ("tp_plan", "tp_size", "distributed_config", "device_mesh")):
        return True
    if fsdp_rank():
        return True
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return is_deepspeed_zero3_enabled()


def _guarded(loader: _Loader) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Patch factory: wraps a from_pretrained so that its device map goes through the guard."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)
        params = signature.parameters
        var_keyword = next((p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)

        def arguments(bound: inspect.BoundArguments) -> dict[str, Any]:
            values = dict(bound.arguments)
            if var_keyword is not None:
                values.update(values.pop(var_keyword, None) or {})
            return values

        @functools.wraps(original)
        def from_pretrained(*args: Any, **kwargs: Any) -> Any:
            # An fsdp rank is handled even alone (world size 1: a dry run of the strategy on one GPU).
            in_run = distributed.is_distributed() or fsdp.requested()
            if not in_run or ("device_map" not in params and var_keyword is None):
                return original(*args, **kwargs)
            try:
                bound = signature.bind_partial(*args, **kwargs)
            except TypeError:
                return original(*args, **kwargs)  # the original reports the bad call in its own words
            passed = arguments(bound)
            if fsdp.requested():
                return _fsdp_load(loader, original, bound, params, var_keyword, passed)
            if _placement_managed_elsewhere(passed):
                return original(*args, **kwargs)
            # What the load will do includes the loader's defaults (unsloth loads 4-bit unless told
            # otherwise); only what was passed goes on to it, since unsloth tells the two apart.
            effective = passed
            if loader.apply_defaults:
                with_defaults = signature.bind_partial(*args, **kwargs)
                with_defaults.apply_defaults()
                effective = arguments(with_defaults)
            asked = passed.get("device_map")  # not passed: nothing asked (unsloth's default is "unchosen")
            quantized = loader.quantized(effective)
            resolved = resolve_device_map(asked, quantized=quantized)
            if resolved is not asked and torch.cuda.is_available():
                # The guard chose data parallelism: make sure one GPU can hold the model.
                _check_fits_one_gpu(effective, loader, quantized)
            if "device_map" in params:
                bound.arguments["device_map"] = resolved
            elif var_keyword is not None:
                bound.arguments.setdefault(var_keyword, {})["device_map"] = resolved
            return original(*bound.args, **bound.kwargs)

        return from_pretrained

    return factory


def _fsdp_load(
    loader: _Loader,
    original: Callable[..., Any],
    bound: inspect.BoundArguments,
    params: Any,
    var_keyword: str | None,
    passed: dict[str, Any],
) -> Any:
    """A load in an fsdp rank: unsloth refused (StrategyError), otherwise the device map FSDP needs
    (nbkit.fsdp.device_map) in place of whatever was asked, so no rank loads a full 16-bit copy onto
    its GPU and no rank splits the model over the others' GPUs; and, from the model's plan over all the
    ranks, a 4-bit load on the host (nbkit.fsdp.load_4bit_on_host) and FSDP's CPU offload
    (nbkit.fsdp.offload_shards) where the GPUs need them, refused where the machine's CPU memory cannot hold
    what those keep there (nbkit.fsdp.check_host_memory).
    """
    if loader is _UNSLOTH:
        raise fsdp.unsloth_error()
    quantized = loader.quantized(passed)
    resolved = fsdp.device_map(quantized)
    if "device_map" in params:
        bound.arguments["device_map"] = resolved
    elif var_keyword is not None:
        bound.arguments.setdefault(var_keyword, {})["device_map"] = resolved
    planned = _fsdp_plan(passed, loader, quantized)
    if planned is not None:
        fsdp.check_host_memory(planned)
        fsdp.offload_shards(planned)
    chosen = setting("fsdp_4bit_load")
    on_host = chosen == "host" or (chosen == "auto" and planned is not None and planned.fsdp_host_load)

    def load() -> Any:
        return original(*bound.args, **bound.kwargs)

    model = fsdp.load_4bit_on_host(load) if quantized and on_host else load()
    fsdp.without_training_cache(model)
    return model


def _fsdp_plan(values: dict[str, Any], loader: _Loader, quantized: bool) -> planner.Plan | None:
    """The planner's view of an fsdp rank's load over all the ranks (at the fit check's sequence length: the
    shortest a user trains), or None with one rank or where the config or the GPUs cannot be read.
    """
    loaded = _model_config(values, loader) if distributed.world_size() > 1 else None
    if loaded is None:
        return None
    from nbkit.notebook import planner

    try:
        return planner.plan(loaded[1], gpus=distributed.world_size(), seq_len=FIT_CHECK_SEQ_LEN, load_in_4bit=quantized)
    except Exception:
        return None


def _model_config(values: dict[str, Any], loader: _Loader) -> tuple[Any, Any] | None:
    """(what is loaded, its config) for a load's arguments (the `config` passed where it is an object), or None where
    no config can be read.
    """
    config_arg = values.get("config")
    given_config = config_arg is not None and not isinstance(config_arg, (str, os.PathLike))
    source = config_arg if given_config else values.get(loader.model_arg)
    if source is None:
        return None
    from nbkit.training.offline import load_config

    hub = {k: values[k] for k in _HUB_KWARGS if values.get(k) is not None}
    try:
        return source, load_config(source, **hub)
    except Exception:
        return None


def _check_fits_one_gpu(values: dict[str, Any], loader: _Loader, quantized: bool) -> None:
    """Raise DeviceMapError before any weight loads if one GPU cannot hold this model for training."""
    loaded = _model_config(values, loader)
    if loaded is None:
        return
    source, model_config = loaded
    from nbkit.notebook import planner

    seq_len = int(values.get("max_seq_length") or FIT_CHECK_SEQ_LEN)
    try:
        # 8-bit is estimated as 4-bit: a lower bound, so the check never refuses a load that could fit.
        estimate = planner.plan(model_config, gpus=1, seq_len=seq_len, load_in_4bit=quantized)
    except Exception:
        return
    message = fit_error(estimate, source)
    if message is not None:
        raise DeviceMapError(message)


def fit_error(estimate: planner.Plan, source: Any) -> str | None:
    """The message for a DDP load that cannot fit on one GPU.

    Args:
        estimate: a single-GPU plan (gpus=1) of the model being loaded.
        source: what was being loaded (a name, a path or a config), for the message.

    Returns:
        The message, or None when the model fits.
    """
    if estimate.strategy == "ddp":
        return None
    name = source if isinstance(source, (str, os.PathLike)) else type(source).__name__
    lines = [
        f"{name} does not fit on one GPU for data-parallel training: about {estimate.per_gpu_gib:.1f} GiB "
        f"per GPU at {estimate.seq_len} tokens (weights {estimate.breakdown['weights']:.1f}, LoRA "
        f"{estimate.breakdown['lora']:.1f}, activations {estimate.breakdown['activations']:.1f}, "
        f"logits/loss {estimate.breakdown['logits']:.1f}, CUDA overhead {estimate.breakdown['overhead']:.1f}), "
        f"but a GPU has {estimate.gpu_memory_gib:.1f} GiB ({estimate.usable_gib:.1f} usable). "
        "Nothing was loaded. Alternatives:",
    ]
    if not estimate.load_in_4bit:
        lines.append("  * load in 4-bit (load_in_4bit=True / a BitsAndBytesConfig)")
    lines.append(
        "  * FSDP: the model sharded over the GPUs, every GPU training (ranks started with the fsdp strategy, "
        "NBKIT_STRATEGY=fsdp; transformers + peft)"
    )
    lines.append(
        "  * model parallel: one process with the model split over the GPUs: device_map='balanced' in "
        "the notebook itself, outside nbkit.launch"
    )
    lines.append("  * fewer or shorter sequences per step (max_seq_length, per-device batch size)")
    lines.append("nbkit.plan(model, gpus=N, seq_len=...) compares the options.")
    return "\n".join(lines)


_TRANSFORMERS_REASON = (
    "device_map='auto'/'balanced' splits the model inside every DDP rank (device-mismatch errors, "
    "4/8-bit refusing to train); each rank must load a full copy on its own device"
)
_UNSLOTH_REASON = (
    "unsloth swaps automatic device maps under DDP silently (loader_utils.prepare_device_map); "
    "nbkit makes the switch explicit (notice or DeviceMapError) and checks the dict maps it leaves alone"
)

# PreTrainedModel.from_pretrained is where every Auto class and model class ends up
# (auto_factory passes device_map through **kwargs), so one patch covers transformers.
patch(
    "transformers.modeling_utils:PreTrainedModel.from_pretrained",
    reason=_TRANSFORMERS_REASON,
    upstream=SEED_DDP_DEVICE_MAP,
    group="guard",
)(_guarded(_TRANSFORMERS))

# FastVisionModel inherits FastModel.from_pretrained; it is declared first so that it wraps the
# original, not the already-wrapped FastModel loader (revert runs newest first, so this unwinds).
for _loader_class in ("FastVisionModel", "FastModel", "FastLanguageModel"):
    patch(
        f"unsloth.models.loader:{_loader_class}.from_pretrained",
        reason=_UNSLOTH_REASON,
        upstream=SEED_DDP_DEVICE_MAP,
        group="guard",
    )(_guarded(_UNSLOTH))
