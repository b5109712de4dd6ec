"""docs/architecture.md describes the tree as it is: every module of nbkit/ has its row in a table there, and
every path the page names exists.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
# A table row starts with the module's path: | `nbkit/rank_side/live_engine.py` | ...
_ROW = re.compile(r"^\| `(nbkit/[\w/]+\.py)` \|", re.MULTILINE)
# Any path into the repository the page names, in a table or in prose.
_PATH = re.compile(r"(?<![\w/.])((?:nbkit|tests|docs|notebooks|benchmarks)/[\w/.-]*[\w/])")


def _modules() -> set[str]:
    return {path.relative_to(ROOT).as_posix() for path in (ROOT / "nbkit").rglob("*.py")}


@pytest.mark.version_independent
def test_every_module_of_nbkit_has_one_row():
    rows = Counter(_ROW.findall(DOC.read_text()))
    missing = sorted(_modules() - set(rows))
    twice = sorted(name for name, count in rows.items() if count > 1)
    assert not missing, "docs/architecture.md: add a row for each of these modules:\n" + "\n".join(missing)
    assert not twice, "docs/architecture.md: one row per module; these have several:\n" + "\n".join(twice)


@pytest.mark.version_independent
def test_every_path_the_page_names_exists():
    named = set(_PATH.findall(DOC.read_text()))
    assert any(name.startswith("nbkit/") for name in named)  # the pattern still reads the page
    gone = sorted(name for name in named if not (ROOT / name).exists())
    assert not gone, "docs/architecture.md names paths the tree does not have:\n" + "\n".join(gone)
