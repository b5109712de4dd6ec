"""The machine and library versions a result was measured with, and the one way the studies
publish a result (printed as JSON, with them, and written to --out).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """GPU model/count/memory, driver, CUDA, library versions, date and host, without creating a
    CUDA context (safe in the process that launches).
    """
    from nbkit.platform.distributed import visible_gpus

    gpus = visible_gpus()
    driver = None
    exe = shutil.which("nvidia-smi")
    if exe is not None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            driver = (
                subprocess.run(
                    [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[0]
            )
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "gpu": gpus[0].name if gpus else None,
        "gpu_count": len(gpus),
        "gpu_memory_gib": round(gpus[0].memory_gib, 1) if gpus else None,
        "driver": driver,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),  # fewer where the process runs under taskset (gpu_pairs.sh)
        "versions": {
            p: _version(p)
            for p in (
                "torch",
                "transformers",
                "peft",
                "accelerate",
                "unsloth",
                "unsloth_zoo",
                "trl",
                "bitsandbytes",
                "nbkit",
            )
        },
        "argv": sys.argv,
    }


def publish(result: dict[str, Any], out: str | os.PathLike[str] | None = None) -> None:
    """Add the machine and versions (`environment()`) to `result` under "environment", print it as
    JSON and, when `out` is given, write the same text there.
    """
    result["environment"] = environment()
    text = json.dumps(result, indent=2, default=str)
    print(text, flush=True)
    if out:
        Path(out).write_text(text + "\n")
