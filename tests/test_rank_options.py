"""How ranks are set up (nbkit.launching.rank_options): every way in refuses a bad option with one message, and the
options nbkit sets win over a user's `env`, with a notice naming the variable.

The ways in: nbkit.launch, nbkit.run_cell (fork and spawn), nbkit.start, nbkit.connect, the `%%ddp` and
`%ddp start` lines, the exporter, and a running live set's calls. Refusals happen before any process
starts; the live-set and launch tests run real gloo ranks on the CPU.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

import nbkit
from nbkit.launching.rank_options import RankOptions
from nbkit.notebook import ddp_options
from nbkit.notebook.export import export_script
from nbkit.platform import config
from nbkit.platform.errors import EmulationError, ExportError, OptionsError, OptionTypeError


def _message(call) -> tuple[type, str]:
    with pytest.raises(OptionsError) as caught:
        call()
    return type(caught.value), str(caught.value)


def _exported(tmp_path: Path, line: str) -> str:
    """The message export_script gives for a notebook whose %%ddp cell has `line`."""
    nb = new_notebook()
    nb.cells = [new_code_cell(f"%%ddp {line}\n1", metadata={"tags": ["train"]})]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(ExportError) as caught:
        export_script(path, "train", tmp_path / "train.py")
    assert not (tmp_path / "train.py").exists()
    return str(caught.value)


# (option, value from Python, the same value on a magic line or None where a line cannot hold it,
#  error type, what the message says)
CASES = [
    ("timeout", "5", None, OptionTypeError, "timeout must be a number of seconds (or None for no limit); got str '5'."),
    (
        "timeout",
        0,
        "0",
        OptionsError,
        "timeout must be a finite number of seconds above 0 (or None for no limit); got 0.",
    ),
    ("timeout", -5, "-5", OptionsError, "above 0 (or None for no limit); got -5."),
    ("timeout", math.nan, "nan", OptionsError, "above 0 (or None for no limit); got nan."),
    ("gpus", 0, "0", OptionsError, "gpus must be a positive whole number or None (all visible GPUs); got 0."),
    (
        "gpus",
        "2",
        None,
        OptionTypeError,
        "gpus must be a positive whole number or None (all visible GPUs); got str '2'.",
    ),
    ("strategy", "zero", "zero", OptionsError, "strategy must be one of 'ddp', 'fsdp'; got 'zero'."),
    (
        "emulate",
        "A100",
        "A100",
        EmulationError,
        "emulate must name a GPU profile, one of 'T4' (or None for none); got 'A100'.",
    ),
    (
        "env",
        "A=1",
        None,
        OptionTypeError,
        "env must be a dict of environment variables, e.g. env={'HF_HOME': '/tmp/hf'}",
    ),
    (
        "env",
        {"A": 1},
        None,
        OptionTypeError,
        "env values must be text, as environment variables are: env={'A': '1'}; got int 1",
    ),
]


@pytest.mark.version_independent
@pytest.mark.parametrize(("option", "value", "word", "error", "text"), CASES, ids=[f"{c[0]}={c[1]!r}" for c in CASES])
def test_every_way_in_gives_one_message_naming_the_option(tmp_path, option, value, word, text, error):
    ran = tmp_path / "ran"
    given = {option: value}
    if option != "gpus":
        given["gpus"] = 2
    calls = {
        "launch": lambda: nbkit.launch(ran.touch, **given),
        "run_cell": lambda: nbkit.run_cell("open('ran', 'w')", {}, **given),
        "run_cell --spawn": lambda: nbkit.run_cell("open('ran', 'w')", {}, spawn=True, **given),
        "start": lambda: nbkit.start(**given),
        "RankOptions": lambda: RankOptions.build(**given),
    }
    if option != "gpus":
        calls["connect"] = lambda: nbkit.live.connect("no-such-client.json", **{option: value})
    if word is not None:
        calls["%%ddp"] = lambda: ddp_options.parse(f"--{option} {word}")
        calls["%ddp start"] = lambda: ddp_options.parse_start(f"--{option} {word}")
    said = {way: _message(call) for way, call in calls.items()}
    messages = {message for _, message in said.values()}
    assert len(messages) == 1, said
    (message,) = messages
    assert text in message
    assert all(kind is error for kind, _ in said.values()), said
    assert issubclass(error, ValueError) and (error is not OptionTypeError or issubclass(error, TypeError))
    if word is not None:
        assert _exported(tmp_path, f"--{option} {word}").endswith(f": {message}")
    assert not ran.exists() and nbkit.live.current() is None  # refused before anything started


@pytest.mark.version_independent
def test_a_line_the_magic_cannot_read_names_the_option():
    with pytest.raises(OptionsError, match="--env takes KEY=VALUE pairs; got 'A'"):
        ddp_options.parse("--env A")
    with pytest.raises(OptionsError, match="argument --timeout: invalid float value: 'soon'"):
        ddp_options.parse("--timeout soon")
    with pytest.raises(OptionsError, match="argument --gpus: invalid int value: 'two'"):
        ddp_options.parse_start("--gpus two")


@pytest.mark.version_independent
def test_gpus_none_as_a_parameters_cell_leaves_it_means_one_process_per_visible_gpu():
    # `%ddp start --gpus $gpus` / `%%ddp --gpus $gpus` with `gpus = None` in the parameters, as the exporter reads it
    assert ddp_options.parse_start("--gpus None").gpus is None
    assert ddp_options.parse("--gpus None --out r").setup.gpus is None
    assert ddp_options.parse("--gpus 2").setup.gpus == 2


@pytest.mark.version_independent
def test_the_value_is_frozen_checked_and_defaults_once():
    options = RankOptions.build(gpus=2, timeout=5, env={"A": "1"}, strategy=" FSDP ", emulate="t4")
    assert (options.gpus, options.timeout, options.env_dict(), options.strategy, options.emulate) == (
        2,
        5.0,
        {"A": "1"},
        "fsdp",
        "T4",
    )
    with pytest.raises(AttributeError):
        options.gpus = 3  # type: ignore[misc]
    assert RankOptions().rank_strategy == "ddp" and RankOptions().strategy is None
    assert ddp_options.parse("").setup == RankOptions() == ddp_options.parse_start("")
    with pytest.raises(OptionsError, match="got 0"):
        RankOptions(timeout=0)


@pytest.mark.version_independent
def test_nbkit_variables_in_env_are_read_as_the_options_and_lose_to_them(capsys):
    assert RankOptions.build(env={config.STRATEGY: "fsdp", config.EMULATE: "t4"}) == RankOptions(
        strategy="fsdp", emulate="T4"
    )
    assert capsys.readouterr().err == ""  # no option given: nothing collides
    options = RankOptions.build(env={config.STRATEGY: "ddp", "A": "1"}, strategy="fsdp")
    assert options.strategy == "fsdp" and options.env_dict() == {"A": "1"}
    said = capsys.readouterr().err
    assert "env sets NBKIT_STRATEGY=ddp, and strategy='fsdp' is given: the ranks get NBKIT_STRATEGY=fsdp" in said
    with pytest.raises(OptionsError, match=r"env=\{'NBKIT_STRATEGY': 'zero'\}: strategy must be one of"):
        RankOptions.build(env={config.STRATEGY: "zero"})


def _rank_view() -> dict:
    from nbkit.training import guard

    return {
        "strategy": os.environ.get(config.STRATEGY),
        "use_fsdp": os.environ.get(config.USE_FSDP),
        "fsdp_rank": config.fsdp_rank(),
        "guard_steps_aside": guard._placement_managed_elsewhere({}),
    }


def test_the_strategy_nbkit_sets_wins_over_env_in_the_ranks(capfd):
    view = nbkit.launch(_rank_view, gpus=1, env={config.STRATEGY: "ddp"}, strategy="fsdp", dashboard=False)
    assert view["strategy"] == "fsdp" and view["fsdp_rank"] and view["use_fsdp"] == "true"
    assert "NBKIT_STRATEGY=ddp" in capfd.readouterr().err
    # ACCELERATE_USE_FSDP=1 on a DDP run: one answer in the rank, and the guard keeps its device map
    view = nbkit.launch(_rank_view, gpus=1, env={config.USE_FSDP: "1"}, dashboard=False)
    assert view == {"strategy": "ddp", "use_fsdp": "false", "fsdp_rank": False, "guard_steps_aside": False}
    assert (
        "ACCELERATE_USE_FSDP=1 in this rank's environment, and the rank's strategy is 'ddp'" in capfd.readouterr().err
    )
    # the same flag spelt 1 on an fsdp rank is accelerate's "true", which its Accelerator needs
    view = nbkit.launch(_rank_view, gpus=1, env={config.USE_FSDP: "1"}, strategy="fsdp", dashboard=False)
    assert view["use_fsdp"] == "true" and view["fsdp_rank"] and view["guard_steps_aside"]


# version_independent: the launches it asks for are refused before they start; the live set runs torch alone.
@pytest.mark.version_independent
def test_a_live_set_checks_its_calls_as_one_shot_runs_do(capfd):
    one_shot = {
        "5": _message(lambda: nbkit.launch(print, gpus=2, timeout="5")),
        0: _message(lambda: nbkit.launch(print, gpus=2, timeout=0)),
    }
    # nbkit.start(env=...) too: the strategy given wins over env's, with a notice
    live = nbkit.start(gpus=2, env={config.STRATEGY: "fsdp"}, strategy="ddp")
    assert "env sets NBKIT_STRATEGY=fsdp, and strategy='ddp' is given" in capfd.readouterr().err
    try:
        assert live.exec(f"import os\nos.environ[{config.STRATEGY!r}]") == "ddp"
        for timeout, said in one_shot.items():
            assert _message(lambda: live.exec("1", timeout=timeout)) == said
            assert _message(lambda: live.run(int, timeout=timeout)) == said
            assert _message(lambda: nbkit.run_cell("1", {}, timeout=timeout)) == said
        assert live.exec("1 + 1", timeout=60) == 2  # the set stays up after each refusal
        # one rank by its number, as exec takes it (README: ranks="all"|0|[0, 1])
        assert nbkit.run_cell("import nbkit\nnbkit.rank()", {}, ranks=1) == 1
        assert nbkit.run_cell("import nbkit\nnbkit.rank()", {}, ranks=[1, 0]) == 0
        with pytest.raises(OptionsError, match="ranks must be a rank number"):
            nbkit.run_cell("1", {}, ranks="0")
        with pytest.raises(OptionsError, match="--env set up processes"):
            nbkit.run_cell("1", {}, env={"A": "1"})
    finally:
        live.stop()
