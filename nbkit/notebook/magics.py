"""IPython magics: `%load_ext nbkit` adds %ddp, %%ddp and %nbkit. Thin layers over the Python API.

Each magic parses its line (nbkit.notebook.ddp_options), calls the API (a %%ddp cell: nbkit.run_cell, which
holds the routing between live set, fork and spawn) and stores --out; `-h` after any of them, and
`%%ddp?`, `%ddp?`, `%nbkit?`, list the options, one line each. Runs in the notebook process only.

%ddp start [--gpus N] [--timeout S] [--env KEY=VALUE ...] [--strategy {ddp,fsdp}] [--emulate PROFILE]
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
    --gpus, --env, --spawn, --strategy and --emulate belong to starting processes and are refused here (%ddp stop, then
    %ddp start with them); a --rank the set does not have, and a cell that does not parse
    (CellSyntaxError, its line and Python's reason), fail before anything runs. The stop button
    during trainer.train() stops training at a step every rank agrees on and keeps the set
    (nbkit.rank_side.live_stopping). A --rank cell must not call a collective (trainer.evaluate(),
    dist.barrier(), all_reduce): the other ranks never join it, and it waits until an interrupt or
    --timeout ends the set.

%%ddp [--gpus N] [--out NAME] [--timeout S] [--all-ranks] [--env KEY=VALUE ...] [--spawn]
      [--strategy {ddp,fsdp}] [--emulate PROFILE]
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
      notebook functions/classes and picklable values the cell uses (nbkit.launching.spawn). It prints
      one line naming the reason and what it brought along; a name that cannot be brought along
      raises an error naming it.
    --rank is refused here: the processes end with the cell, and a cell that runs on some of them
    only would leave the others waiting in their first collective.

%nbkit doctor [--gpus N]            nbkit.doctor(): GPUs, CUDA state, versions, problems and fixes; --gpus:
                                    the ranks you will start (without a GPU, CPU processes: no error)
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
import contextlib
import shlex
from collections.abc import Callable, Iterator
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from nbkit.notebook import ddp_options
from nbkit.notebook.ddp_options import HelpShown, OptionParser, OptionsError
from nbkit.platform.errors import RanksError

__all__ = ["NbkitMagics", "register", "unregister"]


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


def _doctor_parser() -> argparse.ArgumentParser:
    parser = OptionParser("%nbkit doctor")
    parser.add_argument(
        "--gpus",
        type=ddp_options.gpus_value,  # a parameter cell's None, expanded as $gpus
        metavar="N",
        help="the ranks you will start: without a GPU, N CPU processes (no GPU is then not an error)",
    )
    return parser


def _plan_parser() -> argparse.ArgumentParser:
    parser = OptionParser("%nbkit plan")
    parser.add_argument("model", help="hub id, local path, or nbkit name (tiny:..., random:...)")
    parser.add_argument("--seq-len", type=int, dest="seq_len", metavar="N", help="tokens per sample")
    parser.add_argument("--batch-size", type=int, dest="batch_size", metavar="N", help="samples per GPU and step")
    parser.add_argument("--4bit", action="store_true", dest="load_in_4bit", help="load the model in 4 bits")
    parser.add_argument("--gpus", type=int, metavar="N", help="GPUs to plan for")
    parser.add_argument("--gpu-memory", type=float, dest="gpu_memory_gib", metavar="GIB", help="memory per GPU")
    parser.add_argument("--lora-rank", type=int, dest="lora_rank", metavar="R", help="LoRA rank")
    parser.add_argument("--gpu-model", dest="gpu", metavar="NAME", help='the GPU model, e.g. "Tesla T4"; or cpu')
    parser.add_argument(
        "--effective-batch", type=int, dest="effective_batch", metavar="N", help="also the Trainer batch keeping N"
    )
    return parser


def _export_parser() -> argparse.ArgumentParser:
    parser = OptionParser("%nbkit export")
    parser.add_argument("notebook", help="the saved .ipynb file")
    parser.add_argument("cell", help="the cell: a tag, a cell id, or its index (0 = first cell)")
    parser.add_argument("-o", "--out", required=True, help="the script to write, e.g. train.py")
    parser.add_argument("--force", action="store_true", help="replace OUT even if nbkit did not export it")
    return parser


def _with_options(*usages: Callable[[], str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Append the option lists to a magic's docstring, which `%%ddp?` / `%ddp?` / `%nbkit?` show."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__doc__ = (fn.__doc__ or "") + "\n\n" + "\n".join(usage() for usage in usages)
        return fn

    return decorate


def _parsed(parse: Callable[[Any], Any], line: Any) -> Any:
    """`parse(line)`, with OptionsError as IPython's one-line UsageError; None after -h (shown)."""
    try:
        with _as_usage():
            return parse(line)
    except HelpShown as shown:
        print(shown.text)
        return None


@magics_class
class NbkitMagics(Magics):
    """The %ddp line magic, the %%ddp cell magic and the %nbkit line magic."""

    # (the ignore: IPython's stubs type the decorator that takes a name as accepting nothing)
    @line_magic("ddp")  # type: ignore[arg-type]
    @_with_options(ddp_options.start_usage)
    def ddp_line(self, line: str) -> None:
        """%ddp start [options] | stop | status: start, stop or show the live set (see nbkit.magics)."""
        from nbkit import live

        command, _, rest = line.strip().partition(" ")
        if command == "start":
            opts = _parsed(ddp_options.parse_start, rest)
            if opts is not None:
                with _as_usage():
                    ranks = live.start_with(opts)
                devices = ", ".join(sorted({r.device for r in ranks.status().ranks}))
                print(f"nbkit: live set of {ranks.world_size} rank(s) on {devices}; %%ddp cells now run on it.")
        elif command in ("stop", "status"):
            print(_stop() if command == "stop" else _status())
        elif command in ("-h", "--help"):
            print(ddp_options.start_usage())
        else:
            raise UsageError(
                "%ddp takes one of: start [--gpus N] [--timeout S] [--env KEY=VALUE ...] [--strategy {ddp,fsdp}] "
                "[--emulate PROFILE] | stop | status"
            )

    @cell_magic
    @_with_options(ddp_options.usage)
    def ddp(self, line: str, cell: str) -> Any:
        """Run this cell on every GPU: on the live set if one runs, else one-shot (nbkit.run_cell).

        On a live set, notebook names the cell reads are sent once per object: a later cell that reads
        the same object sends nothing; rebinding the name in the notebook sends it again. A change made
        in place to an object already sent (`data.append(x)`) does not reach the ranks: rebind the name
        or use --resend NAME (--resend alone: every name the cell reads). Names the ranks' cells defined
        are never replaced by notebook objects. See nbkit.magics for the rest.
        """
        from nbkit.notebook.run_cell import run_cell_with

        args = _parsed(ddp_options.parse, line)
        if args is None:
            return None
        shell = self.shell
        assert shell is not None
        source = shell.transform_cell(cell)
        # Registered in linecache, so tracebacks of the ranks show the cell's lines.
        filename = shell.compile.cache(source, shell.execution_count)
        try:
            with _as_usage():
                value = run_cell_with(
                    source,
                    shell.user_ns,
                    args.setup,
                    ranks=args.ranks,
                    resend=True if args.resend == [] else args.resend or False,
                    filename=filename,
                )
        except KeyboardInterrupt as interrupt:
            raise _one_line(interrupt) from None
        if args.out is not None:
            shell.user_ns[args.out] = value
        if cell.rstrip().endswith(";"):  # IPython's "no output" convention
            return None
        return value

    @line_magic
    @_with_options(_doctor_parser().format_help, _plan_parser().format_help, _export_parser().format_help)
    def nbkit(self, line: str) -> None:
        """%nbkit doctor | plan MODEL [options] | export NOTEBOOK CELL_OR_TAG -o OUT (see nbkit.magics)."""
        words = shlex.split(line)
        command, rest = (words[0], words[1:]) if words else ("", [])
        handlers = {"doctor": _doctor, "plan": _plan, "export": _export}
        if command not in handlers:
            raise UsageError(
                "%nbkit takes one of: doctor | plan MODEL [options] | "
                "export NOTEBOOK CELL_OR_TAG -o OUT.py  (%nbkit plan -h for options)"
            )
        handlers[command](rest)


@contextlib.contextmanager
def _as_usage() -> Iterator[None]:
    """A mistake in a magic's line that the API it calls finds, as IPython's one-line UsageError naming the
    magic's option: the API's errors name its own arguments (gpus=N), where the magic's user types --gpus N.
    """
    try:
        yield
    except RanksError as exc:
        raise UsageError(exc.magic_text) from None
    except OptionsError as exc:
        raise UsageError(_magic_words(str(exc))) from None


def _magic_words(message: str) -> str:
    """An option's message (RankOptions: "emulate must ...") with the option as the magics spell it
    ("--emulate must ..."); other messages as they are.
    """
    import dataclasses

    from nbkit.launching.rank_options import RankOptions

    name, sep, rest = message.partition(" must ")
    if sep and name in {f.name for f in dataclasses.fields(RankOptions)}:
        return f"--{name.replace('_', '-')} must {rest}"
    return message


def _one_line(interrupt: KeyboardInterrupt) -> KeyboardInterrupt:
    """The stop button's interrupt of a %%ddp cell, shown by the notebook as one line: nbkit has already said
    what it stopped, and the traceback through nbkit's waiting code would add ~60 lines of nothing the user
    can act on. (IPython shows what an exception's `_render_traceback_` returns in place of its traceback.)
    """
    setattr(interrupt, "_render_traceback_", lambda: ["KeyboardInterrupt"])  # noqa: B010 (not a declared attribute)
    return interrupt.with_traceback(None)


def _stop() -> str:
    from nbkit import live

    ranks, gone = live.current(), live.ended()
    if ranks is None and gone is not None:
        live.forget_ended()
        return f"nbkit: the live set had ended: {gone.status().ended} %%ddp cells are one-shot again."
    if ranks is None:
        return "nbkit: no live set is running."
    ranks.stop()
    return f"nbkit: stopped the live set ({ranks.world_size} rank(s))."


def _status() -> str:
    from nbkit import live

    ranks, gone = live.current(), live.ended()
    if ranks is not None:
        return str(ranks.status())
    if gone is not None:  # says that it ended, why, and what to do
        return str(gone.status())
    return "nbkit: no live set is running (%ddp start starts one)."


def _doctor(words: list[str]) -> None:
    from nbkit.notebook.diagnostics import doctor

    args = _parsed(_doctor_parser().parse_args, words)
    if args is not None:
        print(doctor(gpus=args.gpus))


def _plan(words: list[str]) -> None:
    from nbkit.notebook.planner import plan

    parsed = _parsed(_plan_parser().parse_args, words)
    if parsed is None:
        return
    args = vars(parsed)
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


def _export(words: list[str]) -> None:
    from nbkit.notebook.export import export_script

    args = _parsed(_export_parser().parse_args, words)
    if args is None:
        return
    try:
        path = export_script(args.notebook, args.cell, args.out, force=args.force)
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    print(
        f"nbkit: wrote {path}. Run it with: torchrun --nproc_per_node <GPUs> {path}  "
        f"(or: accelerate launch {path}; or python {path}, which forks one process per GPU)"
    )
