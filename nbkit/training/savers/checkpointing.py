"""Activation checkpointing per decoder layer that is safe under DDP, with the layer inputs optionally in host memory.

Each decoder layer of the language model runs under torch's *non-reentrant* checkpoint
(`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`): the forward keeps only the layer's
inputs, and the backward recomputes the layer inside the same backward pass. The reentrant variant
(what unsloth's "unsloth" mode builds on) runs a second forward during backward, so DDP sees every
LoRA weight become ready twice ("Expected to mark a variable ready only once") whenever
find_unused_parameters=True -- which transformers' Trainer sets for peft models. The non-reentrant
one gives each parameter exactly one gradient per backward, works with find_unused_parameters True
or False, static_graph and no_sync, and needs no `enable_input_require_grads()` trick when no input
requires grad (LoRA on a frozen base).

With offload=True the saved layer inputs (the hidden states, one (batch, seq, hidden) tensor per
layer) are copied to pinned CPU memory through `saved_tensors_hooks`. Device-to-host copies run on a
side CUDA stream while the next layers compute; in the backward, fetching a layer's input starts the
host-to-device copy of the layer before it (the next one the backward needs), so copies overlap with
the recomputation. On CPU tensors the hooks keep the tensor as it is.

With regional compilation (nbkit.savers.compiling) a layer is compiled with this checkpoint inside
(compile_checkpointed): the compiled backward recomputes it, and the offloading hooks take only its
input. Calls that would break the compiled region's graph keep the checkpoint outside.

RNG: torch's checkpoint replays the CPU RNG and the RNG of the devices its tensor arguments sit on.
The layer's inputs are moved to the layer's own device first, so dropout masks replay on the device
where the layer runs also when a model is split over several GPUs (device_map).

transformers' own gradient checkpointing: a layer with this saver ignores transformers'
`gradient_checkpointing` flag (one checkpoint, never two), and the KV cache is switched off while
enabled (`config.use_cache=False`; a cache passed to a layer is dropped as transformers does).
"""

from __future__ import annotations

import contextlib
import functools
import types
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nbkit.training.savers import tiled_mlp
from nbkit.training.savers._model import add_mixin, base_model, decoder_layers, has_mixin, remove_mixin

__all__ = ["HostOffloader", "compile_checkpointed", "disable", "drop_compiled", "enable", "is_checkpointed"]

_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")
# A layer's compiled call with the checkpoint inside (compile_checkpointed).
_COMPILED = "_nbkit_compiled_checkpoint"


class _Offloaded:
    """A tensor parked in pinned host memory, and the state of its copies.

    prev: weak reference to the record packed just before this one (the layer before, in the
    forward), which is the next one the backward will ask for: fetching this one prefetches it.
    """

    __slots__ = ("__weakref__", "device", "host", "on_device", "prev", "ready", "used")

    def __init__(self, host: torch.Tensor, device: torch.device, ready: torch.cuda.Event, prev: Any):
        self.host = host
        self.device = device
        self.on_device: torch.Tensor | None = None
        self.ready = ready  # recorded on the side stream after the last copy that was queued
        self.prev = prev
        self.used = False


class HostOffloader:
    """saved_tensors_hooks that keep saved CUDA tensors in pinned host memory until the backward needs them.

    Use `with offloader.hooks(): ...` around code whose saved tensors should be offloaded. One
    offloader serves a whole model, so that each fetch can prefetch the tensor saved before it.
    Tensors on other devices (CPU) are kept as they are.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last: weakref.ref[_Offloaded] | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> HostOffloader:
        # Streams and parked tensors belong to this process's run; a copied model (a reference model
        # made with copy.deepcopy) gets its own, empty offloader.
        return HostOffloader()

    def hooks(self, only: torch.Tensor | None = None) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks that offload what autograd keeps for backward: everything, or with `only`
        the tensors that share its memory (a compiled layer also saves its weights, which stay).
        """
        if only is None:
            return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        storage = only.untyped_storage().data_ptr()

        def pack(tensor: torch.Tensor) -> torch.Tensor | _Offloaded:
            return self._pack(tensor) if tensor.untyped_storage().data_ptr() == storage else tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Offloaded:
        if tensor.device.type != "cuda":
            return tensor
        stream = self._stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor may still be being written
        with torch.cuda.stream(stream):
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            # The compute stream may free the tensor as soon as we return; keep its memory from being
            # reused until the copy has read it.
            tensor.record_stream(stream)
            ready = torch.cuda.Event()
            ready.record(stream)
        record = _Offloaded(host, tensor.device, ready, self._last)
        self._last = weakref.ref(record)
        return record

    def _fetch(self, record: _Offloaded) -> None:
        stream = self._stream(record.device)
        with torch.cuda.stream(stream):
            record.on_device = record.host.to(record.device, non_blocking=True)
            record.ready = torch.cuda.Event()
            record.ready.record(stream)

    def _unpack(self, record: torch.Tensor | _Offloaded) -> torch.Tensor:
        if isinstance(record, torch.Tensor):
            return record
        if record.on_device is None:
            self._fetch(record)
        tensor, record.on_device, record.used = cast(torch.Tensor, record.on_device), None, True
        compute = torch.cuda.current_stream(record.device)
        compute.wait_event(record.ready)
        # Allocated on the side stream, used and freed on the compute stream.
        tensor.record_stream(compute)
        before = record.prev() if record.prev is not None else None
        if before is not None and before.on_device is None and not before.used:
            self._fetch(before)
        return tensor


class _Checkpointing:
    """What one model's checkpointed layers share: the mode, the offloader, the configs' old use_cache."""

    def __init__(self, offload: bool) -> None:
        self.offload = offload
        self.offloader = HostOffloader() if offload else None
        self.use_cache: list[tuple[Any, Any]] = []

    def run(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = functools.partial(nn.Module.__call__, layer)
        if not torch.is_grad_enabled() or not _needs_grad(layer, args, kwargs):
            return call(*args, **kwargs)
        if not getattr(layer, "_can_checkpoint_with_cache", False):
            # The recompute would write the KV cache a second time.
            kwargs = {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        device = _device_of(layer)
        if device is not None:
            # checkpoint records the RNG of its arguments' devices: put them where the dropout runs.
            args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        compiled = getattr(layer, _COMPILED, None)
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        # A hooked layer (FSDP2's all-gather, accelerate's device hooks) and a split tiled MLP break the
        # compiled checkpoint's region, which would then run eagerly: the checkpoint wraps the compiled layer.
        hooked = bool(layer._forward_pre_hooks or layer._forward_hooks)
        if (
            compiled is not None
            and not hooked
            and isinstance(hidden, torch.Tensor)
            and not tiled_mlp.splits(layer, hidden)
        ):
            # The compiled autograd node saves the layer's input (offloaded) and its weights (kept).
            hooks = self.offloader.hooks(only=hidden) if self.offloader is not None else contextlib.nullcontext()
            with hooks:
                return compiled(*args, **kwargs)
        hooks = self.offloader.hooks() if self.offloader is not None else contextlib.nullcontext()
        with hooks:
            return checkpoint(call, *args, use_reentrant=False, **kwargs)


def _device_of(layer: nn.Module) -> torch.device | None:
    """The device of the layer's first parameter, None where it has none or it is on the meta device.

    accelerate's device maps never split a decoder layer, so one parameter tells. Walking all of them, as
    this did before, cost 0.2 ms per layer call, 11 ms of a step of 28 layers.
    """
    first = next(layer.parameters(), None)
    return None if first is None or first.device.type == "meta" else first.device


def _needs_grad(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the layer's output will need a backward (else there is nothing to checkpoint)."""
    inputs = [*args, *kwargs.values()]
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs) or any(
        p.requires_grad for p in layer.parameters()
    )


class _CheckpointedLayer:
    """Mixin for decoder layers: every call goes through the model's _Checkpointing."""

    _nbkit_checkpointing: _Checkpointing

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._nbkit_checkpointing.run(cast(nn.Module, self), args, kwargs)


def _checkpointed_call(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(layer._call_impl, *args, use_reentrant=False, **kwargs)


def compile_checkpointed(layer: nn.Module, compiler: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Give a checkpointed decoder layer a compiled call with the checkpoint inside: `compiler` of that call
    (torch.compile with its options; nbkit.savers.compiling passes its own).

    Dynamo traces a non-reentrant checkpoint as one region, and AOTAutograd's partitioner recomputes the layer
    inside the compiled backward: the forward saves the layer's inputs and weights only, as the checkpoint
    outside a compiled layer does, without that checkpoint's Python hooks on each of the ~50 tensors the
    compiled forward would save (benchmarks/layer_host_cost.py on the CPU, 28 layers of negligible width: 110.7
    ms per LoRA step against 139.6 ms, 90.3 ms without checkpointing). Calls that would break the region's
    graph, which dynamo's checkpoint region cannot hold (a tiled MLP that splits the sequence, a layer with
    module hooks such as FSDP2's), take the checkpoint outside the compiled layer instead.
    nbkit.savers.compiling calls this; drop_compiled() undoes it.
    """
    setattr(layer, _COMPILED, compiler(types.MethodType(_checkpointed_call, layer)))


def drop_compiled(layer: nn.Module) -> None:
    """Undo compile_checkpointed(); a no-op where it was not done."""
    if hasattr(layer, _COMPILED):
        delattr(layer, _COMPILED)


def is_checkpointed(layer: nn.Module) -> bool:
    """Whether enable() checkpoints this decoder layer."""
    return has_mixin(layer, _CheckpointedLayer)


def enable(model: nn.Module, *, offload: bool) -> None:
    """Checkpoint every decoder layer of `model`, offloading saved inputs if asked.

    Replaces a previous setting of this saver. Sets `use_cache=False` on the model's configs
    (restored by disable).

    Args:
        model: a transformers model, bare, peft- or DDP-wrapped.
        offload: keep each layer's saved input in pinned CPU memory instead of on the GPU.

    Raises:
        ValueError: when the model's decoder layers cannot be found.
    """
    disable(model)
    base = base_model(model)
    layers = decoder_layers(base)
    state = _Checkpointing(offload)
    config: Any = getattr(base, "config", None)
    configs = [config] if config is not None else []
    if configs and callable(getattr(config, "get_text_config", None)):
        configs.append(config.get_text_config())
    for each in {id(c): c for c in configs}.values():
        if getattr(each, "use_cache", None):
            state.use_cache.append((each, each.use_cache))
            each.use_cache = False
    for layer in layers:
        cast(Any, layer)._nbkit_checkpointing = state
        add_mixin(layer, _CheckpointedLayer)


def disable(model: nn.Module) -> None:
    """Undo enable(): layers get their own class back and configs their use_cache. A no-op if not enabled."""
    state: _Checkpointing | None = None
    for layer in decoder_layers(model):
        if has_mixin(layer, _CheckpointedLayer):
            state = cast(_CheckpointedLayer, layer)._nbkit_checkpointing
            remove_mixin(layer, _CheckpointedLayer)
            del layer._nbkit_checkpointing
    if state is not None:
        for config, value in state.use_cache:
            config.use_cache = value
