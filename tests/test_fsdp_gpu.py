"""FSDP-QLoRA on one GPU (world size 1): what the CPU tests cannot run, since bitsandbytes' 4-bit
weights need CUDA.

Trainer under the fsdp strategy with the tiny Qwen3 in 4-bit (nbkit.fsdp.qlora_config: NF4 stored as
fp16) and fp16 mixed precision, as on a T4 (the T4 profile, NBKIT_EMULATE=T4, where this checkout has
it): training must not hit the fp16-scaler-on-bf16 error that transformers + peft in 4-bit meet on T4s,
the 4-bit weights must be sharded by FSDP (not left out as uint8), and the saved adapter must load in
a plain process. Also: Liger's kernels under FSDP give the reference gradients.

Run on a machine with a GPU: `python -m pytest -m gpu tests/test_fsdp_gpu.py`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from test_fsdp import FSDP_ENV, _check_against_reference, _sharded_step
from test_savers import GPU_TOLERANCE

import nbkit
from nbkit.training import fsdp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

T4_FSDP = {fsdp.STRATEGY_VARIABLE: "fsdp", "NBKIT_EMULATE": "T4"}


def _qlora_fp16(path: str, out: str) -> dict:
    from peft import LoraConfig, get_peft_model
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    dtype = torch.float16
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=fsdp.qlora_config(dtype), dtype=dtype, device_map="auto"
    )
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    data = [{"input_ids": (ids := torch.randint(8, 1000, (32,))), "labels": ids} for _ in range(8)]
    args = TrainingArguments(
        output_dir=out,
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        fp16=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(out)
    four_bit = [p for n, p in trainer.model_wrapped.named_parameters() if "base_layer" in n and "proj" in n]
    return {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "sharded_4bit": all(isinstance(p, DTensor) for p in four_bit) and bool(four_bit),
        "storage": str({p.dtype for p in four_bit}),
        "fsdp": trainer.is_fsdp_enabled,
    }


def test_qlora_in_fp16_trains_sharded_and_saves_a_loadable_adapter(tiny_text_path, tmp_path):
    result = nbkit.launch(_qlora_fp16, tiny_text_path, str(tmp_path), gpus=1, env=T4_FSDP, timeout=600)
    assert result["fsdp"] and result["sharded_4bit"], result
    assert result["storage"] == str({torch.float16}), result
    assert len(result["losses"]) == 3 and all(torch.isfinite(torch.tensor(result["losses"]))), result
    # The adapter loads in a plain process of its own: importing peft here would import bitsandbytes, which
    # (on a GPU host) initialises CUDA in this process and so blocks the launches of the tests after this one.
    loaded = subprocess.run(
        [sys.executable, "-c", _LOAD_ADAPTER, tiny_text_path, str(tmp_path)], capture_output=True, text=True
    )
    assert loaded.returncode == 0 and loaded.stdout.split()[-1] != "0", loaded.stdout + loaded.stderr


# Prints how many LoRA weights the adapter saved from the shards brings into a plain model.
_LOAD_ADAPTER = """
import sys
from peft import PeftModel
from transformers import AutoModelForCausalLM

loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sys.argv[1]), sys.argv[2])
print(sum("lora_A" in name for name, _ in loaded.named_parameters()))
"""


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
def test_liger_kernels_and_savers_under_fsdp_give_the_reference_gradients():
    """Liger's fused kernels (with its fused linear cross-entropy as the chunked loss) and the tiled MLP, under
    FSDP with accelerate's checkpointing, world size 1 on a GPU: loss and LoRA gradients equal one plain process."""
    savers = dict(checkpointing=None, tiled_mlp=3, chunked_loss=True, kernels="liger", compile=None)
    result = nbkit.launch(_sharded_step, None, savers, "cuda", gpus=1, env=FSDP_ENV, timeout=600)
    _check_against_reference(result, 1, tolerance=GPU_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fsdp_gathers_every_16bit_word_exactly(dtype):
    """FSDP2 copies each rank's shards into its all-gather buffer with torch._foreach_copy_ in the dtype
    _get_all_gather_input_metadatas picks; under nbkit's fsdp patches that copy keeps every 16-bit word, NaN bit
    patterns included, as packed 4-bit weights stored in fp16 or bf16 need (torch's CUDA kernel writes fp16 and
    bf16 NaNs back as one canonical NaN)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    from nbkit.platform import patching

    patching.apply("fsdp")
    words = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).cuda()  # every bit pattern once
    shards = list(words.view(dtype).chunk(2))
    _, _, gather_dtype = collectives._get_all_gather_input_metadatas([shards])
    inputs = [shard.view(gather_dtype) for shard in shards]
    buffer = torch.empty(sum(t.numel() for t in inputs), dtype=gather_dtype, device="cuda")
    torch._foreach_copy_(list(torch.split(buffer, [t.numel() for t in inputs])), inputs)  # FSDP2's copy-in
    assert torch.equal(buffer.view(torch.int16), words)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
@pytest.mark.parametrize("load", ["gpu", "host"])
def test_qlora_under_fsdp_on_two_gpus_trains_as_one_process_does_in_fp16(tmp_path, monkeypatch, load):
    """FSDP-QLoRA on 2 GPUs under the T4 profile (fp16, its loss scaler, compiled layers where nbkit compiles them)
    against the same 4-bit model in one process split over the 2 GPUs, on the same sequences per step
    (benchmarks/fsdp_vs_balanced.py, as the fsdp2 benchmark runs it): the same first loss, the same steps skipped by
    the loss scaler and the same gradient norm, within fp16's arithmetic. The FSDP ranks load the whole model on
    their GPUs, or keep their shares of it on the host until sharding (fsdp_4bit_load="host", as for a model too big
    for one GPU)."""
    monkeypatch.setenv("NBKIT_FSDP_4BIT_LOAD", load)
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "rows.json"
    argv = ["--model", "tiny:qwen3", "--gpus", "2", "--t4", "--seq-len", "256", "--steps", "5", "--warmup", "1"]
    # A process of its own: the FSDP ranks are launched from a process without CUDA, which this one may not be.
    run = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "fsdp_vs_balanced.py"), *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=repo,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    sys.path.insert(0, str(repo))
    from benchmarks import fsdp_vs_balanced

    fsdp_row, balanced = [json.loads(line) for line in out.read_text().splitlines()]
    assert fsdp_row["status"] == balanced["status"] == "ok", (fsdp_row, balanced)
    same = fsdp_vs_balanced.agreement(fsdp_row, balanced)
    assert abs(same["first_loss_difference"]) < 0.005, same
    assert same["skipped"][0] == same["skipped"][1], same
    assert same["grad_norm_ratio"] == pytest.approx(1, rel=0.2), (same, fsdp_row["grad_norms"], balanced["grad_norms"])
