"""IPython magics: `%load_ext nbkit` adds %ddp, %%ddp and %nbkit. Thin layers over the Python API.

%ddp start [--gpus N] [--timeout S] [--env KEY=VALUE ...]
    nbkit.start(...): a live set of training processes, one per GPU (N gloo processes on a CPU),
    that stay up across cells until %ddp stop. While it runs, every %%ddp cell runs on it.
%ddp stop                           ranks.stop(); after a set that a failure ended, makes %%ddp one-shot again
                                    (until then %%ddp refuses to run, since its cells expect the set's names)
%ddp status                         ranks.status(), printed

%%ddp [--out NAME] [--timeout S] [--all-ranks] [--rank N ...] [--resend [NAME ...]]   (a live set is running)
    Runs the cell on every rank of the live set (ranks.exec), or on the --rank ranks only (say,
    rank 0 for inference, saving, pushing), and shows the value of its last expression on the
    lowest rank it ran on; --out NAME also stores it in the notebook. The names the cell defines
    stay on the ranks for later %%ddp cells, and win over notebook names of the same name (never
    replaced by a notebook object). Notebook names the cell reads are sent along (cloudpickle), each
    object once: a rank that already got that very object keeps its copy, so a cell that reads big
    notebook data again costs nothing extra. The name travels again when the notebook binds it to
    another object (`data = load()` run again). A change made in place to an object already sent
    (`data.append(x)`, `cfg["lr"] = 1e-4`) does NOT reach the ranks: rebind the name, or run the
    cell with --resend NAME (--resend alone: every notebook name the cell reads). The set holds what
    it sent until it stops (`del data` frees it then). Notebook functions and classes travel every
    time, with the notebook values they read then. A rank's exception fails the cell (LiveError)
    and every rank stays up with its names. --timeout S ends the set when the cell takes longer.
    --gpus, --env and --spawn belong to starting processes and are refused here (%ddp stop, then
    %ddp start with them); a --rank the set does not have, and a cell that does not parse
    (CellSyntaxError, its line and Python's reason), fail before anything runs. The stop button
    during trainer.train() stops training at a step every rank agrees on and keeps the set
    (nbkit.live.stopping). A --rank cell must not call a collective (trainer.evaluate(),
    dist.barrier(), all_reduce): the other ranks never join it, and it waits until an interrupt or
    --timeout ends the set.

%%ddp [--gpus N] [--out NAME] [--timeout S] [--all-ranks] [--env KEY=VALUE ...] [--spawn]
    (no live set) Runs the cell body on N processes (nbkit.launch) and shows rank 0's value of the last
    expression; --out NAME also stores it in the notebook. Ranks other than 0 are silent unless
    --all-ranks. A failure shows one rank-labelled traceback and raises nbkit.LaunchError (the
    cell fails for papermill/nbclient; the kernel stays usable and the cell can run again at once).
    A cell that does not parse raises CellSyntaxError before any process starts.

    Two modes, and %%ddp says which ran when it is not the usual one:
    - fork (default): the processes are forked from the notebook, so every name of earlier cells is
      visible as is. Fast to start.
    - spawn: when this notebook process can no longer fork working training processes (CUDA is
      initialised here, bitsandbytes is imported, or an accelerate state exists) -- or with
      --spawn -- fresh processes run the cell's source instead, bringing along the modules,
      notebook functions/classes and picklable values the cell uses (nbkit.spawning). It prints
      one line naming the reason and what it brought along; a name that cannot be brought along
      raises an error naming it.
    --rank is refused here: the processes end with the cell, and a cell that runs on some of them
    only would leave the others waiting in their first collective.

%nbkit doctor                       nbkit.doctor(): GPUs, CUDA state, versions, problems and fixes
%nbkit plan MODEL [--seq-len N] [--batch-size N] [--4bit] [--gpus N] [--gpu-memory GIB] [--lora-rank R]
            [--gpu-model NAME] [--effective-batch N]
                                    nbkit.plan(...), printed; with --effective-batch also the Trainer
                                    batch that keeps it, plan.batch_settings(N). --gpu-model: plan(gpu=NAME),
                                    e.g. "Tesla T4", or cpu for processes on CPU cores
%nbkit export NOTEBOOK CELL_OR_TAG -o train.py
                                    nbkit.export.export_script(): the %%ddp cell and what it needs
                                    as a script for torchrun / accelerate launch
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from nbkit import ddp_options

__all__ = ["NbkitMagics", "register", "unregister"]

_NBKIT_DIR = os.path.dirname(os.path.abspath(__file__))


def register(ipython: Any) -> None:
    """Add %%ddp and %nbkit to `ipython` (what `%load_ext nbkit` does). Idempotent."""
    ipython.register_magics(NbkitMagics)


def unregister(ipython: Any) -> None:
    """Remove %ddp, %%ddp and %nbkit from `ipython` (what `%unload_ext nbkit` does)."""
    manager = ipython.magics_manager
    manager.magics["cell"].pop("ddp", None)
    manager.magics["line"].pop("ddp", None)
    manager.magics["line"].pop("nbkit", None)
    manager.registry.pop(NbkitMagics.__name__, None)


@magics_class
class NbkitMagics(Magics):
    """The %ddp line magic, the %%ddp cell magic and the %nbkit line magic."""

    # (the ignore: IPython's stubs type the decorator that takes a name as accepting nothing)
    @line_magic("ddp")  # type: ignore[arg-type]
    def ddp_line(self, line: str) -> None:
        """%ddp start [--gpus N] [--timeout S] [--env K=V ...] | stop | status (see nbkit.magics)."""
        from nbkit import live

        command, _, rest = line.strip().partition(" ")
        ranks = live.current()
        if command == "start":
            try:
                opts = ddp_options.parse_start(rest)
            except ddp_options.OptionsError as exc:
                raise UsageError(str(exc)) from None
            ranks = live.start(gpus=opts.gpus, timeout=opts.timeout, env=opts.env)
            devices = ", ".join(sorted({r.device for r in ranks.status().ranks}))
            print(f"nbkit: live set of {ranks.world_size} rank(s) on {devices}; %%ddp cells now run on it.")
        elif command == "stop":
            gone = live.ended()
            if ranks is None and gone is not None:
                live.forget_ended()
                print(f"nbkit: the live set had ended: {gone.status().ended} %%ddp cells are one-shot again.")
                return
            if ranks is None:
                print("nbkit: no live set is running.")
                return
            ranks.stop()
            print(f"nbkit: stopped the live set ({ranks.world_size} rank(s)).")
        elif command == "status":
            gone = live.ended()
            if ranks is not None:
                print(ranks.status())
            elif gone is not None:  # says that it ended, why, and what to do
                print(gone.status())
            else:
                print("nbkit: no live set is running (%ddp start starts one).")
        else:
            raise UsageError("%ddp takes one of: start [--gpus N] [--timeout S] [--env KEY=VALUE ...] | stop | status")

    @cell_magic
    def ddp(self, line: str, cell: str) -> Any:
        """Run this cell on every GPU: on the live set if one runs, else one-shot (see nbkit.magics).

        On a live set, notebook names the cell reads are sent once per object: a later cell that reads
        the same object sends nothing; rebinding the name in the notebook sends it again. A change made
        in place to an object already sent (`data.append(x)`) does not reach the ranks: rebind the name
        or use --resend NAME (--resend alone: every name the cell reads). Names the ranks' cells defined
        are never replaced by notebook objects.
        """
        from nbkit import cells, live, spawning
        from nbkit.errors import LaunchError, LiveError
        from nbkit.launching import launch

        try:
            args = ddp_options.parse(line)
        except ddp_options.OptionsError as exc:
            raise UsageError(str(exc)) from None
        shell = self.shell
        assert shell is not None
        ranks = live.current()
        if ranks is not None:
            return self._live_cell(ranks, args, cell)
        gone = live.ended()
        if gone is not None:
            # Its cells expect the names that lived on the ranks: a one-shot run would fail oddly.
            raise LiveError(
                f"The live set has ended: {gone.status().ended} Its names are gone. %ddp start starts a new one "
                "(then run the cells that load the model again); %ddp stop makes %%ddp cells one-shot again.",
                ended=True,
            )
        if args.ranks is not None:
            raise UsageError(
                "%%ddp --rank runs a cell on some ranks of a live set, and none is running. Start one with "
                "%ddp start (its processes stay up across cells), or leave --rank out: a one-shot %%ddp runs "
                "on every rank."
            )
        source = shell.transform_cell(cell)
        # Registered in linecache, so tracebacks of the ranks show the cell's lines.
        filename = shell.compile.cache(source, shell.execution_count)
        cells.parse(source, filename)  # a cell that does not parse fails here, before any process starts
        blocker = None if args.spawn else spawning.fork_blocker()
        try:
            if args.spawn or blocker is not None:
                value = spawning.run_source(
                    source,
                    shell.user_ns,
                    filename=filename,
                    reason=blocker or "asked for with --spawn",
                    gpus=args.gpus,
                    timeout=args.timeout,
                    quiet=not args.all_ranks,
                    env=args.env,
                )
            else:
                value = launch(
                    _cell_runner(source, shell.user_ns, filename),
                    gpus=args.gpus,
                    timeout=args.timeout,
                    quiet=not args.all_ranks,
                    env=args.env,
                )
        except LaunchError as exc:
            # The same error, without the frames of nbkit's own plumbing in the ranks' tracebacks.
            error = LaunchError(
                _PLUMBING.sub("", str(exc)), failures=exc.failures, errors=exc.errors, timed_out=exc.timed_out
            )
            raise error from None
        return self._finish(args, cell, value)

    def _live_cell(self, ranks: Any, args: ddp_options.DdpOptions, cell: str) -> Any:
        from nbkit import cells

        shell = self.shell
        assert shell is not None
        refused = [
            name for name, given in (("--gpus", args.gpus), ("--env", args.env), ("--spawn", args.spawn)) if given
        ]
        if refused:
            raise UsageError(
                f"{', '.join(refused)} set up processes, and a live set of {ranks.world_size} rank(s) is running: "
                "its processes are already set up. Leave it out, or %ddp stop and %ddp start with it."
            )
        bad = [r for r in args.ranks or () if r >= ranks.world_size]
        if bad:
            raise UsageError(
                f"--rank {' '.join(map(str, bad))}: the live set has {ranks.world_size} rank(s), numbered 0 to "
                f"{ranks.world_size - 1}."
            )
        source = shell.transform_cell(cell)
        filename = shell.compile.cache(source, shell.execution_count)
        cells.parse(source, filename)  # a cell that does not parse fails here, before anything is sent
        value = ranks.exec(
            source,
            ranks=args.ranks if args.ranks is not None else "all",
            names=ranks.names_for(source, shell.user_ns),
            timeout=args.timeout,
            all_ranks=args.all_ranks,
            filename=filename,
            resend=True if args.resend == [] else args.resend or False,
        )
        return self._finish(args, cell, value)

    def _finish(self, args: ddp_options.DdpOptions, cell: str, value: Any) -> Any:
        if args.out is not None:
            assert self.shell is not None
            self.shell.user_ns[args.out] = value
        if cell.rstrip().endswith(";"):  # IPython's "no output" convention
            return None
        return value

    @line_magic
    def nbkit(self, line: str) -> None:
        """%nbkit doctor | plan MODEL ... | export NOTEBOOK CELL_OR_TAG -o OUT (see nbkit.magics)."""
        words = shlex.split(line)
        command, rest = (words[0], words[1:]) if words else ("", [])
        handlers = {"doctor": self._doctor, "plan": self._plan, "export": self._export}
        if command not in handlers:
            raise UsageError(
                "%nbkit takes one of: doctor | plan MODEL [options] | "
                "export NOTEBOOK CELL_OR_TAG -o OUT.py  (%nbkit plan -h for options)"
            )
        try:
            handlers[command](rest)
        except _HelpShown:
            pass

    def _doctor(self, words: list[str]) -> None:
        from nbkit.diagnostics import doctor

        _parser("%nbkit doctor").parse_args(words)
        print(doctor())

    def _plan(self, words: list[str]) -> None:
        from nbkit.planner import plan

        parser = _parser("%nbkit plan")
        parser.add_argument("model", help="hub id, local path, or nbkit name (tiny:..., random:...)")
        parser.add_argument("--seq-len", type=int, dest="seq_len")
        parser.add_argument("--batch-size", type=int, dest="batch_size")
        parser.add_argument("--4bit", action="store_true", dest="load_in_4bit")
        parser.add_argument("--gpus", type=int)
        parser.add_argument("--gpu-memory", type=float, dest="gpu_memory_gib", metavar="GIB")
        parser.add_argument("--lora-rank", type=int, dest="lora_rank")
        parser.add_argument("--gpu-model", dest="gpu", metavar="NAME", help='the GPU model, e.g. "Tesla T4"; or cpu')
        parser.add_argument("--effective-batch", type=int, dest="effective_batch", metavar="N")
        args = vars(parser.parse_args(words))
        model, effective_batch = args.pop("model"), args.pop("effective_batch")
        # Only what was given: the planner's own defaults apply to the rest. Compared by identity:
        # `0 in (None, False)` is True, which dropped --gpu-memory 0 before plan could refuse it.
        options = {k: v for k, v in args.items() if v is not None and v is not False}
        try:
            planned = plan(model, **options)
            settings = None if effective_batch is None else planned.batch_settings(effective_batch)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        print(planned if settings is None else f"{planned}\n{settings}")

    def _export(self, words: list[str]) -> None:
        from nbkit.export import export_script

        parser = _parser("%nbkit export")
        parser.add_argument("notebook", help="the saved .ipynb file")
        parser.add_argument("cell", help="the cell: a tag, a cell id, or its index (0 = first cell)")
        parser.add_argument("-o", "--out", required=True, help="the script to write, e.g. train.py")
        args = parser.parse_args(words)
        try:
            path = export_script(args.notebook, args.cell, args.out)
        except (ValueError, FileNotFoundError) as exc:
            raise UsageError(str(exc)) from None
        print(
            f"nbkit: wrote {path}. Run it with: torchrun --nproc_per_node <GPUs> {path}  "
            f"(or: accelerate launch {path}; or python {path}, which forks one process per GPU)"
        )


def _cell_runner(source: str, namespace: dict[str, Any], filename: str) -> Any:
    from nbkit.cells import run_cell

    def run_ddp_cell() -> Any:
        # In a forked rank `namespace` is the rank's own copy of the notebook's names: the cell
        # sees them all, and what it assigns stays in the rank.
        return run_cell(source, namespace, filename)

    return run_ddp_cell


# A frame of nbkit's own cell plumbing in a rank's traceback: its "File" line and the source and
# caret lines under it.
_PLUMBING = re.compile(
    r'^  File "' + re.escape(_NBKIT_DIR) + r'/(cells|spawning|magics)\.py", line \d+, in \w+\n(    .*\n)*',
    re.MULTILINE,
)


class _HelpShown(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse for a magic: errors become UsageError (shown in one line), -h does not exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            print(message)
        raise _HelpShown


def _parser(prog: str) -> argparse.ArgumentParser:
    return _Parser(prog=prog, add_help=True)
