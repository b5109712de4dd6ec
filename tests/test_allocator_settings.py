"""torch's allocator settings in the environment nbkit gives GPU ranks: expandable segments, merged with the user's own
settings and never replacing them; CPU ranks and the notebook process are left as they are.
"""

from __future__ import annotations

import os

import pytest

from nbkit.launching import rank_contract
from nbkit.launching.rank_options import RankOptions

VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@pytest.fixture(autouse=True)
def no_user_settings(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.version_independent
def test_gpu_ranks_get_expandable_segments_and_the_notebook_keeps_its_environment():
    before = dict(os.environ)
    env = rank_contract.rank_environment(RankOptions(strategy="fsdp"), use_cpu=False)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_ALLOC_CONF" not in env
    assert dict(os.environ) == before


@pytest.mark.version_independent
def test_cpu_ranks_get_no_allocator_settings():
    env = rank_contract.rank_environment(RankOptions(), use_cpu=True)
    assert not set(VARIABLES) & set(env)


@pytest.mark.version_independent
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_notebooks_settings_are_kept_and_merged(monkeypatch, strategy):
    monkeypatch.setenv(
        "PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6,roundup_power2_divisions:[256:1,>:4]"
    )
    env = rank_contract.rank_environment(RankOptions(strategy=strategy), use_cpu=False)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == (
        "garbage_collection_threshold:0.6,roundup_power2_divisions:[256:1,>:4],expandable_segments:True"
    )


@pytest.mark.version_independent
def test_settings_given_to_the_launch_are_kept_and_merged():
    env = rank_contract.rank_environment(
        RankOptions(env={"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8"}), use_cpu=False
    )
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.8,expandable_segments:True"


@pytest.mark.version_independent
def test_the_newer_variable_is_merged_where_only_it_is_set(monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_use_cuda_host_register:True")
    env = rank_contract.rank_environment(RankOptions(), use_cpu=False)
    assert env["PYTORCH_ALLOC_CONF"] == "pinned_use_cuda_host_register:True,expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env  # torch would read it first and ignore the user's


@pytest.mark.version_independent
@pytest.mark.parametrize(
    "value",
    [
        "expandable_segments:False",
        "garbage_collection_threshold:0.8, expandable_segments:True",
        "backend:cudaMallocAsync",
        "max_split_size_mb:128",  # with expandable segments torch lets reserved memory grow (pytorch issue 123548)
    ],
)
def test_a_users_own_choice_is_left_alone(monkeypatch, value):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", value)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in rank_contract.rank_environment(RankOptions(), use_cpu=False)
    assert rank_contract.allocator_environment({"PYTORCH_CUDA_ALLOC_CONF": value}) == {}
