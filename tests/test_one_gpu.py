"""What nbkit says on one GPU: what the run does there and why it still helps, once per process."""

from __future__ import annotations

import pytest

from nbkit.notebook import one_gpu


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(one_gpu, "_said", set())


@pytest.mark.version_independent
def test_the_live_message_says_what_and_why():
    text = one_gpu.message("live", "Tesla T4")
    assert text.startswith("nbkit: one GPU is visible (Tesla T4), so the live set has one rank")
    assert "no DDP" in text and "keeps the model" in text and "free of CUDA" in text
    assert "runs unchanged on 2 or more GPUs" in text


@pytest.mark.version_independent
def test_the_one_shot_message_says_what_and_why():
    text = one_gpu.message("one-shot", "NVIDIA L4")
    assert "%%ddp runs the cell in one fresh process" in text and "free of CUDA" in text and "%ddp start" in text
    with pytest.raises(ValueError, match="'live' or 'one-shot'"):
        one_gpu.message("fsdp", "x")


@pytest.mark.version_independent
def test_said_once_per_kind_through_logging(capsys):
    assert one_gpu.say_once("live", "Tesla T4") is True
    assert one_gpu.say_once("live", "Tesla T4") is False
    assert one_gpu.say_once("one-shot", "Tesla T4") is True
    out = capsys.readouterr().out
    assert out.count("so the live set has one rank") == 1 and out.count("%%ddp runs the cell") == 1
