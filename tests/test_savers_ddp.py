"""nbkit.savers under real 2-process gloo DDP (nbkit.launch(gpus=2)): the issue's correctness matrix.

For a tiny Qwen3 and a tiny Qwen3-VL with LoRA, each saver alone and all together, under
find_unused_parameters True and False (and static_graph once): one optimisation step of gradient
accumulation 2 (no_sync on the first micro-batch), with different sequence lengths on the two ranks
and in each micro-batch. The loss is normalised as transformers' Trainer does across devices
(sum of token losses / non-ignored tokens over all ranks and micro-batches, times the world size
because DDP averages), so the averaged gradients must equal a single-process reference without
savers over the same global batch. Also checked: each rank's loss values, and that every LoRA
weight's gradient is accumulated once per backward and reduced by DDP once per step.

One launch per model runs the whole matrix; the parent compares.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_savers import (
    GPU_TOLERANCE,
    TOLERANCE,
    assert_grads_match,
    make_batch,
    tiny_model,
    trainable_grads,
)
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

import nbkit
from nbkit.training import savers

# Sequence lengths of each micro-batch, per rank: the ranks differ, and so do their micro-batches.
MICRO_BATCHES = {0: [[24, 17], [20]], 1: [[30], [16, 12]]}
WORLD = len(MICRO_BATCHES)

# compile=None: the savers themselves, also on GPUs (regional compilation under DDP: test_savers_compile.py).
SAVERS = {
    "none": None,
    "offload": dict(checkpointing="offload", tiled_mlp=False, chunked_loss=False, compile=None),
    "recompute": dict(checkpointing="recompute", tiled_mlp=False, chunked_loss=False, compile=None),
    "tiled_mlp": dict(checkpointing=None, tiled_mlp=3, chunked_loss=False, compile=None),
    "chunked_loss": dict(checkpointing=None, tiled_mlp=False, chunked_loss=True, compile=None),
    "all": dict(checkpointing="offload", tiled_mlp=3, chunked_loss=True, compile=None),
}
CASES = [(saver, {"find_unused_parameters": unused}) for saver in SAVERS for unused in (True, False)]
# static_graph with no_sync() fails inside DDP itself (torch 2.13, no savers needed: "expect_autograd_hooks_
# INTERNAL ASSERT", https://github.com/pytorch/pytorch/issues/143580, fix in pytorch/pytorch#187732), so
# this case accumulates by syncing after every micro-batch, which gives the same averaged gradients.
CASES.append(("all", {"static_graph": True}))


def _batches(model: torch.nn.Module, device: torch.device | str) -> tuple[dict[int, list[dict]], torch.Tensor]:
    """Every rank's micro-batches (built identically everywhere) and the step's non-ignored token count."""
    batches = {
        rank: [make_batch(model, lengths, seed=10 * rank + i) for i, lengths in enumerate(shapes)]
        for rank, shapes in MICRO_BATCHES.items()
    }
    # transformers' causal-LM loss predicts labels[1:] from positions [:-1].
    items = sum(int((b["labels"][:, 1:] != -100).sum()) for mbs in batches.values() for b in mbs)
    moved = {rank: [{k: v.to(device) for k, v in b.items()} for b in mbs] for rank, mbs in batches.items()}
    return moved, torch.tensor(items, device=device)


def _run_matrix(kind: str, device_type: str = "cpu", cases: list = CASES) -> dict[str, list[dict]]:
    """In each rank: one DDP step per case. Returns, on rank 0, every rank's results per case (on the CPU).

    device_type "cpu": gloo, CPU tensors; "cuda": NCCL, each rank on cuda:LOCAL_RANK.
    """
    cuda = device_type == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    results = {}
    try:
        for saver, ddp_options in cases:
            model = tiny_model(kind).to(device)
            if SAVERS[saver] is not None:
                savers.apply(model, **SAVERS[saver])
            names = {p: name for name, p in model.named_parameters() if p.requires_grad}
            accumulated = {name: 0 for name in names.values()}
            for p, name in names.items():
                p.register_post_accumulate_grad_hook(
                    lambda p, name=name: accumulated.__setitem__(name, accumulated[name] + 1)
                )
            ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None, **ddp_options)
            reduced = {name: 0 for name in names.values()}

            def counting_allreduce(state, bucket):
                for p in bucket.parameters():
                    reduced[names[p]] += 1
                return allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, counting_allreduce)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            batches, items = _batches(model, device)
            own = batches[rank]
            losses, accumulations, reductions = [], [], []
            for i, batch in enumerate(own):
                sync = i == len(own) - 1 or ddp_options.get("static_graph", False)
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    loss = ddp(**batch, num_items_in_batch=items).loss
                    (loss * WORLD).backward()
                losses.append(loss.item())
                accumulations.append(dict(accumulated))
                reductions.append(dict(reduced))
                accumulated.update(dict.fromkeys(accumulated, 0))
                reduced.update(dict.fromkeys(reduced, 0))
            grads = {name: g.cpu() for name, g in trainable_grads(model).items()}
            optimizer.step()
            mine = {"losses": losses, "grads": grads, "accumulations": accumulations, "reductions": reductions}
            everyone = [None] * WORLD
            dist.all_gather_object(everyone, mine)
            results[f"{saver} {ddp_options}"] = everyone
            # Free this case's DDP objects now: a gloo DDP reducer destroyed after the process group
            # (when the frame is cleared at return) hung rank 1 in its destructor in 2 of ~10 CI runs.
            del ddp, model, optimizer, loss
            gc.collect()
    finally:
        dist.destroy_process_group()
    return results


def _reference(kind: str, device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, no savers, the whole global batch: per-micro-batch losses and summed gradients."""
    model = tiny_model(kind).to(device)
    batches, items = _batches(model, device)
    losses = []
    for rank in sorted(batches):
        for batch in batches[rank]:
            loss = model(**batch, num_items_in_batch=items).loss
            loss.backward()
            losses.append(loss.item())
    return losses, {name: g.cpu() for name, g in trainable_grads(model).items()}


def check_matrix(
    results: dict[str, list[dict]],
    reference_losses: list[float],
    reference_grads: dict[str, torch.Tensor],
    cases: list,
    tolerance: float = TOLERANCE,
) -> None:
    """Assert every case's losses and gradients equal the reference and every hook count is one."""
    assert len(results) == len(cases)
    assert all(g.norm() > 0 for g in reference_grads.values())
    for case, ranks in results.items():
        losses = [loss for result in ranks for loss in result["losses"]]
        assert len(losses) == len(reference_losses)
        for loss, expected in zip(losses, reference_losses):
            assert abs(loss - expected) <= tolerance * abs(expected), f"{case}: loss {loss} != {expected}"
        for rank, result in enumerate(ranks):
            grads = result["grads"]
            assert all("lora_" in name for name in grads)
            assert_grads_match(grads, reference_grads, tolerance, label=f"{case}, rank {rank}: ")
            # Every backward accumulates each LoRA gradient exactly once (DDP's ready hook fires once) ...
            for accumulated in result["accumulations"]:
                assert set(accumulated.values()) == {1}, f"{case}, rank {rank}: {accumulated}"
            # ... and DDP reduces each exactly once per synchronised backward (none under no_sync).
            *accumulating, last = result["reductions"]
            expected = 1 if "static_graph" in case else 0
            assert all(set(r.values()) == {expected} for r in accumulating), f"{case}, rank {rank}: {accumulating}"
            assert set(last.values()) == {1}, f"{case}, rank {rank}: {last}"


def matrix_on_two_gpus(kind: str, matrix_savers: dict[str, dict]) -> None:
    """The matrix for `matrix_savers` (name: savers.apply options), each under find_unused_parameters True
    and False, on 2 GPUs over NCCL, checked against a single-GPU reference without savers.

    Launching needs a process without CUDA: the GPU tests run this in a fresh interpreter
    (`assert_matrix_on_two_gpus`).
    """
    SAVERS.update(matrix_savers)  # _run_matrix looks savers up by name; the ranks fork from here and see these
    cases = [(saver, {"find_unused_parameters": unused}) for saver in matrix_savers for unused in (True, False)]
    results = nbkit.launch(_run_matrix, kind, "cuda", cases, gpus=2, timeout=300, dashboard=False)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    check_matrix(results, *_reference(kind, "cuda:0"), cases, tolerance=GPU_TOLERANCE)


def assert_matrix_on_two_gpus(kind: str, matrix_savers: dict[str, dict]) -> None:
    """`matrix_on_two_gpus` in a fresh interpreter (earlier GPU tests of the session have initialised
    CUDA in this one); fails with the end of its output if it fails. matrix_savers travel as their repr.
    """
    here = Path(__file__).resolve().parent
    code = (
        f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; "
        f"import test_savers_ddp; test_savers_ddp.matrix_on_two_gpus({kind!r}, {matrix_savers!r})"
    )
    # faulthandler: a crash of the interpreter (a C++ abort) shows each thread's Python stack in stderr
    code += "; print('matrix checked', flush=True)"
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:  # in full under "Captured stdout" (the assertion's repr is cut short)
        print(proc.stdout[-4000:], proc.stderr[-12000:], sep="\n")
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-6000:])


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-vl"])
def test_ddp_gradients_losses_and_hook_counts_match_single_process(kind):
    results = nbkit.launch(_run_matrix, kind, gpus=WORLD, timeout=240, dashboard=False)
    check_matrix(results, *_reference(kind), CASES)
