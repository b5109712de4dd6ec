r"""FSDP-QLoRA on N GPUs against the same model split over them in one process (device_map="balanced").

Two runs of transformers' Trainer on the same model, LoRA (r=16 on the q/k/v/o/gate/up/down projections),
sequence length and examples per optimizer step:

- `fsdp`: nbkit.launch(gpus=N) with NBKIT_STRATEGY=fsdp (nbkit.fsdp: accelerate's FSDP2, full sharding,
  activation checkpointing), each rank training `--batch` sequences per step; 4-bit weights stored in the
  compute dtype (nbkit.fsdp.qlora_config) so that FSDP shards them;
- `balanced`: one process, `device_map="balanced"` over the same N GPUs (unsloth's way for large models on
  Kaggle's 2x T4), `--batch` x N sequences per step, the GPUs taking turns; under `--t4` this process runs
  `nbkit.emulate("T4")`, as notebooks/model_parallel.ipynb does with its `emulate` parameter.

Both use nbkit's chunked loss (no full logits), the planner's assumption. `--t4` is the T4 profile: fp16,
each GPU capped at 15 GiB (torch's per-process memory fraction; NBKIT_EMULATE=T4 is also set for what the
ranks read of it). The ranks get nbkit's allocator settings (nbkit.launching.rank_contract.allocator_environment); the
balanced process is given the same, so that both sides run on the same allocator. The sequences come from a
pool of one step's worth, drawn again every step, so that a run that trains shows a falling loss.

Per run: the median step time over the timed steps (benchmarks.measures.step_stats; the first `--warmup`
steps are left out), tokens/s over all GPUs, the losses and gradient norms Trainer logged, and per GPU the
peak allocated memory while loading and sharding (up to Trainer's on_train_begin) and while training, the
peak reserved memory and the allocator's retries (cache flushes when an allocation did not fit), against
the planner's estimates of both peaks (Plan.fsdp_load_gib and Plan.fsdp_breakdown / model_parallel_gib,
without the CUDA overhead); and nvidia-smi's utilisation of every GPU sampled every 100 ms over the timed
steps: the mean per GPU and the share of samples with all GPUs above 50%.
With `--gpus 1` it is a dry run: FSDP with world size 1 against the model on one GPU.

    python3 benchmarks/fsdp_vs_balanced.py --model random:qwen3-14b --gpus 2 --t4 --seq-len 1024 --batch 1 \
        --out $OUT/fsdp_vs_balanced.json --md $OUT/fsdp_vs_balanced.md

Rows go to --out as JSON lines as soon as each run ends (a run that fails is a row with its error).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: the package lives one level up
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from benchmarks import batches, gpu_state, host, measures  # noqa: E402
from benchmarks.trainer_bench import TEXT_LORA, _timer_callback  # noqa: E402
from nbkit.launching import rank_contract  # noqa: E402

T4_MEMORY_GIB = 15.0
LORA_RANK = 16
LEARNING_RATE = 1e-3
# nvidia-smi's sampling period (ms), and the utilisation above which a GPU counts as busy.
SAMPLE_MS = 100
BUSY_PERCENT = 50


@dataclass(frozen=True)
class Run:
    """One side of the comparison."""

    mode: str  # "fsdp" | "balanced"
    model: str
    gpus: int
    seq_len: int
    batch: int  # sequences per step per FSDP rank; the balanced process takes batch x gpus
    steps: int
    warmup: int
    load_in_4bit: bool
    t4: bool
    profile_dir: str | None = None  # profile the last step (left out of the median) and write rank 0's table here
    compile: str | None = "auto"  # nbkit.savers.apply's compile: "auto" (none for a 4-bit FSDP rank), "regional", None
    storage: str = "compute"  # 4-bit weights stored in the compute dtype (sharded), or "uint8" (bitsandbytes' own)
    dtype: str | None = None  # "fp16" / "bf16" / "fp32"; None: fp16 under the T4 profile, else nbkit's choice
    by_layer: bool = False  # LoRA weight and gradient norms by layer at every step (a few ms of syncs per step)
    memory_steps: int = 0  # record the allocator's history over the first steps: what was live at their peak

    @property
    def precision(self) -> str:
        from nbkit.platform import distributed

        if self.dtype is not None:
            return self.dtype
        return "fp16" if self.t4 else distributed.precision()


def _dtype(run: Run) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(run.precision, torch.float32)


def _cap(device: int) -> None:
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, T4_MEMORY_GIB * 2**30 / total), device)


def _model(run: Run, path: str) -> Any:
    """The model with LoRA and nbkit's chunked loss, loaded for `run.mode`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from nbkit.training import fsdp, savers

    dtype = _dtype(run)
    options: dict[str, Any] = {"dtype": dtype}
    if run.load_in_4bit:
        options["quantization_config"] = fsdp.qlora_config(dtype)
        if run.storage == "uint8":  # accelerate leaves such weights unsharded: a full 4-bit copy per GPU
            options["quantization_config"].bnb_4bit_quant_storage = torch.uint8
    if run.mode == "balanced":
        options["device_map"] = "balanced"
        if run.t4:
            options["max_memory"] = {i: f"{T4_MEMORY_GIB:g}GiB" for i in range(run.gpus)}
    base = AutoModelForCausalLM.from_pretrained(path, **options)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, target_modules=TEXT_LORA))
    # FSDP checkpoints the layers itself; the balanced run checkpoints them with nbkit's savers.
    checkpointing = None if run.mode == "fsdp" else "recompute"
    return savers.apply(model, checkpointing=checkpointing, tiled_mlp=False, chunked_loss=True, compile=run.compile)


def _train(run: Run, path: str, per_step: int) -> dict:
    """A Trainer run of run.steps steps of `per_step` sequences in this process; this process's figures."""
    from transformers import AutoConfig, Trainer, TrainingArguments

    cuda = torch.cuda.is_available()  # without: a CPU smoke run (gloo ranks, no peaks)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    devices = [torch.device("cuda", i) for i in range(run.gpus)] if run.mode == "balanced" and cuda else [device]
    for each in devices:
        measures.reset_memory(each)
    model = _model(run, path)
    config = AutoConfig.from_pretrained(path)
    pool = [
        {k: v[0] for k, v in batches.synthetic_batch(config, run.seq_len, 1, "cpu", seed=i).items()}
        for i in range(per_step * (int(os.environ.get("WORLD_SIZE", "1")) if run.mode == "fsdp" else 1))
    ]
    data = pool * run.steps  # the same sequences again every step: the loss falls where training works
    timer = _timer_callback(device)
    phases = _phases_callback(devices, run.warmup)
    profiler = _profile_callback(devices, run)
    gradients = _gradient_callback(run)
    peaks = _peak_callback(devices, run.memory_steps)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=run.steps,
            per_device_train_batch_size=per_step,
            learning_rate=LEARNING_RATE,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            fp16=run.precision == "fp16",
            bf16=run.precision == "bf16",
            disable_tqdm=True,
            seed=0,
            use_cpu=not cuda,
        )
        if run.mode == "balanced":
            # One process drives the model. Trainer counts the GPUs it sees (n_gpu) for DataParallel, which it skips
            # for a 4-bit model, yet still multiplies the loss by that count where device_map left a small model
            # on one GPU (2x H100, Qwen3-1.7B shapes in 4-bit: every loss twice FSDP's); a split model sets it to 1.
            args._n_gpu = 1
        trainer = Trainer(
            model=model, args=args, train_dataset=data, callbacks=[timer, phases, profiler, gradients, peaks]
        )
        trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    scaler = trainer.accelerator.scaler
    return {
        "step_times_s": timer.times,
        "losses": [e["loss"] for e in logged],
        "grad_norms": [e.get("grad_norm") for e in logged],
        # fp16: the loss scale after the run (65536 halved once per skipped step) and the allocator settings
        "loss_scale": None if scaler is None else scaler.get_scale(),
        "alloc_conf": os.environ.get(rank_contract.ALLOC_CONF),
        "window": phases.window,
        "profile": profiler.summary,
        "squares": gradients.squares,
        "hidden": {i: float(v) for i, v in sorted(gradients.hidden.items())},
        "memory": [{**phases.loading[i], **_train_memory(each)} if cuda else None for i, each in enumerate(devices)],
        "at_peak": peaks.breakdowns,
    }


def _train_memory(device: torch.device) -> dict[str, float]:
    """Peak allocated and reserved GiB on `device` since on_train_begin, and the allocator's retries."""
    stats = torch.cuda.memory_stats(device)
    return {
        "train_allocated": torch.cuda.max_memory_allocated(device) / 2**30,
        "train_reserved": torch.cuda.max_memory_reserved(device) / 2**30,
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
    }


def _profile_callback(devices: list[torch.device], run: Run) -> Any:
    """A TrainerCallback that profiles the last step where run.profile_dir is set: milliseconds of GPU kernels by
    kind (NCCL, copies, compute) summed over this process's GPUs against the step's wall time, and on rank 0 (or
    the balanced process) the op table in run.profile_dir. A profiler that fails is recorded, not raised.
    """
    from transformers import TrainerCallback

    from benchmarks.profiling import HOST_SYNCS, device_us, split_events

    class StepProfile(TrainerCallback):
        def __init__(self) -> None:
            self.summary: dict[str, Any] | None = None
            self._profiler: Any = None
            self._start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if run.profile_dir is None or state.global_step != run.steps - 1:
                return
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if devices[0].type == "cuda" else [])
            try:
                self._profiler = profile(activities=activities)
                self._profiler.__enter__()
            except Exception as exc:  # recorded: the run goes on without it
                self.summary, self._profiler = {"error": f"{type(exc).__name__}: {exc}"}, None
            self._start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._profiler is None:
                return
            try:
                for each in devices:
                    if each.type == "cuda":
                        torch.cuda.synchronize(each)
                wall_ms = (time.perf_counter() - self._start) * 1000
                self._profiler.__exit__(None, None, None)
                self.summary = _kernel_summary(self._profiler.key_averages(), wall_ms, len(devices))
                if int(os.environ.get("RANK", "0")) == 0:
                    out = Path(str(run.profile_dir))
                    out.mkdir(parents=True, exist_ok=True)
                    averages = self._profiler.key_averages()
                    # Both orders: an FSDP step whose kernels fill a fraction of its time is bound by the host,
                    # and what holds the host shows only in the CPU order (2x H100: 2.2 s of CPU, 0.4 s of kernels).
                    tables = [
                        averages.table(sort_by=key, row_limit=30)
                        for key in ("self_device_time_total", "self_cpu_time_total")
                    ]
                    (out / f"{run.mode}.txt").write_text(
                        json.dumps(self.summary, indent=1) + "\n" + "\n".join(tables) + "\n"
                    )
            except Exception as exc:  # recorded: the run goes on without it
                self.summary = {"error": f"{type(exc).__name__}: {exc}"}
            self._profiler = None

    def _kernel_summary(averages: Any, wall_ms: float, gpus: int) -> dict[str, Any]:
        kinds = {"nccl": 0.0, "memcpy": 0.0, "compute": 0.0}
        for event in split_events(averages)[0]:
            name = event.key.lower()
            kind = "nccl" if "nccl" in name else "memcpy" if name.startswith(("memcpy", "memset")) else "compute"
            kinds[kind] += device_us(event) / 1000
        busy = 100 * kinds["compute"] / (wall_ms * gpus) if wall_ms else 0.0
        host = split_events(averages)[1]
        return {
            "step_ms": wall_ms,
            **{f"{k}_ms": round(v, 1) for k, v in kinds.items()},
            "compute_busy_pct": busy,
            "host_ops_ms": round(sum(e.self_cpu_time_total for e in host) / 1000, 1),
            "host_syncs": sum(e.count for e in host if e.key in HOST_SYNCS),
        }

    return StepProfile()


def _gradient_callback(run: Run) -> Any:
    """A TrainerCallback that keeps, at each optimizer step (after Trainer unscaled and clipped), the sum of squares
    of this process's LoRA weights and gradients by decoder layer and by A/B, {"layer.A": [weights, gradient]}; an
    FSDP rank sums its own shards (the sums over ranks are the whole model's). A step whose gradients are not finite
    is kept too: which layers first overflow is part of the answer.
    """
    import re

    from transformers import TrainerCallback

    layer = re.compile(r"layers\.(\d+)\..*lora_([AB])")
    block = re.compile(r"layers\.(\d+)(\._checkpoint_wrapped_module)?$")

    class Squares(TrainerCallback):
        def __init__(self) -> None:
            self.squares: list[dict[str, list[float]]] = []
            # Each decoder layer's output RMS in the first forward (this process's sequences): weights that
            # load or gather wrong show here before any gradient does.
            self.hidden: dict[int, Any] = {}
            self._hooks: list[Any] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if not run.by_layer:
                return
            for name, module in model.named_modules():
                found = block.search(name)
                if found is None or isinstance(getattr(module, "_checkpoint_wrapped_module", None), torch.nn.Module):
                    continue
                index = int(found[1])

                def keep(module: Any, args: Any, output: Any, index: int = index) -> None:
                    out = output[0] if isinstance(output, tuple) else output
                    if index not in self.hidden and torch.is_tensor(out):
                        self.hidden[index] = out.detach().float().square().mean().sqrt()

                self._hooks.append(module.register_forward_hook(keep))

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if not run.by_layer:
                return
            sums: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for name, p in model.named_parameters():
                found = layer.search(name)
                if found is None or not p.requires_grad:
                    continue
                weights, grads = sums.setdefault(f"{found[1]}.{found[2]}", ([], []))
                weights.append(_local(p).detach().float().square().sum())
                if p.grad is not None:
                    grads.append(_local(p.grad).float().square().sum())
            self.squares.append({k: [float(sum(w)), float(sum(g))] for k, (w, g) in sums.items()})
            for hook in self._hooks:
                hook.remove()
            self._hooks = []

    return Squares()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter or gradient (a DTensor), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def _phases_callback(devices: list[torch.device], warmup: int) -> Any:
    """A TrainerCallback that keeps, per device, the peak memory of loading and sharding (Trainer shards before
    on_train_begin) and then resets the peak counters (not the cache: a fragmented cache is part of the
    result); and the wall-clock window of the timed steps (after `warmup` steps), for the utilisation samples.
    """
    from transformers import TrainerCallback

    class Phases(TrainerCallback):
        def __init__(self) -> None:
            self.loading: list[dict[str, float]] = [{} for _ in devices]
            self.window: list[float] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            for i, each in enumerate(devices):
                if each.type == "cuda":
                    self.loading[i] = {
                        "load_allocated": torch.cuda.max_memory_allocated(each) / 2**30,
                        "load_reserved": torch.cuda.max_memory_reserved(each) / 2**30,
                    }
                    torch.cuda.reset_peak_memory_stats(each)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == warmup:
                self.window = [time.time()]

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.window = [*self.window[:1], time.time()]

    return Phases()


def _peak_callback(devices: list[torch.device], steps: int) -> Any:
    """A TrainerCallback that records the allocator's history on `devices` over the first `steps` steps (after the
    phases callback's reset, before the timed steps) and keeps, per device, what was live at their peak
    (benchmarks.memory_at_peak); nothing where steps is 0 or there is no GPU.
    """
    from transformers import TrainerCallback

    from benchmarks import memory_at_peak

    recorded = steps > 0 and all(d.type == "cuda" for d in devices)

    class Peaks(TrainerCallback):
        def __init__(self) -> None:
            self.before: dict[int, int] = {}
            self.breakdowns: dict[int, dict[str, Any]] = {}

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if recorded:
                self.before = memory_at_peak.start(devices)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.before and state.global_step == steps:
                self.breakdowns = memory_at_peak.stop(self.before)
                self.before = {}

    return Peaks()


def _fsdp_rank(run: Run, path: str) -> list[dict]:
    """One FSDP rank (under nbkit.launch): capped like a T4 where asked; every rank's figures, on rank 0."""
    from benchmarks.ranks import gather

    if run.t4 and torch.cuda.is_available():
        _cap(int(os.environ.get("LOCAL_RANK", "0")))
    return gather(_train(run, path, run.batch))


def _measure(run: Run) -> dict:
    """Run one side; its row (status "ok", or "oom"/"error" with the message)."""
    import nbkit

    path = nbkit.resolve_model(run.model)
    row: dict[str, Any] = asdict(run) | {"precision": run.precision}
    sampler = _UtilisationSampler()
    try:
        with sampler:
            if run.mode == "fsdp":
                env = {"NBKIT_STRATEGY": "fsdp", **({"NBKIT_EMULATE": "T4"} if run.t4 else {})}
                ranks = nbkit.launch(_fsdp_rank, run, path, gpus=run.gpus, env=env, timeout=3600, dashboard=False)
            else:
                if run.t4:  # as the model_parallel notebook does under the T4 profile (its `emulate` parameter)
                    nbkit.emulate("T4")
                ranks = [_train(run, path, run.batch * run.gpus)]
    except Exception as exc:  # recorded: the other side still runs
        oom = "out of memory" in str(exc).lower()
        where = "".join(traceback.format_tb(exc.__traceback__)[-4:])
        return row | {
            "status": "oom" if oom else "error",
            "error": f"{type(exc).__name__}: {exc}"[-2000:],
            "where": where[-3000:],
        }
    finally:
        gc.collect()
    first = ranks[0]
    timed = first["step_times_s"][run.warmup : -1 if run.profile_dir else None]  # the profiled step is left out
    stats = measures.step_stats(timed)
    memory = [m for rank in ranks for m in rank["memory"] if m is not None]
    losses = first["losses"]
    return row | {
        "status": "ok",
        "median_step_s": stats["median"],
        "step_stats": stats,
        "tokens_per_s": run.seq_len * run.batch * run.gpus / stats["median"],  # the same tokens per step in both
        "losses": losses,
        "grad_norms": first["grad_norms"],
        "by_layer": _by_layer([rank["squares"] for rank in ranks]) if run.by_layer else None,
        "hidden_rms": first["hidden"] if run.by_layer else None,
        "loss_scale": first["loss_scale"],
        "profile": [rank["profile"] for rank in ranks],
        "alloc_conf": [rank["alloc_conf"] for rank in ranks],
        "trains": bool(losses) and all(math.isfinite(x) and x > 0 for x in losses) and losses[-1] < losses[0],
        "memory": memory,
        "at_peak": [rank["at_peak"] for rank in ranks],
        "peak_allocated_gib": [max(m["load_allocated"], m["train_allocated"]) for m in memory],
        "utilisation": sampler.summary(*first["window"]) if len(first["window"]) == 2 else None,
        **_planned(run),
    }


def _by_layer(ranks: list[list[dict[str, list[float]]]]) -> list[dict[str, list[float]]]:
    """Per optimizer step, {"layer.A": [weight norm, gradient norm]} of the whole model: the ranks' sums of squares
    added (an FSDP rank holds a shard of each) and square-rooted.
    """
    steps = []
    for per_rank in zip(*ranks):
        keys = sorted(per_rank[0], key=lambda k: (int(k.split(".")[0]), k))
        steps.append({k: [math.sqrt(sum(r[k][i] for r in per_rank)) for i in (0, 1)] for k in keys})
    return steps


class _UtilisationSampler:
    """nvidia-smi's utilisation of every GPU this process may use (CUDA_VISIBLE_DEVICES: on a shared host the
    others run someone else's work), every SAMPLE_MS ms, while the `with` block runs (nothing where there is
    no nvidia-smi). It runs in this process and never touches CUDA.
    """

    def __init__(self) -> None:
        self.samples: list[tuple[float, list[int]]] = []  # (time, utilisation % of each GPU)
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._ids: list[str] = []

    def __enter__(self) -> _UtilisationSampler:
        exe = shutil.which("nvidia-smi")
        gpus = gpu_state.GpuSample.take()
        if exe is not None and gpus is not None:
            self._ids = [str(i) for i in gpus.indices]
            query = [
                exe,
                f"--id={','.join(self._ids)}",
                "--query-gpu=index,utilization.gpu",
                "--format=csv,noheader,nounits",
                f"--loop-ms={SAMPLE_MS}",
            ]
            self._process = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        current: list[int] = []
        for line in self._process.stdout:
            index, _, busy = line.partition(",")
            if not busy.strip().isdigit():
                continue
            if index.strip() == self._ids[0] and current:
                self.samples.append((time.time(), current))
                current = []
            current.append(int(busy))

    def __exit__(self, *exc: Any) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=10)

    def summary(self, start: float, end: float) -> dict[str, Any] | None:
        """Mean utilisation per GPU and the share of samples with every GPU above BUSY_PERCENT, within [start, end]."""
        inside = [busy for at, busy in self.samples if start <= at <= end]
        if not inside:
            return None
        gpus = min(len(busy) for busy in inside)
        return {
            "samples": len(inside),
            "mean_percent": [round(sum(b[i] for b in inside) / len(inside), 1) for i in range(gpus)],
            "all_busy_share": round(sum(all(x > BUSY_PERCENT for x in b[:gpus]) for b in inside) / len(inside), 3),
        }


def _planned(run: Run) -> dict[str, float | None]:
    """The planner's peak allocated memory per GPU for this run while training and (FSDP in 4-bit) while loading
    (its estimates less the CUDA overhead), and the larger of the two.
    """
    import nbkit

    plan = nbkit.plan(
        run.model,
        gpus=run.gpus,
        gpu_memory_gib=T4_MEMORY_GIB if run.t4 else 80.0,
        seq_len=run.seq_len,
        # The balanced process takes every GPU's sequences at once (_measure: the same tokens per step); planned
        # with one GPU's batch, its estimate read 22% under the measured peak (2x H100, 2026-11-27).
        batch_size=run.batch * (run.gpus if run.mode == "balanced" else 1),
        load_in_4bit=run.load_in_4bit,
        lora_rank=LORA_RANK,
        checkpointing="recompute",
    )
    if run.mode == "fsdp":
        train = plan.fsdp_gib - plan.fsdp_breakdown["overhead"]
        load = None if plan.fsdp_load_gib is None else _allocated(plan.fsdp_load_gib)
    else:
        train, load = plan.model_parallel_gib - plan.breakdown["overhead"], None
    return {"planned_train_gib": train, "planned_load_gib": load, "planned_gib": max(train, load or 0.0)}


def _allocated(total_gib: float) -> float:
    """A planner figure without its CUDA overhead (the context and the allocator's slack)."""
    from nbkit.notebook import planner

    return (total_gib - planner.CUDA_CONTEXT_GIB) / (1 + planner.ALLOCATOR_SLACK)


def markdown(rows: list[dict], command: str, env: dict) -> str:
    """The results as a markdown table, with the command and the machine."""
    v = env["versions"]
    lines = [
        f"`{command}`",
        "",
        f"{env['date']}, {env['gpu_count']} x {env['gpu']} ({env['gpu_memory_gib']} GiB), driver {env['driver']}; "
        f"torch {v['torch']}, transformers {v['transformers']}, accelerate {v['accelerate']}, peft {v['peft']}, "
        f"bitsandbytes {v['bitsandbytes']}, nbkit {v['nbkit']}.",
        "",
        "| run | model | GPUs | weights | seq x batch/GPU | s/step (median) | tokens/s (all GPUs) | loss first -> last | "
        "peak GiB per GPU: loading / training (planned) | allocator retries | GPU busy % (all > 50%) | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        weights = f"{'4-bit' if r['load_in_4bit'] else '16-bit'} {r['precision']}"
        if r["status"] != "ok":
            lines.append(
                f"| {r['mode']} | {r['model']} | {r['gpus']} | {weights} | {r['seq_len']} x {r['batch']} | - | - | - | - | - | - | "
                f"{r['status']}: {r.get('error', '')[:160]} |"
            )
            continue
        lines.append(
            f"| {r['mode']} | {r['model']} | {r['gpus']} | {weights} | {r['seq_len']} x {r['batch']} | {r['median_step_s']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {_losses(r['losses'])} | {_memory(r)} | "
            f"{', '.join(str(m['alloc_retries']) for m in r['memory']) or '-'} | {_busy(r['utilisation'])} | "
            f"{'trains' if r['trains'] else 'does not train'} |"
        )
    fsdp, balanced = ({r["mode"]: r for r in rows if r["status"] == "ok"}.get(m) for m in ("fsdp", "balanced"))
    if fsdp and balanced:
        lines += ["", f"FSDP / balanced tokens/s: {fsdp['tokens_per_s'] / balanced['tokens_per_s']:.2f}x."]
        same = agreement(fsdp, balanced)
        norms = same["grad_norm_ratio"]
        lines.append(
            f"The same training? First loss {same['first_loss_difference']:+.2%} (FSDP against balanced); steps the fp16 "
            f"loss scaler skipped: {same['skipped'][0]} against {same['skipped'][1]}; gradient norm at the first step "
            f"both took: " + ("-" if norms is None else f"{norms:.3g}x") + "."
        )
    for r in rows:
        if r["status"] == "ok" and r["peak_allocated_gib"]:
            error = r["planned_gib"] / max(r["peak_allocated_gib"]) - 1
            lines.append(f"{r['mode']}: the planner's peak {r['planned_gib']:.2f} GiB is {error:+.0%} of the measured.")
    for r in rows:
        for rank, profile in enumerate(r.get("profile") or []):
            if profile and "error" not in profile:
                lines.append(
                    f"{r['mode']} process {rank}, profiled last step: {profile['step_ms']:.0f} ms, GPU kernels "
                    f"{profile['compute_ms']:.0f} ms compute, {profile['nccl_ms']:.0f} ms NCCL, "
                    f"{profile['memcpy_ms']:.0f} ms copies (compute {profile['compute_busy_pct']:.0f}% of its GPUs' time)."
                )
            elif profile:
                lines.append(f"{r['mode']} process {rank}: profiler failed: {profile['error'][:160]}")
    for r in rows:
        for rank, devices in enumerate(r.get("at_peak") or []):
            for device, peak in devices.items():
                origins = "; ".join(f"{o['origin']} {o['gib']:.2f}" for o in peak["origins"][:8])
                lines.append(
                    f"{r['mode']} process {rank} GPU {device}, live at the first steps' peak of {peak['peak_gib']:.2f} "
                    f"GiB: {peak['before_gib']:.2f} from before them, {origins}; other {peak['other_gib']:.2f}"
                    + (" (the recording lost its oldest entries)" if peak["truncated"] else "")
                    + "."
                )
    return "\n".join(lines) + "\n"


def agreement(fsdp: dict, balanced: dict) -> dict:
    """Whether the two runs trained alike (they see the same sequences per optimizer step from the same weights).

    Returns {"first_loss_difference": FSDP's first loss over the balanced one's, minus 1 (before any update, so
    only arithmetic separates them); "skipped": the steps each run's fp16 loss scaler skipped (non-finite gradient
    norm); "grad_norm_ratio": FSDP's gradient norm over the balanced one's at the first step where both are
    finite (None where there is none)}.
    """

    def finite(norm: float | None) -> bool:
        return norm is not None and math.isfinite(norm)

    pairs = list(zip(fsdp["grad_norms"], balanced["grad_norms"]))
    both = next(((f, b) for f, b in pairs if finite(f) and finite(b) and b), None)
    return {
        "first_loss_difference": fsdp["losses"][0] / balanced["losses"][0] - 1,
        "skipped": tuple(sum(not finite(n) for n in r["grad_norms"]) for r in (fsdp, balanced)),
        "grad_norm_ratio": None if both is None else both[0] / both[1],
    }


def _losses(losses: list[float]) -> str:
    return f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "-"


def _memory(r: dict) -> str:
    measured = "; ".join(f"{m['load_allocated']:.2f} / {m['train_allocated']:.2f}" for m in r["memory"]) or "-"
    load = "-" if r["planned_load_gib"] is None else f"{r['planned_load_gib']:.2f}"
    return f"{measured} ({load} / {r['planned_train_gib']:.2f})"


def _busy(utilisation: dict | None) -> str:
    if not utilisation:
        return "-"
    return f"{', '.join(f'{x:.0f}' for x in utilisation['mean_percent'])} ({utilisation['all_busy_share']:.0%})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:qwen3-14b", help="nbkit name, hub id or path (a causal LM)")
    p.add_argument("--gpus", type=int, default=2, help="GPUs for both runs (1: the dry run)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1, help="sequences per FSDP rank per step (balanced: x gpus)")
    p.add_argument("--steps", type=int, default=8, help="Trainer steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    p.add_argument("--16bit", dest="four_bit", action="store_false", help="16-bit weights instead of 4-bit")
    p.add_argument("--t4", action="store_true", help="the T4 profile: fp16, 15 GiB per GPU")
    p.add_argument("--modes", default="fsdp,balanced", help="which runs, in order (fsdp first: no CUDA before it)")
    p.add_argument("--out", type=Path, required=True, help="JSON lines, one per run")
    p.add_argument("--md", type=Path, help="markdown table")
    p.add_argument("--profile-dir", help="profile each run's last step (left out of the median); op tables here")
    p.add_argument(
        "--compile",
        choices=["auto", "regional", "none"],
        default="auto",
        help="nbkit.savers.apply's compile (auto: none for a 4-bit model in an FSDP rank, regional for a 16-bit one)",
    )
    p.add_argument(
        "--storage",
        choices=["compute", "uint8"],
        default="compute",
        help="the packed 4-bit weights' dtype: the compute dtype (FSDP shards them) or uint8 (FSDP leaves them whole)",
    )
    p.add_argument(
        "--precision",
        choices=["fp16", "bf16", "fp32"],
        help="the training precision of both runs (default: fp16 under --t4, else bf16 where the GPU has it)",
    )
    p.add_argument(
        "--by-layer",
        action="store_true",
        help="record the LoRA weights' and gradients' norms by decoder layer at every step (whether both runs train "
        "the same layers alike)",
    )
    p.add_argument(
        "--memory-steps",
        type=int,
        default=0,
        help="record the allocator's history over this many first steps (at most --warmup: recording slows them) "
        "and report what was live at their peak, by the code that allocated it",
    )
    args = p.parse_args(argv)
    if args.warmup >= args.steps - (1 if args.profile_dir else 0):
        p.error("--warmup must be below --steps (the median needs timed steps; a profiled last step is not one)")
    if args.memory_steps > args.warmup:
        p.error("--memory-steps must be at most --warmup: the recorded steps are slower, so none may be timed")
    rows = []
    for mode in args.modes.split(","):
        if mode == "balanced":  # the allocator settings nbkit gives its ranks, for a like-for-like comparison
            os.environ.update(rank_contract.allocator_environment(os.environ))
        run = Run(
            mode,
            args.model,
            args.gpus,
            args.seq_len,
            args.batch,
            args.steps,
            args.warmup,
            args.four_bit,
            args.t4,
            None if args.profile_dir is None else str(args.profile_dir),
            None if args.compile == "none" else args.compile,
            args.storage,
            args.precision,
            args.by_layer,
            args.memory_steps,
        )
        row = _measure(run)
        rows.append(row)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k != "step_stats"}), flush=True)
    if args.md:
        args.md.write_text(markdown(rows, " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), host.environment()))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
