r"""Host time of an FSDP2 rank's Trainer step against a DDP rank's, by phase and by library.

    python3 benchmarks/fsdp_host_cost.py [--variants fsdp,fsdp+noprefetch,...,ddp] [--layers 40] \
        [--seq-len 128] [--steps 8] [--warmup 3] [--profile-steps 2] [--gpus 2] [--out rows.json] [--md rows.md]

Why: FSDP-QLoRA of a 14B model on 2 GPUs took 1.45-1.73 s a step where its kernels took 0.4 s (2x H100,
benchmarks/RESULTS.md): the rank's host is the bound. A model of many narrow layers on the CPU (the
tiny Qwen3 with `--layers` decoder layers, hidden size 64) makes the arithmetic negligible, so what a step
costs there is the per-layer and per-parameter host work: FSDP2's hooks, DTensor dispatch in the optimizer
and the gradient clipping, checkpointing, Trainer and nbkit's callbacks. With `--layers 40` and LoRA r=16 on
the seven projections the model has Qwen3-14B's 560 LoRA parameters.

Each variant is one nbkit.launch of `--gpus` ranks (gloo on the CPU) that loads the model, adds LoRA with peft
and nbkit's chunked loss (nbkit.savers.apply), and trains it with transformers' Trainer as
benchmarks/fsdp_vs_balanced.py does (logging every step, gradient clipping at 1.0, Trainer's default AdamW).
A variant is a strategy and options joined by "+":

- `fsdp`: NBKIT_STRATEGY=fsdp, nbkit's FSDP2 set-up (accelerate's checkpointing, forward prefetch, fp32
  gradient reduction); `ddp`: nbkit's default strategy, nbkit's checkpointing ("recompute");
- `noprefetch`: without nbkit's forward prefetch (and the last layer resharded like the others);
- `twounits`: accelerate's units as it makes them, two per checkpointed layer (the checkpoint wrapper's, without
  weights, and the layer's), where nbkit makes the wrapper the layer's one unit;
- `keep`: FSDP_RESHARD_AFTER_FORWARD=false (ZeRO-2); `noac`: no activation checkpointing;
- `noclip`: max_grad_norm=0; `nochunk`: transformers' loss in place of nbkit's chunked one;
- `noreport`: without nbkit's reporting patches (its dashboard callback); `foreach`: AdamW with foreach
  instead of Trainer's default fused; `fp32`: no mixed precision (fp32 weights); `compile` / `nocompile`: nbkit's
  regional compilation on / off (its default, "auto", compiles a model on one GPU: a 4-bit model under FSDP, or
  any model under DDP on GPUs; never on the CPU).

Per step, on rank 0, over `--steps` steps after `--warmup` (no profiler): the main thread's CPU time and the wall
time of each phase (medians), from wrappers and Trainer callbacks: forward (compute_loss), backward
(accelerator.backward), clip (accelerator.clip_grad_norm_; Trainer 5 computes the norm even with max_grad_norm=0),
optimizer, zero_grad and scheduler, and the rest (data, loss bookkeeping, logging, callbacks). CPU time leaves
out what a rank waits for: gloo's collectives on a CPU (on a GPU, NCCL's run on the GPU and the host waits for
neither). Then `--profile-steps` steps under cProfile: function calls by library (the file a Python function lives
in; builtins, torch ops among them, counted apart), the same from run to run, and own time by library (a builtin's
counted for the library that called it; cProfile inflates Python-heavy parts); then as many under torch.profiler:
aten ops, the ops with the most self CPU time, FSDP2's annotations (FSDP::pre_forward, ...), collectives and host
reads of a tensor's value (`aten::_local_scalar_dense`: each one waits for the GPU on a GPU; on a CPU fused AdamW
and the CPU's foreach fallbacks add one per parameter that a GPU does not have). On a CPU the times are those of a
tiny model on shared cores: the counts, and what each setting changes, are the result.

On GPUs: `--model random:qwen3-14b --layers 0 --4bit --t4 --seq-len 1024` (as fsdp_vs_balanced.py's run); the
phases are then host times: the host queues kernels and waits only where something reads a GPU value.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: the package lives one level up
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from benchmarks import batches, host, measures  # noqa: E402
from benchmarks.trainer_bench import TEXT_LORA  # noqa: E402

LORA_RANK = 16
OPTIONS = {
    "noprefetch": "without nbkit's forward prefetch",
    "twounits": "accelerate's two FSDP units per checkpointed layer (the wrapper's and the layer's)",
    "keep": "FSDP_RESHARD_AFTER_FORWARD=false",
    "noac": "no activation checkpointing",
    "noclip": "max_grad_norm=0",
    "nochunk": "transformers' loss",
    "noreport": "without nbkit's reporting patches",
    "foreach": "AdamW foreach (not fused)",
    "fp32": "fp32, no mixed precision",
    "compile": "regional compilation (nbkit.savers' compile='regional'; 'auto' compiles only on one GPU)",
    "nocompile": "no regional compilation",
}
FSDP_ONLY = frozenset({"noprefetch", "twounits", "keep"})
PHASES = ("forward", "backward", "clip", "optimizer", "zero_grad+scheduler", "other")
# Library of a Python function by the path of its file, first match wins.
LIBRARIES = (
    ("FSDP2", "torch/distributed/fsdp/"),
    ("DTensor", "torch/distributed/tensor/"),
    ("checkpointing", "torch/utils/checkpoint.py"),
    ("checkpointing", "torch/distributed/algorithms/_checkpoint/"),
    ("DDP", "torch/nn/parallel/"),
    ("c10d", "torch/distributed/"),
    ("optimizer", "torch/optim/"),
    ("optimizer", "torch/amp/"),
    ("clip_grad", "torch/nn/utils/clip_grad.py"),
    ("autograd", "torch/autograd/"),
    ("nn.Module", "torch/nn/modules/"),
    ("torch other", "torch/"),
    ("peft", "peft/"),
    ("transformers", "transformers/"),
    ("accelerate", "accelerate/"),
    ("nbkit", "nbkit/"),
    ("benchmark", "benchmarks/"),
)
# FSDP2's record_function annotations, read from torch.profiler (CPU total per step).
FSDP_RANGES = ("FSDP::",)


@dataclass(frozen=True)
class Job:
    """What every rank of one variant runs. Plain data."""

    variant: str
    model_path: str
    seq_len: int
    batch: int
    warmup: int
    steps: int
    profile_steps: int
    four_bit: bool
    t4: bool
    stats_dir: str | None = None  # each rank's cProfile stats written here (pstats files)

    @property
    def options(self) -> list[str]:
        return parse_variant(self.variant)[1]

    @property
    def precision(self) -> str:
        if "fp32" in self.options:
            return "fp32"
        if self.t4:
            return "fp16"
        return "bf16"


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`fsdp+noclip` -> ("fsdp", ["noclip"]). Raises ValueError for an unknown strategy or option."""
    strategy, *options = text.split("+")
    if strategy not in ("fsdp", "ddp") or any(o not in OPTIONS for o in options):
        raise ValueError(f"{text!r}: use fsdp|ddp[+option...], options {sorted(OPTIONS)}")
    if strategy == "ddp" and FSDP_ONLY.intersection(options):
        raise ValueError(f"{text!r}: {sorted(FSDP_ONLY)} are FSDP settings")
    return strategy, options


def environment(variant: str, t4: bool) -> dict[str, str]:
    """The ranks' environment for `variant`: the strategy and the FSDP settings it changes."""
    strategy, options = parse_variant(variant)
    env = {"NBKIT_STRATEGY": strategy, **({"NBKIT_EMULATE": "T4"} if t4 else {})}
    if strategy == "fsdp":
        env["FSDP_RESHARD_AFTER_FORWARD"] = "false" if "keep" in options else "true"
        env["FSDP_ACTIVATION_CHECKPOINTING"] = "false" if "noac" in options else "true"
    return env


def _model(job: Job, device: torch.device) -> Any:
    """The model with LoRA and nbkit's savers as the variant asks, on `device` (FSDP: where accelerate wants it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from nbkit.training import fsdp, savers

    strategy, options = parse_variant(job.variant)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[job.precision]
    kwargs: dict[str, Any] = {"dtype": dtype}
    if job.four_bit:
        kwargs["quantization_config"] = fsdp.qlora_config(dtype)
    if strategy == "ddp":
        kwargs["device_map"] = {"": str(device)}
    base = AutoModelForCausalLM.from_pretrained(job.model_path, **kwargs)
    base.config.use_cache = False
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, target_modules=TEXT_LORA))
    # FSDP checkpoints the layers itself (accelerate's wrapper); DDP with nbkit's savers.
    checkpointing = None if strategy == "fsdp" or "noac" in options else "recompute"
    compile = "regional" if "compile" in options else None if "nocompile" in options else "auto"
    return savers.apply(
        model, checkpointing=checkpointing, tiled_mlp=False, chunked_loss="nochunk" not in options, compile=compile
    )


def _now() -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds): a rank waiting for a collective uses no CPU."""
    return time.perf_counter(), time.thread_time()


class _PhaseClock:
    """Wall and main-thread CPU seconds per phase of each optimizer step (see the module docstring), from wrappers
    around Trainer's compute_loss, accelerator.backward and accelerator.clip_grad_norm_ and from Trainer callbacks; also runs
    the profilers over the steps after the timed ones.
    """

    def __init__(self, job: Job) -> None:
        self.job = job
        self.steps: list[dict[str, tuple[float, float]]] = []  # per step: phase -> (wall, cpu) seconds
        self._current: dict[str, tuple[float, float]] = {}
        self._marks: dict[str, tuple[float, float]] = {}
        self._begun: tuple[float, float] | None = None
        self.cprofile: cProfile.Profile | None = None
        self.torch_profile: Any = None

    def timed(self, phase: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = _now()
            try:
                return fn(*args, **kwargs)
            finally:
                self._current[phase] = _add(self._current.get(phase, (0.0, 0.0)), _since(start))

        return wrapped

    def mark(self, name: str) -> None:
        self._marks[name] = _now()

    def step_begin(self, global_step: int) -> None:
        if self._begun is not None:
            step = _since(self._begun)
            phases = dict(self._current)
            phases["optimizer"] = _since(self._marks["optimizing"], self._marks["optimized"])
            phases["zero_grad+scheduler"] = _since(self._marks["optimized"], self._marks["ended"])
            accounted = (sum(w for w, _ in phases.values()), sum(c for _, c in phases.values()))
            phases["other"] = (step[0] - accounted[0], step[1] - accounted[1])
            self.steps.append({"step": step, **phases})
        self._current.clear()
        self._profile(global_step)
        self._begun = _now()

    def _profile(self, global_step: int) -> None:
        """Profile the `profile_steps` steps after the timed ones with cProfile, then as many with torch.profiler."""
        first = self.job.warmup + self.job.steps
        if global_step == first:
            self.cprofile = cProfile.Profile()
            self.cprofile.enable()
        elif global_step == first + self.job.profile_steps and self.cprofile is not None:
            self.cprofile.disable()
            from torch.profiler import ProfilerActivity, profile

            cuda = torch.cuda.is_available()
            self.torch_profile = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            self.torch_profile.start()
        elif global_step == first + 2 * self.job.profile_steps and self.torch_profile is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.torch_profile.stop()


def _since(start: tuple[float, float], end: tuple[float, float] | None = None) -> tuple[float, float]:
    end = end or _now()
    return end[0] - start[0], end[1] - start[1]


def _add(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return a[0] + b[0], a[1] + b[1]


def _callback(clock: _PhaseClock) -> Any:
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.step_begin(state.global_step)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.mark("optimizing")

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.mark("optimized")

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.mark("ended")

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.step_begin(state.global_step)

    return Clock()


def _without_prefetch() -> Any:
    """A TrainerCallback that undoes nbkit's forward prefetch on the sharded model before the first step."""
    from transformers import TrainerCallback

    from nbkit.training import fsdp

    class NoPrefetch(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            layers = fsdp._weight_units(fsdp._decoder_layer_units(model))
            for layer in layers:
                layer.set_modules_to_forward_prefetch([])
            if layers:
                layers[-1].set_reshard_after_forward(True, recurse=False)

    return NoPrefetch()


def _trainer(job: Job, model: Any, out: str, clock: _PhaseClock) -> Any:
    """A Trainer of the variant, its phases wrapped for `clock`."""
    from transformers import AutoConfig, Trainer, TrainingArguments

    options = job.options
    config = AutoConfig.from_pretrained(job.model_path)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pool = [
        {k: v[0] for k, v in batches.synthetic_batch(config, job.seq_len, 1, "cpu", seed=i).items()}
        for i in range(job.batch * world)
    ]
    total = job.warmup + job.steps + 2 * job.profile_steps + 1
    args = TrainingArguments(
        output_dir=out,
        max_steps=total,
        per_device_train_batch_size=job.batch,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        fp16=job.precision == "fp16",
        bf16=job.precision == "bf16",
        max_grad_norm=0.0 if "noclip" in options else 1.0,
        optim="adamw_torch" if "foreach" in options else "adamw_torch_fused",
        disable_tqdm=True,
        seed=0,
        use_cpu=not torch.cuda.is_available(),
    )
    callbacks = [_callback(clock)] + ([_without_prefetch()] if "noprefetch" in options else [])
    trainer = Trainer(model=model, args=args, train_dataset=pool * total, callbacks=callbacks)
    trainer.compute_loss = clock.timed("forward", trainer.compute_loss)
    trainer.accelerator.backward = clock.timed("backward", trainer.accelerator.backward)
    # what Trainer 4.57 and 5 both call to clip and to compute the norm (5's _clip_grad_norm among them)
    trainer.accelerator.clip_grad_norm_ = clock.timed("clip", trainer.accelerator.clip_grad_norm_)
    return trainer


def run_rank(job: Job) -> dict[str, Any]:
    """One rank of one variant: train, time, profile; every rank's figures on rank 0 (its own elsewhere)."""
    import nbkit
    from benchmarks.ranks import gather

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        if job.t4:
            from benchmarks.fsdp_vs_balanced import _cap

            _cap(local)
    else:
        torch.set_num_threads(1)  # two ranks on a small machine only fight over cores
    if "noreport" in job.options:
        nbkit.uninstall("reporting")
    if "twounits" in job.options:
        import accelerate.utils.fsdp_utils  # noqa: F401  (the patch is applied once its module is imported)

        from nbkit.training import fsdp

        fsdp._OUTERMOST_UNITS.revert()
    clock = _PhaseClock(job)
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(job, _model(job, device), out, clock)
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    if job.stats_dir and clock.cprofile is not None:
        Path(job.stats_dir).mkdir(parents=True, exist_ok=True)
        clock.cprofile.dump_stats(Path(job.stats_dir) / f"{job.variant}.rank{os.environ.get('RANK', '0')}.pstats")
    timed = clock.steps[job.warmup : job.warmup + job.steps]
    result = {
        # Medians over the timed steps of each phase's wall and main-thread CPU milliseconds (the machine's other
        # work slows some steps; their CPU time grows too, through caches and shared cores).
        "wall_ms": {k: _median_ms(timed, k, 0) for k in ("step", *PHASES)},
        "cpu_ms": {k: _median_ms(timed, k, 1) for k in ("step", *PHASES)},
        "cpu_ms_min": min(1000 * s["step"][1] for s in timed),
        "python_calls": _python_calls(clock.cprofile, job.profile_steps),
        "wall_ms_stats": measures.step_stats([1000 * s["step"][0] for s in timed]),
        "losses": losses,
        "lora_params": sum(1 for p in trainer.model.parameters() if p.requires_grad),
        "libraries_ms": _libraries(clock.cprofile, job.profile_steps),
        "top_functions": _top_functions(clock.cprofile, job.profile_steps),
        **_torch_profile(clock.torch_profile, job.profile_steps),
    }
    return gather(result)


def _median_ms(steps: list[dict[str, tuple[float, float]]], phase: str, which: int) -> float:
    return 1000 * statistics.median(s.get(phase, (0.0, 0.0))[which] for s in steps)


def _python_calls(profile: cProfile.Profile | None, steps: int) -> dict[str, float]:
    """Function calls per step under cProfile (Python functions and builtins), by library.

    Unlike times, the same from run to run.
    """
    if profile is None:
        return {}
    counts: collections.Counter[str] = collections.Counter()
    for (filename, _, _), (_, calls, _, _, _) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        counts["all"] += calls
        counts["builtins" if filename == "~" else _library(filename)] += calls
    return {k: v / steps for k, v in counts.most_common()}


def _library(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    return next((name for name, part in LIBRARIES if part in path), "other Python")


def _libraries(profile: cProfile.Profile | None, steps: int) -> dict[str, float]:
    """Own time per step (ms, cProfile) by library; a builtin's (a C++ torch op) by the library of its callers."""
    if profile is None:
        return {}
    totals: collections.Counter[str] = collections.Counter()
    for (filename, _, name), (_, _, own, _, callers) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        if filename != "~":
            totals[_library(filename)] += own
            continue
        if "c10d" in name:  # a collective, or the wait for one: gloo works on the CPU; NCCL on a GPU does not
            totals["collectives (C++)"] += own
            continue
        if not callers:
            totals["builtins, no caller"] += own
        for (caller_file, _, _), caller in callers.items():
            totals[_library(caller_file) + " (C++)"] += caller[2]
    return {k: 1000 * v / steps for k, v in totals.most_common()}


def _top_functions(profile: cProfile.Profile | None, steps: int, top: int = 25) -> list[tuple[str, float, float]]:
    """The functions with the most own time: (where, calls per step, ms per step)."""
    if profile is None:
        return []
    stats = pstats.Stats(profile).stats.items()  # type: ignore[attr-defined]
    ranked = sorted(stats, key=lambda kv: -kv[1][2])[:top]
    return [
        (f"{f.split('site-packages/')[-1]}:{line}({name})", calls / steps, 1000 * own / steps)
        for (f, line, name), (_, calls, own, _, _) in ranked
    ]


def _fsdp_ranges(events: list[Any], steps: int) -> dict[str, tuple[float, float]]:
    """FSDP2's annotations summed over its units (their names end in the unit's modules): calls and CPU ms per step.

    Annotations nest (pre_forward holds an all_gather), so the totals overlap.
    """
    out: dict[str, list[float]] = {}
    for e in events:
        if e.key.startswith(FSDP_RANGES):
            name = e.key.split(" (")[0].split(" for ")[0]
            calls, ms = out.setdefault(name, [0.0, 0.0])
            out[name] = [calls + e.count / steps, ms + e.cpu_time_total / 1000 / steps]
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def _torch_profile(profile: Any, steps: int, top: int = 25) -> dict[str, Any]:
    """Per step: the ops with the most self CPU time, FSDP2's annotated phases (CPU total), host reads, and on GPUs
    the CUDA runtime's synchronising calls and the kernels' device time.
    """
    from benchmarks.profiling import HOST_SYNCS, device_us, split_events

    if profile is None:
        return {}
    averages = profile.key_averages()
    host = [e for e in averages if e.self_cpu_time_total > 0 or e.key.startswith(FSDP_RANGES)]
    ops = [e for e in host if not e.key.startswith(FSDP_RANGES)]
    ranked = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top]
    return {
        "top_ops": [(e.key[:80], e.count / steps, e.self_cpu_time_total / 1000 / steps) for e in ranked],
        "fsdp_ranges": _fsdp_ranges(host, steps),
        "host_reads": sum(e.count for e in averages if e.key == "aten::_local_scalar_dense") / steps,
        "aten_ops": sum(e.count for e in averages if e.key.startswith("aten::")) / steps,
        "ops_by_count": [(e.key[:80], e.count / steps) for e in sorted(ops, key=lambda e: -e.count)[:top]],
        "collectives": {e.key: e.count / steps for e in averages if e.key.startswith(("gloo:", "nccl:"))},
        "cuda_syncs": sum(e.count for e in averages if e.key in HOST_SYNCS) / steps,
        "gpu_kernel_ms": sum(device_us(e) for e in split_events(averages)[0]) / 1000 / steps,
        # Every event's own CPU time (ops, FSDP2's annotations, autograd nodes): torch's "Self CPU time total".
        "profiled_cpu_ms": sum(e.self_cpu_time_total for e in averages) / 1000 / steps,
    }


def model_path(model: str, layers: int, dtype: torch.dtype, out: str) -> str:
    """The path of `model` (an nbkit name or a path).

    With `layers` > 0: its shape with that many decoder layers, random weights written to `out` (a narrow model
    of many layers: host work per layer dominates).
    """
    import nbkit

    if layers <= 0:
        return nbkit.resolve_model(model)
    from transformers import AutoModelForCausalLM

    from nbkit.training import offline

    loaded = offline.load_config(model)
    # Built again so that what follows from the layer count (layer_types) follows the new one.
    config = type(loaded)(**{**loaded.to_dict(), "num_hidden_layers": layers, "layer_types": None})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(out)
    offline.load_processor(nbkit.resolve_model(model)).save_pretrained(out)
    return out


def measure(job: Job, gpus: int) -> dict[str, Any]:
    """One variant under nbkit.launch; its row: every rank's figures under "ranks", or the error (the next variant
    still runs).
    """
    import nbkit

    row = {"variant": job.variant, **asdict(job)}
    try:
        ranks = nbkit.launch(
            run_rank, job, gpus=gpus, env=environment(job.variant, job.t4), timeout=1800, dashboard=False
        )
    except Exception as exc:  # recorded: an OOM or a failing setting ends one variant, not the run
        return row | {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
    return row | {"ranks": ranks}


def markdown(rows: list[dict], command: str, env: dict) -> str:
    """Rank 0's figures per variant as markdown tables, with the command and the machine."""
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    machine = f"{env['gpu_count']} x {env['gpu']}" if env["gpu_count"] else f"{env['cpu_count']} CPUs, no GPU"
    failed = [f"{r['variant']} failed: {r['error'][:300]}" for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    firsts = [r["ranks"][0] for r in rows]
    lines = [f"`{command}`", "", f"{env['date']}, {machine}; {versions}.", "", *failed]
    lines += [
        "Per step, rank 0: main-thread CPU ms by phase (median of the timed steps, no profiler; wall ms in brackets), "
        "and from the profiled steps the function calls (cProfile), aten ops, host reads and collectives "
        "(torch.profiler):",
        "",
        "| variant | step wall | step CPU (min) | " + " | ".join(PHASES) + " | calls | aten ops | host reads "
        "| collectives |",
        "|---|" + "---:|" * (len(PHASES) + 6),
    ]
    for r, first in zip(rows, firsts):
        phases = " | ".join(f"{first['cpu_ms'][p]:.1f} ({first['wall_ms'][p]:.0f})" for p in PHASES)
        collectives = ", ".join(f"{k} {v:g}" for k, v in sorted(first.get("collectives", {}).items()))
        lines.append(
            f"| {r['variant']} | {first['wall_ms']['step']:.0f} | {first['cpu_ms']['step']:.1f} "
            f"({first['cpu_ms_min']:.1f}) | {phases} | {first['python_calls'].get('all', 0):,.0f} | "
            f"{first.get('aten_ops', 0):,.0f} | {first.get('host_reads', 0):g} | {collectives} |"
        )
    lines += ["", "Function calls per step by library (cProfile; the same from run to run):", ""]
    lines += _library_table(rows, [f["python_calls"] for f in firsts], "{:,.0f}")
    lines += [
        "",
        "Own time under cProfile, ms per step, by library (C++: a builtin, by the library that called it):",
        "",
    ]
    lines += _library_table(rows, [f["libraries_ms"] for f in firsts], "{:.1f}")
    for r, first in zip(rows, firsts):
        if first.get("gpu_kernel_ms"):
            lines += [
                "",
                f"{r['variant']}: GPU kernels {first['gpu_kernel_ms']:.0f} ms and {first['cuda_syncs']:g} synchronising "
                f"CUDA calls per profiled step (one per window is the harness's), against {first['profiled_cpu_ms']:.0f} "
                "ms of profiled host time",
            ]
        ranges = ", ".join(f"{k} {n:g}x {ms:.1f}" for k, (n, ms) in first.get("fsdp_ranges", {}).items())
        lines += [
            "",
            f"{r['variant']}: FSDP2's annotations (torch.profiler, calls and CPU ms per step): {ranges or '-'}",
        ]
        lines += ["", f"{r['variant']}: busiest functions (cProfile own time) and ops (torch.profiler self CPU):", ""]
        lines += [f"- {ms:.2f} ms, {calls:g} calls: `{where}`" for where, calls, ms in first["top_functions"][:10]]
        lines += [f"- {ms:.2f} ms, {calls:g} calls: `{op}`" for op, calls, ms in first.get("top_ops", [])[:10]]
    return "\n".join(lines) + "\n"


def _library_table(rows: list[dict], values: list[dict[str, float]], number: str) -> list[str]:
    names = sorted({k for v in values for k in v}, key=lambda k: -max(v.get(k, 0) for v in values))
    out = ["| library | " + " | ".join(r["variant"] for r in rows) + " |", "|---|" + "---:|" * len(rows)]
    return out + [f"| {name} | " + " | ".join(number.format(v.get(name, 0)) for v in values) + " |" for name in names]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="fsdp,ddp")
    p.add_argument("--model", default="tiny:qwen3", help="nbkit name or path of a causal LM")
    p.add_argument(
        "--layers", type=int, default=None, help="decoder layers (0: the model's own; default 40 for tiny:, else 0)"
    )
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--profile-steps", type=int, default=2, help="steps under cProfile, then as many under torch's")
    p.add_argument("--4bit", dest="four_bit", action="store_true", help="QLoRA (nbkit.fsdp.qlora_config; GPUs)")
    p.add_argument("--t4", action="store_true", help="the T4 profile: fp16, 15 GiB per GPU")
    p.add_argument("--stats-dir", help="write each rank's cProfile stats here (pstats files, one per variant)")
    p.add_argument("--out", type=Path)
    p.add_argument("--md", type=Path)
    a = p.parse_args(argv)
    try:
        variants = [v for v in a.variants.split(",") if parse_variant(v)]
    except ValueError as exc:
        p.error(str(exc))
    if a.steps < 1 or a.warmup < 1 or a.profile_steps < 1:
        p.error("--steps, --warmup and --profile-steps must be at least 1")
    command = " ".join(["python3", "benchmarks/fsdp_host_cost.py", *(argv if argv is not None else sys.argv[1:])])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dtype = torch.float16 if a.t4 else torch.bfloat16
        layers = a.layers if a.layers is not None else 40 if a.model.startswith("tiny:") else 0
        path = model_path(a.model, layers, dtype, tmp)
        for variant in variants:
            job = Job(
                variant, path, a.seq_len, a.batch, a.warmup, a.steps, a.profile_steps, a.four_bit, a.t4, a.stats_dir
            )
            rows.append(measure(job, a.gpus))
            if a.out:
                a.out.write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    env = host.environment()
    text = markdown(rows, command, env)
    print(text)
    if a.out:
        a.out.write_text(json.dumps({"command": command, "environment": env, "rows": rows}, indent=1))
    if a.md:
        a.md.write_text(text)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
