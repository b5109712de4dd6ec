"""The package stays easy to walk into: no class over 400 lines and no function over 80 in nbkit/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nbkit"
LIMITS = {ast.ClassDef: 400, ast.FunctionDef: 80, ast.AsyncFunctionDef: 80}


@pytest.mark.version_independent
def test_no_class_over_400_lines_and_no_function_over_80():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            limit = LIMITS.get(type(node))
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                lines = node.end_lineno - node.lineno + 1
                too_long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long, "split these along their seams:\n" + "\n".join(too_long)
