r"""What loading a 16-bit checkpoint costs each rank's RAM on an FSDP live set, with and without nbkit's fix.

    python benchmarks/fsdp_load_memory.py [--ranks 2] [--hidden 1024] [--layers 8] [--out load_memory.json]

Builds a random Qwen3 checkpoint (bf16, `--hidden` x `--layers`, 32K vocabulary) in a temporary folder, starts a
live set of `--ranks` ranks with the fsdp strategy (gloo CPU ranks where no GPU is visible) and, in every rank,
loads it with `from_pretrained` twice: once as nbkit's "fsdp" patch group leaves transformers, once with the patch
that gives the ranks which do not read the checkpoint uninitialised placeholders (nbkit.fsdp) switched off. Per
rank and case: the resident memory (RSS) the load added. A DDP live set's ranks are loaded once more as the
reference (each maps the checkpoint's file; nothing is copied until the weights move to a GPU).

Each case loads into a fresh model and frees it; RSS is read right after `from_pretrained` returns.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import nbkit  # noqa: E402
from nbkit.training import fsdp  # noqa: E402

_FIX = "transformers.modeling_utils:PreTrainedModel._move_missing_keys_from_meta_to_device"


def _added_by_load(path: str, fixed: bool) -> int:
    """In a rank: the bytes of resident memory one from_pretrained of `path` added (the fix on or off)."""
    import gc

    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    from nbkit.platform import patching

    fix = next((p for p in patching.registered("fsdp") if p.target == _FIX), None)
    off = fix is not None and not fixed
    if off:
        fix.revert()
    try:
        before = psutil.Process().memory_info().rss
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        added = psutil.Process().memory_info().rss - before
        del model
    finally:
        if off:
            fix.apply()
    gc.collect()
    return added


def _per_rank(live: nbkit.live.LiveRanks, path: str, fixed: bool) -> list[float]:
    live.exec(
        "added = _added_by_load(path, fixed)", names={"_added_by_load": _added_by_load, "path": path, "fixed": fixed}
    )
    return [round(live.pull("added", rank=r) / 2**20, 1) for r in range(live.world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the results as JSON here too")
    a = parser.parse_args()

    import torch
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with tempfile.TemporaryDirectory(prefix="nbkit-load-memory-") as folder:
        config = Qwen3Config(
            hidden_size=a.hidden,
            intermediate_size=3 * a.hidden,
            num_hidden_layers=a.layers,
            num_attention_heads=a.hidden // 128,
            num_key_value_heads=max(1, a.hidden // 256),
            head_dim=128,
            vocab_size=32000,
            tie_word_embeddings=False,
        )
        Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
        size_mib = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 2**20
        results: dict = {
            "checkpoint_mib": round(size_mib, 1),
            "ranks": a.ranks,
            "transformers": transformers.__version__,
        }
        with nbkit.start(gpus=a.ranks, env={fsdp.STRATEGY_VARIABLE: "fsdp"}) as live:
            results["fsdp_fixed_mib"] = _per_rank(live, folder, fixed=True)
            results["fsdp_unfixed_mib"] = _per_rank(live, folder, fixed=False)
        with nbkit.start(gpus=a.ranks) as live:
            results["ddp_mib"] = _per_rank(live, folder, fixed=True)
    print(json.dumps(results, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
