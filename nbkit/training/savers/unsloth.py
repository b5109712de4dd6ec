"""unsloth's memory savers under DDP and across GPUs: the fixes nbkit.install() applies where missing.

unsloth's three long-sequence savers have each failed under DDP or with a model split over GPUs
(docs/unsloth_patches.md has the table of releases):

1. Fused chunked loss with hidden states and lm_head on different GPUs: the chunks' functorch
   transform fails with "Cannot access storage of TensorWrapper". Fixed upstream by moving the hidden
   states to the lm_head's device before the loss; the patch here does the same where that is missing.
2. TiledMLP: the backward calls `.backward()` once per sequence shard, so every weight's DDP hook fires
   once per shard ("marked ready twice", or wrong gradients). The patch routes unsloth's TiledMLP
   through nbkit's tiled MLP, whose parameters are inputs of the autograd function (one
   accumulation per weight), unless unsloth ships its own replacement.
3. Reentrant (offloaded) checkpointing of text models under DDP: Trainer passes
   `find_unused_parameters=True` for peft models, the checkpointed forward runs without grad so DDP
   marks the LoRA weights unused, then the recompute marks them again ("Expected to mark a variable
   ready only once"). The patch makes Trainer pick False for a LoRA-only dense text model under
   checkpointing (every LoRA weight gets a gradient each step), unless the user chose a value or
   unsloth makes that choice itself.
4. Not a failure but a cost: to avoid 3 for vision models, unsloth checkpoints them under DDP with
   torch's non-reentrant checkpoint plus saved-tensor offload hooks, a different path from its
   single-GPU one, and slower (benchmarks/RESULTS.md). For dense (non-MoE) vision models nbkit
   keeps the single-GPU checkpointing and has Trainer use find_unused_parameters=False, which is
   right when every trainable weight gets a gradient each step (images in every batch for a LoRA'd
   vision tower). The setting `nbkit.configure(unsloth_vlm_ddp_checkpointing="unsloth")`, read
   at each model load, gives unsloth its own choice back.

Fixes 1-3 are detected by *feature*, never by version: the `when` predicates read the code of the
unsloth / unsloth_zoo modules already imported (or, for unsloth's own package, its source files,
without importing it: `import unsloth` initialises CUDA). Where the feature is present the patch is
left out. Each fix acts only in a distributed run or when devices actually differ, so single-GPU
runs are unchanged. nbkit.install() applies these (group "unsloth_savers") when the modules are imported.

The detection functions take source text, so they are tested against real unsloth releases.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, cast

import torch

from nbkit.platform import compat, distributed, notices
from nbkit.platform.config import setting
from nbkit.platform.patching import patch
from nbkit.training.savers._model import base_model

__all__ = [
    "fused_loss_moves_hidden_states",
    "needs_cross_device_loss_fix",
    "needs_find_unused_fix",
    "needs_tiled_mlp_fix",
    "replaces_tiled_mlp_apply",
    "sets_ddp_find_unused_parameters",
    "tiled_backward_runs_backward_per_shard",
    "unsloth_chooses_vlm_checkpointing",
]

_log = notices.logger(__name__)

_FUSED_LOSS_MODULE = "unsloth_zoo.fused_losses.cross_entropy_loss"
_TILED_MLP_MODULE = "unsloth_zoo.tiled_mlp"


# --------------------------------------------------------------------------------------------------
# Feature detection on source text


def _parse(source: str) -> ast.Module | None:
    try:
        return ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None


def _named(tree: ast.AST, kind: type, name: str) -> list[Any]:
    return [node for node in ast.walk(tree) if isinstance(node, kind) and getattr(node, "name", None) == name]


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def fused_loss_moves_hidden_states(source: str) -> bool:
    """Whether unsloth_zoo's `unsloth_fused_ce_loss` (in `source`) reassigns `hidden_states` from
    `hidden_states.to(...)` before its chunked loss: the fix for hidden states and lm_head on different
    devices. False when the function is absent or does not.
    """
    tree = _parse(source)
    if tree is None:
        return False
    for function in _named(tree, ast.FunctionDef, "unsloth_fused_ce_loss"):
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Assign)
                and any(_is_name(t, "hidden_states") for t in node.targets)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "to"
                and _is_name(node.value.func.value, "hidden_states")
            ):
                return True
    return False


def tiled_backward_runs_backward_per_shard(source: str) -> bool:
    """Whether `TiledMLP.backward` (in `source`) calls a `.backward(...)` inside a loop: each call
    accumulates every weight's gradient once more, which DDP refuses. False when absent.
    """
    tree = _parse(source)
    if tree is None:
        return False
    for cls in _named(tree, ast.ClassDef, "TiledMLP"):
        for method in _named(cls, ast.FunctionDef, "backward"):
            for loop in ast.walk(method):
                if isinstance(loop, (ast.For, ast.While)) and any(
                    isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
                    for n in ast.walk(loop)
                ):
                    return True
    return False


def replaces_tiled_mlp_apply(source: str) -> bool:
    """Whether `source` assigns `TiledMLP.apply` (unsloth's own DDP-safe replacement of zoo's TiledMLP)."""
    tree = _parse(source)
    if tree is None:
        return False
    return any(
        isinstance(node, ast.Assign)
        and any(
            isinstance(t, ast.Attribute) and t.attr == "apply" and _is_name(t.value, "TiledMLP") for t in node.targets
        )
        for node in ast.walk(tree)
    )


def sets_ddp_find_unused_parameters(source: str) -> bool:
    """Whether `source` assigns some `<args>.ddp_find_unused_parameters` (unsloth choosing DDP's
    find_unused_parameters for its models itself).
    """
    tree = _parse(source)
    if tree is None:
        return False
    return any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Attribute) and t.attr == "ddp_find_unused_parameters" for t in node.targets)
        for node in ast.walk(tree)
    )


# --------------------------------------------------------------------------------------------------
# Where the installed code is read from (never importing it)


def _imported_source(module_name: str, qualname: str) -> str | None:
    """Source of `qualname` in an already imported module; None if not imported or not readable."""
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is None:
        return None
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None


def _unsloth_models_dir() -> Path | None:
    """Unsloth's `models` package directory, found without importing unsloth; None if not installed."""
    module = sys.modules.get("unsloth")
    locations = getattr(module, "__path__", None)
    if locations is None:
        try:
            spec = importlib.util.find_spec("unsloth")
        except (ImportError, ValueError):
            return None
        locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        return None
    models = Path(next(iter(locations))) / "models"
    return models if models.is_dir() else None


@functools.cache
def _unsloth_ships(models_dir: Path, needle: str, check: Callable[[str], bool] | None = None) -> bool:
    for path in sorted(models_dir.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if needle in text and (check is None or check(text)):
            return True
    return False


def needs_cross_device_loss_fix() -> bool:
    """unsloth_zoo's fused loss is imported and does not move hidden states to the lm_head's device.

    Unreadable source counts as missing: the fix is a no-op where the devices already agree.
    """
    if _FUSED_LOSS_MODULE not in sys.modules:
        return False
    source = _imported_source(_FUSED_LOSS_MODULE, "unsloth_fused_ce_loss")
    return source is None or not fused_loss_moves_hidden_states(source)


def needs_tiled_mlp_fix() -> bool:
    """unsloth_zoo's TiledMLP is imported, backpropagates shard by shard, and unsloth does not replace it."""
    if _TILED_MLP_MODULE not in sys.modules:
        return False
    source = _imported_source(_TILED_MLP_MODULE, "TiledMLP")
    if source is not None and not tiled_backward_runs_backward_per_shard(source):
        return False
    models = _unsloth_models_dir()
    return models is None or not _unsloth_ships(models, "TiledMLP", replaces_tiled_mlp_apply)


def needs_find_unused_fix() -> bool:
    """Unsloth is installed and never chooses DDP's find_unused_parameters for its models itself."""
    models = _unsloth_models_dir()
    return models is not None and not _unsloth_ships(
        models, "ddp_find_unused_parameters", sets_ddp_find_unused_parameters
    )


def unsloth_chooses_vlm_checkpointing() -> bool:
    """The installed unsloth decides its vision models' checkpointing through
    vlm_gradient_checkpointing_reentrant (read from its source, without importing it).
    """
    models = _unsloth_models_dir()
    return models is not None and _unsloth_ships(models, "def vlm_gradient_checkpointing_reentrant")


# --------------------------------------------------------------------------------------------------
# The patches


@functools.cache
def _forward_parameters(cls: type) -> list[str]:
    return list(inspect.signature(cast(Any, cls).forward).parameters)[1:]


@patch(
    f"{_FUSED_LOSS_MODULE}:UnslothFusedLoss.apply",
    reason="hidden states on another GPU than lm_head fail inside the chunked loss's functorch transform "
    "('Cannot access storage of TensorWrapper'); move them (differentiably) to lm_head's device first",
    upstream="https://github.com/unslothai/unsloth-zoo/pull/423",
    group="unsloth_savers",
    when=needs_cross_device_loss_fix,
)
def _fused_loss_on_head_device(original: Callable[..., Any]) -> Callable[..., Any]:
    # zoo calls UnslothFusedLoss.apply positionally in the order of forward's parameters (after ctx).
    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        names = _forward_parameters(cls)
        values = dict(zip(names, args), **kwargs)
        weight = values.get("lm_head_weight")
        if isinstance(weight, torch.Tensor):
            for name in ("hidden_states", "labels", "mask"):
                value = values.get(name)
                if isinstance(value, torch.Tensor) and value.device != weight.device:
                    values[name] = value.to(weight.device)
        positional = [values.pop(n) for n in names[: len(args)]]
        return original(cls, *positional, **values)

    return apply


@patch(
    f"{_TILED_MLP_MODULE}:TiledMLP.apply",
    reason="TiledMLP's backward calls .backward() per sequence shard, so each weight's DDP hook fires once "
    "per shard ('marked ready twice'); under DDP run nbkit's tiled MLP, which returns each weight's "
    "gradient once",
    upstream="https://github.com/unslothai/unsloth/pull/4077",
    group="unsloth_savers",
    when=needs_tiled_mlp_fix,
)
def _tiled_mlp_ddp_safe(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply(
        cls: type,
        mlp_forward: Callable[[torch.Tensor], Any],
        mlp_module: torch.nn.Module,
        x: torch.Tensor,
        *rest: Any,
    ) -> Any:
        # rest: preserve_rng_state (nbkit always replays the RNG), num_shards, max_flat_qlen.
        # Without DDP (or without a backward) unsloth's own code is right. Mixture-of-experts blocks
        # return extra outputs nbkit's tiling does not carry: left as they are.
        ddp_backward = distributed.is_distributed() and torch.is_grad_enabled()
        if not ddp_backward or hasattr(mlp_module, "experts") or len(rest) < 2 or x.dim() < 2:
            return original(cls, mlp_forward, mlp_module, x, *rest)
        from nbkit.training.savers.tiled_mlp import _TiledGrad, _TiledRun

        shards = max(1, min(int(rest[1]), x.shape[-2]))
        params = [p for p in mlp_module.parameters() if p.requires_grad]
        return _TiledRun.apply(_TiledGrad.apply(x, mlp_forward, shards, *params), mlp_forward, shards)

    return apply


_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _has_experts(config: Any) -> bool:
    """Mixture-of-experts layers in the model or its language part (experts a step skips leave
    weights without gradient, which find_unused_parameters=False cannot take).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(getattr(c, key, None) for c in (config, text) for key in _MOE_KEYS)


def _dense_vision_model(model: Any) -> bool:
    """A vision-language model without mixture-of-experts layers."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vision_config", None) is None:
        return False
    return not _has_experts(config)


def _fix_4_wanted() -> bool:
    """Fix 4 needs the Trainer patch below to set find_unused_parameters=False, and that patch exists
    for transformers 5 only (Trainer._build_accelerator_args); on 4.x unsloth's own DDP checkpointing
    (non-reentrant, slower, correct with find_unused_parameters=True) stays.
    """
    return compat.transformers_major() >= 5 and unsloth_chooses_vlm_checkpointing()


@patch(
    "unsloth.models.vision:vlm_gradient_checkpointing_reentrant",
    reason="under DDP unsloth checkpoints vision models with torch's non-reentrant checkpoint and offload "
    "hooks instead of its single-GPU reentrant offloading checkpoint, which is faster under DDP too "
    "(benchmarks/RESULTS.md); keep the single-GPU one for dense vision models, Trainer then uses "
    "find_unused_parameters=False (transformers 5 only: on 4.x nbkit cannot set that, so unsloth's choice stays)",
    upstream="https://github.com/unslothai/unsloth/issues/3713",
    group="unsloth_savers",
    when=_fix_4_wanted,
)
def _vlm_keeps_single_gpu_checkpointing(original: Callable[[], bool]) -> Callable[[], bool]:
    @functools.wraps(original)
    def vlm_gradient_checkpointing_reentrant() -> bool:
        chosen = original()  # True on one GPU, FSDP2 and ZeRO-3: nothing to change there
        if chosen or setting("unsloth_vlm_ddp_checkpointing") != "reentrant":
            return chosen
        # unsloth asks without naming the model; its caller (FastBaseModel.post_patch_model, also used
        # for some text models) holds it as `model`. Anything else keeps unsloth's answer.
        model = _caller_model()
        if model is None or not _dense_vision_model(base_model(model)):
            return chosen
        cast(Any, model)._nbkit_kept_reentrant = True  # read by the Trainer patch below
        return True

    return vlm_gradient_checkpointing_reentrant


def _caller_model() -> torch.nn.Module | None:
    """The `model` of the nearest calling frame outside nbkit (the registry may add a frame)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("nbkit."):
        frame = frame.f_back
    model = frame.f_locals.get("model") if frame is not None else None
    return model if isinstance(model, torch.nn.Module) else None


def _kept_reentrant_under_ddp(trainer: Any) -> bool:
    """A model fix 4 kept on unsloth's reentrant checkpointing, trained in a distributed run."""
    model = trainer.model
    if model is None or not distributed.is_distributed():
        return False
    return any(getattr(m, "_nbkit_kept_reentrant", False) for m in (model, base_model(model)))


def _reentrant_lora_text_model_under_ddp(trainer: Any) -> bool:
    """The case unsloth's reentrant checkpointing breaks with find_unused_parameters=True."""
    if "unsloth" not in sys.modules or not distributed.is_distributed() or not needs_find_unused_fix():
        return False
    if getattr(trainer.args, "ddp_find_unused_parameters", None) is not None:
        return False  # the user's choice stands
    from transformers import PreTrainedModel

    model = trainer.model
    if model is None or isinstance(model, PreTrainedModel):
        return False  # transformers already picks False for these under checkpointing
    base = base_model(model)
    config = getattr(base, "config", None)
    # VLMs (unsloth checkpoints them non-reentrantly under DDP), MoE (experts a step skips) and
    # anything but a decoder-only LM can leave trainable weights without gradient: keep True there.
    if not type(base).__name__.endswith("ForCausalLM") or config is None:
        return False
    if any(getattr(config, key, None) is not None for key in ("vision_config", "audio_config")):
        return False
    if _has_experts(config):
        return False
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if not trainable or not all(
        "lora_" in name and "embed" not in name and "lm_head" not in name for name in trainable
    ):
        return False
    return bool(trainer.args.gradient_checkpointing) or any(
        getattr(m, "gradient_checkpointing", False) is True for m in base.modules()
    )


def _find_unused_fix_wanted() -> bool:
    return needs_find_unused_fix() or unsloth_chooses_vlm_checkpointing()


@patch(
    "transformers.trainer:Trainer._build_accelerator_args",
    reason="unsloth checkpoints text models (and, with fix 4, vision models) reentrantly; Trainer's "
    "find_unused_parameters=True for peft models then fails under DDP ('Expected to mark a variable ready "
    "only once'); where every trainable weight gets a gradient each step False is correct",
    upstream="https://github.com/unslothai/unsloth/issues/3713",
    group="unsloth_savers",
    when=_find_unused_fix_wanted,
)
def _find_unused_false_for_unsloth_lora(original: Callable[..., Any]) -> Callable[..., Any]:
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        vlm = _kept_reentrant_under_ddp(self)
        if vlm and getattr(self.args, "ddp_find_unused_parameters", None) is True:
            raise ValueError(
                "ddp_find_unused_parameters=True cannot work with this unsloth vision model: nbkit kept "
                "unsloth's single-GPU (reentrant) checkpointing under DDP, which needs False. Either leave "
                "ddp_find_unused_parameters unset, or run nbkit.configure(unsloth_vlm_ddp_checkpointing="
                "'unsloth') before loading the model (unsloth's slower DDP checkpointing, which allows True)."
            )
        if vlm or _reentrant_lora_text_model_under_ddp(self):
            from accelerate.utils import DistributedDataParallelKwargs

            for handler in result.get("kwargs_handlers", []):
                if isinstance(handler, DistributedDataParallelKwargs) and handler.find_unused_parameters:
                    handler.find_unused_parameters = False
                    _log.info(
                        "nbkit: DDP find_unused_parameters=False for this model (unsloth checkpoints it "
                        "reentrantly, which fails with True). Set TrainingArguments.ddp_find_unused_parameters "
                        "to choose yourself."
                    )
        return result

    return build
