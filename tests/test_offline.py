"""nbkit.offline: offline model names resolve to loadable, trainable, cached checkpoints."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
import torch
from PIL import Image

import nbkit
from nbkit.platform import compat, patching
from nbkit.training import offline
from nbkit.training.offline import MODELS, TOKEN_IDS, load_config, load_processor, resolve_model
from nbkit.training.synthetic import text_dataset, vision_dataset


def test_other_names_pass_through_and_typos_are_errors(tmp_path: Path) -> None:
    for name in ("Qwen/Qwen3-VL-2B-Instruct", "/models/my-checkpoint", "unsloth/Qwen3-1.7B"):
        assert resolve_model(name, cache_dir=tmp_path) == name
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="no offline model 'tiny:qwen'.*tiny:qwen3-vl"):
        resolve_model("tiny:qwen", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="random:qwen3-vl-4b"):
        load_config("random:qwen3-vl-8b")
    assert set(MODELS) == {
        "tiny:qwen3",
        "tiny:qwen3-vl",
        "random:qwen3-1.7b",
        "random:qwen3-8b",
        "random:qwen3-14b",
        "random:qwen3-32b",
        "random:qwen3-vl-2b",
        "random:qwen3-vl-4b",
    }


def test_tiny_text_model_loads_and_learns(tiny_text_path: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_text_path)
    shape = (config.model_type, config.hidden_size, config.num_hidden_layers, config.head_dim)
    assert shape == ("qwen3", 64, 2, 16)
    tokenizer = AutoTokenizer.from_pretrained(tiny_text_path)
    assert len(tokenizer) <= config.vocab_size
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]) == [1, 2, 0]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert load_processor(tiny_text_path).__class__ is tokenizer.__class__  # text models: the tokenizer

    model, info = AutoModelForCausalLM.from_pretrained(tiny_text_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, like the real Qwen3
    norm = model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    assert model.model.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)

    batch = tokenizer.apply_chat_template(
        [item["messages"] for item in text_dataset(8)],
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        padding=True,
    )
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        if not losses:  # first step: a random model is uniform over its vocabulary, every weight learns
            assert loss.item() == pytest.approx(math.log(config.vocab_size), rel=0.05)
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]


def test_chat_template_renders_turns_images_and_generation_prompt(tiny_text_path: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_text_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is written?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "cat"}]},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is written?<|im_end|>\n"
        "<|im_start|>assistant\ncat<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # Assistant turns are marked for TRL's assistant_only_loss: the answer and its <|im_end|>.
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reverse 'dog'."}, {"role": "assistant", "content": "god"}],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    masked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.decode(masked) == "god<|im_end|>"


def test_tiny_vl_model_trains_on_processed_images(tiny_vl_path: str) -> None:
    from transformers import AutoModelForImageTextToText, Qwen3VLProcessor

    processor = load_processor("tiny:qwen3-vl")
    assert isinstance(processor, Qwen3VLProcessor)
    items = vision_dataset(2, image_size=64)
    texts = [processor.apply_chat_template(item["messages"], tokenize=False) for item in items]
    batch = processor(images=[item["images"] for item in items], text=texts, padding=True, return_tensors="pt")
    assert set(batch) >= {"input_ids", "attention_mask", "pixel_values", "image_grid_thw"}
    image_tokens = batch["input_ids"] == TOKEN_IDS["<|image_pad|>"]
    # 64x64 pixels, 8px patches, 2x2 merge: an 8x8 grid becomes 16 image tokens per image.
    assert batch["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]]
    assert image_tokens.sum(dim=1).tolist() == [16, 16]
    if compat.transformers_major() >= 5:  # 5.x processors add mm_token_type_ids, and its models require them
        assert torch.equal(batch["mm_token_type_ids"] == 1, image_tokens)

    model, info = AutoModelForImageTextToText.from_pretrained(tiny_vl_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    labels = batch["input_ids"].masked_fill(image_tokens | (batch["attention_mask"] == 0), -100)
    loss = model(**batch, labels=labels).loss
    loss.backward()
    assert loss.item() == pytest.approx(math.log(model.config.text_config.vocab_size), rel=0.05)
    vision = model.model.visual
    for param in (
        vision.patch_embed.proj.weight,
        vision.blocks[0].attn.qkv.weight,
        vision.deepstack_merger_list[1].linear_fc2.weight,
    ):
        assert param.grad is not None and param.grad.abs().sum() > 0


def test_trl_vision_collator_works_with_the_cpu_processor(tiny_vl_path: str) -> None:
    from transformers import AutoModelForImageTextToText
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    collator = DataCollatorForVisionLanguageModeling(load_processor(tiny_vl_path))
    batch = collator(vision_dataset(3, seed=5))
    assert batch["pixel_values"].shape[0] == 3 * 64
    assert (batch["labels"] != -100).sum() == batch["attention_mask"].sum()
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path)
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0


def test_cpu_processor_patch_is_declared_needed_and_reversible(tiny_vl_path: str) -> None:
    from transformers.processing_utils import ProcessorMixin
    from transformers.utils import is_torchvision_available

    (declared,) = [
        p
        for p in patching.registered("offline")
        if p.target == "transformers.processing_utils:ProcessorMixin.check_argument_for_proper_class"
    ]
    assert "torchvision" in declared.reason and declared.upstream.startswith("https://github.com/huggingface/")
    if is_torchvision_available():
        pytest.skip("with torchvision, load_processor is plain AutoProcessor and needs no patch")
    processor = load_processor(tiny_vl_path)
    parts = dict(
        image_processor=processor.image_processor,
        tokenizer=processor.tokenizer,
        video_processor=processor.video_processor,
    )
    patching.revert("offline")
    original = ProcessorMixin.__dict__["check_argument_for_proper_class"]
    assert not declared.is_applied
    # The transformers bug the patch exists for: the real video processor is rejected (up to 5.22 by name; from
    # 5.23 the lookup itself fails on the placeholder that stands for the video processors' mapping).
    with pytest.raises((TypeError, AttributeError), match="BaseVideoProcessor was expected|VIDEO_PROCESSOR_MAPPING"):
        type(processor)(**parts)
    load_processor(tiny_vl_path)
    assert declared.is_applied and ProcessorMixin.__dict__["check_argument_for_proper_class"] is not original
    type(processor)(**parts)
    patching.revert("offline")
    assert ProcessorMixin.__dict__["check_argument_for_proper_class"] is original


def _auto_processor(path: str) -> str:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], tokenize=False
    )
    batch = processor(images=[Image.new("RGB", (64, 64))], text=[text], return_tensors="pt")
    return f"{type(processor).__name__} {int(batch['pixel_values'].shape[0] > 0)}"


def test_auto_processor_works_in_a_rank_without_torchvision(tiny_vl_path: str) -> None:
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        pytest.skip("with torchvision, AutoProcessor needs no help")
    # the natural call, as a user's %%ddp cell makes it (transformers alone raises ImportError here)
    assert nbkit.launch(_auto_processor, tiny_vl_path, gpus=1) == "Qwen3VLProcessor 1"


def test_second_resolve_reuses_the_cache(tiny_vl_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = Path(tiny_vl_path) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns

    def no_rebuild(*args: object) -> None:
        raise AssertionError("resolve_model rebuilt a cached checkpoint")

    monkeypatch.setattr(offline, "_build", no_rebuild)
    assert resolve_model("tiny:qwen3-vl") == tiny_vl_path
    assert weights.stat().st_mtime_ns == stamp
    assert Path(tiny_vl_path).name.endswith(f"-v{offline.FORMAT_VERSION}")
    assert not [p for p in Path(tiny_vl_path).parent.iterdir() if ".build-" in p.name]


def _resolve_in_child(cache: str, queue: mp.Queue) -> None:
    torch.set_num_threads(1)  # forked after torch ran in the parent: keep the child single-threaded
    queue.put(resolve_model("tiny:qwen3", cache_dir=cache))


def test_processes_resolving_at_once_share_one_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    children = [ctx.Process(target=_resolve_in_child, args=(str(tmp_path), queue)) for _ in range(2)]
    for child in children:
        child.start()
    paths = [queue.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert paths[0] == paths[1]
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [Path(paths[0]).name]
    model, info = AutoModelForCausalLM.from_pretrained(paths[0], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_ranks_resolve_one_checkpoint_and_train_it_with_ddp(tmp_path: Path) -> None:
    import nbkit

    def train(cache: str) -> tuple[list[str], bool, float]:
        import torch.distributed as dist
        from transformers import AutoModelForImageTextToText

        path = resolve_model("tiny:qwen3-vl", cache_dir=cache)  # both ranks at once, fresh cache
        dist.init_process_group("gloo")
        processor = load_processor(path)
        model = torch.nn.parallel.DistributedDataParallel(AutoModelForImageTextToText.from_pretrained(path))
        items = vision_dataset(2, seed=dist.get_rank())  # different data on each rank
        texts = [processor.apply_chat_template(item["messages"], tokenize=False) for item in items]
        batch = processor(images=[i["images"] for i in items], text=texts, padding=True, return_tensors="pt")
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        grad = model.module.model.visual.patch_embed.proj.weight.grad
        grads, paths = [torch.empty_like(grad) for _ in range(2)], [None, None]
        dist.all_gather(grads, grad)
        dist.all_gather_object(paths, path)
        value = loss.item()
        # DDP's reducer (reached from the model and the loss's graph) holds the process group: free
        # them before destroying it, or the group is torn down by destructors after this function
        # returns, which hung a rank in most runs here.
        del model, loss
        dist.destroy_process_group()
        return paths, torch.equal(grads[0], grads[1]), value

    paths, same_gradients, loss = nbkit.launch(train, str(tmp_path), gpus=2, timeout=120, dashboard=False)
    assert paths[0] == paths[1] and [p.name for p in tmp_path.iterdir() if p.is_dir()] == [Path(paths[0]).name]
    assert same_gradients and math.isfinite(loss)  # DDP averaged the vision tower's gradients


def _build_then_hang(cache: str, ready: mp.Event) -> None:
    torch.set_num_threads(1)

    def hang(config: object, spec: object, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half a checkpoint")
        ready.set()
        signal.pause()

    offline._write_weights = hang
    resolve_model("tiny:qwen3", cache_dir=cache)


def test_a_killed_build_leaves_no_checkpoint_behind(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_build_then_hang, args=(str(tmp_path), ready))
    child.start()
    assert ready.wait(timeout=120)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    names = [p.name for p in tmp_path.iterdir()]
    assert not any(name == f"tiny-qwen3-v{offline.FORMAT_VERSION}" for name in names)
    assert any(".build-" in name for name in names)  # the half build is only in its temp directory

    path = resolve_model("tiny:qwen3", cache_dir=tmp_path)  # the lock died with the child
    assert (Path(path) / "model.safetensors").stat().st_size > 1000
    assert not [p for p in tmp_path.iterdir() if ".build-" in p.name]


def test_sharded_weights_load_like_a_single_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_text_path: str
) -> None:
    # The random: models are written in shards; exercise that path at tiny size.
    import json
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    small_shards = replace(offline._SPECS["tiny:qwen3"], max_shard_bytes=150_000)
    monkeypatch.setitem(offline._SPECS, "tiny:qwen3", small_shards)
    path = Path(resolve_model("tiny:qwen3", cache_dir=tmp_path))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    sharded, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    single = AutoModelForCausalLM.from_pretrained(tiny_text_path)
    # Same seed, same chunks: the weights do not depend on how they are split into files.
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert torch.equal(a, b), name


# Published shapes (config.json of the Qwen repositories) and parameter counts.
_HEADS = dict(num_key_value_heads=8, head_dim=128)
_PUBLISHED = {
    "random:qwen3-1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        **_HEADS,
        params=(1.6e9, 1.8e9),
    ),
    "random:qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        **_HEADS,
        tie_word_embeddings=False,
        params=(8.1e9, 8.3e9),
    ),
    "random:qwen3-14b": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        **_HEADS,
        tie_word_embeddings=False,
        params=(14.5e9, 15.0e9),
    ),
    "random:qwen3-32b": dict(
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        **_HEADS,
        tie_word_embeddings=False,
        params=(32.5e9, 33.0e9),
    ),
    "random:qwen3-vl-2b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        **_HEADS,
        params=(2.0e9, 2.3e9),
    ),
    "random:qwen3-vl-4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        **_HEADS,
        params=(4.2e9, 4.6e9),
    ),
}


@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_random_configs_have_the_published_shapes(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    monkeypatch.setenv("NBKIT_CACHE", str(tmp_path))
    expected = dict(_PUBLISHED[name])
    low, high = expected.pop("params")
    config = load_config(name)
    text = config.get_text_config()
    assert {key: getattr(text, key) for key in expected} == expected
    assert text.vocab_size == 151936 and text.tie_word_embeddings == expected.get("tie_word_embeddings", True)
    if "vl" in name:
        vision = config.vision_config
        assert (vision.depth, vision.hidden_size, vision.num_heads, vision.patch_size) == (24, 1024, 16, 16)
        assert vision.out_hidden_size == text.hidden_size
        assert list(vision.deepstack_visual_indexes) == [5, 11, 17]
        # transformers 5 keeps M-RoPE's sections in rope_parameters, 4.x in rope_scaling
        rope = getattr(text, "rope_parameters", None) or text.rope_scaling
        assert rope["mrope_section"] == [24, 20, 20]
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    count = sum(p.numel() for p in model.parameters())
    assert low < count < high, f"{name}: {count / 1e9:.2f}B parameters"
    assert list(tmp_path.iterdir()) == []  # nothing was built


def test_load_config_of_a_local_checkpoint(tiny_vl_path: str) -> None:
    from_disk = load_config(tiny_vl_path)
    built = load_config("tiny:qwen3-vl")
    assert from_disk.to_dict()["text_config"] == built.to_dict()["text_config"]
    assert from_disk.image_token_id == built.image_token_id == TOKEN_IDS["<|image_pad|>"]


# ----------------------------------------------------------------------------------------------
# GPU hosts (pytest -m gpu): the real processor, random: weights at full size, unsloth.


@pytest.mark.gpu
def test_gpu_random_vl_model_builds_fast_and_trains() -> None:
    import time

    from transformers import AutoModelForImageTextToText, AutoProcessor

    start = time.perf_counter()
    path = resolve_model("random:qwen3-vl-2b")
    built_in = time.perf_counter() - start
    print(f"random:qwen3-vl-2b resolved in {built_in:.1f} s at {path}")
    assert built_in < 300, f"building 4.3 GB of random weights took {built_in:.0f} s"
    processor = load_processor(path)
    assert type(processor) is type(AutoProcessor.from_pretrained(path))  # torchvision host: the real one
    assert "Pil" not in type(processor.image_processor).__name__
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16, device_map={"": "cuda:0"})
    item = vision_dataset(1, image_size=256)[0]
    text = processor.apply_chat_template(item["messages"], tokenize=False)
    batch = processor(images=item["images"], text=[text], return_tensors="pt").to("cuda:0")
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == pytest.approx(math.log(151936), rel=0.1)


@pytest.mark.gpu
def test_gpu_unsloth_loads_the_tiny_models(tiny_text_path: str, tiny_vl_path: str) -> None:
    unsloth = pytest.importorskip("unsloth")

    model, tokenizer = unsloth.FastLanguageModel.from_pretrained(tiny_text_path, load_in_4bit=False, max_seq_length=256)
    model = unsloth.FastLanguageModel.get_peft_model(model, r=8, target_modules=["q_proj", "v_proj"])
    batch = tokenizer.apply_chat_template(
        [text_dataset(1)[0]["messages"]], tokenize=True, return_dict=True, return_tensors="pt"
    ).to("cuda")
    model(**batch, labels=batch["input_ids"]).loss.backward()

    model, processor = unsloth.FastVisionModel.from_pretrained(tiny_vl_path, load_in_4bit=False)
    model = unsloth.FastVisionModel.get_peft_model(model, r=8)
    item = vision_dataset(1)[0]
    text = processor.apply_chat_template(item["messages"], tokenize=False)
    batch = processor(images=item["images"], text=[text], return_tensors="pt").to("cuda")
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss)
