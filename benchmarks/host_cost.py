r"""What a Trainer step spends outside the model's forward and backward: collectives, host reads, time.

    python benchmarks/host_cost.py [--variants hf,hf+noreport,sft,sft+noreport] [--shape 128x4] \
        [--steps 8] [--profile-steps 3] [--gpus 2] [--launcher nbkit|live] [--out host_cost.json] [--md host_cost.md]

Runs `--gpus` ranks under nbkit.launch, or in a live set with `--launcher live` (gloo CPU ranks where no GPU is
visible), builds the model of benchmarks/trainer_bench.py once per rank (`--backend`, default
transformers+peft+nbkit.savers; unsloth on GPUs), and trains it once per variant, each with its own Trainer built
by trainer_bench (the flagship's options: logging_steps=1, gradient_accumulation_steps=1). A variant is a trainer,
`sft` (TRL SFTTrainer) or `hf` (transformers Trainer), plus options joined by "+":

- `noreport`: without nbkit's reporting patches (the dashboard callback and its Trainer.training_step
  hook, which nbkit.launch adds to every Trainer), to see what they add;
- `nanfilter_off`: TrainingArguments(logging_nan_inf_filter=False) (Trainer reads the loss on the host
  each micro-step to filter NaN/inf out of the logged loss);
- `log10`: logging_steps=10 instead of 1;
- `nobcast`: TrainingArguments(ddp_broadcast_buffers=False) (DDP broadcasts the model's buffers, Qwen3-VL's
  rotary frequencies among them, from rank 0 before every forward).

Variants share the model: SFTTrainer patches the model's forward at __init__ (TRL's chunked or fused LM head) and
the patch stays, so list `hf` variants first where Trainer alone matters.

Per optimizer step, on rank 0, after `--warmup` steps:
- time: the step's wall time (on_step_begin to the next on_step_begin, CUDA synchronised at both
  ends on GPUs), the model's forward (hooks on the PEFT model) and `accelerator.backward` (DDP's
  gradient all-reduce included), and the rest ("outside"): data, loss bookkeeping, metrics,
  optimizer, logging, callbacks. `--steps` steps, no profiler. On GPUs forward and backward are host times: the
  host queues kernels, and waits inside them only where something reads a GPU tensor's value.
- under torch.profiler, `--profile-steps` more steps: collectives (`gloo:*` / `nccl:*` events; those issued from
  Python also as `c10d::*` ops with their caller; DDP's gradient all-reduce runs in C++ and has none) and
  host reads of a tensor's value (`aten::_local_scalar_dense`: `.item()`, `if tensor`, `float(tensor)`),
  each attributed to the first Python frame outside torch and accelerate; on GPUs the CUDA runtime's
  synchronising calls (cudaStreamSynchronize, ...), which is what blocks the host (the harness's one
  torch.cuda.synchronize at the end of the profiled steps included: 1/profile-steps per step);
- on CPUs, in the same steps, ValueReads: every Python-level call that needs a tensor's values on the host
  (`.item()`, `.tolist()`, `bool(tensor)`, `.numpy()`, `nonzero`, boolean-mask indexing, `repeat_interleave`
  by a tensor) with its caller. On a GPU each such call on a GPU tensor waits for the GPU; on a CPU none
  waits, and tensors that stay on the host on a GPU run too (the collator's, the optimizer's step counters)
  are counted alike: read the callers.

On a CPU the times are CPU times of a tiny model on shared cores, not GPU timings: there the counts are the
result. torch 2.13's profiler with with_stack=True now and then kills a rank (SIGSEGV, SIGABRT, or an event name
read from freed memory; benchmarks/RESULTS.md says how often): run it again.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: the package lives in ROOT
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from benchmarks import host, trainer_bench  # noqa: E402
from benchmarks.profiling import HOST_SYNCS, device_us, split_events  # noqa: E402

OPTIONS = {
    "noreport": {},
    "nanfilter_off": {"logging_nan_inf_filter": False},
    "log10": {"logging_steps": 10},
    "nobcast": {"ddp_broadcast_buffers": False},
}
# Frames skipped when attributing an event to the code that caused it.
LIBRARY_FRAMES = ("torch/", "accelerate/utils/", "accelerate/accelerator.py", "contextlib.py", "host_cost.py")


# Python-level calls that need a tensor's values on the host (item, tolist, bool(tensor), ...) or size their
# output by them (nonzero, boolean-mask indexing, repeat_interleave by a tensor): each one waits for the GPU
# when the tensor lives there.
VALUE_CALLS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"})
VALUE_SHAPED = frozenset({"masked_select", "unique", "unique_consecutive", "repeat_interleave"})


def _caller() -> str:
    """The innermost Python frame outside torch, accelerate and this file ("path(line): function")."""
    frame = sys._getframe(2)
    while frame is not None:
        name = f"{frame.f_code.co_filename}({frame.f_lineno}): {frame.f_code.co_name}"
        if not any(part in name for part in LIBRARY_FRAMES):
            return name.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
        frame = frame.f_back
    return "no Python frame"


def _value_call(name: str, args: tuple, kwargs: dict) -> bool:
    if name in VALUE_CALLS:
        return True
    if name in VALUE_SHAPED:
        return name != "repeat_interleave" or isinstance(
            args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor
        )
    if name in ("__getitem__", "__setitem__") and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


class ValueReads(TorchFunctionMode):
    """Counts, by caller, the Python-level calls of VALUE_CALLS / VALUE_SHAPED made while it is active.

    Used on CPUs, where no call waits for anything: it says which calls would wait for the GPU there.
    `.tolist()` and boolean-mask indexing never reach the profiler as `aten::_local_scalar_dense`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _value_call(name, args, kwargs):
            self.counts[f"{name} <- {_caller()}"] += 1
        return func(*args, **kwargs)


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`sft+noreport` -> ("sft", ["noreport"]). Raises ValueError for an unknown trainer or option."""
    trainer, *options = text.split("+")
    if trainer not in ("sft", "hf") or any(o not in OPTIONS for o in options):
        raise ValueError(f"{text!r}: use sft|hf[+option...], options {sorted(OPTIONS)}")
    return trainer, options


def _probe(device: torch.device, model: Any, warmup: int, steps: int, profile_steps: int) -> Any:
    """A TrainerCallback that times steps warmup..warmup+steps, then profiles the next `profile_steps`."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.fwd = self.bwd = 0.0
            self.marks: dict[str, Any] = {}
            self.profiler: Any = None
            self.values = ValueReads() if device.type == "cpu" else None
            self._fwd_start = 0.0
            self.hooks = [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]

        def _before(self, *_: Any) -> None:
            self._fwd_start = time.perf_counter()

        def _after(self, *_: Any) -> None:
            self.fwd += time.perf_counter() - self._fwd_start

        def timed_backward(self, backward: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return backward(*args, **kwargs)
                finally:
                    self.bwd += time.perf_counter() - start

            return wrapped

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == warmup:
                sync()
                self.marks["start"] = (time.perf_counter(), self.fwd, self.bwd)
            elif state.global_step == warmup + steps:
                sync()
                self.marks["end"] = (time.perf_counter(), self.fwd, self.bwd)
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                self.profiler = profile(activities=activities, with_stack=True)
                self.profiler.start()
                if self.values is not None:
                    self.values.__enter__()
            elif state.global_step == warmup + steps + profile_steps:
                sync()
                if self.values is not None:
                    self.values.__exit__(None, None, None)
                self.profiler.stop()

    return Probe()


def _origin(event: Any) -> str:
    """Where a profiler event came from: the first Python frame above it outside torch and accelerate,
    and the innermost Python frame when that is another one ("caller <- innermost").

    With with_stack=True this torch records Python calls as events of their own, the op's CPU parents.
    """
    frames = []
    parent = event.cpu_parent
    while parent is not None:
        if "): " in parent.name and not parent.name.startswith("<built-in") and "host_cost.py" not in parent.name:
            frames.append(parent.name.split("site-packages/")[-1])
        parent = parent.cpu_parent
    if not frames:
        return "no Python frame"
    caller = next((f for f in frames if not any(part in f for part in LIBRARY_FRAMES)), frames[-1])
    return caller if caller == frames[0] else f"{caller} <- {frames[0]}"


def _counts(prof: Any, steps: int) -> dict[str, Any]:
    """Per step: collectives and host reads by kind and by origin; CUDA syncs on GPUs.

    A collective is counted once, by its gloo/nccl event (DDP's gradient all-reduce included, which
    runs in C++); those that Python code issued also have a c10d op on the calling thread, whose
    origin is listed.
    """
    kinds: collections.Counter[str] = collections.Counter()
    origins: collections.Counter[str] = collections.Counter()
    ops = 0
    for event in prof.events():
        name = event.name
        # Outermost aten ops: each one dispatched from Python or from compiled code, on a GPU about one
        # kernel launch (or a few) of host work; regional compilation replaces most of a layer's with one call.
        if name.startswith("aten::") and (event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")):
            ops += 1
        if name.startswith(("gloo:", "nccl:")):
            kinds["collective " + name] += 1
            continue
        if (
            name.startswith("c10d::")
            and event.cpu_parent is not None
            and not event.cpu_parent.name.startswith("c10d::")
        ):
            kind = "c10d op " + name
        elif name == "aten::_local_scalar_dense":
            kind = "host read"
        elif name in HOST_SYNCS:
            kind = "cuda sync " + name
        else:
            continue
        kinds[kind] += 1
        origins[f"{kind} <- {_origin(event)}"] += 1
    return {
        **_device_work(prof, steps),
        "collectives_per_step": sum(v for k, v in kinds.items() if k.startswith("collective")) / steps,
        "host_reads_per_step": kinds["host read"] / steps,
        "cuda_syncs_per_step": sum(v for k, v in kinds.items() if k.startswith("cuda sync")) / steps,
        "aten_ops_per_step": ops / steps,
        "by_kind_per_step": {k: v / steps for k, v in sorted(kinds.items())},
        "by_origin_per_step": {k: v / steps for k, v in sorted(origins.items(), key=lambda kv: -kv[1])},
    }


def _device_work(prof: Any, steps: int, top: int = 12) -> dict[str, Any]:
    """Per step: GPU kernel time and launches against the host's busiest ops, to say which side bounds it.

    "gpu_kernel_ms" sums every kernel's device time (kernels of one stream do not overlap, so against the step's
    wall time it is how busy the GPU was); "kernel_launches" counts the CUDA runtime's launch calls (host
    work per kernel); "top_host_ops" are the ops with the most self CPU time (all threads), "top_kernels" the
    kernels with the most device time. Empty without a GPU.
    """
    kernels, host = split_events(prof.key_averages())
    if not kernels:
        return {}
    launches = sum(e.count for e in host if "LaunchKernel" in e.key)
    by_host = sorted(host, key=lambda e: -e.self_cpu_time_total)[:top]
    by_kernel = sorted(kernels, key=lambda e: -device_us(e))[:top]
    return {
        "gpu_kernel_ms_per_step": sum(device_us(e) for e in kernels) / 1000 / steps,
        "kernel_launches_per_step": launches / steps,
        "top_host_ops": [(e.key[:90], e.count / steps, e.self_cpu_time_total / 1000 / steps) for e in by_host],
        "top_kernels": [(e.key[:90], e.count / steps, device_us(e) / 1000 / steps) for e in by_kernel],
    }


def run(
    launch: trainer_bench.Launch, variants: list[str], warmup: int, steps: int, profile_steps: int, out: str | None
) -> list[dict]:
    """Each rank: build the model once, train it once per variant; returns rank 0's figures, which rank 0
    also writes to `out` after each variant (a launch stopped by a time limit keeps what it measured).
    """
    import nbkit

    cuda = launch.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # forked CPU ranks (see trainer_bench.run)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = trainer_bench.build_model(launch, device)
    (seq_len, batch) = launch.shapes[0]
    rows = []
    for variant in variants:
        trainer_kind, options = parse_variant(variant)
        launch.trainer = trainer_kind
        launch.trainer_options = {k: v for o in options for k, v in OPTIONS[o].items()}
        if "noreport" in options:
            nbkit.uninstall("reporting")
        probe = _probe(device, model, warmup, steps, profile_steps)
        with tempfile.TemporaryDirectory() as out_dir:
            trainer = trainer_bench._trainer(
                launch, model, seq_len, batch, warmup + steps + profile_steps + 1, out_dir, probe
            )
            trainer.accelerator.backward = probe.timed_backward(trainer.accelerator.backward)
            trainer.train()
            logged = [e for e in trainer.state.log_history if "loss" in e]
        for hook in probe.hooks:
            hook.remove()
        if "noreport" in options:
            nbkit.install("reporting")
        (t0, f0, b0), (t1, f1, b1) = probe.marks["start"], probe.marks["end"]
        step_ms = 1000 * (t1 - t0) / steps
        fwd_ms, bwd_ms = 1000 * (f1 - f0) / steps, 1000 * (b1 - b0) / steps
        rows.append(
            {
                "variant": variant,
                "step_ms": step_ms,
                "forward_ms": fwd_ms,
                "backward_ms": bwd_ms,
                "outside_ms": step_ms - fwd_ms - bwd_ms,
                "logged_keys": sorted(logged[-1]) if logged else [],
                **_counts(probe.profiler, profile_steps),
                "value_reads_per_step": sum(probe.values.counts.values()) / profile_steps if probe.values else None,
                "value_reads_by_origin_per_step": {
                    k: v / profile_steps for k, v in sorted(probe.values.counts.items(), key=lambda kv: -kv[1])
                }
                if probe.values
                else None,
            }
        )
        del trainer
        if out and int(os.environ.get("RANK", "0")) == 0:
            Path(out).write_text(json.dumps({"partial": True, "rows": rows}, indent=1))
    return rows


def markdown(env: dict, command: str, launch: trainer_bench.Launch, rows: list[dict]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    seq, batch = launch.shapes[0]
    lines = [
        f"Machine: {env['cpu_count']} CPUs, {env['gpu_count']} GPUs ({env['gpu']}); {versions}; "
        f"Python {env['python']}; {env['date']}.",
        f"Command: `{command}`",
        f"{launch.gpus} ranks, {launch.config.partition(':')[0]}, {launch.model}, {launch.precision}, {seq}x{batch} per rank, "
        f"{'one image per sample' if launch.image else 'text only'}; rank 0; per optimizer step.",
        "",
        "| variant | collectives | `_local_scalar_dense` | value calls (Python) | CUDA syncs | aten ops | step ms "
        "| forward ms | backward ms | outside ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        values = "" if r["value_reads_per_step"] is None else f"{r['value_reads_per_step']:g}"
        lines.append(
            f"| {r['variant']} | {r['collectives_per_step']:g} | {r['host_reads_per_step']:g} | {values} | "
            f"{r['cuda_syncs_per_step']:g} | {r['aten_ops_per_step']:g} | {r['step_ms']:.1f} | "
            f"{r['forward_ms']:.1f} | {r['backward_ms']:.1f} | "
            f"{r['outside_ms']:.1f} |"
        )
    for r in rows:
        if "gpu_kernel_ms_per_step" in r:
            lines += [
                "",
                f"{r['variant']}, per profiled step: GPU kernels {r['gpu_kernel_ms_per_step']:.1f} ms, "
                f"{r['kernel_launches_per_step']:g} kernel launches (profiled steps run slower than timed ones).",
                "",
                "| busiest host ops | calls | self CPU ms | | busiest kernels | calls | GPU ms |",
                "|---|---:|---:|---|---|---:|---:|",
            ]
            for (op, calls, ms), (kernel, kcalls, kms) in zip(r["top_host_ops"], r["top_kernels"]):
                lines.append(f"| `{op}` | {calls:g} | {ms:.2f} | | `{kernel}` | {kcalls:g} | {kms:.2f} |")
        lines += ["", f"{r['variant']}, per step, by origin (profiler):", ""]
        lines += [f"- {v:g} x {k}" for k, v in r["by_origin_per_step"].items()]
        if r["value_reads_by_origin_per_step"]:
            lines += ["", f"{r['variant']}, per step, value calls by caller:", ""]
            lines += [f"- {v:g} x {k}" for k, v in r["value_reads_by_origin_per_step"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="hf,hf+noreport,hf+nanfilter_off,sft,sft+noreport")
    p.add_argument(
        "--backend",
        default="transformers",
        help=f"one of {trainer_bench.BACKENDS}, a transformers one with +extras from {trainer_bench.EXTRAS}",
    )
    p.add_argument("--model", default=None, help="default: tiny:qwen3-vl on CPUs, random:qwen3-vl-2b on GPUs")
    p.add_argument("--shape", default=None, help="seq_len x batch per rank (default: 128x4 on CPUs, 1024x4 on GPUs)")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps, after the timed ones")
    p.add_argument("--no-image", action="store_true")
    p.add_argument(
        "--launcher",
        choices=("nbkit", "live"),
        default="nbkit",
        help="nbkit.launch, or a live set (nbkit.start, the function run as a cell would be)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    a = p.parse_args(argv)
    for v in a.variants.split(","):
        parse_variant(v)
    try:
        backend, extras = trainer_bench.split_backend(trainer_bench.parse_config(f"{a.backend}:1")[0])
    except ValueError as exc:
        p.error(str(exc))

    import nbkit

    # On the CPU nbkit.launch sets ACCELERATE_USE_CPU in the ranks (their Trainer: gloo DDP); this
    # process keeps its environment (the CPU test runs main() inside pytest).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = a.model or ("random:qwen3-vl-2b" if device == "cuda" else "tiny:qwen3-vl")
    shape = trainer_bench._shape(a.shape or ("1024x4" if device == "cuda" else "128x4"))
    launch = trainer_bench.Launch(
        backend=backend,
        extras=extras,
        gpus=a.gpus,
        launcher="nbkit",
        model=model,
        model_path=nbkit.resolve_model(model),
        device=device,
        precision="bf16" if device == "cuda" else "fp32",
        quant="16bit",
        shapes=[shape],
        results_path="",
        image=not a.no_image,
    )
    command = " ".join(["python3", "benchmarks/host_cost.py", *(argv if argv is not None else sys.argv[1:])])
    variants = a.variants.split(",")
    run_args = (launch, variants, a.warmup, a.steps, a.profile_steps, a.out)
    if a.launcher == "live":
        # run from its module, not __main__'s: cloudpickle then sends it by reference and the ranks' frames keep this
        # file's name, which the attribution skips (by value they read "<dynamic-code>").
        from benchmarks import host_cost

        live = nbkit.start(gpus=a.gpus)
        try:
            rows = live.run(host_cost.run, *run_args)
        finally:
            live.stop()
    else:
        rows = nbkit.launch(run, *run_args, gpus=a.gpus, quiet=True, dashboard=False)
    env = host.environment()
    text = markdown(env, command, launch, rows)
    print(text)
    if a.out:
        Path(a.out).write_text(json.dumps({"command": command, "environment": env, "rows": rows}, indent=1))
    if a.md:
        Path(a.md).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
