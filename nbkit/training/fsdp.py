"""FSDP (and FSDP-QLoRA) ranks: what a rank does when its environment holds NBKIT_STRATEGY=fsdp.

nbkit does no sharding of its own. A rank started with the fsdp strategy gets the environment that
`accelerate launch --use_fsdp` would give it (ACCELERATE_USE_FSDP and the FSDP_* variables that
accelerate's FullyShardedDataParallelPlugin reads): FSDP version 2, transformer-layer auto-wrap
(the model's `_no_split_modules`: one unit per decoder layer, its checkpoint wrapper where the layer
is checkpointed), full sharding (reshard after forward), efficient loading (rank 0
reads the weights, the other ranks get theirs by broadcast when the model is sharded), activation
checkpointing, and a full state dict gathered to rank 0 for saving. transformers' Trainer builds
its Accelerator from that environment, so `Trainer(...).train()` trains sharded with no change to
the user's code; `shard(model)` does the same for a loop of one's own (accelerate's prepare). A
setting the user exported in the rank's environment wins over nbkit's.

A model too big for one GPU even in 4-bit loads with each rank keeping only its rows of the quantised
weights in CPU memory until sharding (`load_4bit_on_host`), and where even its shards would not fit the
GPUs, they stay in CPU memory while training (`offload_shards`: FSDP's CPU offload); the guard chooses
both from the planner's figures.

What a sharded model needs besides: generation on every rank (`generate`, which refuses within
seconds a call made on some ranks only, where the weights' other shards would never come), and the
adapter gathered to rank 0 to be saved once (`save_adapter`; `save_merged` says why it is not offered).

Where accelerate needs CUDA: `AcceleratorState` turns ACCELERATE_USE_FSDP into
DistributedType.FSDP only for accelerator back ends (MULTI_GPU, XPU, NPU, ...); a gloo rank on CPU
stays MULTI_CPU and Trainer would wrap it in DDP instead. FSDP2 itself (`fully_shard`, DTensor,
gloo collectives) runs on CPU under torch 2.13, and so does the rest of accelerate's FSDP2 path
(fsdp2_prepare_model, rank-0 loading, state dicts), so in a rank without CUDA the "fsdp" patch group
below makes the state FSDP as well: CPU ranks (CI, a laptop) run the same code path the GPU ranks do.
bitsandbytes' 4-bit weights need CUDA: `qlora_config()` is only useful on a GPU.

unsloth has no FSDP (its models are patched for one process or DDP): loading through unsloth in an
fsdp rank raises StrategyError, naming the transformers + peft way.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import itertools
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nbkit.platform import config, distributed, host, notices
from nbkit.platform.errors import StrategyError
from nbkit.platform.patching import patch

__all__ = [
    "EVERY_RANK_TIMEOUT_S",
    "OFFLOAD_VARIABLE",
    "STRATEGY_VARIABLE",
    "FsdpSettings",
    "check_host_memory",
    "compute_dtype",
    "device_map",
    "generate",
    "holds_4bit_weights",
    "load_4bit_on_host",
    "offload_shards",
    "qlora_config",
    "requested",
    "save_adapter",
    "save_merged",
    "setup_rank",
    "shard",
    "unsloth_error",
    "without_training_cache",
]

# The variable nbkit.launch / nbkit.start / the magics put into the ranks' environment.
STRATEGY_VARIABLE = config.STRATEGY
# accelerate's switch for FSDP's CPU offload of the shards (offload_shards).
OFFLOAD_VARIABLE = "FSDP_OFFLOAD_PARAMS"
# Seconds a generation on a sharded model waits for every rank to call it before it is refused.
EVERY_RANK_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class FsdpSettings:
    """The FSDP set-up nbkit gives a rank, as accelerate's plugin reads it from the environment.

    Attributes:
        activation_checkpointing: recompute each transformer layer in the backward (accelerate's
            checkpoint wrapper, non-reentrant). Do not also pass gradient_checkpointing=True to
            TrainingArguments: transformers refuses the two together.
        cpu_ram_efficient_loading: only rank 0 reads the checkpoint; the others build the model
            empty and receive their shards by broadcast when it is sharded (4-bit models excepted:
            every rank quantises them itself, since bitsandbytes' parameters cannot move to meta; see
            device_map and load_4bit_on_host).
        reshard_after_forward: free each layer's gathered weights after its forward (full sharding,
            ZeRO-3); False keeps them until the backward (ZeRO-2: more memory, less communication).
        state_dict_type: FULL_STATE_DICT gathers the weights to rank 0 for saving (the adapter is
            small; Trainer's checkpoints then hold ordinary files peft loads).
    """

    activation_checkpointing: bool = True
    cpu_ram_efficient_loading: bool = True
    reshard_after_forward: bool = True
    state_dict_type: str = "FULL_STATE_DICT"

    def environment(self) -> dict[str, str]:
        """The variables accelerate's FullyShardedDataParallelPlugin and transformers read.

        Returns:
            {name: value}, ACCELERATE_USE_FSDP and the FSDP_* settings.
        """
        flag = {True: "true", False: "false"}
        return {
            "ACCELERATE_USE_FSDP": "true",
            "FSDP_VERSION": "2",
            "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
            "FSDP_RESHARD_AFTER_FORWARD": flag[self.reshard_after_forward],
            "FSDP_CPU_RAM_EFFICIENT_LOADING": flag[self.cpu_ram_efficient_loading],
            "FSDP_ACTIVATION_CHECKPOINTING": flag[self.activation_checkpointing],
            "FSDP_STATE_DICT_TYPE": self.state_dict_type,
        }


def requested() -> bool:
    """Whether this process is a rank of the fsdp strategy (NBKIT_STRATEGY=fsdp in its environment)."""
    return config.strategy() == "fsdp"


def setup_rank(settings: FsdpSettings | None = None) -> None:
    """Make this rank an FSDP rank for accelerate and Trainer: export `settings.environment()` where
    the variable is not set yet, and apply the "fsdp" patch group (accelerate's FSDP state on a rank
    without CUDA; peft's adapter keys under activation checkpointing).

    Called by nbkit.rank_side.setup.prepare_rank() in every rank whose environment asks for the fsdp
    strategy; idempotent. Call it before the first Accelerator or Trainer of the process: accelerate
    keeps its state for the process's life.

    Args:
        settings: the set-up; None: FsdpSettings().
    """
    for name, value in (settings or FsdpSettings()).environment().items():
        os.environ.setdefault(name, value)
    from nbkit.platform import patching

    patching.apply("fsdp")


def compute_dtype() -> torch.dtype:
    """The 16-bit dtype an FSDP rank computes (and stores 4-bit weights) in: float16 on GPUs without
    native bf16 (Kaggle's T4, compute capability 7.5), bfloat16 on newer GPUs and on CPU (where fp16
    matmuls are slow or missing and bf16 is what FSDP's mixed precision is tested with).
    """
    return torch.float16 if distributed.precision() == "fp16" else torch.bfloat16


def qlora_config(dtype: torch.dtype | None = None) -> Any:
    """A BitsAndBytesConfig for QLoRA under FSDP: NF4 with double quantisation, computing in `dtype`
    and storing the packed 4-bit weights in `dtype` too (`bnb_4bit_quant_storage`).

    FSDP2 shards floating-point parameters only, and every parameter of one FSDP unit must share a
    dtype: bitsandbytes' default uint8 storage is left unsharded on every rank by accelerate (a full
    4-bit copy per GPU), while a 16-bit storage dtype equal to the model's torch_dtype is sharded like
    the 16-bit weights. Load with `torch_dtype=dtype` as well.

    Args:
        dtype: None: compute_dtype() (fp16 on T4s, bf16 elsewhere).

    Returns:
        transformers.BitsAndBytesConfig.
    """
    from transformers import BitsAndBytesConfig

    dtype = dtype or compute_dtype()
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )


def device_map(quantized: bool) -> Any:
    """The device map an fsdp rank loads with, whatever the user asked for (the guard calls this).

    16-bit: None: the model loads on CPU (only rank 0 reads the weights under efficient loading) and
    accelerate moves each rank's shards to its GPU while sharding, so no GPU holds a full copy.
    4-bit: {"": this rank's device}: bitsandbytes quantises on the GPU while loading, so each rank
    loads the 4-bit model there (a quarter of the 16-bit size) before it is sharded, or, where that
    would not fit, keeps each weight's rows of its shard in CPU memory as it is made (load_4bit_on_host).
    """
    return {"": distributed.device()} if quantized else None


def offload_shards(planned: Any) -> None:
    """Have accelerate keep this rank's shards, their gradients and the optimizer's state in CPU memory (FSDP2's CPU
    offload: FSDP_OFFLOAD_PARAMS=true) where `planned.fsdp_offload` (a nbkit.plan Plan, not imported here: the
    planner imports this package's savers) says FSDP fits the GPUs only this way, and not where it does not; a
    value the user set is kept. Rank 0 says when it turns the offload on.

    The guard calls it while an fsdp rank loads (the model's plan over all the ranks): Trainer's Accelerator, made
    after the load, reads the variable. A live set's ranks keep their environment from cell to cell, so a later load
    of a model that fits turns the offload nbkit chose off again. Slower than FSDP on the GPUs (every layer's weights
    cross PCIe in each forward and backward), and the ranks of a machine hold the whole model in pinned CPU memory.
    """
    global _offload_chosen
    if not planned.fsdp_offload:
        if _offload_chosen:
            os.environ.pop(OFFLOAD_VARIABLE, None)
            _offload_chosen = False
        return
    if config.flag(OFFLOAD_VARIABLE) is not None:
        return
    os.environ[OFFLOAD_VARIABLE] = "true"
    _offload_chosen = True
    if distributed.rank() == 0:
        notices.logger(__name__).info(
            f"nbkit: {planned.model} fits {planned.gpus} GPUs of {planned.gpu_memory_gib:.0f} GiB under FSDP only with "
            f"its shards in CPU memory (about {planned.fsdp_gib:.1f} GiB per GPU that way): FSDP's CPU offload is on "
            f"({OFFLOAD_VARIABLE}=true; every layer's weights now cross to the GPU in each step, so steps are slower, "
            f"and the ranks of this machine hold about {planned.fsdp_host_gib:.1f} GiB of CPU memory together). "
            f"Set {OFFLOAD_VARIABLE}=false before the load to keep the shards on the GPUs."
        )


def check_host_memory(planned: Any) -> None:
    """Refuse a load whose CPU memory the machine cannot give: `planned.fsdp_host_gib` (a nbkit.plan Plan), what the
    ranks of this machine hold there together while loading on the host or training with offloaded shards, against
    nbkit.platform.host.memory_gib(). Above HOST_MEMORY_WARNING of it, rank 0 says the run is at the machine's edge
    (the ranks' own processes and the notebook's come on top).

    Raises:
        StrategyError: more than the machine has; the load would end minutes later with a rank killed for memory.
    """
    needed, have = planned.fsdp_host_gib, host.memory_gib()
    if not needed or have is None or needed <= HOST_MEMORY_WARNING * have:
        return
    what = (
        "its shards in pinned memory (FSDP's CPU offload, which its GPUs need), LoRA's weights, gradients and "
        "optimizer state"
        if planned.fsdp_offload
        else "its quantised weights while they load, before they are sharded onto the GPUs"
    )
    figures = (
        f"{planned.model} in 4-bit on {planned.gpus} GPUs of {planned.gpu_memory_gib:.0f} GiB needs about "
        f"{needed:.1f} GiB of CPU memory across its FSDP ranks for {what}, and this machine gives {have:.1f} GiB"
    )
    if needed > have:
        raise StrategyError(
            f"{figures}: the load would end with a rank killed for lack of memory. Train it on more GPUs, or on GPUs "
            "with more memory, where its shards stay on them (nbkit.plan(model, gpus=..., gpu_memory_gib=...) gives "
            "the figures), or choose a smaller model."
        )
    if distributed.rank() == 0:
        notices.logger(__name__).info(
            f"nbkit: {figures}, with the ranks' own processes and this notebook's on top: a run at the edge of its "
            "memory. Free what the notebook holds (other models, big data) before training."
        )


# The share of the machine's CPU memory above which check_host_memory warns.
HOST_MEMORY_WARNING = 0.8

# Whether offload_shards set FSDP_OFFLOAD_PARAMS in this process (and may take it back).
_offload_chosen = False


# (this rank, ranks) while a 4-bit load keeps its weights on the host (load_4bit_on_host). A module variable, not a
# context variable: transformers may run a load's conversions in worker threads, which a context does not reach.
_host_rows: tuple[int, int] | None = None


def load_4bit_on_host(load: Callable[[], Any]) -> Any:
    """Run `load` (a 4-bit from_pretrained in an fsdp rank) keeping each quantised weight in CPU memory as soon as
    bitsandbytes has made it on the GPU, with only the rows this rank's FSDP shard will hold written.

    Loaded whole, a 4-bit Qwen3-32B is 18.4 GiB on each rank's GPU before FSDP shards it, more than a T4 has.
    Here a rank's GPU holds, while it loads, the 16-bit weights that are not quantised (embeddings, norms),
    the quantisation state and the weight being quantised; its host memory holds its share of the packed
    weights (1/ranks of them: the other rows of each host tensor are never written, so their pages are never
    resident). FSDP2 moves each unit's weights to the GPU when it shards them and keeps this rank's dim-0
    chunk, which is exactly the rows written here. Until the model is sharded, its weights are not whole on
    any rank, so a forward before that (a generation before training) is refused with a StrategyError.
    The guard calls this where the planner finds that the whole quantised model would not fit one GPU
    (nbkit.configure(fsdp_4bit_load="host" | "gpu") decides otherwise). Under transformers 4.x, which has no
    per-weight conversion to hook, the model loads whole on the GPU as before.

    Args:
        load: a call that loads and returns the model, with nbkit.fsdp.qlora_config() (weights stored in a
            16-bit dtype, which FSDP shards by rows).

    Returns:
        What `load` returned.
    """
    global _host_rows
    rows = _host_rows = (distributed.rank(), distributed.world_size())
    try:
        model = load()
    finally:
        _host_rows = None
    if any(getattr(p, "_nbkit_rows_on_host", False) for p in model.parameters()):
        model.__dict__["_nbkit_rows_on_host"] = rows
        _refuse_forward_until_sharded(model)
    return model


def _keep_rows_on_host(weight: torch.Tensor, rank: int, ranks: int) -> None:
    """Replace `weight`'s data by CPU memory where only this rank's FSDP2 chunk (torch.chunk over dim 0, the
    split fully_shard makes) is written.
    """
    rows = weight.shape[0]
    step = -(-rows // ranks)
    start, stop = min(rank * step, rows), min((rank + 1) * step, rows)
    host = torch.empty(weight.shape, dtype=weight.dtype, device="cpu")
    host[start:stop].copy_(weight.data[start:stop])
    weight.data = host
    weight._nbkit_rows_on_host = True  # type: ignore[attr-defined]


def _refuse_forward_until_sharded(model: Any) -> None:
    """A pre-hook on the input embeddings (every forward calls them, also through peft's wrappers) that refuses a
    forward of the model while its weights are held as rows on the host, and removes itself once it is sharded.
    """
    owner = weakref.ref(model)

    def check(module: torch.nn.Module, args: Any) -> None:
        loaded = owner()
        if loaded is None or _is_sharded(loaded):
            handle.remove()
            return
        raise StrategyError(
            "This 4-bit model was loaded for FSDP with each rank keeping only its share of the weights in CPU memory "
            "(the whole model does not fit one GPU), so it cannot run until it is sharded. Train it "
            "(Trainer(...).train() shards it), or shard it first with model = nbkit.fsdp.shard(model) on every rank, "
            "then generate with nbkit.fsdp.generate(model, ...)."
        )

    handle = model.get_input_embeddings().register_forward_pre_hook(check)


def _quantised_on_host(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: transformers' bitsandbytes conversion keeps each 4-bit weight it makes as rows on the host
    while load_4bit_on_host runs (see there).
    """

    @functools.wraps(original)
    def convert(self: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        made = original(self, *args, **kwargs)
        if _host_rows is not None:
            for weight in made.values():
                if _is_4bit_weight(weight):
                    _keep_rows_on_host(weight, *_host_rows)
        return made

    return convert


patch(
    "transformers.integrations.bitsandbytes:Bnb4bitQuantize.convert",
    reason="an fsdp rank quantises the whole model on its GPU before FSDP shards it (18.4 GiB for Qwen3-32B, over "
    "a T4's 15); under nbkit.fsdp.load_4bit_on_host each quantised weight goes to host memory as it is made, "
    "only the rows of this rank's shard written",
    upstream="none filed yet: transformers loads a bitsandbytes model whole on each rank under FSDP (efficient "
    "loading does not apply to quantised weights)",
    group="fsdp",
)(_quantised_on_host)


def _no_warmup_on_host(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: transformers' allocator warm-up reserves nothing while load_4bit_on_host runs (see there)."""

    @functools.wraps(original)
    def caching_allocator_warmup(*args: Any, **kwargs: Any) -> None:
        if _host_rows is None:
            original(*args, **kwargs)

    return caching_allocator_warmup


patch(
    "transformers.modeling_utils:caching_allocator_warmup",
    reason="before loading, transformers reserves on the GPU what the loaded weights will take there, counted as the "
    "whole model: 17.4 GiB for Qwen3-32B in 4-bit, over a T4's 15, where load_4bit_on_host keeps the quantised "
    "weights on the host; it reserves nothing during such a load",
    upstream="none filed yet: transformers/modeling_utils.py caching_allocator_warmup sizes every weight by the "
    "device map",
    group="fsdp",
)(_no_warmup_on_host)


def holds_4bit_weights(model: torch.nn.Module) -> bool:
    """Whether `model` holds bitsandbytes' packed 4-bit weights (Params4bit), as a QLoRA load gives it."""
    return any(_is_4bit_weight(p) for p in model.parameters())


def _is_4bit_weight(tensor: torch.Tensor) -> bool:
    # By class name: bitsandbytes may be absent, and importing it creates a CUDA context.
    return type(tensor).__name__ == "Params4bit"


def without_training_cache(model: Any) -> None:
    """Turn off a loaded model's KV cache for its training forwards (`config.use_cache = False`).

    accelerate's FSDP2 activation checkpointing recomputes each layer in the backward; a forward that
    builds a KV cache appends to it again during that recomputation, and the recomputed attention then
    has twice the keys ("Recomputed values ... have different metadata": seen with Trainer on
    transformers 4.57, whose training forwards keep use_cache on; transformers 5 turns it off itself).
    generate() asks for the cache explicitly, so generation keeps it.
    """
    config = getattr(model, "config", None)
    if config is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for each in {id(config): config, id(text): text}.values():  # a VL model's text config holds its own flag
        if getattr(each, "use_cache", None):
            each.use_cache = False


def unsloth_error() -> StrategyError:
    """The error for an unsloth load in an fsdp rank."""
    return StrategyError(
        "unsloth cannot train with the fsdp strategy: it has no FSDP support (its models are patched for "
        "one process or DDP). Load the model with transformers + peft instead: "
        "AutoModelForCausalLM / AutoModelForImageTextToText.from_pretrained(..., "
        "quantization_config=nbkit.fsdp.qlora_config(), torch_dtype=nbkit.fsdp.compute_dtype()) for QLoRA, then "
        "peft.get_peft_model(model, LoraConfig(...)); or keep unsloth and start the ranks with the ddp strategy "
        "(a full copy of the model per GPU)."
    )


def shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> torch.nn.Module:
    """Shard `model` over this process group the way Trainer does under FSDP: accelerate's
    Accelerator.prepare with the plugin read from the environment (under FSDP2 Trainer passes the
    model as it is, LoRA or not: transformer layers are the units, LoRA weights shard with their layer).

    For a loop of one's own or an inference cell; Trainer shards by itself. Collective: call it on
    every rank, with the same model. The model is changed in place (FSDP2 swaps its class).

    Args:
        model: the model every rank built or loaded the same way.
        optimizer: an optimizer over the model's parameters, switched in place to the sharded ones
            (accelerate's FSDP2 preparation takes the two together). None: the model alone.

    Returns:
        The sharded model (each parameter a DTensor holding this rank's shard).

    Raises:
        StrategyError: this process is not an fsdp rank (nbkit.config.fsdp_rank(): the fsdp strategy, or
            ACCELERATE_USE_FSDP where no strategy is set).
    """
    if not config.fsdp_rank():
        raise StrategyError(
            "nbkit.fsdp.shard() needs an fsdp rank: start the ranks with the fsdp strategy "
            f"({STRATEGY_VARIABLE}=fsdp in their environment), or call nbkit.fsdp.setup_rank() first."
        )
    config.settle_fsdp_flag()  # accelerate's Accelerator takes only "true" for FSDP
    from accelerate import Accelerator

    accelerator = Accelerator()
    # accelerate refuses a model without an optimizer under FSDP2; plain SGD keeps no state.
    placeholder = optimizer or torch.optim.SGD(list(model.parameters()), lr=0.0)
    sharded, _ = accelerator.prepare(model, placeholder)
    # FSDP2 makes root the first FSDP unit whose forward runs. generate() looks up the input embeddings
    # before calling the model, and accelerate shards them in a group with the output embedding: that group
    # then becomes root and FSDP refuses a root of two modules. Initialising now makes the model itself
    # root, as a training step's forward would (torch has no public call for this).
    sharded._get_fsdp_state()._lazy_init()
    return sharded


def generate(model: torch.nn.Module, *, every_rank_timeout: float | None = None, **inputs: Any) -> Any:
    """`model.generate(**inputs)` on a sharded model: call it on every rank, with the same inputs.

    Every forward of a sharded model gathers each layer's weights from all ranks, so a generate that
    runs on some ranks only (a `%%ddp --rank 0` cell) would wait for the others forever. This first
    checks, through the process group's store, that every rank has called it, and raises within
    `every_rank_timeout` seconds where one has not (the ranks stay usable; in fsdp ranks a plain
    `model.generate` on a sharded model is checked the same way, by the "fsdp" patch group). The
    model's own top-level units (embeddings, final norm, output layer) stay gathered for the whole
    generation: peft's generate calls the inner model's forward, which bypasses the root unit's
    gathering; each decoder layer is gathered and freed per step as in training.

    Args:
        model: a model sharded by Trainer or shard() (peft or plain transformers).
        every_rank_timeout: seconds to wait for the other ranks before raising (None: EVERY_RANK_TIMEOUT_S).
        **inputs: generate()'s arguments (input_ids, pixel_values, max_new_tokens, ...).

    Returns:
        What model.generate returns, on every rank (the same tokens: same weights, same inputs).

    Raises:
        StrategyError: some rank did not call it within the timeout (the message says to run the cell on
            every rank).
    """
    from torch.distributed.fsdp import FSDPModule

    _check_every_rank(every_rank_timeout)
    layers = _layer_units(model)
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and id(m) not in layers]
    for unit in units:
        unit.unshard()
    token = _CHECKED.set(True)
    try:
        with torch.no_grad():
            return model.generate(**{"use_cache": True, **inputs})  # type: ignore[operator]
    finally:
        _CHECKED.reset(token)
        for unit in units:
            unit.reshard()


# Set while generate() runs: the generate it calls was checked already.
_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("nbkit_fsdp_checked", default=False)


def _check_every_rank(timeout: float | None) -> None:
    """Raise StrategyError unless every rank of the process group reaches this call within `timeout` s."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    timeout = EVERY_RANK_TIMEOUT_S if timeout is None else timeout
    missing = _ranks_missing(timeout)
    if missing:
        raise StrategyError(
            f"generate on a sharded (FSDP) model must run on every rank, but rank(s) {missing} did not call it "
            f"within {timeout:g} s. Each rank holds only its shard of the weights, so generation needs "
            "all of them: run the cell on every rank (%%ddp without --rank), with the same inputs everywhere, "
            "use nbkit.fsdp.generate(model, ...), and keep rank 0's answer."
        )


def _layer_units(model: torch.nn.Module) -> set[int]:
    """Ids of the FSDP units that are one decoder layer (see _decoder_layer_units)."""
    return {id(m) for m in _decoder_layer_units(model)}


def _decoder_layer_units(model: torch.nn.Module) -> list[Any]:
    """The FSDP units that are one decoder layer (a class the model lists in _no_split_modules, the classes
    accelerate's transformer-layer policy wraps), checkpoint-wrapped or not, in the order the model holds
    them (the order a transformers model runs them).
    """
    from torch.distributed.fsdp import FSDPModule

    layers = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or ())}
    return [
        m
        for m in model.modules()
        if isinstance(m, FSDPModule)
        and type(getattr(m, "_checkpoint_wrapped_module", m)).__name__.removeprefix("FSDP") in layers
    ]


def _ranks_missing(timeout: float) -> list[int]:
    """Count this call on this rank in the process group's store and wait until every rank has counted as
    many; returns the ranks that had not within `timeout` seconds (and then takes this rank's count back,
    so that the next call on every rank lines up again). The store, not a collective: a collective that
    times out leaves its group unusable, and this check exists for exactly that case.
    """
    import time

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()  # the rendezvous store every rank shares
    me, world = dist.get_rank(), dist.get_world_size()
    calls = store.add(f"nbkit/training/fsdp/generate/{me}", 1)
    deadline = time.monotonic() + timeout
    while True:
        missing = [r for r in range(world) if r != me and store.add(f"nbkit/training/fsdp/generate/{r}", 0) < calls]
        if not missing:
            return []
        if time.monotonic() > deadline:
            store.add(f"nbkit/training/fsdp/generate/{me}", -1)
            return missing
        time.sleep(0.05)


def _saved_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """What saving a sharded model needs, gathered to rank 0's CPU memory (an empty dict elsewhere): its trainable
    weights only where the model is a peft model whose adapters all train (peft keeps the adapters' keys of a state
    dict), else every parameter. Collective: every rank must call it.

    The frozen base stays sharded where it can: gathering it would put a 14B model's 9.3 GB of packed 4-bit weights
    into rank 0's RAM to save 64M LoRA weights, at every checkpoint.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # torch reads the sharded weights: decide on those, not on gathered copies a module may hold (peft switches
    # requires_grad on whichever weights its modules hold).
    _reshard(model)
    frozen_left_out = _only_the_base_is_frozen(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=frozen_left_out)
    return get_model_state_dict(model, options=options)


def _reshard(model: torch.nn.Module) -> None:
    """Every FSDP unit of `model` back to its shards, its gathered weights freed (FSDPModule.reshard is per unit)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _only_the_base_is_frozen(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model whose every adapter weight trains (an inactive adapter is frozen, and a save
    that left frozen weights out would lose it).
    """
    adapters = getattr(model, "peft_config", None)
    if not isinstance(adapters, dict) or not adapters:
        return False
    marks = tuple(f".{name}." for name in adapters)
    return all(p.requires_grad for name, p in model.named_parameters() if any(m in name for m in marks))


def save_adapter(model: torch.nn.Module, path: str | os.PathLike[str]) -> Path | None:
    """Save a sharded peft model's adapter: its weights gathered to rank 0 and written there once, in
    peft's format (adapter_config.json + adapter_model.safetensors); a plain single process loads it with
    PeftModel.from_pretrained.

    Collective: call it on every rank (each sends its shards). torch gathers them into rank 0's CPU
    memory, never onto a GPU; the frozen base weights stay where they are when every adapter trains.

    Args:
        model: a peft model sharded by Trainer or shard().
        path: the directory to write.

    Returns:
        The directory on rank 0, None on the other ranks.
    """
    state = _saved_state_dict(model)
    if distributed.rank() != 0:
        return None
    target = Path(path)
    model.save_pretrained(target, state_dict=state)  # type: ignore[operator]  # peft filters the adapter keys
    return target


def save_merged(model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
    """Not available under FSDP; raises StrategyError saying what to do.

    Merging LoRA into the base weights needs every full weight in 16-bit on one device: for a model
    sharded because it does not fit one GPU, that is exactly the copy FSDP avoids (and a 4-bit base
    must first be dequantised). Save the adapter (save_adapter / Trainer.save_model), then merge in a
    single process with the weights on CPU.
    """
    raise StrategyError(
        "save_merged is not available under FSDP: merging LoRA into the base needs a full 16-bit copy of the "
        "model on one device, which is what sharding avoids. Save the adapter on every rank with "
        "nbkit.fsdp.save_adapter(model, path) (or trainer.save_model(path)); then, in one process with enough "
        "CPU memory: base = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16, device_map='cpu'); "
        "PeftModel.from_pretrained(base, path).merge_and_unload().save_pretrained(out)."
    )


def _adapter_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: Accelerator.get_state_dict of an FSDP2 model gathers what saving it needs
    (_saved_state_dict: a peft model's trainable weights where every adapter trains, else every parameter).

    Trainer saves through it (save_model and every checkpoint) and peft then keeps the adapter's keys; accelerate
    gathered the whole model to rank 0's CPU memory first, a 4-bit base included. Otherwise its options are
    accelerate's (a full state dict on rank 0's CPU; its broadcast_from_rank0 only matters when loading).
    """

    @functools.wraps(original)
    def get_state_dict(self: Any, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        if getattr(self, "is_fsdp2", False):
            return _saved_state_dict(model)
        return original(self, model, unwrap)

    return get_state_dict


patch(
    "accelerate.accelerator:Accelerator.get_state_dict",
    reason="Trainer saves a sharded peft model (save_model, every checkpoint) through accelerate's FSDP2 state dict, "
    "which gathers every parameter to rank 0's CPU memory, though peft keeps the adapter's keys only: a 14B model's "
    "9.3 GB of packed 4-bit weights per save, for 64M LoRA weights",
    upstream="none filed yet: accelerate/accelerator.py get_state_dict (FSDP2: get_model_state_dict without "
    "ignore_frozen_params)",
    group="fsdp",
)(_adapter_state_dict)


def _cpu_fsdp_state(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: AcceleratorState on a rank without CUDA becomes FSDP where accelerate's own code
    would leave it MULTI_CPU (see the module docstring).
    """

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        if fsdp_plugin is None or self.distributed_type != DistributedType.MULTI_CPU:
            return
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = self.distributed_type

    return __init__


patch(
    "accelerate.state:AcceleratorState.__init__",
    reason="accelerate makes ACCELERATE_USE_FSDP an FSDP run only on accelerator back ends; a gloo rank on CPU "
    "would train with DDP instead, although FSDP2 and accelerate's FSDP2 path run there (fsdp ranks without CUDA)",
    upstream="none filed yet: accelerate/state.py sets DistributedType.FSDP only in its MULTI_GPU/XPU/NPU/... branch",
    group="fsdp",
    when=lambda: not torch.cuda.is_available(),
)(_cpu_fsdp_state)


def _unwrapped_prefixes(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: peft's adapter key prefixes without the activation-checkpoint wrapper's name.

    peft finds the adapter's entries of a state dict by walking the model's modules. accelerate's
    FSDP2 activation checkpointing puts each decoder layer inside a CheckpointWrapper, whose module
    names hold "_checkpoint_wrapped_module." while state dict keys do not (the wrapper's state-dict
    hook drops it): every prefix then misses, and save_pretrained (Trainer.save_model too) writes an
    adapter file with no tensors in it (seen here: peft 0.21, accelerate 1.15, torch 2.13).
    """

    @functools.wraps(original)
    def prefixes(*args: Any, **kwargs: Any) -> set[str]:
        return {prefix.replace(_CHECKPOINT_WRAPPER, "") for prefix in original(*args, **kwargs)}

    return prefixes


# torch.distributed.algorithms._checkpoint.checkpoint_wrapper's name for the wrapped module.
_CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."

patch(
    "peft.tuners.tuners_utils:_get_tuner_state_dict_key_prefixes",
    reason="under accelerate's FSDP2 activation checkpointing, peft's structural adapter-key lookup sees the "
    "checkpoint wrapper's module names and saves an empty adapter (Trainer.save_model and save_pretrained alike)",
    upstream="none filed yet: peft/tuners/tuners_utils.py strips FSDP1's '_fsdp_wrapped_module.' prefix only",
    group="fsdp",
)(_unwrapped_prefixes)


def _placeholders_not_copies(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: under FSDP's efficient loading, a rank other than each host's first gets its
    parameters as uninitialised CPU memory instead of zeros.

    transformers 5 loads those ranks' weights on the meta device and then gives every parameter a
    zero-filled CPU tensor of the full size; accelerate never reads them (it moves the model to meta
    again while sharding and broadcasts rank 0's weights). Zero-filling makes each such rank hold the
    whole model in RAM: a 317 MiB bf16 checkpoint added 317 MiB to rank 1's resident memory, 14 MiB
    with this patch (benchmarks/RESULTS.md, "FSDP loading"). With 2 ranks of a 16-bit 8B model that
    is 17 GB of a Kaggle session's RAM (about 30 GB); with 8 ranks, seven copies. Uninitialised
    memory is not resident until written (transformers 4.x used it here too). Buffers stay zeros, as
    transformers makes them: they are small, and the non-persistent ones are initialised next.
    """

    @functools.wraps(original)
    def move(self: Any, missing_keys: Any, device_map: Any, device_mesh: Any, hf_quantizer: Any) -> None:
        from transformers import modeling_utils

        if hf_quantizer is not None or not modeling_utils.is_fsdp_enabled() or modeling_utils.is_local_dist_rank_0():
            return original(self, missing_keys, device_map, device_mesh, hf_quantizer)
        for key, param in self.named_parameters():
            modeling_utils._load_parameter_into_model(self, key, torch.empty_like(param, device="cpu"))
        for key, buffer in self.named_buffers():
            modeling_utils._load_parameter_into_model(self, key, torch.zeros_like(buffer, device="cpu"))
        return None

    return move


patch(
    "transformers.modeling_utils:PreTrainedModel._move_missing_keys_from_meta_to_device",
    reason="under FSDP's efficient loading, transformers 5 fills every parameter of the ranks that do not read the "
    "checkpoint with zeros, so each holds a full copy of the model in RAM that accelerate then discards",
    upstream="none filed yet: transformers/modeling_utils.py _move_missing_keys_from_meta_to_device (4.x used "
    "torch.empty_like there)",
    group="fsdp",
)(_placeholders_not_copies)


def _sharded_model_kept(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: Accelerator's FSDP2 preparation takes a model that is sharded already as it is.

    accelerate returns such a model unchanged from fsdp2_prepare_model, but only after looking up the
    transformer layer classes for activation checkpointing and auto-wrap. Where the layers are the units,
    fully_shard has renamed them (Qwen3DecoderLayer is FSDPQwen3DecoderLayer now): training again, resuming
    after a stop, or a new Trainer of trainer.model failed with "Could not find the transformer layer
    class". Where their checkpoint wrappers are (nbkit's units under activation checkpointing), it finds the
    layers inside and would wrap each in a second checkpoint. The layers keep the checkpointing and sharding
    of the first preparation; the optimizer and the rest are prepared as accelerate prepares them, and the
    optimizer already holds the sharded parameters.
    """

    @functools.wraps(original)
    def _prepare_fsdp2(self: Any, *args: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule

        models = [obj for obj in args if isinstance(obj, torch.nn.Module)]
        if not models or not isinstance(getattr(models[-1], "_orig_mod", models[-1]), FSDPModule):
            return original(self, *args)
        result = [obj if isinstance(obj, torch.nn.Module) else self._prepare_one(obj, first_pass=True) for obj in args]
        result = [obj if isinstance(obj, torch.nn.Module) else self._prepare_one(obj) for obj in result]
        if not any(model is models[-1] for model in self._models):
            self._models.append(models[-1])
        return tuple(result)

    return _prepare_fsdp2


patch(
    "accelerate.accelerator:Accelerator._prepare_fsdp2",
    reason="accelerate looks up the transformer layer classes of a model that FSDP2 has sharded already (renamed "
    "FSDP<Layer>) before it would return it unchanged, so training an FSDP model again, resuming after a stop or a "
    "new Trainer of trainer.model failed with 'Could not find the transformer layer class' (or, with the checkpoint "
    "wrappers as the units, would checkpoint each layer a second time)",
    upstream="none filed yet: accelerate/accelerator.py _prepare_fsdp2 applies activation checkpointing before "
    "fsdp2_prepare_model's check for an FSDPModule",
    group="fsdp",
)(_sharded_model_kept)


def _checked_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: generate on a sharded model first checks that every rank called it (see generate())."""

    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _CHECKED.get() and _is_sharded(self):
            _check_every_rank(None)
        return original(self, *args, **kwargs)

    return generate


def _checked_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: save_pretrained of a sharded model without a gathered state dict is refused before
    anything is written (see save_adapter).
    """

    @functools.wraps(original)
    def save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("state_dict") is None and _is_sharded(self):
            raise StrategyError(
                f"save_pretrained({str(save_directory)!r}) of a sharded (FSDP) model: each rank holds only its shard "
                "of the weights, which save_pretrained cannot write (nothing was written). Gather and save with "
                "nbkit.fsdp.save_adapter(model, path) on every rank (%%ddp without --rank), or "
                "trainer.save_model(path) on every rank; rank 0 writes the files."
            )
        return original(self, save_directory, *args, **kwargs)

    return save_pretrained


for _target in (
    "transformers.modeling_utils:PreTrainedModel.save_pretrained",
    "peft.peft_model:PeftModel.save_pretrained",
):
    patch(
        _target,
        reason="save_pretrained of a sharded model without a gathered state dict failed with 'Attempted to access the "
        "data pointer on an invalid python storage' after writing README.md, on every rank or on rank 0 alone; this "
        "refuses it before anything is written, saying how to save",
        upstream="none filed yet: transformers and peft save the local DTensor shards as if they were whole tensors",
        group="fsdp",
    )(_checked_save)


def _is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


patch(
    "transformers.generation.utils:GenerationMixin.generate",
    reason="a sharded model's forward on some ranks only (a %%ddp --rank 0 cell) waits for the other ranks' shards "
    "until the process group's timeout (minutes); this refuses it within seconds, with what to do",
    upstream="none: FSDP's collectives cannot tell a rank that never comes from a slow one",
    group="fsdp",
)(_checked_generate)


def _lean_fsdp2_preparation(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: accelerate's FSDP2 preparation holding no second copy of the weights while it shards,
    and gathering each decoder layer's weights one layer ahead in the forward.

    accelerate takes `model.state_dict()` before sharding and keeps it until it returns, but reads it only
    to broadcast rank 0's weights under efficient loading of a 16-bit model. Elsewhere, a 4-bit model
    above all (loaded whole on each rank's GPU, nbkit.fsdp.device_map), the old full tensors then stay
    alive while every shard is made: the full 4-bit model plus all its shards at once (a 14B model:
    about 9.3 + 4.6 GiB on each GPU), and the freed full copies leave the cache fragmented. Here the
    model answers that call with an empty dict for the preparation's length where nothing reads it.

    FSDP2 gathers a layer's weights when its forward starts; that overlaps the previous layer's compute
    only while the CPU runs ahead of the GPU. Naming the next layer as each layer's forward prefetch
    issues its all-gather as soon as the layer starts (one more layer's weights in memory; the backward
    already prefetches one layer by itself, and checkpointed recomputation gathers through it). The last
    layer keeps its gathered weights after its forward: its backward follows right after the loss, so
    freeing them would only gather them again where nothing can hide the wait. After a forward without
    grad (generation, evaluation) no backward follows, and it reshards: left gathered, it also held the
    weights peft's disable_adapter() switches requires_grad on, so the last layer's sharded LoRA weights
    stayed frozen after the context (a save that gathers trainable weights lost them).

    Under mixed precision accelerate reduces the gradients in the compute dtype. In fp16 (T4s) a LoRA
    gradient times the loss scale may overflow in the sum over ranks and a small one vanishes, and bf16
    keeps 8 bits of it; the trainable weights are fp32 and few, so they are reduced in fp32 (as torch's
    own FSDP2 examples do), for a few MiB more per step.

    accelerate also has every unit cast its outputs to the compute dtype, the model's loss included: in
    bf16 the loss kept 8 bits (6.969 for 6.954, tiny Qwen3 on CPU ranks), and in fp16 the loss scaler's
    first scale, 65,536, is one above fp16's largest number, so the scaled loss's gradient entered the
    model as inf and the first steps were skipped (2x H100, Qwen3-14B in 4-bit: two steps, where the same
    model in one process skipped none). The units compute in the compute dtype anyway (their weights are
    cast to it), so outputs keep the dtype they were computed in.
    """

    @functools.wraps(original)
    def fsdp2_prepare_model(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
        plugin = accelerator.state.fsdp_plugin
        policy = plugin.mixed_precision_policy
        if policy is not None:
            sixteen = (torch.float16, torch.bfloat16)
            reduce_dtype = torch.float32 if policy.reduce_dtype in sixteen else policy.reduce_dtype
            output_dtype = None if policy.output_dtype in sixteen else policy.output_dtype
            plugin.mixed_precision_policy = dataclasses.replace(
                policy, reduce_dtype=reduce_dtype, output_dtype=output_dtype
            )
        if plugin.cpu_ram_efficient_loading and not holds_4bit_weights(model):
            prepared = original(accelerator, model)
        else:
            model.__dict__["state_dict"] = _no_state_dict
            try:
                prepared = original(accelerator, model)
            finally:
                model.__dict__.pop("state_dict", None)
        _check_rows_on_host(prepared)
        layers = _weight_units(_decoder_layer_units(prepared))
        for layer, following in itertools.pairwise(layers):
            layer.set_modules_to_forward_prefetch([following])
        if layers and plugin.reshard_after_forward:
            layers[-1].set_reshard_after_forward(False, recurse=False)
            layers[-1].register_forward_hook(_reshard_without_grad)
        return prepared

    return fsdp2_prepare_model


def _byte_all_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: FSDP2 gathers 16-bit parameters as their bytes.

    FSDP-QLoRA stores bitsandbytes' packed 4-bit weights in the compute dtype so that FSDP shards them
    (qlora_config), and about one fp16 word in 32 of packed codes reads as a NaN (one bf16 word in 258).
    Before its all-gather FSDP2 copies every shard into one buffer with torch._foreach_copy_, whose CUDA
    kernel takes 16-bit values through fp32 and writes every NaN back as the one canonical NaN: four codes
    of each such word changed, on every gather, with more than one rank (one rank copies with copy_).
    Qwen3-1.7B shapes in 4-bit on 2 GPUs in fp16: the last layer's output RMS 14.6 where the same weights
    unsharded give 4.3, gradient norms a tenth of theirs, a loss that fell a third as far (benchmarks/
    RESULTS.md). Gathering the bytes (FSDP2's own path for units of mixed dtypes) copies them exactly, and
    moves the same bytes.
    """

    @functools.wraps(original)
    def metadatas(param_all_gather_inputs: list[list[torch.Tensor]]) -> Any:
        dtypes, numels, dtype = original(param_all_gather_inputs)
        return dtypes, numels, torch.uint8 if dtype in (torch.float16, torch.bfloat16) else dtype

    return metadatas


patch(
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_all_gather_input_metadatas",
    reason="FSDP2 copies 16-bit shards into its all-gather buffer through fp32 on CUDA (torch._foreach_copy_), "
    "which rewrites every NaN bit pattern as the canonical NaN: bitsandbytes' packed 4-bit weights stored in "
    "fp16 (one word in 32 reads as a NaN) came back with changed codes, so FSDP-QLoRA on 2 GPUs under fp16 "
    "trained a different model (gradient norms a tenth of the unsharded model's); the shards are gathered as "
    "bytes instead",
    upstream="https://github.com/bitsandbytes-foundation/bitsandbytes/issues/1945 (the same in bf16; open)",
    group="fsdp",
)(_byte_all_gather)


def _check_rows_on_host(model: torch.nn.Module) -> None:
    """Raise StrategyError where a model loaded by load_4bit_on_host was sharded other than over every rank in rank
    order (a device mesh of the user's): its shards would then hold rows this rank never loaded.
    """
    from torch.distributed.tensor import DTensor

    rows = getattr(model, "_nbkit_rows_on_host", None)
    sharded = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    if rows is None or sharded is None:
        return
    mesh = sharded.device_mesh
    if mesh.ndim != 1 or mesh.size() != rows[1] or mesh.get_local_rank() != rows[0]:
        raise StrategyError(
            f"This 4-bit model was loaded with rank {rows[0]} of {rows[1]} keeping only its share of each weight, but "
            f"FSDP sharded it over a device mesh of shape {tuple(mesh.shape)}: its shards would hold rows that were "
            "never loaded. Shard over all ranks (accelerate's default), or load with "
            'nbkit.configure(fsdp_4bit_load="gpu").'
        )


def _reshard_without_grad(module: Any, args: Any, output: Any) -> None:
    """Forward hook of the last decoder layer's unit: free its gathered weights where no backward will."""
    if not torch.is_grad_enabled():
        module.reshard()


def _weight_units(units: list[Any]) -> list[Any]:
    """The units among `units` that hold weights themselves: accelerate's own policy makes each checkpointed
    decoder layer's CheckpointWrapper an FSDP unit with no weights around the layer's unit (prefetching it would
    gather nothing). nbkit's patch of that policy (_outermost_layer_units) leaves the wrapper the only unit,
    where the policy is still accelerate's to patch.
    """
    from torch.distributed.fsdp import FSDPModule

    return [u for u in units if not any(isinstance(m, FSDPModule) for m in itertools.islice(u.modules(), 1, None))]


def _no_state_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {}


patch(
    "accelerate.accelerator:fsdp2_prepare_model",
    reason="accelerate keeps a state dict of the whole unsharded model alive while it shards, read only for "
    "16-bit efficient loading: a 4-bit rank held its full model and all its shards at once (14.1 GiB per GPU for "
    "a 14B model on 2 GPUs); FSDP2 overlaps a layer's all-gather with the previous layer's compute only when "
    "the CPU runs ahead, so each layer names the next one for forward prefetch (and the last layer stays gathered "
    "into its backward); the (LoRA) gradients are "
    "reduced in fp32, not in the 16-bit compute dtype, where fp16's loss-scaled sums overflow; and the units' "
    "outputs, the loss included, keep their dtype instead of being cast to the 16-bit one (an fp16 loss turned the "
    "loss scaler's first scale into an inf gradient)",
    upstream="none filed yet: accelerate/utils/fsdp_utils.py fsdp2_prepare_model (original_sd taken "
    "unconditionally; forward_prefetch refused for FSDP2)",
    group="fsdp",
)(_lean_fsdp2_preparation)


def _outermost_layer_units(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory: accelerate's transformer-layer policy makes each checkpointed decoder layer one FSDP unit,
    at its checkpoint wrapper, instead of two.

    accelerate checkpoints a layer by wrapping it in a CheckpointWrapper before sharding, and its policy looks
    through the wrapper so that the layer still gets a unit; but the layer inside matches as well, and is
    sharded first (bottom-up): it becomes the unit that holds the weights, and the wrapper a second unit around
    it that holds none. FSDP's hooks then run three times per layer and forward (the wrapper's, the layer's, and
    the layer's again in the backward's recomputation), each casting the inputs and walking the outputs. With
    the wrapper alone as the unit (how torch's examples shard a checkpointed block) its hooks run once: its
    pre-backward gathers the weights before the recomputation, which then runs without FSDP's hooks. The same
    weights are gathered and reduced in the same units and order, so the results are the same.
    """

    @functools.wraps(original)
    def fsdp2_prepare_auto_wrap_policy(plugin: Any, model: torch.nn.Module) -> Callable[[torch.nn.Module], bool] | None:
        policy = original(plugin, model)
        if policy is None:
            return None
        wrapped = {id(m._checkpoint_wrapped_module) for m in model.modules() if _is_wrapper(m) and policy(m)}
        if not wrapped:
            return policy
        return lambda module: id(module) not in wrapped and policy(module)

    return fsdp2_prepare_auto_wrap_policy


def _is_wrapper(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "_checkpoint_wrapped_module", None), torch.nn.Module)


_OUTERMOST_UNITS = patch(
    "accelerate.utils.fsdp_utils:fsdp2_prepare_auto_wrap_policy",
    reason="under activation checkpointing accelerate's transformer-layer policy matches both each decoder layer and "
    "the checkpoint wrapper around it, so every layer became two FSDP units (one without weights) and FSDP's hooks "
    "ran three times per layer and forward (recomputation included): host time per step on host-bound GPUs",
    upstream="none filed yet: accelerate/utils/fsdp_utils.py fsdp2_prepare_auto_wrap_policy looks through "
    "CheckpointWrapper but still matches the wrapped layer",
    group="fsdp",
)(_outermost_layer_units)
