"""nbkit.savers.unsloth: feature detection of unsloth's DDP-safe savers, and the fixes where they are missing.

unsloth cannot run here (it needs a GPU), so:
- the detectors are checked on the real sources of unsloth releases, read from their wheels without
  importing anything. Wheels are looked for in $NBKIT_UNSLOTH_WHEELS and the repository's .whl/
  (fill either with `pip download --no-deps unsloth==V unsloth_zoo==V -d DIR`); releases whose
  expected features are listed below (the table of docs/unsloth_patches.md) are asserted;
- the patches are checked end to end on a stand-in package written here (our own few lines with the
  shapes of the buggy code: a TiledMLP whose backward calls .backward() per shard, a fused loss that
  refuses tensors on two devices), imported after nbkit.install() so the import hook applies them.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
import types
import zipfile
from pathlib import Path

import pytest
import torch

from nbkit.platform import compat, patch_groups, patching
from nbkit.training.savers import unsloth as fixes

# release -> (fused loss moves hidden states, TiledMLP backprops per shard, unsloth replaces TiledMLP.apply,
#             unsloth chooses ddp_find_unused_parameters): what docs/unsloth_patches.md states.
EXPECTED = {
    "2025.12.8": (False, True, False, False),
    "2026.1.4": (False, True, False, False),
    "2026.3.7": (False, True, False, False),
    "2026.5.5": (True, True, False, False),
    "2026.6.7": (True, True, False, False),
    "2026.8.17": (True, True, False, False),
    "2026.9.9": (True, True, False, False),
    "2026.10.9": (True, True, True, True),
}


def _wheels() -> dict[str, dict[str, Path]]:
    """version -> {"unsloth": wheel, "unsloth_zoo": wheel} for releases with both wheels available."""
    dirs = [os.environ.get("NBKIT_UNSLOTH_WHEELS"), str(Path(__file__).resolve().parents[1] / ".whl")]
    found: dict[str, dict[str, Path]] = {}
    for d in filter(None, dirs):
        for wheel in Path(d).glob("unsloth*.whl"):
            m = re.match(r"(unsloth(?:_zoo)?)-([0-9.]+)-", wheel.name)
            if m:
                found.setdefault(m.group(2), {})[m.group(1)] = wheel
    return {v: w for v, w in found.items() if len(w) == 2}


WHEELS = _wheels()
TRAINER = "transformers.trainer:Trainer._build_accelerator_args"
# Trainer._build_accelerator_args, where nbkit sets find_unused_parameters, is transformers 5's.
needs_transformers_5 = pytest.mark.skipif(
    compat.transformers_major() < 5,
    reason="the find_unused_parameters patch targets Trainer._build_accelerator_args (transformers 5); "
    "on 4.x fix 4 stays off instead (test_on_transformers_4_unsloth_keeps_its_ddp_checkpointing)",
)


@pytest.mark.parametrize(
    "version", sorted(WHEELS) or [pytest.param("none", marks=pytest.mark.skip("no unsloth wheels"))]
)
def test_detection_on_real_releases(version):
    zoo = zipfile.ZipFile(WHEELS[version]["unsloth_zoo"])
    main = zipfile.ZipFile(WHEELS[version]["unsloth"])
    models = [
        main.read(n).decode("utf-8", "replace") for n in main.namelist() if re.fullmatch(r"unsloth/models/[^/]+\.py", n)
    ]
    assert models, "an unsloth wheel without unsloth/models/*.py"
    found = (
        fixes.fused_loss_moves_hidden_states(zoo.read("unsloth_zoo/fused_losses/cross_entropy_loss.py").decode()),
        fixes.tiled_backward_runs_backward_per_shard(zoo.read("unsloth_zoo/tiled_mlp.py").decode()),
        # Parsing only the files that name the feature, as the runtime check does.
        any(fixes.replaces_tiled_mlp_apply(s) for s in models if "TiledMLP" in s),
        any(fixes.sets_ddp_find_unused_parameters(s) for s in models if "ddp_find_unused_parameters" in s),
    )
    if version not in EXPECTED:
        pytest.skip(f"unsloth {version} is not in the table; detected {found}: add it to docs/unsloth_patches.md")
    assert found == EXPECTED[version]


def test_detectors_on_both_shapes_of_code():
    moved = """
def unsloth_fused_ce_loss(trainer, hidden_states, lm_head_weight, *args):
    if hidden_states.device != lm_head_weight.device:
        hidden_states = hidden_states.to(device=lm_head_weight.device)
    return run(hidden_states)
"""
    inline = """
def unsloth_fused_ce_loss(trainer, hidden_states, lm_head_weight, *args):
    return run(hidden_states.to(lm_head_weight.device))
def other(hidden_states):
    hidden_states = hidden_states.to("cuda")
"""
    assert fixes.fused_loss_moves_hidden_states(moved)
    assert not fixes.fused_loss_moves_hidden_states(inline)  # inside the transform, or another function
    assert not fixes.fused_loss_moves_hidden_states("def broken(:")

    per_shard = "class TiledMLP:\n    def backward(ctx, g):\n        for x in xs:\n            torch.autograd.backward(f(x), g)\n"
    summed = "class TiledMLP:\n    def backward(ctx, g):\n        for x in xs:\n            gs = torch.autograd.grad(f(x), params, g)\n        out.backward = 1\n"
    assert fixes.tiled_backward_runs_backward_per_shard(per_shard)
    assert not fixes.tiled_backward_runs_backward_per_shard(summed)
    assert fixes.replaces_tiled_mlp_apply("def fix():\n    TiledMLP.apply = staticmethod(mine)\n")
    assert not fixes.replaces_tiled_mlp_apply("x = TiledMLP.apply(f, m, x)\n")
    assert fixes.sets_ddp_find_unused_parameters("def f(args):\n    args.ddp_find_unused_parameters = False\n")
    assert not fixes.sets_ddp_find_unused_parameters("names = ('ddp_find_unused_parameters',)\n")


# -------------------------------------------------------------------------------- stand-in unsloth

_FUSED_LOSS = """
import torch

class UnslothFusedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss_function, hidden_states, lm_head_weight, lm_head_bias, labels, mask=None, n_items=None):
        devices = {t.device for t in (hidden_states, lm_head_weight, labels)}
        if len(devices) > 1:
            raise RuntimeError("Cannot access storage of TensorWrapper")
        return (hidden_states.sum() + lm_head_weight.sum()).float()

    @staticmethod
    def backward(ctx, grad):
        return (None,) * 7

def unsloth_fused_ce_loss(trainer, hidden_states, lm_head_weight, lm_head_bias, labels, mask=None, n_items=None):
    {move}
    return UnslothFusedLoss.apply(None, hidden_states, lm_head_weight, lm_head_bias, labels, mask, n_items)
"""

_TILED_MLP = """
import torch

class TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mlp_forward, mlp_module, x, preserve_rng_state, num_shards, max_flat_qlen):
        ctx.mlp_forward, ctx.num_shards = mlp_forward, num_shards
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([mlp_forward(p) for p in x.chunk(num_shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        grads = []
        for piece, g in zip(x.chunk(ctx.num_shards, dim=-2), grad.chunk(ctx.num_shards, dim=-2)):
            piece = piece.detach().requires_grad_()
            with torch.enable_grad():
                torch.autograd.backward(ctx.mlp_forward(piece), g)
            grads.append(piece.grad)
        return None, None, torch.cat(grads, dim=-2), None, None, None
"""

_DDP_DEFAULTS = """
def choose(args):
    args.ddp_find_unused_parameters = False

def patch_tiled():
    from unsloth_zoo.tiled_mlp import TiledMLP
    TiledMLP.apply = staticmethod(lambda *a: None)
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """Writes a stand-in unsloth_zoo / unsloth; yields a function (fixed: bool) -> tmp root; cleans up."""

    def make(fixed: bool) -> Path:
        move = "hidden_states = hidden_states.to(lm_head_weight.device)" if fixed else "pass"
        files = {
            "unsloth_zoo/__init__.py": "",
            "unsloth_zoo/fused_losses/__init__.py": "",
            "unsloth_zoo/fused_losses/cross_entropy_loss.py": _FUSED_LOSS.replace("{move}", move),
            "unsloth_zoo/tiled_mlp.py": _TILED_MLP,
            "unsloth/__init__.py": "",
            "unsloth/models/__init__.py": "",
        }
        if fixed:
            files["unsloth/models/_ddp_defaults.py"] = _DDP_DEFAULTS
        _write(tmp_path, files)
        monkeypatch.syspath_prepend(str(tmp_path))
        return tmp_path

    yield make
    patch_groups.uninstall()
    for name in [n for n in sys.modules if n.split(".")[0] in ("unsloth", "unsloth_zoo")]:
        del sys.modules[name]
    fixes._unsloth_ships.cache_clear()
    fixes._forward_parameters.cache_clear()


def _import_stand_in() -> tuple[types.ModuleType, types.ModuleType]:
    import unsloth  # noqa: F401  (the stand-in)
    from unsloth_zoo import tiled_mlp
    from unsloth_zoo.fused_losses import cross_entropy_loss

    return cross_entropy_loss, tiled_mlp


def _tiled_weight_grads(tiled_mlp: types.ModuleType) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """Runs the stand-in TiledMLP over 3 shards; returns how often each weight accumulated, and its grad."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    counts = {name: 0 for name, _ in mlp.named_parameters()}
    for name, p in mlp.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: counts.__setitem__(name, counts[name] + 1))
    x = torch.randn(2, 6, 8, requires_grad=True)
    tiled_mlp.TiledMLP.apply(mlp.forward, mlp, x, False, 3, None).pow(2).sum().backward()
    reference = torch.autograd.grad(mlp(x).pow(2).sum(), list(mlp.parameters()))
    for (name, p), ref in zip(mlp.named_parameters(), reference):
        assert torch.allclose(p.grad, ref, atol=1e-6), name
    return counts, {name: p.grad for name, p in mlp.named_parameters()}


def test_fixes_applied_on_import_where_missing(stand_in, monkeypatch):
    stand_in(fixed=False)
    patch_groups.install("unsloth_savers")
    loss_module, tiled_mlp = _import_stand_in()
    applied = patching.applied()
    assert "unsloth_zoo.fused_losses.cross_entropy_loss:UnslothFusedLoss.apply" in applied
    assert "unsloth_zoo.tiled_mlp:TiledMLP.apply" in applied
    if compat.transformers_major() >= 5:  # now, or when transformers.trainer is imported
        assert TRAINER in applied + patching.pending()

    # Hidden states and labels on another device than lm_head (meta stands in for a second GPU).
    hidden, labels = torch.randn(2, 3, 4, requires_grad=True), torch.zeros(2, 3, dtype=torch.long)
    weight = torch.empty(5, 4, device="meta")
    loss = loss_module.unsloth_fused_ce_loss(None, hidden, weight, None, labels)
    assert loss.device.type == "meta"

    # Under DDP each weight accumulates once; a single process keeps unsloth's own code.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    counts, _ = _tiled_weight_grads(tiled_mlp)
    assert set(counts.values()) == {1}
    monkeypatch.setenv("WORLD_SIZE", "1")
    counts, _ = _tiled_weight_grads(tiled_mlp)
    assert set(counts.values()) == {3}

    patch_groups.uninstall()
    assert "apply" not in vars(tiled_mlp.TiledMLP) and "apply" not in vars(loss_module.UnslothFusedLoss)
    with pytest.raises(RuntimeError, match="TensorWrapper"):
        loss_module.unsloth_fused_ce_loss(None, hidden, weight, None, labels)
    monkeypatch.setenv("WORLD_SIZE", "2")
    counts, _ = _tiled_weight_grads(tiled_mlp)
    assert set(counts.values()) == {3}  # the stand-in really has the bug the fix removes


def test_left_alone_where_unsloth_ships_the_fix(stand_in):
    stand_in(fixed=True)
    patch_groups.install("unsloth_savers")
    _import_stand_in()
    assert not fixes.needs_cross_device_loss_fix()
    assert fixes.needs_tiled_mlp_fix() is False and fixes.needs_find_unused_fix() is False
    assert patching.applied("unsloth_savers") == []


def test_nothing_is_imported_or_patched_without_unsloth():
    assert "unsloth_zoo.tiled_mlp" not in sys.modules
    assert not fixes.needs_cross_device_loss_fix() and not fixes.needs_tiled_mlp_fix()
    assert not fixes.needs_find_unused_fix()  # unsloth is not installed here
    assert "unsloth" not in sys.modules and "unsloth_zoo" not in sys.modules


@needs_transformers_5
def test_trainer_gets_find_unused_false_only_for_lora_text_models_under_ddp(
    stand_in, monkeypatch, tiny_text_path, tmp_path
):
    peft = pytest.importorskip("peft")
    from accelerate.utils import DistributedDataParallelKwargs
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    stand_in(fixed=False)
    _import_stand_in()
    (target,) = [p for p in patching.registered("unsloth_savers") if p.target == TRAINER]
    assert target.apply()
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_text_path)
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
        model.base_model.model.model.gradient_checkpointing = True

        def find_unused(model, **args) -> bool:
            trainer = types.SimpleNamespace(
                args=TrainingArguments(output_dir=str(tmp_path), report_to=[], **args), model=model
            )
            (handler,) = Trainer._build_accelerator_args(trainer)["kwargs_handlers"]
            assert isinstance(handler, DistributedDataParallelKwargs)
            return handler.find_unused_parameters

        assert find_unused(model) is True  # single process: unchanged
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
        assert find_unused(model) is False
        assert find_unused(model, ddp_find_unused_parameters=True) is True  # the user's choice stands
        model.base_model.model.model.gradient_checkpointing = False
        assert find_unused(model) is True  # no checkpointing, nothing to fix
        model.base_model.model.model.gradient_checkpointing = True
        model.base_model.model.lm_head.weight.requires_grad_(True)
        assert find_unused(model) is True  # a non-LoRA trainable weight: keep the safe default
    finally:
        target.revert()


_VISION = """
def is_distributed():
    import os
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def vlm_gradient_checkpointing_reentrant():
    return not is_distributed()


class FastBaseModel:
    @staticmethod
    def post_patch_model(model):  # what unsloth does with the answer, for every model it loads
        model._unsloth_gradient_checkpointing = "unsloth"
        model._unsloth_vlm_gc_non_reentrant = not vlm_gradient_checkpointing_reentrant()
        return model
"""


@pytest.mark.skipif(compat.transformers_major() >= 5, reason="transformers 4.x only")
def test_on_transformers_4_unsloth_keeps_its_ddp_checkpointing(stand_in, monkeypatch, tiny_vl_path):
    # Without a way to set find_unused_parameters=False on 4.x, keeping the reentrant checkpoint would
    # fail the first DDP backward; unsloth's own (non-reentrant) choice must stand.
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForImageTextToText

    root = stand_in(fixed=True)
    _write(root, {"unsloth/models/vision.py": _VISION})
    patch_groups.install("unsloth_savers")
    from unsloth.models.vision import FastBaseModel

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path)
    vlm = FastBaseModel.post_patch_model(peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"])))
    assert vlm._unsloth_vlm_gc_non_reentrant is True and not getattr(vlm, "_nbkit_kept_reentrant", False)
    assert not [t for t in patching.applied() if t.endswith("vlm_gradient_checkpointing_reentrant")]


@needs_transformers_5
def test_dense_vision_models_keep_single_gpu_checkpointing_and_trainer_follows(
    stand_in, monkeypatch, tiny_vl_path, tiny_text_path, tmp_path
):
    peft = pytest.importorskip("peft")
    from accelerate.utils import DistributedDataParallelKwargs
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Trainer, TrainingArguments

    root = stand_in(fixed=True)  # unsloth chooses find_unused_parameters itself: only fix 4 is nbkit's
    _write(root, {"unsloth/models/vision.py": _VISION})
    patch_groups.install("unsloth_savers")
    from unsloth.models.vision import FastBaseModel

    def load(path, auto):
        model = auto.from_pretrained(path)
        return FastBaseModel.post_patch_model(
            peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
        )

    def find_unused(model, **args) -> bool:
        trainer = types.SimpleNamespace(
            args=TrainingArguments(output_dir=str(tmp_path), report_to=[], **args), model=model
        )
        (handler,) = Trainer._build_accelerator_args(trainer)["kwargs_handlers"]
        assert isinstance(handler, DistributedDataParallelKwargs)
        return handler.find_unused_parameters

    one_gpu = load(tiny_vl_path, AutoModelForImageTextToText)
    assert one_gpu._unsloth_vlm_gc_non_reentrant is False  # one process: unsloth's own answer, nothing marked
    assert not getattr(one_gpu, "_nbkit_kept_reentrant", False)

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    vlm = load(tiny_vl_path, AutoModelForImageTextToText)
    assert vlm._unsloth_vlm_gc_non_reentrant is False  # unsloth alone: non-reentrant under DDP
    assert find_unused(vlm) is False
    with pytest.raises(ValueError, match="unsloth_vlm_ddp_checkpointing='unsloth'"):
        find_unused(vlm, ddp_find_unused_parameters=True)

    text = load(tiny_text_path, AutoModelForCausalLM)  # unsloth routes some text models through here too
    assert text._unsloth_vlm_gc_non_reentrant is True and find_unused(text) is True  # left to unsloth

    monkeypatch.setenv("NBKIT_UNSLOTH_VLM_DDP_CHECKPOINTING", "unsloth")  # read at each load
    vlm = load(tiny_vl_path, AutoModelForImageTextToText)
    assert vlm._unsloth_vlm_gc_non_reentrant is True and find_unused(vlm) is True

    monkeypatch.delenv("NBKIT_UNSLOTH_VLM_DDP_CHECKPOINTING")
    patch_groups.uninstall()
    assert load(tiny_vl_path, AutoModelForImageTextToText)._unsloth_vlm_gc_non_reentrant is True  # restored
