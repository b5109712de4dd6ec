"""The fsdp strategy on CPU: real gloo ranks (nbkit.launch with NBKIT_STRATEGY=fsdp), FSDP2 through
accelerate, the tiny Qwen3 in fp32 with LoRA.

In each launch every rank checks that it holds 1/N of the base weights, computes one step's loss and
LoRA gradients on its own sequences (normalised over the global batch as Trainer does across ranks),
and the parent compares them with a single process over the whole batch. Also: nbkit's savers under
FSDP, Trainer under FSDP, and the adapter saved from the sharded model loading in a plain process.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch
from test_savers import TOLERANCE, make_batch, relative_error, tiny_model, trainable_grads

import nbkit
from nbkit.training import fsdp

FSDP_ENV = {fsdp.STRATEGY_VARIABLE: "fsdp"}


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


# Sequence lengths of each rank's batch: the ranks differ in shape and token count.
LENGTHS = {0: [24, 17], 1: [30], 2: [20], 3: [16, 12]}


def _batches(model: torch.nn.Module, world: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    batches = [make_batch(model, LENGTHS[rank], seed=rank) for rank in range(world)]
    # transformers' causal-LM loss predicts labels[1:] from positions [:-1].
    items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    return batches, items


def _frozen_numel(model: torch.nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the full model) over the frozen base weights."""
    from torch.distributed.tensor import DTensor

    local = full = 0
    for p in model.parameters():
        if not p.requires_grad:
            local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
            full += p.numel()
    return local, full


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
        for name, g in ((n, p.grad) for n, p in model.named_parameters() if p.requires_grad)
    }


def _sharded_step(adapter_dir: str | None, savers: dict | None, device_type: str = "cpu") -> dict:
    """In each rank: load, shard, one forward/backward on this rank's batch; gathered to every rank.
    device_type "cuda": NCCL, the rank's GPU, fp32 without TF32 (tests/test_fsdp_gpu.py)."""
    import torch.distributed as dist

    from nbkit.training import savers as nbkit_savers

    device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0")) if device_type == "cuda" else None)
    if device_type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model("qwen3").to(device)
    if savers is not None:
        nbkit_savers.apply(model, **savers)
    batches, items = _batches(model, world)
    batch = {k: v.to(device) for k, v in batches[rank].items()}
    model = fsdp.shard(model)
    held, full = _frozen_numel(model)
    loss = model(**batch, num_items_in_batch=items, use_cache=False).loss
    (loss * world).backward()  # FSDP averages the gradients over the ranks, as DDP does
    mine = {"held": held, "full": full, "loss": loss.item(), "class": type(model).__name__}
    grads = {name: g.cpu() for name, g in _full_grads(model).items()}
    if adapter_dir is not None:
        fsdp.save_adapter(model, adapter_dir)
        # what save_adapter gathers to rank 0: parameter names only (a 4-bit base would be gigabytes)
        mine["gathered"] = sorted(k for k in fsdp._saved_state_dict(model) if "rotary" not in k)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            mine["logits"] = model(input_ids=batches[0]["input_ids"]).logits.detach()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone, "grads": grads}


def _reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = tiny_model("qwen3")
    batches, items = _batches(model, world)
    losses = []
    for batch in batches:
        loss = model(**batch, num_items_in_batch=items).loss
        loss.backward()
        losses.append(loss.item())
    return losses, trainable_grads(model)


def _check_against_reference(result: dict, world: int, tolerance: float = TOLERANCE) -> None:
    losses, reference = _reference(world)
    for rank, info in enumerate(result["ranks"]):
        assert info["class"].startswith("FSDP"), info["class"]
        # Each rank holds its 1/N of every base weight (dim-0 shards: at most one row more than an equal split).
        assert info["full"] / world * 0.95 <= info["held"] <= info["full"] / world * 1.1, (rank, info)
        assert info["loss"] == pytest.approx(losses[rank], rel=tolerance)
    assert sum(info["held"] for info in result["ranks"]) == result["ranks"][0]["full"]
    grads = {name.replace("_checkpoint_wrapped_module.", ""): g for name, g in result["grads"].items()}
    assert grads.keys() == reference.keys()
    for name, grad in grads.items():
        assert relative_error(grad, reference[name]) < tolerance, name


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_its_share_and_gradients_equal_one_process(world):
    result = nbkit.launch(_sharded_step, None, None, gpus=world, env=FSDP_ENV, timeout=300)
    _check_against_reference(result, world)


@pytest.mark.parametrize(
    ("savers", "accelerate_checkpointing"),
    [
        # nbkit's offloaded checkpointing in place of accelerate's (which is turned off)
        (dict(checkpointing="offload", tiled_mlp=3, chunked_loss=True), "false"),
        # accelerate's checkpointing (nbkit's default fsdp set-up) with the tiled MLP and the chunked loss
        (dict(checkpointing=None, tiled_mlp=3, chunked_loss=True), "true"),
    ],
    ids=["offload", "fsdp-checkpointing"],
)
def test_savers_under_fsdp_give_the_reference_gradients(savers, accelerate_checkpointing):
    env = {**FSDP_ENV, "FSDP_ACTIVATION_CHECKPOINTING": accelerate_checkpointing}
    result = nbkit.launch(_sharded_step, None, savers, gpus=2, env=env, timeout=300)
    _check_against_reference(result, 2)


def test_adapter_saved_from_shards_loads_in_one_process_with_the_same_outputs(tmp_path):
    from peft import PeftModel

    result = nbkit.launch(_sharded_step, str(tmp_path), None, gpus=2, env=FSDP_ENV, timeout=300)
    assert sorted(os.listdir(tmp_path)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    base = tiny_model("qwen3", lora=False)
    loaded = PeftModel.from_pretrained(base, str(tmp_path))
    batch = make_batch(loaded, LENGTHS[0], seed=0)
    with torch.no_grad():
        logits = loaded(input_ids=batch["input_ids"]).logits
    assert relative_error(logits, result["ranks"][0]["logits"]) < TOLERANCE
    # Only the trainable (LoRA) weights travel to rank 0, not the frozen base's shards; torch keeps one frozen
    # weight, the output layer that tiny Qwen3 ties to its embeddings (a second name for a parameter).
    gathered = result["ranks"][0]["gathered"]
    lora = [k for k in gathered if "lora_" in k]
    assert set(gathered) - set(lora) <= {"base_model.model.lm_head.weight"}, gathered
    assert len(lora) == sum(p.requires_grad for p in tiny_model("qwen3").parameters())
    assert result["ranks"][1]["gathered"] == []


def test_saves_leave_the_frozen_weights_out_only_where_every_adapter_trains():
    """A save gathers the trainable weights alone for a peft model whose frozen weights are its base; a second,
    inactive adapter (frozen) or a model without adapters keeps every parameter in the save."""
    from peft import LoraConfig

    model = tiny_model("qwen3")
    assert fsdp._only_the_base_is_frozen(model)
    model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj"]))  # added inactive: frozen
    assert not fsdp._only_the_base_is_frozen(model)
    assert not fsdp._only_the_base_is_frozen(tiny_model("qwen3", lora=False))


def _generated_without_adapter_then_saved(adapter_dir: str) -> dict:
    """In each rank: shard, a forward without grad inside peft's disable_adapter() (what a notebook's "before"
    answers do), then save_adapter; which LoRA weights are frozen in the sharded model afterwards."""
    model = fsdp.shard(tiny_model("qwen3"))
    batch = make_batch(model, [12], seed=0)
    with torch.no_grad(), model.disable_adapter():
        model(input_ids=batch["input_ids"], use_cache=False)
    fsdp.save_adapter(model, adapter_dir)
    fsdp._reshard(model)  # the sharded weights, whatever save_adapter left gathered
    return {"frozen_lora": [n for n, p in model.named_parameters() if "lora_" in n and not p.requires_grad]}


def test_adapter_switched_off_for_a_forward_trains_and_saves_whole_afterwards(tmp_path):
    """peft's disable_adapter() switches requires_grad off and on again on the weights each module holds; the
    last decoder layer, kept gathered after a forward for its backward, must not keep its sharded LoRA weights
    frozen after a forward without grad, and the saved adapter has every LoRA weight."""
    from safetensors.torch import load_file

    result = nbkit.launch(_generated_without_adapter_then_saved, str(tmp_path), gpus=2, env=FSDP_ENV, timeout=300)
    assert result["frozen_lora"] == []
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert len(saved) == sum(p.requires_grad for p in tiny_model("qwen3").parameters())


def _trainer_run(path: str, out: str) -> dict:
    from tiny_training import saving_trainer

    trainer = saving_trainer(path, out, samples=8, max_steps=3, logging_steps=1, save_strategy="no")
    trainer.train()
    trainer.save_model(out)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    # what Trainer's saves gather to rank 0 (names only)
    gathered = sorted(k for k in trainer.accelerator.get_state_dict(trainer.model) if "rotary" not in k)
    return {
        "class": type(trainer.model_wrapped).__name__,
        "losses": losses,
        "fsdp": trainer.is_fsdp_enabled,
        "gathered": gathered,
    }


def test_trainer_trains_sharded_and_saves_the_adapter(tiny_text_path, tmp_path):
    result = nbkit.launch(_trainer_run, tiny_text_path, str(tmp_path), gpus=2, env=FSDP_ENV, timeout=300)
    assert result["fsdp"] and result["class"].startswith("FSDP"), result
    assert len(result["losses"]) == 3 and all(torch.isfinite(torch.tensor(result["losses"])))
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved and all("lora_" in key and "_checkpoint_wrapped_module" not in key for key in saved), list(saved)
    # Trainer's saves gathered the adapter (and the output layer tied to the embeddings), not the frozen base.
    lora = [k for k in result["gathered"] if "lora_" in k]
    assert len(lora) == len(saved) and set(result["gathered"]) - set(lora) <= {"base_model.model.lm_head.weight"}


def _sharding_watched() -> dict:
    """In each rank: shard the tiny model, noting at the root's sharding (the last unit accelerate shards) which
    frozen base weights as loaded are still alive, and which layer each decoder layer prefetches."""
    import weakref

    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.tensor import DTensor

    model = tiny_model("qwen3")
    loaded = {name: weakref.ref(p) for name, p in model.named_parameters() if not p.requires_grad}
    alive: list[list[str]] = []
    original = torch_fsdp.fully_shard

    def watching(module, *args, **kwargs):
        if module is model:
            alive.append([name for name, ref in loaded.items() if ref() is not None])
        return original(module, *args, **kwargs)

    torch_fsdp.fully_shard = watching  # accelerate imports fully_shard from here when it prepares
    try:
        sharded = fsdp.shard(model)
    finally:
        torch_fsdp.fully_shard = original
    layers = fsdp._weight_units(fsdp._decoder_layer_units(sharded))
    states = [layer._get_fsdp_state() for layer in layers]
    prefetched = [[states.index(s) for s in state._states_to_forward_prefetch] for state in states]
    policy = states[0]._mp_policy
    batch = make_batch(sharded, [12], seed=0)
    loss = sharded(**batch, use_cache=False).loss
    loss_dtype = str(loss.dtype)
    # Between the forward and the backward: which layers still hold their gathered (plain, not sharded) weights.
    gathered = [not any(isinstance(p, DTensor) for p in layer.parameters()) for layer in layers]
    loss.backward()
    return {
        "alive": alive,
        "loaded": sorted(loaded),
        "prefetched": prefetched,
        "dtypes": (str(policy.param_dtype), str(policy.reduce_dtype), str(policy.output_dtype), loss_dtype),
        "gathered_after_forward": gathered,
        "layers": sharded.config.num_hidden_layers,
    }


def test_sharding_frees_the_loaded_weights_as_it_goes_and_prefetches_the_next_layer():
    """Without efficient loading (a 4-bit model's case: each rank loads the whole model on its GPU), no rank holds
    every loaded layer and all their shards at once; in the forward each layer gathers the next one's weights and
    the last keeps its own for the backward; under 16-bit mixed precision the gradients are reduced in fp32."""
    env = {**FSDP_ENV, "FSDP_CPU_RAM_EFFICIENT_LOADING": "false", "ACCELERATE_MIXED_PRECISION": "bf16"}
    result = nbkit.launch(_sharding_watched, gpus=2, env=env, timeout=300)
    assert any(".layers." in name for name in result["loaded"])
    (alive,) = result["alive"]
    # What the root shards itself (the final norm) and the embeddings accelerate holds while it finishes.
    assert all(".layers." not in name for name in alive), alive
    layers = result["layers"]
    assert layers >= 2 and result["prefetched"] == [[i + 1] for i in range(layers - 1)] + [[]]
    # computed in bf16, gradients reduced in fp32, and the loss kept in the fp32 it is computed in (not cast to bf16)
    assert result["dtypes"] == ("torch.bfloat16", "torch.float32", "None", "torch.float32")
    # The last layer keeps its gathered weights from its forward into its backward, which follows at once.
    assert result["gathered_after_forward"] == [False] * (layers - 1) + [True]


def _steps_with_units(accelerates_units: bool) -> dict:
    """In each rank: shard the tiny model (accelerate's checkpointing on, as nbkit sets it up) with nbkit's units,
    or with accelerate's own where `accelerates_units`; two optimizer steps on this rank's batch, with gradient
    clipping. Returns the units, the losses, the clipped gradients and the trained LoRA weights (gathered)."""
    import accelerate.utils.fsdp_utils  # noqa: F401  (nbkit's patch of it is applied on import)
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if accelerates_units:
        fsdp._OUTERMOST_UNITS.revert()
    model = tiny_model("qwen3")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sharded = fsdp.shard(model, optimizer)
    batches, items = _batches(sharded, dist.get_world_size())
    losses, norms = [], []
    for _ in range(2):
        loss = sharded(**batches[dist.get_rank()], num_items_in_batch=items, use_cache=False).loss
        (loss * dist.get_world_size()).backward()
        norms.append(torch.nn.utils.clip_grad_norm_([p for p in sharded.parameters() if p.requires_grad], 0.5))
        grads = _full_grads(sharded)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "units": [type(m).__name__ for m in sharded.modules() if isinstance(m, FSDPModule)],
        "losses": losses,
        "norms": [float(n.full_tensor() if hasattr(n, "full_tensor") else n) for n in norms],
        "grads": grads,
        "weights": {name: w.full_tensor() for name, w in sharded.named_parameters() if w.requires_grad},
    }


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_each_checkpointed_layer_is_one_unit_and_trains_as_accelerates_two_do(precision):
    """accelerate 1.15 makes a checkpointed layer two FSDP units (its checkpoint wrapper and the layer inside); nbkit makes
    the wrapper its one unit, whose hooks then run once per layer and forward. The same weights are gathered and
    reduced in the same order: losses, clipped gradients and trained weights are identical, in fp32 and under
    FSDP's bf16 mixed precision (inputs cast once by the wrapper, where the layer cast them again)."""
    env = {**FSDP_ENV, "ACCELERATE_MIXED_PRECISION": precision}
    ours = nbkit.launch(_steps_with_units, False, gpus=2, env=env, timeout=300)
    theirs = nbkit.launch(_steps_with_units, True, gpus=2, env=env, timeout=300)
    layers = tiny_model("qwen3").config.num_hidden_layers
    # one unit per layer: its wrapper where accelerate's policy looks through wrappers (1.15), else the layer (1.12)
    wrappers = ours["units"].count("FSDPCheckpointWrapper")
    assert wrappers + ours["units"].count("FSDPQwen3DecoderLayer") == layers and wrappers in (0, layers)
    if wrappers:  # accelerate's own policy made two units of each layer there
        assert theirs["units"].count("FSDPCheckpointWrapper") == theirs["units"].count("FSDPQwen3DecoderLayer")
        assert len(theirs["units"]) - len(ours["units"]) == layers
    else:
        assert theirs["units"] == ours["units"]
    assert ours["losses"] == theirs["losses"] and ours["norms"] == theirs["norms"]
    assert ours["losses"][1] != ours["losses"][0]  # the first step changed the weights
    for kind in ("grads", "weights"):
        assert ours[kind].keys() == theirs[kind].keys()
        for name, value in ours[kind].items():
            assert torch.equal(value, theirs[kind][name]), (kind, name)


def test_settings_are_accelerates_fsdp2_environment():
    env = fsdp.FsdpSettings().environment()
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    assert fsdp.FsdpSettings(activation_checkpointing=False).environment()["FSDP_ACTIVATION_CHECKPOINTING"] == "false"


def test_shard_outside_an_fsdp_rank_says_how_to_start_one(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(nbkit.NbkitError, match="fsdp strategy"):
        fsdp.shard(torch.nn.Linear(2, 2))


def test_save_merged_says_why_not_and_what_to_do():
    with pytest.raises(nbkit.NbkitError, match="merge_and_unload"):
        fsdp.save_merged(torch.nn.Linear(2, 2), "out")


def _recording_loader(calls: list) -> object:
    def from_pretrained(model_name, device_map=None, load_in_4bit=True, **kwargs):
        calls.append(device_map)
        return "loaded"

    return from_pretrained


@pytest.mark.parametrize("loader", ["transformers", "unsloth"])
def test_guard_in_an_fsdp_rank_loads_for_sharding_and_refuses_unsloth(monkeypatch, loader):
    from nbkit.training import guard

    monkeypatch.setenv(fsdp.STRATEGY_VARIABLE, "fsdp")
    calls: list = []
    wrapped = guard._guarded(guard._UNSLOTH if loader == "unsloth" else guard._TRANSFORMERS)(_recording_loader(calls))
    if loader == "unsloth":
        with pytest.raises(nbkit.errors.StrategyError, match="transformers \\+ peft") as caught:
            wrapped("some/model", device_map="balanced")
        assert isinstance(caught.value, nbkit.NbkitError) and calls == []
        return
    # 16-bit: on CPU whatever was asked (rank 0 reads, accelerate shards onto the GPUs); 4-bit: the rank's device.
    assert wrapped("some/model", device_map="balanced", load_in_4bit=False) == "loaded"
    assert wrapped("some/model", device_map="auto", quantization_config=object()) == "loaded"
    assert calls == [None, {"": "cpu"}]


@pytest.mark.parametrize(
    ("model", "gpus", "host", "offload"),
    [
        ("random:qwen3-14b", 2, False, False),  # 9.3 GiB in 4-bit: loads whole, trains sharded on the GPUs
        ("random:qwen3-32b", 4, True, False),  # 18.4 GiB in 4-bit: over a T4 while loading, not once sharded over 4
        ("random:qwen3-32b", 2, True, True),  # over 2 T4s even sharded, and too big to split: the shards offloaded
    ],
)
def test_guard_in_an_fsdp_rank_loads_on_the_host_and_offloads_where_the_plan_needs_it(
    monkeypatch, capsys, tmp_path, model, gpus, host, offload
):
    """Under the T4 profile (15 GiB): the guard asks the planner about the model over all the ranks, keeps the 4-bit
    weights on the host while loading where the whole model would not fit a GPU, and turns FSDP's CPU offload on
    (FSDP_OFFLOAD_PARAMS, which accelerate reads when Trainer makes its Accelerator) where FSDP fits only that way,
    saying so on rank 0; a value the user set is kept."""
    from nbkit.training import guard

    for name, value in {
        fsdp.STRATEGY_VARIABLE: "fsdp",
        "NBKIT_EMULATE": "T4",
        "WORLD_SIZE": str(gpus),
        "RANK": "0",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(fsdp.OFFLOAD_VARIABLE, "")  # unset for accelerate, and put back as it was afterwards
    _machine_memory(monkeypatch, tmp_path, 64)
    loads: list = []
    monkeypatch.setattr(fsdp, "load_4bit_on_host", lambda load: loads.append("host") or load())

    def from_pretrained(pretrained_model_name_or_path, *args, device_map=None, **kwargs):
        return "loaded"

    wrapped = guard._guarded(guard._TRANSFORMERS)(from_pretrained)
    assert wrapped(model, quantization_config=object()) == "loaded"
    assert loads == (["host"] if host else [])
    assert (os.environ.get(fsdp.OFFLOAD_VARIABLE) == "true") is offload
    said = capsys.readouterr().out
    assert ("FSDP's CPU offload is on (FSDP_OFFLOAD_PARAMS=true" in said) is offload, said
    if offload:
        # A live set's rank keeps its environment: a later load of a model that fits takes nbkit's choice back...
        wrapped("random:qwen3-14b", quantization_config=object())
        assert not os.environ.get(fsdp.OFFLOAD_VARIABLE)
        # ... and the user's choice wins, either way.
        monkeypatch.setenv(fsdp.OFFLOAD_VARIABLE, "false")
        wrapped(model, quantization_config=object())
        assert os.environ[fsdp.OFFLOAD_VARIABLE] == "false"
        monkeypatch.setenv(fsdp.OFFLOAD_VARIABLE, "true")
        wrapped("random:qwen3-14b", quantization_config=object())
        assert os.environ[fsdp.OFFLOAD_VARIABLE] == "true"
    # 16-bit weights load in CPU memory anyway: never on the host as 4-bit rows
    loads.clear()
    wrapped("random:qwen3-14b", load_in_4bit=False)
    assert loads == []


def _machine_memory(monkeypatch: pytest.MonkeyPatch, tmp_path, gib: float) -> None:
    """Make nbkit.platform.host read a machine of `gib` GiB and no container limit."""
    from nbkit.platform import host

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {int(gib * 2**20)} kB\nMemFree:        1024 kB\n")
    monkeypatch.setattr(host, "MEMINFO", meminfo)
    monkeypatch.setattr(host, "CGROUP_LIMITS", (tmp_path / "no-cgroup",))


@pytest.mark.parametrize("gib", [16, 26])
def test_guard_refuses_an_fsdp_load_the_machines_memory_cannot_hold(monkeypatch, capsys, tmp_path, gib):
    """Qwen3-32B in 4-bit on 2 T4s trains only with its shards offloaded, 22.8 GiB of pinned CPU memory on the
    machine (torch rounds each shard up to a power of two): on a 16 GiB machine the load is refused before it
    starts, naming the figures and what to do; on 26 GiB rank 0 says the run is at the machine's edge."""
    from nbkit.training import guard

    for name, value in {fsdp.STRATEGY_VARIABLE: "fsdp", "NBKIT_EMULATE": "T4", "WORLD_SIZE": "2", "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(fsdp.OFFLOAD_VARIABLE, "")
    _machine_memory(monkeypatch, tmp_path, gib)
    monkeypatch.setattr(fsdp, "load_4bit_on_host", lambda load: load())
    loads: list = []

    def from_pretrained(pretrained_model_name_or_path, *args, **kwargs):
        loads.append(pretrained_model_name_or_path)
        return "loaded"

    wrapped = guard._guarded(guard._TRANSFORMERS)(from_pretrained)
    if gib == 16:
        with pytest.raises(nbkit.errors.StrategyError) as refused:
            wrapped("random:qwen3-32b", quantization_config=object())
        message = str(refused.value)
        assert "needs about 22.8 GiB of CPU memory" in message and "this machine gives 16.0 GiB" in message
        assert "more GPUs" in message and "nbkit.plan(" in message and loads == []
        return
    assert wrapped("random:qwen3-32b", quantization_config=object()) == "loaded"
    said = capsys.readouterr().out
    assert "needs about 22.8 GiB of CPU memory" in said and "this machine gives 26.0 GiB" in said, said
    assert "at the edge of its memory" in said


def test_the_machines_memory_is_its_containers_where_that_is_lower(monkeypatch, tmp_path):
    from nbkit.platform import host

    _machine_memory(monkeypatch, tmp_path, 64)
    assert host.memory_gib() == 64
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(host, "CGROUP_LIMITS", (limit,))
    for text, expected in (("max\n", 64), (f"{30 * 2**30}\n", 30), (f"{2**62}\n", 64)):
        limit.write_text(text)
        assert host.memory_gib() == expected


def test_unsloth_error_names_the_transformers_way():
    message = str(fsdp.unsloth_error())
    assert "no FSDP" in message and "qlora_config()" in message and "ddp strategy" in message


@pytest.mark.parametrize(
    ("capability", "expected"), [((7, 5), torch.float16), ((8, 0), torch.bfloat16), (None, torch.bfloat16)]
)
def test_fsdp_computes_in_fp16_on_t4s_and_bf16_elsewhere(monkeypatch, capability, expected):
    from nbkit.platform import distributed

    gpus = [] if capability is None else [distributed.GPU(0, "GPU", 15.0, capability)]
    monkeypatch.setattr(distributed, "visible_gpus", lambda: gpus)
    assert fsdp.compute_dtype() == expected


@pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None and transformers_major() < 5,
    reason="transformers 4.x's BitsAndBytesConfig needs bitsandbytes installed",
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qlora_settings_store_4bit_weights_in_the_compute_dtype(dtype):
    config = fsdp.qlora_config(dtype)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    # FSDP shards floating-point storage only, and one unit's parameters must share a dtype.
    assert config.bnb_4bit_quant_storage == config.bnb_4bit_compute_dtype == dtype


def _qlora_shards(path: str, out: str) -> dict:
    """In each rank: load the tiny Qwen3 in 4-bit as an fsdp rank does, try a forward, shard, and save this rank's
    shards of the 4-bit weights (as their bytes: packed codes stored as bf16 read as NaN at times); every rank's
    results, gathered."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=fsdp.qlora_config(dtype), dtype=dtype, device_map="auto"
    )
    on_host = sum(bool(getattr(p, "_nbkit_rows_on_host", False)) for p in model.parameters())
    ids = torch.arange(8, 40).reshape(2, 16)
    try:
        model(input_ids=ids)
        refused = ""
    except nbkit.StrategyError as exc:
        refused = str(exc)
    model = fsdp.shard(model)
    shards = {n: p.to_local().view(torch.int16).clone() for n, p in model.named_parameters() if isinstance(p, DTensor)}
    # Each shard's padded storage, what FSDP2's CPU offload pins parameter by parameter (read before the forward, which
    # leaves the root's and the last layer's weights gathered for the backward).
    shard_bytes = sorted(p.to_local().untyped_storage().nbytes() for p in model.parameters() if isinstance(p, DTensor))
    torch.save(shards, f"{out}-{dist.get_rank()}.pt")
    mine = {
        "on_host": on_host,
        "refused": refused,
        "loss": model(input_ids=ids, labels=ids).loss.item(),
        "shard_bytes": shard_bytes,
    }
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


@pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None or transformers_major() < 5,
    reason="needs bitsandbytes (its CPU backend) and transformers 5's conversion of 4-bit weights while loading",
)
def test_a_4bit_load_on_the_host_gives_each_rank_the_shards_of_a_whole_load(tiny_text_path, tmp_path):
    """The fsdp_4bit_load setting: "host" keeps only each rank's rows of the quantised weights and refuses a forward
    before sharding, naming what to do; once sharded, every rank holds the same bytes as after a whole load ("gpu")
    and computes the same loss."""
    from transformers import AutoConfig

    from nbkit.notebook import planner

    results = {}
    for where in ("gpu", "host"):
        env = {**FSDP_ENV, "NBKIT_FSDP_4BIT_LOAD": where}
        results[where] = nbkit.launch(
            _qlora_shards, tiny_text_path, str(tmp_path / where), gpus=2, env=env, timeout=300
        )
    for rank in range(2):
        whole, host = results["gpu"][rank], results["host"][rank]
        assert whole["on_host"] == 0 and not whole["refused"]
        assert host["on_host"] == 14  # the 7 linear layers of each of the 2 decoder layers
        assert "cannot run until it is sharded" in host["refused"] and "nbkit.fsdp.shard(model)" in host["refused"]
        assert host["loss"] == whole["loss"]
        expected, got = (torch.load(tmp_path / f"{where}-{rank}.pt") for where in ("gpu", "host"))
        assert expected.keys() == got.keys() and any("proj" in name for name in expected)
        for name, shard in expected.items():
            assert torch.equal(shard, got[name]), (rank, name)
        # The planner's count of what each rank's shards take (its CPU memory under offload) is FSDP2's own.
        frozen, _ = planner._shards(AutoConfig.from_pretrained(tiny_text_path), 16, 2)
        assert host["shard_bytes"] == whole["shard_bytes"] == sorted(frozen)


def test_fsdp_vs_balanced_script_runs_on_cpu_ranks(tmp_path):
    """benchmarks/fsdp_vs_balanced.py on the CPU: FSDP on 2 gloo ranks and the balanced process, rows with the
    harness's median, losses that fall, and a table."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import fsdp_vs_balanced

    out, md = tmp_path / "rows.json", tmp_path / "rows.md"
    argv = ["--model", "tiny:qwen3", "--gpus", "2", "--16bit", "--seq-len", "32", "--steps", "4", "--warmup", "1"]
    argv += ["--profile-dir", str(tmp_path / "profile"), "--memory-steps", "1"]
    assert fsdp_vs_balanced.main([*argv, "--modes", "fsdp,balanced", "--out", str(out), "--md", str(md)]) == 0
    fsdp_row, balanced = [json.loads(line) for line in out.read_text().splitlines()]
    for row, mode in ((fsdp_row, "fsdp"), (balanced, "balanced")):
        assert row["status"] == "ok" and row["mode"] == mode and row["tokens_per_s"] > 0
        assert row["step_stats"]["median"] == row["median_step_s"] and row["planned_gib"] > 0
        assert len(row["losses"]) == 4 and row["trains"], row["losses"]
        assert f"| {mode} | tiny:qwen3 | 2 |" in md.read_text()
        # The last step is profiled (and left out of the median).
        assert all(p is not None and "error" not in p and p["step_ms"] > 0 for p in row["profile"]), row["profile"]
        assert (tmp_path / "profile" / f"{mode}.txt").is_file()
        assert row["at_peak"] == [{}] * (2 if mode == "fsdp" else 1)  # the allocator's history is CUDA's only
    # The same sequences per optimizer step: two FSDP ranks train as the one balanced process does.
    assert fsdp_row["losses"] == pytest.approx(balanced["losses"], rel=1e-4)
    assert fsdp_row["grad_norms"] == pytest.approx(balanced["grad_norms"], rel=1e-3)
    same = fsdp_vs_balanced.agreement(fsdp_row, balanced)
    assert abs(same["first_loss_difference"]) < 1e-4 and same["skipped"] == (0, 0)
    assert same["grad_norm_ratio"] == pytest.approx(1, rel=1e-3)
    assert re.search(r"The same training\? First loss [+-]0\.00%", md.read_text())
