"""The strategy planner: will LoRA training of this model fit, with DDP or split over the GPUs?

`plan(model, gpus=2, gpu_memory_gib=15)` reads the model's config only (the model is built on the
meta device, so no weights are downloaded or allocated), counts its parameters exactly, estimates
the peak GPU memory of LoRA training with nbkit's default memory savers, and picks a strategy:
"ddp" (a full copy per GPU), "fsdp" (the model sharded over the GPUs, every GPU training its own
batches: nbkit.fsdp), "model_parallel" (one process, the model split over the GPUs, which take
turns) or "does_not_fit". `str(plan)` says why, with the numbers and what to change.

What the estimate assumes (the setup of benchmarks/planner_accuracy.py, which measures it):
- weights in 16-bit (2 bytes; modules transformers keeps in fp32 at 4), or 4-bit NF4 for every
  nn.Linear except the output embedding (bitsandbytes' default);
- LoRA of rank r on the language model's q/k/v/o/gate/up/down projections (LORA_TARGET_MODULES;
  vision towers are left out), adapters in fp32 with their gradients and AdamW's two states;
- mixed precision (autocast to 16-bit, as Trainer does with fp16/bf16=True), SDPA attention without
  a padding mask (flash / memory-efficient kernels), batch of equal-length sequences;
- nbkit.savers' defaults: per-layer checkpointing ("offload": layer inputs in host memory;
  "recompute": layer inputs on the GPU; None: no checkpointing, which also needs the Trainer's own
  checkpointing off: TRL's SFTConfig turns it on by default, and it then recomputes every layer that has
  no checkpoint of nbkit's), the tiled MLP, and the chunked loss (no full logits).
Under FSDP (nbkit.fsdp's set-up: accelerate's FSDP2, full sharding, activation checkpointing) a rank
holds 1/N of the weights and of the LoRA weights, gradients and AdamW states, plus the gathered full
weights of FSDP_GATHERED_LAYERS layers (computing, prefetched, and FSDP2's all-gather buffer), and during
the loss the output embedding twice (gathered, and the buffer FSDP2 keeps until its next all-gather) beside
one layer; in 4-bit
the packed weights are sharded but their quantisation state is on every rank. Its activations are
those of its own batch, with layer inputs kept on the GPU ("recompute"; None: no checkpointing). In
4-bit a rank first loads and quantises the whole model on its own GPU and shards it only afterwards
(`Plan.fsdp_load_gib`: the quantised model and then the fp32 LoRA weights; the "fsdp" patch group frees
each loaded layer as its shard is made, so no rank holds the model and its shards at once), so "fsdp"
also needs that copy to fit one GPU (16-bit weights load in CPU memory). A run's peak is the larger of
the two; the FSDP figures are checked against peaks measured on 2 and 4 GPUs, with what was live at each
(benchmarks/RESULTS.md, "FSDP-QLoRA").
The per-token byte counts below come from recording every tensor autograd saves (saved_tensors_hooks,
unique storages) on CPU in decoder layers with peft LoRA under bf16 autocast: for Qwen3-VL-2B's
shapes, 112 KiB per token per layer without the tiled MLP (tests/test_planner.py checks the formula
against such a measurement). What the backward allocates on top, the loss chunk and the CUDA
figures are estimates to be checked on a GPU with benchmarks/planner_accuracy.py.

The per-GPU batch (`Plan.recommended_batch_size`, `Plan.batch_reason`): a training step has a fixed
host cost (Python, kernel launches, DDP's bookkeeping) that does not grow with its tokens, and GPU
work that does. Measured on H200s (benchmarks/RESULTS.md, Qwen3-VL-2B shapes, LoRA): about 70 ms per
step plus 20 us per token, so 1K x 4 (4,096 tokens) is half host work and scales 1.3-1.6x on 2 GPUs,
while 1K x 16 scales 1.94x and 16K x 1 1.97x. The planner therefore asks for enough tokens per GPU
per step that the host cost is at most a fifth of the step, scaling the measured figures by the
model's size, its layer count and the GPU's 16-bit tensor throughput, and takes the largest batch
up to that which still fits in memory. On a T4 (65 TFLOP/s, 1/15 of an H200) a 1K x 4 step is
already about 1.25 s of GPU work against about 0.07 s of host work (the H200 host's figure; Kaggle's CPUs
are slower, which was not measured): GPU-bound, so the asked batch stays. Where the processes train on
CPU cores (`gpu="cpu"`: no GPU to keep busy) the asked batch stays too.

`Plan.batch_settings(effective_batch)` turns the recommendation into Trainer's two arguments,
per_device_train_batch_size and gradient_accumulation_steps, keeping the examples per optimizer step
the user asked for (or, with None, training at the recommended batch without accumulation), and
says in one line what it chose and why.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any

from nbkit.platform import distributed, notices
from nbkit.training import emulation
from nbkit.training.offline import load_config

__all__ = ["LORA_TARGET_MODULES", "STRATEGIES", "BatchSettings", "Plan", "plan"]

STRATEGIES = ("ddp", "fsdp", "model_parallel", "does_not_fit")
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

GIB = 2**30
# Bytes per weight of bitsandbytes NF4: half a byte plus one fp32 absmax per 64-weight block
# (double quantisation, unsloth's default, stores less: this is the upper bound).
NF4_BYTES_PER_WEIGHT = 0.5 + 4 / 64
# LoRA adapters: fp32 weight + fp32 gradient + AdamW exp_avg and exp_avg_sq, plus the 16-bit copy
# that autocast caches for the whole forward (and the backward keeps).
LORA_BYTES_PER_PARAM = 4 + 4 + 8 + 2
# DDP keeps a flat fp32 copy of the trainable gradients in its communication buckets.
DDP_BUCKET_BYTES_PER_PARAM = 4
# Layer inputs of the offloaded checkpointing alive on the GPU at once: the one being copied out
# (forward) or in (backward), plus the prefetched next one.
OFFLOAD_LAYER_INPUTS_ON_GPU = 2
# A typical image for the vision tower's forward (a 512x512 image at patch size 16 = 1024 patches),
# and the bytes per patch per vision hidden unit its frozen forward holds at once (one block's
# temporaries: the residual stream, qkv, attention output and the 4x MLP).
VISION_PATCHES = 1024
VISION_WORKING_BYTES_PER_HIDDEN = 2 * (1 + 3 + 1 + 2 * 4)
# CUDA context, cuBLAS/cuDNN handles and kernels: memory that torch's allocator never reports.
CUDA_CONTEXT_GIB = 0.5
# The caching allocator reserves more than it hands out (fragmentation, rounding).
ALLOCATOR_SLACK = 0.08
# Headroom kept free on each GPU before calling a plan a fit.
SAFETY_MARGIN = 0.05
# transformers loads a bitsandbytes model with device_map="balanced" into 90% of each GPU's budget (its quantiser
# keeps the rest for buffers made while quantising), which shifts layers onto the last GPU.
BNB_MAX_MEMORY_FRACTION = 0.90
# FSDP gathers one transformer layer's full weights for its forward/backward and prefetches the next one
# (nbkit.fsdp names it in the forward; the backward does so by itself), and FSDP2 receives each all-gather
# into one flat buffer that it then copies out into the layer's weights: while the next layer lands, three
# layers' worth on top of the rank's shard.
FSDP_GATHERED_LAYERS = 3
# NF4 under FSDP (nbkit.fsdp.qlora_config: double quantisation, packed weights stored in a 16-bit dtype):
# the packed half byte per weight is a parameter and is sharded; the quantisation state (one uint8 absmax
# per 64-weight block, one fp32 scale per 256 blocks) is not a parameter, so every rank keeps all of it.
NF4_PACKED_BYTES_PER_WEIGHT = 0.5
NF4_DOUBLE_QUANT_STATE_BYTES_PER_WEIGHT = 1 / 64 + 4 / (64 * 256)
# The per-step cost measured on an H200 host (benchmarks/RESULTS.md, "1K x 4 taken apart": unsloth,
# Qwen3-VL-2B shapes, LoRA r=16, bf16; 1K x 4 in 0.145-0.156 s, 1K x 16 in 0.394 s): a fixed host
# part per step, about proportional to the decoder layers (kernel launches), and GPU work per token,
# about proportional to the parameters and inversely to the GPU's 16-bit tensor throughput.
MEASURED_HOST_S_PER_LAYER = 0.070 / 28
MEASURED_GPU_S_PER_TOKEN = 20e-6
MEASURED_PARAMETERS = 2.13e9  # Qwen3-VL-2B, vision tower included
MEASURED_TFLOPS = 989.0  # H200 / H100 SXM dense bf16, spec sheet
# Dense 16-bit tensor-core TFLOP/s from the vendors' spec sheets, by a part of the GPU's name.
GPU_TFLOPS = {"T4": 65.0, "L4": 121.0, "A100": 312.0, "H100": 989.0}
GPU_TFLOPS["H200"] = GPU_TFLOPS["GH200"] = 989.0
# The host part may be at most 1 / HOST_SHARE_FACTOR of the step: 1/5 (1K x 16 on an H200: 70 ms of
# 394 ms, 2 GPUs scale 1.94x; 1K x 4: 70 of 150 ms, 1.3-1.6x).
HOST_SHARE_FACTOR = 5
# Largest per-GPU batch the planner recommends (beyond it memory, not scaling, is the question).
MAX_RECOMMENDED_BATCH = 64


@dataclass(frozen=True)
class BatchSettings:
    """Trainer's batch arguments from a plan (Plan.batch_settings), and why.

    per_device_train_batch_size, gradient_accumulation_steps: the arguments of TrainingArguments /
    SFTConfig of the same names (`trainer_args` holds both, for SFTConfig(**settings.trainer_args)).
    processes: the data-parallel training processes the effective batch is spread over.
    unit: what one process trains on, for the text ("GPU", or "process" on CPU cores and in model parallel).
    reason: what was chosen and why, in a sentence or two. str() is one line with the numbers and the reason.
    """

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    processes: int
    unit: str
    reason: str

    @property
    def effective_batch(self) -> int:
        """Examples per optimizer step over all processes."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.processes

    @property
    def trainer_args(self) -> dict[str, int]:
        """{"per_device_train_batch_size": ..., "gradient_accumulation_steps": ...} for TrainingArguments."""
        return {
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }

    def __str__(self) -> str:
        steps = self.gradient_accumulation_steps
        parts = [f"{self.per_device_train_batch_size} per {self.unit}"]
        if steps > 1:
            parts.append(f"{steps} accumulation steps")
        if self.processes > 1:
            parts.append(f"{self.processes} {self.unit}s" if self.unit == "GPU" else f"{self.processes} processes")
        accumulation = "" if steps > 1 else ", no gradient accumulation"
        return (
            f"Trainer: {' x '.join(parts)} = {self.effective_batch} examples per optimizer step{accumulation}. "
            f"{self.reason}"
        )


@dataclass(frozen=True)
class Plan:
    """The planner's answer for one model on one machine.

    strategy: "ddp" | "fsdp" | "model_parallel" | "does_not_fit" (in that order of preference: the first
        that fits).
    per_gpu_gib: peak memory per GPU with DDP (a full copy on each), CUDA overhead included.
    breakdown: GiB per GPU with DDP: "weights", "lora" (LoRA weights + grads + AdamW states, and
        DDP's gradient buckets), "activations" (checkpoints kept on the GPU plus one layer's
        recomputation and backward), "logits" (what the chunked loss adds on top of that peak),
        "overhead" (CUDA context and allocator slack). The entries sum to per_gpu_gib.
    model_parallel_gib: peak per GPU with the model split over `gpus` GPUs in one process.
    fsdp_gib, fsdp_breakdown: peak per GPU (per rank) with the model sharded over `gpus` ranks by FSDP,
        and its parts, keyed as `breakdown` ("weights" is the rank's shard plus the gathered layers);
        for gpus=1, FSDP in one process (nothing sharded, the same gathering).
    fsdp_load_gib: in 4-bit, the peak per GPU while an FSDP rank loads: it quantises the whole model on
        its own GPU and shards it only afterwards (nbkit.fsdp.device_map), or, where that would not fit
        (fsdp_host_load), keeps each quantised weight's rows of its shard in CPU memory as it is made.
        None in 16-bit, where the weights load in CPU memory.
    fsdp_host_load: in 4-bit, whether FSDP ranks load that way (nbkit.fsdp.load_4bit_on_host, which the
        guard uses where this is True); the ranks of a host then hold about the packed 4-bit model in
        CPU memory together until it is sharded.
    fsdp_offload: whether FSDP fits only with its shards, their gradients and the optimizer's state kept in
        CPU memory (FSDP2's CPU offload, which the guard then turns on: FSDP_OFFLOAD_PARAMS), where neither
        FSDP without it nor the split fits (4-bit weights only); fsdp_gib is then with it. Each step then moves
        every layer's weights to the GPU over PCIe.
    fsdp_host_gib: the CPU memory the ranks of a machine hold together while loading on the host (the packed
        4-bit weights) or training with offload (every shard, LoRA's fp32 weights and their gradients in pinned
        memory, which torch rounds up to a power of two per allocation, and AdamW's state), else 0. The ranks'
        own processes come on top.
    usable_gib: the memory a plan may use per GPU (gpu_memory_gib minus a safety margin).
    recommended_batch_size: the per-GPU batch (Trainer's per_device_train_batch_size) of seq_len
        sequences that keeps the GPU, not the host, the bound of each step and fits in memory;
        batch_reason says why, with the figures. The memory figures above are for batch_size.
        batch_settings(effective_batch) turns it into Trainer's arguments.
    gpu: the GPU model planned for ("T4", "H200", ...), "cpu" for processes training on CPU cores,
        None when unknown.
    host_seconds_per_step, gpu_seconds_per_token: the fixed host time of a step and the GPU time per
        token the recommendation was computed from (None where it used none: gpu="cpu", or a strategy
        other than "ddp").
    peak_allocated_gib: per_gpu_gib without the overhead, comparable to torch.cuda.max_memory_allocated.
    """

    model: str
    strategy: str
    gpus: int
    gpu_memory_gib: float
    seq_len: int
    batch_size: int
    load_in_4bit: bool
    lora_rank: int
    checkpointing: str | None
    parameters: int
    lora_parameters: int
    lora_modules: tuple[str, ...]
    breakdown: dict[str, float]
    per_gpu_gib: float
    model_parallel_gib: float
    usable_gib: float
    advice: tuple[str, ...] = field(default=())
    recommended_batch_size: int = 1
    batch_reason: str = ""
    gpu: str | None = None
    host_seconds_per_step: float | None = None
    gpu_seconds_per_token: float | None = None
    fsdp_gib: float | None = None
    fsdp_breakdown: dict[str, float] = field(default_factory=dict)
    fsdp_load_gib: float | None = None
    fsdp_host_load: bool = False
    fsdp_offload: bool = False
    fsdp_host_gib: float = 0.0

    @property
    def peak_allocated_gib(self) -> float:
        """Peak memory torch allocates per GPU (per_gpu_gib without the CUDA context and allocator overhead)."""
        return self.per_gpu_gib - self.breakdown["overhead"]

    def host_share(self, batch_size: int) -> float | None:
        """The fraction of a step of batch_size x seq_len tokens per GPU that is fixed host work, by the
        figures the recommendation used; None where it used none (gpu="cpu", a strategy other than "ddp").
        """
        if self.host_seconds_per_step is None or self.gpu_seconds_per_token is None:
            return None
        gpu_s = self.gpu_seconds_per_token * self.seq_len * batch_size
        return self.host_seconds_per_step / (self.host_seconds_per_step + gpu_s)

    def batch_settings(self, effective_batch: int | None = None) -> BatchSettings:
        """Trainer's per_device_train_batch_size and gradient_accumulation_steps for this plan.

        Takes effective_batch: the examples per optimizer step over all data-parallel processes
        (per_device_train_batch_size x gradient_accumulation_steps x processes, where the processes are
        the plan's GPUs, except for "model_parallel": one process drives them all). A number is kept
        exactly: the per-process batch is the largest divisor of effective_batch / processes up to
        recommended_batch_size, and gradient accumulation makes up the rest; where that is below the
        recommendation, the reason says which effective batch would reach it. None trains at
        recommended_batch_size without accumulation, so the effective batch is recommended_batch_size x
        processes; the reason says so where that is more than the asked batch_size.

        Returns a BatchSettings: the two arguments (`trainer_args`, for SFTConfig(**...)), the processes,
        the effective batch and the reason in a sentence or two (its str(): all of that in one line).
        Raises ValueError when effective_batch is not a whole number above 0 or not a multiple of the
        processes (each takes the same number of examples per step). Runs anywhere (CPU, any rank);
        never touches CUDA.
        """
        processes = 1 if self.strategy == "model_parallel" else self.gpus
        unit = "process" if self.strategy == "model_parallel" or _is_cpu(self.gpu) else "GPU"
        recommended = self.recommended_batch_size
        if effective_batch is None:
            per_device, accumulation = recommended, 1
        else:
            if isinstance(effective_batch, bool) or not isinstance(effective_batch, int) or effective_batch < 1:
                raise ValueError(
                    f"effective_batch must be a whole number of examples per optimizer step above 0, "
                    f"not {effective_batch!r}."
                )
            if effective_batch % processes:
                lower = effective_batch // processes * processes
                options = " or ".join(str(n) for n in (lower, lower + processes) if n > 0)
                raise ValueError(
                    f"effective_batch={effective_batch} is not a multiple of the {processes} training processes: "
                    f"each takes the same number of examples per optimizer step. Use {options}."
                )
            share = effective_batch // processes
            per_device = max(d for d in range(1, min(share, recommended) + 1) if share % d == 0)
            accumulation = share // per_device
        reason = self._settings_reason(per_device, processes, unit, effective_batch)
        return BatchSettings(per_device, accumulation, processes, unit, reason)

    def _settings_reason(self, per_device: int, processes: int, unit: str, effective_batch: int | None) -> str:
        """Why batch_settings chose per_device (see there), in a sentence or two."""
        recommended, asked = self.recommended_batch_size, self.batch_size
        if self.strategy == "does_not_fit":
            why = (
                f"The plan says this does not fit (about {self.per_gpu_gib:.1f} GiB per GPU, "
                f"{self.usable_gib:.1f} usable): expect to run out of memory; str(plan) says what would fit."
            )
        elif self.strategy == "model_parallel":
            why = f"One process drives the {self.gpus} GPUs the model is split over: the batch is a question of memory."
        elif _is_cpu(self.gpu):
            why = (
                f"The processes train on CPU cores: no GPU waits for the host, so at most the asked {asked} per {unit}."
            )
        elif self.host_share(per_device) is None:  # a Plan made by hand, without the figures
            why = f"{recommended} per {unit} is the plan's recommendation."
        elif per_device == recommended > asked:
            why = (
                f"Raised from the asked {asked} per {unit}: {self._host_words(asked)}, at {per_device} it is "
                f"{self.host_share(per_device):.0%}."
            )
        else:
            words = self._host_words(per_device)
            why = words[0].upper() + words[1:]
            if (self.host_share(per_device) or 0.0) <= 1 / HOST_SHARE_FACTOR:
                why += ": the GPU bounds it."
            elif per_device == recommended:
                limit = "the planner's cap" if recommended == MAX_RECOMMENDED_BATCH else "what fits in memory"
                why += f", but more per {unit} exceeds {limit}: DDP scales below the GPU count."
            else:
                why += "."
        if effective_batch is None:
            if per_device > asked:
                why += f" Set effective_batch to choose the examples per step ({asked * processes} keeps the asked)."
            return why
        share = effective_batch // processes
        if per_device < recommended and share < recommended:
            why += (
                f" effective_batch={effective_batch} leaves {share} per {unit}, below the planner's {recommended}: "
                f"effective_batch={recommended * processes} would train at {recommended}."
            )
        elif per_device < recommended:
            lower = share // recommended * recommended * processes
            why += (
                f" The planner's {recommended} per {unit} does not divide the {share} per {unit} of "
                f"effective_batch={effective_batch}, {per_device} is the largest that does: effective_batch={lower} or "
                f"{lower + recommended * processes} would train at {recommended}."
            )
        return why

    def _host_words(self, batch_size: int) -> str:
        gpu = self.gpu or "an H100/H200-class GPU (model unknown)"
        return (
            f"at {batch_size} x {self.seq_len} tokens the host is {self.host_share(batch_size):.0%} of a step on {gpu}"
        )

    def __str__(self) -> str:
        b = self.breakdown
        weights = "4-bit" if self.load_in_4bit else "16-bit"
        lines = [
            f"{self.model}: {self.parameters / 1e9:.2f}B parameters ({weights}), LoRA r={self.lora_rank} on "
            f"{', '.join(self.lora_modules)} ({self.lora_parameters / 1e6:.1f}M trainable), "
            f"{self.batch_size} x {self.seq_len} tokens per GPU, checkpointing={self.checkpointing!r}.",
            f"With DDP each GPU needs about {self.per_gpu_gib:.1f} GiB: weights {b['weights']:.2f}, LoRA + grads "
            f"+ AdamW {b['lora']:.2f}, activations {b['activations']:.2f}, logits/loss {b['logits']:.2f}, "
            f"CUDA overhead {b['overhead']:.2f}.",
            f"Each of the {self.gpus} GPU(s) has {self.gpu_memory_gib:.1f} GiB ({self.usable_gib:.1f} usable).",
        ]
        if self.fsdp_gib is not None and self.gpus > 1:
            f = self.fsdp_breakdown
            lines.append(
                f"With FSDP over the {self.gpus} GPUs each rank needs about {self.fsdp_gib:.1f} GiB: weights (its "
                f"shard + the gathered layers) {f['weights']:.2f}, LoRA + grads + AdamW {f['lora']:.2f}, activations "
                f"{f['activations']:.2f}, logits/loss {f['logits']:.2f}, CUDA overhead {f['overhead']:.2f}."
            )
            if self.fsdp_host_load:
                lines.append(
                    "The whole model in 4-bit would not fit one GPU while it loads, so each FSDP rank keeps its share "
                    "of the quantised weights in CPU memory until they are sharded (about "
                    f"{self.fsdp_load_gib or 0:.1f} GiB per GPU while loading"
                    + (
                        ")."
                        if self.fsdp_offload  # the offload's sentence gives the CPU memory, its larger figure
                        else f"; the ranks of a machine hold about {self.fsdp_host_gib:.1f} GiB of CPU memory "
                        "together)."
                    )
                )
        if self.fsdp_offload:
            lines.append(
                "That is with FSDP's CPU offload: the shards, their gradients and the optimizer's state stay in CPU "
                f"memory (the ranks of a machine hold the whole model there together, about {self.fsdp_host_gib:.1f} "
                "GiB, most of it pinned, which torch rounds up to a power of two per shard) and each layer's weights "
                "cross to the GPU in every forward and backward, since neither FSDP without it nor the split fits."
            )
        if self.strategy == "ddp":
            lines.append(
                "Strategy: ddp. A full copy fits on one GPU, so DDP (a live set, %%ddp or nbkit.launch) trains one "
                f"copy per GPU ({self.gpus} x the batches per step); load with device_map=None."
            )
        elif self.strategy == "fsdp":
            lines.append(
                f"Strategy: fsdp. A full copy does not fit on one GPU, but sharded over the {self.gpus} GPUs it does, "
                "and every GPU trains its own batches: start the ranks with the fsdp strategy (a live set or "
                "nbkit.launch with NBKIT_STRATEGY=fsdp), load without a device_map (4-bit: "
                "quantization_config=nbkit.fsdp.qlora_config()), transformers + peft (unsloth has no FSDP)."
            )
        elif self.strategy == "model_parallel":
            lines.append(
                f"Strategy: model_parallel. A full copy does not fit on one GPU, but split over {self.gpus} GPUs "
                f"it needs about {self.model_parallel_gib:.1f} GiB per GPU: load with device_map='balanced' "
                "in the notebook itself (one process, not nbkit.launch); the GPUs then take turns."
            )
        else:
            lines.append(
                f"Strategy: does_not_fit. Even split over {self.gpus} GPU(s) it needs about "
                f"{self.model_parallel_gib:.1f} GiB per GPU."
            )
        lines.extend(self.advice)
        if self.batch_reason:
            unit = "process" if _is_cpu(self.gpu) else "GPU"
            lines.append(f"Batch: {self.recommended_batch_size} per {unit}. {self.batch_reason}")
        return "\n".join(lines)


def plan(
    model: Any,
    *,
    gpus: int | None = None,
    gpu_memory_gib: float | None = None,
    seq_len: int = 2048,
    batch_size: int = 1,
    load_in_4bit: bool = False,
    lora_rank: int = 16,
    checkpointing: str | None = "offload",
    gpu: str | None = None,
) -> Plan:
    """Estimate per-GPU memory of LoRA training and choose DDP, model parallel, or neither.

    Takes a model name (hub id, local path, "tiny:"/"random:" name) or a PretrainedConfig; the
    config only is read and the model is built on the meta device. gpus / gpu_memory_gib default to
    this machine's visible GPUs (the smallest one's memory), or under a GPU profile (nbkit.emulate("T4"))
    the emulated GPU's memory and model; give both to plan for another machine
    (e.g. gpus=2, gpu_memory_gib=15 for Kaggle's 2x T4). seq_len x batch_size are the tokens per GPU
    per step. gpu names the GPU model ("T4", "L4", "A100", "H100", "H200") for the batch
    recommendation; by default, the name of this machine's first visible GPU where at least `gpus`
    GPUs are visible, else unknown (then an H100-class GPU is assumed, and the reason says so).
    gpu="cpu" says the processes train on CPU cores (gloo, no GPU): the asked batch stays.

    Returns a Plan, with the per-GPU batch it recommends for seq_len and why. Raises ValueError for
    arguments out of range, or when no GPU is visible and gpus / gpu_memory_gib were not given.
    Runs anywhere (CPU, any rank); never touches CUDA.
    """
    from nbkit.training.savers import CHECKPOINTING

    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r} is not one of {CHECKPOINTING}.")
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("lora_rank", lora_rank)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive whole number, not {value!r}.")
    gpus, gpu_memory_gib = _machine(gpus, gpu_memory_gib)
    config = load_config(model)
    counts = _counts(config, lora_rank)
    label = os.fspath(model) if isinstance(model, (str, os.PathLike)) else counts.architecture
    planned = _plan(
        label, counts, config, gpus, gpu_memory_gib, seq_len, batch_size, load_in_4bit, lora_rank, checkpointing
    )
    return _with_batch(planned, counts, config, gpu if gpu is not None else _local_gpu_name(planned))


def _machine(gpus: int | None, gpu_memory_gib: float | None) -> tuple[int, float]:
    if gpus is not None and (not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1):
        raise ValueError(f"gpus must be a positive whole number, not {gpus!r}.")
    if gpu_memory_gib is not None and (
        isinstance(gpu_memory_gib, bool)
        or not isinstance(gpu_memory_gib, numbers.Real)
        or not math.isfinite(gpu_memory_gib)
        or gpu_memory_gib <= 0
    ):
        raise ValueError(f"gpu_memory_gib must be a finite number of GiB above 0, not {gpu_memory_gib!r}.")
    profile = emulation.active()
    if gpu_memory_gib is None and profile is not None:  # nbkit.emulate("T4"): plan for the emulated GPU
        gpu_memory_gib = profile.memory_gib
    if gpus is not None and gpu_memory_gib is not None:
        return gpus, float(gpu_memory_gib)
    visible = distributed.visible_gpus()
    if not visible:
        raise ValueError(
            "No GPU is visible here, so the planner cannot tell how many GPUs or how much memory to plan for. "
            "Pass both, e.g. nbkit.plan(model, gpus=2, gpu_memory_gib=15) (%nbkit plan MODEL --gpus 2 "
            "--gpu-memory 15) for Kaggle's 2x T4."
        )
    gpus = gpus if gpus is not None else len(visible)
    if gpu_memory_gib is None:
        known = [g.memory_gib for g in visible[:gpus] if g.memory_gib > 0]
        if not known:
            raise ValueError("The GPUs' memory size is unknown here (no nvidia-smi); pass gpu_memory_gib=.")
        gpu_memory_gib = min(known)
    return gpus, float(gpu_memory_gib)


# ---------------------------------------------------------------------------------------------
# Counting parameters on the meta device.


@dataclass(frozen=True)
class _Counts:
    architecture: str
    parameters: int
    bytes_16bit: int  # every parameter at 2 bytes, except those the model keeps in fp32
    bytes_4bit: float  # nn.Linear weights (not the output embedding) as NF4, the rest as above
    largest_linear: int  # elements of the biggest quantizable weight (dequantised one at a time)
    quantized: int  # elements of all quantizable weights (every nn.Linear but the output embedding)
    lora_parameters: int
    lora_modules: tuple[str, ...]
    qk_norm: bool  # per-head RMSNorm on queries and keys (Qwen3), which saves fp32 copies of q and k


_COUNTS: dict[tuple[str, int], _Counts] = {}
_SHARES: dict[tuple[str, int, float, bool], float] = {}
_MODELS: dict[str, Any] = {}  # the last few models built on the meta device, by config
_MODELS_KEPT = 4


def _counts(config: Any, lora_rank: int) -> _Counts:
    """Parameter counts of the model `config` describes (cached per config and LoRA rank)."""
    key = (_config_key(config), lora_rank)
    if key not in _COUNTS:
        _COUNTS[key] = _count_on_meta(_meta_model(config), lora_rank)
    return _COUNTS[key]


def _config_key(config: Any) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def _meta_model(config: Any) -> Any:
    key = _config_key(config)
    if key not in _MODELS:
        if len(_MODELS) >= _MODELS_KEPT:
            _MODELS.pop(next(iter(_MODELS)))
        _MODELS[key] = _build_on_meta(config)
    return _MODELS[key]


def _element_bytes(model: Any) -> dict[str, int]:
    """Bytes per element of each parameter (by name; tied ones once) in 16-bit training: 4 for the
    modules the model keeps in fp32, else 2.
    """
    cls = type(model)
    keep_fp32 = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ()) + tuple(
        getattr(cls, "_keep_in_fp32_modules_strict", None) or ()
    )
    return {name: 4 if any(k in name.split(".") for k in keep_fp32) else 2 for name, _ in model.named_parameters()}


def _quantized_names(model: Any) -> set[str]:
    """The parameters bitsandbytes stores in 4-bit: the weight of every nn.Linear but the output embedding."""
    import torch

    output = model.get_output_embeddings()
    named = dict(model.named_parameters())  # a weight tied to another appears once, under the other's name
    return {
        f"{name}.weight"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not output and f"{name}.weight" in named
    }


def _count_on_meta(model: Any, lora_rank: int) -> _Counts:
    cls = type(model)
    named = dict(model.named_parameters())  # shared (tied) parameters appear once
    bytes_of = _element_bytes(model)
    element = {id(p): bytes_of[name] for name, p in named.items()}
    bytes_16 = sum(p.numel() * element[id(p)] for p in named.values())
    quantized = {id(named[name]): named[name].numel() for name in _quantized_names(model)}
    bytes_4 = (
        bytes_16 - sum(n * element[i] for i, n in quantized.items()) + NF4_BYTES_PER_WEIGHT * sum(quantized.values())
    )
    lora = _lora_linears(model)
    lora_modules = {name.rsplit(".", 1)[-1] for name, _ in lora}
    lora_params = sum(lora_rank * (m.in_features + m.out_features) for _, m in lora)
    return _Counts(
        architecture=cls.__name__,
        parameters=sum(p.numel() for p in named.values()),
        bytes_16bit=bytes_16,
        bytes_4bit=bytes_4,
        largest_linear=max(quantized.values(), default=0),
        quantized=sum(quantized.values()),
        lora_parameters=lora_params,
        lora_modules=tuple(m for m in LORA_TARGET_MODULES if m in lora_modules),
        qk_norm=any(name.endswith(".q_norm") for name, _ in model.named_modules()),
    )


def _lora_linears(model: Any) -> list[tuple[str, Any]]:
    """(name, nn.Linear) of the language model's linears LoRA adapts (LORA_TARGET_MODULES; vision towers are left
    out).
    """
    import torch

    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and name.rsplit(".", 1)[-1] in LORA_TARGET_MODULES
        and not _in_vision_tower(name)
    ]


def _balanced_share(config: Any, gpus: int, gpu_memory_gib: float, load_in_4bit: bool) -> float:
    """The largest share of the model's weights that one of `gpus` GPUs holds when transformers loads it
    with device_map="balanced" (cached).

    It is accelerate's own map (get_balanced_memory, then infer_auto_device_map) of the model on the meta
    device, sized as transformers sizes it (in 4-bit: the quantised linears at half a byte, within
    BNB_MAX_MEMORY_FRACTION of each GPU). Not an even split: accelerate keeps room for the largest module
    (a large vocabulary's 16-bit lm_head) on every GPU but the last, which takes the rest. Qwen3-14B in
    4-bit over 2 GPUs of 15 GiB: 70% on the second GPU, as loaded there (2.86 and 6.72 GiB, 2x H100).
    Weights that would not fit any GPU count on the largest share: training needs them on a GPU.
    """
    key = (_config_key(config), gpus, float(gpu_memory_gib), load_in_4bit)
    if key not in _SHARES:
        _SHARES[key] = _balanced_share_on_meta(_meta_model(config), gpus, gpu_memory_gib, load_in_4bit)
    return _SHARES[key]


def _balanced_share_on_meta(model: Any, gpus: int, gpu_memory_gib: float, load_in_4bit: bool) -> float:
    import torch
    from accelerate.utils import compute_module_sizes, infer_auto_device_map
    from accelerate.utils.dataclasses import CustomDtype

    quantized = _quantized_names(model) if load_in_4bit else set()
    dtypes = {4: torch.float32, 2: torch.float16}
    sizing = {
        "dtype": CustomDtype.INT4 if load_in_4bit else torch.float16,
        "special_dtypes": {n: dtypes[b] for n, b in _element_bytes(model).items() if n not in quantized},
    }
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    sizes = compute_module_sizes(model, **sizing)
    budget = _balanced_budget(model, sizes, gpus, int(gpu_memory_gib * GIB), no_split)
    if load_in_4bit:
        budget = {device: int(limit * BNB_MAX_MEMORY_FRACTION) for device, limit in budget.items()}
    # accelerate warns that each GPU index is "not available" here: the planner runs where those GPUs are not.
    with notices.quieted([logging.getLogger("accelerate.utils.modeling")], logging.ERROR):
        device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split, **sizing)
    held = [0] * gpus
    spilled = 0
    for name, device in device_map.items():
        if isinstance(device, int):
            held[device] += sizes[name]
        else:
            spilled += sizes[name]
    return (max(held) + spilled) / sizes[""]


def _balanced_budget(model: Any, sizes: dict[str, int], gpus: int, limit: int, no_split: list[str]) -> dict[int, int]:
    """What accelerate's get_balanced_memory gives each of `gpus` GPUs of `limit` bytes for `model`: an even
    share plus 1.25 of its largest unsplittable block (a decoder layer) on every GPU but the last, which keeps
    `limit`. Computed here because get_balanced_memory before accelerate 1.13 resolves GPU indices through
    torch.device, which raises where no GPU is (the planner runs there too).
    """
    kinds = {name: type(module).__name__ for name, module in model.named_modules()}
    blocks = [size for name, size in sizes.items() if name and kinds.get(name) in no_split]
    share = sizes[""] // gpus + int(1.25 * max(blocks, default=0))
    return {i: min(share, limit) if i < gpus - 1 else limit for i in range(gpus)}


def _build_on_meta(config: Any) -> Any:
    """The model `config` describes, with every tensor on the meta device (no memory, no init)."""
    import torch
    import transformers

    with torch.device("meta"):
        for architecture in getattr(config, "architectures", None) or ():
            cls = getattr(transformers, architecture, None)
            if cls is not None:
                return cls(config)
        autos = [transformers.AutoModelForCausalLM, transformers.AutoModel]
        if getattr(config, "vision_config", None) is not None:
            autos.insert(0, transformers.AutoModelForImageTextToText)
        for auto in autos:
            try:
                return auto.from_config(config)
            except ValueError:  # this Auto class has no model for the config's type
                continue
    raise ValueError(
        f"The planner cannot build a {type(config).__name__} ({config.model_type!r}): transformers has no "
        "causal-LM or image-text-to-text class for it."
    )


def _in_vision_tower(module_name: str) -> bool:
    return any("vision" in part or part == "visual" for part in module_name.split("."))


# ---------------------------------------------------------------------------------------------
# The estimate.


@dataclass(frozen=True)
class _Shape:
    hidden: int
    intermediate: int
    layers: int
    q: int  # attention heads x head dim
    kv: int  # key/value heads x head dim
    vocab: int

    @classmethod
    def of(cls, config: Any) -> _Shape:
        text = config.get_text_config()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(
            text.hidden_size,
            text.intermediate_size,
            text.num_hidden_layers,
            heads * head_dim,
            kv_heads * head_dim,
            text.vocab_size,
        )


def _layer_saved_per_token(s: _Shape, qk_norm: bool, tiled_mlp: bool, lora_rank: int) -> int:
    """Bytes autograd keeps per token for one decoder layer (LoRA on all projections, autocast)."""
    norms = 2 * 4 * s.hidden  # each RMSNorm keeps its input upcast to fp32
    # q/k/v and o LoRA A keep their (16-bit) inputs, every LoRA B its rank-r input
    lora_inputs = 3 * 2 * s.hidden + 2 * s.q + len(LORA_TARGET_MODULES) * 2 * lora_rank
    qk = (4 * s.q + 4 * s.kv) if qk_norm else 0  # q_norm / k_norm keep fp32 inputs
    attention = 2 * s.q + 2 * s.kv + 2 * s.kv + 2 * s.q  # SDPA keeps q, k, v and its output
    mlp = 2 * s.hidden if tiled_mlp else _mlp_saved_per_token(s)  # tiled: only the MLP input
    return norms + lora_inputs + qk + attention + mlp


def _mlp_saved_per_token(s: _Shape) -> int:
    # gate/up LoRA inputs; gate output (SiLU input), SiLU output, up output, down's input
    return 2 * 2 * s.hidden + 4 * 2 * s.intermediate


def _layer_backward_per_token(s: _Shape) -> int:
    """Transient bytes per token while one layer's attention runs backward."""
    # incoming and residual gradients, grad of the attention output, dq/dk/dv, flash's fp32 dq accumulator
    return 2 * 2 * s.hidden + 2 * s.q + (2 * s.q + 2 * s.kv + 2 * s.kv) + 4 * s.q


def _mlp_backward_per_token(s: _Shape) -> int:
    # gradients of the gate, up and SiLU outputs, and of the MLP input
    return 3 * 2 * s.intermediate + 2 * s.hidden


@dataclass(frozen=True)
class _Estimate:
    weights: float
    lora: float
    persistent: float  # checkpoints kept on the GPU for the whole step
    layer_phase: float  # one layer's recomputation + backward
    loss_phase: float  # the chunked loss (forward computes its gradients)
    vision_phase: float  # the frozen vision tower's forward, before the decoder runs

    def bytes_per_gpu(self) -> tuple[dict[str, float], float]:
        activations = self.persistent + max(self.layer_phase, self.vision_phase)
        logits = max(0.0, self.loss_phase - max(self.layer_phase, self.vision_phase))
        allocated = self.weights + self.lora + activations + logits
        overhead = CUDA_CONTEXT_GIB * GIB + ALLOCATOR_SLACK * allocated
        parts = {
            "weights": self.weights,
            "lora": self.lora,
            "activations": activations,
            "logits": logits,
            "overhead": overhead,
        }
        return {k: v / GIB for k, v in parts.items()}, sum(parts.values()) / GIB


def _estimate(
    counts: _Counts,
    config: Any,
    gpus: int,
    seq_len: int,
    batch_size: int,
    load_in_4bit: bool,
    lora_rank: int,
    checkpointing: str | None,
    split: int = 1,
    fsdp_shards: int = 0,
    *,
    gpu_memory_gib: float,
    fsdp_offload: bool = False,
) -> _Estimate:
    """Peak bytes for one GPU of gpu_memory_gib (the tiled MLP's automatic shards depend on it); split > 1
    spreads the weights and checkpoints over that many GPUs; fsdp_shards > 0 shards the weights and LoRA state
    over that many FSDP ranks (see the module docstring), and fsdp_offload keeps those shards, their gradients
    and the optimizer's state in CPU memory (FSDP2's CPU offload): the GPU holds the gathered layers only.
    """
    s = _Shape.of(config)
    tokens = seq_len * batch_size
    from nbkit.training.savers.loss import BYTES_PER_LOGIT, rows_per_chunk
    from nbkit.training.savers.tiled_mlp import automatic_tokens_per_shard, shard_count

    # What the tiled MLP will use on this GPU; one shard: the plain MLP.
    per_shard = automatic_tokens_per_shard(gpu_memory_gib * GIB, s.intermediate)
    shards = shard_count(tokens, seq_len, s.hidden, tokens_per_shard=per_shard)
    tiled = shards > 1
    saved = _layer_saved_per_token(s, counts.qk_norm, tiled, lora_rank) * tokens
    hidden_state = 2 * s.hidden * tokens
    if checkpointing == "offload":
        persistent: float = OFFLOAD_LAYER_INPUTS_ON_GPU * hidden_state
        recompute = saved
    elif checkpointing == "recompute":
        persistent = s.layers * hidden_state
        recompute = saved
    else:
        persistent = s.layers * saved
        recompute = 0
    if tiled:  # each shard is recomputed, its activations and gradients live only during its backward
        shard_tokens = math.ceil(tokens / shards)
        mlp_backward = shard_tokens * (_mlp_saved_per_token(s) + _mlp_backward_per_token(s)) + hidden_state
    else:
        mlp_backward = _mlp_backward_per_token(s) * tokens
    layer_phase = recompute + max(_layer_backward_per_token(s) * tokens, mlp_backward)
    if load_in_4bit:
        layer_phase += 2 * 2 * counts.largest_linear  # dequantised weight and its transpose/grad path
    rows = min(tokens, rows_per_chunk(s.vocab))
    # the final norm's fp32 input, its 16-bit output and the loss's gradient for it, plus one chunk
    loss_phase: float = (4 + 2 + 2) * s.hidden * tokens + BYTES_PER_LOGIT * rows * s.vocab
    vision = getattr(config, "vision_config", None)
    vision_phase = VISION_PATCHES * vision.hidden_size * VISION_WORKING_BYTES_PER_HIDDEN if vision is not None else 0
    weights = float(counts.bytes_4bit if load_in_4bit else counts.bytes_16bit)
    ddp_buckets = DDP_BUCKET_BYTES_PER_PARAM if gpus > 1 and split == 1 else 0
    lora = float(counts.lora_parameters * (LORA_BYTES_PER_PARAM + ddp_buckets))
    if fsdp_shards:
        sharded, replicated = _fsdp_weights(counts, load_in_4bit)
        layer, embedding = _fsdp_gathered(s, config, sharded)
        weights = (0 if fsdp_offload else sharded / fsdp_shards) + replicated + FSDP_GATHERED_LAYERS * layer
        # The loss runs on the gathered output embedding, beside the buffer FSDP2 gathered it into (kept until the
        # next all-gather, the backward's first), with one decoder layer still gathered rather than three.
        loss_phase += 2 * embedding - (FSDP_GATHERED_LAYERS - 1) * layer
        lora = 0.0 if fsdp_offload else float(counts.lora_parameters * LORA_BYTES_PER_PARAM) / fsdp_shards
    if split > 1:
        share = _balanced_share(config, split, gpu_memory_gib, load_in_4bit)
        weights, lora, persistent = weights * share, lora * share, persistent * share
    return _Estimate(
        float(weights), float(lora), float(persistent), float(layer_phase), float(loss_phase), float(vision_phase)
    )


def _fsdp_weights(counts: _Counts, load_in_4bit: bool) -> tuple[float, float]:
    """(bytes FSDP shards over the ranks, bytes every rank keeps whole) of the model's weights: in 4-bit the
    packed weights are parameters and sharded, their quantisation state is not (see NF4_PACKED_BYTES_PER_WEIGHT).
    """
    if not load_in_4bit:
        return float(counts.bytes_16bit), 0.0
    packed = counts.bytes_4bit - (NF4_BYTES_PER_WEIGHT - NF4_PACKED_BYTES_PER_WEIGHT) * counts.quantized
    return packed, NF4_DOUBLE_QUANT_STATE_BYTES_PER_WEIGHT * counts.quantized


def _fsdp_load(counts: _Counts, on_host: bool) -> float:
    """Peak bytes while a 4-bit fsdp rank loads: the whole quantised model on its GPU (on_host: only the
    16-bit weights that are not quantised and the quantisation state, nbkit.fsdp.load_4bit_on_host), one
    16-bit weight being quantised, and then the LoRA weights (fp32) that peft adds there before anything
    is sharded. Sharding itself frees each loaded layer as its shard is made (nbkit.fsdp's "fsdp" group), so
    the shards never sit beside the whole model.
    """
    packed, state = _fsdp_weights(counts, True)
    kept = counts.bytes_4bit - NF4_BYTES_PER_WEIGHT * counts.quantized if on_host else packed
    return kept + state + max(2.0 * counts.largest_linear, 4.0 * counts.lora_parameters)


def _fsdp_host(counts: _Counts, config: Any, lora_rank: int, ranks: int, host_load: bool, offload: bool) -> float:
    """Bytes of CPU memory the `ranks` 4-bit FSDP ranks of a machine hold together: under offload every shard in
    pinned memory (_offloaded_per_rank), else while loading on the host the packed weights (each rank writes only
    its rows, in pageable memory: exactly their bytes).
    """
    if offload:
        return ranks * _offloaded_per_rank(config, lora_rank, ranks)
    return _fsdp_weights(counts, True)[0] if host_load else 0.0


def _offloaded_per_rank(config: Any, lora_rank: int, ranks: int) -> float:
    """Bytes of CPU memory one of `ranks` FSDP ranks holds under FSDP2's CPU offload of a 4-bit model: its
    shards (_shards) pinned, LoRA's fp32 gradients pinned too after each reduce-scatter, and AdamW's two states
    (pageable). torch's pinned allocator rounds every allocation up to a power of two (_pinned): for Qwen3-32B on 2
    ranks that is 10.3 GiB of pinned frozen shards per rank for 8.7 GiB of packed weights and embeddings.
    """
    frozen, lora = _shards(config, lora_rank, ranks)
    pinned = sum(map(_pinned, frozen)) + 2 * sum(map(_pinned, lora))  # LoRA's weights and their gradients
    return float(pinned + 2 * sum(lora))


def _shards(config: Any, lora_rank: int, ranks: int) -> tuple[list[int], list[int]]:
    """Bytes of each parameter's shard on one of `ranks` FSDP2 ranks of the 4-bit model: (the frozen weights: NF4
    codes and the 16-bit rest, LoRA's fp32 weights). FSDP2 gives every rank torch.chunk's first chunk along dim 0,
    padded, and the 4-bit codes are stored two per byte in 16-bit words, one column (nbkit.fsdp.qlora_config).
    """
    model = _meta_model(config)
    quantized, element = _quantized_names(model), _element_bytes(model)
    frozen = []
    for name, p in model.named_parameters():
        rows, row_bytes = (
            (math.ceil(p.numel() / 4), 2) if name in quantized else (p.shape[0], element[name] * p[0].numel())
        )
        frozen.append(math.ceil(rows / ranks) * row_bytes)
    lora = [
        math.ceil(rows / ranks) * columns * 4
        for _, m in _lora_linears(model)
        for rows, columns in ((lora_rank, m.in_features), (m.out_features, lora_rank))  # lora_A, lora_B
    ]
    return frozen, lora


def _pinned(nbytes: int) -> int:
    """The bytes torch's pinned-memory allocator (CachingHostAllocator) takes for nbytes: the next power of two, so
    that freed blocks are found again by size. Newer torch can skip the rounding above PYTORCH_ALLOC_CONF's
    pinned_max_round_threshold_mb, which nbkit leaves unset: a torch without that setting refuses the unknown key.
    """
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def _fsdp_gathered(s: _Shape, config: Any, weights: float) -> tuple[float, float]:
    """Bytes of one decoder layer's full weights and of the 16-bit output embedding, as an FSDP rank gathers them:
    `weights` less the embeddings, spread evenly over the layers (a vision tower counts as part of the layers, an
    overestimate).
    """
    embedding = 2 * s.vocab * s.hidden
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    embeddings = embedding if tied else 2 * embedding
    return max(0.0, weights - embeddings) / s.layers, embedding


def _plan(
    label: str,
    counts: _Counts,
    config: Any,
    gpus: int,
    gpu_memory_gib: float,
    seq_len: int,
    batch_size: int,
    load_in_4bit: bool,
    lora_rank: int,
    checkpointing: str | None,
) -> Plan:
    usable = gpu_memory_gib * (1 - SAFETY_MARGIN)

    def per_gpu(split: int = 1, **changes: Any) -> float:
        args: dict[str, Any] = dict(
            seq_len=seq_len,
            batch_size=batch_size,
            load_in_4bit=load_in_4bit,
            lora_rank=lora_rank,
            checkpointing=checkpointing,
            gpu_memory_gib=gpu_memory_gib,
        )
        args.update(changes)
        return _estimate(counts, config, gpus, split=split, **args).bytes_per_gpu()[1]

    common = (counts, config, gpus, seq_len, batch_size, load_in_4bit, lora_rank)
    breakdown, total = _estimate(*common, checkpointing, gpu_memory_gib=gpu_memory_gib).bytes_per_gpu()
    split_total = per_gpu(split=gpus) if gpus > 1 else total
    fsdp = _fsdp_fit(common, checkpointing, gpu_memory_gib, usable, split_total)
    if total <= usable:
        strategy = "ddp"
    elif gpus > 1 and fsdp.total <= usable and (fsdp.load is None or fsdp.load <= usable):
        strategy = "fsdp"
    elif gpus > 1 and split_total <= usable:
        strategy = "model_parallel"
    else:
        strategy = "does_not_fit"
    advice = _advice(strategy, per_gpu, usable, gpus, seq_len, batch_size, load_in_4bit, checkpointing)
    return Plan(
        model=label,
        strategy=strategy,
        gpus=gpus,
        gpu_memory_gib=gpu_memory_gib,
        seq_len=seq_len,
        batch_size=batch_size,
        load_in_4bit=load_in_4bit,
        lora_rank=lora_rank,
        checkpointing=checkpointing,
        parameters=counts.parameters,
        lora_parameters=counts.lora_parameters,
        lora_modules=counts.lora_modules,
        breakdown=breakdown,
        per_gpu_gib=total,
        model_parallel_gib=split_total,
        usable_gib=usable,
        advice=tuple(advice),
        fsdp_gib=fsdp.total,
        fsdp_breakdown=fsdp.breakdown,
        fsdp_load_gib=fsdp.load,
        fsdp_host_load=fsdp.host_load,
        fsdp_offload=fsdp.offload,
        fsdp_host_gib=_fsdp_host(counts, config, lora_rank, gpus, fsdp.host_load, fsdp.offload) / GIB,
    )


@dataclass(frozen=True)
class _FsdpFit:
    """How FSDP fits (_fsdp_fit): the per-rank breakdown and total while training, the peak while loading (4-bit),
    whether the load keeps the weights on the host and whether the shards are offloaded.
    """

    breakdown: dict[str, float]
    total: float
    load: float | None
    host_load: bool
    offload: bool


def _fsdp_fit(
    common: tuple[_Counts, Any, int, int, int, bool, int],
    checkpointing: str | None,
    gpu_memory_gib: float,
    usable: float,
    split_total: float,
) -> _FsdpFit:
    """FSDP over common's GPUs (the _estimate arguments _plan shares): on the GPUs, loading on the host where a
    rank's GPU cannot hold the whole quantised model, and offloading the shards where neither that nor the split fits.
    """
    counts, gpus, load_in_4bit = common[0], common[2], common[5]
    fsdp_checkpointing = None if checkpointing is None else "recompute"  # accelerate's checkpointing keeps inputs
    breakdown, total = _estimate(
        *common, fsdp_checkpointing, fsdp_shards=gpus, gpu_memory_gib=gpu_memory_gib
    ).bytes_per_gpu()
    # In 4-bit an fsdp rank loads and quantises the whole model on its own GPU, one 16-bit weight at a time,
    # and shards it only afterwards (nbkit.fsdp.device_map); where that copy would not fit, it keeps each
    # quantised weight's rows of its shard on the host instead (nbkit.fsdp.load_4bit_on_host).
    load, host_load = None, False
    if load_in_4bit:
        load = _Estimate(_fsdp_load(counts, on_host=False), 0, 0, 0, 0, 0).bytes_per_gpu()[1]
        host_load = gpus > 1 and load > usable
        if host_load:
            load = _Estimate(_fsdp_load(counts, on_host=True), 0, 0, 0, 0, 0).bytes_per_gpu()[1]
    loads = load is None or load <= usable
    # Offloading the shards moves each layer's weights over PCIe in every forward, recomputation and backward:
    # the last resort, after the split, and for 4-bit weights only (the ranks of a machine hold the whole model in
    # pinned CPU memory together: 22.8 GiB for a 32B model in 4-bit on 2 ranks, about four times that in 16-bit,
    # where loading in 4-bit is the better advice).
    offload = load_in_4bit and gpus > 1 and loads and total > usable and split_total > usable
    if offload:
        breakdown, total = _estimate(
            *common, fsdp_checkpointing, fsdp_shards=gpus, gpu_memory_gib=gpu_memory_gib, fsdp_offload=True
        ).bytes_per_gpu()
    return _FsdpFit(breakdown, total, load, host_load, offload)


def _advice(
    strategy: str,
    per_gpu: Any,
    usable: float,
    gpus: int,
    seq_len: int,
    batch_size: int,
    load_in_4bit: bool,
    checkpointing: str | None,
) -> list[str]:
    """What would make DDP fit (or, failing that, anything fit), with the estimate for each change."""
    if strategy == "ddp":
        return []
    lines = [
        {
            "model_parallel": "To train with DDP (faster than model parallel) instead:",
            "fsdp": "To train with DDP (no per-layer gathering) instead:",
        }.get(strategy, "What would fit:")
    ]
    for change, value in (("load_in_4bit", True), ("checkpointing", "offload")):
        if {"load_in_4bit": load_in_4bit, "checkpointing": checkpointing}[change] != value:
            gib = per_gpu(**{change: value})
            verdict = "fits" if gib <= usable else "still too much"
            lines.append(f"  * {change}={value!r}: about {gib:.1f} GiB per GPU ({verdict}).")
    if batch_size > 1 and per_gpu(batch_size=1) <= usable:
        lines.append("  * batch_size=1 per GPU (raise gradient accumulation to keep the effective batch).")
    shorter = next((n for n in _shorter(seq_len) if per_gpu(seq_len=n, batch_size=1) <= usable), None)
    if shorter is not None:
        lines.append(f"  * sequences of at most {shorter} tokens fit with DDP.")
    if strategy == "does_not_fit":
        for four_bit in sorted({load_in_4bit, True}):
            more = next((n for n in range(gpus + 1, 17) if per_gpu(split=n, load_in_4bit=four_bit) <= usable), None)
            if more is not None:
                how = " in 4-bit" if four_bit and not load_in_4bit else ""
                lines.append(
                    f"  * {more} GPUs of this size{how}, with the model split over them (device_map='balanced')."
                )
    if len(lines) == 1:
        lines.append("  * nothing short of larger GPUs: even one 256-token sequence in 4-bit is too much.")
    return lines


def _shorter(seq_len: int) -> list[int]:
    """Candidate sequence lengths below seq_len, longest first (powers of two down to 256)."""
    top = 2 ** int(math.log2(seq_len - 1)) if seq_len > 256 else 0
    return [n for n in (top >> i for i in range(16)) if n >= 256]


# ---------------------------------------------------------------------------------------------
# The per-GPU batch.


def _local_gpu_name(planned: Plan) -> str | None:
    """This machine's GPU model when the plan is for this machine (its GPUs are visible), else None;
    under a GPU profile (nbkit.emulate), the emulated GPU.
    """
    profile = emulation.active()
    if profile is not None:
        return profile.gpu
    visible = distributed.visible_gpus()
    if not visible or len(visible) < planned.gpus:
        return None
    known = [g for g in visible if g.name != "unknown"]
    return known[0].name if known else None


def gpu_tflops(name: str | None) -> float | None:
    """Dense 16-bit tensor TFLOP/s of a GPU model from its name ("Tesla T4", "NVIDIA H200"), None if unknown."""
    if not name:
        return None
    upper = name.upper()
    for key in sorted(GPU_TFLOPS, key=len, reverse=True):  # longest first: "GH200" before "H200"
        if key in upper:
            return GPU_TFLOPS[key]
    return None


def _with_batch(planned: Plan, counts: _Counts, config: Any, gpu: str | None) -> Plan:
    """The plan with recommended_batch_size, batch_reason and gpu filled in (see the module docstring)."""
    from dataclasses import replace

    seq_len, asked = planned.seq_len, planned.batch_size
    if planned.strategy != "ddp":
        reason = (
            f"Keep {asked}: with {planned.strategy} the question is memory, not the host cost per step (see above)."
        )
        return replace(planned, recommended_batch_size=asked, batch_reason=reason, gpu=gpu)
    if _is_cpu(gpu):
        reason = f"Keep {asked}: the processes train on CPU cores (gpu='cpu'), so no GPU waits for the host."
        return replace(planned, recommended_batch_size=asked, batch_reason=reason, gpu="cpu")
    known = gpu_tflops(gpu)
    assumed = known is None
    tflops = MEASURED_TFLOPS if known is None else known
    host_s = MEASURED_HOST_S_PER_LAYER * _Shape.of(config).layers
    token_s = MEASURED_GPU_S_PER_TOKEN * (counts.parameters / MEASURED_PARAMETERS) * (MEASURED_TFLOPS / tflops)
    target_tokens = math.ceil((HOST_SHARE_FACTOR - 1) * host_s / token_s)
    wanted = min(MAX_RECOMMENDED_BATCH, max(asked, 2 ** math.ceil(math.log2(max(1, target_tokens / seq_len)))))

    def fits(batch: int) -> bool:
        return (
            _estimate(
                counts,
                config,
                planned.gpus,
                seq_len,
                batch,
                planned.load_in_4bit,
                planned.lora_rank,
                planned.checkpointing,
                gpu_memory_gib=planned.gpu_memory_gib,
            ).bytes_per_gpu()[1]
            <= planned.usable_gib
        )

    batch = wanted
    while batch > asked and not fits(batch):
        batch //= 2
    batch = max(batch, asked)
    step_host = host_s
    step_gpu = token_s * seq_len * batch
    share = step_host / (step_host + step_gpu)
    where = f"on {gpu}" if not assumed else "on an H100/H200-class GPU (GPU model unknown: pass gpu='T4' etc.)"
    figures = (
        f"A step has about {step_host * 1e3:.0f} ms of fixed host work ({_Shape.of(config).layers} layers, as "
        "measured on an H200 host's CPU; a slower CPU has more) and, "
        f"{where}, about {token_s * 1e6:.0f} us of GPU work per token: at {batch} x {seq_len} tokens the host is "
        f"{share:.0%} of the step"
    )
    if batch == asked and asked >= wanted:
        reason = f"{figures}, so the GPU already bounds it and DDP scales with the GPUs."
    elif batch == asked:
        reason = (
            f"{figures}; {wanted} x {seq_len} would make the GPU the bound (host at most "
            f"{1 / HOST_SHARE_FACTOR:.0%}), but more than {asked} per GPU does not fit in memory, so expect DDP to "
            "scale below the GPU count (on H200s 1K x 4 scaled 1.3-1.6x on 2 GPUs)."
        )
    else:
        short = "" if batch == wanted else f" ({wanted} would be better still but does not fit)"
        reason = (
            f"{figures}{short}. Smaller per-GPU batches leave the GPU waiting for the host, more so under DDP "
            f"(H200s, 1K tokens: 4 per GPU scaled 1.3-1.6x on 2 GPUs, 16 per GPU 1.94x). Set "
            f"per_device_train_batch_size={batch} and divide gradient_accumulation_steps by {batch // asked} "
            "to keep the effective batch; with short samples of uneven length also pack them (TRL: "
            "SFTConfig(padding_free=True)) so that the tokens per step are real tokens, not padding."
        )
    return replace(
        planned,
        recommended_batch_size=batch,
        batch_reason=reason,
        gpu=gpu,
        host_seconds_per_step=step_host,
        gpu_seconds_per_token=token_s,
    )


def _is_cpu(gpu: str | None) -> bool:
    """Whether `gpu` says the processes train on CPU cores (gpu="cpu")."""
    return gpu is not None and gpu.strip().lower() == "cpu"
