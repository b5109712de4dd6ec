"""The options of a `%%ddp` line, parsed without IPython.

One spec serves the magic (nbkit.magics) and the script exporter (nbkit.export), so a line the
magic accepts is read the same way by both, and `import nbkit.export` never imports IPython.

    opts = parse("--gpus 2 --out loss --env A=1 B=2")
    opts.setup.gpus, opts.out, opts.setup.env_dict()     # 2, "loss", {"A": "1", "B": "2"}

The options that set up the ranks (--gpus, --timeout, --env, --strategy, --emulate, --all-ranks,
--spawn) become one nbkit.launching.rank_options.RankOptions, checked there as nbkit.launch checks its arguments
(the same messages); `parse_start` returns one for `%ddp start`.

`--rank N [N ...]` runs the cell on those ranks of the live set only (`%ddp start`); a one-shot
%%ddp (no live set) rejects it (nbkit.magics), since its processes end with the cell and a cell
that runs on some of them only would leave the others waiting. `--resend [NAME ...]` sends notebook
names to the live set's ranks again although they hold those objects already (a one-shot %%ddp
always uses the current values, so there it changes nothing). `--strategy {ddp,fsdp}` and
`--emulate PROFILE` reach the ranks' environment (nbkit.launching.rank_contract.rank_environment) of a one-shot run;
on a running live set they are refused, as --gpus is.

`-h` anywhere raises HelpShown with the option list (one line per option), which the magics print;
`usage()` and `start_usage()` give the same text for their docstrings (`%%ddp?`, `%ddp?`).
"""

from __future__ import annotations

import argparse
import keyword
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field

from nbkit.launching.rank_options import RankOptions
from nbkit.platform.errors import OptionsError

__all__ = [
    "DdpOptions",
    "HelpShown",
    "OptionParser",
    "OptionsError",
    "gpus_value",
    "parse",
    "parse_env",
    "parse_start",
    "start_usage",
    "usage",
]

PROG = "%%ddp"


class HelpShown(Exception):
    """-h was given: `text` is the option list to show, and nothing runs."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


@dataclass(frozen=True)
class DdpOptions:
    """What a %%ddp line asks for.

    Attributes:
        setup: how the ranks are set up (--gpus, --timeout, --env, --strategy, --emulate, --all-ranks,
            --spawn), checked.
        out: notebook name to store rank 0's value under, or None.
        ranks: run on these ranks of the live set only (None: every rank).
        resend: notebook names to send to the live set's ranks even though they hold that object
            already (after a change made in place); [] for every name the cell reads; None: none.
    """

    setup: RankOptions = field(default_factory=RankOptions)
    out: str | None = None
    ranks: list[int] | None = None
    resend: list[str] | None = None


class _OneLinePerOption(argparse.HelpFormatter):
    """Each option and its help on one line (the widest, --env KEY=VALUE [KEY=VALUE ...], fits)."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=40, width=160)


class OptionParser(argparse.ArgumentParser):
    """argparse for a magic's line: raises OptionsError instead of printing and exiting, and HelpShown
    (with the option list, one line per option) for -h.
    """

    def __init__(self, prog: str):
        super().__init__(prog=prog, add_help=True, formatter_class=_OneLinePerOption)

    def error(self, message: str) -> None:  # type: ignore[override]
        """A line that cannot be read: OptionsError naming the option."""
        raise OptionsError(f"{self.prog}: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        """Only -h ends parsing early here: HelpShown with the option list."""
        raise HelpShown(self.format_help())

    def print_help(self, file: object = None) -> None:
        """-h prints nothing itself: exit() raises HelpShown with the text, for the caller to show."""


def gpus_value(text: str) -> int | None:
    """A --gpus value: a whole number, or "None", which is what `--gpus $gpus` expands to where a notebook's parameters
    leave gpus at None, and means the default (one process per visible GPU), as the exporter reads it too.
    """
    return None if text == "None" else int(text)


gpus_value.__name__ = "int"  # argparse names the type in its message: "--gpus: invalid int value: 'two'"


def _process_options(parser: argparse.ArgumentParser) -> None:
    """The options that set up processes, shared by %%ddp (one-shot) and %ddp start."""
    parser.add_argument(
        "--gpus", type=gpus_value, default=None, metavar="N", help="processes to run (default: one per visible GPU)"
    )
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="stop every rank after S seconds")
    parser.add_argument(
        "--env",
        nargs="+",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variables for the processes",
    )
    parser.add_argument(
        "--strategy", default=None, metavar="{ddp,fsdp}", help="how the ranks share the model (default: ddp)"
    )
    parser.add_argument("--emulate", default=None, metavar="PROFILE", help="GPU profile for the ranks to emulate")


def _parser() -> argparse.ArgumentParser:
    parser = OptionParser(PROG)
    _process_options(parser)
    parser.add_argument("--out", default=None, metavar="NAME", help="store rank 0's value in the notebook under NAME")
    parser.add_argument("--all-ranks", action="store_true", help="show the output of every rank, not only rank 0")
    parser.add_argument("--spawn", action="store_true", help="start fresh processes even where forking would work")
    parser.add_argument(
        "--rank", type=int, nargs="+", default=None, metavar="N", help="run on these ranks of the live set only"
    )
    parser.add_argument(
        "--resend",
        nargs="*",
        default=None,
        metavar="NAME",
        help="live set: send these notebook names again although the ranks hold them (all the cell reads: none given)",
    )
    return parser


def _start_parser() -> argparse.ArgumentParser:
    parser = OptionParser("%ddp start")
    _process_options(parser)
    return parser


def usage() -> str:
    """The %%ddp option list, one line per option, for help texts."""
    return _parser().format_help()


def start_usage() -> str:
    """The `%ddp start` option list, one line per option, for help texts."""
    return _start_parser().format_help()


def parse(line: str) -> DdpOptions:
    """The options of a %%ddp line (the text after "%%ddp").

    Takes the line as the user typed it (after IPython has expanded `$name` and `{expr}`; `--gpus None`, from
    `--gpus $gpus` with gpus None, is the default). Returns a DdpOptions. Raises OptionsError naming the option for
    anything it cannot read: an unknown option, a value of the wrong type, an --out that is not a Python name, an
    --env item without "=", and what RankOptions refuses (a timeout that is not a positive number, a --gpus below
    1, a --strategy other than ddp and fsdp, a profile nbkit does not have); HelpShown for -h.
    """
    ns = _parser().parse_args(_words(line, PROG))
    if ns.rank is not None and any(r < 0 for r in ns.rank):
        raise OptionsError(f"--rank takes rank numbers (0 and up); got {' '.join(map(str, ns.rank))}.")
    bad = [n for n in ns.resend or () if not n.isidentifier()]
    if bad:
        raise OptionsError(f"--resend takes notebook names; {bad[0]!r} is not one.")
    if ns.out is not None and (not ns.out.isidentifier() or keyword.iskeyword(ns.out)):
        raise OptionsError(f"--out needs a Python name to store the value under; {ns.out!r} is not one.")
    return DdpOptions(
        setup=_setup(ns, all_ranks=ns.all_ranks, spawn=ns.spawn),
        out=ns.out,
        ranks=sorted(set(ns.rank)) if ns.rank is not None else None,
        resend=ns.resend,
    )


def parse_start(line: str) -> RankOptions:
    """The options of a `%ddp start` line: --gpus N, --timeout S, --env KEY=VALUE ..., --strategy, --emulate.

    Raises OptionsError and HelpShown as parse() does.
    """
    return _setup(_start_parser().parse_args(_words(line, "%ddp start")))


def _words(line: str, prog: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise OptionsError(f"{prog}: cannot read the line ({exc}).") from None


def _setup(ns: argparse.Namespace, **more: bool) -> RankOptions:
    """The ranks' set-up a parsed line asks for, checked by RankOptions."""
    return RankOptions.build(
        gpus=ns.gpus,
        timeout=ns.timeout,
        env=parse_env(item for group in ns.env for item in group),
        strategy=ns.strategy,
        emulate=ns.emulate,
        **more,
    )


def parse_env(items: Iterable[str]) -> dict[str, str]:
    """KEY=VALUE strings as a dict. Raises OptionsError for an item without "=" or without a key."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OptionsError(f"--env takes KEY=VALUE pairs; got {item!r}.")
        env[key] = value
    return env
