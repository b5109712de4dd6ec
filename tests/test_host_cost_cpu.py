"""benchmarks/host_cost.py and trainer_memory.py on the CPU, on tiny:qwen3-vl.

host_cost.py: two gloo ranks of SFTTrainer and Trainer.

What the counts must say, whatever the machine: TRL's SFTTrainer.compute_loss adds four all-gathers per
micro-step (entropy, token count, accuracy: issue 16), issued from compute_loss; nbkit's dashboard callback
reads the step's loss once per step and issues no collective, and only where nbkit's reporting patches are
applied; Trainer's NaN filter reads the loss twice per micro-step.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nbkit
from benchmarks import host_cost

# What these tests count is TRL 1.x's SFTTrainer (its compute_loss's metric gathers, its chunked_nll
# forward). On trl 0.x nbkit.platform.compat replaces SFTTrainer.compute_loss for a model with nbkit's chunked
# loss (Trainer's, no metrics), so neither is there to count.
trl_1 = pytest.mark.skipif(
    int(importlib.metadata.version("trl").split(".")[0]) < 1,
    reason="counts TRL 1.x's SFTTrainer (on trl 0.x nbkit.platform.compat replaces it)",
)


def test_variants_parse():
    assert host_cost.parse_variant("sft") == ("sft", [])
    assert host_cost.parse_variant("hf+noreport+nanfilter_off") == ("hf", ["noreport", "nanfilter_off"])
    for bad in ("dpo", "sft+fast", "sft+"):
        with pytest.raises(ValueError, match="sft\\|hf"):
            host_cost.parse_variant(bad)


def _main_past_the_profiler_crash(argv: list[str]) -> int:
    """host_cost.main, tried once more where a rank died in torch's profiler rather than in what is counted.

    torch 2.13's profiler with with_stack=True, profiling window after window, now and then kills the
    process (SIGSEGV, SIGABRT) or hands back an event whose name is freed memory (UnicodeDecodeError),
    with or without nbkit, collectives or a process group (benchmarks/RESULTS.md, "torch's profiler with
    with_stack=True"). This test profiles 4 windows a rank and hit it in about 1 run in 30. A second try
    tells that crash apart from a wrong count, which fails both.
    """
    try:
        return host_cost.main(argv)
    except nbkit.LaunchError as exc:
        # (a rank the crash left alone may fail too: "Connection closed by peer")
        if not any("signal" in text or "UnicodeDecodeError" in text for text in exc.failures.values()):
            raise
        return host_cost.main(argv)


@pytest.mark.slow
@trl_1
def test_counts_trl_metric_gathers_and_nbkit_reads_per_step(tmp_path):
    out, md = tmp_path / "host_cost.json", tmp_path / "host_cost.md"
    argv = ["--variants", "sft,hf+noreport", "--shape", "128x2", "--steps", "2", "--warmup", "1"]
    assert _main_past_the_profiler_crash([*argv, "--out", str(out), "--md", str(md)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    sft, hf = rows["sft"], rows["hf+noreport"]

    def gathers(row: dict) -> float:
        return row["by_kind_per_step"].get("collective gloo:all_gather", 0)

    # TRL gathers its metrics after each forward (4 all-gathers in compute_loss); in nbkit's ranks each rank keeps its
    # own and one all-reduce averages them at the step that logs (nbkit.training.trl_metrics), so the SFT step
    # gathers no more than plain Trainer's. (Under trl 1.16 the same compute_loss frame also holds DDP's buffer
    # broadcast of the forward it runs, which is DDP's, not a metric.)
    assert gathers(sft) == gathers(hf)
    from_trl = [
        v
        for k, v in sft["by_origin_per_step"].items()
        if k.startswith("c10d op c10d::allgather") and "sft_trainer.py" in k
    ]
    assert sum(from_trl) == 0
    assert not any("trl/" in k for k in hf["by_origin_per_step"] if k.startswith("c10d op"))

    def calls(row: dict, caller: str, name: str = "") -> float:
        return sum(v for k, v in row["value_reads_by_origin_per_step"].items() if caller in k and k.startswith(name))

    assert calls(sft, "nbkit/rank_side/reporting.py", "item") == 1
    # Without nbkit's reporting, the one read of nbkit's in a step is its chunked loss finding the labelled
    # positions (a data-dependent shape), where the model's loss runs through it (transformers 5.24 here).
    assert calls(hf, "nbkit/") == calls(hf, "nbkit/training/savers/loss.py", "nonzero") <= 1
    # nbkit's collectives in a step: its averaging of the gradients, in place of DDP's reducer's all-reduce, and (the
    # step logs) its one average of TRL's metrics.
    ours = {k: v for k, v in sft["by_origin_per_step"].items() if k.startswith("c10d op") and "nbkit/" in k}
    assert sorted(k.split(" <- ")[1].split("(")[0] for k in ours) == [
        "nbkit/training/gradient_averaging.py",
        "nbkit/training/trl_metrics.py",
    ], ours
    assert list(ours.values()) == [1, 1], ours
    assert calls(hf, "transformers/trainer.py", "__bool__") == 2  # torch.isnan / isinf of the loss
    assert calls(sft, "trl/trainer/sft_trainer.py") >= 5  # .item() and `if num_valid > 0` in compute_loss
    for row in (sft, hf):
        assert row["step_ms"] > 0 and row["forward_ms"] > 0 and row["backward_ms"] > 0
        assert row["outside_ms"] == pytest.approx(row["step_ms"] - row["forward_ms"] - row["backward_ms"])
    text = md.read_text()
    assert f"| sft | {sft['collectives_per_step']:g} | " in text
    assert "sft, per step, value calls by caller:" in text and "hf+noreport, per step, by origin (profiler):" in text


@trl_1
def test_trainer_memory_phases_run_and_the_transformers_path_keeps_no_full_logits(tmp_path):
    # In its own process: the script applies nbkit's patches (nbkit.install()) as a launched rank would.
    out = tmp_path / "memory.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "trainer_memory.py"
    argv = [sys.executable, str(script), "--backend", "transformers", "--shape", "128x1", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["phase"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["plain", "plain_after_sft_init", "compute_loss", "train"]
    # nbkit's chunked loss: the logits hold the last position only, never (tokens, vocab).
    assert rows["plain"]["logits_shape"][:2] == [1, 1]
    # After SFTTrainer's __init__ the model's own forward keeps no full logits either: none with trl 1.14's
    # chunked_nll forward, the last position with trl 1.16's fused LM head beside it; its training step's
    # compute_loss returns no outputs.
    shape = rows["plain_after_sft_init"]["logits_shape"]
    assert shape is None or shape[:2] == [1, 1], shape
    assert rows["compute_loss"]["logits_shape"] is None
    assert all(r["peak_gib"] is None for r in rows.values())  # a CPU run measures no GPU memory
