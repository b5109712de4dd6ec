"""On 2 GPUs, DDP training equals 1-GPU training on the same global batch (bf16, 5 steps).

For the nbkit backend (transformers + peft + nbkit.savers defaults) and, where installed, unsloth:
the same tiny Qwen3-VL (random weights), LoRA on all linear layers, 5 SGD steps on global batches
of 4 sequences with one image each. The 1-GPU run takes each whole batch; under nbkit.launch with 2
GPUs each rank takes half. Losses (mean over the global batch) and the LoRA weight updates must
agree within bf16 tolerance, and both DDP replicas must hold identical weights.

Run on a machine with 2+ GPUs: `python -m pytest -m gpu tests/test_gpu_ddp.py`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import nbkit

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS.parent))

from benchmarks.batches import shard_batch, synthetic_batch  # noqa: E402
from benchmarks.models import build_model  # noqa: E402
from benchmarks.ranks import gather, setup_rank, teardown_rank  # noqa: E402
from benchmarks.stepping import Stepper, probe, wrap_ddp  # noqa: E402

pytestmark = pytest.mark.gpu

STEPS, SEQ_LEN, GLOBAL_BATCH, LR = 5, 256, 4, 0.1
# bf16 autocast: the two runs multiply differently shaped matrices, so they round differently.
LOSS_RTOL, UPDATE_RTOL = 1e-2, 5e-2


def _train(backend: str, path: str) -> dict:
    """Every rank: STEPS SGD steps on its shard of the same global batches.

    Returns (rank 0) the global mean loss per step, each LoRA tensor's update, the trainable
    parameters the probe found unused, and the largest difference between the ranks' weights.
    """
    device = setup_rank("cuda")
    try:
        rank, world = nbkit.rank(), nbkit.world_size()
        model = build_model(backend, path, "bf16", device, lora_r=8, max_seq_len=SEQ_LEN, seed=0)
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        before = {n: p.detach().cpu().clone() for n, p in trainable.items()}
        batches = [
            shard_batch(synthetic_batch(model.config, SEQ_LEN, GLOBAL_BATCH, device, image=True, seed=s), world, rank)
            for s in range(STEPS)
        ]
        unused = probe(Stepper(model, "bf16", device), batches[0])
        wrapped = wrap_ddp(model, device, unused=unused)
        optimizer = torch.optim.SGD(list(trainable.values()), lr=LR)
        stepper = Stepper(wrapped, "bf16", device, optimizer=optimizer)
        losses = []
        for batch in batches:
            loss = float(stepper.step(batch))
            losses.append(sum(gather(loss)) / world)
        flat = torch.cat([p.detach().flatten().cpu() for p in trainable.values()])
        replicas = gather(flat)
        return {
            "losses": losses,
            "updates": {n: p.detach().cpu() - before[n] for n, p in trainable.items()},
            "unused": unused,
            "replica_spread": max(float((r - replicas[0]).abs().max()) for r in replicas),
        }
    finally:
        teardown_rank()


@pytest.fixture(scope="module")
def two_gpus() -> None:
    gpus = nbkit.visible_gpus()
    if len(gpus) < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {len(gpus)}")


@pytest.mark.parametrize(
    "backend",
    [
        "nbkit",
        pytest.param(
            "unsloth",
            marks=pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth is not installed"),
        ),
    ],
)
def test_ddp_on_two_gpus_equals_one_gpu_on_the_same_global_batch(backend, two_gpus, tiny_vl_path):
    one = nbkit.launch(_train, backend, tiny_vl_path, gpus=1, timeout=900, dashboard=False)
    two = nbkit.launch(_train, backend, tiny_vl_path, gpus=2, timeout=900, dashboard=False)

    assert two["replica_spread"] == 0.0  # DDP keeps both ranks' LoRA weights identical
    assert one["unused"] == [] and two["unused"] == []  # with an image every LoRA tensor trains
    assert all(torch.isfinite(torch.tensor(run["losses"])).all() for run in (one, two))
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=LOSS_RTOL, atol=0.0)

    assert sorted(one["updates"]) == sorted(two["updates"])
    names = sorted(one["updates"])
    single = torch.cat([one["updates"][n].flatten() for n in names])
    ddp = torch.cat([two["updates"][n].flatten() for n in names])
    assert single.norm() > 0  # the steps changed the adapters
    error = float((ddp - single).norm() / single.norm())
    assert error < UPDATE_RTOL, f"{backend}: LoRA updates under DDP differ from 1 GPU by {error:.2%} (norm-wise)"
    # Every module's adapter, not just the total: a tensor DDP failed to average stands out here.
    for prefix in ("visual", "language_model"):
        part = [n for n in names if prefix in n]
        assert part, f"no LoRA tensors under {prefix}"
        a = torch.cat([one["updates"][n].flatten() for n in part])
        b = torch.cat([two["updates"][n].flatten() for n in part])
        assert float((b - a).norm() / a.norm()) < UPDATE_RTOL, prefix
