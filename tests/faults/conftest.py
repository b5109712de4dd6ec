"""The fault matrix's shared check: whatever a case does, nothing of it is left behind.

`leftovers` snapshots this test process before each case: its child processes
(zombies included), open descriptors, Python threads, listening TCP sockets, and nbkit's files in
the temporary directory; after the case the same must hold. Automatic garbage collection is off
during a case, so a launch must release its resources itself rather than through a later
collection (a rendezvous socket once stayed open until then).

A module opts in with `pytestmark = pytest.mark.usefixtures("leftovers")` (not autouse: modules of
the matrix that drive kernels from other test code decide for themselves), and marks with
`leftovers_ignore(...)` what this process cannot attribute to nbkit. Cases use faultkit's
`failed_within(seconds)` to time a fault and `assert_reruns()` for the immediate rerun.

`kernel` is the live-set modules' notebook: one real Jupyter kernel per module.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultkit import SETTLE_S, Kernel, Snapshot, assert_reruns
from version_split import Record


@pytest.fixture(scope="module")
def private_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A temporary directory of the module's own (TMPDIR, also for every process it starts): other
    test runs on this machine share /tmp, and their files are not this matrix's leftovers. Put
    back after the module, so tests outside the matrix see the usual one.
    """
    path = tmp_path_factory.mktemp("tmpdir")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(path))
        mp.setattr(tempfile, "tempdir", str(path))
        yield path


@pytest.fixture(scope="module")
def warmed_up(private_tmp: Path, versioned_imports: Record | None) -> None:
    """One launch before the first case: a process's first torch TCPStore creates a pipe pair that
    the process keeps for good (libuv's process-wide signal pipe: one per process, not per
    launch, measured here), which is not a leftover of the case that happens to run first.
    """
    assert os.environ["TMPDIR"] == str(private_tmp)
    assert_reruns(2)
    if versioned_imports is not None:
        # The launch imports accelerate here, for the fixture, not for the version_independent case that happens to
        # come first (a live-set case when the module's fork cases are deselected).
        versioned_imports.since_last()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "leftovers_ignore(*kinds): leftover kinds ('descriptors', 'threads', ...) that this test process "
        "cannot attribute to nbkit (say why where it is used)",
    )


@pytest.fixture
def leftovers(request: pytest.FixtureRequest, warmed_up: None) -> Iterator[Snapshot]:
    """Fail the case if it left a process, descriptor, thread, listening port or nbkit file."""
    if not Path("/proc/self/fd").exists():
        pytest.skip("the leftover checks read Linux /proc")
    # What earlier tests left for the collector is not this case's: set aside for the case (gc.freeze), so that
    # no collection during it (a launch's own) reaches it. (A full collection here instead took 0.3 s a case: this
    # process holds ~500,000 objects.)
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        before = Snapshot.take()
        try:
            yield before
        finally:
            if was_enabled:
                gc.enable()
        marker = request.node.get_closest_marker("leftovers_ignore")
        ignored = set(marker.args) if marker else set()

        def grown() -> dict[str, list]:
            return {k: v for k, v in Snapshot.take().grown_since(before).items() if k not in ignored}

        deadline = time.monotonic() + SETTLE_S
        while (left := grown()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"left behind: {left}"
    finally:
        gc.unfreeze()


@pytest.fixture(scope="module")
def kernel(
    request: pytest.FixtureRequest, kernel_name: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Kernel]:
    """A Jupyter kernel for the module's cases, in a temporary directory named after the module, with
    nbkit's magics loaded and `nbkit, os, signal, time` imported. Module-scoped: starting a kernel and a
    live set takes seconds, so a module's cases share them (each case starts a set if none runs)."""
    with Kernel(kernel_name, tmp_path_factory.mktemp(request.module.__name__)) as k:
        setup = k.run("%load_ext nbkit\nimport nbkit, os, signal, time")
        assert setup["error"] is None, setup
        yield k
