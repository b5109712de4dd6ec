"""nbkit.install() / nbkit.uninstall(): idempotent, exactly reversible, patching libraries when they are imported."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Qwen3ForCausalLM
from transformers.modeling_utils import PreTrainedModel
from transformers.models.auto.auto_factory import _BaseAutoModelClass

import nbkit
from nbkit.platform import patch_groups, patching

GUARD_TARGET = "transformers.modeling_utils:PreTrainedModel.from_pretrained"
UNSLOTH_TARGETS = [
    f"unsloth.models.loader:{name}.from_pretrained" for name in ("FastVisionModel", "FastModel", "FastLanguageModel")
]


@pytest.fixture(autouse=True)
def _nothing_installed():
    nbkit.uninstall()
    yield
    nbkit.uninstall()


def _descriptors() -> dict[str, Any]:
    """What every class whose from_pretrained users call holds in its own __dict__ (None: inherited)."""
    classes = (
        PreTrainedModel,
        _BaseAutoModelClass,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        Qwen3ForCausalLM,
    )
    return {cls.__name__: vars(cls).get("from_pretrained") for cls in classes}


def test_install_is_idempotent_and_uninstall_restores_the_exact_descriptors():
    before = _descriptors()
    original = before["PreTrainedModel"]
    assert isinstance(original, classmethod) and before["Qwen3ForCausalLM"] is None

    assert GUARD_TARGET in nbkit.install()
    patched = vars(PreTrainedModel)["from_pretrained"]
    assert isinstance(patched, classmethod) and patched is not original
    assert patched.__func__.__wrapped__ is original.__func__
    assert Qwen3ForCausalLM.from_pretrained.__func__ is patched.__func__  # model classes inherit the guard
    assert {k: v for k, v in _descriptors().items() if k != "PreTrainedModel"} == {
        k: v for k, v in before.items() if k != "PreTrainedModel"
    }  # Auto classes untouched (they call it)

    assert nbkit.install() == patching.applied("guard") + patching.applied("unsloth_savers")
    assert vars(PreTrainedModel)["from_pretrained"] is patched  # a second install wraps nothing again

    nbkit.uninstall()
    after = _descriptors()
    assert all(after[name] is before[name] for name in before)
    assert "from_pretrained" not in vars(Qwen3ForCausalLM)
    assert patching.applied() == [] and patching.pending() == []
    assert not any(isinstance(finder, patching._ImportWatcher) for finder in sys.meta_path)
    nbkit.uninstall()  # nothing left to undo
    assert _descriptors() == after


def test_groups_can_be_chosen_and_unknown_names_are_refused():
    original = vars(PreTrainedModel)["from_pretrained"]
    targets = nbkit.install("unsloth_savers")
    assert GUARD_TARGET not in targets and not patching.applied("guard")
    assert set(targets) <= {p.target for p in patching.registered("unsloth_savers")}
    assert vars(PreTrainedModel)["from_pretrained"] is original
    assert GUARD_TARGET in nbkit.install()  # now the guard too, keeping the savers as they are
    assert set(targets) <= set(patching.applied())
    with pytest.raises(ValueError, match="no patch group 'savers'; the groups are forksafety, guard"):
        nbkit.install("guard", "savers")
    with pytest.raises(ValueError, match="no patch group 'gaurd'"):
        nbkit.uninstall("gaurd")
    assert GUARD_TARGET in patching.applied("guard")  # a refused call changes nothing
    nbkit.uninstall("guard")
    assert vars(PreTrainedModel)["from_pretrained"] is original
    assert set(targets) <= set(patching.applied("unsloth_savers") + patching.pending("unsloth_savers"))


# A stand-in for unsloth.models.loader (unsloth cannot be installed without a GPU): the same class
# layout (FastVisionModel inherits FastModel's staticmethod), the same leading parameters, and a
# functools.wraps decorator that, like unsloth's, sees which keywords the caller passed explicitly.
_FAKE_LOADER = """
import functools

DEFAULT_DEVICE_MAP = "sequential"


def track_explicit(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return {"device_map": fn(*args, **kwargs), "explicit": sorted(kwargs)}
    return wrapper


@track_explicit
def _load(model_name="unsloth/model", max_seq_length=2048, dtype=None, load_in_4bit=True, load_in_8bit=False,
          load_in_16bit=False, full_finetuning=False, token=None, device_map=DEFAULT_DEVICE_MAP, *args, **kwargs):
    return device_map


class FastLanguageModel:
    from_pretrained = staticmethod(_load)


class FastModel:
    from_pretrained = staticmethod(_load)


class FastVisionModel(FastModel):
    pass


ORIGINALS = {cls.__name__: vars(cls).get("from_pretrained") for cls in (FastLanguageModel, FastModel, FastVisionModel)}
"""


def _unsloth_imported_inside(fake_root: str) -> dict[str, Any]:
    r: dict[str, Any] = {"pending": patching.pending(), "imported_early": "unsloth" in sys.modules}
    sys.path.insert(0, fake_root)
    from unsloth.models import loader
    from unsloth.models.loader import FastLanguageModel, FastModel, FastVisionModel

    r["installed"] = patching.applied()
    original = loader.ORIGINALS["FastModel"].__func__
    r["vision_wraps_the_original"] = FastVisionModel.from_pretrained.__wrapped__ is original
    os.environ["NBKIT_DEVICE_MAP_POLICY"] = "error"
    calls = {
        "default_4bit_balanced": lambda: FastVisionModel.from_pretrained("m", device_map="balanced"),
        "16bit_balanced": lambda: FastVisionModel.from_pretrained("m", load_in_4bit=False, device_map="balanced"),
        "positional_auto": lambda: FastLanguageModel.from_pretrained(
            "m", 2048, None, False, False, False, False, None, "auto"
        ),
        "load_in_16bit_auto": lambda: FastModel.from_pretrained("m", load_in_16bit=True, device_map="auto"),
        "unset": lambda: FastLanguageModel.from_pretrained("m"),
        "other_rank": lambda: FastModel.from_pretrained("m", device_map={"": f"cuda:{1 - nbkit.local_rank()}"}),
        "own_rank": lambda: FastModel.from_pretrained("m", device_map={"": f"cuda:{nbkit.local_rank()}"}),
    }
    for name, call in calls.items():
        try:
            r[name] = call()
            r[name + "_explicit"] = r[name]["explicit"]
            r[name] = r[name]["device_map"]
        except nbkit.DeviceMapError as exc:
            r[name] = f"DeviceMapError: {exc}"
    nbkit.uninstall()
    r["restored"] = {
        cls.__name__: vars(cls).get("from_pretrained") is loader.ORIGINALS[cls.__name__]
        for cls in (FastLanguageModel, FastModel, FastVisionModel)
    }
    r["after_uninstall"] = FastVisionModel.from_pretrained("m", load_in_4bit=False, device_map="balanced")["device_map"]
    return r


def test_unsloth_loaders_are_guarded_once_unsloth_is_imported_in_the_launched_function(tmp_path):
    package = Path(tmp_path, "unsloth", "models")
    package.mkdir(parents=True)
    Path(tmp_path, "unsloth", "__init__.py").write_text("")
    Path(package, "__init__.py").write_text("")
    Path(package, "loader.py").write_text(textwrap.dedent(_FAKE_LOADER))

    r = nbkit.launch(_unsloth_imported_inside, str(tmp_path), gpus=2)
    # install() (run by the launcher in each rank) imported nothing and waited for the import
    assert r["imported_early"] is False and set(UNSLOTH_TARGETS) <= set(r["pending"])
    assert set(UNSLOTH_TARGETS) <= set(r["installed"])
    assert r["vision_wraps_the_original"]  # FastVisionModel is guarded once, not through FastModel's guard
    assert r["default_4bit_balanced"] == {"": "cpu"}  # unsloth loads 4-bit by default: always the rank's device
    assert r["unset"] == {"": "cpu"}
    # the loader's defaults are read, never passed on as if the caller had chosen them
    assert r["default_4bit_balanced_explicit"] == r["unset_explicit"] == ["device_map"]
    for name in ("16bit_balanced", "positional_auto", "load_in_16bit_auto"):
        assert r[name].startswith("DeviceMapError: device_map="), name
    assert r["other_rank"].startswith("DeviceMapError: The device_map puts modules of rank 0")
    assert r["own_rank"] == {"": "cuda:0"}  # an explicit map on the rank's own device is kept
    assert r["restored"] == {"FastLanguageModel": True, "FastModel": True, "FastVisionModel": True}
    assert r["after_uninstall"] == "balanced"


_ABSENT = object()


def _values(group: str) -> dict[str, Any]:
    """target -> what the patched owner holds itself now (its __dict__ entry, _ABSENT for an inherited
    attribute), for the group's targets whose module is imported and whose owner exists in this version (the
    registry skips the others: transformers 4.x has no Bnb4bitQuantize); imports nothing."""
    found = {}
    for p in patching.registered(group):
        module, _, path = p.target.partition(":")
        owner: Any = sys.modules.get(module)
        *parents, attr = path.split(".")
        for name in parents:
            owner = getattr(owner, name, None)
        if owner is not None:
            found[p.target] = vars(owner).get(attr, _ABSENT)
    return found


def _replaced(p: patching.Patch, before: dict[str, Any], patched: dict[str, Any]) -> bool:
    """Whether install() put `p`'s replacement in place of what was there: the attribute now, or inside the switch of
    another group's patch of the same attribute (two groups patch SFTTrainer.__init__; the one applied first stays
    inside the other's, and comes back there when it is installed again)."""
    replacement = p._saved[3] if p._saved is not None else None
    value = patched[p.target]
    while value is not None and value is not replacement:
        value = getattr(value, "__wrapped__", None)
    return value is not None and replacement is not before[p.target]


def _install_and_uninstall_each_group() -> dict[str, Any]:
    """Per group: what install(group) patched, left pending and restored; run where every group acts."""
    results = {}
    for name, group in patch_groups.GROUPS.items():
        importlib.import_module(group.module)
        for p in patching.registered(name):  # the libraries that are installed, imported as a user would
            with contextlib.suppress(ImportError):
                importlib.import_module(p.module)
        nbkit.uninstall(name)
        before = _values(name)
        targets = nbkit.install(name)
        patched = _values(name)
        again = nbkit.install(name)
        r = {
            "targets": targets,
            "pending": patching.pending(name),
            "idempotent": again == targets and _values(name) == patched,
            "replaced": all(_replaced(p, before, patched) for p in patching.registered(name) if p.is_applied),
            "not_imported": sorted(p.target for p in patching.registered(name) if p.module not in sys.modules),
        }
        nbkit.uninstall(name)
        after = _values(name)
        r["restored"] = after.keys() == before.keys() and all(after[t] is before[t] for t in before)
        r["left"] = patching.applied(name) + patching.pending(name)
        results[name] = r
    return results


def _versioned_out() -> set[str]:
    """Groups whose every patch is for library releases other than the installed ones: the compat
    group acts on transformers 4.x, on trl 0.x and on transformers 5.23 and newer, none of it on transformers
    5.0 to 5.22 with trl 1.x."""
    from nbkit.platform import compat

    return set() if compat._transformers_4() or compat._trl_0() or compat._transformers_5_23() else {"compat"}


def _check_each_group(results: dict[str, Any], acting: set[str]) -> None:
    acting = acting - _versioned_out()
    assert set(results) == set(patch_groups.GROUPS)
    for name, r in results.items():
        assert r["restored"] and r["left"] == [] and r["idempotent"] and r["replaced"], (name, r)
        assert sorted(r["pending"]) == r["not_imported"], name  # waiting exactly for what is not imported
        assert bool(r["targets"]) == (name in acting), (name, r["targets"])


def test_install_and_uninstall_of_every_group_restore_the_originals_exactly():
    results = _install_and_uninstall_each_group()
    # reporting's patches act only in launched ranks; unsloth is not installed here, so its loaders
    # (guard) and fixes (unsloth_savers) wait for its import, as does the fix of Trainer where
    # transformers ships it
    _check_each_group(results, acting=set(patch_groups.GROUPS) - {"reporting", "unsloth_savers"})
    assert set(results["guard"]["pending"]) == set(UNSLOTH_TARGETS)
    assert results["reporting"]["pending"] == []


def _in_a_rank() -> dict[str, Any]:
    groups = {p.group for p in patching.registered() if p.is_applied}
    return {"applied_by_launch": sorted(groups), "results": _install_and_uninstall_each_group()}


def test_every_group_installs_and_uninstalls_exactly_in_a_launched_rank():
    # mixed_precision patches TRL's SFTTrainer: applied in the (forked) rank where TRL is imported here
    trl_imported = "trl.trainer.sft_trainer" in sys.modules
    processors = ("transformers.processing_utils", "transformers.models.auto.processing_auto")
    processors_imported = any(name in sys.modules for name in processors)
    from transformers.utils import is_torchvision_available

    r = nbkit.launch(_in_a_rank, gpus=1)
    # what nbkit.launch sets up in every rank, before the user's function runs (forksafety: the
    # fixture reverted it in this process, which the rank was forked from; launch: applied in this
    # process while it starts the ranks, so a forked rank finds it applied)
    # attention: only on a GPU without flash attention (nbkit.training.attention.needed), so not on CPU ranks
    expected = {
        "checkpoints",
        "guard",
        "reporting",
        "launch",
        "compat",
        "teardown",
        "cell_group",
        "trainer_defaults",
        "gradient_averaging",
    }
    expected -= _versioned_out()
    expected |= {"mixed_precision", "trl_metrics"} if trl_imported else set()
    # offline fixes processors where torchvision is missing: applied in the rank where their module is imported here
    expected |= {"offline"} if processors_imported and not is_torchvision_available() else set()
    assert r["applied_by_launch"] == sorted(expected)
    _check_each_group(r["results"], acting=set(patch_groups.GROUPS) - {"unsloth_savers"})


def test_checkpoints_enable_and_disable():
    from transformers.trainer_callback import CallbackHandler

    from nbkit.training import checkpoints

    original = vars(CallbackHandler)["__init__"]
    checkpoints.enable()
    assert vars(CallbackHandler)["__init__"] is not original
    handler = CallbackHandler([], None, None, None, None)
    assert [type(cb).__name__ for cb in handler.callbacks] == ["CheckpointMarker"]
    checkpoints.disable()
    assert vars(CallbackHandler)["__init__"] is original
    assert CallbackHandler([], None, None, None, None).callbacks == []
    assert patching.applied("checkpoints") == []


def test_doctor_lists_applied_and_pending_patches():
    nbkit.install()
    text = str(nbkit.doctor())
    assert f"patches applied: guard ({GUARD_TARGET})" in text
    pending = next(line for line in text.splitlines() if line.startswith("  patches pending"))
    assert all(target in pending for target in UNSLOTH_TARGETS)
    nbkit.uninstall()
    text = str(nbkit.doctor())
    assert "  patches applied: none" in text and "applied when their module is imported): none" in text
