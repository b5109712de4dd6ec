"""Run at start-up by every Python process of a module with `version_independent` tests (tests/conftest.py puts
this folder first on PYTHONPATH there): notes each import of a library whose pinned version differs between
the newest and the oldest set, and each read of such a library's installed metadata (code that chooses what to do
by `importlib.metadata.version(...)` depends on the version without importing the library), so that the test that
caused it fails unless it runs on both sets.

It only records: the import or read itself goes on as usual, so the processes behave as they would without it.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import threading
from collections.abc import Callable
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from typing import Any


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


# importlib.metadata's functions that read one distribution's installed metadata by its name.
METADATA_READS = ("version", "distribution", "metadata", "requires", "files")


def watch_metadata(names: frozenset[str], record: str) -> Callable[[], None]:
    """Note `<name>(metadata) reader pid command` in `record` each time this process reads the metadata of a
    distribution among `names`; returns what puts importlib.metadata's functions back."""
    originals = {attr: getattr(importlib.metadata, attr) for attr in METADATA_READS}
    inside = threading.local()  # version() calls distribution(): one read, noted once

    def watched(read: Callable[..., Any]) -> Callable[..., Any]:
        def reading(distribution_name: str, *args: Any, **kwargs: Any) -> Any:
            if not getattr(inside, "read", False) and str(distribution_name).lower().replace("-", "_") in names:
                with open(record, "a") as out:
                    command = " ".join(sys.argv[:3])
                    out.write(f"{distribution_name}(metadata) {_importer()} pid {os.getpid()}: {command}\n")
            outer, inside.read = getattr(inside, "read", False), True
            try:
                return read(distribution_name, *args, **kwargs)
            finally:
                inside.read = outer

        return reading

    def unwatch() -> None:
        for attr, read in originals.items():
            setattr(importlib.metadata, attr, read)

    for attr, read in originals.items():
        setattr(importlib.metadata, attr, watched(read))
    return unwatch


def _importer() -> str:
    """`module.function` of the innermost frame outside the import machinery, importlib.metadata and this file."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith("<frozen")
        or frame.f_code.co_filename in (__file__, importlib.metadata.__file__)
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
    watch_metadata(finder.names, record)
    return finder


install()
