"""Running a script as an outside launcher would: `torchrun --nproc_per_node 2` on 2 gloo CPU ranks,
the way exported scripts and scripts around nbkit.launch are run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def torchrun(script: Path, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `script` under torchrun with 2 processes, in its own folder, one OpenMP thread each (2 CPU
    cores in CI); returns the finished process with its stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script.name],
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
