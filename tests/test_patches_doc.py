"""docs/patches.md lists every patch nbkit declares, as nbkit.patching.describe() renders it."""

from __future__ import annotations

import importlib
from pathlib import Path

from nbkit import patching

# Every module that declares patches through nbkit.patching.
DECLARING = (
    "nbkit.forksafety",
    "nbkit.launching",
    "nbkit.guard",
    "nbkit.savers.unsloth",
    "nbkit.reporting",
    "nbkit.checkpoints",
    "nbkit.offline",
    "nbkit.compat",
)
DOC = Path(__file__).resolve().parents[1] / "docs" / "patches.md"


def test_docs_list_every_declared_patch():
    for module in DECLARING:
        importlib.import_module(module)
    table = patching.describe()
    assert table in DOC.read_text(), (
        "docs/patches.md is out of date: paste in the output of "
        "`python -c 'import tests.test_patches_doc as t; t.render()'`"
    )
    declared = {p.target.partition(":")[0].split(".")[0] for p in patching.registered()}
    assert {"torch", "transformers", "accelerate", "unsloth", "unsloth_zoo"} <= declared


def render() -> None:
    for module in DECLARING:
        importlib.import_module(module)
    print(patching.describe())
