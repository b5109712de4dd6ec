"""Run at start-up by every Python process of a module with `version_independent` tests (tests/conftest.py puts
this folder first on PYTHONPATH there): notes each import of a library whose pinned version differs between
the newest and the oldest set, so that the test that caused it fails unless it runs on both sets.

It only records: the import itself goes on as usual, so the processes behave as they would without it.
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec


class VersionedImports(MetaPathFinder):
    """Appends `name pid command` to `record` the first time a process looks for one of `names` (a top level)."""

    def __init__(self, names: frozenset[str], record: str):
        self.names, self.record = names, record

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if path is None and fullname in self.names:
            with open(self.record, "a") as out:
                out.write(f"{fullname} pid {os.getpid()}: {' '.join(sys.argv[:3])}\n")
        return None  # the usual finders import it


def install() -> VersionedImports | None:
    """Install the recorder this process's environment asks for (NBKIT_TEST_VERSIONED_*), if any."""
    record, names = os.environ.get("NBKIT_TEST_VERSIONED_RECORD"), os.environ.get("NBKIT_TEST_VERSIONED_NAMES")
    if not record or not names:
        return None
    finder = VersionedImports(frozenset(names.split(",")), record)
    sys.meta_path.insert(0, finder)
    return finder


install()
