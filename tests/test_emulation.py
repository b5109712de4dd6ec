"""nbkit.emulate("T4"): the profile in this process, in launched ranks, in the planner, and its undoing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import nbkit
from nbkit.platform import distributed, patching
from nbkit.platform.distributed import GPU
from nbkit.platform.errors import EmulationError
from nbkit.training import emulation

H100 = GPU(0, "NVIDIA H100 80GB HBM3", 79.6, (9, 0))


@pytest.fixture(autouse=True)
def no_profile_left() -> Iterator[None]:
    """Every test starts and ends without a profile (the environment variable and this process's state)."""
    nbkit.emulate(None)
    yield
    nbkit.emulate(None)


def _flags() -> dict[str, Any]:
    return {
        "env": os.environ.get("NBKIT_EMULATE"),
        "bf16": torch.cuda.is_bf16_supported(),
        "patched": patching.applied("emulate"),
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
    }


@pytest.mark.version_independent
def test_t4_profile_switches_precision_kernels_and_environment_and_undoes_them_exactly(capsys, monkeypatch):
    torch.backends.cuda.matmul.allow_tf32 = True  # as a user who turned TF32 on would have it
    before = _flags()
    original = torch.cuda.is_bf16_supported
    monkeypatch.setattr(distributed, "visible_gpus", lambda: [H100])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # where the notice looks (no context either way)
    assert nbkit.precision() == "bf16"
    profile = nbkit.emulate("t4")  # names are case-insensitive
    nbkit.emulate("T4")  # said once per process, not at every call
    assert profile is nbkit.emulate.PROFILES["T4"] and profile.memory_gib == 15.0
    on = _flags()
    assert on["env"] == "T4" and on["bf16"] is False and on["patched"] == ["torch.cuda:is_bf16_supported"]
    assert not (on["flash"] or on["cudnn_sdp"] or on["tf32"] or on["cudnn_tf32"])
    assert nbkit.precision() == "fp16"
    said = [line for line in capsys.readouterr().err.splitlines() if "emulating" in line]  # the nbkit logger
    assert len(said) == 1 and "Tesla T4" in said[0] and "Not emulated: speed" in said[0] and "sm_75" in said[0]
    assert not torch.cuda.is_initialized()  # the memory cap waits for CUDA: the notebook stays fork-safe

    assert nbkit.emulate(None) is None
    assert _flags() == before and "NBKIT_EMULATE" not in os.environ
    assert torch.cuda.is_bf16_supported is original
    assert nbkit.precision() == "bf16"
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.version_independent
def test_the_profile_brings_the_t4_fixes_into_this_process_and_takes_them_back():
    # A process that trains itself (notebook_launcher in place, a script) needs what launched ranks get:
    # attention without flash (seq x seq memory otherwise) and fp16-ready dtypes under TRL's SFTTrainer.
    nbkit.uninstall("attention")
    nbkit.uninstall("mixed_precision")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    nbkit.emulate("T4")
    assert patching.applied("attention") == ["torch.nn.functional:scaled_dot_product_attention"]
    assert patching.applied("mixed_precision") or patching.pending("mixed_precision")
    assert torch.nn.functional.scaled_dot_product_attention is not sdpa
    nbkit.emulate(None)
    assert not (patching.applied("attention") or patching.applied("mixed_precision"))
    assert not patching.pending("mixed_precision")
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    nbkit.install("attention")  # applied before the profile: switching it off leaves it
    nbkit.emulate("T4")
    nbkit.emulate(None)
    assert patching.applied("attention")
    nbkit.uninstall("attention")


@pytest.mark.version_independent
def test_precision_stays_fp32_without_a_gpu_under_a_profile(capsys, monkeypatch):
    assert torch.cuda.device_count() == 0 or pytest.skip("a GPU is visible")
    monkeypatch.setattr(emulation._state, "logged", False)  # the notice is said once per process
    nbkit.emulate("T4")
    assert nbkit.precision() == "fp32"  # fp16 training on CPU cores fails: the profile is for GPUs
    said = [line for line in capsys.readouterr().err.splitlines() if "profile is on" in line]
    # the notice does not promise fp16 on a machine where it cannot hold
    assert len(said) == 1 and "no GPU is visible here" in said[0] and "fp32" in said[0] and "fp16" not in said[0]


@pytest.mark.version_independent
def test_an_unknown_profile_names_the_known_ones_and_changes_nothing(monkeypatch):
    before = _flags()
    with pytest.raises(nbkit.EmulationError, match=r"no GPU profile 'A100'.*the profiles are T4") as caught:
        nbkit.emulate("A100")
    assert isinstance(caught.value, nbkit.NbkitError) and isinstance(caught.value, ValueError)
    assert _flags() == before
    monkeypatch.setenv("NBKIT_EMULATE", "K80")
    with pytest.raises(nbkit.EmulationError, match="'K80'"):  # what every launched rank calls first
        emulation.apply_from_env()


def test_the_planner_plans_for_the_emulated_t4(tiny_text_path):
    nbkit.emulate("T4")
    emulated = nbkit.plan(tiny_text_path, gpus=2)
    assert emulated.gpu_memory_gib == 15.0 and emulated.gpu == "Tesla T4"
    t4 = nbkit.plan(tiny_text_path, gpus=2, gpu_memory_gib=15, gpu="T4")
    assert emulated.gpu_seconds_per_token == t4.gpu_seconds_per_token
    h100 = nbkit.plan(tiny_text_path, gpus=2, gpu_memory_gib=15, gpu="H100")
    # a T4 does 65 dense 16-bit TFLOP/s against an H100's 989: each token costs that much more
    assert emulated.gpu_seconds_per_token == pytest.approx(h100.gpu_seconds_per_token * 989 / 65)
    assert nbkit.plan(tiny_text_path, gpus=2, gpu_memory_gib=40).gpu_memory_gib == 40  # an explicit size wins


def _in_rank() -> dict[str, Any]:
    return _flags()


def test_launched_ranks_apply_the_profile_the_environment_names(monkeypatch):
    # only the environment variable, as nbkit.launch(emulate=...) / %ddp --emulate pass it: the ranks
    # apply the profile themselves (this process has none)
    monkeypatch.setenv("NBKIT_EMULATE", "T4")
    assert torch.backends.cuda.flash_sdp_enabled() and patching.applied("emulate") == []
    r = nbkit.launch(_in_rank, gpus=2)
    assert r["env"] == "T4" and r["patched"] == ["torch.cuda:is_bf16_supported"] and r["bf16"] is False
    assert not (r["flash"] or r["cudnn_sdp"] or r["tf32"])
    assert torch.backends.cuda.flash_sdp_enabled() and patching.applied("emulate") == []


def test_emulate_in_the_notebook_reaches_every_rank():
    nbkit.emulate("T4")
    r = nbkit.launch(_in_rank, gpus=2)
    assert r["env"] == "T4" and r["patched"] == ["torch.cuda:is_bf16_supported"] and not r["flash"]


def _one() -> int:
    return 1


def test_a_launch_under_an_unknown_profile_fails_naming_the_known_ones(monkeypatch):
    monkeypatch.setenv("NBKIT_EMULATE", "K80")  # e.g. a typo in %ddp start --emulate
    with pytest.raises(nbkit.LaunchError, match=r"EmulationError: nbkit has no GPU profile 'K80'.*profiles are T4"):
        nbkit.launch(_one, gpus=2)


@pytest.mark.version_independent
def test_launch_and_start_refuse_an_unknown_profile_before_starting_anything():
    # the emulate= argument (and %ddp start --emulate, %%ddp --emulate) is checked in the notebook
    for call in (lambda: nbkit.launch(_one, gpus=2, emulate="K80"), lambda: nbkit.start(gpus=2, emulate="K80")):
        with pytest.raises(EmulationError, match=r"emulate must name a GPU profile, one of 'T4' .*; got 'K80'"):
            call()


def _t4_on_a_gpu() -> dict[str, Any]:
    fits = torch.empty(14 * 2**30, dtype=torch.uint8, device="cuda")  # a T4 has 15 GiB
    del fits
    try:
        torch.empty(16 * 2**30, dtype=torch.uint8, device="cuda")
        refused = False
    except torch.cuda.OutOfMemoryError:
        refused = True
    return {
        **_flags(),
        "precision": nbkit.precision(),
        "refused_16_gib": refused,
        "total_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_larger_gpu_a_rank_gets_15_gib_fp16_and_no_bf16():
    nbkit.emulate("T4")
    r = nbkit.launch(_t4_on_a_gpu, gpus=1)
    assert r["total_gib"] > 16 or pytest.skip("the GPU is not larger than a T4")
    assert r["refused_16_gib"] and r["precision"] == "fp16" and r["bf16"] is False
    assert not (r["flash"] or r["tf32"])
    assert not torch.cuda.is_initialized()  # the notebook process stays without a CUDA context
