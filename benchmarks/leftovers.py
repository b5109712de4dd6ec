"""What of this process a launch could leave behind, in one snapshot: its child processes (zombies
included), open descriptors, threads, listening TCP ports, files in the temporary directory,
/dev/shm entries and resident memory (Linux /proc).

Two users: soak.py samples it after every launch and reports the growth over hundreds of them,
and the fault tests (tests/faults) compare one taken before a case with one taken after it, where
any new item is a leak. Both watch for the same leaks, so they read /proc the same way.
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Snapshot"]


@dataclass(frozen=True)
class Snapshot:
    """What of this process a fault or a leak could leave behind (see the module doc).

    children: pids. fds: 'fd -> target', so that a descriptor closed and reopened elsewhere shows.
    threads: Python threads as 'name#ident'. os_threads: the process's kernel threads (tids; torch
    and gloo start threads Python does not see). listening: TCP ports. tmp_files: paths in the
    temporary directory, except ipykernel_PID folders (where ipykernel keeps its cells' code: the
    kernel's, not nbkit's) and torch's compile cache, torchinductor_USER (made by any process's first import
    of torch._dynamo, kept for the next). dev_shm: entry names. rss_mib: resident memory.
    """

    children: frozenset[int]
    fds: frozenset[str]
    threads: frozenset[str]
    os_threads: frozenset[int]
    listening: frozenset[int]
    tmp_files: frozenset[str]
    dev_shm: frozenset[str]
    rss_mib: float

    @classmethod
    def take(cls) -> Snapshot:
        """This process, now."""
        return cls(
            children=frozenset(_children()),
            fds=frozenset(_fds()),
            threads=frozenset(f"{t.name}#{t.ident}" for t in threading.enumerate()),
            os_threads=frozenset(int(tid) for tid in os.listdir("/proc/self/task")),
            listening=frozenset(_listening_ports()),
            tmp_files=frozenset(_tmp_files()),
            dev_shm=frozenset(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else frozenset(),
            rss_mib=_rss_mib(),
        )

    def grown_since(self, before: Snapshot) -> dict[str, list]:
        """What is here now and was not in `before`: {what: [items]}, only kinds with new items.

        Compares what a launch owns and must release: child processes, descriptors, Python
        threads, listening ports, temporary files. Kernel threads, /dev/shm and memory are left to
        the counts (`counts()`): libraries grow their thread pools and caches on first use, and
        other processes on the machine write to /dev/shm, so a new item there is no leak by itself.
        """
        grown: dict[str, list] = {
            "child processes": sorted(self.children - before.children),
            "descriptors": sorted(self.fds - before.fds),
            "threads": sorted(self.threads - before.threads),
            "listening ports": sorted(self.listening - before.listening),
            "files in the temporary directory": sorted(self.tmp_files - before.tmp_files),
        }
        return {what: items for what, items in grown.items() if items}

    def counts(self) -> dict[str, float]:
        """How many of each, for a growth over many launches: fds, threads, os_threads, children,
        dev_shm, listening, tmp_files and rss_mib (MiB, one decimal).
        """
        return {
            "fds": len(self.fds),
            "threads": len(self.threads),
            "os_threads": len(self.os_threads),
            "children": len(self.children),
            "dev_shm": len(self.dev_shm),
            "listening": len(self.listening),
            "tmp_files": len(self.tmp_files),
            "rss_mib": round(self.rss_mib, 1),
        }


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


def _tmp_files() -> list[str]:
    others = ("ipykernel_", "torchinductor_")
    return [
        p for p in glob.glob(os.path.join(tempfile.gettempdir(), "*")) if not os.path.basename(p).startswith(others)
    ]


def _rss_mib() -> float:
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
