"""The constraints files and `make constraints` (tools/constraints.py), which rewrites them from what pip resolves:
held pins stay, the other pins take the new versions, comments stay; the sets defined against the newest one take
its versions for every pin they do not hold."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_tool():
    spec = importlib.util.spec_from_file_location("nbkit_constraints_tool", REPO / "tools" / "constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()

FILE = """# why the set is what it is
torch==2.13.0  # held: the CPU build
Transformers==5.17.0
# trl: a reason that names 1.14.2
trl==1.14.2
cloudpickle==3.1.2
cloudpickle==3.1.2
"""


@pytest.mark.version_independent
def test_a_rewrite_keeps_held_pins_comments_and_order_and_drops_repeats():
    resolved = {"torch": "2.15.0", "transformers": "5.24.0", "trl": "1.16.0", "cloudpickle": "3.1.3"}
    text, changes = tool.rewrite(FILE, resolved)
    assert text == (
        "# why the set is what it is\n"
        "torch==2.13.0  # held: the CPU build\n"
        "Transformers==5.24.0\n"
        "# trl: a reason that names 1.14.2\n"
        "trl==1.16.0\n"
        "cloudpickle==3.1.3\n"
    )
    assert changes == [
        "Transformers: 5.17.0 -> 5.24.0",
        "trl: 1.14.2 -> 1.16.0",
        "cloudpickle: 3.1.2 -> 3.1.3",
        "cloudpickle: repeated line removed",
    ]
    assert tool.rewrite(text, resolved) == (text, [])  # a second run changes nothing


@pytest.mark.version_independent
def test_a_pin_pip_no_longer_installs_is_named():
    with pytest.raises(ValueError, match="trl: not resolved; delete the pin or mark it held"):
        tool.rewrite(FILE, {"transformers": "5.24.0", "cloudpickle": "3.1.3"})


@pytest.mark.version_independent
def test_held_pins_are_what_pip_is_asked_for():
    assert list(tool.pins(FILE, held=True).values()) == ["torch==2.13.0"]
    assert tool.pins(FILE)["transformers"] == "Transformers==5.17.0"


@pytest.mark.version_independent
def test_the_other_sets_take_the_newest_sets_versions_for_all_they_do_not_hold():
    newest = tool.pins(tool.NEWEST.read_text())
    for path in tool.FOLLOWERS:
        following = tool.pins(path.read_text(), held=False)
        assert following.keys() <= newest.keys(), path.name
        assert {name: newest[name] for name in following} == following, f"{path.name}: run make constraints"
    # the Kaggle image's libraries (docs/versions.md)
    kaggle = {
        name: pin.partition("==")[2] for name, pin in tool.pins((REPO / "constraints-kaggle.txt").read_text()).items()
    }
    assert kaggle["transformers"].startswith("5.5.") and kaggle["trl"].startswith("0.24.")
    assert kaggle["peft"].startswith("0.19.") and kaggle["accelerate"].startswith("1.13.")
