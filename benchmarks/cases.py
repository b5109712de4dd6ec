"""What one benchmark launch runs: its LaunchSpec, its Cases, their DDP options, and a result row's identity.

Backends (LoRA r=16 on all linear layers, alpha = r, no dropout, in every case; built in
benchmarks/models.py): "unsloth", "nbkit" (transformers + peft with nbkit.savers.apply) and
"plain" (transformers + peft with transformers' non-reentrant gradient checkpointing).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

BACKENDS = ("unsloth", "nbkit", "plain")


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


#   freeze_unused (default True): freeze the trainable parameters the probe step found without a
#     gradient (a VLM's LoRA'd vision tower on a text-only batch), as a user who trains only what
#     the data uses would (finetune_vision_layers=False); their gradient is None either way. Under
#     nbkit, unsloth's vision models checkpoint reentrantly in DDP and need this (or an image).
#   find_unused_parameters="auto": True exactly when unused parameters are left (freeze_unused=false),
#     as transformers' Trainer would search for them; any DDP argument can be given too.
#   comm_hook: "bf16" / "fp16" gradient compression (torch's default hooks), as unsloth installs.
#   reducer=flat: no DistributedDataParallel; the gradients are averaged by one all-reduce of one flat buffer
#     after the step's last backward (benchmarks.stepping.FlatGradients), which takes no other DDP argument.
DDP_DEFAULTS: dict[str, Any] = {"find_unused_parameters": "auto", "freeze_unused": True}


_DDP_KNOBS = ("freeze_unused", "comm_hook", "reducer")


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


def ddp_argument_names() -> set[str]:
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
    static_graph, find_unused_parameters (also "auto"), broadcast_buffers, ...), plus freeze_unused,
    comm_hook ("bf16" / "fp16" / none) and reducer ("flat", alone or with freeze_unused). Raises ValueError naming
    the valid keys otherwise.
    """
    options = dict(DDP_DEFAULTS)
    allowed = ddp_argument_names() | set(_DDP_KNOBS)
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
    if options.get("reducer") not in (None, "flat"):
        raise ValueError(f"reducer={options['reducer']!r}: use flat (leave it out for DDP's reducer).")
    ddp_only = set(options) - set(DDP_DEFAULTS) - {"reducer"}
    if options.get("reducer") == "flat" and ddp_only:
        raise ValueError(
            f"reducer=flat replaces DistributedDataParallel, which {', '.join(sorted(ddp_only))} configure."
        )
    return tuple(sorted(options.items()))


def ddp_label(options: dict[str, Any]) -> str:
    """The options that differ from the defaults, as "key=value,..." ("" for the defaults)."""
    return ",".join(f"{k}={v}" for k, v in sorted(options.items()) if DDP_DEFAULTS.get(k) != v)


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
