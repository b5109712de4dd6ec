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
    """Appends `name importer pid command` to `record` each time a process looks for one of `names` (a top
    level); the importer is the module and function whose import statement asked for it."""

    def __init__(self, names: frozenset[str], record: str):
        self.names, self.record = names, record

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if path is None and fullname in self.names:
            with open(self.record, "a") as out:
                out.write(f"{fullname} {_importer()} pid {os.getpid()}: {' '.join(sys.argv[:3])}\n")
        return None  # the usual finders import it


def _importer() -> str:
    """`module.function` of the innermost frame outside the import machinery and this file."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith("<frozen") or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_name}"


def install() -> VersionedImports | None:
    """Install the recorder this process's environment asks for (NBKIT_TEST_VERSIONED_*), if any."""
    record, names = os.environ.get("NBKIT_TEST_VERSIONED_RECORD"), os.environ.get("NBKIT_TEST_VERSIONED_NAMES")
    if not record or not names:
        return None
    finder = VersionedImports(frozenset(names.split(",")), record)
    sys.meta_path.insert(0, finder)
    return finder


install()
