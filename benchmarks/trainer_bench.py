r"""Trainer-level benchmark: LoRA training through TRL's SFTTrainer (or transformers' Trainer), as users run it.

bench.py times a plain loop; this harness times what the flagship notebook runs: SFTTrainer with
per_device_train_batch_size, bf16/fp16 flags, logging every step, Trainer's own DDP wrapping and
optimizer, timed by a TrainerCallback. Side by side in one call:

- launchers: nbkit.launch, accelerate's notebook_launcher (both from a fresh process standing in
  for a notebook kernel that has imported transformers), and `accelerate launch` of this file;
- backends: unsloth (FastVisionModel / FastLanguageModel), transformers + peft + nbkit.savers
  (`transformers`), the same with Liger's fused kernels (`liger`: nbkit.savers.apply(kernels="liger"));
- 16-bit or 4-bit (QLoRA: unsloth's load_in_4bit, bitsandbytes NF4 for transformers) weights,
  bf16 / fp16 autocast, 1 / 2 / 4 GPUs, shapes such as 1024x4, 1024x16, 16384x1;
- repeats: every launch runs `--repeats` times; the report gives the median over repeats and their
  spread.

A configuration is `backend:gpus@launcher` (`unsloth:2`, `liger:2@accelerate`, `transformers:1@notebook`);
the launcher defaults to nbkit. The transformers backends take speed options after a "+" (EXTRAS:
`liger+compile+lean:1@notebook`). `--windows 3` splits each run's timed steps into 3 windows and reports
the median and spread over the window medians (one launch, no repeat: unsloth's compilation costs
minutes per launch). One launch loads the model once and runs every shape, each with its
own Trainer. Per shape and rank: step times (wall time between the ends of successive steps, CUDA
synchronised, so data loading, logging and the optimizer are included), the median of the second half
of the steps, tokens/s per GPU (seq_len x batch / that median), peak allocated memory, and the time
from the launcher call to the end of the first step (imports, model load and compilation included;
for `accelerate launch` from the command's start).

`--longest` searches the longest sequence (batch 1) that trains in one process under a memory cap
(`--memory-cap-gib 15` stands in for a T4): lengths from `--seq-lens` until the first that fails,
then two bisection steps to multiples of 4096, each attempt a few Trainer steps.

Examples (GPU host, see benchmarks/README.md for the set-up):

    python3 benchmarks/trainer_bench.py --configs unsloth:1@notebook,unsloth:2,unsloth:2@notebook,unsloth:2@accelerate \
        --shapes 1024x4,1024x16,16384x1 --out $OUT/trainer.json --md $OUT/trainer.md
    python3 benchmarks/trainer_bench.py --longest --configs unsloth:1,transformers:1 --quant 16bit,4bit \
        --precision fp16 --memory-cap-gib 15 --out $OUT/t4_trainer.json --md $OUT/t4_trainer.md

CPU smoke test (gloo ranks, tiny model): tests/test_trainer_bench_cpu.py.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import importlib.metadata
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script (python benchmarks/trainer_bench.py): the package lives in ROOT
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import batches, host, launching, measures, profiling, sync_sites  # noqa: E402

BACKENDS = ("unsloth", "transformers", "liger")
# Speed options a transformers / liger configuration can add (`liger+compile+lean:1`). `liger+compile` is what a
# notebook's transformers backend gets on a GPU (nbkit.training.models.add_lora: kernels="auto", compile="auto"); a
# bare `liger` leaves the layers eager.
# compile: nbkit.savers.apply(compile="regional"), torch.compile of each decoder layer and vision block;
# lean: Trainer without its per-micro-step NaN/inf check of the loss (logging_nan_inf_filter=False),
# two host reads of a GPU value (two syncs) fewer per micro-step (RESULTS.md, host cost);
# notile: nbkit.savers.apply(tiled_mlp=False), the MLP over the whole sequence at once;
# tile4: nbkit.savers.apply(tiled_mlp=4), the MLP in 4 sequence shards at every length;
# recompute: nbkit.savers.apply(checkpointing="recompute"), the checkpointed layer inputs stay on the GPU;
# nockpt: nbkit.savers.apply(checkpointing=None) and the Trainer's own checkpointing off, no layer recomputed in the
# backward (what memory allows at short shapes);
# nostop: in a live set, the ranks' stop agreement off (patch group "live": one gloo all-reduce per step fewer);
# ddpreducer: DDP's own reducer averages the gradients (nbkit.configure(ddp_reducer="ddp") in every rank) in place
# of nbkit's one all-reduce per step (nbkit.training.gradient_averaging); unsloth takes it too;
# findunused: Trainer's ddp_find_unused_parameters=True, which TRL's SFTTrainer chooses for a vision-language model
# and accelerate launch's ranks (no nbkit set-up) train with; nbkit's ranks choose False where LoRA trains only the
# language model (nbkit.training.trainer_defaults);
# graphs: as compile, the decoder layers with inductor's mode="reduce-overhead" (CUDA graphs: a layer's kernels
# recorded once and replayed, one launch for the host instead of dozens); 4.6x slower at 1K x 4 on one H200, since
# the graphs were recorded again at every step (RESULTS.md, "CUDA graphs for the compiled layers").
# gpusplit: as compile, with transformers' own split of the vision attention by image (the sizes read from the GPU
# in each block, which breaks its graph) in place of nbkit.savers.vision_attention's;
# nomark: as compile, with the sequence length left to dynamo (nbkit.savers.compiling._mark_sequence_dynamic off): at
# fixed shapes the layers then train on the static graph of their first compilation, where nbkit's marks give them
# the dynamic one from the start;
# abmetrics: TRL's SFTTrainer metrics averaged over the ranks once per log (nbkit's default,
# nbkit.training.trl_metrics) on the odd steps and gathered by TRL after every forward on the even ones, in every
# rank: both ways in one launch, on the same host at the same time (launches here differ by 10-50%), reported apart;
# pin: each rank's threads kept to its own share of the machine's CPUs (rank r of w: the r-th of w equal slices of
# the CPUs it may use), so that two ranks' main and autograd threads never meet on one vCPU; one rank keeps them all;
# expand / noexpand: torch's CUDA allocator with / without expandable segments in every process of the launch
# (PYTORCH_CUDA_ALLOC_CONF; nbkit keeps a setting that names them): nbkit gives its ranks expandable segments
# (nbkit.launching.rank_contract.allocator_environment), while `accelerate launch` and a one-GPU process in place
# run without, so these two set the allocator alike on both sides of a comparison.
ALLOCATOR_EXTRAS = {"expand": "expandable_segments:True", "noexpand": "expandable_segments:False"}
EXTRAS = (
    "compile",
    "lean",
    "notile",
    "tile4",
    "recompute",
    "nockpt",
    "nostop",
    "findunused",
    "ddpreducer",
    "graphs",
    "gpusplit",
    "nomark",
    "pin",
    "abmetrics",
    *ALLOCATOR_EXTRAS,
)
# Extras that change only what passes between ranks, nothing a one-GPU run does: a 1-GPU run without them is their
# scaling reference.
LAUNCH_ONLY_EXTRAS = ("nostop", "findunused", "ddpreducer", "pin", "abmetrics")
# nbkit: nbkit.launch; live: a live set (nbkit.start, then the function as a call); notebook: accelerate's
# notebook_launcher; accelerate: `accelerate launch` of this file, nbkit's default patches only; torchrun:
# torchrun of this file as an exported cell runs, nbkit.launch inside the rank (nbkit's whole rank set-up).
LAUNCHERS = ("nbkit", "live", "notebook", "accelerate", "torchrun")
SCRIPT_LAUNCHERS = ("accelerate", "torchrun")
QUANTS = ("16bit", "4bit")
LANGUAGE_LORA = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
TEXT_LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Launch:
    """One launch: a model loaded once, every shape trained with its own Trainer. Plain data (JSON)."""

    backend: str
    gpus: int
    launcher: str
    model: str
    model_path: str
    device: str  # "cuda" or "cpu"
    precision: str  # "bf16", "fp16", "fp32"
    quant: str  # "16bit" or "4bit"
    shapes: list[tuple[int, int]]  # (seq_len, batch per GPU)
    results_path: str
    steps: int = 20
    warmup: int = 3
    image: bool = True
    trainer: str = "sft"  # "sft" (TRL SFTTrainer) or "hf" (transformers Trainer)
    repeat: int = 0
    memory_cap_gib: float | None = None
    longest: bool = False
    launched_at: float = 0.0  # time.time() when the launcher was called (script launchers: the command)
    emulate: str | None = None  # a GPU profile (nbkit.emulate) every rank applies, e.g. "T4"
    # unsloth's loss: "unsloth" (its own fused loss) or "nbkit" (nbkit's chunked loss takes over)
    unsloth_loss: str = "unsloth"
    trainer_options: dict[str, Any] = field(default_factory=dict)  # TrainingArguments / SFTConfig overrides
    extras: list[str] = field(default_factory=list)  # EXTRAS
    windows: int = 1  # timed steps split into this many windows, each window's median reported
    compile_backend: str = "inductor"  # torch.compile's backend for the compile extra
    profile_steps: int = 0  # steps profiled after the timed ones (torch.profiler; every rank's summary in the row)
    # The notebook launchers' process imports the model's modeling module before the launch, as a notebook has
    # after earlier cells (False: nothing but unsloth where it trains in place, as in a fresh kernel).
    preload: bool = True
    image_grid: tuple[int, int, int] = batches.IMAGE_GRID  # each image's patches (t, h, w) before the 2x2 merge

    @property
    def sample_image(self) -> tuple[int, int, int] | None:
        """Each sample's image grid for the collator, None for text-only samples."""
        return self.image_grid if self.image else None

    @property
    def config(self) -> str:
        return f"{'+'.join([self.backend, *self.extras])}:{self.gpus}@{self.launcher}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Launch:
        data = json.loads(text)
        data["shapes"] = [tuple(s) for s in data["shapes"]]
        data["image_grid"] = tuple(data["image_grid"])
        return cls(**data)


# ---------------------------------------------------------------------------------------------
# Inside a rank
# ---------------------------------------------------------------------------------------------


def build_model(launch: Launch, device: torch.device) -> torch.nn.Module:
    """The LoRA model as the flagship notebook builds it for this backend (LoRA r=16 on the language model)."""
    from transformers import AutoConfig

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(launch.precision, torch.float32)
    four_bit = launch.quant == "4bit"
    vision = getattr(AutoConfig.from_pretrained(launch.model_path), "vision_config", None) is not None
    max_len = max(seq for seq, _ in launch.shapes)
    if launch.backend == "unsloth":
        import unsloth  # noqa: F401  (first: it patches transformers and TRL as they load)
        from unsloth import FastLanguageModel, FastVisionModel

        loader = FastVisionModel if vision else FastLanguageModel
        model, _ = loader.from_pretrained(
            launch.model_path, dtype=dtype, load_in_4bit=four_bit, max_seq_length=max_len, device_map=str(device)
        )
        extra: dict[str, Any] = {"finetune_vision_layers": False} if vision else {"target_modules": TEXT_LORA}
        model = loader.get_peft_model(model, r=16, lora_alpha=16, random_state=0, **extra)
        if launch.unsloth_loss == "nbkit":  # unsloth's own checkpointing and MLP stay; only the loss changes
            import nbkit

            nbkit.savers.apply(model, checkpointing=None, tiled_mlp=False)
        return model
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, BitsAndBytesConfig

    import nbkit

    torch.manual_seed(0)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype) if four_bit else None
    model = auto.from_pretrained(
        launch.model_path, dtype=dtype, device_map={"": str(device)}, quantization_config=quantization
    )
    model.config.use_cache = False
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=16, target_modules=LANGUAGE_LORA if vision else TEXT_LORA)
    )
    kernels = "liger" if launch.backend == "liger" else None
    options: dict[str, Any] = dict(
        kernels=kernels,
        tiled_mlp=4 if "tile4" in launch.extras else "notile" not in launch.extras,
        checkpointing=None if "nockpt" in launch.extras else "recompute" if "recompute" in launch.extras else "offload",
    )
    graphs = "graphs" in launch.extras
    if graphs and launch.compile_backend == "inductor":
        # As `compile`, then each decoder layer compiled again with CUDA graphs. The vision blocks keep plain
        # compilation: a graph break splits each into two graphs, around which a replay overwrote an output still
        # in use ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run", one H200).
        from nbkit.training.savers import _model, checkpointing

        nbkit.savers.apply(model, **options, compile="regional")
        for layer in _model.decoder_layers(_model.base_model(model)):
            layer.compile(backend="inductor", mode="reduce-overhead")
            if checkpointing.is_checkpointed(layer):
                checkpointing.compile_checkpointed(
                    layer, functools.partial(torch.compile, backend="inductor", mode="reduce-overhead")
                )
        return model
    if graphs or ("compile" in launch.extras and launch.compile_backend != "inductor"):  # the dry run's aot_eager
        nbkit.savers.apply(model, **options, compile=None)
        nbkit.savers.compiling.enable(model, backend=launch.compile_backend)
    else:
        nbkit.savers.apply(model, **options, compile="regional" if "compile" in launch.extras else None)
    if "nomark" in launch.extras:
        nbkit.savers.compiling._mark_sequence_dynamic = lambda args, kwargs: None
    if "gpusplit" in launch.extras:
        from nbkit.training.savers import vision_attention

        vision_attention.disable(model)
    return model


class _Collator:
    """Builds each batch: random sequences of exactly seq_len tokens (one image each for a VLM when
    asked), as a real collator tokenises and processes images per batch (host work that belongs in the
    step). It uses only how many samples it is given, never their content: the dataset is a placeholder
    column (named input_ids so that no trainer's column filter removes it), and unsloth's patched
    SFTTrainer may change what reaches the collator.
    """

    def __init__(self, config: Any, seq_len: int, image_grid: tuple[int, int, int] | None) -> None:
        # image_grid: each sample's image in patches (batches.synthetic_batch), None for text only
        self.config, self.seq_len, self.image_grid = config, seq_len, image_grid
        self.seed = 1_000_003 * int(os.environ.get("RANK", "0"))  # other data on every rank

    def __call__(self, samples: list[Any]) -> dict[str, torch.Tensor]:
        parts = []
        for _ in samples:
            self.seed += 1
            parts.append(
                batches.synthetic_batch(
                    self.config,
                    self.seq_len,
                    1,
                    "cpu",
                    image=self.image_grid is not None,
                    image_grid=self.image_grid or batches.IMAGE_GRID,
                    seed=self.seed,
                )
            )
        batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        # No padding; TRL counts tokens from the mask, and transformers' sdpa path drops an all-ones mask.
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch


def _timer_callback(device: torch.device, profile_from: int | None = None, sync_step: int | None = None) -> Any:
    """The step timer; with `profile_from`, the steps after that many are profiled (and not timed); with
    `sync_step`, that step's synchronising CUDA calls are counted by site (sync_sites; an untimed warm-up step).
    """
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time between the ends of successive optimizer steps (the first: from its own start), and the
        milliseconds of Python garbage collection within each (a host-bound step pays for them in full).
        """

        def __init__(self) -> None:
            self.times: list[float] = []
            self.gc_ms: list[float] = []
            self.first_step_end: float | None = None
            self.host: list[dict[str, float]] = []  # measures.HostClock's counters of each step
            self.cores: list[str | None] = []  # the physical core the main thread was on at each step's end
            # measures.thread_cpu_by_name at the two ends of the timed half
            self.threads: list[dict[str, tuple[int, float]]] = []
            self.watch: dict[str, Any] | None = None  # measures.HalfWatch over the timed half
            self._watch: measures.HalfWatch | None = None
            self.profile: dict[str, Any] | None = None
            self.sync_sites = sync_sites.SyncSites()
            self.metric_modes: list[str] = []  # the abmetrics extra's trl_metrics setting of each step
            self._sync_watch: Any = None
            self._profiler: Any = None
            self._profiled_from = 0.0
            self._clock: measures.HostClock | None = None
            self._last: float | None = None
            self._gc = 0.0
            self._gc_started = 0.0

        def _on_gc(self, phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                self._gc_started = time.perf_counter()
            else:
                self._gc += time.perf_counter() - self._gc_started

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            gc.callbacks.append(self._on_gc)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._on_gc in gc.callbacks:
                gc.callbacks.remove(self._on_gc)
            self._end_sync_watch()  # a step that raised (an OOM) left it on, and the next shape must not run under it
            if self._watch is not None and self.watch is None:  # ended inside the timed half: no figures, no sampler
                self._watch.stop(1)

        def _end_sync_watch(self) -> None:
            if self._sync_watch is not None:
                self._sync_watch.__exit__(None, None, None)
                self._sync_watch = None

        def _sync(self) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._last is None:
                self._sync()
                self._last = time.perf_counter()
                self._clock = measures.HostClock()
            if state.global_step == sync_step:
                self._sync_watch = self.sync_sites.watch()
                self._sync_watch.__enter__()
            if profile_from is not None and state.global_step == profile_from and self._profiler is None:
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                self._sync()
                self._profiler = profile(activities=activities)
                self._profiler.__enter__()
                self._profiled_from = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._end_sync_watch()  # off before the timer's own sync
            self._sync()
            if self._profiler is not None:
                if state.global_step >= state.max_steps:
                    wall = time.perf_counter() - self._profiled_from
                    self._profiler.__exit__(None, None, None)
                    self.profile = profiling.summary(
                        self._profiler.key_averages(), state.global_step - profile_from, wall
                    )
                return  # profiled steps are not timed
            now = time.perf_counter()
            self.times.append(now - (now if self._last is None else self._last))
            self.gc_ms.append(round(1000 * self._gc, 2))
            if self._clock is not None:
                self.host.append(self._clock.sample())
                self.cores.append(measures.thread_core())
                timed = profile_from if profile_from is not None else state.max_steps
                if len(self.times) in (timed // 2, timed):  # the ends of the timed half _row reads
                    self.threads.append(measures.thread_cpu_by_name())
                    if self._watch is None:
                        self._watch = measures.HalfWatch()
                    else:
                        self.watch = self._watch.stop(timed - timed // 2)
            self._last, self._gc = now, 0.0
            if self.first_step_end is None:
                self.first_step_end = time.time()

    return StepTimer()


def _trainer_checkpoints(args: Any) -> bool:
    """Whether a Trainer built with `args` asks transformers to checkpoint the model's layers (a layer with nbkit's
    checkpoint ignores the request).
    """
    flag = getattr(args, "activation_checkpointing", None)
    return bool(args.gradient_checkpointing if flag is None else flag)


def _trainer(launch: Launch, model: Any, seq_len: int, batch: int, steps: int, out_dir: str, timer: Any) -> Any:
    """The Trainer (or SFTTrainer) for one shape, as the flagship builds it, with `launch.trainer_options`
    replacing TrainingArguments / SFTConfig options (`--trainer-option`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    from datasets import Dataset

    data = Dataset.from_dict({"input_ids": [[0]] * (steps * batch * world)})
    collate = _Collator(common_config(launch), seq_len, launch.sample_image)
    options: dict[str, Any] = dict(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=batch,
        # Explicit: unsloth's patched SFTConfig defaults to 2 (seen on the H100: "Gradient accumulation steps = 2").
        gradient_accumulation_steps=1,
        learning_rate=2e-4,
        lr_scheduler_type="linear",
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        bf16=launch.precision == "bf16",
        fp16=launch.precision == "fp16",
        use_cpu=launch.device == "cpu",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if "lean" in launch.extras:
        options["logging_nan_inf_filter"] = False
    if "findunused" in launch.extras:
        options["ddp_find_unused_parameters"] = True
    if "nockpt" in launch.extras:
        from nbkit.platform import compat

        # Trainer's own checkpointing off as well: SFTConfig turns it on by default, and it checkpoints every layer
        # that has no checkpoint of nbkit's.
        options[compat.trainer_checkpointing_field()] = False
    options.update(launch.trainer_options)
    callbacks = [timer, *([_graph_steps()] if "graphs" in launch.extras else [])]
    if "abmetrics" in launch.extras:
        callbacks.append(_alternating_metrics(timer.metric_modes))
    if launch.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        from nbkit.training.offline import load_processor

        args = SFTConfig(**options, dataset_kwargs={"skip_prepare_dataset": True}, max_length=None)
        return SFTTrainer(
            model=model,
            args=args,
            train_dataset=data,
            processing_class=load_processor(launch.model_path),
            data_collator=collate,
            callbacks=callbacks,
        )
    from transformers import Trainer, TrainingArguments

    return Trainer(
        model=model, args=TrainingArguments(**options), train_dataset=data, data_collator=collate, callbacks=callbacks
    )


def _alternating_metrics(modes: list[str]) -> Any:
    """The abmetrics extra's callback: nbkit's trl_metrics setting "at_log" for each odd step, "per_batch" for each
    even one (the same on every rank, read at each compute_loss), noted in `modes` step by step.
    """
    from transformers import TrainerCallback

    import nbkit

    class AlternatingMetrics(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            mode = "at_log" if state.global_step % 2 == 0 else "per_batch"
            nbkit.configure(trl_metrics=mode)
            modes.append(mode)

    return AlternatingMetrics()


def _graph_steps() -> Any:
    """A callback that marks each optimizer step's start for torch's CUDA graphs
    (torch.compiler.cudagraph_mark_step_begin), as torch asks of a training loop: the previous step's
    outputs of the replayed graphs may then be overwritten.
    """
    from transformers import TrainerCallback

    class GraphSteps(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            torch.compiler.cudagraph_mark_step_begin()

    return GraphSteps()


_CONFIGS: dict[str, Any] = {}


def common_config(launch: Launch) -> Any:
    """The model's transformers config (cached per path)."""
    if launch.model_path not in _CONFIGS:
        from transformers import AutoConfig

        _CONFIGS[launch.model_path] = AutoConfig.from_pretrained(launch.model_path)
    return _CONFIGS[launch.model_path]


def _graph_breaks() -> collections.Counter[str]:
    """torch.compile's graph breaks in this process so far, by reason (none where dynamo never loaded)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return collections.Counter(utils.counters["graph_break"]) if utils is not None else collections.Counter()


def _ddp_options(model: Any, accelerator: Any) -> dict[str, bool] | None:
    """The options DDP trained `model` with, as it holds them (what Trainer, TRL and nbkit decided), and whether
    nbkit's one all-reduce per step averaged its gradients in place of DDP's reducer; None for a model not wrapped
    in DDP.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    from nbkit.training import gradient_averaging

    names = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "broadcast_buffers")
    options = {name: bool(getattr(model, name)) for name in names}
    options["flat_averaging"] = gradient_averaging.averager(accelerator) is not None
    return options


def _oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _case(launch: Launch, model: Any, seq_len: int, batch: int, device: torch.device, steps: int) -> dict:
    """Train one shape; returns this rank's figures (status ok / oom / error)."""
    # The last warm-up step (compiled, untimed) is the one whose syncs are counted.
    sync_step = launch.warmup - 1 if launch.warmup >= 2 else None
    timer = _timer_callback(device, steps - launch.profile_steps if launch.profile_steps else None, sync_step)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    row: dict[str, Any] = {"seq_len": seq_len, "batch": batch}
    breaks_before = _graph_breaks()
    trainer = None
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            trainer = _trainer(launch, model, seq_len, batch, steps, out_dir, timer)
            row["trainer_checkpointing"] = _trainer_checkpoints(trainer.args)
            trainer.train()
            row["ddp"] = _ddp_options(trainer.model_wrapped, trainer.accelerator)
            losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        row.update(status="ok", loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None)
    except Exception as exc:  # recorded, and the next shape runs (a single process recovers from an OOM)
        row.update(status="oom" if _oom(exc) else "error", error=f"{type(exc).__name__}: {exc}"[-2000:])
        # The one-line error alone does not say where (an inductor assertion names no frame): the
        # traceback goes to the log and into the row.
        row["traceback"] = traceback.format_exc()[-6000:]
        print(row["traceback"], file=sys.stderr, flush=True)
    finally:
        timer.on_train_end(None, None, None)  # its GC hook off also when training raised
        del trainer
        gc.collect()
    row["step_times_s"] = timer.times
    row["gc_ms"] = timer.gc_ms
    row["host"] = timer.host
    row["cores"] = timer.cores
    row["threads"] = timer.threads
    row["watch"] = timer.watch
    row["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    # torch.compile's graph breaks during this shape's run, by reason: a break inside a compiled layer
    # splits it into pieces, each a cache lookup and its own launches on every call.
    row["graph_breaks"] = dict((_graph_breaks() - breaks_before).most_common(8))
    row["profile"] = timer.profile
    row["sync_sites"] = timer.sync_sites.top()
    row["metric_modes"] = timer.metric_modes
    row["torch_threads"] = torch.get_num_threads()
    row["interpreter"] = measures.interpreter_state()
    row["first_step_end"] = timer.first_step_end
    row["peak"] = measures.peak_memory_gib(device)
    return row


def _ladder(launch: Launch, model: Any, device: torch.device, emit: Any) -> list[dict]:
    """Lengths in order until the first failure, then two bisections to multiples of 4096; each row
    is passed to emit(row) as soon as it is measured (a launch stopped by its timeout keeps them).
    """
    rows, good, bad = [], 0, None
    for seq_len, _ in launch.shapes:
        row = _case(launch, model, seq_len, 1, device, launch.warmup + launch.steps + launch.profile_steps)
        rows.append(row)
        emit(row)
        if row["status"] != "ok":
            bad = seq_len
            break
        good = seq_len
    for _ in range(2):
        if bad is None or bad - good <= 4096:
            break
        middle = (good + bad) // 2 // 4096 * 4096
        if middle <= good:
            break
        row = _case(launch, model, middle, 1, device, launch.warmup + launch.steps + launch.profile_steps)
        rows.append(row)
        emit(row)
        good, bad = (middle, bad) if row["status"] == "ok" else (good, middle)
    return rows


def _pin_to_share(rank: int, world: int) -> None:
    """The `pin` extra: every thread of this process, and those it starts later, on rank's slice of the usable CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    share = set(cpus[rank * len(cpus) // world : (rank + 1) * len(cpus) // world])
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), share)


def run(launch: Launch) -> None:
    """Each rank: load, train every shape, gather the figures; rank 0 appends one JSON line per shape."""
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = launch.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # forked CPU ranks: see landscape.md (fork after torch's thread pool started)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if "pin" in launch.extras:
        _pin_to_share(rank, int(os.environ.get("WORLD_SIZE", "1")))
    if "nostop" in launch.extras:
        from nbkit.platform import patching

        patching.revert("live")
    if launch.emulate:  # nbkit.launch's ranks already did (prepare_rank); the other launchers' did not
        from nbkit.training import emulation

        emulation.apply_from_env()
    if cuda:
        torch.cuda.set_device(device)
        if launch.memory_cap_gib:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, launch.memory_cap_gib * 2**30 / total), device)
    start = time.time()
    model = build_model(launch, device)
    load_s = time.time() - start
    import torch.distributed as dist

    # From the launcher's environment: the process group only exists once the first Trainer has set it up.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    written: list[dict] = []

    def emit(row: dict) -> None:  # one process: write each row at once; several: gathered at the end
        if world == 1:
            with open(launch.results_path, "a") as f:
                f.write(json.dumps(_row(launch, row, [row], load_s, first=not written)) + "\n")
            written.append(row)

    if launch.longest:
        mine = _ladder(launch, model, device, emit)
    else:
        mine = []
        for seq_len, batch in launch.shapes:
            mine.append(
                _case(launch, model, seq_len, batch, device, launch.warmup + launch.steps + launch.profile_steps)
            )
            emit(mine[-1])
    if world > 1:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            with open(launch.results_path, "a") as f:
                for i, row in enumerate(mine):
                    ranks = [r[i] for r in everyone]
                    f.write(json.dumps(_row(launch, row, ranks, load_s, first=i == 0)) + "\n")


def _row(launch: Launch, row: dict, ranks: list[dict], load_s: float, first: bool) -> dict:
    times = row["step_times_s"]
    half = times[len(times) // 2 :] if len(times) > 1 else times
    ok = all(r["status"] == "ok" for r in ranks)
    stats = measures.step_stats(half) if ok and half else None
    tokens = row["seq_len"] * row["batch"]
    out = {
        **_identity(launch),
        "seq_len": row["seq_len"],
        "batch": row["batch"],
        "status": "ok" if ok else next(r["status"] for r in ranks if r["status"] != "ok"),
        "error": next((r["error"] for r in ranks if r.get("error")), None),
        "traceback": next((r["traceback"] for r in ranks if r.get("traceback")), None),
        "step_times_s": times,
        "gc_ms": row.get("gc_ms"),  # this rank's garbage-collection time within each step
        # Rank 0's host per timed step (medians): its main thread's CPU time against the step's wall time
        # says whether the host thread was busy or waited; the process's CPU time, what its other threads
        # burned; involuntary switches, how often the scheduler took the main thread's core.
        "host": _host_medians(row.get("host") or [], len(half)),
        # Every rank's counters and profile: DDP runs the ranks in step, so a rank that waits (its CPU
        # spinning in a device sync is counted as CPU) shows beside the one that sets the pace.
        "host_by_rank": [_host_medians(r.get("host") or [], len(half)) for r in ranks],
        # Each rank's main thread's physical cores over the timed steps, most often first: two ranks on one
        # core (its two hardware threads) would each run slower with no switch counted.
        "cores_by_rank": [_core_counts(r.get("cores") or [], len(half)) for r in ranks],
        "shared_core_steps": _shared_core_steps([r.get("cores") or [] for r in ranks], len(half)),
        # Each rank's threads by name over the timed half: which of a rank's threads (ipykernel's, NCCL's, a
        # tokenizer's pool) are there and what CPU they take beside the main thread.
        "threads_by_rank": [_thread_cpu(r.get("threads") or [], len(half)) for r in ranks],
        # Each rank's measures.HalfWatch over the timed half: its main thread's wait for a CPU, the machine's busy
        # CPUs and busiest processes, and where its main thread's Python stack was, per step.
        "watch_by_rank": [r.get("watch") for r in ranks],
        "alloc_conf": row.get("alloc_conf"),  # the CUDA allocator's settings the ranks ran with
        # whether the Trainer asked transformers to checkpoint layers (those without nbkit's checkpoint obey)
        "trainer_checkpointing": row.get("trainer_checkpointing"),
        "ddp": row.get("ddp"),  # rank 0's DDP options (find_unused_parameters, ...); None in one process
        "torch_threads": row.get("torch_threads"),
        # Each rank's interpreter after its steps (measures.interpreter_state): what could slow the same code in one
        # launcher's ranks and not another's (a live rank is an ipykernel process; a launched one, forked).
        "interpreter_by_rank": [r.get("interpreter") for r in ranks],
        "profile": row.get("profile"),
        "profile_by_rank": [r.get("profile") for r in ranks],
        "graph_breaks": row.get("graph_breaks"),
        # Each rank's synchronising CUDA calls by site in the last warm-up step (sync_sites): who makes the
        # host wait for the GPU, where a profile only counts the waits.
        "sync_sites_by_rank": [r.get("sync_sites") or {} for r in ranks],
        "step_time_s": stats,
        "tokens_per_s_per_gpu": tokens / stats["median"] if stats else None,
        "peak_allocated_gib": [r["peak"]["allocated"] if r["peak"] else None for r in ranks],
        "load_s": load_s,
        "first_step_s": times[0] if times else None,
        "loss_first": row.get("loss_first"),
        "loss_last": row.get("loss_last"),
    }
    if first and row["first_step_end"] is not None and launch.launched_at:
        out["launch_to_first_step_s"] = row["first_step_end"] - launch.launched_at
    if launch.windows > 1 and stats:
        out["window_medians_s"] = window_medians(times[launch.warmup :], launch.windows)
    modes = row.get("metric_modes") or []
    if ok and modes:  # abmetrics: each way's median over the timed steps that ran it
        timed = list(zip(modes, times))[launch.warmup :]
        out["metric_modes"] = modes
        out["ab_medians_s"] = {
            mode: statistics.median(t for m, t in timed if m == mode) for mode in sorted({m for m, _ in timed})
        }
    return out


def _timed_steps(samples: list[Any], timed: int) -> list[Any]:
    """The per-step samples of the last `timed` steps (all of them where no step was timed)."""
    return samples[-timed:] if timed else samples


def _thread_cpu(readings: list[dict[str, tuple[int, float]]], steps: int) -> dict[str, dict[str, float]]:
    """The threads by name over the timed half, from StepTimer's two readings at its ends ({} without both)."""
    return measures.thread_cpu_between(readings[0], readings[1], steps) if len(readings) == 2 else {}


def _host_medians(samples: list[dict[str, float]], timed: int) -> dict[str, float]:
    """The median of each HostClock counter over the last `timed` steps' samples ({} without samples)."""
    samples = _timed_steps(samples, timed)
    if not samples:
        return {}
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def _core_counts(cores: list[str | None], timed: int) -> dict[str, int]:
    """How many of the last `timed` steps ended with the main thread on each core, most often first."""
    return dict(collections.Counter(c for c in _timed_steps(cores, timed) if c).most_common())


def _shared_core_steps(cores_by_rank: list[list[str | None]], timed: int) -> int:
    """Of the last `timed` steps, how many two ranks' main threads ended on one physical core: DDP keeps the ranks in
    step, so the same step's samples are taken at about the same moment.
    """
    tails = [_timed_steps(cores, timed) for cores in cores_by_rank]
    return sum(1 for step in zip(*tails) if len([c for c in step if c]) > len({c for c in step if c}))


def window_medians(times: list[float], windows: int) -> list[float]:
    """The median of each of `windows` consecutive, equal windows of `times` (a remainder at the end is left
    out): a slow stretch (a compile, a GC pause, a clock change) shows as one window apart from the others.
    Raises ValueError when there are fewer times than windows.
    """
    size = len(times) // windows
    if size == 0:
        raise ValueError(f"{len(times)} timed steps cannot make {windows} windows: raise --steps.")
    return [statistics.median(times[i * size : (i + 1) * size]) for i in range(windows)]


# ---------------------------------------------------------------------------------------------
# The launching side
# ---------------------------------------------------------------------------------------------


def _preload(launch: Launch) -> None:
    """What a notebook has imported in earlier cells: transformers and the model's modeling module (never
    unsloth, peft or bitsandbytes where ranks fork: they initialise CUDA or make both notebook launchers refuse
    to fork). unsloth's one-GPU notebooks, which train in the kernel itself, import unsloth in their first cell,
    before transformers, as unsloth asks. launch.preload False: nothing more, as in a fresh kernel (with unsloth
    first and the modeling module after it, 16K x 1 under the T4 profile still made full fp32 logits, 9.27 GiB).
    """
    if launch.backend == "unsloth" and launch.launcher == "notebook" and launch.gpus == 1:
        import unsloth  # noqa: F401
    if not launch.preload:
        return
    from transformers.models.auto import modeling_auto

    config = common_config(launch)
    vision = getattr(config, "vision_config", None) is not None
    mapping = (
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING if vision else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    )
    mapping[type(config)]


def _launch_mode(path: str) -> int:
    """A fresh process standing in for a notebook kernel: call the notebook launcher from here."""
    return launching.launch_from_kernel(run, Launch.from_json(Path(path).read_text()), _preload)


def _worker_mode(path: str) -> int:
    """One rank of `accelerate launch` or torchrun: the same function the notebook launchers run."""
    launch = Launch.from_json(Path(path).read_text())
    return launching.script_rank(run, launch, exported=launch.launcher == "torchrun")


def _command(launch: Launch, path: Path) -> list[str]:
    me = str(Path(__file__).resolve())
    if launch.launcher == "accelerate":
        return launching.accelerate_command(launch.gpus, path.parent, me, "--worker-mode", str(path))
    if launch.launcher == "torchrun":
        return launching.torchrun_command(launch.gpus, path.parent, me, "--worker-mode", str(path))
    return [sys.executable, me, "--launch-mode", str(path)]


def run_launch(launch: Launch, workdir: Path, timeout: float) -> list[dict]:
    """Run one launch in a fresh process group; one row per shape, failures and timeouts included."""
    slug = f"{launch.config}-{launch.precision}-{launch.quant}-{launch.unsloth_loss}-r{launch.repeat}".replace(
        ":", "-"
    ).replace("@", "-")
    path = workdir / f"{slug}.json"
    launch.results_path = str(workdir / f"{slug}.jsonl")
    launch.launched_at = time.time()
    path.write_text(launch.to_json())
    print(f"\n=== {launch.config} {launch.precision} {launch.quant} repeat {launch.repeat} ===", flush=True)
    start = time.monotonic()
    command, env = _command(launch, path), launching.child_env(launch.device, gpus=launch.gpus)
    for extra in set(launch.extras) & set(ALLOCATOR_EXTRAS):
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_EXTRAS[extra]
    if "ddpreducer" in launch.extras:
        from nbkit.platform import config

        env[config.SETTINGS["ddp_reducer"].env] = "ddp"
    reason, tail = launching.run_process(command, env, timeout, "nbkit-trainer-bench")
    wall = time.monotonic() - start
    rows, error = launching.read_rows(Path(launch.results_path))
    for row in rows:
        row["launch_wall_s"] = wall
    done = {(r["seq_len"], r["batch"]) for r in rows}
    if not launch.longest:
        for seq_len, batch in launch.shapes:
            if (seq_len, batch) not in done:
                rows.append(
                    dict(
                        _identity(launch),
                        seq_len=seq_len,
                        batch=batch,
                        launch_wall_s=wall,
                        status="timeout" if reason and "timeout" in reason else "error",
                        error=error or reason or "the launch ended without reporting this shape",
                        output_tail="\n".join(tail),
                    )
                )
    print(
        f"=== {launch.config}: {wall:.0f} s{' -- ' + (error or reason or '') if error or reason else ''} ===",
        flush=True,
    )
    return rows


def _identity(launch: Launch) -> dict:
    keys = (
        "backend",
        "gpus",
        "launcher",
        "precision",
        "quant",
        "trainer",
        "trainer_options",
        "extras",
        "image",
        "image_grid",
        "memory_cap_gib",
        "emulate",
        "unsloth_loss",
        "preload",
        "repeat",
    )
    return {"config": launch.config, **{k: getattr(launch, k) for k in keys}}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def summarise(rows: list[dict]) -> list[dict]:
    """One entry per (config, precision, quant, shape): median over repeats of the per-run medians,
    tokens/s per GPU, spread over repeats, scaling against the 1-GPU entry that does the same work (same
    backend and extras, launch-only extras aside: `liger+compile+nockpt:2` against `liger+compile+nockpt:1`),
    through the same launcher where one ran (`:2@live` against `:1@live`), else the first listed.
    """
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in rows:
        groups[(r["config"], r["precision"], r["quant"], r["seq_len"], r["batch"])].append(r)
    out = []
    for (config, precision, quant, seq_len, batch), runs in groups.items():
        ok = [r for r in runs if r["status"] == "ok"]
        # Each run's median, or with --windows each of its windows' medians.
        medians = [m for r in ok for m in (r.get("window_medians_s") or [r["step_time_s"]["median"]])]
        entry = {
            "config": config,
            "backend": runs[0]["backend"],
            "work": (runs[0]["backend"], *sorted(set(runs[0]["extras"]) - set(LAUNCH_ONLY_EXTRAS))),
            "gpus": runs[0]["gpus"],
            "launcher": runs[0]["launcher"],
            "precision": precision,
            "quant": quant,
            "seq_len": seq_len,
            "batch": batch,
            "runs": len(runs),
            "ok_runs": len(ok),
            "statuses": [r["status"] for r in runs],
            "samples": len(medians),
        }
        if medians:
            median = statistics.median(medians)
            entry.update(
                step_s=median,
                step_s_runs=medians,
                spread_pct=100 * (max(medians) - min(medians)) / median,
                tokens_per_s_per_gpu=seq_len * batch / median,
                peak_gib=max(max(g for g in r["peak_allocated_gib"] if g is not None) for r in ok)
                if any(g is not None for r in ok for g in r["peak_allocated_gib"])
                else None,
                launch_to_first_step_s=[r["launch_to_first_step_s"] for r in ok if "launch_to_first_step_s" in r],
            )
        out.append(entry)
    for entry in out:
        bases = [
            e
            for e in out
            if e["work"] == entry["work"]
            and e["gpus"] == 1
            and e.get("step_s")
            and all(e[k] == entry[k] for k in ("precision", "quant", "seq_len", "batch"))
        ]
        # The same launcher's one-GPU run first: a run in the harness's own process (@notebook) keeps torch's pool of
        # one thread per core, whose threads burned 0.5-1 s of CPU per step on a 32-core host and spread its launches
        # by 39% (RESULTS.md, 2x H200, 2026-11-29), where nbkit's and the script launchers' ranks get one thread.
        base = next((e for e in bases if e["launcher"] == entry["launcher"]), bases[0] if bases else None)
        if base and entry.get("step_s") and entry["gpus"] > 1:
            entry["scaling"] = entry["gpus"] * base["step_s"] / entry["step_s"]
        unsloth = next((e for e in out if e["backend"] == "unsloth" and e.get("step_s") and _same_case(e, entry)), None)
        if unsloth and entry.get("step_s") and entry["backend"] != "unsloth":
            entry["vs_unsloth"] = entry["step_s"] / unsloth["step_s"]
            if entry.get("peak_gib") is not None and unsloth.get("peak_gib") is not None:
                entry["peak_vs_unsloth"] = entry["peak_gib"] / unsloth["peak_gib"]
    return out


def _same_case(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in ("gpus", "precision", "quant", "seq_len", "batch"))


def _case_label(row: dict) -> str:
    """A row's case as the markdown tables name it: "bf16 16bit 1024x4"."""
    return f"{row['precision']} {row['quant']} {row['seq_len']}x{row['batch']}"


def _host_table(rows: list[dict]) -> list[str]:
    """Markdown lines: rank 0's host per timed step in each run (medians; see _row's "host")."""
    runs = [r for r in rows if r.get("host")]
    if not runs:
        return []
    lines = [
        "",
        "Each rank's host per timed step (medians; ranks separated by /): main thread CPU, all threads' CPU, the",
        "main thread's involuntary context switches (its core taken) and voluntary ones (it slept: the GIL, a lock),",
        "its page faults, OS threads, the physical cores (package/core) the main thread ended its steps on, most",
        "often first, and in how many timed steps two ranks' main threads ended on one core; rank 0's torch intra-op",
        "threads and graph breaks:",
        "",
    ]
    lines += [
        "| config | case | repeat | step ms | main CPU ms | process CPU ms | switches | sleeps | page faults | threads | "
        "main thread's cores | torch threads | graph breaks |"
    ]
    lines += ["|---|---|---:|---:|---|---|---|---|---|---|---|---:|---:|"]
    for r in runs:
        case = _case_label(r)
        hosts = r["host_by_rank"]
        lines.append(
            f"| {r['config']} | {case} | {r['repeat']} | {1000 * r['step_time_s']['median']:.0f} | "
            f"{_by_rank(hosts, 'main_cpu_s', 1000)} | {_by_rank(hosts, 'process_cpu_s', 1000)} | "
            f"{_by_rank(hosts, 'main_involuntary_switches')} | {_by_rank(hosts, 'main_voluntary_switches')} | "
            f"{_by_rank(hosts, 'main_page_faults')} | {_by_rank(hosts, 'os_threads')} | {_cores_cell(r)} | {r.get('torch_threads')} | "
            f"{sum((r.get('graph_breaks') or {}).values())} |"
        )
    return lines + _thread_lines(runs) + _interpreter_lines(runs) + _watch_lines(runs)


def _thread_lines(runs: list[dict]) -> list[str]:
    """Markdown lines: each rank's busiest threads by name over the timed half (see _row's "threads_by_rank")."""
    runs = [r for r in runs if any(r.get("threads_by_rank") or [])]
    if not runs:
        return []
    lines = ["", "Each rank's OS threads by name over the timed steps: count, and CPU ms per step (busiest five):", ""]
    lines += ["| config | case | repeat | rank | threads | busiest |", "|---|---|---:|---:|---:|---|"]
    for r in runs:
        case = _case_label(r)
        for rank, groups in enumerate(r["threads_by_rank"]):
            busiest = ", ".join(
                f"{name} x{g['threads']:.0f}: {g['cpu_ms_per_step']:.0f}" for name, g in list(groups.items())[:5]
            )
            total = sum(g["threads"] for g in groups.values())
            lines.append(f"| {r['config']} | {case} | {r['repeat']} | {rank} | {total:.0f} | {busiest} |")
    return lines


def _interpreter_lines(runs: list[dict]) -> list[str]:
    """Markdown lines: each rank's interpreter after its steps (see _row's "interpreter_by_rank")."""
    runs = [r for r in runs if any(r.get("interpreter_by_rank") or [])]
    if not runs:
        return []
    lines = [
        "",
        "Each rank's interpreter after its steps: sys.monitoring's tools (event masks; none before Python 3.12),",
    ]
    lines += ["trace and profile functions, objects the garbage collector tracks (frozen), modules:", ""]
    lines += ["| config | case | repeat | rank | monitoring | trace / profile | tracked (frozen) | modules |"]
    lines += ["|---|---|---:|---:|---|---|---|---:|"]
    for r in runs:
        for rank, state in enumerate(r["interpreter_by_rank"]):
            if not state:
                continue
            tools = state["monitoring_tools"]
            shown = "n/a" if tools is None else ", ".join(f"{k}: {v:#x}" for k, v in tools.items()) or "none"
            lines.append(
                f"| {r['config']} | {_case_label(r)} | {r['repeat']} | {rank} | {shown} | "
                f"{state['trace']} / {state['profile']} | {state['gc_tracked']:,} ({state['gc_frozen']:,}) | "
                f"{state['modules']:,} |"
            )
    return lines


def _watch_lines(runs: list[dict]) -> list[str]:
    """Markdown lines: each rank's HalfWatch over the timed half (see _row's "watch_by_rank")."""
    runs = [r for r in runs if any(r.get("watch_by_rank") or [])]
    if not runs:
        return []
    lines = [
        "",
        "Over the timed half, per step: each rank's main thread on a CPU and waiting for one while runnable, the",
        "machine's busy CPUs and steal, its busiest other processes (CPU ms), and where the main thread's Python",
        "stack was (samples every 5 ms; the five most frequent leaf < caller frames):",
        "",
        "| config | case | repeat | rank | on CPU ms | CPU wait ms | busy CPUs | steal % | busiest others | samples | stacks |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in runs:
        for rank, w in enumerate(r["watch_by_rank"]):
            if not w:
                continue
            others = ", ".join(
                f"{p['name']} {p['cpu_ms_per_step']:.0f}" for p in w["busiest_processes"] if not p["me"]
            )[:120]
            stacks = "; ".join(f"{k} {v:.1f}" for k, v in list(w["stacks"].items())[:5])
            lines.append(
                f"| {r['config']} | {_case_label(r)} | {r['repeat']} | {rank} | {w['main_run_ms']:.0f} | "
                f"{w['main_runqueue_wait_ms']:.1f} | {w['machine_busy_cpus']:.1f} | {w['machine_steal_pct']:.2f} | "
                f"{others} | {w['samples_per_step']:.0f} | {stacks} |"
            )
    return lines


def _cores_cell(row: dict) -> str:
    """Each rank's two most frequent cores, "rank 0 / rank 1 / ...", and the timed steps two ranks ended on one core."""
    cell = " / ".join(", ".join(list(counts)[:2]) for counts in row.get("cores_by_rank") or [])
    shared = row.get("shared_core_steps")
    return f"{cell} ({shared} steps on one core)" if shared else cell


def _by_rank(hosts: list[dict], key: str, scale: float = 1.0) -> str:
    """One host counter of every rank, "rank 0 / rank 1 / ...", blank where a rank lacks it."""
    return " / ".join(f"{scale * h[key]:.0f}" if key in h else "" for h in hosts)


def _profile_lines(rows: list[dict]) -> list[str]:
    """Markdown lines: each run's profiled steps (every rank, per step), their busiest host ops and longest kernels
    after.
    """
    runs = [r for r in rows if r.get("profile")]
    if not runs:
        return []
    lines = ["", "Profiled steps after the timed ones (each rank, per step; the profiler slows the host):", ""]
    lines += [
        "| config | case | repeat | rank | step ms | compute ms | nccl ms | memcpy ms | host ops ms | host syncs | "
        "busiest host ops (ms) | longest kernels (ms) |"
    ]
    lines += ["|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in runs:
        case = _case_label(r)
        for rank, p in enumerate(r["profile_by_rank"]):
            if not p:
                continue
            ops = ", ".join(f"{o['op']} {o['ms']:.1f}" for o in p["top_host_ops"][:6])
            kernels = ", ".join(f"`{k['kernel'][:48]}` {k['ms']:.1f}" for k in p.get("top_kernels", [])[:5])
            lines.append(
                f"| {r['config']} | {case} | {r['repeat']} | {rank} | {p['step_ms']:.0f} | {p['compute_ms']:.1f} | "
                f"{p['nccl_ms']:.1f} | {p['memcpy_ms']:.1f} | {p['host_ops_ms']:.1f} | {p['host_syncs']:.1f} | {ops} | "
                f"{kernels} |"
            )
    return lines


def _ab_lines(rows: list[dict]) -> list[str]:
    """Markdown lines: each abmetrics run's median step with TRL's metrics averaged once per log and gathered per
    forward, over its own timed steps.
    """
    runs = [r for r in rows if r.get("ab_medians_s")]
    if not runs:
        return []
    lines = [
        "",
        "TRL's metrics, both ways in each launch (abmetrics; median s/step of the timed steps that ran each):",
        "",
    ]
    for r in runs:
        ways = ", ".join(f"{mode} {s:.3f}" for mode, s in r["ab_medians_s"].items())
        lines.append(f"- {r['config']} {_case_label(r)}: {ways}")
    return lines


def _sync_lines(rows: list[dict]) -> list[str]:
    """Markdown lines: rank 0's synchronising CUDA calls by site in one warm-up step, each configuration and case
    once (its first run that counted any).
    """
    seen, lines = set(), []
    for r in rows:
        sites = (r.get("sync_sites_by_rank") or [{}])[0]
        case = _case_label(r)
        if not sites or (r["config"], case) in seen:
            continue
        seen.add((r["config"], case))
        lines += [
            "",
            f"`{r['config']}` {case}, rank 0: {sum(sites.values())} syncs in its last warm-up step, by site:",
            "",
        ]
        lines += ["| syncs | site (innermost first) |", "|---:|---|"] + [f"| {n} | `{k}` |" for k, n in sites.items()]
    return lines


def _against_unsloth(summary: list[dict]) -> list[str]:
    """Markdown lines: each transformers configuration's step time and peak as a multiple of unsloth's."""
    rows = [e for e in summary if "vs_unsloth" in e]
    if not rows:
        return []
    lines = ["", "Against unsloth (same GPUs, precision, quantisation and shape; below 1 is faster):", ""]
    lines += ["| config | case | step time / unsloth's | peak / unsloth's |", "|---|---|---:|---:|"]
    for e in rows:
        peak = f"{e['peak_vs_unsloth']:.2f}x" if "peak_vs_unsloth" in e else ""
        case = _case_label(e)
        lines.append(f"| {e['config']} | {case} | {e['vs_unsloth']:.2f}x | {peak} |")
    return lines


def markdown(env: dict, command: str, summary: list[dict], rows: list[dict]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    lines = [
        f"Machine: {env['gpu_count']}x {env['gpu']} ({env['gpu_memory_gib']} GiB), driver {env['driver']}, "
        f"CUDA {env['cuda']}, {env['cpus_usable']} of {env['cpu_count']} CPUs; {versions}; Python {env['python']}; {env['date']}.",
        "",
        f"Command: `{command}`",
        "",
        "| config | case | runs ok | tok/s/GPU | scaling vs 1 GPU | step s (median of runs) | spread over runs | "
        "peak GiB/GPU | launch to 1st step s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in summary:
        case = _case_label(e)
        if not e.get("step_s"):
            lines.append(f"| {e['config']} | {case} | 0/{e['runs']} ({', '.join(e['statuses'])}) | | | | | | |")
            continue
        scaling = f"{e['scaling']:.2f}x" if "scaling" in e else ""
        first = ", ".join(f"{t:.1f}" for t in e["launch_to_first_step_s"])
        peak = f"{e['peak_gib']:.2f}" if e["peak_gib"] is not None else ""
        lines.append(
            f"| {e['config']} | {case} | {e['ok_runs']}/{e['runs']} | {e['tokens_per_s_per_gpu']:,.0f} | {scaling} | "
            f"{e['step_s']:.3f} | {e['spread_pct']:.1f}% | {peak} | {first} |"
        )
    lines += _host_table(rows) + _profile_lines(rows) + _sync_lines(rows) + _ab_lines(rows)
    if any(e.get("samples", 0) > e.get("ok_runs", 0) for e in summary):
        lines += ["", "Step s and spread: over every timed window of every run (--windows), not per run."]
    lines += _against_unsloth(summary)
    failures = [r for r in rows if r["status"] != "ok"]
    if failures:
        lines += ["", "Failures:", ""]
        for r in failures:
            lines.append(
                f"- {r['config']} {_case_label(r)}: {r['status']}: "
                f"{(r.get('error') or '').splitlines()[-1][:300] if r.get('error') else ''}"
            )
    return "\n".join(lines) + "\n"


def _shape(text: str) -> tuple[int, int]:
    seq, _, batch = text.lower().partition("x")
    value = int(seq[:-1]) * 1024 if seq.endswith("k") else int(seq)
    return value, int(batch or 1)


def parse_config(text: str) -> tuple[str, int, str]:
    """`backend[+extra...]:gpus[@launcher]` -> (backend with its extras, gpus, launcher); split_backend()
    separates the extras. Raises ValueError for unknown parts.
    """
    head, _, launcher = text.partition("@")
    spec, _, gpus = head.partition(":")
    launcher = launcher or "nbkit"
    backend, extras = split_backend(spec)
    if backend not in BACKENDS or launcher not in LAUNCHERS or not gpus.isdigit() or int(gpus) < 1:
        raise ValueError(f"{text!r}: use backend:gpus[@launcher], backend in {BACKENDS}, launcher in {LAUNCHERS}.")
    if any(e not in EXTRAS for e in extras) or (backend == "unsloth" and set(extras) - set(LAUNCH_ONLY_EXTRAS)):
        raise ValueError(
            f"{text!r}: a transformers or liger backend takes +extras from {EXTRAS}; unsloth those of "
            f"{LAUNCH_ONLY_EXTRAS}."
        )
    if len(set(extras) & set(ALLOCATOR_EXTRAS)) > 1:
        raise ValueError(f"{text!r}: one of {tuple(ALLOCATOR_EXTRAS)} at most.")
    return spec, int(gpus), launcher


def split_backend(spec: str) -> tuple[str, list[str]]:
    """`liger+compile+lean` -> ("liger", ["compile", "lean"])."""
    backend, *extras = spec.split("+")
    return backend, extras


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="unsloth:1@notebook,unsloth:2,unsloth:2@notebook,unsloth:2@accelerate")
    p.add_argument("--shapes", "--seq-lens", dest="shapes", default="1024x4,1024x16,16384x1")
    p.add_argument("--precision", default=None, help="bf16, fp16 or fp32 (default: bf16 on GPUs, fp32 on CPUs)")
    p.add_argument("--quant", default="16bit", help="16bit, 4bit or both (comma-separated)")
    p.add_argument("--model", default="random:qwen3-vl-2b")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--no-image", action="store_true", help="text-only sequences (default: one small image each)")
    p.add_argument(
        "--image-grid",
        type=lambda text: (1, int(text), int(text)),
        default=batches.IMAGE_GRID,
        metavar="PATCHES",
        help="each image PATCHES x PATCHES patches before the 2x2 merge (default 16: 64 image tokens; Qwen3-VL's "
        "16-pixel patches make 80 a 1,280-pixel image, 1,600 tokens)",
    )
    p.add_argument("--trainer", choices=("sft", "hf"), default="sft")
    p.add_argument(
        "--trainer-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a TrainingArguments / SFTConfig option for every launch, VALUE as JSON "
        "(e.g. logging_nan_inf_filter=false); repeatable",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--memory-cap-gib", type=float, default=None)
    p.add_argument(
        "--emulate",
        default=None,
        help="a GPU profile every rank applies (nbkit.emulate), e.g. T4: its memory cap and precision "
        "(fp16 unless --precision says otherwise)",
    )
    p.add_argument(
        "--no-preload",
        action="store_true",
        help="the notebook launchers' process imports nothing before the launch (by default it imports the model's "
        "modeling module, as a notebook has after earlier cells)",
    )
    p.add_argument(
        "--unsloth-loss",
        choices=("unsloth", "nbkit"),
        default="unsloth",
        help="unsloth's loss: its own fused loss, or nbkit's chunked loss (nbkit.savers.apply(model, "
        "checkpointing=None, tiled_mlp=False))",
    )
    p.add_argument("--longest", action="store_true", help="search the longest sequence that trains (batch 1)")
    p.add_argument("--launch-timeout", type=float, default=400)
    p.add_argument("--time-limit", type=float, default=None, help="start no launch after this many seconds")
    p.add_argument(
        "--windows", type=int, default=1, help="split each run's timed steps into this many windows (median of each)"
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of +compile (aot_eager: no code generation)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile this many steps after the timed ones (each rank: host ops, kernels, syncs per step)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    p.add_argument("--launch-mode", help=argparse.SUPPRESS)
    p.add_argument("--worker-mode", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.launch_mode:
        return _launch_mode(a.launch_mode)
    if a.worker_mode:
        return _worker_mode(a.worker_mode)

    import nbkit

    configs = [parse_config(c) for c in a.configs.split(",") if c]
    if a.windows < 1 or a.steps < a.windows:
        p.error(f"--windows {a.windows} needs at least as many --steps ({a.steps})")
    trainer_options = {}
    for item in a.trainer_option:
        name, sep, value = item.partition("=")
        if not sep:
            p.error(f"--trainer-option takes NAME=VALUE, not {item!r}")
        trainer_options[name] = json.loads(value)
    shapes = [_shape(s) for s in a.shapes.split(",") if s]
    if a.longest:
        shapes = sorted((s, 1) for s, _ in shapes)
    profile = nbkit.emulate(a.emulate) if a.emulate else None  # NBKIT_EMULATE: every launched process inherits it
    precision = a.precision or (profile.precision if profile else "bf16" if a.device == "cuda" else "fp32")
    quants = [q for q in a.quant.split(",") if q]
    if any(q not in QUANTS for q in quants):
        p.error(f"--quant takes {QUANTS}")
    path = nbkit.resolve_model(a.model)
    gpu_count = len(nbkit.visible_gpus())
    env, rows, started = host.environment(), [], time.monotonic()
    for package in ("liger-kernel", "triton"):  # not in host.environment()'s list
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            env["versions"][package] = importlib.metadata.version(package)
    command = " ".join(["python3", "benchmarks/trainer_bench.py", *(argv if argv is not None else sys.argv[1:])])
    # Each launch's spec and rows, and the launchers' log folders: gone when the benchmark ends.
    with tempfile.TemporaryDirectory(prefix="trainer-bench-") as scratch:
        workdir = Path(scratch)
        # In the order of three nested loops: repeat, then configuration, then quantisation.
        for repeat, (spec, gpus, launcher), quant in itertools.product(range(a.repeats), configs, quants):
            backend, extras = split_backend(spec)
            launch = Launch(
                backend,
                gpus,
                launcher,
                a.model,
                path,
                a.device,
                precision,
                quant,
                shapes,
                "",
                a.steps,
                a.warmup,
                not a.no_image,
                a.trainer,
                repeat,
                a.memory_cap_gib,
                a.longest,
                trainer_options=trainer_options,
                emulate=profile.name if profile else None,
                unsloth_loss=a.unsloth_loss,
                extras=extras,
                windows=a.windows,
                compile_backend=a.compile_backend,
                profile_steps=a.profile_steps,
                preload=not a.no_preload,
                image_grid=a.image_grid,
            )
            skip = None
            if a.time_limit is not None and time.monotonic() - started > a.time_limit:
                skip = f"not started: the {a.time_limit:.0f} s time limit had passed"
            elif a.device == "cuda" and gpus > gpu_count:
                skip = f"needs {gpus} GPUs, this machine has {gpu_count}"
            elif backend == "unsloth" and a.device != "cuda":
                skip = "unsloth trains only on GPUs"
            if skip:
                rows += [dict(_identity(launch), seq_len=s, batch=b, status="skipped", error=skip) for s, b in shapes]
                continue
            rows += run_launch(launch, workdir, a.launch_timeout)
            summary = summarise(rows)
            if a.out:
                Path(a.out).write_text(
                    json.dumps(
                        {
                            "command": command,
                            "environment": env,
                            "wall_s": time.monotonic() - started,
                            "summary": summary,
                            "results": rows,
                        },
                        indent=1,
                    )
                )
            if a.md:
                Path(a.md).write_text(markdown(env, command, summary, rows))
    print(markdown(env, command, summarise(rows), rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
