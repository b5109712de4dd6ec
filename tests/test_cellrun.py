"""nbkit.run_cell: what a %%ddp cell does, from a plain Python script (no kernel, no IPython).

Real processes on gloo: the same call runs the code forked, spawned, and on a live set, as %%ddp does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import faulthandler
    import json
    import nbkit

    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where it hangs, in the assertion below

    base = 40
    _private = 2
    said = {}
    cell = "import os, nbkit\\n(os.environ['NBKIT_STRATEGY'], os.environ.get('NBKIT_EMULATE'), base + _private + nbkit.rank())"
    said["fork"] = nbkit.run_cell(cell, globals(), gpus=2, strategy="fsdp", emulate="t4", dashboard=False)
    said["spawn"] = nbkit.run_cell(cell, globals(), gpus=2, spawn=True, dashboard=False)
    try:
        nbkit.run_cell("1", globals(), gpus=2, strategy="zero")
    except ValueError as exc:
        said["bad_strategy"] = str(exc)
    only_on_ranks = "class Thing:\\n    pass\\nThing()"  # a class the script does not have
    said["unbuildable"] = {}

    def unbuildable(mode, **options):
        try:
            nbkit.run_cell(only_on_ranks, globals(), dashboard=False, **options)
        except nbkit.LaunchError as exc:
            said["unbuildable"][mode] = f"{type(exc).__name__}: {exc}"

    unbuildable("fork", gpus=2)
    unbuildable("spawn", gpus=2, spawn=True)
    ranks = nbkit.start(gpus=2, strategy="fsdp")
    try:
        said["live"] = nbkit.run_cell("import nbkit\\ny = base + _private + nbkit.rank()\\ny", globals())
        said["live_kept"] = nbkit.run_cell("y * 10", globals(), ranks=[1])
        try:
            nbkit.run_cell("1", globals(), gpus=2)
        except ValueError as exc:
            said["live_refused"] = f"{type(exc).__name__}: {exc}"
        said["live_env"] = nbkit.run_cell("import os\\nos.environ['NBKIT_STRATEGY']", globals())
        unbuildable("live")
    finally:
        ranks.stop()
    print("SAID " + json.dumps(said))
    """
)


def test_a_script_runs_a_cell_as_ddp_does_forked_spawned_and_on_a_live_set(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    said = json.loads(done.stdout.split("SAID ", 1)[1])
    # rank 0's value; the options reached the ranks (the profile under its own name)
    assert said["fork"] == ["fsdp", "T4", 42]
    assert said["spawn"] == ["ddp", None, 42]  # the _private name travelled to fresh processes
    assert "strategy must be one of 'ddp', 'fsdp'; got 'zero'" in said["bad_strategy"]
    assert said["live"] == 42 and said["live_kept"] == 430  # names stay on the set's ranks
    assert said["live_refused"].startswith("OptionsError: --gpus set up processes")
    assert said["live_env"] == "fsdp"
    # rank 0's value that the notebook cannot rebuild: the same clear error in every mode
    texts = said["unbuildable"]
    assert sorted(texts) == ["fork", "live", "spawn"], texts
    why = "Rank 0's value came back but cannot be rebuilt in the notebook (AttributeError: "
    for mode in ("fork", "spawn"):
        assert why in texts[mode] and "exists on the ranks only" in texts[mode], (mode, texts[mode])
    # a live rank's cells do not run in its __main__ module: the class cannot even leave the rank, and
    # rankside says so in the rank's words
    assert texts["live"].startswith("LiveError: "), texts["live"]
    assert "Rank 0's return value (Thing) cannot be sent back to the notebook" in texts["live"], texts["live"]
