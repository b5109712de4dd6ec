"""Running a script as an outside launcher would: `torchrun --nproc_per_node 2` on 2 gloo CPU ranks,
the way exported scripts and scripts around nbkit.launch are run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# torchrun with 2 processes; add the script's name.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]


def rank_env(scratch: Path) -> dict[str, str]:
    """This process's environment with one OpenMP thread a rank (2 CPU cores in CI) and `scratch` (the test's
    folder) as the temporary directory: torchrun makes a torchelastic_* folder there and never removes it."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}


def torchrun(script: Path, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `script` under torchrun with 2 processes, in its own folder (also its temporary one), one OpenMP thread
    each; returns the finished process with its stdout and stderr as text."""
    return subprocess.run(
        [*TORCHRUN, script.name],
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=rank_env(script.parent),
    )
