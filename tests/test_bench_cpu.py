"""The benchmark harness (benchmarks/bench.py, benchmarks/runner.py and the parts it uses) end to end on the CPU.

Real launches of tiny:qwen3-vl with 2 gloo ranks, under nbkit.launch and under `accelerate launch`
of the same function as a script; one case fails on every rank (a sequence too short for its
image) and one configuration cannot run here (unsloth), and the run must record both and go on.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS.parent))

from benchmarks.batches import shard_batch, synthetic_batch  # noqa: E402
from benchmarks.cases import ddp_label, parse_ddp_options  # noqa: E402
from benchmarks.host_placement import _cpulist, topology  # noqa: E402
from benchmarks.measures import gc_pauses, percentile, step_stats  # noqa: E402
from benchmarks.stepping import Stepper, wrap_ddp  # noqa: E402
from benchmarks.sync_sites import SYNC_WARNING, SyncSites  # noqa: E402


def test_step_stats_percentiles_and_spread():
    stats = step_stats([3.0, 1.0, 10.0, 2.0, 4.0])
    assert stats["median"] == 3.0
    assert stats["min"] == 1.0 and stats["max"] == 10.0
    assert stats["p10"] == pytest.approx(1.4)  # linear interpolation between the sorted times
    assert stats["p90"] == pytest.approx(7.6)
    assert stats["spread_pct"] == pytest.approx(100 * (7.6 - 1.4) / 3.0)
    # soak.py's p95 and the live studies' p10/p90 are the same interpolation
    assert percentile([3.0, 1.0, 10.0, 2.0, 4.0], 0.95) == pytest.approx(8.8)
    assert percentile([5.0], 0.5) == 5.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)


def test_gc_pauses_are_counted_per_generation_inside_the_block_only():
    import gc

    with gc_pauses() as pauses:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    assert pauses["collections"][2] == 2 and pauses["collections"][0] >= 1
    assert 0 < pauses["max_ms"] <= pauses["total_ms"]
    seen = list(pauses["collections"])
    gc.collect()
    assert pauses["collections"] == seen  # the callback left with the block


def test_ddp_options_parse_and_reject_unknown_keys():
    options = dict(parse_ddp_options("bucket_cap_mb=100, static_graph=true,comm_hook=bf16"))
    assert options == {
        "bucket_cap_mb": 100,
        "static_graph": True,
        "comm_hook": "bf16",
        "find_unused_parameters": "auto",
        "freeze_unused": True,
    }
    assert ddp_label(options) == "bucket_cap_mb=100,comm_hook=bf16,static_graph=True"
    with pytest.raises(ValueError, match="bucket_cap_mb"):  # the message lists the known keys
        parse_ddp_options("bucket_size=100")
    assert ddp_label(dict(parse_ddp_options("reducer=flat,freeze_unused=false"))) == "freeze_unused=False,reducer=flat"
    with pytest.raises(ValueError, match="replaces DistributedDataParallel, which static_graph configure"):
        parse_ddp_options("reducer=flat,static_graph=true")


def test_synthetic_image_batch_shards_back_into_the_global_batch(tiny_vl_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_vl_path)
    batch = synthetic_batch(config, 96, 4, "cpu", image=True, seed=3)
    assert batch["input_ids"].shape == (4, 96)
    image = batch["input_ids"] == config.image_token_id
    assert image.sum(dim=1).tolist() == [64] * 4  # 16x16 patches after the 2x2 merge
    assert torch.equal(batch["mm_token_type_ids"].bool(), image)
    assert torch.equal(batch["labels"], batch["input_ids"].masked_fill(image, -100))  # no loss on image tokens
    shards = [shard_batch(batch, 2, i) for i in range(2)]
    for key, value in batch.items():
        assert torch.equal(torch.cat([s[key] for s in shards]), value), key
    assert shards[1]["pixel_values"].shape[0] == 2 * 256  # its two sequences' patches
    with pytest.raises(ValueError, match="too short"):
        synthetic_batch(config, 32, 1, "cpu", image=True)
    # A larger image (trainer_bench --image-grid): its patches, its merged tokens, and its grid for the vision tower.
    large = synthetic_batch(config, 200, 2, "cpu", image=True, image_grid=(1, 24, 20))
    assert (large["input_ids"] == config.image_token_id).sum(dim=1).tolist() == [120] * 2
    assert large["pixel_values"].shape[0] == 2 * 480
    assert large["image_grid_thw"].tolist() == [[1, 24, 20]] * 2


def test_bench_runs_launches_side_by_side_and_records_failures(tmp_path, tiny_vl_path):
    out, md = tmp_path / "results.json", tmp_path / "results.md"
    cmd = [
        sys.executable,
        str(BENCHMARKS / "bench.py"),
        "--configs",
        "nbkit:2,nbkit:2@accelerate,unsloth:1",
        "--model",
        "tiny:qwen3-vl",
        "--seq-lens",
        "32,128",
        "--image",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--profile",
        "--profile-steps",
        "1",
        "--out",
        str(out),
        "--md",
        str(md),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[nbkit:2] fp32 128x4:" in done.stdout  # progress lines as it goes

    report = json.loads(out.read_text())
    assert report["environment"]["versions"]["torch"] == torch.__version__
    rows = {(r["config"], r["seq_len"]): r for r in report["results"]}
    assert set(rows) == {(c, n) for c in ("nbkit:2", "nbkit:2@accelerate", "unsloth:1") for n in (32, 128)}

    for config in ("nbkit:2", "nbkit:2@accelerate"):
        row = rows[(config, 128)]
        assert row["status"] == "ok", row
        assert row["batch"] == 4 and row["precision"] == "fp32"
        times = row["step_times_s"]
        assert len(times) == 2 and row["step_time_s"]["median"] == pytest.approx(statistics.median(times))
        assert row["tokens_per_s_per_gpu"] == pytest.approx(128 * 4 / statistics.median(times))
        assert row["tokens_per_s_total"] == pytest.approx(2 * row["tokens_per_s_per_gpu"])
        assert row["loss_finite"] and row["loss_first"] > 0
        assert row["unused_trainable_params"] == 0  # with an image the vision tower's LoRA trains too
        assert 0 < row["launch_to_first_step_s"] < row["launch_wall_s"]
        profile = Path(report["settings"]["profile_dir"]) / row["profile"]["files"][0]
        assert "Self CPU" in profile.read_text()
        assert row["profile"]["host_ops_ms_per_step"] > 0
        gc_ranks = row["gc"]["per_rank"]  # both ranks' collections; the slower one is the step's
        assert len(gc_ranks) == 2 and all(len(r["collections"]) == 3 for r in gc_ranks)
        assert row["gc"]["ms_per_step"] == max(r["ms_per_step"] for r in gc_ranks)

        short = rows[(config, 32)]  # the image does not fit: every rank fails its probe, the launch goes on
        assert short["status"] == "error" and short["phase"] == "probe"
        assert short["failed_ranks"] == [0, 1] and "too short" in short["error"]

    for n in (32, 128):
        assert rows[("unsloth:1", n)]["status"] == "skipped"
        assert "GPU" in rows[("unsloth:1", n)]["error"]

    table = md.read_text()
    assert "| config | case | status | tok/s/GPU |" in table
    assert "| nbkit:2 | fp32 128x4 | ok |" in table
    assert "| nbkit:2@accelerate | fp32 128x4 | ok |" in table
    assert "## Launchers: median step time vs nbkit.launch" in table
    assert "| nbkit:2 | fp32 32x4 | error: ValueError: One image takes 66 tokens" in table
    assert "| unsloth:1 | fp32 32x4 | skipped: unsloth trains only on GPUs" in table


def test_gradient_accumulation_counts_every_micro_batch(tmp_path):
    out = tmp_path / "ga.json"
    cmd = [
        sys.executable,
        str(BENCHMARKS / "bench.py"),
        "--configs",
        "nbkit:1@notebook,nbkit:2",
        "--model",
        "tiny:qwen3",
        "--seq-lens",
        "64x2",
        "--grad-accum",
        "3",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    for config, world in (("nbkit:1@notebook", 1), ("nbkit:2", 2)):
        row = rows[config]
        assert row["status"] == "ok" and row["grad_accum"] == 3, row
        assert row["tokens_per_step"] == 64 * 2 * 3 * world
        assert row["tokens_per_s_per_gpu"] == pytest.approx(64 * 2 * 3 / row["step_time_s"]["median"])
    assert rows["nbkit:2"]["scaling"] == pytest.approx(
        rows["nbkit:2"]["tokens_per_s_total"] / rows["nbkit:1@notebook"]["tokens_per_s_total"]
    )
    assert "64x2 GA3" in out.with_suffix(".md").read_text()


def _ddp_and_flat_updates(path: str) -> list[str]:
    """On each rank: one SGD step of the same model under DDP and under reducer=flat, each rank starting from
    weights of its own and training on a batch of its own, with and without gradient accumulation; asserts the
    updated weights are equal, and returns which cases ran."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from benchmarks.ranks import setup_rank, teardown_rank

    cpu, ran = setup_rank("cpu"), []
    rank = dist.get_rank()
    for accum in (1, 3):
        updated = {}
        for reducer in ("", "reducer=flat"):
            torch.manual_seed(rank)  # other weights on each rank: both must start from rank 0's
            model = AutoModelForCausalLM.from_pretrained(path)
            for param in model.parameters():
                param.data.normal_(0, 0.02)
            model.lm_head.weight.requires_grad_(False)  # a frozen tensor, as LoRA leaves most of a model
            batch = {"input_ids": torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(7 + rank))}
            batch["labels"] = batch["input_ids"]
            wrapped = wrap_ddp(model, cpu, parse_ddp_options(reducer))
            trainable = [p for p in wrapped.parameters() if p.requires_grad]
            Stepper(wrapped, "fp32", cpu, optimizer=torch.optim.SGD(trainable, lr=1.0), grad_accum=accum).step(batch)
            updated[reducer] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            ran.append(f"{type(wrapped).__name__} GA{accum}")
        ddp, flat = updated.values()
        assert ddp.keys() == flat.keys()
        different = [(k, (ddp[k] - flat[k]).abs().max().item()) for k in ddp if not torch.equal(ddp[k], flat[k])]
        assert different == [], f"rank {rank}, GA{accum}: {different[:5]}"
    teardown_rank()
    return ran


def test_the_flat_reducer_updates_the_weights_exactly_as_ddp_does(tiny_text_path):
    import nbkit

    ran = nbkit.launch(_ddp_and_flat_updates, tiny_text_path, gpus=2)
    assert ran == [
        "DistributedDataParallel GA1",
        "FlatGradients GA1",
        "DistributedDataParallel GA3",
        "FlatGradients GA3",
    ]


def test_ddp_copies_each_lora_gradient_and_the_flat_reducer_does_not(tmp_path):
    out = tmp_path / "ops.json"
    cmd = [sys.executable, str(BENCHMARKS / "ddp_op_count.py"), "--layers", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    tensors, ops = result["trainable_tensors"], result["differing"]
    assert tensors == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
    one, ddp, flat = ops["aten::copy_"]  # one process / DDP / flat: copies of gradients, kernels on a GPU
    assert ddp - one >= 2 * tensors and flat - one <= 2  # per tensor, against per step
    assert ops["c10d::allreduce_"][1:] == [1, 1]  # one bucket and one flat buffer: the model is small
    assert "trainable tensors: 28" in done.stdout


def test_accumulated_micro_batches_give_the_update_of_their_mean(tiny_text_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 100, (2, 16))}
    batch["labels"] = batch["input_ids"]
    updates = []
    for accum in (1, 3):
        model = AutoModelForCausalLM.from_pretrained(tiny_text_path)
        before = model.lm_head.weight.detach().clone()
        Stepper(
            model, "fp32", torch.device("cpu"), optimizer=torch.optim.SGD(model.parameters(), lr=1.0), grad_accum=accum
        ).step(batch)
        updates.append(model.lm_head.weight.detach() - before)
    assert updates[0].abs().max() > 0
    torch.testing.assert_close(updates[1], updates[0])  # the same batch three times, each a third: one step's update


def test_gpu_soak_cycles_live_sets_and_finds_nothing_left(tmp_path):
    # The GPU soak's dry run: CPU ranks, 2 cycles, in a process of its own as on the GPU host.
    out = tmp_path / "soak.json"
    # A temporary directory of its own: the soak counts the files there as leftovers, and other test runs on this
    # machine (CI runs the oldest set's slowest files beside the suite) share /tmp.
    private = tmp_path / "tmp"
    private.mkdir()
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_soak.py"), "--cycles", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(private)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    records = result["records"]
    assert result["flat"] and len(records) == 2
    assert [r["losses_rank0"] for r in records] == [records[0]["losses_rank0"]] * 2  # seeded: the same steps
    assert len(records[0]["losses_rank0"]) == 3 and all(r["device_rank0"] == "cpu" for r in records)
    left = [(r["process"]["children"], r["left_since_first_cycle"]) for r in records]
    assert all(children == 0 and not grown for children, grown in left), left


def test_host_placement_reads_cpu_lists_and_this_machines_layout():
    # sysfs writes ranges and single CPUs, comma-separated
    assert _cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert _cpulist("") == []
    topo = topology()
    assert sorted(topo["cpus"]) == sorted(os.sched_getaffinity(0))
    for cpu, info in topo["cpus"].items():
        assert cpu in info["siblings"]  # a CPU is among its core's threads
    # every NUMA node lists only CPUs this process may use, and none twice
    listed = [c for cpus in topo["nodes"].values() for c in cpus]
    assert len(listed) == len(set(listed)) and set(listed) <= set(topo["cpus"])


def test_rank_host_probe_measures_a_launched_and_a_live_rank_and_what_each_has_hooked(tmp_path):
    out, md = tmp_path / "probe.json", tmp_path / "probe.md"
    cmd = [sys.executable, str(BENCHMARKS / "rank_host_probe.py"), "--rounds", "2", "--out", str(out), "--md", str(md)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    launched, live = report["rounds"]["launch"], report["rounds"]["live"]
    assert len(launched) == len(live) == 2
    for measured in launched + live:
        assert measured["device"] == "cpu" and all(measured[key] > 0 for key in ("add_us", "mm_us", "call_ns"))
        assert measured["trace"] == "None" and measured["monitoring_tools"] == {}
    # a live rank is an ipyparallel engine: ipykernel's threads and its debugger's modules, idle; a forked rank has none
    assert live[0]["os_threads"] > launched[0]["os_threads"] and launched[0]["debugger_modules"] == 0
    # the medians as the probe reports them, to 2 decimals (a median of two rounds is their mean, which may not be)
    assert report["medians"]["live"]["module_us"] == round(statistics.median(m["module_us"] for m in live), 2)
    assert [line.split("|")[1].strip() for line in md.read_text().splitlines()[2:4]] == ["launch", "live"]


def test_flagship_scaling_compares_whole_run_throughput_and_names_a_summary_without_a_pace(tmp_path):
    def summary(folder: str, seconds: float, tokens: float, processes: int) -> Path:
        train = {
            "seconds_per_step": seconds,
            "tokens_per_second": tokens,
            "first_step_seconds": 30.0,
            "mean_seconds_per_step": 2.0,
            "batch": {"per_device": 2, "accumulation": 1, "processes": processes},
            "peak_memory_gib": 4.5,
        }
        path = tmp_path / folder / "qwen3_vl_2xT4" / "summary.json"
        path.parent.mkdir(parents=True)
        run = {"backend": "unsloth", "precision": "fp16", "load_in_4bit": False, "checkpointing": None, "train": train}
        path.write_text(json.dumps(run))
        return path

    one, two = summary("gpus1", 0.3, 1600.0, 1), summary("gpus2", 0.4, 1200.0, 2)
    script = [sys.executable, str(BENCHMARKS / "flagship_scaling.py")]
    done = subprocess.run([*script, str(one), f"two GPUs={two}"], capture_output=True, text=True, check=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith("| gpus1") or line.startswith("| two")]
    assert rows[0].endswith("| 1,600 | 4.50 | 1.00x |")
    assert rows[1].startswith("| two GPUs | unsloth | fp16 | False | None |")  # named by its label
    assert rows[1].endswith("| 2,400 | 4.50 | 1.50x |")  # 1,200 tokens/s on each of 2 GPUs against 1,600
    assert "| 2 x 1 x 2 | 0.400 |" in rows[1]
    paceless = summary("plain", 0.3, 0.0, 1)
    failed = subprocess.run([*script, str(one), str(paceless)], capture_output=True, text=True)
    assert failed.returncode == 1 and str(paceless) in failed.stderr and "no steady tokens/s" in failed.stderr
    assert "| gpus1 |" in failed.stdout and "| plain |" not in failed.stdout  # the other runs still get their rows


def _reads_the_gpu(sync_warnings: int) -> None:
    """Stands in for model code that reads GPU values: torch's warning for each read, as under sync debug mode."""
    import warnings

    for _ in range(sync_warnings):
        warnings.warn(f"{SYNC_WARNING} (item)", UserWarning, stacklevel=1)


def test_sync_sites_count_every_synchronising_call_by_its_caller_and_pass_other_warnings_on():
    import warnings

    sites = SyncSites(depth=1)
    with warnings.catch_warnings(record=True) as others, sites.watch():
        _reads_the_gpu(3)
        _reads_the_gpu(2)  # the same line: one site, counted every time, not once as warnings' default would
        warnings.warn("a deprecation the user should still see", UserWarning, stacklevel=1)
    assert len(sites.counts) == 1
    (site,) = sites.counts
    path, _, where = site.partition(":")
    assert path.endswith("tests/test_bench_cpu.py") and where.endswith(" _reads_the_gpu")
    assert sites.counts[site] == 5
    assert [str(w.message) for w in others] == ["a deprecation the user should still see"]
    # outside watch() nothing is counted
    with warnings.catch_warnings(record=True):
        _reads_the_gpu(1)
    assert sum(sites.counts.values()) == 5


def test_sync_sites_top_keeps_the_total():
    sites = SyncSites()
    sites.counts.update({"a.py:1 f": 5, "b.py:2 g": 3, "c.py:3 h": 1})
    assert sites.top(2) == {"a.py:1 f": 5, "b.py:2 g": 3, "(other sites)": 1}
    assert sites.top() == {"a.py:1 f": 5, "b.py:2 g": 3, "c.py:3 h": 1}
