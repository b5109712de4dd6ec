"""nbkit's notices go through logging (the `nbkit` logger, shown at INFO by default, filterable) and nothing of the
library reaches stdout otherwise: representative API calls on CPU, in a fresh process, with the notices recorded
instead of shown, leave stdout empty except for what the ranks themselves print (their output is relayed, not a
notice)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nbkit.platform import notices

REPO = Path(__file__).resolve().parents[1]
RANK_LINE = "printed by the user code on a rank"

# The calls, in a fresh interpreter: a checkpoint search, the planner, the doctor, an offline model and the
# synthetic data, a one-shot launch whose function loads a model with device_map="auto" (the guard's notice, on
# rank 0) and prints, and a live set that runs a cell that prints.
SCRIPT = textwrap.dedent(
    f"""
    import json, logging, sys
    import nbkit
    from nbkit.platform import notices

    log = notices.logger()
    log.handlers.clear()  # recorded here instead of written to stdout
    kept = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record.getMessage())

    log.addHandler(Keep())

    def train():
        import nbkit
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(nbkit.resolve_model("tiny:qwen3"), device_map="auto")
        print("{RANK_LINE}")
        return nbkit.rank()

    if __name__ == "__main__":
        nbkit.checkpoints.resume_point("out")
        nbkit.plan("tiny:qwen3", gpus=2, gpu_memory_gib=15.0, seq_len=128, batch_size=2, gpu="cpu")
        nbkit.doctor()
        nbkit.data.image_text_dataset("synthetic", 2, image_size=32)
        assert nbkit.launch(train, gpus=2) == 0
        ranks = nbkit.start(gpus=2)
        try:
            ranks.exec("print('{RANK_LINE}')")
        finally:
            ranks.stop()
        print(json.dumps(kept), file=sys.stderr)
    """
)


@pytest.mark.slow
def test_representative_calls_print_nothing_but_the_ranks_own_output(tmp_path):
    script = tmp_path / "calls.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kept = json.loads(done.stderr.strip().splitlines()[-1])
    assert "nbkit: no checkpoint in out yet; starting fresh." in kept  # a notice, through logging
    library_lines = [line for line in done.stdout.splitlines() if line.strip() and RANK_LINE not in line]
    assert library_lines == [], "the library printed instead of logging:\n" + "\n".join(library_lines)
    assert done.stdout.count(RANK_LINE) == 2  # rank 0's, from the launch and from the live cell
    # stderr holds the libraries' warnings; a line of nbkit's there would be a notice printed past logging
    printed = [line for line in done.stderr.splitlines()[:-1] if line.startswith("nbkit:")]
    assert printed == [], printed


@pytest.mark.version_independent
def test_notices_are_shown_at_info_filterable_and_never_twice(capsys):
    log = notices.logger("nbkit.test")
    root = logging.getLogger("nbkit")
    assert root.getEffectiveLevel() <= logging.INFO and not root.propagate
    log.info("nbkit: shown")
    log.warning("nbkit: a warning")
    assert capsys.readouterr() == ("nbkit: shown\n", "nbkit: a warning\n")
    level = root.level
    try:
        root.setLevel(logging.WARNING)
        log.info("nbkit: hidden")
        assert capsys.readouterr().out == ""
    finally:
        root.setLevel(level)
    logging.basicConfig()  # a user's own logging set-up: nbkit's notice still appears once
    try:
        log.info("nbkit: once")
        captured = capsys.readouterr()
        assert (captured.out + captured.err).count("nbkit: once") == 1
    finally:
        for handler in logging.getLogger().handlers[:]:
            if type(handler) is logging.StreamHandler:
                logging.getLogger().removeHandler(handler)
