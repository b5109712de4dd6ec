"""A failure that pytest cannot render is one failed test with its cause, and the run goes on (plain_failures)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FAILING = """
import ast


def test_fails_where_its_source_cannot_be_parsed(monkeypatch):
    def broken(*args, **kwargs):
        raise SystemError("AST constructor recursion depth mismatch (before=129, after=183)")

    monkeypatch.setattr(ast, "parse", broken)  # as CPython 3.11's shared AST counter can make it fail
    try:
        raise ValueError("the cause")
    except ValueError:
        assert False, "the test's own failure"


def test_after_it():
    pass
"""


def test_an_unrenderable_failure_is_one_failed_test_naming_its_cause_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "test_unrenderable.py").write_text(FAILING)
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "plain_failures", "-p", "no:cacheprovider", "-o", "addopts="],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout + run.stderr
    assert "INTERNALERROR" not in out, out
    assert "1 failed, 1 passed" in out, out
    assert "pytest could not render this failure: AST constructor recursion depth mismatch" in out, out
    assert "AssertionError: the test's own failure" in out and "ValueError: the cause" in out, out
    assert "test_unrenderable.py:13 in test_fails_where_its_source_cannot_be_parsed" in out, out
