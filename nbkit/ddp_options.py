"""The options of a `%%ddp` line, parsed without IPython.

One spec serves the magic (nbkit.magics) and the script exporter (nbkit.export), so a line the
magic accepts is read the same way by both, and `import nbkit.export` never imports IPython.

    opts = parse("--gpus 2 --out loss --env A=1 B=2")
    opts.gpus, opts.out, opts.env          # 2, "loss", {"A": "1", "B": "2"}

`--rank N [N ...]` runs the cell on those ranks of the live set only (`%ddp start`); a one-shot
%%ddp (no live set) rejects it (nbkit.magics), since its processes end with the cell and a cell
that runs on some of them only would leave the others waiting. `--resend [NAME ...]` sends notebook
names to the live set's ranks again although they hold those objects already (a one-shot %%ddp
always uses the current values, so there it changes nothing). `parse_start` reads the line of
`%ddp start`.
"""

from __future__ import annotations

import argparse
import keyword
import math
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field

from nbkit.errors import NbkitError

__all__ = ["DdpOptions", "OptionsError", "StartOptions", "parse", "parse_env", "parse_start"]

PROG = "%%ddp"


class OptionsError(NbkitError, ValueError):
    """A %%ddp line that cannot be read; the message names the option and what it takes."""


@dataclass
class DdpOptions:
    """What a %%ddp line asks for.

    Attributes:
        gpus: processes to run (None: one per visible GPU).
        out: notebook name to store rank 0's value under, or None.
        timeout: seconds after which every rank is stopped, or None.
        all_ranks: show every rank's output, not only rank 0's.
        env: environment variables for the processes.
        spawn: start fresh processes even where forking would work.
        ranks: run on these ranks of the live set only (None: every rank).
        resend: notebook names to send to the live set's ranks even though they hold that object
            already (after a change made in place); [] for every name the cell reads; None: none.
    """

    gpus: int | None = None
    out: str | None = None
    timeout: float | None = None
    all_ranks: bool = False
    env: dict[str, str] = field(default_factory=dict)
    spawn: bool = False
    ranks: list[int] | None = None
    resend: list[str] | None = None


@dataclass
class StartOptions:
    """What a `%ddp start` line asks for (the arguments of nbkit.start)."""

    gpus: int | None = None
    timeout: float | None = None
    env: dict[str, str] = field(default_factory=dict)


class _Parser(argparse.ArgumentParser):
    """argparse that raises OptionsError instead of printing and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise OptionsError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, add_help=False)
    parser.add_argument("--gpus", type=int, default=None, help="processes to run (default: one per visible GPU)")
    parser.add_argument("--out", default=None, metavar="NAME", help="store rank 0's value in the notebook under NAME")
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="stop every rank after S seconds")
    parser.add_argument("--all-ranks", action="store_true", help="show the output of every rank, not only rank 0")
    parser.add_argument(
        "--env",
        nargs="+",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variables for the processes",
    )
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


def usage() -> str:
    """The option summary, for help texts."""
    return _parser().format_help()


def parse(line: str) -> DdpOptions:
    """The options of a %%ddp line (the text after "%%ddp").

    Takes the line as the user typed it (after IPython has expanded `$name` and `{expr}`).
    Returns a DdpOptions. Raises OptionsError naming the option for anything it cannot read: an
    unknown option, a value of the wrong type, an --out that is not a Python name, an --env item
    without "=", a timeout that is not a positive number, or a --gpus below 1.
    """
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise OptionsError(f"{PROG}: cannot read the line ({exc}).") from None
    ns = _parser().parse_args(words)
    _check_common(ns)
    if ns.rank is not None and any(r < 0 for r in ns.rank):
        raise OptionsError(f"--rank takes rank numbers (0 and up); got {' '.join(map(str, ns.rank))}.")
    bad = [n for n in ns.resend or () if not n.isidentifier()]
    if bad:
        raise OptionsError(f"--resend takes notebook names; {bad[0]!r} is not one.")
    if ns.out is not None and (not ns.out.isidentifier() or keyword.iskeyword(ns.out)):
        raise OptionsError(f"--out needs a Python name to store the value under; {ns.out!r} is not one.")
    return DdpOptions(
        gpus=ns.gpus,
        out=ns.out,
        timeout=ns.timeout,
        all_ranks=ns.all_ranks,
        env=parse_env(item for group in ns.env for item in group),
        spawn=ns.spawn,
        ranks=sorted(set(ns.rank)) if ns.rank is not None else None,
        resend=ns.resend,
    )


def parse_start(line: str) -> StartOptions:
    """The options of a `%ddp start` line: --gpus N, --timeout S, --env KEY=VALUE ...

    Raises OptionsError as parse() does.
    """
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise OptionsError(f"%ddp start: cannot read the line ({exc}).") from None
    parser = _Parser(prog="%ddp start", add_help=False)
    parser.add_argument("--gpus", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--env", nargs="+", action="append", default=[], metavar="KEY=VALUE")
    ns = parser.parse_args(words)
    _check_common(ns)
    return StartOptions(gpus=ns.gpus, timeout=ns.timeout, env=parse_env(item for group in ns.env for item in group))


def _check_common(ns: argparse.Namespace) -> None:
    if ns.gpus is not None and ns.gpus < 1:
        raise OptionsError(f"--gpus takes a whole number of at least 1; got {ns.gpus}.")
    if ns.timeout is not None and not (math.isfinite(ns.timeout) and ns.timeout > 0):
        raise OptionsError(f"--timeout takes a number of seconds above 0; got {ns.timeout}.")


def parse_env(items: Iterable[str]) -> dict[str, str]:
    """KEY=VALUE strings as a dict. Raises OptionsError for an item without "=" or without a key."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OptionsError(f"--env takes KEY=VALUE pairs; got {item!r}.")
        env[key] = value
    return env
