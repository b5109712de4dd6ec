"""Where a training step makes the host wait for the GPU: the Python sites of its synchronising CUDA calls, counted.

Under `torch.cuda.set_sync_debug_mode("warn")` torch warns at every call that blocks the host until the GPU
has caught up (`.item()`, `.tolist()`, `nonzero`, a copy into pageable memory). `SyncSites.watch()` turns
that mode on for the code it wraps and counts the warnings by site: the innermost frames outside torch,
so that a transformers line or an nbkit line names who asked. A profile counts the syncs (158 per step
at 1K x 4 on one H200); this says which code makes them, the first thing to know before removing one.
Syncs inside a backward surface at the `backward()` call: autograd's worker thread hands its warnings
to the thread that called it.
"""

from __future__ import annotations

import collections
import contextlib
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch

# What torch's warning says (c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync).
SYNC_WARNING = "called a synchronizing CUDA operation"


def site(frames: list[traceback.FrameSummary], depth: int = 2) -> str:
    """The `depth` innermost frames not in torch, innermost first, as "file:line function" joined by " < ", after
    the innermost frame of all and " | " where that one is torch's (which torch call made the host wait).
    """
    frames = [f for f in frames if not f.filename.endswith(("/warnings.py", "/sync_sites.py"))]
    outside = [f for f in frames if "/torch/" not in f.filename]
    callers = " < ".join(_frame(f) for f in reversed(outside[-depth:]))
    return f"{_frame(frames[-1])} | {callers}" if frames and "/torch/" in frames[-1].filename else callers


def _frame(frame: traceback.FrameSummary) -> str:
    return f"{_short(frame.filename)}:{frame.lineno} {frame.name}"


def _short(path: str) -> str:
    """A frame's file from its package on: "transformers/models/...", "nbkit/training/...", else as it is."""
    # /tmp/site/: where benchmarks/gpu_suite.sh installs the GPU hosts' wheels
    for marker in ("site-packages/", "dist-packages/", "/tmp/site/"):
        if marker in path:
            return path.split(marker, 1)[1]
    for package in ("/nbkit/", "/benchmarks/"):
        if package in path:
            return package.lstrip("/") + path.split(package, 1)[1]
    return path


class SyncSites:
    """Counts synchronising CUDA calls by site over the spans that `watch()` wraps (any thread's warnings
    that reach this one). `counts` maps a site to its number of syncs.
    """

    def __init__(self, depth: int = 2) -> None:
        self.depth = depth
        self.counts: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        cuda = torch.cuda.is_available()
        before = torch.cuda.get_sync_debug_mode() if cuda else 0
        with warnings.catch_warnings():
            # Every sync, not only the first from each line; other warnings keep their filters.
            warnings.filterwarnings("always", message=f".*{SYNC_WARNING}", category=UserWarning)
            shown = warnings.showwarning

            def record(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
                if SYNC_WARNING in str(message):
                    self.counts[site(traceback.extract_stack(), self.depth)] += 1
                else:
                    shown(message, category, filename, lineno, *rest)

            warnings.showwarning = record
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(before)

    def top(self, n: int = 12) -> dict[str, int]:
        """The `n` sites with the most syncs, most first, and the rest as "(other sites)": the values add up to all."""
        busiest = dict(self.counts.most_common(n))
        rest = sum(self.counts.values()) - sum(busiest.values())
        return {**busiest, "(other sites)": rest} if rest else busiest
