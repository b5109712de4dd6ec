"""docs/patches.md lists every patch group and every patch nbkit declares, as nbkit renders them."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from nbkit.platform import patch_groups, patching

DOC = Path(__file__).resolve().parents[1] / "docs" / "patches.md"


def _declare_all() -> None:
    for group in patch_groups.GROUPS.values():
        importlib.import_module(group.module)


@pytest.mark.version_independent
def test_every_group_is_in_the_table_and_declared_where_it_says():
    _declare_all()
    assert {p.group for p in patching.registered()} == set(patch_groups.GROUPS)
    for p in patching.registered():
        declaring = patch_groups.GROUPS[p.group].module
        assert p.factory.__module__ == declaring, (p.target, p.factory.__module__, declaring)


@pytest.mark.version_independent
def test_docs_list_every_group_and_every_declared_patch():
    _declare_all()
    text = DOC.read_text()
    assert patch_groups.describe() in text and patching.describe() in text, (
        "docs/patches.md is out of date: paste in the output of "
        "`python -c 'import tests.test_patches_doc as t; t.render()'`"
    )
    declared = {p.target.partition(":")[0].split(".")[0] for p in patching.registered()}
    assert {"torch", "transformers", "accelerate", "unsloth", "unsloth_zoo"} <= declared


def render() -> None:
    """Print the two tables that docs/patches.md holds."""
    _declare_all()
    print(patch_groups.describe())
    print(patching.describe())
