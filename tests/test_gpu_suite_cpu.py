"""benchmarks/gpu_suite.sh's test parts: together they run every gpu-marked test file, and each part ends
within one 9-minute call on the GPU host (its own time limit says so)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _test_parts() -> dict[str, tuple[int, list[str]]]:
    script = (ROOT / "benchmarks" / "gpu_suite.sh").read_text()
    block = script[script.index("TEST_PARTS=(") : script.index("\n)\n", script.index("TEST_PARTS=("))]
    parts = {}
    for entry in re.findall(r'"([^"]*)"', block):
        name, limit, *args = entry.split()
        parts[name] = (int(limit), [arg.split(":")[0] for arg in args])
    return parts


@pytest.mark.version_independent
def test_the_parts_name_every_gpu_marked_file_and_each_fits_a_9_minute_call():
    parts = _test_parts()
    named = {path for _, paths in parts.values() for path in paths}
    marked = {
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if re.search(r"mark\.gpu\b", path.read_text())
    }
    assert marked - named == set(), "gpu-marked files no part of gpu_suite.sh's `tests` names"
    assert named <= marked, "parts name files without gpu-marked tests"
    assert all(name.startswith("tests_") and limit <= 540 for name, (limit, _) in parts.items()), parts
