"""nbkit.recipe: a run's choices made once in the notebook (processes, backend, precision, 16-bit or 4-bit, batch),
said in a few lines, and the model steps for them in the ranks, without a branch on the backend."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

import nbkit
from nbkit.platform import compat
from nbkit.platform.errors import BackendError, OptionsError, RanksError, StrategyError
from nbkit.training import emulation

# Qwen3-8B's shapes (as in notebooks/model_parallel.ipynb): ~16 GiB of 16-bit weights, more than a T4 holds.
QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
)


def test_on_cpu_processes_a_tiny_model_trains_in_16_bit_fp32_with_transformers_and_says_so():
    recipe = nbkit.recipe("tiny:qwen3-vl", gpus=2, max_seq_length=256, batch_size=1, effective_batch=4)
    assert (recipe.gpus, recipe.backend, recipe.precision, recipe.load_in_4bit) == (2, "transformers", "fp32", False)
    assert recipe.plan.gpu == "cpu" and recipe.plan.gpu_memory_gib == 15.0 and recipe.plan.strategy == "ddp"
    assert recipe.trainer_args == {
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "bf16": False,
        "fp16": False,
    }
    plan, choices, batch = str(recipe).rsplit("\n", 2)
    assert plan == str(recipe.plan)
    assert choices == (
        "2 processes on cpu, backend transformers, precision fp32, 16-bit LoRA: a full copy fits on each GPU in 16-bit"
    )
    assert batch.startswith("Trainer: 1 per process x 2 accumulation steps x 2 processes = 4 examples")
    assert pickle.loads(pickle.dumps(recipe)) == recipe  # it travels to the ranks with the cells that use it


def test_a_model_too_big_for_a_full_copy_trains_in_4_bit_under_ddp_and_in_16_bit_under_fsdp():
    from transformers import Qwen3Config

    config = Qwen3Config(**QWEN3_8B)
    ddp = nbkit.recipe(config, gpus=2, max_seq_length=1024)
    assert ddp.load_in_4bit and ddp.plan.strategy == "ddp"
    assert ddp.bits_reason.startswith("in 16-bit the planner says fsdp (")
    fsdp = nbkit.recipe(config, gpus=2, max_seq_length=1024, strategy="fsdp")
    assert not fsdp.load_in_4bit and fsdp.bits_reason == "the shards fit on each GPU in 16-bit"
    assert fsdp.backend == "transformers"  # "auto": unsloth has no FSDP
    with pytest.raises(StrategyError, match="unsloth cannot train with the fsdp strategy"):
        nbkit.recipe(config, gpus=2, strategy="fsdp", backend="unsloth")
    with pytest.raises(StrategyError, match="recipe.from_pretrained loads a full copy"):
        fsdp.from_pretrained()
    assert not nbkit.recipe(config, gpus=2, load_in_4bit=False).load_in_4bit  # as asked, even where it won't fit


def test_a_gpu_profile_is_planned_for_and_reaches_the_ranks_started_afterwards():
    try:
        recipe = nbkit.recipe("tiny:qwen3", gpus=2, emulate="T4")
        assert emulation.active() is emulation.PROFILES["T4"]  # NBKIT_EMULATE: every rank started from here
        assert recipe.plan.gpu == "Tesla T4" and recipe.plan.gpu_memory_gib == 15.0
    finally:
        emulation.emulate(None)


def test_what_cannot_be_chosen_is_refused_with_the_argument_to_change():
    with pytest.raises(RanksError, match=r"nbkit.recipe\(gpus=None\) has nothing to run on.*pass gpus=N"):
        nbkit.recipe("tiny:qwen3")  # no GPU here
    with pytest.raises(OptionsError, match="precision must be None or one of 'bf16', 'fp16', 'fp32', not 'fp8'"):
        nbkit.recipe("tiny:qwen3", gpus=2, precision="fp8")
    with pytest.raises(OptionsError, match="strategy must be 'ddp' or 'fsdp', not 'model_parallel'"):
        nbkit.recipe("tiny:qwen3", gpus=2, strategy="model_parallel")
    with pytest.raises(OptionsError, match="checkpointing must be one of 'offload', 'recompute', None, not 'none'"):
        nbkit.recipe("tiny:qwen3", gpus=2, checkpointing="none")
    with pytest.raises(OptionsError, match="unsloth brings its own offloaded checkpointing.*backend='transformers'"):
        nbkit.recipe("tiny:qwen3", gpus=2, backend="unsloth", checkpointing=None)
    with pytest.raises(OptionsError, match="under fsdp nbkit's FSDP set-up checkpoints each layer itself"):
        nbkit.recipe("tiny:qwen3", gpus=2, strategy="fsdp", checkpointing=None)


def test_checkpointing_auto_is_off_where_the_batch_fits_without_it_and_print_says_why():
    t4 = dict(gpus=2, emulate="T4", max_seq_length=2048, backend="transformers")
    try:
        # Qwen3-VL-2B at 2048 x 1 on Kaggle's T4s: about 12 GiB per GPU without checkpointing, of 14.2.
        auto = nbkit.recipe("random:qwen3-vl-2b", **t4)
        assert auto.checkpointing is None and auto.plan.checkpointing is None and auto.load_in_4bit is False
        assert auto.trainer_args[compat.trainer_checkpointing_field()] is False  # SFTConfig's default is True
        note = str(auto).splitlines()[-2]
        assert note == auto.checkpointing_note and note.startswith("Checkpointing: off: without it the plan says about")
        assert note.endswith("checkpointing='offload' keeps it.")
        # Asked for, the checkpoint stays, with the same batch, and the line says what "auto" would do.
        on = nbkit.recipe("random:qwen3-vl-2b", **t4, checkpointing="offload")
        assert on.checkpointing == "offload" and compat.trainer_checkpointing_field() not in on.trainer_args
        assert on.batch == auto.batch and on.load_in_4bit is False
        assert on.checkpointing_note.startswith("Checkpointing: offload. Without it the plan says about")
        assert on.checkpointing_note.endswith("nbkit.recipe(..., checkpointing='auto').")
        # 2048 x 2 per GPU (the flagship's default batch) does not fit a T4 without it: "auto" keeps it, quietly.
        two = nbkit.recipe("random:qwen3-vl-2b", **t4, batch_size=2)
        assert two.checkpointing == "offload" and two.checkpointing_note == "" and two.load_in_4bit is False
        # None asked for there fits only in 4-bit, which trains slower than 16-bit with the checkpoint: said so.
        off = nbkit.recipe("random:qwen3-vl-2b", **t4, batch_size=2, checkpointing=None)
        assert off.checkpointing is None and off.load_in_4bit is True
        assert off.checkpointing_note.startswith("Checkpointing: off, so the model trains in 4-bit")
        assert nbkit.recipe("random:qwen3-vl-2b", **t4, checkpointing=None).checkpointing_note == ""
        # unsloth brings its own checkpoint: "auto" is unsloth's, offloaded
        assert nbkit.recipe("random:qwen3-vl-2b", **{**t4, "backend": "unsloth"}).checkpointing == "offload"
    finally:
        emulation.emulate(None)
    cpu = nbkit.recipe("tiny:qwen3-vl", gpus=2)  # CPU ranks: the plan is a stand-in, nothing is chosen from it
    assert cpu.checkpointing == "offload" and cpu.checkpointing_note == ""


def test_checkpointing_off_reaches_the_trainers_own_setting_in_the_installed_trl(tmp_path):
    from trl import SFTConfig

    def trainer_checkpoints(trainer_args: dict) -> bool:
        config = SFTConfig(**trainer_args, output_dir=str(tmp_path), use_cpu=True, report_to=[])
        return bool(getattr(config, "activation_checkpointing", config.gradient_checkpointing))  # renamed in 5.23

    # with nbkit's checkpoint the recipe leaves TRL's choice (True in trl 1.x; nbkit's checkpointed layers ignore it)
    default = nbkit.recipe("tiny:qwen3-vl", gpus=2, checkpointing="offload").trainer_args
    assert trainer_checkpoints(default) == trainer_checkpoints({"bf16": False, "fp16": False})
    # ... and without nbkit's checkpoint it turns the Trainer's own off, under the name the installed version reads,
    # so that the training cell prints no deprecation notice
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert not trainer_checkpoints(nbkit.recipe("tiny:qwen3-vl", gpus=2, checkpointing=None).trainer_args)


def test_in_a_rank_its_steps_load_add_lora_and_switch_modes_for_the_chosen_backend():
    recipe = nbkit.recipe("tiny:qwen3", gpus=1, precision="bf16", max_seq_length=128)
    assert recipe.dtype is torch.bfloat16 and recipe.trainer_args["bf16"] and not recipe.trainer_args["fp16"]
    model, tokenizer = recipe.from_pretrained()  # the model planned for
    assert model.dtype is torch.bfloat16 and tokenizer.eos_token
    model = recipe.get_peft_model(model, r=4, lora_alpha=4)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}  # peft's adapters
    recipe.for_inference(model)
    assert not model.training
    recipe.for_training(model)
    assert model.training and recipe.data_collator(model, tokenizer) is None


def test_unsloths_merged_and_gguf_savers_are_refused_under_transformers_with_what_to_do(tmp_path):
    recipe = nbkit.recipe("tiny:qwen3", gpus=1)
    for save in (
        lambda: recipe.save_merged(object(), object(), str(tmp_path)),
        lambda: recipe.save_gguf(object(), object(), str(tmp_path), "q8_0"),
    ):
        with pytest.raises(
            BackendError, match=r"is unsloth's \(backend 'unsloth'\); this model trains with transformers"
        ):
            save()
    assert list(tmp_path.iterdir()) == []
