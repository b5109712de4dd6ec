"""Building blocks of nbkit's GPU benchmarks: models, synthetic batches, the timed DDP loop, figures.

Used by bench.py (the matrix harness), tests/test_gpu_ddp.py and any other benchmark script:

    import common                                   # benchmarks/ on sys.path
    device = common.setup_rank()                    # in each launched rank
    model = common.build_model("nbkit", path, "bf16", device)
    batch = common.synthetic_batch(model.config, 1024, 4, device)
    step = common.Stepper(common.wrap_ddp(model, device), "bf16", device)
    times, losses = common.timed_steps(step, batch, steps=20)
    common.step_stats(times)                        # median, p10/p90, spread

`run_launch(spec)` is the whole per-rank job of one benchmark launch: it loads the model once per
precision, runs every case of the spec (sequence length x batch x precision x DDP options) and
appends one JSON line per case to `spec.results_path` from rank 0, so a launch that dies half-way
still leaves the cases it finished. bench.py runs it under nbkit.launch, accelerate's
notebook_launcher, `accelerate launch` and torchrun: the same function in every case.

Backends (LoRA r=16 on all linear layers, alpha = r, no dropout, in every case):
- "unsloth": unsloth's FastVisionModel (FastLanguageModel for text models), 16-bit weights, its
  gradient checkpointing "unsloth". Imported inside the rank only (importing it initialises CUDA).
- "nbkit": transformers + peft with `nbkit.savers.apply(model)` (offloaded checkpointing, tiled MLP,
  chunked loss by default).
- "plain": transformers + peft with transformers' non-reentrant gradient checkpointing.

Every rank runs the same sequence of collectives whatever fails, so one case's failure (an OOM, an
exception) is recorded on every rank and the launch goes on with the next case: each case starts
with a probe step on the bare model (no DDP, so no collective inside), the ranks agree on its
outcome over a gloo group, and only then train together.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import inspect
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nbkit  # noqa: F401  (first: nbkit.forksafety keeps this launching process fork-safe)

__all__ = [
    "BACKENDS",
    "PRECISIONS",
    "Case",
    "LaunchSpec",
    "Stepper",
    "agree",
    "build_model",
    "case_row",
    "ddp_label",
    "environment",
    "gather",
    "gc_pauses",
    "parse_ddp_options",
    "parse_value",
    "peak_memory_gib",
    "preload",
    "probe",
    "run_launch",
    "setup_rank",
    "shard_batch",
    "step_stats",
    "synthetic_batch",
    "teardown_rank",
    "timed_steps",
    "wrap_ddp",
]

BACKENDS = ("unsloth", "nbkit", "plain")
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# DDP options that are nbkit-benchmark knobs rather than DistributedDataParallel arguments:
#   freeze_unused (default True): freeze the trainable parameters the probe step found without a
#     gradient (a VLM's LoRA'd vision tower on a text-only batch), as a user who trains only what
#     the data uses would (finetune_vision_layers=False); their gradient is None either way. Under
#     nbkit, unsloth's vision models checkpoint reentrantly in DDP and need this (or an image).
#   find_unused_parameters="auto": True exactly when unused parameters are left (freeze_unused=false),
#     as transformers' Trainer would search for them; any DDP argument can be given too.
#   comm_hook: "bf16" / "fp16" gradient compression (torch's default hooks), as unsloth installs.
DDP_DEFAULTS: dict[str, Any] = {"find_unused_parameters": "auto", "freeze_unused": True}
_DDP_KNOBS = ("freeze_unused", "comm_hook")

# The one small image of --image: a grid of 16x16 patches (64 tokens after Qwen-VL's 2x2 merge).
IMAGE_GRID = (1, 16, 16)


# ---------------------------------------------------------------------------------------------
# What one launch runs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One measured configuration inside a launch."""

    seq_len: int
    batch: int
    precision: str
    ddp: tuple[tuple[str, Any], ...] = ()  # DDP options, sorted (key, value) pairs

    @property
    def tokens(self) -> int:
        """Tokens per rank per step."""
        return self.seq_len * self.batch

    def label(self) -> str:
        text = f"{self.precision} {self.seq_len}x{self.batch}"
        extra = ddp_label(dict(self.ddp))
        return f"{text} [{extra}]" if extra else text


@dataclass
class LaunchSpec:
    """Everything a launch's ranks need, as plain data (written to JSON for script launchers).

    `ladder`: cases are ascending sequence lengths (batch 1) tried until the first failure, then
    bisected `ladder_bisect` times (to multiples of 4096) between the longest that trained and the
    shortest that did not.
    """

    backend: str
    gpus: int
    launcher: str
    model: str
    model_path: str
    device: str  # "cuda" or "cpu"
    cases: list[Case]
    results_path: str
    steps: int = 20
    warmup: int = 3  # untimed steps, the probe step included
    lora_r: int = 16
    image: bool = False
    memory_cap_gib: float | None = None
    ladder: bool = False
    ladder_bisect: int = 2
    profile_dir: str | None = None
    profile_steps: int = 3
    grad_accum: int = 1  # micro-batches per optimisation step
    savers: dict[str, Any] = field(default_factory=dict)
    unsloth_checkpointing: str | bool = "unsloth"
    launched_at: float = 0.0  # time.time() just before the launcher was called
    collective_timeout_s: float = 300.0
    seed: int = 0

    @property
    def config(self) -> str:
        name = f"{self.backend}:{self.gpus}"
        return name if self.launcher == "nbkit" else f"{name}@{self.launcher}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LaunchSpec:
        data = json.loads(text)
        data["cases"] = [
            Case(c["seq_len"], c["batch"], c["precision"], tuple(tuple(kv) for kv in c["ddp"])) for c in data["cases"]
        ]
        return cls(**data)


def _ddp_argument_names() -> set[str]:
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    return set(params) - {"self", "module", "device_ids", "output_device", "process_group", "device_mesh"}


def parse_value(text: str) -> Any:
    """A command-line value: true/false/none, an int, a float, else the text itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_ddp_options(text: str) -> tuple[tuple[str, Any], ...]:
    """Parse "key=value,key=value" DDP options into sorted (key, value) pairs, defaults filled in.

    Keys: any DistributedDataParallel argument of this torch (bucket_cap_mb, gradient_as_bucket_view,
    static_graph, find_unused_parameters (also "auto"), broadcast_buffers, ...), plus freeze_unused
    and comm_hook ("bf16" / "fp16" / none). Raises ValueError naming the valid keys otherwise.
    """
    options = dict(DDP_DEFAULTS)
    allowed = _ddp_argument_names() | set(_DDP_KNOBS)
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in allowed:
            raise ValueError(
                f"DDP option {item!r} is not key=value with a known key. Known: {', '.join(sorted(allowed))}."
            )
        options[key] = parse_value(value)
    if options.get("comm_hook") not in (None, "bf16", "fp16"):
        raise ValueError(f"comm_hook={options['comm_hook']!r}: use bf16, fp16 or none.")
    if options["find_unused_parameters"] not in (True, False, "auto"):
        raise ValueError("find_unused_parameters must be true, false or auto.")
    return tuple(sorted(options.items()))


def ddp_label(options: dict[str, Any]) -> str:
    """The options that differ from the defaults, as "key=value,..." ("" for the defaults)."""
    return ",".join(f"{k}={v}" for k, v in sorted(options.items()) if DDP_DEFAULTS.get(k) != v)


# ---------------------------------------------------------------------------------------------
# Rank set-up
# ---------------------------------------------------------------------------------------------

_control_group: Any = None


def setup_rank(
    device_kind: str | None = None, *, memory_cap_gib: float | None = None, timeout_s: float = 300.0
) -> torch.device:
    """Set this rank up: its device, an optional memory cap, the process group for several ranks.

    Takes "cuda" / "cpu" (None: cuda where available), a per-process cap in GiB (the T4 stand-in;
    torch.cuda.set_per_process_memory_fraction, so allocations past it raise OutOfMemoryError) and
    the collective timeout (a rank left waiting for a failed peer errors out after it instead of
    hanging). Initialises torch.distributed (NCCL on GPUs, gloo on CPU) when WORLD_SIZE > 1, plus a
    gloo group for the ranks' agreements. Returns this rank's device. Call once per rank, first.
    """
    import torch.distributed as dist

    global _control_group
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device_kind is None:
        device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if memory_cap_gib is not None:
            total = torch.cuda.get_device_properties(local_rank).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, memory_cap_gib * 2**30 / total), local_rank)
    else:
        device = torch.device("cpu")
        # Forked CPU ranks hang in their first parallel op when the parent had started torch's
        # thread pool, and two ranks on a small machine only fight over cores anyway.
        torch.set_num_threads(1)
    if world == int(os.environ.get("LOCAL_WORLD_SIZE", "0")) and sys.platform.startswith("linux"):
        # Every rank is on this machine: gloo (the agreements, CPU runs) over loopback, whatever
        # the host name resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    if world > 1 and _control_group is None:
        _control_group = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
    return device


def teardown_rank() -> None:
    """Destroy the process group set up by setup_rank (a no-op in a single process)."""
    import torch.distributed as dist

    global _control_group
    _control_group = None
    if dist.is_initialized():
        dist.destroy_process_group()


def gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank ([value] in a single process). Collective."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=_control_group)
    return out


def agree(ok: bool) -> bool:
    """True when `ok` is True on every rank. Collective, over gloo: works right after a CUDA OOM."""
    return all(gather(bool(ok)))


# ---------------------------------------------------------------------------------------------
# Models and batches
# ---------------------------------------------------------------------------------------------


def _is_vision(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def build_model(
    backend: str,
    path: str,
    precision: str,
    device: torch.device,
    *,
    lora_r: int = 16,
    max_seq_len: int = 2048,
    savers: dict[str, Any] | None = None,
    unsloth_checkpointing: str | bool = "unsloth",
    seed: int = 0,
) -> nn.Module:
    """A LoRA model ready to train on `device`, built the way each backend's users build it.

    Takes the backend ("unsloth", "nbkit", "plain"), a local checkpoint path, the precision
    ("bf16"/"fp16": weights in that dtype, trained under autocast; "fp32"), the rank's device, the
    LoRA rank (alpha = r, all linear layers, the LM head excluded), the longest sequence unsloth
    should prepare for, nbkit.savers.apply options (defaults: all savers), unsloth's
    use_gradient_checkpointing, and the seed of the LoRA initialisation (same on every rank).
    Returns the peft model in train mode, trainable parameters in fp32 (GradScaler needs fp32
    gradients; peft does this by default, unsloth may not). Raises ValueError for an unknown
    backend or precision; ImportError when unsloth is asked for and not installed.
    """
    from transformers import AutoConfig

    if backend not in BACKENDS:
        raise ValueError(f"Unknown backend {backend!r}; use one of {', '.join(BACKENDS)}.")
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}.")
    dtype = PRECISIONS[precision]
    vision = _is_vision(AutoConfig.from_pretrained(path))
    place = str(device)  # the whole model on this rank's device ("cuda:1", "cpu")
    if backend == "unsloth":
        model = _unsloth_model(path, dtype, place, vision, lora_r, max_seq_len, unsloth_checkpointing, seed)
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", device_map=place)
        model.config.use_cache = False
        if backend == "plain":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(seed)
        lora = LoraConfig(
            r=lora_r, lora_alpha=lora_r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
        model = get_peft_model(model, lora)
        if backend == "nbkit":
            import nbkit.savers

            nbkit.savers.apply(model, **(savers or {}))
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    model.train()
    return model


def _unsloth_model(
    path: str,
    dtype: torch.dtype,
    place: str,
    vision: bool,
    lora_r: int,
    max_seq_len: int,
    checkpointing: str | bool,
    seed: int,
) -> nn.Module:
    import unsloth  # noqa: F401  (first, as unsloth requires; ~25 s, initialises CUDA)
    from unsloth import FastLanguageModel, FastVisionModel

    loader = FastVisionModel if vision else FastLanguageModel
    model, _ = loader.from_pretrained(
        path,
        max_seq_length=max_seq_len,
        dtype=dtype,
        load_in_4bit=False,
        device_map=place,
        use_gradient_checkpointing=checkpointing,
    )
    lora = dict(
        r=lora_r,
        lora_alpha=lora_r,
        lora_dropout=0.0,
        bias="none",
        random_state=seed,
        use_gradient_checkpointing=checkpointing,
    )
    if vision:
        lora.update(
            target_modules="all-linear",
            finetune_vision_layers=True,
            finetune_language_layers=True,
            finetune_attention_modules=True,
            finetune_mlp_modules=True,
        )
    else:
        lora.update(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = loader.get_peft_model(model, **lora)
    loader.for_training(model)
    return model


def preload(spec: LaunchSpec) -> None:
    """Import what the ranks of `spec` will use (transformers, the model's modeling module, nbkit's
    savers) in the process that launches, so that forked ranks inherit it as they inherit a
    notebook's earlier imports. Never imports unsloth (it initialises CUDA) nor peft: `import peft`
    imports bitsandbytes where it is installed (peft/helpers.py), and both notebook launchers then
    refuse to fork. No CUDA here.
    """
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    config = AutoConfig.from_pretrained(spec.model_path)
    mapping = (
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
        if _is_vision(config)
        else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    )
    mapping[type(config)]  # imports the modeling module
    if spec.backend == "nbkit":
        import nbkit.savers  # noqa: F401


def synthetic_batch(
    config: Any, seq_len: int, batch: int, device: torch.device | str, *, image: bool = False, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A training batch of `batch` random sequences of exactly `seq_len` tokens, labels = inputs
    (image tokens excepted).

    Takes the model's config (text or Qwen-VL), the length and count, the device, whether each
    sequence carries one small image (IMAGE_GRID patches as <vision_start> <image_pad>... <vision_end>
    right after the first token, with pixel_values, image_grid_thw and mm_token_type_ids), and a
    seed (same seed, same batch). No attention mask (no padding), so attention never materialises
    a seq x seq mask. Token ids avoid the image/video marker ids; image tokens get label -100. Raises ValueError when an image
    is asked of a model that is not a Qwen-VL or does not fit in `seq_len`.
    """
    if seq_len < 2 or batch < 1:
        raise ValueError(f"A batch needs seq_len >= 2 and batch >= 1 (got {seq_len} x {batch}).")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = text.vocab_size
    markers = {
        getattr(config, name, None)
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    } - {None}
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    if markers:
        filler = next(i for i in range(vocab) if i not in markers)
        ids[torch.isin(ids, torch.tensor(sorted(markers)))] = filler
    out = {"input_ids": ids}
    if image:
        out.update(_image_inputs(config, ids, generator))
    out["labels"] = ids.clone()
    if image:  # as chat collators do: no loss on image tokens
        out["labels"][out["mm_token_type_ids"].bool()] = -100
    return {k: v.to(device) for k, v in out.items()}


def _image_inputs(config: Any, ids: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
    vision = getattr(config, "vision_config", None)
    needed = ("patch_size", "temporal_patch_size", "spatial_merge_size")
    if vision is None or not all(hasattr(vision, n) for n in needed) or getattr(config, "image_token_id", None) is None:
        raise ValueError(
            f"--image needs a Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL); {type(config).__name__} is not one. "
            "Run text-only batches instead."
        )
    batch, seq_len = ids.shape
    t, h, w = IMAGE_GRID
    patches = t * h * w
    tokens = patches // vision.spatial_merge_size**2
    if seq_len < tokens + 3:
        raise ValueError(f"One image takes {tokens + 2} tokens; seq_len {seq_len} is too short for it.")
    channels = getattr(vision, "in_channels", 3)
    width = channels * vision.temporal_patch_size * vision.patch_size**2
    ids[:, 1] = config.vision_start_token_id
    ids[:, 2 : 2 + tokens] = config.image_token_id
    ids[:, 2 + tokens] = config.vision_end_token_id
    kinds = torch.zeros_like(ids, dtype=torch.int32)
    kinds[:, 2 : 2 + tokens] = 1
    return {
        "pixel_values": torch.randn(batch * patches, width, generator=generator),
        "image_grid_thw": torch.tensor([IMAGE_GRID] * batch),
        "mm_token_type_ids": kinds,
    }


def shard_batch(batch: dict[str, torch.Tensor], parts: int, index: int) -> dict[str, torch.Tensor]:
    """Rows index*n/parts .. (index+1)*n/parts of a synthetic batch (its images' patches included):
    the share of one rank of `parts` in a global batch. Raises ValueError if the rows do not split evenly.
    """
    rows = batch["input_ids"].shape[0]
    if rows % parts:
        raise ValueError(f"A batch of {rows} rows does not split into {parts} equal parts.")
    size = rows // parts
    out = {}
    for key, value in batch.items():
        if key == "pixel_values":  # (images x patches, width): each row's image is a block of patches
            per_row = value.shape[0] // rows
            out[key] = value[index * size * per_row : (index + 1) * size * per_row]
        else:
            out[key] = value[index * size : (index + 1) * size]
    return out


# ---------------------------------------------------------------------------------------------
# Training steps
# ---------------------------------------------------------------------------------------------


def wrap_ddp(
    model: nn.Module, device: torch.device, options: Iterable[tuple[str, Any]] = (), *, unused: Iterable[str] = ()
) -> nn.Module:
    """`model` in DistributedDataParallel with `options` (see parse_ddp_options); `model` itself
    when torch.distributed is not initialised or has one rank.

    `unused`: names of trainable parameters the probe step left without a gradient; they decide
    find_unused_parameters="auto" and are the ones freeze_unused freezes (undo with
    `unfreeze(model, names)`). Raises ValueError for an option this torch's DDP does not take.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    options = dict(DDP_DEFAULTS, **dict(options))
    unused = set(unused)
    freeze = bool(options.pop("freeze_unused"))
    hook = options.pop("comm_hook", None)
    if freeze and unused:
        for name, param in model.named_parameters():
            if name in unused:
                param.requires_grad_(False)
        unused = set()
    if options["find_unused_parameters"] == "auto":
        options["find_unused_parameters"] = bool(unused)
    bad = set(options) - _ddp_argument_names()
    if bad:
        raise ValueError(f"This torch's DistributedDataParallel takes no {', '.join(sorted(bad))}.")
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **options)
    if hook is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        wrapped.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
    return wrapped


def unfreeze(model: nn.Module, names: Iterable[str]) -> None:
    """Make the named parameters trainable again (after wrap_ddp's freeze_unused)."""
    names = set(names)
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(True)


class Stepper:
    """One optimisation step of `model` as a Trainer does it: autocast forward, backward, AdamW.

    Takes the model (bare, peft or DDP-wrapped; called as model(**batch).loss), the precision
    ("bf16"/"fp16" autocast, fp16 with a GradScaler; "fp32" none), the device, the optimizer
    (default: AdamW over the trainable parameters, fused on CUDA, lr 1e-4), and the number of
    micro-batches per optimisation step (gradient accumulation: DDP all-reduces on the last one
    only, as Trainer's gradient_accumulation_steps does; each micro-batch is the same batch).
    """

    def __init__(
        self,
        model: nn.Module,
        precision: str,
        device: torch.device,
        optimizer: torch.optim.Optimizer | None = None,
        lr: float = 1e-4,
        grad_accum: int = 1,
    ):
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be at least 1 (got {grad_accum}).")
        self.model = model
        self.grad_accum = grad_accum
        self.device = device
        self.dtype = PRECISIONS[precision] if precision != "fp32" else None
        params = [p for p in model.parameters() if p.requires_grad]
        if optimizer is None:
            optimizer = torch.optim.AdamW(params, lr=lr, fused=device.type == "cuda")
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, batch: dict[str, torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """Forward and backward only (gradients accumulate, the loss multiplied by `scale`);
        returns the detached, unscaled loss.
        """
        with self._autocast():
            loss = self.model(**batch).loss
        scaled = loss * scale if scale != 1.0 else loss
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return loss.detach()

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A full optimisation step over grad_accum micro-batches; returns the last detached loss."""
        for _ in range(self.grad_accum - 1):
            no_sync = getattr(self.model, "no_sync", contextlib.nullcontext)  # DDP: no all-reduce yet
            with no_sync():
                self.backward(batch, 1.0 / self.grad_accum)
        loss = self.backward(batch, 1.0 / self.grad_accum)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def probe(stepper: Stepper, batch: dict[str, torch.Tensor]) -> list[str]:
    """One forward and backward of the bare model (no optimizer step); returns the names of the
    trainable parameters that got no gradient (the unused ones DDP must be told about). Leaves
    every gradient cleared.
    """
    stepper.backward(batch)
    _sync(stepper.device)
    unused = [n for n, p in stepper.model.named_parameters() if p.requires_grad and p.grad is None]
    stepper.model.zero_grad(set_to_none=True)
    return unused


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(stepper: Stepper, batch: dict[str, torch.Tensor], steps: int) -> tuple[list[float], list[float]]:
    """Run `steps` optimisation steps; returns (seconds per step, loss per step). Each step ends
    with the device synchronised, so its time is the step's own.
    """
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = stepper.step(batch)
        losses.append(float(loss))
        _sync(stepper.device)
        times.append(time.perf_counter() - start)
    return times, losses


@contextlib.contextmanager
def gc_pauses() -> Iterator[dict[str, Any]]:
    """Python's garbage collections while the block runs: yields a dict that fills with the
    collections per generation ("collections"), their total and longest pause in milliseconds.
    A host-bound step pays for them in full, and under DDP a pause on one rank stalls the others.
    """
    found: dict[str, Any] = {"collections": [0, 0, 0], "total_ms": 0.0, "max_ms": 0.0}
    started: list[float] = []

    def on_collect(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pause = (time.perf_counter() - started.pop()) * 1000
            found["collections"][info["generation"]] += 1
            found["total_ms"] += pause
            found["max_ms"] = max(found["max_ms"], pause)

    gc.callbacks.append(on_collect)
    try:
        yield found
    finally:
        gc.callbacks.remove(on_collect)


def step_stats(times: list[float]) -> dict[str, float]:
    """Median, p10, p90, min, max, stdev (seconds) and spread = (p90 - p10) / median in percent."""
    ordered = sorted(times)

    def pct(q: float) -> float:
        pos = q * (len(ordered) - 1)
        low, high = math.floor(pos), math.ceil(pos)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    median = statistics.median(ordered)
    return {
        "median": median,
        "p10": pct(0.1),
        "p90": pct(0.9),
        "min": ordered[0],
        "max": ordered[-1],
        "stdev": statistics.stdev(ordered) if len(ordered) > 1 else 0.0,
        "spread_pct": 100.0 * (pct(0.9) - pct(0.1)) / median if median > 0 else 0.0,
    }


def peak_memory_gib(device: torch.device) -> dict[str, float] | None:
    """Peak allocated and reserved GiB on `device` since the last reset; None on CPU."""
    if device.type != "cuda":
        return None
    return {
        "allocated": torch.cuda.max_memory_allocated(device) / 2**30,
        "reserved": torch.cuda.max_memory_reserved(device) / 2**30,
    }


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def case_row(spec: LaunchSpec, case: Case, **fields: Any) -> dict:
    """A result row: what identifies the case (launch and case settings) followed by `fields`.
    Rows of cases that never ran (skipped, lost to a timeout) are built the same way.
    """
    return {
        "config": spec.config,
        "backend": spec.backend,
        "gpus": spec.gpus,
        "launcher": spec.launcher,
        "model": spec.model,
        "precision": case.precision,
        "seq_len": case.seq_len,
        "batch": case.batch,
        "image": spec.image,
        "ddp": ddp_label(dict(case.ddp)) if spec.gpus > 1 else "",
        "memory_cap_gib": spec.memory_cap_gib,
        "steps": spec.steps,
        "warmup": spec.warmup,
        "grad_accum": spec.grad_accum,
        **fields,
    }


def _describe(exc: BaseException) -> tuple[str, str, str]:
    """(status, one-line message, traceback tail) of a failed case."""
    oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
    first = (str(exc).strip().splitlines() or [""])[0]
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
    return ("oom" if oom else "error"), f"{type(exc).__name__}: {first}"[:400], tail


# ---------------------------------------------------------------------------------------------
# One launch: every case of a spec, on every rank
# ---------------------------------------------------------------------------------------------


class _Launch:
    """The state of run_launch on one rank."""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.device = setup_rank(spec.device, memory_cap_gib=spec.memory_cap_gib, timeout_s=spec.collective_timeout_s)
        self.first_step_s: float | None = None
        self.results: list[dict] = []

    # -- bookkeeping ------------------------------------------------------------------------
    def _row(self, case: Case, **fields: Any) -> dict:
        return case_row(self.spec, case, **fields)

    def _record(self, row: dict) -> None:
        self.results.append(row)
        if self.rank != 0:
            return
        with open(self.spec.results_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(_progress_line(row), flush=True)

    def _failed(self, case: Case, ok: bool, failure: tuple[str, str, str] | None, **fields: Any) -> dict:
        """The row of a case that failed on some rank: each failing rank's reason."""
        reasons = gather(None if ok else failure)
        failed = {r: f for r, f in enumerate(reasons) if f is not None}
        status = "oom" if any(f[0] == "oom" for f in failed.values()) else "error"
        first_rank, first = min(failed.items())
        return self._row(
            case,
            status=status,
            error=first[1],
            error_rank=first_rank,
            error_detail=first[2],
            failed_ranks=sorted(failed),
            **fields,
        )

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        spec = self.spec
        groups: dict[str, list[Case]] = {}
        for case in spec.cases:
            groups.setdefault(case.precision, []).append(case)
        for precision, cases in groups.items():
            model, load_s, failure = self._load(precision, max(c.seq_len for c in cases))
            if not agree(failure is None):
                for case in cases:  # the same load failure stands for every case of this precision
                    self._record(self._failed(case, failure is None, failure, phase="load", load_s=load_s))
                del model
                _reset_memory(self.device)
                continue
            runner = self._ladder if spec.ladder else self._each
            runner(model, cases, load_s)
            del model
            _reset_memory(self.device)
        return self.results

    def _load(self, precision: str, max_seq_len: int) -> tuple[nn.Module | None, float, tuple | None]:
        spec = self.spec
        start = time.perf_counter()
        try:
            model = build_model(
                spec.backend,
                spec.model_path,
                precision,
                self.device,
                lora_r=spec.lora_r,
                max_seq_len=max_seq_len,
                savers=spec.savers,
                unsloth_checkpointing=spec.unsloth_checkpointing,
                seed=spec.seed,
            )
            return model, time.perf_counter() - start, None
        except Exception as exc:  # recorded for every case of this precision; the launch goes on
            return None, time.perf_counter() - start, _describe(exc)

    def _each(self, model: nn.Module, cases: list[Case], load_s: float) -> None:
        for case in cases:
            self._record(self._case(model, case, load_s))

    def _ladder(self, model: nn.Module, cases: list[Case], load_s: float) -> None:
        """Ascending lengths until the first failure, then bisect between the last success and it."""
        cases = sorted(cases, key=lambda c: c.seq_len)
        longest, shortest_failed = 0, None
        for case in cases:
            row = self._case(model, case, load_s)
            self._record(row)
            if row["status"] != "ok":
                shortest_failed = case.seq_len
                break
            longest = case.seq_len
        template = cases[0]
        for _ in range(self.spec.ladder_bisect if shortest_failed is not None else 0):
            middle = (longest + shortest_failed) // 2 // 4096 * 4096
            if middle <= longest or middle >= shortest_failed:
                break
            row = self._case(model, replace(template, seq_len=middle), load_s)
            self._record(row)
            if row["status"] == "ok":
                longest = middle
            else:
                shortest_failed = middle

    def _case(self, model: nn.Module, case: Case, load_s: float) -> dict:
        """Probe step (bare model), agreement, DDP warm-up and timed steps, optional profile."""
        spec, device = self.spec, self.device
        model.zero_grad(set_to_none=True)  # nothing left over from a case that failed half-way
        _reset_memory(device)
        failure, unused, batch = None, [], None
        try:
            batch = synthetic_batch(
                model.config, case.seq_len, case.batch, device, image=spec.image, seed=spec.seed * 1000 + self.rank
            )
            unused = probe(Stepper(model, case.precision, device), batch)
        except Exception as exc:
            failure = _describe(exc)
        if self.first_step_s is None and failure is None and spec.launched_at:
            self.first_step_s = time.time() - spec.launched_at
        timing = dict(load_s=load_s, launch_to_first_step_s=self.first_step_s)
        if not agree(failure is None):
            batch = None
            return self._failed(case, failure is None, failure, phase="probe", **timing)

        wrapped: nn.Module = model
        stepper: Stepper | None = None
        figures: dict[str, Any] = {}
        try:
            wrapped = wrap_ddp(model, device, case.ddp, unused=unused)
            stepper = Stepper(wrapped, case.precision, device, grad_accum=spec.grad_accum)
            timed_steps(stepper, batch, max(0, spec.warmup - 1))
            with gc_pauses() as pauses:
                times, losses = timed_steps(stepper, batch, spec.steps)
            figures = self._figures(case, times, losses, unused)
            figures["gc"] = {**pauses, "ms_per_step": pauses["total_ms"] / spec.steps}  # per optimisation step
            if spec.profile_dir:
                figures["profile"] = _profile(stepper, batch, spec, case, self.rank)
        except Exception as exc:
            failure = _describe(exc)
        finally:
            unfreeze(model, unused)  # also when wrap_ddp froze them and then failed
            stepper = wrapped = None
        ok = agree(failure is None)
        memory = gather(peak_memory_gib(device))
        gc_by_rank = gather(figures.get("gc"))
        if not ok:
            return self._failed(case, failure is None, failure, phase="train", **timing)
        # The slowest rank sets the pace of a DDP step, so its garbage collections are the ones that count.
        figures["gc"] = {
            "ms_per_step": max(p["ms_per_step"] for p in gc_by_rank),
            "per_rank": [{k: p[k] for k in ("collections", "total_ms", "max_ms", "ms_per_step")} for p in gc_by_rank],
        }
        if memory[0] is not None:
            figures["peak_allocated_gib"] = [m["allocated"] for m in memory]
            figures["peak_reserved_gib"] = [m["reserved"] for m in memory]
        return self._row(case, status="ok", **timing, **figures)

    def _figures(self, case: Case, times: list[float], losses: list[float], unused: list[str]) -> dict:
        stats = step_stats(times)
        tokens = case.tokens * self.spec.grad_accum  # per rank per optimisation step
        per_gpu = tokens / stats["median"]
        return {
            "step_time_s": stats,
            "step_times_s": times,
            "tokens_per_step": tokens * self.world,
            "tokens_per_s_per_gpu": per_gpu,
            "tokens_per_s_total": per_gpu * self.world,
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "loss_finite": all(map(math.isfinite, losses)),
            "unused_trainable_params": len(unused),
        }


def run_launch(spec: LaunchSpec) -> list[dict]:
    """The per-rank job of one benchmark launch; returns this rank's result rows.

    Runs every case of `spec` (see LaunchSpec and the module docstring), rank 0 appending one JSON
    line per case to spec.results_path and printing one progress line. Case failures are rows
    with status "oom" or "error" and the reason; the launch carries on. Tears the process group
    down at the end. Raises only for failures outside any case (the rank set-up itself).
    """
    launch = _Launch(spec)
    try:
        return launch.run()
    finally:
        teardown_rank()


def _progress_line(row: dict) -> str:
    head = f"[{row['config']}] {row['precision']} {row['seq_len']}x{row['batch']}"
    if row.get("ddp"):
        head += f" [{row['ddp']}]"
    if row["status"] != "ok":
        return f"{head}: {row['status'].upper()} ({row.get('phase', '')}) {row.get('error', '')}"
    stats = row["step_time_s"]
    memory = row.get("peak_allocated_gib")
    mem = f", peak {max(memory):.2f} GiB/GPU" if memory else ""
    first = row.get("launch_to_first_step_s")
    first_text = f", first step {first:.1f} s after launch" if first is not None else ""
    gc_text = f", Python GC {row['gc']['ms_per_step']:.1f} ms/step" if "gc" in row else ""
    return (
        f"{head}: {stats['median']:.3f} s/step (spread {stats['spread_pct']:.1f}%), "
        f"{row['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, {row['tokens_per_s_total']:,.0f} total{mem}{first_text}"
        f"{gc_text}"
    )


# ---------------------------------------------------------------------------------------------
# Profiling
# ---------------------------------------------------------------------------------------------

# Host calls that block the CPU until the GPU catches up: each one drains the launch queue.
_HOST_SYNCS = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"})


def _profile(stepper: Stepper, batch: dict[str, torch.Tensor], spec: LaunchSpec, case: Case, rank: int) -> dict:
    """Profile spec.profile_steps more steps on every rank; rank 0 writes the tables and trace.

    Returns, per step and for this rank: the wall time under the profiler ("step_ms"); on GPUs the
    milliseconds of GPU kernels by kind ("nccl", "memcpy", "compute"), so NCCL time against compute
    and idle GPU time can be read off; "host_ops_ms_per_step", the self CPU time of every torch op
    and CUDA runtime call summed over all threads (the main thread and autograd's, so it is not a
    wall time; profiler annotations such as DistributedDataParallel.forward are left out, as their
    children are counted); "host_syncs_per_step", the calls that block the CPU until the GPU catches
    up, the harness's own one synchronisation per step included. The written file lists the ops by
    device time (on GPUs) and by self CPU time.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if stepper.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(spec.profile_steps):
            stepper.step(batch)
            _sync(stepper.device)
    wall_ms = (time.perf_counter() - start) * 1000 / spec.profile_steps
    averages = prof.key_averages()
    summary: dict[str, Any] = {"step_ms": wall_ms}
    if stepper.device.type == "cuda":
        kinds = {"nccl": 0.0, "memcpy": 0.0, "compute": 0.0}
        for event in averages:
            # Annotations ("DistributedDataParallel.forward", "nccl:all_reduce", "record_param_comms")
            # span kernels that are counted on their own: counting them too would double the time.
            if getattr(event, "device_type", None) != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
                continue
            name = event.key.lower()
            kind = "nccl" if "nccl" in name else "memcpy" if name.startswith(("memcpy", "memset")) else "compute"
            kinds[kind] += _device_us(event) / 1000
        summary.update({f"{k}_ms_per_step": v / spec.profile_steps for k, v in kinds.items()})
        summary["compute_busy_pct"] = 100 * summary["compute_ms_per_step"] / wall_ms if wall_ms else 0.0
    # A step whose kernels take less than its wall time is bound by the host: the CPU side says where.
    host_events = [
        e
        for e in averages
        if getattr(e, "device_type", None) != DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    summary["host_ops_ms_per_step"] = sum(e.self_cpu_time_total for e in host_events) / 1000 / spec.profile_steps
    summary["host_syncs_per_step"] = sum(e.count for e in host_events if e.key in _HOST_SYNCS) / spec.profile_steps
    if rank == 0:
        out = Path(spec.profile_dir)
        out.mkdir(parents=True, exist_ok=True)
        slug = f"{spec.config}_{case.label()}".replace(":", "-").replace("@", "-").replace(" ", "_")
        slug = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in slug)
        sort = "self_cpu_time_total"
        if stepper.device.type == "cuda":  # torch < 2.4 named device times after CUDA
            sort = (
                "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
            )
        lines = [
            f"{spec.config} {case.label()}: {spec.profile_steps} steps, rank 0",
            json.dumps(summary, indent=1),
            f"By {sort}:",
            averages.table(sort_by=sort, row_limit=30),
        ]
        if sort != "self_cpu_time_total":
            lines += ["By self_cpu_time_total:", averages.table(sort_by="self_cpu_time_total", row_limit=30)]
        (out / f"{slug}.txt").write_text("\n".join(lines) + "\n")
        prof.export_chrome_trace(str(out / f"{slug}.trace.json.gz"))
        summary["files"] = [f"{slug}.txt", f"{slug}.trace.json.gz"]
    return summary


def _device_us(event: Any) -> float:
    """An event's own device time in microseconds, under the name this torch uses."""
    value = getattr(event, "self_device_time_total", None)
    return getattr(event, "self_cuda_time_total", 0.0) if value is None else value


# ---------------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """GPU model/count/memory, driver, CUDA, library versions, date and host, without creating a
    CUDA context (safe in the process that launches).
    """
    from nbkit.distributed import visible_gpus

    gpus = visible_gpus()
    driver = None
    exe = shutil.which("nvidia-smi")
    if exe is not None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            driver = (
                subprocess.run(
                    [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[0]
            )
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "gpu": gpus[0].name if gpus else None,
        "gpu_count": len(gpus),
        "gpu_memory_gib": round(gpus[0].memory_gib, 1) if gpus else None,
        "driver": driver,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "versions": {
            p: _version(p)
            for p in (
                "torch",
                "transformers",
                "peft",
                "accelerate",
                "unsloth",
                "unsloth_zoo",
                "trl",
                "bitsandbytes",
                "nbkit",
            )
        },
        "argv": sys.argv,
    }
