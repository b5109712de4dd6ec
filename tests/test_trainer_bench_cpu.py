"""benchmarks/trainer_bench.py end to end on the CPU: real SFTTrainer runs of tiny:qwen3-vl.

Two gloo ranks under nbkit.launch, a live set, `accelerate launch` and torchrun (an exported cell's
rank set-up), one process under notebook_launcher; a Liger configuration, which cannot run on a CPU, must be recorded with nbkit's
message and the run must go on. Also the configuration parser and the summary's arithmetic.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS.parent))

from benchmarks import trainer_bench  # noqa: E402
from nbkit.platform import compat  # noqa: E402


def test_configs_and_shapes_parse():
    assert trainer_bench.parse_config("unsloth:2") == ("unsloth", 2, "nbkit")
    assert trainer_bench.parse_config("liger:4@accelerate") == ("liger", 4, "accelerate")
    assert trainer_bench.parse_config("unsloth:2@torchrun") == ("unsloth", 2, "torchrun")
    assert trainer_bench.parse_config("unsloth:2@live") == ("unsloth", 2, "live")
    for bad in ("plain:2", "unsloth:0", "unsloth:2@mpirun", "unsloth"):
        with pytest.raises(ValueError, match="backend:gpus"):
            trainer_bench.parse_config(bad)
    with pytest.raises(ValueError, match="at most"):
        trainer_bench.parse_config("liger+expand+noexpand:2")
    # unsloth takes the extras that change only what passes between ranks, and no other.
    assert trainer_bench.parse_config("unsloth+ddpreducer:2") == ("unsloth+ddpreducer", 2, "nbkit")
    with pytest.raises(ValueError, match="unsloth those of"):
        trainer_bench.parse_config("unsloth+compile:2")
    assert trainer_bench._shape("1024x16") == (1024, 16)
    assert trainer_bench._shape("16k") == (16384, 1)


def _row(config: str, gpus: int, median: float, repeat: int, status: str = "ok") -> dict:
    backend, *extras = config.split(":")[0].split("+")
    return {
        "config": config,
        "backend": backend,
        "extras": extras,
        "gpus": gpus,
        "launcher": config.partition("@")[2] or "nbkit",
        "precision": "bf16",
        "quant": "16bit",
        "seq_len": 1024,
        "batch": 4,
        "repeat": repeat,
        "status": status,
        "step_time_s": {"median": median} if status == "ok" else None,
        "peak_allocated_gib": [5.0] * gpus,
        "launch_to_first_step_s": 30.0 + repeat,
    }


def _summary(rows: list[dict]) -> dict[str, dict]:
    """trainer_bench's summary of these rows, by configuration."""
    return {e["config"]: e for e in trainer_bench.summarise(rows)}


def test_summary_takes_the_median_of_repeats_and_scales_against_one_gpu():
    rows = [_row("unsloth:1@notebook", 1, 0.2, r) for r in range(3)]
    rows += [_row("unsloth:2@nbkit", 2, m, r) for r, m in enumerate([0.25, 0.21, 0.30])]
    rows.append(_row("unsloth:2@nbkit", 2, 0.0, 3, status="error"))
    summary = _summary(rows)
    two = summary["unsloth:2@nbkit"]
    assert two["runs"] == 4 and two["ok_runs"] == 3
    assert two["step_s"] == 0.25
    assert two["tokens_per_s_per_gpu"] == pytest.approx(4096 / 0.25)
    assert two["spread_pct"] == pytest.approx(100 * (0.30 - 0.21) / 0.25)
    assert two["scaling"] == pytest.approx(2 * 0.2 / 0.25)
    assert "scaling" not in summary["unsloth:1@notebook"]


def test_scaling_compares_runs_that_do_the_same_work():
    """A 2-GPU run scales against the 1-GPU run with its extras (listed in any order), a launch-only extra aside."""
    rows = [
        _row("liger+nockpt+compile:1@notebook", 1, 0.40, 0),
        _row("liger+compile:1@notebook", 1, 0.30, 0),
        _row("liger+compile+nockpt:2@nbkit", 2, 0.50, 0),
        _row("liger+compile:2@nbkit", 2, 0.32, 0),
        _row("liger+compile+nostop:2@live", 2, 0.36, 0),
        _row("liger+lean:2@nbkit", 2, 0.36, 0),
    ]
    summary = _summary(rows)
    assert summary["liger+compile+nockpt:2@nbkit"]["scaling"] == pytest.approx(2 * 0.40 / 0.50)
    assert summary["liger+compile:2@nbkit"]["scaling"] == pytest.approx(2 * 0.30 / 0.32)
    assert summary["liger+compile+nostop:2@live"]["scaling"] == pytest.approx(2 * 0.30 / 0.36)
    assert "scaling" not in summary["liger+lean:2@nbkit"]  # no 1-GPU run did its work


def test_scaling_prefers_the_one_gpu_run_through_the_same_launcher():
    rows = [
        _row("liger+compile:1@notebook", 1, 0.35, 0),
        _row("liger+compile:1@live", 1, 0.25, 0),
        _row("liger+compile:1@nbkit", 1, 0.24, 0),
        _row("liger+compile:2@live", 2, 0.30, 0),
        _row("liger+compile:2@nbkit", 2, 0.28, 0),
        _row("liger+compile:2@accelerate", 2, 0.29, 0),
    ]
    summary = _summary(rows)
    assert summary["liger+compile:2@live"]["scaling"] == pytest.approx(2 * 0.25 / 0.30)
    assert summary["liger+compile:2@nbkit"]["scaling"] == pytest.approx(2 * 0.24 / 0.28)
    # No one-GPU run through accelerate launch: the first one listed.
    assert summary["liger+compile:2@accelerate"]["scaling"] == pytest.approx(2 * 0.35 / 0.29)


# trl's own default under transformers' old name (nbkit's compat group, not applied here, renames it in the ranks)
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_nockpt_turns_the_trainers_own_checkpointing_off_under_the_name_this_transformers_reads():
    """SFTConfig checkpoints by default; a layer without nbkit's checkpoint would then be recomputed anyway."""
    from trl import SFTConfig

    default = SFTConfig(output_dir="unused", use_cpu=True, bf16=False)
    off = SFTConfig(output_dir="unused", use_cpu=True, bf16=False, **{compat.trainer_checkpointing_field(): False})
    assert trainer_bench._trainer_checkpoints(default) is True
    assert trainer_bench._trainer_checkpoints(off) is False


@pytest.mark.slow
def test_trainer_runs_under_every_launcher_and_records_what_cannot_run(tmp_path, monkeypatch):
    out, md = tmp_path / "trainer.json", tmp_path / "trainer.md"
    scratch = tmp_path / "tmp"  # the temporary directory of the benchmark and of every process it starts
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    code = trainer_bench.main(
        [
            "--configs",
            "transformers:2,transformers:1@notebook,transformers+expand:2@accelerate,transformers+findunused:2@torchrun,"
            "transformers:2@live,liger:1@notebook",
            "--shapes",
            "128x2",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--model",
            "tiny:qwen3-vl",
            "--device",
            "cpu",
            "--launch-timeout",
            "240",
            "--profile-steps",
            "1",
            "--out",
            str(out),
            "--md",
            str(md),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    rows = {r["config"]: r for r in report["results"]}
    launched = ("nbkit", "live", "accelerate", "torchrun")
    extra = {"accelerate": "+expand", "torchrun": "+findunused"}
    configs = [f"transformers{extra.get(launcher, '')}:2@{launcher}" for launcher in launched]
    for config in ("transformers:1@notebook", *configs):
        row = rows[config]
        assert row["status"] == "ok", row.get("error")
        assert len(row["step_times_s"]) == 4  # warm-up + timed steps, each timed by the callback
        assert row["tokens_per_s_per_gpu"] == pytest.approx(256 / row["step_time_s"]["median"])
        assert row["launch_to_first_step_s"] > row["first_step_s"] > 0
        assert row["loss_first"] > 0 and row["loss_last"] > 0
        assert len(row["peak_allocated_gib"]) == row["gpus"]
        # the host's counters of rank 0's timed steps: its main thread trained, in a process of >= 1 thread
        assert 0 < row["host"]["main_cpu_s"] <= row["host"]["process_cpu_s"] + 1e-3
        assert row["host"]["os_threads"] >= 1 and row["torch_threads"] >= 1
        # every rank's counters and profiled step, rank 0's first: the rank that sets the pace can be told apart
        assert len(row["host_by_rank"]) == len(row["profile_by_rank"]) == row["gpus"]
        assert row["host_by_rank"][0] == row["host"] and row["profile_by_rank"][0] == row["profile"]
        for host, profile in zip(row["host_by_rank"], row["profile_by_rank"]):
            assert host["main_cpu_s"] > 0 and host["main_voluntary_switches"] >= 0 and host["main_page_faults"] >= 0
            assert profile["steps"] == 1 and profile["host_ops_ms"] > 0
        # each rank's main thread's cores, one count per timed step (the later half of the steps)
        assert [sum(cores.values()) for cores in row["cores_by_rank"]] == [2] * row["gpus"]
        assert 0 <= row["shared_core_steps"] <= 2
        # each rank's threads by name over those steps, its main thread among them (a live rank has ipykernel's too)
        for groups in row["threads_by_rank"]:
            assert groups["(main)"]["threads"] == 1 and all(g["cpu_ms_per_step"] >= 0 for g in groups.values())
        # each rank's interpreter after its steps, for telling two launchers' processes apart
        assert len(row["interpreter_by_rank"]) == row["gpus"]
        assert all(i["modules"] > 0 and i["gc_tracked"] > 0 for i in row["interpreter_by_rank"])
        assert row["trainer_checkpointing"] is True  # SFTConfig's default, which nbkit's checkpointed layers ignore
        # two ranks: DDP's options as it held them; in place, no DDP
        assert (row["ddp"] is None) == (row["gpus"] == 1)
    # nbkit's rank set-up (trainer_defaults): no search for unused parameters where LoRA trains only the language
    # model and its layers are checkpointed
    for launcher in ("nbkit", "live"):
        assert rows[f"transformers:2@{launcher}"]["ddp"]["find_unused_parameters"] is False
    # a forked rank set the notebook's objects aside from its collections; a live rank is a process of its own
    assert all(i["gc_frozen"] > 0 for i in rows["transformers:2@nbkit"]["interpreter_by_rank"])
    # ... and the user's own choice stands (the findunused extra sets it as a user would)
    assert rows["transformers+findunused:2@torchrun"]["ddp"]["find_unused_parameters"] is True
    # the allocator extra reaches the ranks' environment; a launch without it leaves the setting alone
    assert rows["transformers+expand:2@accelerate"]["alloc_conf"] == "expandable_segments:True"
    assert rows["transformers:2@nbkit"]["alloc_conf"] == os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    liger = rows["liger:1@notebook"]
    assert liger["status"] == "error"
    assert "KernelsError" in liger["error"] and "need the model on CUDA GPUs" in liger["error"]
    summary = {e["config"]: e for e in report["summary"]}
    assert summary["transformers:2@nbkit"]["scaling"] > 0
    text = md.read_text()
    assert "| transformers+expand:2@accelerate | fp32 16bit 128x2 | 1/1 |" in text
    assert "liger:1@notebook fp32 16bit 128x2: error: " in text
    # the host table gives both ranks of a launch, the profile table a row per rank
    nbkit_host = next(
        line for line in text.splitlines() if line.startswith("| transformers:2@nbkit | fp32 16bit 128x2 | 0 |")
    )
    assert len(nbkit_host.split("|")[5].split(" / ")) == 2
    # ... and a row per rank in the threads table, the main thread named
    live = [line for line in text.splitlines() if line.startswith("| transformers:2@live | fp32 16bit 128x2 | 0 |")]
    assert [line.split("|")[4].strip() for line in live if "(main) x1: " in line] == ["0", "1"]
    assert any(line.startswith("| transformers:2@live | fp32 16bit 128x2 | 0 | 1 |") for line in text.splitlines())
    # Left behind: only caches, the launches' working folder (unsloth's compiled code) and inductor's; no specs,
    # rows or launcher logs (torch elastic's torchelastic_* folders went with them).
    caches = ("nbkit-trainer-bench", "torchinductor_")
    assert [p.name for p in scratch.iterdir() if not p.name.startswith(caches)] == []
