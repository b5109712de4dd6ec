"""nbkit.run_cell: what a `%%ddp` cell does, as a function a script can call (notebook side).

The %%ddp magic (nbkit.magics) parses its line and calls this; everything it decides lives here:

    run_cell(code, namespace, **options)
      -> a live set runs (nbkit.live.current())  -> LiveRanks.exec on it (names sent: nbkit.notebook.notebook_names)
      -> a live set ended after a failure         -> LiveError: its names are gone (nothing runs one-shot)
      -> no live set, forking works               -> nbkit.launch of the code (fork: every name shared)
      -> no live set, forking blocked, or spawn   -> nbkit.launching.spawn.run_source (fresh processes)

Ranks' tracebacks start at the cell's code: nbkit.launching.rank_contract.rank_traceback leaves out the frames of
this module and of the other plumbing between a rank's entry point and the cell.
"""

from __future__ import annotations

import linecache
import numbers
from collections.abc import Iterable
from typing import Any

from nbkit.launching.rank_options import RankOptions
from nbkit.notebook import cell_code, one_gpu
from nbkit.platform import distributed, forksafety
from nbkit.platform.errors import LiveError, OptionsError, OptionTypeError
from nbkit.rank_side import cell_group

__all__ = ["run_cell", "run_cell_with"]


def run_cell(
    code: str,
    namespace: dict[str, Any],
    *,
    gpus: int | None = None,
    timeout: float | None = None,
    all_ranks: bool = False,
    env: dict[str, str] | None = None,
    spawn: bool = False,
    ranks: int | Iterable[int] | None = None,
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
            or those the code reads (spawn); a live set gets those the code reads (nbkit.notebook.notebook_names).
        gpus: processes to start (None: one per visible GPU), as in nbkit.launch.
        env: environment variables for the processes.
        spawn: start fresh processes even where forking would work (nbkit.launching.spawn).
        strategy: "ddp" or "fsdp" (None: "ddp"), as in nbkit.launch.
        emulate: a GPU profile for the ranks to emulate, as in nbkit.launch.
        (gpus, env, spawn, strategy and emulate start processes: refused while a live set runs.)
        timeout: seconds before every rank is stopped (a live set: ended).
        all_ranks: show every rank's output, not only the lowest one's.
        ranks: a live set only: run on this rank or these ranks (None: every rank).
        resend: a live set only: names to send again although the ranks hold them (True: all).
        filename: the name the ranks' tracebacks give the code; registered in linecache.
        dashboard: show the ranks' reports (one-shot runs; a live set always does).

    Returns:
        That rank's value, pickled there and rebuilt here (tensors on the CPU).

    Raises:
        CellSyntaxError: the code does not parse (before anything runs).
        OptionsError (a ValueError): an option that does not fit: one out of range or of the wrong
            type (nbkit.launching.rank_options, the same message as nbkit.launch / nbkit.start give), process
            options on a live set, a rank the set does not have, `ranks` without a live set.
        LiveError: a rank failed on the live set, or a live set ended after a failure and its
            names are gone (nbkit.live.forget_ended() makes cells one-shot again).
        LaunchError, BringAlongError, and what nbkit.launch / spawning.run_source raise.
    """
    options = RankOptions.build(
        gpus=gpus,
        timeout=timeout,
        env=env,
        strategy=strategy,
        emulate=emulate,
        all_ranks=all_ranks,
        dashboard=dashboard,
        spawn=spawn,
    )
    return run_cell_with(code, namespace, options, ranks=ranks, resend=resend, filename=filename)


def run_cell_with(
    code: str,
    namespace: dict[str, Any],
    options: RankOptions,
    *,
    ranks: int | Iterable[int] | None = None,
    resend: bool | Iterable[str] = False,
    filename: str = "<ddp cell>",
) -> Any:
    """run_cell with the ranks' set-up as one value (what the %%ddp magic calls); returns and raises as
    run_cell does.
    """
    from nbkit import live

    cell_code.parse(code, filename)  # a cell that does not parse fails here, before any process starts
    # this cell's lines, not those of an earlier cell run under the same name
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    current = live.current()
    if current is not None:
        _refuse_setup(current, options)
        return _on_live_set(current, code, namespace, ranks, options, resend, filename)
    _refuse_after_a_set_ended(live.ended())
    if ranks is not None:
        raise OptionsError(
            "%%ddp --rank runs a cell on some ranks of a live set, and none is running. Start one with "
            "%ddp start (its processes stay up across cells), or leave --rank out: a one-shot %%ddp runs "
            "on every rank."
        )
    return _one_shot(code, namespace, filename, options)


def _refuse_setup(live_set: Any, options: RankOptions) -> None:
    """OptionsError naming the process options given: a live set's processes are set up."""
    refused = [f"--{option}" for option in options.process_options()]
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
    ranks: int | Iterable[int] | None,
    options: RankOptions,
    resend: bool | Iterable[str],
    filename: str,
) -> Any:
    chosen = _chosen_ranks(ranks)
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
        timeout=options.timeout,
        all_ranks=options.all_ranks,
        filename=filename,
        resend=resend if isinstance(resend, bool) else list(resend),
    )


def _chosen_ranks(ranks: Any) -> list[int] | None:
    """`ranks` (one rank, several, or None for every rank) as a sorted list; OptionsError for anything else."""
    if ranks is None:
        return None
    if isinstance(ranks, numbers.Integral):
        listed = [ranks]
    else:
        listed = list(ranks) if isinstance(ranks, Iterable) and not isinstance(ranks, str) else []
    whole = all(isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in listed)
    if not listed or not whole or min(listed) < 0:
        error = OptionsError if listed and whole else OptionTypeError
        raise error(f"ranks must be a rank number (0 and up) or a list of them, or None for every rank; got {ranks!r}.")
    return sorted({int(r) for r in listed})


def _one_shot(code: str, namespace: dict[str, Any], filename: str, options: RankOptions) -> Any:
    from nbkit.launching import spawn as spawning
    from nbkit.launching.fork import launch_with

    visible = distributed.visible_gpus()
    if len(visible) == 1:  # Colab: what one-shot cells do there, once
        one_gpu.say_once("one-shot", visible[0].name)
    blocker = None if options.spawn else forksafety.fork_blocker()
    if options.spawn or blocker is not None:
        return spawning.run_source(
            code, namespace, options, filename=filename, reason=blocker or "asked for with --spawn"
        )

    def run_ddp_cell() -> Any:
        # In a forked rank `namespace` is the rank's own copy of the notebook's names: the cell
        # sees them all, and what it assigns stays in the rank. It runs in the default process
        # group, as on a live set.
        cell_group.join()
        return cell_code.run_cell(code, namespace, filename)

    return launch_with(options, run_ddp_cell)
