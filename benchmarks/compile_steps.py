"""Which training steps stop to compile the model's layers, and why: the flagship notebook's training on its own data
(nbkit.recipe, nbkit.data's synthetic image-text set, TRL's SFTTrainer), in this process, with nbkit's compiled
regions, printing each step's time and dynamo's reason for every recompilation.

    python benchmarks/compile_steps.py                               # tiny:qwen3-vl, aot_eager, 20 steps
    python benchmarks/compile_steps.py --backend inductor --no-mark  # as dynamo compiles without nbkit's marks

--no-mark leaves the sequence length to dynamo (nbkit.savers.compiling._mark_sequence_dynamic off), which compiles each
kind of batch again at its second length. On a GPU the steps that compile take tens of seconds each; on the CPU with
aot_eager about one, and their count is what compares.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the package lives in ROOT
    sys.path.insert(0, str(ROOT))

INSTRUCTION = "Write the LaTeX representation for this image."


def _conversation(sample: dict[str, Any]) -> dict[str, Any]:
    """One example as the flagship notebook converts it."""
    return {
        "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": INSTRUCTION}]}],
        "completion": [{"role": "assistant", "content": [{"type": "text", "text": sample["text"]}]}],
        "images": [sample["image"].convert("RGB")],
    }


class _Recompiles(logging.Handler):
    """Dynamo's recompilation messages (torch's "recompiles" log), each the guard that failed."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons.append(record.getMessage())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny:qwen3-vl")
    parser.add_argument("--backend", default="aot_eager", help="torch.compile's backend for the regions")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2, help="examples per step, as the flagship's default")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--emulate", help="a GPU to emulate on this one, as nbkit.recipe(emulate=...): T4")
    parser.add_argument("--no-mark", action="store_true", help="leave the sequence length to dynamo")
    parser.add_argument("--out", help="a JSON file for the steps")
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    import nbkit
    from nbkit.training.savers import compiling

    if args.no_mark:
        compiling._mark_sequence_dynamic = lambda args, kwargs: None
    torch._logging.set_logs(recompiles=True)
    recompiles = _Recompiles()
    logging.getLogger("torch._dynamo").addHandler(recompiles)

    recipe = nbkit.recipe(
        args.model, gpus=1, backend="transformers", max_seq_length=2048, batch_size=args.batch, emulate=args.emulate
    )
    model, processor = recipe.from_pretrained(args.model)
    model = recipe.get_peft_model(model, r=16, lora_alpha=16, random_state=3407)
    compiling.enable(model, backend=args.backend)  # "auto" compiles on a GPU only
    data = [_conversation(s) for s in nbkit.data.image_text_dataset("synthetic", 81, image_size=args.image_size)]
    data.pop()  # the notebook's held-out example

    steps: list[dict[str, Any]] = []

    class Steps(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.start, self.seen = time.perf_counter(), len(recompiles.reasons)

        def on_step_end(self, _args: Any, state: Any, *_: Any, **__: Any) -> None:
            reasons = [  # the guards that failed, one line each ("- 0/1: tensor 'args[0]' size mismatch ...")
                line.strip()
                for message in recompiles.reasons[self.seen :]
                for line in message.splitlines()
                if re.match(r"\s*- \d+/\d+: ", line)
            ]
            steps.append({"step": state.global_step, "s": time.perf_counter() - self.start, "recompiles": reasons})
            print(f"step {state.global_step}: {steps[-1]['s']:.2f} s", *reasons, sep="\n  ", flush=True)

    recipe.for_training(model)
    trainer = SFTTrainer(
        model=model,
        processing_class=processor,
        data_collator=recipe.data_collator(model, processor),
        train_dataset=Dataset.from_list(data),
        args=SFTConfig(
            **recipe.trainer_args,
            max_steps=args.steps,
            learning_rate=2e-4,
            logging_steps=1,
            seed=3407,
            output_dir="/tmp/nbkit-compile-steps",
            report_to="none",
            save_strategy="no",
            max_length=2048,
            disable_tqdm=True,
        ),
        callbacks=[Steps()],
    )
    trainer.train()
    first = steps[0]["s"]
    later = sorted(s["s"] for s in steps[1:])
    slow = [s["step"] for s in steps if s["s"] > max(3 * later[len(later) // 2], 0.5)] if later else []
    print(
        f"first step {first:.2f} s; steps that stopped to compile: {slow}; median of the rest "
        f"{later[len(later) // 2]:.3f} s"
        if later
        else f"first step {first:.2f} s"
    )
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv, "steps": steps, "compiled_at": slow}, indent=1))


if __name__ == "__main__":
    main()
