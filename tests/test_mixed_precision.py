"""fp16 training dtypes: trainable weights fp32, frozen non-quantised weights fp16, also after TRL's SFTTrainer.

bitsandbytes does not run on CPU: the 4-bit case here is TRL's own (it decides from the model's
`is_loaded_in_4bit`, the flag transformers sets on a bitsandbytes model); the GPU run of
benchmarks/gpu_suite.sh t4 trains real 4-bit models in fp16.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest
import torch

import nbkit
from nbkit.platform import compat
from nbkit.training.mixed_precision import fit_for_fp16


def _lora_model(path: str) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def _dtypes(model: Any) -> tuple[set[torch.dtype], set[torch.dtype]]:
    params = list(model.parameters())
    return {p.dtype for p in params if p.requires_grad}, {p.dtype for p in params if not p.requires_grad}


def test_fit_for_fp16_makes_trainable_weights_fp32_and_frozen_ones_fp16(tiny_text_path):
    model = _lora_model(tiny_text_path)
    for p in model.parameters():  # as TRL leaves a QLoRA model: LoRA in bf16
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    lora = sum(p.requires_grad for p in model.parameters())
    frozen = sum(not p.requires_grad for p in model.parameters())
    counts = fit_for_fp16(model)
    assert _dtypes(model) == ({torch.float32}, {torch.float16})
    assert counts == {"trainable_to_fp32": lora, "frozen_to_fp16": frozen, "compute_dtype_to_fp16": 0}
    assert fit_for_fp16(model) == dict.fromkeys(counts, 0)  # idempotent
    # the model still trains: one fp16-autocast step gives every LoRA weight a finite fp32 gradient
    ids = torch.arange(1, 9).unsqueeze(0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def _sft_trainer(model: Any, path: str, tmp_path: Any, fp16: bool) -> Any:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    base = model.get_base_model()
    base.is_loaded_in_4bit = True  # what transformers sets on a bitsandbytes model; TRL reads it
    try:
        args = SFTConfig(
            output_dir=str(tmp_path),
            fp16=fp16,
            use_cpu=True,
            max_steps=1,
            report_to=[],
            per_device_train_batch_size=2,
            dataset_kwargs={"skip_prepare_dataset": True},
            max_length=None,
            remove_unused_columns=False,
        )
        data = Dataset.from_dict({"input_ids": [list(range(1, 9))] * 2})
        return SFTTrainer(
            model=model, args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(path)
        )
    finally:
        del base.is_loaded_in_4bit  # transformers would look for bitsandbytes, absent on CPU


def _trl_casts_to_bf16() -> bool:
    return int(importlib.metadata.version("trl").split(".")[0]) >= 1


@pytest.mark.skipif(
    not _trl_casts_to_bf16(),
    reason="TRL 0.x does not cast QLoRA weights to bf16 (it runs peft's prepare_model_for_kbit_training instead)",
)
def test_sft_trainer_under_fp16_leaves_qlora_weights_fp16_ready(tiny_text_path, tmp_path):
    nbkit.uninstall("mixed_precision")
    model = _lora_model(tiny_text_path)  # the cause, on TRL 1.x: LoRA weights in bf16 under fp16
    _sft_trainer(model, tiny_text_path, tmp_path, fp16=True)
    assert _dtypes(model)[0] == {torch.bfloat16}
    nbkit.install("mixed_precision")
    try:
        model = _lora_model(tiny_text_path)
        _sft_trainer(model, tiny_text_path, tmp_path, fp16=True)
        assert _dtypes(model) == ({torch.float32}, {torch.float16})
        model = _lora_model(tiny_text_path)  # bf16 training: TRL's choice stands
        _sft_trainer(model, tiny_text_path, tmp_path, fp16=False)
        assert _dtypes(model)[0] == {torch.bfloat16}
    finally:
        nbkit.uninstall("mixed_precision")


def _groups_in_rank() -> list[str]:
    import trl.trainer.sft_trainer  # noqa: F401  (the patch waits for TRL's import)

    from nbkit.platform import patching

    return sorted({p.group for p in patching.registered() if p.is_applied})


def test_every_launched_rank_gets_the_fp16_fix():
    assert "mixed_precision" in nbkit.launch(_groups_in_rank, gpus=1)


def _frozen_mlp(model: Any) -> torch.Tensor:
    """A frozen 16-bit weight that stands for the ones bitsandbytes leaves unquantised (norms, embeddings, vision)."""
    return model.get_base_model().model.layers[0].mlp.gate_proj.weight


@pytest.mark.skipif(_trl_casts_to_bf16(), reason="TRL 1.x leaves the adapters of a PeftModel it is given trainable")
def test_sft_trainer_keeps_a_quantised_peft_model_as_it_is(tiny_text_path, tmp_path):
    nbkit.uninstall("compat")
    model = _lora_model(tiny_text_path)
    lora = {n for n, p in model.named_parameters() if p.requires_grad}
    _sft_trainer(model, tiny_text_path, tmp_path, fp16=False)
    assert lora and not any(p.requires_grad for p in model.parameters())  # the cause: TRL 0.22 froze them all
    assert _frozen_mlp(model).dtype == torch.float32  # and upcast every frozen 16-bit weight (4-bit ones aside)
    compat.enable()
    try:
        model = _lora_model(tiny_text_path)
        trainer = _sft_trainer(model, tiny_text_path, tmp_path, fp16=False)
        assert {n for n, p in model.named_parameters() if p.requires_grad} == lora
        assert _frozen_mlp(model).dtype == torch.bfloat16  # as loaded
        before = {n: p.detach().clone() for n, p in model.named_parameters() if n in lora}
        trainer.train()
        # LoRA's B starts at zero: after one step every adapter weight pair has moved
        moved = {n for n, p in model.named_parameters() if n in lora and not torch.equal(p, before[n])}
        assert {n for n in lora if "lora_B" in n} <= moved
    finally:
        nbkit.uninstall("compat")


_TORCHAO_WITHOUT_THE_CLASS = {  # a torchao as 0.18 ships it, as far as peft's dispatcher looks: no LinearActivationQuantizedTensor
    "torchao/__init__.py": "",
    "torchao/dtypes.py": "import torch\n\nclass AffineQuantizedTensor(torch.Tensor):\n    pass\n",
    "torchao/quantization/__init__.py": "",
    "torchao-0.18.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: torchao\nVersion: 0.18.0\n",
}

# transformers imports a torchao it finds at its own import: the stand-in goes on the path after that,
# before peft adds LoRA (peft asks whether torchao is there at that moment).
_ADD_LORA = """
import sys
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
if sys.argv[2] == "nbkit":
    from nbkit.platform import compat
    compat.enable()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
sys.path.insert(0, sys.argv[3])
model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
print("lora layers:", sum(name.endswith("lora_A") for name, _ in model.named_modules()))
"""


@pytest.mark.skipif(not compat._peft_before_0_21(), reason="peft 0.21 does not import the removed torchao class")
def test_lora_is_added_beside_a_torchao_without_linear_activation_quantized_tensor(tiny_text_path, tmp_path):
    import subprocess
    import sys

    for name, text in _TORCHAO_WITHOUT_THE_CLASS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    def add_lora(how: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", _ADD_LORA, tiny_text_path, how, str(tmp_path)]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    plain = add_lora("plain")
    assert plain.returncode != 0 and "cannot import name 'LinearActivationQuantizedTensor'" in plain.stderr
    fixed = add_lora("nbkit")
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert int(fixed.stdout.split("lora layers:")[1]) > 0
