"""What the fault matrix checks around every case (used by conftest.py's `leftovers` fixture and
by the cases): snapshots of what a fault could leave behind, timing, and the immediate rerun.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nbkit

# Kernel cases shut their kernel down asynchronously (jupyter_client), and the last reaping of a
# launch can trail its return by a scheduling slice on this loaded machine: what is still there
# after this long is a leftover.
SETTLE_S = 10.0


@dataclass(frozen=True)
class Snapshot:
    """What of this process a fault could leave behind."""

    children: frozenset[int]
    fds: frozenset[str]
    threads: frozenset[str]
    listening: frozenset[int]
    tmp_files: frozenset[str]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(
            children=frozenset(_children()),
            fds=frozenset(_fds()),
            threads=frozenset(f"{t.name}#{t.ident}" for t in threading.enumerate()),
            listening=frozenset(_listening_ports()),
            tmp_files=frozenset(_nbkit_tmp_files()),
        )

    def grown_since(self, before: Snapshot) -> dict[str, list]:
        grown = {
            "child processes": sorted(self.children - before.children),
            "descriptors": sorted(self.fds - before.fds),
            "threads": sorted(self.threads - before.threads),
            "listening ports": sorted(self.listening - before.listening),
            "files in the temporary directory": sorted(self.tmp_files - before.tmp_files),
        }
        return {what: items for what, items in grown.items() if items}


def _children() -> list[int]:
    """This process's children, zombies (exited, not yet reaped) included."""
    me, found = os.getpid(), []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(stat).read_text().rsplit(") ", 1)[1].split()
            if int(fields[1]) == me:
                found.append(int(stat.split("/")[2]))
    return found


def _fds() -> list[str]:
    """Open descriptors as 'fd -> target', so a descriptor closed and reopened elsewhere shows."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
    return found


def _listening_ports() -> list[int]:
    """TCP ports on which a socket of this process listens."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _nbkit_tmp_files() -> list[str]:
    """Everything in the temporary directory (the matrix's own: conftest's private_tmp), except
    the ipykernel_PID folders where ipykernel keeps its cells' code (the kernel's, not nbkit's).
    """
    return [p for p in glob.glob(os.path.join(tempfile.gettempdir(), "*")) if "ipykernel_" not in p]


@contextlib.contextmanager
def failed_within(seconds: float) -> Iterator[None]:
    """The block must end (by raising, normally) within `seconds` of wall time."""
    start = time.monotonic()
    yield
    took = time.monotonic() - start
    assert took < seconds, f"took {took:.1f} s, more than {seconds} s"


def _answer() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = __import__("torch").ones(1) * (nbkit.rank() + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def assert_reruns(gpus: int = 2) -> None:
    """The same kind of launch works at once after the fault."""
    assert nbkit.launch(_answer, gpus=gpus) == gpus * (gpus + 1) // 2
