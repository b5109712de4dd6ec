r"""Host time of a LoRA step by savers setting: a deep, narrow model on the CPU, where compute is negligible.

    python3 benchmarks/layer_host_cost.py [--variants plain,savers,savers+compile] [--layers 28] [--steps 30]

Why: at 1K x 4 a Qwen3-VL-2B LoRA step on an H100 is bound by host work, and what nbkit wraps around each
decoder layer (checkpointing, its offloading hooks, the compiled region's runtime) is paid per layer per
step. A Qwen3 with Qwen3-VL-2B's 28 layers but a hidden size of 64 and 512 tokens keeps the arithmetic
negligible, so its step time on one CPU thread is mostly that host work: what each setting adds per step.

A variant is `plain` (transformers + peft, no saver) or `savers` with options after "+", in nbkit.savers.apply's
terms: `+compile` (compile="regional", inductor generating C++ here), `+recompute` (checkpointing="recompute"),
`+nockpt` (checkpointing=None), `+tiled` (the automatic tiled MLP, which on a CPU splits 512 tokens in 4 shards;
without it the MLP is whole, as a GPU's automatic count keeps it at 1K x 4). LoRA r=4 on every projection,
AdamW (foreach), one thread. Per variant, a fresh process: the median and minimum of the steps after
`--warmup`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: the package lives in ROOT
    sys.path.insert(0, str(ROOT))

OPTIONS = {
    "compile": {"compile": "regional"},
    "recompute": {"checkpointing": "recompute"},
    "nockpt": {"checkpointing": None},
    "tiled": {"tiled_mlp": True},
}


def narrow_lora_model(layers: int) -> tuple[Any, dict[str, Any]]:
    """A Qwen3 with `layers` of Qwen3-VL-2B's language layers at hidden size 64 (the module doc says why), LoRA r=4 on
    every projection (peft), seeded, sdpa attention; and its batch of 4 x 128 tokens: (model, batch).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(Qwen3ForCausalLM(config), LoraConfig(r=4, lora_alpha=4, target_modules=targets))
    ids = torch.randint(0, config.vocab_size, (4, 128))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def step_times(variant: str, layers: int, steps: int, warmup: int) -> list[float]:
    """Build the model, apply the variant and time `warmup + steps` LoRA steps; returns the timed ones (s).
    Raises ValueError for an unknown variant.
    """
    name, *extras = variant.split("+")
    if name not in ("plain", "savers") or (name == "plain" and extras) or any(e not in OPTIONS for e in extras):
        raise ValueError(f"unknown variant {variant!r}: plain, or savers[+{'+'.join(OPTIONS)}]")
    import torch

    from nbkit.training import savers

    torch.set_num_threads(1)
    model, batch = narrow_lora_model(layers)
    if name == "savers":
        options: dict[str, Any] = {"checkpointing": "offload", "tiled_mlp": False, "compile": None}
        for extra in extras:
            options.update(OPTIONS[extra])
        savers.apply(model, **options)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times[warmup:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variants", default="plain,savers+nockpt,savers,savers+recompute,savers+compile+nockpt,savers+compile"
    )
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.worker:  # one variant in this fresh process: its times as JSON on the last line
        print(json.dumps(step_times(a.worker, a.layers, a.steps, a.warmup)))
        return 0
    from benchmarks import host

    rows = []
    for variant in a.variants.split(","):
        command = [sys.executable, __file__, "--worker", variant, "--layers", str(a.layers)]
        command += ["--steps", str(a.steps), "--warmup", str(a.warmup)]
        done = subprocess.run(
            command, capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false")
        )
        if done.returncode != 0:
            rows.append({"variant": variant, "error": done.stderr[-2000:]})
        else:
            times = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({"variant": variant, "median_ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times)})
        print(rows[-1], flush=True)
    host.publish({"layers": a.layers, "steps": a.steps, "rows": rows}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
