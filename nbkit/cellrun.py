"""nbkit.run_cell: what a `%%ddp` cell does, as a function a script can call (notebook side).

The %%ddp magic (nbkit.magics) parses its line and calls this; everything it decides lives here:

    run_cell(code, namespace, **options)
      -> a live set runs (nbkit.live.current())  -> LiveRanks.exec on it (names sent: nbkit.notebook_names)
      -> a live set ended after a failure         -> LiveError: its names are gone (nothing runs one-shot)
      -> no live set, forking works               -> nbkit.launch of the code (fork: every name shared)
      -> no live set, forking blocked, or spawn   -> nbkit.spawning.run_source (fresh processes)

Ranks' tracebacks start at the cell's code: nbkit.rankside.rank_traceback leaves out the frames of
this module and of the other plumbing between a rank's entry point and the cell.
"""

from __future__ import annotations

import linecache
from collections.abc import Iterable
from typing import Any

from nbkit import cell_group, cells, distributed, forksafety, one_gpu, rankside
from nbkit.ddp_options import OptionsError
from nbkit.errors import LiveError

__all__ = ["run_cell"]


def run_cell(
    code: str,
    namespace: dict[str, Any],
    *,
    gpus: int | None = None,
    timeout: float | None = None,
    all_ranks: bool = False,
    env: dict[str, str] | None = None,
    spawn: bool = False,
    ranks: Iterable[int] | None = None,
    resend: bool | Iterable[str] = False,
    strategy: str | None = None,
    emulate: str | None = None,
    filename: str = "<ddp cell>",
    dashboard: bool = True,
) -> Any:
    """Run cell `code` on every rank, as a `%%ddp` cell does, and return the value of its last
    expression on rank 0 (or on the lowest rank of `ranks`); None when it ends with a statement.

    Args:
        code: the cell's Python source (IPython syntax already transformed).
        namespace: the notebook's names (a script: its globals()). One-shot runs see them all (fork)
            or those the code reads (spawn); a live set gets those the code reads (nbkit.notebook_names).
        gpus: processes to start (None: one per visible GPU), as in nbkit.launch.
        env: environment variables for the processes.
        spawn: start fresh processes even where forking would work (nbkit.spawning).
        strategy: "ddp" or "fsdp" (None: "ddp"), as in nbkit.launch.
        emulate: a GPU profile for the ranks to emulate, as in nbkit.launch.
        (gpus, env, spawn, strategy and emulate start processes: refused while a live set runs.)
        timeout: seconds before every rank is stopped (a live set: ended).
        all_ranks: show every rank's output, not only the lowest one's.
        ranks: a live set only: run on these ranks (None: every rank).
        resend: a live set only: names to send again although the ranks hold them (True: all).
        filename: the name the ranks' tracebacks give the code; registered in linecache.
        dashboard: show the ranks' reports (one-shot runs; a live set always does).

    Returns:
        That rank's value, pickled there and rebuilt here (tensors on the CPU).

    Raises:
        CellSyntaxError: the code does not parse (before anything runs).
        OptionsError (a ValueError): an option that does not fit: process options on a live set,
            a rank the set does not have, `ranks` without a live set.
        LiveError: a rank failed on the live set, or a live set ended after a failure and its
            names are gone (nbkit.live.forget_ended() makes cells one-shot again).
        LaunchError, BringAlongError, and what nbkit.launch / spawning.run_source raise.
    """
    from nbkit import live

    cells.parse(code, filename)  # a cell that does not parse fails here, before any process starts
    # this cell's lines, not those of an earlier cell run under the same name
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    current = live.current()
    if current is not None:
        _refuse_setup(current, gpus=gpus, env=env, spawn=spawn, strategy=strategy, emulate=emulate)
        return _on_live_set(current, code, namespace, ranks, timeout, all_ranks, resend, filename)
    _refuse_after_a_set_ended(live.ended())
    if ranks is not None:
        raise OptionsError(
            "%%ddp --rank runs a cell on some ranks of a live set, and none is running. Start one with "
            "%ddp start (its processes stay up across cells), or leave --rank out: a one-shot %%ddp runs "
            "on every rank."
        )
    options = {
        "gpus": gpus,
        "timeout": timeout,
        "quiet": not all_ranks,
        "env": env,
        "dashboard": dashboard,
        "strategy": rankside.check_strategy(strategy or "ddp"),
        "emulate": emulate,
    }
    return _one_shot(code, namespace, filename, spawn, options)


def _refuse_setup(live_set: Any, **setup: Any) -> None:
    """OptionsError naming the options in `setup` that were given: a live set's processes are set up."""
    refused = [f"--{option}" for option, given in setup.items() if given]
    if refused:
        raise OptionsError(
            f"{', '.join(refused)} set up processes, and a live set of {live_set.world_size} rank(s) is "
            "running: its processes are already set up. Leave it out, or %ddp stop and %ddp start with it."
        )


def _refuse_after_a_set_ended(gone: Any) -> None:
    """LiveError while a set that a failure ended is remembered: its cells expect the names that lived
    on the ranks, so a one-shot run would fail oddly.
    """
    if gone is not None:
        raise LiveError(
            f"The live set has ended: {gone.status().ended} Its names are gone. %ddp start starts a new one "
            "(then run the cells that load the model again); %ddp stop makes %%ddp cells one-shot again.",
            ended=True,
        )


def _on_live_set(
    live_set: Any,
    code: str,
    namespace: dict[str, Any],
    ranks: Iterable[int] | None,
    timeout: float | None,
    all_ranks: bool,
    resend: bool | Iterable[str],
    filename: str,
) -> Any:
    chosen = sorted(set(ranks)) if ranks is not None else None
    bad = [r for r in chosen or () if r >= live_set.world_size]
    if bad:
        raise OptionsError(
            f"--rank {' '.join(map(str, bad))}: the live set has {live_set.world_size} rank(s), numbered 0 to "
            f"{live_set.world_size - 1}."
        )
    return live_set.exec(
        code,
        ranks=chosen if chosen is not None else "all",
        names=live_set.names_for(code, namespace),
        timeout=timeout,
        all_ranks=all_ranks,
        filename=filename,
        resend=resend if isinstance(resend, bool) else list(resend),
    )


def _one_shot(code: str, namespace: dict[str, Any], filename: str, spawn: bool, options: dict[str, Any]) -> Any:
    from nbkit import spawning
    from nbkit.launching import launch

    visible = distributed.visible_gpus()
    if len(visible) == 1:  # Colab: what one-shot cells do there, once
        one_gpu.say_once("one-shot", visible[0].name)
    blocker = None if spawn else forksafety.fork_blocker()
    if spawn or blocker is not None:
        return spawning.run_source(
            code, namespace, filename=filename, reason=blocker or "asked for with --spawn", **options
        )

    def run_ddp_cell() -> Any:
        # In a forked rank `namespace` is the rank's own copy of the notebook's names: the cell
        # sees them all, and what it assigns stays in the rank. It runs in the default process
        # group, as on a live set.
        cell_group.join()
        return cells.run_cell(code, namespace, filename)

    return launch(run_ddp_cell, **options)
