"""benchmarks/fsdp_host_cost.py on the CPU: FSDP2 and DDP ranks (gloo) of a 2-layer tiny Qwen3 under Trainer.

What the figures must say, whatever the machine: every phase of a step is timed; the FSDP rank runs FSDP2's and
DTensor's Python and gathers each layer's weights, the DDP rank neither; accelerate's two units per checkpointed
layer run more Python than nbkit's one, for the same ops and the same losses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import fsdp_host_cost


@pytest.mark.version_independent
def test_variants_parse():
    assert fsdp_host_cost.parse_variant("fsdp") == ("fsdp", [])
    assert fsdp_host_cost.parse_variant("ddp+noac+fp32") == ("ddp", ["noac", "fp32"])
    for bad in ("deepspeed", "fsdp+fast", "ddp+keep", "ddp+twounits"):
        with pytest.raises(ValueError, match="fsdp|ddp|FSDP settings"):
            fsdp_host_cost.parse_variant(bad)
    assert fsdp_host_cost.environment("fsdp+keep+noac", t4=False) == {
        "NBKIT_STRATEGY": "fsdp",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_ACTIVATION_CHECKPOINTING": "false",
    }
    assert fsdp_host_cost.environment("ddp", t4=True) == {"NBKIT_STRATEGY": "ddp", "NBKIT_EMULATE": "T4"}


def test_fsdp_and_ddp_steps_by_phase_and_library(tmp_path):
    out, md = tmp_path / "rows.json", tmp_path / "rows.md"
    argv = ["--variants", "fsdp,fsdp+twounits,ddp", "--layers", "2", "--seq-len", "32"]
    argv += ["--steps", "2", "--warmup", "1", "--profile-steps", "1", "--out", str(out), "--md", str(md)]
    assert fsdp_host_cost.main(argv) == 0
    rows = {r["variant"]: r["ranks"][0] for r in json.loads(out.read_text())["rows"]}
    fsdp, two, ddp = rows["fsdp"], rows["fsdp+twounits"], rows["ddp"]
    for row in rows.values():
        assert row["cpu_ms"]["forward"] > 0 and row["cpu_ms"]["backward"] > 0 and row["wall_ms"]["step"] > 0
        # warm-up, timed, cProfile and torch.profiler steps, and one to stop the profiler in
        assert row["lora_params"] == 2 * 7 * 2 and len(row["losses"]) == 1 + 2 + 1 + 1 + 1
    assert fsdp["python_calls"]["FSDP2"] > 0 and fsdp["python_calls"]["DTensor"] > 0
    assert "FSDP2" not in ddp["python_calls"] and "DTensor" not in ddp["python_calls"]
    # Both ranks gather the step's token count and loss (Trainer); the FSDP rank also each unit's weights.
    assert fsdp["collectives"]["gloo:all_gather"] >= ddp["collectives"]["gloo:all_gather"] + 2 * 2
    # accelerate 1.15's own policy makes two units of each checkpointed layer (more calls), 1.12's one (as many):
    # test_fsdp checks the units themselves on each set
    assert two["python_calls"]["all"] >= fsdp["python_calls"]["all"] and two["aten_ops"] == fsdp["aten_ops"]
    assert two["losses"] == fsdp["losses"]
    text = md.read_text()
    assert all(f"| {variant} |" in text for variant in rows)
