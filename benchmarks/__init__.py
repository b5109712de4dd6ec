"""nbkit's GPU benchmarks: the harnesses (scripts) and the parts they share, one module per job.

Scripts, run as `python benchmarks/NAME.py ...` (see benchmarks/README.md):

- bench.py: the matrix of backends x launchers x GPU counts (results as JSON and a markdown table).
- trainer_bench.py: the same through TRL's SFTTrainer / transformers' Trainer, as users train.
- savers.py: nbkit's memory savers at long sequences, one configuration after another.
- planner_accuracy.py: nbkit.plan's estimates against measured peaks.
- fork_probe.py: which import creates a CUDA context in a notebook-like process.
- the CPU and live-set studies: soak.py, stop_agreement.py, live_overhead.py, live_first_step.py,
  live_names.py, host_cost.py, trainer_memory.py (their medians and percentiles from measures).

Parts (also imported by tests/test_bench_cpu.py, tests/test_gpu_ddp.py and tests/faults):

- cases: what one launch runs (LaunchSpec, Case, DDP options) and the identity of a result row.
- ranks: a rank's set-up and teardown, and the agreements between ranks.
- models: LoRA models built the way each backend's users build them.
- batches: synthetic batches (text, or text with one small image) and their shards.
- stepping: DDP wrapping and timed training steps.
- measures: statistics of repeated timings (median, percentiles, spread), garbage-collection
  pauses, peak memory.
- leftovers: what of a process a launch could leave behind (children, descriptors, threads, ports,
  temporary files, /dev/shm, memory); soak.py and the fault tests (tests/faults) share it.
- profiling: a torch.profiler summary of a few steps.
- host: the machine and library versions a result was measured with.
- runner: one launch on one rank (every case of a spec; the same function under every launcher).
- launching: the launching side (each launch a fresh process group, its output's tail, its time limit,
  the rows it wrote), for bench.py and trainer_bench.py.

A minimal use, in each launched rank::

    from benchmarks import batches, models, ranks, stepping
    device = ranks.setup_rank()
    model = models.build_model("nbkit", path, "bf16", device)
    batch = batches.synthetic_batch(model.config, 1024, 4, device)
    step = stepping.Stepper(stepping.wrap_ddp(model, device), "bf16", device)
    times, losses = stepping.timed_steps(step, batch, steps=20)
"""

# First, before torch: nbkit.platform.forksafety keeps the launching process fork-safe.
import nbkit  # noqa: F401
