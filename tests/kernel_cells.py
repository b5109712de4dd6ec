"""Named notebook cells run in a real Jupyter kernel (nbclient), and what each cell showed.

The notebook tests (test_magics.py, test_live_notebook.py) tell a story in one notebook and then
assert on each cell's outputs by name.
"""

from __future__ import annotations

from pathlib import Path

from nbclient import NotebookClient
from nbformat import NotebookNode
from nbformat.v4 import new_code_cell, new_notebook

# Warnings the libraries print into a training cell that nbkit's ranks avoid at their cause (nbkit.training.trainer_defaults,
# the ranks' OMP_NUM_THREADS, no deprecated DDP option in the notebooks): what each looks like, by what it is about.
LIBRARY_WARNINGS = {
    "accelerate's thread note": "OMP_NUM_THREADS/MKL_NUM_THREADS unset",
    "the DataLoader's pin_memory on a CPU": "'pin_memory' argument is set as true but no accelerator",
    "DDP's unused-parameter search": "find_unused_parameters=True was specified",
    "broadcast_buffers' deprecation": "`broadcast_buffers` is deprecated",
}


def library_warnings(text: str) -> list[str]:
    """Which of LIBRARY_WARNINGS `text` (a cell's output) shows."""
    return [what for what, needle in LIBRARY_WARNINGS.items() if needle in text]


def run_cells(cells: dict[str, str], path: str | Path, kernel_name: str, timeout: float) -> dict[str, dict]:
    """Execute the cells in order in a fresh kernel named kernel_name, working directory `path`, each
    allowed `timeout` seconds; a failing cell does not stop the rest. Returns {cell name: cell_outputs}.
    """
    nb = new_notebook()
    nb.cells = [new_code_cell(source) for source in cells.values()]
    NotebookClient(
        nb, kernel_name=kernel_name, timeout=timeout, allow_errors=True, resources={"metadata": {"path": str(path)}}
    ).execute()
    return {name: cell_outputs(cell) for name, cell in zip(cells, nb.cells)}


def cell_outputs(cell: NotebookNode) -> dict:
    """A run cell's stdout and stderr text, its error output (or None), its value's text/plain (or
    None), and the data of each display it made, in order."""
    out: dict = {"stdout": "", "stderr": "", "error": None, "result": None, "displays": []}
    for o in cell.outputs:
        if o.output_type == "stream":
            out[o.name] += o.text
        elif o.output_type == "error":
            out["error"] = o
        elif o.output_type == "execute_result":
            out["result"] = o.data.get("text/plain")
        elif o.output_type == "display_data":
            out["displays"].append(o.data)
    return out
