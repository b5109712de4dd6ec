"""What one-shot ranks print reaches the stdout they share as it is printed, in whole lines
(nbkit.rank_side.output.write_whole_lines), whether torchrun runs them or a script's nbkit.launch starts
them. Unbuffered (torchrun starts its ranks so), print wrote a line's text and its newline apart,
and another rank's line could land in between (an exported script's printed result came out
unparsable under torchrun)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from outside_launcher import TORCHRUN, rank_env

SCRIPT = textwrap.dedent(
    """
    import time
    from pathlib import Path

    import nbkit


    def train():
        if nbkit.rank() == 0:
            print("rank 0 waits for the test to see this line")
        release = Path("release")
        deadline = time.monotonic() + 60
        while not release.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {nbkit.rank()}: no release after 60 s")
            time.sleep(0.02)
        # Both ranks at once, from the same moment: lines that other lines could cut into.
        for i in range(10000):
            print(f"line {i} of rank {nbkit.rank()} " + "x" * 40)
        return nbkit.rank()


    if __name__ == "__main__":
        nbkit.launch(train, gpus=2, quiet=False)
    """
)


# torchrun runs the script on each rank; run alone, the script's nbkit.launch starts them. Both run
# unbuffered (torchrun starts its ranks with -u; a script may run under -u or PYTHONUNBUFFERED), where
# print writes a line's text and its newline apart.
LAUNCHERS = {"torchrun": TORCHRUN, "script": [sys.executable, "-u"]}


# nbkit.launch's own ranks start through accelerate, whose version differs between the two sets.
@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=pytest.mark.version_independent), "script"])
def test_one_shot_ranks_print_whole_lines_as_they_print_them(tmp_path: Path, launcher: str) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = subprocess.Popen(
        [*LAUNCHERS[launcher], "train.py"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=rank_env(tmp_path),
    )
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.append(proc.stderr.read()), daemon=True).start()  # type: ignore[union-attr]
    lines = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.rstrip("\n"))
            if line.startswith("rank 0 waits"):
                # Seen while rank 0 still runs: the ranks go on only once this file exists.
                (tmp_path / "release").touch()
        returncode = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert returncode == 0, "".join(stderr)[-3000:]
    assert lines[0] == "rank 0 waits for the test to see this line"
    whole = re.compile(r"(\[rank 1\] )?line (\d+) of rank (\d) x{40}")
    seen: dict[int, list[int]] = {0: [], 1: []}
    for line in lines[1:]:
        match = whole.fullmatch(line)
        assert match, f"a line cut by another: {line!r}"
        rank = int(match.group(3))
        assert (match.group(1) is not None) == (rank == 1)  # rank 1's lines come prefixed, rank 0's not
        seen[rank].append(int(match.group(2)))
    assert seen == {0: list(range(10000)), 1: list(range(10000))}
