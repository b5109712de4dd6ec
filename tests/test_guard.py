"""The model-loading guard: every policy branch inside real 2-process launches, and nothing outside them."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_marks import two_gpus
from test_planner import llama_70b

import nbkit
from nbkit.notebook.planner import plan
from nbkit.training import guard

AUTOMATIC = [None, "auto", "balanced", "balanced_low_0", "sequential", "unsloth", "unsloth_balanced"]
NOTICE = "nbkit: device_map="


def _error(call: Callable[[], Any]) -> list[str] | None:
    """[exception type, message] of what call raises, None when it returns."""
    try:
        call()
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return None


def _policy_matrix(out_dir: str, tiny_path: str) -> dict[str, Any]:
    """Runs on each rank of a 2-process launch; writes what each branch did to rank<N>.json."""
    from transformers import AutoModelForCausalLM

    from nbkit.platform import patching

    mine, other = nbkit.local_rank(), 1 - nbkit.local_rank()
    r: dict[str, Any] = {}
    r["automatic"] = {str(m): nbkit.resolve_device_map(m) for m in AUTOMATIC}
    own = {"model.embed_tokens": f"cuda:{mine}", "model.layers": mine, "lm_head": "cpu"}
    r["own_dict_is_unchanged"] = nbkit.resolve_device_map(own) is own
    r["foreign_dict"] = _error(
        lambda: nbkit.resolve_device_map(
            {"model.embed_tokens": "cpu", "model.layers.1": f"cuda:{other}", "lm_head": other}
        )
    )
    r["foreign_device"] = _error(lambda: nbkit.resolve_device_map(torch.device("cuda", other)))
    model = AutoModelForCausalLM.from_pretrained(tiny_path, device_map="auto")
    r["auto_class_device"] = str(model.device)
    r["installed"] = patching.applied()

    os.environ["NBKIT_DEVICE_MAP_POLICY"] = "error"
    r["env_error"] = _error(lambda: nbkit.resolve_device_map("balanced"))
    r["env_error_quantized"] = nbkit.resolve_device_map("balanced", quantized=True)
    r["env_error_unset"] = nbkit.resolve_device_map(None)
    r["auto_class_error"] = _error(lambda: AutoModelForCausalLM.from_pretrained(tiny_path, device_map="auto"))
    nbkit.configure(device_map_policy="data_parallel")
    r["configured_data_parallel"] = nbkit.resolve_device_map("sequential")
    nbkit.configure(device_map_policy="error")
    r["configured_error"] = _error(lambda: nbkit.resolve_device_map("auto"))
    Path(out_dir, f"rank{nbkit.rank()}.json").write_text(json.dumps(r))
    return r


def test_every_policy_branch_in_a_two_process_launch(tmp_path, tiny_text_path, capfd):
    nbkit.launch(_policy_matrix, str(tmp_path), tiny_text_path, gpus=2)
    out, _ = capfd.readouterr()
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        other = 1 - rank
        assert "transformers.modeling_utils:PreTrainedModel.from_pretrained" in r["installed"]
        # automatic maps (and no map) load a full copy on the rank's own device ("cpu" in a CPU launch)
        assert r["automatic"] == {str(m): {"": "cpu"} for m in AUTOMATIC}
        assert r["auto_class_device"] == "cpu"
        # a dict on the rank's own devices is respected; one naming another rank's GPU is refused
        assert r["own_dict_is_unchanged"]
        kind, message = r["foreign_dict"]
        assert kind == "DeviceMapError"
        assert f"'model.layers.1' -> cuda:{other}" in message and f"'lm_head' -> cuda:{other}" in message
        assert "'model.embed_tokens'" not in message and f"rank {rank}" in message
        assert r["foreign_device"][0] == "DeviceMapError" and f"cuda:{other}" in r["foreign_device"][1]
        # policy "error", from the environment variable and from nbkit.configure
        for key, asked in (("env_error", "balanced"), ("auto_class_error", "auto"), ("configured_error", "auto")):
            kind, message = r[key]
            assert kind == "DeviceMapError", key
            assert f"device_map={asked!r}" in message and f"rank {rank} of 2" in message
            for teaches in (
                "data parallel",
                "device_map=None",
                "model parallel",
                "device_map='balanced'",
                "outside nbkit.launch",
                "nbkit.configure(device_map_policy='data_parallel')",
                "NBKIT_DEVICE_MAP_POLICY",
            ):
                assert teaches in message, (key, teaches)
        # quantized loads and unset maps are placed on the rank's device whatever the policy
        assert r["env_error_quantized"] == r["env_error_unset"] == {"": "cpu"}
        assert r["configured_data_parallel"] == {"": "cpu"}
    # one notice for the whole launch, from rank 0, naming what was asked and what is used instead
    notices = [line for line in out.splitlines() if NOTICE in line]
    assert len(notices) == 1, out
    assert notices[0].startswith(NOTICE + "'auto' was asked for")
    assert "{'': 'cpu'}" in notices[0] and "full copy" in notices[0]


def test_outside_a_launch_everything_passes_through(tiny_text_path, capfd, monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NBKIT_DEVICE_MAP_POLICY", "error")
    maps = [*AUTOMATIC, "cuda", "cuda:1", 1, {"model": "cuda:0", "lm_head": "cuda:1"}]
    for device_map in maps:
        assert nbkit.resolve_device_map(device_map) is device_map
        assert nbkit.resolve_device_map(device_map, quantized=True) is device_map
    from transformers import AutoModelForCausalLM

    nbkit.install()
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_text_path, device_map="auto")  # no error: one process
    finally:
        nbkit.uninstall()
    assert model.device == torch.device("cpu")
    assert NOTICE not in capfd.readouterr().out
    assert issubclass(nbkit.DeviceMapError, ValueError)


def test_a_model_too_large_for_one_gpu_is_refused_with_numbers_and_alternatives():
    seventy_b = llama_70b()
    estimate = plan(seventy_b, gpus=1, gpu_memory_gib=15, seq_len=512)
    message = guard.fit_error(estimate, "meta-llama/Llama-3.3-70B")
    assert message is not None
    assert message.startswith("meta-llama/Llama-3.3-70B does not fit on one GPU")
    assert f"about {estimate.per_gpu_gib:.1f} GiB" in message and "15.0 GiB" in message
    assert f"weights {estimate.breakdown['weights']:.1f}" in message and "Nothing was loaded" in message
    for alternative in ("4-bit", "device_map='balanced'", "outside nbkit.launch", "shorter sequences"):
        assert alternative in message
    quantized = guard.fit_error(plan(seventy_b, gpus=1, gpu_memory_gib=15, load_in_4bit=True), "x")
    assert quantized is not None and "load in 4-bit" not in quantized
    assert guard.fit_error(plan("tiny:qwen3", gpus=1, gpu_memory_gib=15), "tiny") is None


def _load_huge(config_dir: str) -> list[str] | None:
    from transformers import AutoModelForCausalLM

    return _error(lambda: AutoModelForCausalLM.from_pretrained(config_dir, device_map="auto"))


@pytest.mark.gpu
@two_gpus
def test_ddp_load_of_a_model_no_gpu_holds_fails_before_loading(tmp_path):
    """On 2 GPUs: a 70B config (no weights on disk at all) is refused by the fit check, not by a missing file."""
    llama_70b().save_pretrained(tmp_path)
    kind, message = nbkit.launch(_load_huge, str(tmp_path), gpus=2)
    assert kind == "DeviceMapError" and "does not fit on one GPU" in message


def _load_tiny_auto(tiny_path: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, device_map="auto")
    gathered: list[str | None] = [None, None]
    torch.distributed.init_process_group("gloo")
    torch.distributed.all_gather_object(gathered, str(model.device))
    torch.distributed.destroy_process_group()
    return gathered


@pytest.mark.gpu
@two_gpus
def test_on_two_gpus_auto_puts_each_rank_on_its_own_gpu(tiny_text_path):
    assert nbkit.launch(_load_tiny_auto, tiny_text_path, gpus=2) == ["cuda:0", "cuda:1"]
