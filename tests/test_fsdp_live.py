"""FSDP on a live set (nbkit.start with NBKIT_STRATEGY=fsdp): 2 gloo CPU ranks, cell by cell.

Load, shard, train and save are separate calls, as separate notebook cells are: the sharded model
and its optimizer stay on the ranks between them. A rank that dies in the middle of a sharded step
ends the set the way it does under DDP: a LiveError that names the rank, and no process left.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

import nbkit
from nbkit.platform.errors import LiveError
from nbkit.training import fsdp

pytestmark = pytest.mark.slow

TESTS = str(Path(__file__).resolve().parent)

LOAD = """
import os
import sys
sys.path.insert(0, tests)
import torch
import nbkit
from nbkit.training import fsdp
from tiny_training import tiny_lora, token_sequences

model = tiny_lora(path)
strategy = os.environ.get("ACCELERATE_USE_FSDP")
"""

SHARD = """
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
model = fsdp.shard(model, optimizer)
type(model).__name__
"""

TRAIN = """
batch = torch.stack([s["input_ids"] for s in token_sequences(8, 16)])[nbkit.rank() * 4 : nbkit.rank() * 4 + 4]
losses = []
for _ in range(steps):
    loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
losses
"""


def test_load_shard_train_and_save_in_separate_cells(tmp_path):
    live = nbkit.start(gpus=2, env={fsdp.STRATEGY_VARIABLE: "fsdp"})
    try:
        path = nbkit.resolve_model("tiny:qwen3")
        live.exec(LOAD, names={"tests": TESTS, "path": path})
        assert live.pull("strategy") == "true" and live.pull("strategy", rank=1) == "true"
        assert live.exec(SHARD).startswith("FSDP")
        losses = live.exec(TRAIN, names={"steps": 4})
        assert len(losses) == 4 and losses[-1] < losses[0], losses  # the optimizer kept its sharded state
        more = live.exec(TRAIN, names={"steps": 2})
        assert more[0] < losses[0]  # the next cell trains the same sharded model on
        # generate on rank 0 alone would wait for rank 1's shards forever: it is refused, and the set stays up.
        ask = "fsdp.generate(model, input_ids=batch[:1, :4], max_new_tokens=3, do_sample=False, every_rank_timeout=5)"
        live.exec("fsdp.EVERY_RANK_TIMEOUT_S = 5")
        plain = "model.generate(input_ids=batch[:1, :4], max_new_tokens=3, do_sample=False)"  # the flagship's way
        for wrong in (ask, plain):
            started = time.monotonic()
            with pytest.raises(LiveError, match="must run on every rank") as info:
                live.exec(wrong, ranks=0, timeout=120)
            assert not info.value.ended and time.monotonic() - started < 60
            assert "rank(s) [1] did not call it" in str(info.value)
        answers = live.exec(f"{ask}.tolist()")
        assert len(answers[0]) == 7, answers  # every rank generated: 4 prompt tokens and 3 new ones
        live.exec("fsdp.save_adapter(model, out)", names={"out": str(tmp_path)})
        assert (tmp_path / "adapter_model.safetensors").stat().st_size > 0
        # save_pretrained cannot write a sharded model's shards: refused before anything is written, saying how.
        for ranks in ("all", 0):
            with pytest.raises(LiveError, match=r"of a sharded \(FSDP\) model.*nothing was written.*save_adapter"):
                live.exec("model.save_pretrained(plain)", ranks=ranks, names={"plain": str(tmp_path / "plain")})
            assert not (tmp_path / "plain").exists()
    finally:
        live.stop()


def test_a_rank_that_dies_mid_step_ends_the_set_and_leaves_nothing():
    live = nbkit.start(gpus=2, env={fsdp.STRATEGY_VARIABLE: "fsdp"})
    pids = [row.pid for row in live.status().ranks]
    try:
        live.exec(LOAD, names={"tests": TESTS, "path": nbkit.resolve_model("tiny:qwen3")}, timeout=120)
        live.exec(SHARD, timeout=120)
        # Rank 1 ends in the middle of its forward, between two layers' all-gathers; rank 0 waits in one.
        dying = TRAIN.replace(
            "    loss = model(",
            "    if nbkit.rank() == 1:\n"
            "        model.base_model.model.model.layers[1].register_forward_pre_hook(lambda *a: os._exit(3))\n"
            "    loss = model(",
        )
        started = time.monotonic()
        with pytest.raises(LiveError) as info:
            live.exec(dying, names={"steps": 1}, timeout=120)
        assert time.monotonic() - started < 60
        message = str(info.value)
        assert info.value.ended and "rank 1" in message and "exited with code 3" in message, message
    finally:
        live.stop()
    deadline = time.monotonic() + 15
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
        assert time.monotonic() < deadline, "ranks left running"
        time.sleep(0.2)
    assert os.environ.get(fsdp.STRATEGY_VARIABLE) is None  # the notebook process is no rank


def _load_and_shard(path: str) -> dict:
    """In a rank: the resident memory loading `path` added, then one base weight as the sharded
    model holds it (gathered whole)."""
    import psutil
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    before = psutil.Process().memory_info().rss
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    added = psutil.Process().memory_info().rss - before
    model = fsdp.shard(model)
    weight = model.get_parameter("model.layers.1.mlp.down_proj.weight")
    whole = weight.full_tensor() if isinstance(weight, DTensor) else weight
    return {"added": added, "weight": whole.detach().to(torch.bfloat16).cpu()}


def test_a_rank_that_does_not_read_the_checkpoint_does_not_hold_a_copy_of_it(tmp_path):
    # Under FSDP's efficient loading only rank 0 reads the weights; the other ranks get their shards by
    # broadcast when the model is sharded, so until then they need no copy of the model in memory (a 16-bit
    # 8B model is 17 GB of a Kaggle session's RAM, about 30 GB).
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        head_dim=128, vocab_size=128000, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    expected = load_file(next(tmp_path.glob("*.safetensors")))["model.layers.1.mlp.down_proj.weight"]
    with nbkit.start(gpus=2, env={fsdp.STRATEGY_VARIABLE: "fsdp"}) as live:
        live.exec("import sys\nsys.path.insert(0, tests)", names={"tests": TESTS})  # _load_and_shard's module
        live.exec("loaded = _load_and_shard(path)", names={"_load_and_shard": _load_and_shard, "path": str(tmp_path)})
        loaded = [live.pull("loaded", rank=rank) for rank in (0, 1)]
    # Loading also imports the code it runs: about 38 MB with transformers 5.24, a third of this checkpoint, so the
    # checkpoint is made large enough (vocab_size below) for a copy to stand out (zero-filled: 1.1x the checkpoint).
    assert loaded[1]["added"] < size / 4, (loaded[1]["added"], size)
    for rank in (0, 1):
        assert torch.equal(loaded[rank]["weight"], expected), rank  # rank 1's shards came from rank 0
