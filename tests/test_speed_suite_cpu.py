"""benchmarks/gpu_suite.sh's `speed` part in its CPU dry run, and trainer_bench's speed options.

The dry run is the GPU part with tiny:qwen3-vl on the CPU: the same trainer_bench options (configs with
+compile and +lean, 3 timed windows per shape, a bf16 part and a T4-profile part), Liger swapped for the
plain transformers path (Liger needs CUDA) and compiled with aot_eager. unsloth cannot run on a CPU and
must be recorded as skipped while the rest goes on. And benchmarks/loss_chunks.py (the loss alone by rows
per chunk) on the CPU, small.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import trainer_bench  # noqa: E402


def test_configs_take_speed_extras_for_the_transformers_backends_only():
    assert trainer_bench.parse_config("liger+compile+lean:1@notebook") == ("liger+compile+lean", 1, "notebook")
    assert trainer_bench.split_backend("liger+compile+lean") == ("liger", ["compile", "lean"])
    for bad in ("unsloth+compile:1", "liger+fast:1", "plain+compile:1"):
        with pytest.raises(ValueError, match="backend"):
            trainer_bench.parse_config(bad)


def test_window_medians_and_the_ratio_to_unsloth():
    assert trainer_bench.window_medians([5, 1, 2, 3, 9, 4, 4, 6, 8, 100], 3) == [2, 4, 6]  # the 10th is left out
    with pytest.raises(ValueError, match="raise --steps"):
        trainer_bench.window_medians([1.0, 2.0], 3)

    def row(config: str, windows: list[float], peak: float) -> dict:
        backend, *extras = config.split(":")[0].split("+")
        return dict(
            config=config,
            backend=backend,
            extras=extras,
            gpus=1,
            launcher="notebook",
            precision="bf16",
            quant="16bit",
            seq_len=1024,
            batch=4,
            status="ok",
            step_time_s={"median": statistics.median(windows)},
            window_medians_s=windows,
            peak_allocated_gib=[peak],
        )

    summary = {
        e["config"]: e
        for e in trainer_bench.summarise(
            [row("unsloth:1@notebook", [0.40, 0.42, 0.44], 7.5), row("liger+compile:1@notebook", [0.5, 0.46, 0.6], 5.0)]
        )
    }
    fast = summary["liger+compile:1@notebook"]
    assert fast["samples"] == 3 and fast["step_s"] == 0.5  # the median of the three windows
    assert fast["spread_pct"] == pytest.approx(100 * (0.6 - 0.46) / 0.5)
    assert fast["vs_unsloth"] == pytest.approx(0.5 / 0.42) and fast["peak_vs_unsloth"] == pytest.approx(5 / 7.5)
    assert "vs_unsloth" not in summary["unsloth:1@notebook"]
    text = trainer_bench.markdown(
        {
            "versions": {},
            "gpu_count": 1,
            "gpu": "x",
            "gpu_memory_gib": 1,
            "driver": "",
            "cuda": "",
            "cpu_count": 1,
            "cpus_usable": 1,
            "python": "3",
            "date": "today",
        },
        "cmd",
        list(summary.values()),
        [],
    )
    assert "| liger+compile:1@notebook | bf16 16bit 1024x4 | 1.19x | 0.67x |" in text


@pytest.mark.slow
def test_speed_part_dry_run_on_the_cpu(tmp_path):
    env = dict(
        os.environ, SUITE_DRY_RUN="1", OUT=str(tmp_path), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    )
    done = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", "speed"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for part, configs in (
        (
            "speed_bf16",
            {"unsloth:1@notebook", "transformers+compile+lean:1@notebook", "transformers:1@notebook"},
        ),
        ("speed_t4", {"unsloth:1@notebook", "transformers+compile+lean:1@notebook"}),
    ):
        assert f"=== {part}: exit 0" in done.stdout, done.stdout[-3000:]
        report = json.loads((tmp_path / f"{part}.json").read_text())
        rows = {(r["config"], r["seq_len"]): r for r in report["results"]}
        assert set(rows) == {(c, n) for c in configs for n in (128, 192)}
        for (config, _), r in rows.items():
            if config.startswith("unsloth"):
                assert r["status"] == "skipped" and "GPU" in r["error"]
                continue
            assert r["status"] == "ok", r.get("error")
            assert r["precision"] == "fp32"  # the T4 part too: fp16 needs a GPU
            assert len(r["step_times_s"]) == 1 + 3  # warm-up + timed
            assert len(r["gc_ms"]) == 4 and all(ms >= 0 for ms in r["gc_ms"])  # GC time within each step
            assert r["window_medians_s"] == r["step_times_s"][1:]  # 3 windows of one step each
            assert r["extras"] == (["compile", "lean"] if "+" in config else [])
            assert r["loss_first"] > 0
        summary = {(e["config"], e["seq_len"]): e for e in report["summary"]}
        fast = summary[("transformers+compile+lean:1@notebook", 128)]
        assert fast["samples"] == 3 and fast["step_s"] == statistics.median(
            rows[("transformers+compile+lean:1@notebook", 128)]["window_medians_s"]
        )
        table = (tmp_path / f"{part}.md").read_text()
        assert "| transformers+compile+lean:1@notebook | fp32 16bit 128x2 | 1/1 |" in table
        assert "over every timed window of every run" in table


def test_loss_chunks_script_on_the_cpu(tmp_path):
    from benchmarks import loss_chunks

    out, md = tmp_path / "loss.json", tmp_path / "loss.md"
    argv = ["--device", "cpu", "--tokens", "300", "--vocab", "997", "--hidden", "32", "--kernels", "nbkit"]
    argv += [
        "--dtypes",
        "fp32",
        "--rows",
        "auto,16",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--out",
        str(out),
        "--md",
        str(md),
    ]
    assert loss_chunks.main(argv) == 0
    cases = json.loads(out.read_text())["cases"]
    # 270 counted rows (every tenth ignored): one default chunk (about 256 MiB of fp32 logits), or 17 of 16 rows.
    assert [(c["rows_spec"], c["rows"], c["chunks"]) for c in cases] == [
        ("auto", 256 * 2**20 // (4 * 997), 1),
        ("16", 16, 17),
    ]
    assert all(c["ms"] > 0 and c["peak_extra_gib"] is None for c in cases)
    assert "| nbkit | fp32 | 300 | 16 (16) | 17 |" in md.read_text()


def test_layer_host_cost_script_on_the_cpu(tmp_path):
    from benchmarks import layer_host_cost

    out = tmp_path / "host.json"
    argv = ["--variants", "plain,savers+nockpt,savers", "--layers", "2", "--steps", "2", "--warmup", "1"]
    argv += ["--out", str(out)]
    assert layer_host_cost.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["plain", "savers+nockpt", "savers"]
    assert all(0 < r["min_ms"] <= r["median_ms"] for r in rows), rows
    with pytest.raises(ValueError, match="unknown variant"):
        layer_host_cost.step_times("savers+fast", 2, 1, 0)
