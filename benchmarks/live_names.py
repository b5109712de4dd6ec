"""What a %%ddp cell that reads big notebook data costs on a live set, cell after cell, on the CPU.

    python benchmarks/live_names.py [--gpus 2] [--samples 1000] [--image-size 448] [--out live_names.json]

Builds the flagship notebook's offline training data in this process (nbkit's synthetic vision set,
--samples images of --image-size px, as `notebooks/qwen3_vl_2xT4.ipynb` does with its defaults), starts
a live set of N gloo ranks, and times `%%ddp` cells run through IPython's own cell machinery here
(InteractiveShell.run_cell: the magic, the names it sends along):
- `len(train_data)` three times (the first sends the data; what the later ones cost is the question);
- a trivial cell (`1`) for comparison;
- `len(train_data)` after the notebook rebinds `train_data` to another list (it is sent again).
Prints seconds per cell, the size of the data pickled, and the seconds the data took to build.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the benchmarks package lives in ROOT
    sys.path.insert(0, ROOT)

from benchmarks import host  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2, help="ranks (gloo CPU processes where there is no GPU)")
    parser.add_argument("--samples", type=int, default=1000, help="training examples (the flagship's num_samples)")
    parser.add_argument("--image-size", type=int, default=448, help="side of the synthetic images in pixels")
    parser.add_argument("--out", default=None, help="write the figures as JSON here too")
    args = parser.parse_args()

    from IPython.core.interactiveshell import InteractiveShell

    import nbkit

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbkit", store_history=False)
    start = time.perf_counter()
    # The flagship's synthetic data, in its prompt-completion form (section 8 of the notebook).
    chats = nbkit.vision_dataset(args.samples, seed=0, image_size=args.image_size)
    shell.user_ns["train_data"] = [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
            "completion": [
                {"role": "assistant", "content": [{"type": "text", "text": c["messages"][1]["content"][0]["text"]}]}
            ],
            "images": [c["images"][0].convert("RGB")],
        }
        for c in chats
    ]
    built = time.perf_counter() - start
    pickled_mb = len(pickle.dumps(shell.user_ns["train_data"])) / 1e6

    def cell(source: str) -> float:
        begin = time.perf_counter()
        shell.run_cell(source, store_history=False, silent=True).raise_error()
        return round(time.perf_counter() - begin, 3)

    ranks = nbkit.start(gpus=args.gpus)
    try:
        figures = {
            "ranks": ranks.world_size,
            "samples": args.samples,
            "image_size": args.image_size,
            "data_build_s": round(built, 2),
            "data_pickled_mb": round(pickled_mb, 1),
            "len_cells_s": [cell("%%ddp\nlen(train_data)") for _ in range(3)],
            "trivial_cell_s": cell("%%ddp\n1"),
        }
        shell.user_ns["train_data"] = list(shell.user_ns["train_data"])  # the same items, another list
        figures["len_cell_after_rebinding_s"] = cell("%%ddp\nlen(train_data)")
        figures["len_cell_after_that_s"] = cell("%%ddp\nlen(train_data)")
    finally:
        ranks.stop()
    host.publish(figures, args.out)


if __name__ == "__main__":
    main()
