"""What a rank's output does: one routine for the ranks of nbkit.launch and of a live set.

A rank writes at two levels: Python's sys.stdout and sys.stderr (print, logging, warnings, progress
bars), and its descriptors 1 and 2, which C and C++ code writes to directly (torch's DDP and c10d
warnings, gloo, NCCL, CUDA, a library's printf). A rank's two levels are shown or hidden together:

- hidden: both go to /dev/null. One-shot ranks other than 0, unless quiet=False.
- shown: both go, line by line, to one sink. One-shot ranks other than 0 with quiet=False
  (%%ddp --all-ranks): the notebook's streams the rank inherited, every line prefixed "[rank N] ".
  Live ranks: the relay to the notebook while a call shows the rank (its lowest rank, or all with
  --all-ranks), dropped otherwise; the notebook prefixes the ranks after the first.
- untouched: one-shot rank 0 keeps the notebook's streams and descriptors (what it writes reaches
  the cell exactly as the notebook's own output does).

At the descriptor level, descriptors 1 and 2 become the write ends of pipes, and a thread per pipe
passes what arrives to the rank's Python stream of the same name, where the same decision applies.
`RankOutput.drain()`, at the end of a live call and of a one-shot rank's function, has libc flush
its buffers and reads what the pipes hold, so nothing written during a call arrives after it.

Limits, by construction:
- libc buffers C code's stdout when it is a pipe: a printf to stdout shows at the next newline
  the library flushes, or at the end of the call (drain); C code's stderr is unbuffered.
- Lines of one rank's two levels keep their order within a level; a Python line and a C line
  written moments apart can arrive in either order.
- A rank that dies (a signal, an abort) loses what its reader thread had not read: a native
  crash's last line may be missing. Its exit signal is always reported, and a live rank's
  faulthandler stack is kept in its log (nbkit.rank_side.live_engine).
- The reader is a Python thread: C code that writes more than a pipe holds (1 MiB, where Linux
  grants it) while holding the GIL waits until the GIL is let go. ipykernel's own capture of a
  kernel's descriptors works the same way.
- Ranks of an outside launcher (torchrun, accelerate launch) keep their descriptors: that launcher
  owns them (torchrun's --tee, --local-ranks-filter); only their Python-level lines are prefixed,
  and, as for every one-shot rank, their Python streams write whole lines (`write_whole_lines`).
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import io
import os
import re
import select
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LineStream", "Prefixed", "RankOutput", "Sink", "flush_c_streams", "route_launched", "write_whole_lines"]

# Where shown text goes: sink(stream name "stdout" | "stderr", text).
Sink = Callable[[str, str], None]

_PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031  # fcntl's F_SETPIPE_SZ (Linux)


def route_launched(rank: int, quiet: bool, stdout: Any, stderr: Any, *, descriptors: bool = True) -> RankOutput | None:
    """Route the output of a one-shot rank (nbkit.launch) for the rest of its life.

    Args:
        rank: the rank. Rank 0 keeps its streams and descriptors: returns None.
        quiet: hide every rank but 0, at both levels (no thread, nothing to drain: returns None).
        stdout: the notebook's stdout, as the rank inherited it; a shown rank writes there.
        stderr: the notebook's stderr, likewise.
        descriptors: take descriptors 1 and 2 over too (False in ranks of an outside launcher).

    Returns:
        The RankOutput of a shown rank other than 0 (drain it when the function ends), else None.
    """
    if rank == 0:
        return None
    if quiet:
        _hide()
        return None
    prefix = f"[rank {rank}] "
    targets = {
        "stdout": Prefixed(_beside_descriptor(stdout, 1) if descriptors else stdout, prefix),
        "stderr": Prefixed(_beside_descriptor(stderr, 2) if descriptors else stderr, prefix),
    }

    def sink(name: str, text: str) -> None:
        targets[name].write(text)
        targets[name].flush()

    return RankOutput(sink, descriptors=descriptors)


def write_whole_lines() -> None:
    """Have this process's sys.stdout and sys.stderr pass on each line as it ends, in one write.

    For one-shot ranks, which share one stdout: that of the script that called nbkit.launch, or of
    the outside launcher that runs them (rank 0 writes to it directly). torchrun starts its ranks
    unbuffered (`python -u`), where print writes a line's text and its newline apart: another
    rank's line could land in between (an exported script's printed result came out unparsable).
    Block buffered (a pipe, started without -u), rank 0's lines would show only when 8 KiB
    gathered, cut anywhere. A line written in one write (Linux keeps a pipe write of up to 4 KiB
    whole) is never split. A stream that cannot be reconfigured (not a TextIOWrapper: a kernel's)
    is left as it is.
    """
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            with contextlib.suppress(ValueError, OSError):  # closed, or not writable
                stream.reconfigure(line_buffering=True, write_through=False)


def _beside_descriptor(stream: Any, fd: int) -> Any:
    """`stream`, or, where it writes to descriptor `fd` itself (a script's sys.stdout, not a
    kernel's), a stream on a copy of `fd` made now: the rank's `fd` is about to become a pipe whose
    reader writes here, which must not lead back into the pipe.
    """
    try:
        own = stream.fileno() == fd
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        own = False
    if not own:
        return stream
    stream.flush()
    return open(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace")


def _hide() -> None:
    devnull = open(os.devnull, "w")  # noqa: SIM115 (the rank's streams for the rest of its life)
    sys.stdout = sys.stderr = devnull
    os.dup2(devnull.fileno(), 1)
    os.dup2(devnull.fileno(), 2)


class RankOutput:
    """A rank's sys.stdout/sys.stderr and (with `descriptors`) its descriptors 1 and 2, routed to `sink`.

    Args:
        sink: takes (stream name, text) of whole lines (a partial line when drained).
        shown: whether the rank is shown now; what is written while it says False is dropped.
        descriptors: also take descriptors 1 and 2 over (pipes read by a thread each).

    Replaces sys.stdout and sys.stderr at once (for the rank's life: libraries keep the stream
    they find at import, and those imports happen later); close() puts back what it found.
    """

    def __init__(self, sink: Sink, *, shown: Callable[[], bool] = lambda: True, descriptors: bool = True):
        self._found = (sys.stdout, sys.stderr)
        self.stdout = LineStream("stdout", sink, shown, fileno=1)
        self.stderr = LineStream("stderr", sink, shown, fileno=2)
        if descriptors:
            for stream in self._found:  # what Python holds for the descriptors goes out first
                with contextlib.suppress(Exception):
                    stream.flush()
        self._readers = [_DescriptorReader(1, self.stdout), _DescriptorReader(2, self.stderr)] if descriptors else []
        sys.stdout, sys.stderr = self.stdout, self.stderr

    def drain(self) -> None:
        """Pass on everything written so far, at both levels, partial lines included."""
        if self._readers:
            flush_c_streams()
        for reader in self._readers:
            reader.read_available()
        for stream in (self.stdout, self.stderr):
            stream.flush()

    def close(self) -> None:
        """Drain, then give the descriptors and sys.stdout/sys.stderr back as they were found."""
        self.drain()
        for reader in self._readers:
            reader.close()
        self._readers = []
        sys.stdout, sys.stderr = self._found


class LineStream(io.TextIOBase):
    r"""A rank's sys.stdout or sys.stderr: whole lines to `sink` while `shown()`, dropped otherwise.

    A line ends at "\n" or "\r" (progress bars redraw with "\r"); flush() sends a partial line.
    Whole lines matter: print() writes its pieces one by one, and two ranks' pieces would
    otherwise interleave within a line. Safe to write from several threads (the descriptor
    readers write here too).
    """

    def __init__(self, name: str, sink: Sink, shown: Callable[[], bool], *, fileno: int):
        self.name, self._sink, self._shown, self._fileno = name, sink, shown, fileno
        self._pending = ""
        self._lock = threading.RLock()

    def writable(self) -> bool:
        """Always True."""
        return True

    def write(self, text: str) -> int:
        """Keep `text`; send the lines it completes (nothing while the rank is not shown)."""
        if not text or not self._shown():
            return len(text)
        with self._lock:
            self._pending += text
            end = max(self._pending.rfind("\n"), self._pending.rfind("\r")) + 1
            if end:
                complete, self._pending = self._pending[:end], self._pending[end:]
                self._send(complete)
        return len(text)

    def flush(self) -> None:
        """Send the partial line kept so far."""
        with self._lock:
            pending, self._pending = self._pending, ""
        if pending and self._shown():
            self._send(pending)

    def _send(self, text: str) -> None:
        try:
            self._sink(self.name, text)
        except Exception:  # the notebook is gone (the rank is about to end), or a display problem
            pass

    def isatty(self) -> bool:
        """False: a rank's output is never a terminal (progress bars then print plain lines)."""
        return False

    def fileno(self) -> int:
        """The descriptor this stream stands for (1 or 2), which the rank's C code writes to."""
        return self._fileno


class Prefixed(io.TextIOBase):
    r"""A text stream that starts every line written to `target` with `prefix`.

    Lines end at "\n" or at "\r"; text is passed on at once.
    """

    def __init__(self, target: Any, prefix: str):
        self._target, self._prefix, self._at_line_start = target, prefix, True

    def writable(self) -> bool:
        """Always True."""
        return True

    def write(self, text: str) -> int:
        """Write `text` to the target, the prefix at the start of each line."""
        out = []
        for piece in re.split(r"(?<=[\r\n])", text):
            if not piece:
                continue
            if self._at_line_start:
                out.append(self._prefix)
            out.append(piece)
            self._at_line_start = piece.endswith(("\n", "\r"))
        self._target.write("".join(out))
        return len(text)

    def flush(self) -> None:
        """Flush the target."""
        self._target.flush()

    def isatty(self) -> bool:
        """False: prefixed lines are never a terminal's."""
        return False

    def fileno(self) -> int:
        """The target's descriptor."""
        return int(self._target.fileno())


class _DescriptorReader:
    """Descriptor `fd` replaced by a pipe; a thread passes what arrives to `stream` as text."""

    def __init__(self, fd: int, stream: LineStream):
        self.fd, self._stream = fd, stream
        read_end, write_end = os.pipe()
        with contextlib.suppress(OSError, ImportError):
            import fcntl

            fcntl.fcntl(write_end, _F_SETPIPE_SZ, _PIPE_BYTES)
        os.set_blocking(read_end, False)
        self._read_end = read_end
        self._saved = os.dup(fd)
        os.dup2(write_end, fd)
        os.close(write_end)
        self._wake_read, self._wake_write = os.pipe()  # close() wakes the thread through this
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"nbkit-rank-fd{fd}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                ready, _, _ = select.select([self._read_end, self._wake_read], [], [])
            except (OSError, ValueError):
                return
            if self._wake_read in ready:
                return
            if not self.read_available():
                return

    def read_available(self) -> bool:
        """Pass on what the pipe holds now; False once it can give no more (closed)."""
        with self._lock:
            if self._closed:
                return False
            while True:
                try:
                    chunk = os.read(self._read_end, 65536)
                except BlockingIOError:
                    return True
                except OSError:
                    return False
                if not chunk:
                    return False
                self._stream.write(self._decoder.decode(chunk))

    def close(self) -> None:
        """Point the descriptor back where it pointed, read what is left, end the thread."""
        os.dup2(self._saved, self.fd)
        os.close(self._saved)
        self.read_available()
        with self._lock:
            self._closed = True
        os.write(self._wake_write, b"x")
        self._thread.join(timeout=5)
        for end in (self._read_end, self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(end)


def flush_c_streams() -> None:
    """fflush(NULL): what C code printed to stdout sits in libc's buffer while stdout is a pipe."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(None).fflush(None)
