"""Where this process runs: the host (Kaggle, Colab or a machine of one's own) and the frontend
that shows its output (a notebook a person watches, a headless run, a terminal or a script).

One place reads the marks each platform leaves, for the three parts of nbkit that behave
differently by platform: the dashboard (a live panel only where a person watches), the doctor
(which secret store to ask, Kaggle's one-GPU advice) and checkpoints (Kaggle's attached inputs are
searched for earlier runs).

The marks read:

- Kaggle: KAGGLE_KERNEL_RUN_TYPE ("Interactive", or "Batch" for "Save & Run All") or
  KAGGLE_URL_BASE in the environment; attached datasets and saved outputs under /kaggle/input.
- Colab: COLAB_RELEASE_TAG or COLAB_GPU in the environment.
- VS Code: a cell id of the form "vscode-notebook-cell:..." in the execution request, or VSCODE_PID
  in a kernel that no Jupyter server started (VS Code starts its kernels itself, and they inherit
  the editor's environment).
- JupyterLab / Notebook: JPY_SESSION_NAME (set by jupyter_server 2+ for a notebook's kernel), a
  cell id in the execution request (JupyterLab and Notebook 7 send one; nbclient sends none), or a
  Jupyter server as the kernel's parent process (the classic Notebook 6.5 sets neither mark, and
  nbclient and papermill start their kernels without a server).
- A headless run: papermill, nbclient, nbconvert, nbmake, pytest or testbook among the command
  lines of the kernel's parent processes (Linux /proc).

`memory_gib()` reads how much CPU memory the machine gives this process: the smaller of the kernel's total and
the memory limit of the control group it runs in (Kaggle's and Colab's notebooks run in containers, whose
/proc/meminfo shows the whole host).

`current()` looks again at every call: it reads a few environment variables and, in a kernel, up
to four /proc files, and what it reads can change within a process (%env, a test's environment).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbkit.platform import shell as nbkit_shell

__all__ = ["KAGGLE_INPUT", "Platform", "current", "detect", "kaggle_input", "memory_gib"]

# The memory limits of this process's control group (v2, then v1), and the kernel's view of the machine.
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
MEMINFO = Path("/proc/meminfo")

# Where Kaggle attaches datasets and saved notebook outputs (a module attribute so that tests can
# point it at a temporary folder).
KAGGLE_INPUT = Path("/kaggle/input")

# Programs that execute notebooks without a person watching: their kernels have no live frontend.
_HEADLESS_RUNNERS = ("papermill", "nbclient", "nbconvert", "jupyter-execute", "nbmake", "pytest", "testbook")

# Command-line marks of a Jupyter server process (jupyter lab / notebook / server, as exec'd).
_JUPYTER_SERVERS = ("jupyter-lab", "jupyter-notebook", "jupyter-server", "jupyter lab", "jupyter notebook")

_VSCODE_CELL = "vscode-notebook-cell"

# The frontend's words in the doctor's platform line, after "local (...)".
_FRONTEND_TEXT = {
    "script": "(script)",
    "ipython": "(IPython)",
    "jupyter": "(Jupyter kernel), shown in JupyterLab/Notebook",
    "vscode": "(Jupyter kernel), shown in VS Code",
    "headless": "(Jupyter kernel), run headless (papermill, nbclient or the like)",
    "kernel": "(Jupyter kernel)",
}


@dataclass(frozen=True)
class Platform:
    """Where this process runs.

    host: "kaggle", "colab" or "local". frontend: "kaggle" or "colab" (a kernel of theirs),
    "vscode", "jupyter" (JupyterLab or Notebook), "headless" (a kernel run by papermill, nbclient
    and the like), "kernel" (a Jupyter kernel with no sign of who shows it), "ipython" (terminal
    IPython) or "script" (no IPython shell: a script, a terminal, a launched rank). batch: a Kaggle
    "Save & Run All" run, which nobody watches.
    """

    host: str
    frontend: str
    batch: bool = False

    @property
    def watched(self) -> bool:
        """Whether a person watches this kernel's output live in a notebook (positive evidence only)."""
        return self.frontend in ("kaggle", "colab", "vscode", "jupyter") and not self.batch

    @property
    def description(self) -> str:
        """One phrase for people: 'Kaggle (interactive session)', 'Colab', 'local (Jupyter kernel),
        shown in VS Code', ...
        """
        if self.host == "kaggle":
            return f"Kaggle ({'batch run: Save & Run All' if self.batch else 'interactive session'})"
        if self.host == "colab":
            return "Colab"
        return f"local {_FRONTEND_TEXT[self.frontend]}"


def current() -> Platform:
    """The platform of this process, from its environment, its IPython shell and its parent processes."""
    return detect(os.environ, nbkit_shell.current())


def detect(environ: Mapping[str, str], shell: Any, ancestors: list[str] | None = None) -> Platform:
    """The platform that `environ` (environment variables), `shell` (the IPython shell, or None) and
    `ancestors` (the parent processes' command lines, lower case, up to and including the first
    Jupyter server's; default: read from /proc when needed) describe. See the module doc for the marks.
    """
    run_type = environ.get("KAGGLE_KERNEL_RUN_TYPE")
    if run_type is not None or environ.get("KAGGLE_URL_BASE"):
        host = "kaggle"
    elif environ.get("COLAB_RELEASE_TAG") or environ.get("COLAB_GPU") is not None:
        host = "colab"
    else:
        host = "local"
    batch = host == "kaggle" and (run_type or "").lower() == "batch"
    if shell is None:
        return Platform(host, "script", batch)
    if not hasattr(shell, "kernel"):
        return Platform(host, "ipython", batch)
    if host != "local":
        return Platform(host, host, batch)
    if ancestors is None:
        ancestors = _ancestor_cmdlines()
    # The server's own command line says nothing about who runs it (a test, a terminal): only that it serves.
    served = bool(ancestors) and _is_server(ancestors[-1])
    parents = ancestors[:-1] if served else ancestors
    if any(runner in cmdline for cmdline in parents for runner in _HEADLESS_RUNNERS):
        return Platform(host, "headless")
    cell = _cell_id(shell)
    session = bool(environ.get("JPY_SESSION_NAME")) or served
    if cell.startswith(_VSCODE_CELL) or (environ.get("VSCODE_PID") and not session):
        return Platform(host, "vscode")
    if session or cell:
        return Platform(host, "jupyter")
    return Platform(host, "kernel")


def kaggle_input(platform: Platform | None = None) -> Path | None:
    """Kaggle's folder of attached inputs (KAGGLE_INPUT) on Kaggle when it exists, else None."""
    platform = platform or current()
    return KAGGLE_INPUT if platform.host == "kaggle" and KAGGLE_INPUT.is_dir() else None


def _cell_id(shell: Any) -> str:
    """The cell id the frontend sent with the running execution request ('' when none)."""
    try:
        request = shell.kernel.get_parent()
    except Exception:  # older ipykernel signatures: no evidence
        return ""
    if not isinstance(request, dict):
        return ""
    return str((request.get("metadata") or {}).get("cellId") or "")


def _is_server(cmdline: str) -> bool:
    return any(server in cmdline for server in _JUPYTER_SERVERS)


def _ancestor_cmdlines(depth: int = 4) -> list[str]:
    """Command lines of this process's parents, up to and including the first Jupyter server's
    (Linux /proc; [] where unavailable). Whatever started the server (a terminal, a test, a
    service) says nothing about who watches the notebooks a person opens in it.
    """
    lines, pid = [], os.getppid()
    for _ in range(depth):
        if pid <= 1:
            break
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").lower()
            lines.append(cmdline)
            if _is_server(cmdline):
                break
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return lines


def memory_gib() -> float | None:
    """GiB of CPU memory this process's machine gives it: MEMINFO's MemTotal, or its control group's limit where that
    is lower (a container's); None where neither can be read (not Linux).
    """
    sizes = []
    for limit in CGROUP_LIMITS:
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit; v1 writes a huge number instead
            sizes.append(int(text))
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemTotal:"):
                sizes.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    return min(sizes) / 2**30 if sizes else None
