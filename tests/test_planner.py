"""nbkit.plan: exact parameter counts from configs, memory estimates, strategies and explanations.

Parameter counts are recomputed here from the config fields alone (independently of the planner,
which builds the model on the meta device), for a tiny model and for real published shapes.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3VLConfig

import nbkit
from nbkit.notebook import planner
from nbkit.platform import compat
from nbkit.training import offline
from nbkit.training.offline import load_config

GIB = 2**30
T4 = dict(gpus=2, gpu_memory_gib=15)


def qwen3_vl_2b() -> Qwen3VLConfig:
    """Qwen/Qwen3-VL-2B-Instruct's published shapes, built here without nbkit.offline."""
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
            # M-RoPE as published, in the installed transformers' terms (4.57's model needs its sections)
            **offline._rope_fields(
                {"rope_parameters": dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20])}
            ),
        ),
        vision_config=dict(
            depth=24,
            hidden_size=1024,
            intermediate_size=4096,
            num_heads=16,
            out_hidden_size=2048,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[5, 11, 17],
            patch_size=16,
        ),
        tie_word_embeddings=True,
    )


def qwen3_8b() -> Qwen3Config:
    """Qwen3-8B's shapes (untied lm_head): 16 GB of bf16 weights, more than one T4 holds."""
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    )


def llama_70b() -> LlamaConfig:
    """Llama-3.3-70B's shapes: about 140 GB of bf16 weights, more than any one GPU holds (also test_guard's)."""
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )


def text_counts(c) -> dict[str, int]:
    """Parameters of a Llama/Qwen3-style decoder from its config: total, nn.Linear weights, LoRA (r=1)."""
    h, i, layers, v = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    qk_norm = 2 * d if c.model_type.startswith("qwen3") else 0
    linear = layers * (h * q + 2 * h * kv + q * h + 3 * h * i)
    per_layer_other = 2 * h + qk_norm
    lm_head = 0 if c.tie_word_embeddings else v * h
    return dict(
        total=v * h + linear + layers * per_layer_other + h + lm_head,
        linear=linear,  # excludes lm_head, which stays 16-bit in 4-bit loads
        lora=layers * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)),
    )


def vision_counts(c) -> dict[str, int]:
    """Parameters of the Qwen3-VL vision tower from its config."""
    h, i, m2 = c.hidden_size, c.intermediate_size, c.spatial_merge_size**2
    patch = c.in_channels * c.temporal_patch_size * c.patch_size**2 * h + h
    block_linear = (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
    block = 2 * 2 * h + block_linear

    def merger(norm_width: int) -> tuple[int, int]:
        linear = (h * m2) * (h * m2) + h * m2 + (h * m2) * c.out_hidden_size + c.out_hidden_size
        return 2 * norm_width + linear, linear

    main_total, main_linear = merger(h)
    deep_total, deep_linear = merger(h * m2)
    deep = len(c.deepstack_visual_indexes)
    return dict(
        total=patch + c.num_position_embeddings * h + c.depth * block + main_total + deep * deep_total,
        linear=c.depth * block_linear + main_linear + deep * deep_linear,  # weights and biases
        linear_bias=c.depth * (3 * h + h + i + h) + (h * m2 + c.out_hidden_size) * (1 + deep),
    )


def test_tiny_and_real_shapes_match_hand_counts():
    configs = {"tiny": load_config("tiny:qwen3"), "qwen3-8b": qwen3_8b(), "llama-70b": llama_70b()}
    for name, config in configs.items():
        expected = text_counts(config)
        p = nbkit.plan(config, **T4, lora_rank=16)
        assert p.parameters == expected["total"], name
        assert p.lora_parameters == 16 * expected["lora"], name
        assert p.breakdown["weights"] == pytest.approx(2 * expected["total"] / GIB, rel=1e-12), name
        q4 = nbkit.plan(config, **T4, load_in_4bit=True)
        nf4 = (expected["total"] - expected["linear"]) * 2 + expected["linear"] * planner.NF4_BYTES_PER_WEIGHT
        assert q4.breakdown["weights"] == pytest.approx(nf4 / GIB, rel=1e-12), name
    assert nbkit.plan(llama_70b(), **T4).parameters == 70_553_706_496  # Llama-3-70B's published count


def test_qwen3_vl_2b_counts_include_the_vision_tower_but_lora_only_the_language_model():
    config = qwen3_vl_2b()
    text, vision = text_counts(config.text_config), vision_counts(config.vision_config)
    p = nbkit.plan(config, **T4, lora_rank=16)
    assert p.parameters == text["total"] + vision["total"] == 2_127_532_032
    assert p.lora_parameters == 16 * text["lora"] == 17_432_576
    assert p.lora_modules == planner.LORA_TARGET_MODULES
    # 4-bit: every nn.Linear weight but the lm_head (tied to the embedding here), biases stay 16-bit
    linear = text["linear"] + vision["linear"] - vision["linear_bias"]
    nf4 = (p.parameters - linear) * 2 + linear * planner.NF4_BYTES_PER_WEIGHT
    assert nbkit.plan(config, **T4, load_in_4bit=True).breakdown["weights"] == pytest.approx(nf4 / GIB, rel=1e-12)


def test_nbkit_names_are_planned_from_their_config():
    assert nbkit.plan("random:qwen3-vl-2b", **T4).parameters == 2_127_532_032


@pytest.mark.skipif(
    compat.transformers_major() < 5,
    reason="the formula is calibrated on transformers 5; a 4.57 decoder layer keeps about 30% more "
    "(5792 against 4464 bytes per token at these toy shapes), which the planner does not model",
)
def test_layer_activation_formula_matches_what_autograd_saves():
    """The per-token bytes the planner assumes equal the bytes autograd really keeps for a decoder
    layer with peft LoRA under bf16 autocast (measured on CPU with saved_tensors_hooks)."""
    from peft import LoraConfig, get_peft_model

    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    config._attn_implementation = "sdpa"
    model = get_peft_model(
        Qwen3ForCausalLM(config).to(torch.bfloat16), LoraConfig(r=8, target_modules=list(planner.LORA_TARGET_MODULES))
    )
    # The second layer: the first one's input (the embedding) needs no gradient, so its norm saves less.
    layer = model.base_model.model.model.layers[1]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved_bytes(tokens: int) -> int:
        seen: dict[int, tuple[bool, int]] = {}  # storage -> (first saved inside the layer, bytes)
        inside = [False]

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen.setdefault(storage.data_ptr(), (inside[0], storage.nbytes()))
            return t

        hooks = [
            layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
            layer.register_forward_hook(lambda *_: inside.__setitem__(0, False)),
        ]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            model(input_ids=torch.randint(0, 256, (1, tokens)), use_cache=False)
        for hook in hooks:
            hook.remove()
        return sum(nbytes for in_layer, nbytes in seen.values() if in_layer)

    # The difference cancels what does not grow with the sequence (16-bit copies of the LoRA weights);
    # the formula leaves out per-head fp32 statistics (1% at these toy sizes, <0.2% at real ones).
    per_token = (saved_bytes(384) - saved_bytes(128)) / 256
    expected = planner._layer_saved_per_token(planner._Shape.of(config), qk_norm=True, tiled_mlp=False, lora_rank=8)
    assert per_token == pytest.approx(expected, rel=0.015)


def test_qwen3_vl_2b_on_two_t4s_is_ddp_and_memory_grows_with_tokens():
    p = nbkit.plan("random:qwen3-vl-2b", **T4)
    assert p.strategy == "ddp"
    assert p.gpus == 2 and p.gpu_memory_gib == 15 and p.usable_gib < 15
    assert p.per_gpu_gib == pytest.approx(sum(p.breakdown.values()))
    assert p.peak_allocated_gib == pytest.approx(p.per_gpu_gib - p.breakdown["overhead"])
    assert 4.0 < p.per_gpu_gib < p.usable_gib
    long = nbkit.plan("random:qwen3-vl-2b", **T4, seq_len=16384)
    assert long.breakdown["activations"] > 4 * p.breakdown["activations"]
    assert long.breakdown["weights"] == p.breakdown["weights"]
    modes = {
        mode: nbkit.plan(qwen3_vl_2b(), **T4, seq_len=8192, checkpointing=mode).breakdown["activations"]
        for mode in ("offload", "recompute", None)
    }
    assert modes["offload"] < modes["recompute"] < modes[None]
    assert nbkit.plan(qwen3_vl_2b(), **T4, seq_len=8192, batch_size=2).per_gpu_gib > long.per_gpu_gib / 2


def test_too_large_models_are_split_or_refused_and_the_explanation_says_what_to_change():
    eight_b = nbkit.plan(qwen3_8b(), **T4)
    assert eight_b.strategy == "fsdp"
    assert eight_b.per_gpu_gib > eight_b.usable_gib >= eight_b.fsdp_gib
    text = str(eight_b)
    assert "Strategy: fsdp" in text and "every GPU trains" in text and "qlora_config()" in text
    assert f"{eight_b.per_gpu_gib:.1f} GiB" in text and f"each rank needs about {eight_b.fsdp_gib:.1f} GiB" in text
    # At 8K tokens each FSDP rank's own activations no longer fit; the GPUs taking turns do.
    long = nbkit.plan(qwen3_8b(), **T4, seq_len=8192)
    assert long.strategy == "model_parallel"
    assert long.fsdp_gib > long.usable_gib >= long.model_parallel_gib
    text = str(long)
    assert "model_parallel" in text and "device_map='balanced'" in text and "not nbkit.launch" in text
    assert f"{long.model_parallel_gib:.1f} GiB" in text
    text = str(eight_b)
    four_bit = nbkit.plan(qwen3_8b(), **T4, load_in_4bit=True)
    assert four_bit.strategy == "ddp"
    assert f"load_in_4bit=True: about {four_bit.per_gpu_gib:.1f} GiB per GPU (fits)" in text

    seventy_b = nbkit.plan(llama_70b(), **T4)
    assert seventy_b.strategy == "does_not_fit"
    text = str(seventy_b)
    assert "does_not_fit" in text and "GPUs of this size" in text and "load_in_4bit=True" in text
    assert str(four_bit).count("Strategy: ddp") == 1 and "nbkit.launch" in str(four_bit)


def test_long_sequences_suggest_a_length_that_fits():
    p = nbkit.plan(qwen3_vl_2b(), gpus=2, gpu_memory_gib=6, seq_len=65536, load_in_4bit=True)
    assert p.strategy != "ddp"
    line = next(line for line in str(p).splitlines() if "sequences of at most" in line)
    fits = int(line.split("at most ")[1].split()[0])
    assert nbkit.plan(qwen3_vl_2b(), gpus=2, gpu_memory_gib=6, seq_len=fits, load_in_4bit=True).strategy == "ddp"
    assert nbkit.plan(qwen3_vl_2b(), gpus=2, gpu_memory_gib=6, seq_len=2 * fits, load_in_4bit=True).strategy != "ddp"


def test_arguments_are_checked_and_a_cpu_machine_must_say_which_gpus():
    with pytest.raises(ValueError, match="gpu_memory_gib"):
        nbkit.plan(qwen3_8b())  # no GPU here: nothing to default to
    with pytest.raises(ValueError, match="checkpointing"):
        nbkit.plan(qwen3_8b(), **T4, checkpointing="full")
    with pytest.raises(ValueError, match="seq_len"):
        nbkit.plan(qwen3_8b(), **T4, seq_len=0)
    with pytest.raises(ValueError, match="gpus"):
        nbkit.plan(qwen3_8b(), gpus=0, gpu_memory_gib=15)


# ---------------------------------------------------------------------------------------------
# The per-GPU batch: enough tokens per step that the GPU, not the host, bounds it, within memory.


def test_small_batches_on_fast_gpus_are_raised_to_the_gpu_bound_regime():
    plan = nbkit.plan(qwen3_vl_2b(), gpus=2, gpu_memory_gib=140, seq_len=1024, batch_size=4, gpu="NVIDIA H200")
    # RESULTS.md: on H200s 1K x 16 scaled 1.94x where 1K x 4 scaled 1.3-1.6x.
    assert plan.recommended_batch_size == 16
    assert plan.gpu == "NVIDIA H200"
    assert "per_device_train_batch_size=16" in plan.batch_reason
    assert "divide gradient_accumulation_steps by 4" in plan.batch_reason
    assert "padding_free=True" in plan.batch_reason
    assert "Batch: 16 per GPU." in str(plan)
    # The memory figures stay those of the batch asked for; the recommended one fits too.
    assert plan.batch_size == 4
    bigger = nbkit.plan(qwen3_vl_2b(), gpus=2, gpu_memory_gib=140, seq_len=1024, batch_size=16, gpu="H200")
    assert bigger.strategy == "ddp" and bigger.recommended_batch_size == 16
    assert "already bounds it" in bigger.batch_reason


def test_a_t4_is_already_gpu_bound_at_1k_x_4():
    plan = nbkit.plan(qwen3_vl_2b(), **T4, seq_len=1024, batch_size=4, gpu="Tesla T4")
    assert plan.recommended_batch_size == 4
    assert "GPU already bounds it" in plan.batch_reason
    assert "on Tesla T4, about 304 us of GPU work per token" in plan.batch_reason
    assert "Batch: 4 per GPU." in str(plan)


def test_long_sequences_keep_batch_one():
    plan = nbkit.plan(qwen3_vl_2b(), gpus=2, gpu_memory_gib=140, seq_len=16384, batch_size=1, gpu="H100")
    assert plan.recommended_batch_size == 1
    assert "already bounds it" in plan.batch_reason


def test_the_recommended_batch_is_the_largest_that_fits_memory():
    # 1K sequences on 7 GiB GPUs: 16 per GPU would be GPU-bound but does not fit.
    plan = nbkit.plan(qwen3_vl_2b(), gpus=2, gpu_memory_gib=7, seq_len=1024, batch_size=1, gpu="H100")
    batch = plan.recommended_batch_size
    assert 1 < batch < 16
    fits = nbkit.plan(qwen3_vl_2b(), gpus=2, gpu_memory_gib=7, seq_len=1024, batch_size=batch, gpu="H100")
    too_big = nbkit.plan(qwen3_vl_2b(), gpus=2, gpu_memory_gib=7, seq_len=1024, batch_size=2 * batch, gpu="H100")
    assert fits.per_gpu_gib <= fits.usable_gib < too_big.per_gpu_gib
    assert "would be better still but does not fit" in plan.batch_reason


def test_an_unknown_gpu_is_planned_as_a_fast_one_and_says_so(monkeypatch):
    monkeypatch.setattr(planner.distributed, "visible_gpus", list)  # as on a machine without GPUs, also on a GPU host
    plan = nbkit.plan(qwen3_vl_2b(), **T4, seq_len=1024, batch_size=4)
    assert plan.gpu is None
    assert plan.recommended_batch_size == 16
    assert "GPU model unknown: pass gpu='T4'" in plan.batch_reason


def test_a_model_that_does_not_fit_keeps_its_batch():
    plan = nbkit.plan(qwen3_8b(), **T4, seq_len=1024, batch_size=2, gpu="T4")
    assert plan.strategy != "ddp"
    assert plan.recommended_batch_size == 2
    assert "the question is memory" in plan.batch_reason


@pytest.mark.parametrize(
    ("name", "tflops"),
    [("Tesla T4", 65.0), ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", 121.0), ("x", None)],
)
def test_gpu_throughput_by_name(name, tflops):
    assert planner.gpu_tflops(name) == tflops


# ---------------------------------------------------------------------------------------------
# Plan.batch_settings: the recommendation as Trainer's two arguments, keeping the effective batch.

H200 = dict(gpus=2, gpu_memory_gib=140, gpu="NVIDIA H200")


def test_batch_settings_keep_the_effective_batch_at_the_recommended_per_gpu_batch():
    plan = nbkit.plan(qwen3_vl_2b(), **H200, seq_len=1024, batch_size=4)
    assert plan.recommended_batch_size == 16
    settings = plan.batch_settings(64)
    assert settings.trainer_args == {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2}
    assert settings.processes == 2 and settings.effective_batch == 64
    assert str(settings).startswith("Trainer: 16 per GPU x 2 accumulation steps x 2 GPUs = 64 examples per optimizer")
    assert "Raised from the asked 4 per GPU: at 4 x 1024 tokens the host is 46% of a step on NVIDIA H200" in str(
        settings
    )
    exact = plan.batch_settings(32)
    assert (exact.per_device_train_batch_size, exact.gradient_accumulation_steps) == (16, 1)
    assert str(exact).startswith("Trainer: 16 per GPU x 2 GPUs = 32 examples per optimizer step, no gradient accum")
    # Any even effective batch is kept exactly, with the largest per-GPU batch up to 16 that divides its share.
    for effective in range(2, 200, 2):
        s = plan.batch_settings(effective)
        share = effective // 2
        assert s.effective_batch == effective and s.per_device_train_batch_size <= 16, effective
        assert share % s.per_device_train_batch_size == 0
        assert not any(share % d == 0 for d in range(s.per_device_train_batch_size + 1, 17)), effective


def test_batch_settings_say_when_the_effective_batch_keeps_the_gpu_below_the_recommendation():
    plan = nbkit.plan(qwen3_vl_2b(), **H200, seq_len=1024, batch_size=4)
    small = plan.batch_settings(8)  # 4 per GPU: what the user trains on stays, and the text says what it costs
    assert small.trainer_args == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1}
    assert "the host is 46% of a step" in small.reason
    assert "effective_batch=8 leaves 4 per GPU, below the planner's 16: effective_batch=32 would train at 16" in (
        small.reason
    )
    odd = plan.batch_settings(48)  # 24 per GPU: 16 does not divide it, 12 does
    assert odd.trainer_args == {"per_device_train_batch_size": 12, "gradient_accumulation_steps": 2}
    assert "16 per GPU does not divide the 24 per GPU of effective_batch=48" in odd.reason
    assert "effective_batch=32 or 64 would train at 16" in odd.reason
    assert "\n" not in str(odd)


def test_without_an_effective_batch_the_recommended_batch_trains_without_accumulation_and_says_so():
    plan = nbkit.plan(qwen3_vl_2b(), **H200, seq_len=2048, batch_size=2)
    settings = plan.batch_settings()
    assert settings.trainer_args == {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}
    assert settings.effective_batch == 16
    assert "Raised from the asked 2 per GPU" in settings.reason
    assert "Set effective_batch to choose the examples per step (4 keeps the asked)." in settings.reason


def test_kaggle_t4s_keep_the_batch_the_notebooks_ask_for():
    # The flagship's defaults: 2 examples of up to 2048 tokens per GPU, 2 T4s.
    plan = nbkit.plan(qwen3_vl_2b(), **T4, seq_len=2048, batch_size=2, gpu="Tesla T4")
    settings = plan.batch_settings()
    assert settings.trainer_args == {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}
    assert str(settings) == (
        "Trainer: 2 per GPU x 2 GPUs = 4 examples per optimizer step, no gradient accumulation. "
        "At 2 x 2048 tokens the host is 5% of a step on Tesla T4: the GPU bounds it."
    )
    assert plan.batch_settings(16).trainer_args == {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}
    # text_llm_ddp's and long_context's defaults keep theirs too.
    for model, seq_len, batch in (("random:qwen3-1.7b", 2048, 4), ("random:qwen3-1.7b", 16384, 1)):
        kept = nbkit.plan(model, **T4, seq_len=seq_len, batch_size=batch, gpu="Tesla T4").batch_settings()
        assert kept.trainer_args == {"per_device_train_batch_size": batch, "gradient_accumulation_steps": 1}, model


def test_an_effective_batch_the_processes_cannot_share_evenly_is_refused_with_the_nearest_that_they_can():
    plan = nbkit.plan(qwen3_vl_2b(), **T4, seq_len=2048, batch_size=2, gpu="T4")
    with pytest.raises(
        ValueError, match=r"effective_batch=5 is not a multiple of the 2 training processes.*Use 4 or 6"
    ):
        plan.batch_settings(5)
    with pytest.raises(ValueError, match=r"Use 2\.$"):
        plan.batch_settings(1)
    for wrong in (0, -4, 4.0, True, "8"):
        with pytest.raises(ValueError, match="effective_batch must be a whole number"):
            plan.batch_settings(wrong)


def test_processes_on_cpu_cores_keep_the_asked_batch():
    # A tiny model is all host work on any GPU, so for an unknown GPU the planner raises its batch;
    # on CPU cores (the notebooks without a GPU) there is no GPU to keep busy and the asked batch stays.
    tiny = dict(gpus=2, gpu_memory_gib=15, seq_len=256, batch_size=2)
    assert nbkit.plan("tiny:qwen3-vl", **tiny, gpu="H100").recommended_batch_size > 2
    plan = nbkit.plan("tiny:qwen3-vl", **tiny, gpu="cpu")
    assert plan.gpu == "cpu" and plan.recommended_batch_size == 2 and plan.host_share(2) is None
    assert "Batch: 2 per process. Keep 2: the processes train on CPU cores" in str(plan)
    assert str(plan.batch_settings()).startswith("Trainer: 2 per process x 2 processes = 4 examples per optimizer")
    settings = plan.batch_settings(8)
    assert settings.trainer_args == {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    assert "no GPU waits for the host" in settings.reason


def test_model_parallel_trains_in_one_process_and_a_plan_that_does_not_fit_says_so():
    split = nbkit.plan(qwen3_8b(), **T4, seq_len=4096, batch_size=2, gpu="T4")
    assert split.strategy == "model_parallel"
    settings = split.batch_settings(8)
    assert settings.processes == 1 and settings.trainer_args["gradient_accumulation_steps"] == 4
    assert str(settings).startswith("Trainer: 2 per process x 4 accumulation steps = 8 examples per optimizer step.")
    assert "One process drives the 2 GPUs" in settings.reason
    too_big = nbkit.plan(llama_70b(), **T4, gpu="T4").batch_settings()
    assert "The plan says this does not fit" in too_big.reason and "expect to run out of memory" in too_big.reason


def test_a_split_model_is_planned_as_transformers_balances_it_over_the_gpus():
    # device_map="balanced" is uneven: accelerate keeps room for the 16-bit lm_head on the first GPU, and
    # bitsandbytes' loading keeps back 10% of each GPU, so the last GPU holds most of a 4-bit model. Loaded on
    # 2 GPUs of 15 GiB, Qwen3-14B in 4-bit held 2.86 and 6.72 GiB (70% on the second; 2x H100, 2026-11-27).
    from nbkit.notebook import planner

    config = planner.load_config("random:qwen3-14b")
    four_bit = planner._balanced_share(config, 2, 15.0, True)
    assert 0.66 < four_bit < 0.74
    # the same weights over more GPUs: each holds less, never less than an even share
    assert 1 / 4 <= planner._balanced_share(config, 4, 15.0, True) < four_bit
    # the split plan's GPU holds at least that share of the whole model's weights (breakdown: the model on one GPU)
    split = nbkit.plan(
        "random:qwen3-14b", **T4, seq_len=1024, batch_size=2, load_in_4bit=True, checkpointing="recompute"
    )
    assert split.model_parallel_gib > split.breakdown["weights"] * four_bit


def test_batch_settings_are_trainer_arguments(tmp_path):
    from trl import SFTConfig

    settings = nbkit.plan(qwen3_vl_2b(), **H200, seq_len=1024, batch_size=4).batch_settings(64)
    config = SFTConfig(output_dir=str(tmp_path), **settings.trainer_args, bf16=False, report_to=[])
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (16, 2)


def test_fsdp_shards_weights_and_lora_state_per_rank_and_keeps_each_ranks_activations():
    """The fsdp verdict: chosen before model_parallel when the shards fit; its per-rank breakdown adds up."""
    plans = {gpus: nbkit.plan(qwen3_8b(), gpus=gpus, gpu_memory_gib=15) for gpus in (1, 2, 4)}
    for p in plans.values():
        assert p.fsdp_gib == pytest.approx(sum(p.fsdp_breakdown.values()))
    one, two, four = (plans[n].fsdp_breakdown for n in (1, 2, 4))
    # Each rank's shard halves with twice the ranks; what stays is the gathered layers and output embedding.
    gathered = 2 * two["weights"] - one["weights"]
    assert four["weights"] == pytest.approx(one["weights"] / 4 + gathered * 3 / 4, rel=1e-6)
    assert two["lora"] == pytest.approx(one["lora"] / 2) and four["lora"] == pytest.approx(one["lora"] / 4)
    assert one["activations"] == two["activations"] == four["activations"]  # each rank trains its own batch
    assert plans[1].strategy == "does_not_fit" and plans[2].strategy == plans[4].strategy == "fsdp"
    assert "fsdp" in nbkit.notebook.planner.STRATEGIES
    assert plans[2].fsdp_load_gib is None  # 16-bit weights load in CPU memory and are sharded from there


def test_fsdp_in_4bit_loads_on_the_host_where_the_whole_quantised_model_does_not_fit_a_gpu():
    # An fsdp rank quantises the whole model on its own GPU and shards it only afterwards (nbkit.fsdp.device_map)...
    thirty_two_b = nbkit.plan("random:qwen3-32b", gpus=2, gpu_memory_gib=24, seq_len=1024, load_in_4bit=True)
    assert thirty_two_b.strategy == "fsdp" and not thirty_two_b.fsdp_host_load
    assert thirty_two_b.fsdp_load_gib is not None and thirty_two_b.fsdp_load_gib <= thirty_two_b.usable_gib
    assert "CPU memory until they are sharded" not in str(thirty_two_b)
    # ... unless that copy is more than a GPU holds: a 4-bit 70B on 24 GiB GPUs. Each rank then keeps its rows of the
    # quantised weights on the host (nbkit.fsdp.load_4bit_on_host), and its GPU holds only what is not quantised
    # (the 16-bit embeddings), the quantisation state and the weight being quantised.
    seventy_b = nbkit.plan(llama_70b(), gpus=4, gpu_memory_gib=24, load_in_4bit=True)
    assert seventy_b.fsdp_host_load and seventy_b.strategy == "fsdp"
    assert seventy_b.fsdp_gib is not None and seventy_b.fsdp_load_gib is not None
    assert max(seventy_b.fsdp_gib, seventy_b.fsdp_load_gib) <= seventy_b.usable_gib
    config = llama_70b()
    embeddings = 2 * 2 * config.vocab_size * config.hidden_size / 2**30
    assert embeddings < seventy_b.fsdp_load_gib < embeddings + 4, seventy_b.fsdp_load_gib
    assert "keeps its share of the quantised weights in CPU memory until they are sharded" in str(seventy_b)
    # Where one GPU loads the whole model, so does FSDP: no host load on a single GPU either.
    one_gpu = nbkit.plan(llama_70b(), gpus=1, gpu_memory_gib=24, load_in_4bit=True)
    assert not one_gpu.fsdp_host_load


def test_fsdp_offloads_its_shards_only_where_neither_fsdp_on_the_gpus_nor_the_split_fits():
    """Qwen3-32B's shapes in 4-bit on 2 GPUs of 15 GiB: sharded over 2 they still need more than a GPU (the shard is
    half the model), and split over 2 as well; with FSDP's CPU offload a GPU holds the gathered layers, the
    quantisation state and the activations only. On 4 such GPUs FSDP fits without it."""
    two = nbkit.plan("random:qwen3-32b", gpus=2, gpu_memory_gib=15, seq_len=1024, load_in_4bit=True)
    assert two.strategy == "fsdp" and two.fsdp_offload and two.fsdp_gib is not None
    assert two.model_parallel_gib > two.usable_gib >= two.fsdp_gib
    assert two.fsdp_breakdown["lora"] == 0  # LoRA's shards, gradients and AdamW state live in CPU memory
    on_gpus = planner._estimate(
        planner._counts(load_config("random:qwen3-32b"), 16),
        load_config("random:qwen3-32b"),
        2,
        1024,
        1,
        True,
        16,
        "recompute",
        fsdp_shards=2,
        gpu_memory_gib=15,
    )
    assert on_gpus.bytes_per_gpu()[1] > two.usable_gib
    assert "FSDP's CPU offload" in str(two) and "pinned" in str(two)
    # The machine's CPU memory: every rank's shards pinned, each rounded up to a power of two by torch (Qwen3-32B's
    # 10 MiB q_proj shard takes 16), so more than the packed model and LoRA's fp32 weights, gradients and AdamW state.
    config = load_config("random:qwen3-32b")
    packed, _ = planner._fsdp_weights(planner._counts(config, 16), True)
    exact = packed + planner._counts(config, 16).lora_parameters * (4 + 4 + 8)
    assert 1.1 * exact / 2**30 < two.fsdp_host_gib < 1.5 * exact / 2**30
    four = nbkit.plan("random:qwen3-32b", gpus=4, gpu_memory_gib=15, seq_len=1024, load_in_4bit=True)
    assert four.strategy == "fsdp" and not four.fsdp_offload and four.fsdp_breakdown["lora"] > 0
    # Where the split fits, it is chosen before offloading (every step would move the weights over PCIe).
    fourteen = nbkit.plan("random:qwen3-14b", gpus=2, gpu_memory_gib=12, seq_len=1024, load_in_4bit=True)
    assert not fourteen.fsdp_offload


def test_fsdp_in_4bit_shards_the_packed_weights_and_keeps_the_quantisation_state_on_every_rank():
    """What a 4-bit FSDP rank holds, counted from the model on the meta device: its share of the packed weights
    (half a byte per quantised weight, 16-bit elsewhere), the whole double-quantisation state (not a parameter, so
    never sharded) and three decoder layers gathered (the one computing, the prefetched next one and the all-gather
    buffer it is copied out of); during the loss the output embedding twice (gathered, and the buffer FSDP2 keeps
    until its next all-gather) beside one layer, as measured on 2x H100 (benchmarks/memory_at_peak.py). Loading
    holds the whole quantised model and then the fp32 LoRA weights, and no shard beside them."""
    from nbkit.training.savers.loss import BYTES_PER_LOGIT, rows_per_chunk

    config = qwen3_8b()
    plans = {gpus: nbkit.plan(config, gpus=gpus, gpu_memory_gib=80, seq_len=1024, load_in_4bit=True) for gpus in (2, 4)}
    model = planner._build_on_meta(config)
    output = model.get_output_embeddings()
    quantised = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not output)
    packed = 0.5 * quantised + 2 * (sum(p.numel() for p in model.parameters()) - quantised)
    state = quantised * (1 / 64 + 4 / (64 * 256))
    embedding = 2 * config.vocab_size * config.hidden_size
    layer = (packed - 2 * embedding) / config.num_hidden_layers  # untied: input and output embeddings
    gib = 2**30
    two, four = (plans[g].fsdp_breakdown["weights"] * gib for g in (2, 4))
    assert two - four == pytest.approx(packed / 4, rel=1e-9)  # only the packed weights are sharded
    assert four == pytest.approx(packed / 4 + state + 3 * layer, rel=1e-9)
    # The loss's phase (an FSDP rank keeps every layer's input on the GPU: "recompute"): the norm's tensors and
    # one chunk of logits, plus what it holds gathered beyond the three layers.
    tokens, width = 1024, config.hidden_size
    breakdown = plans[4].fsdp_breakdown
    layer_phase = breakdown["activations"] * gib - config.num_hidden_layers * 2 * width * tokens
    loss = 8 * width * tokens + BYTES_PER_LOGIT * rows_per_chunk(config.vocab_size) * config.vocab_size
    assert breakdown["logits"] * gib == pytest.approx(loss + 2 * embedding - 2 * layer - layer_phase, rel=1e-9)
    lora = 16 * sum(
        m.in_features + m.out_features for n, m in model.named_modules() if n.endswith(planner.LORA_TARGET_MODULES)
    )
    load = {g: plans[g].fsdp_load_gib for g in (2, 4)}
    assert load[2] == load[4]  # each rank loads the whole model, however many ranks share it afterwards
    allocated = (load[2] - planner.CUDA_CONTEXT_GIB) / (1 + planner.ALLOCATOR_SLACK) * gib
    assert allocated == pytest.approx(packed + state + 4 * lora, rel=1e-9)  # fp32 LoRA outweighs one fp16 weight
