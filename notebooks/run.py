"""Execute nbkit's notebooks with papermill, with parameters that fit the machine.

    python notebooks/run.py [NAME ...] --out DIR [-p key=value ...]

NAME is a notebook of this folder without ".ipynb" (all of them when none is given). Each one runs
in a fresh kernel of this Python interpreter; the executed copy is written to DIR/NAME.ipynb and
the run's files (checkpoints, adapter, summary.json) to DIR/NAME/. The notebooks' own defaults
are the real models and datasets a user trains on Kaggle; this script replaces them where this
machine cannot use them:

- no GPU: the tiny offline models (tiny:qwen3-vl, tiny:qwen3), nbkit's synthetic datasets, 2 CPU
  processes training over gloo, and a few short steps (what CI runs);
- GPUs but no Hugging Face hub: models of the real shapes with random weights (random:...) and
  the synthetic datasets;
- GPUs and the hub: the notebooks' defaults.

`-p key=value` sets any parameter last (values are read as Python literals where they parse, as
text otherwise), e.g. `-p max_steps=100 -p backend=transformers`. tests/test_notebooks.py imports
`run` from this file, so the choice of parameters exists once.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NOTEBOOKS = (
    "qwen3_vl_2xT4",
    "qwen3_vl_2xT4_oneshot",
    "text_llm_ddp",
    "model_parallel",
    "long_context",
    "big_model_fsdp",
)

# Per notebook: (model without a GPU, model on GPUs without the hub, CPU-sized parameters).
# The vision notebooks keep 4 examples per optimizer step on CPU as 1 per process x 2 accumulation steps x 2
# processes, so that CI trains through the planner's batch settings with gradient accumulation.
_QWEN3_VL = (
    "tiny:qwen3-vl",
    "random:qwen3-vl-2b",
    dict(
        max_steps=16,
        num_samples=64,
        batch_size=1,
        effective_batch=4,
        max_seq_length=256,
        image_size=64,
        learning_rate=1e-2,
    ),
)
_OFFLINE: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_vl_2xT4": _QWEN3_VL,  # the live set, cell by cell
    "qwen3_vl_2xT4_oneshot": _QWEN3_VL,  # the same run in one %%ddp cell
    # sharded over the live set (FSDP); on GPUs without the hub, the largest random: shapes nbkit has
    "big_model_fsdp": ("tiny:qwen3-vl", "random:qwen3-vl-4b", _QWEN3_VL[2]),
    "text_llm_ddp": (
        "tiny:qwen3",
        "random:qwen3-1.7b",
        dict(max_steps=16, num_samples=128, batch_size=4, max_seq_length=128, learning_rate=1e-2),
    ),
    "model_parallel": (
        "tiny:qwen3",
        "random:qwen3-1.7b",  # one process: twice the batch of the DDP notebooks' two
        dict(max_steps=16, num_samples=128, batch_size=8, max_seq_length=128, learning_rate=1e-2),
    ),
    "long_context": (
        "tiny:qwen3",
        "random:qwen3-1.7b",
        dict(
            max_steps=16,
            num_samples=400,
            batch_size=1,
            max_seq_length=512,
            learning_rate=1e-2,
            measure_lengths=[256, 2048],
        ),
    ),
}
_CPU_PROCESSES = 2
_KERNEL = "nbkit-run"


def has_gpu() -> bool:
    """Whether this machine has an NVIDIA GPU (asked without initialising CUDA here)."""
    from nbkit.platform.distributed import visible_gpus

    return bool(visible_gpus())


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether huggingface.co answers (and HF_HUB_OFFLINE does not forbid asking)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _check_name(name: str) -> None:
    if name not in _OFFLINE:
        raise ValueError(f"There is no notebook {name!r}; choose from {', '.join(NOTEBOOKS)}.")


def parameters(name: str, out: Path, *, gpu: bool, hub: bool, overrides: Mapping[str, Any] | None = None) -> dict:
    """The papermill parameters for notebook `name` on a machine with/without GPUs and hub access.

    Returns a dict (output_dir always points into `out`); `overrides` win over everything.
    Raises ValueError for an unknown notebook name.
    """
    _check_name(name)
    tiny, random_weights, cpu_sized = _OFFLINE[name]
    params: dict[str, Any] = {"output_dir": str(Path(out).resolve() / name)}
    if not gpu:
        params.update(model_name=tiny, dataset_name="synthetic", gpus=_CPU_PROCESSES, **cpu_sized)
    elif not hub:
        params.update(model_name=random_weights, dataset_name="synthetic")
    params.update(overrides or {})
    return params


@contextlib.contextmanager
def _kernel_environment(hub: bool) -> Iterator[str]:
    """A kernelspec for this very interpreter, visible to papermill while the notebooks run, the
    nbkit of this checkout first on the kernel's path, and an offline hub where it cannot be
    reached. Yields the kernel name.
    """
    from ipykernel.kernelspec import write_kernel_spec

    from nbkit.platform.config import environment

    with tempfile.TemporaryDirectory(prefix="nbkit-kernels-") as root:
        write_kernel_spec(os.path.join(root, "kernels", _KERNEL))  # argv: sys.executable -m ipykernel_launcher
        values = {
            "JUPYTER_PATH": os.pathsep.join(filter(None, [root, os.environ.get("JUPYTER_PATH")])),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
        }
        if not hub:
            values["HF_HUB_OFFLINE"] = "1"
        with environment(values):
            yield _KERNEL


def run(
    names: Sequence[str] | None = None,
    out: str | os.PathLike[str] = "notebooks/outputs",
    overrides: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = 1800,
) -> list[Path]:
    """Execute notebooks (all when `names` is empty) and return the paths of the executed copies.

    Parameters come from `parameters()` for this machine, then `overrides`. `timeout` bounds
    each cell in seconds (None: no limit). Raises ValueError for an unknown name and papermill's
    PapermillExecutionError when a cell fails (the executed copy, with the error, is saved first).
    """
    try:
        import papermill
    except ImportError:
        raise ImportError(
            "Running the notebooks needs papermill and a kernel: pip install 'nbkit-ddp[notebooks]'."
        ) from None

    names = list(names or NOTEBOOKS)
    for name in names:  # every name before the first notebook runs
        _check_name(name)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    gpu, hub = has_gpu(), hub_reachable()
    executed = []
    with _kernel_environment(hub) as kernel:
        for name in names:
            params = parameters(name, out, gpu=gpu, hub=hub, overrides=overrides)
            target = out / f"{name}.ipynb"
            print(f"nbkit: running {name} ({', '.join(f'{k}={v!r}' for k, v in params.items())})", flush=True)
            start = time.monotonic()
            papermill.execute_notebook(
                str(HERE / f"{name}.ipynb"),
                str(target),
                parameters=params,
                kernel_name=kernel,
                cwd=str(out),
                progress_bar=False,
                execution_timeout=timeout,
            )
            print(f"nbkit: {name} finished in {time.monotonic() - start:.0f} s -> {target}", flush=True)
            executed.append(target)
    return executed


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"notebooks to run (default: all): {', '.join(NOTEBOOKS)}"
    )
    parser.add_argument("--out", required=True, help="folder for the executed notebooks and their runs' files")
    parser.add_argument(
        "-p",
        "--parameter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a notebook parameter (repeatable)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one cell may run (default 1800)")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.parameter:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            parser.error(f"-p takes KEY=VALUE with KEY a Python name; got {item!r}.")
        overrides[key] = _literal(value)
    try:
        paths = run(args.names, args.out, overrides, timeout=args.timeout)
    except ValueError as error:
        parser.error(str(error))
    print("Executed notebooks:")
    for path in paths:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))  # nbkit from this checkout when it is not installed
    sys.exit(main())
