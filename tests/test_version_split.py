"""The split between the two sets CI tests on: `make test-oldest` leaves out the tests marked version_independent,
and the recorder in tests/versioned_imports is what keeps that marker true (tests/conftest.py fails a marked test
whose processes import a library the sets differ in)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from version_split import RECORDER, START_UP_IMPORTERS, Record, versioned_modules


def test_the_watched_modules_are_those_of_the_libraries_pinned_differently():
    # constraints.txt and constraints-oldest.txt pin these to different versions (with any other top-level
    # module their distributions install: trl 0.22 also installs `examples` and `scripts`) ...
    watched = versioned_modules()
    assert {"accelerate", "datasets", "huggingface_hub", "peft", "tokenizers", "transformers", "trl"} <= watched
    # ... and torch and the notebook stack the same in both.
    assert not watched & {"torch", "ipyparallel", "ipykernel", "jupyter_client", "zmq", "IPython", "cloudpickle"}


def _run(code: str, record: Path) -> None:
    env = {
        **os.environ,
        "NBKIT_TEST_VERSIONED_RECORD": str(record),
        "NBKIT_TEST_VERSIONED_NAMES": ",".join(sorted(versioned_modules())),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(RECORDER), os.environ.get("PYTHONPATH")])),
    }
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_a_started_process_records_what_it_imports_and_who_asked(tmp_path):
    record = tmp_path / "imports.txt"
    record.touch()
    _run("import json, torch\ndef load():\n    import tokenizers\nload()", record)
    lines = record.read_text().splitlines()
    assert [line.split()[:2] for line in lines] == [["tokenizers", "__main__.load"]], lines
    assert Record(record, versioned_modules()).since_last() == lines  # what a marked test fails with


def test_a_ranks_start_up_import_is_expected_and_nothing_else_is(tmp_path):
    record = tmp_path / "imports.txt"
    record.touch()
    _run("from nbkit.rank_side import reporting\nreporting._progress_bars_off()\nimport peft", record)
    importers = {line.split()[1] for line in record.read_text().splitlines()}
    assert importers > START_UP_IMPORTERS  # recorded (huggingface_hub), and what peft imports in turn
    left = Record(record, versioned_modules()).since_last()
    assert [line.split()[:2] for line in left] == [["peft", "__main__.<module>"]], left
