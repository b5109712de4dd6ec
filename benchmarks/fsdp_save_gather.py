r"""What saving a sharded peft model gathers to rank 0: every parameter (accelerate's FSDP2 state dict, what Trainer's
saves used) against the trainable ones (what nbkit's fsdp patches gather where every adapter trains).

Two CPU ranks over gloo (nbkit.launch with the fsdp strategy), the model in bf16 with LoRA r=16 on the seven
projections, sharded by nbkit.fsdp.shard; on rank 0, for each way: the seconds torch's get_model_state_dict takes,
the bytes of tensors it returns and the resident memory it adds.

    python3 benchmarks/fsdp_save_gather.py --model random:qwen3-1.7b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: the package lives one level up
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import nbkit  # noqa: E402
from nbkit.training import fsdp  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rank(path: str) -> dict[str, Any]:
    """One rank: load, add LoRA, shard, then gather the state dict both ways (collectives: every rank takes part)."""
    import psutil
    from peft import LoraConfig, get_peft_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = fsdp.shard(get_peft_model(model, LoraConfig(r=16, target_modules=PROJECTIONS)))
    process = psutil.Process()
    figures = {}
    for name, frozen_left_out in (("trainable", True), ("every parameter", False)):
        before = process.memory_info().rss
        start = time.perf_counter()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=frozen_left_out)
        state = get_model_state_dict(model, options=options)
        seconds = time.perf_counter() - start
        tensors = [t for t in state.values() if torch.is_tensor(t)]
        figures[name] = {
            "seconds": round(seconds, 2),
            "gathered_gb": round(sum(t.numel() * t.element_size() for t in tensors) / 1e9, 3),
            "rss_added_gb": round((process.memory_info().rss - before) / 1e9, 3),
            "tensors": len(tensors),
        }
        del state, tensors
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:qwen3-1.7b", help="nbkit name, hub id or path (a causal LM)")
    args = p.parse_args(argv)
    env = {fsdp.STRATEGY_VARIABLE: "fsdp"}
    print(json.dumps(nbkit.launch(_rank, nbkit.resolve_model(args.model), gpus=2, env=env, timeout=1200), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
