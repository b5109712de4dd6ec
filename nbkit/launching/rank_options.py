"""How ranks are set up: one immutable value, checked once where the user's words enter (notebook side).

    options = RankOptions.build(gpus=2, timeout=600, env={"HF_HOME": "/tmp/hf"}, strategy="fsdp")
    options.gpus, options.timeout, options.env_dict()      # 2, 600.0, {"HF_HOME": "/tmp/hf"}

nbkit.launch, nbkit.run_cell, nbkit.start and nbkit.connect build one from their arguments, the
`%%ddp` and `%ddp start` lines (nbkit.notebook.ddp_options) from theirs, the exporter from a notebook's lines;
from there the value travels as it is: to the fork (nbkit.launching.fork), to spawn's launcher process
(pickled, nbkit.launching.spawn), to a live set (nbkit.live) and into an exported script (nbkit.export).
Each option has one default here and one check, so a bad value gets the same message on every path,
naming the option and what to pass: OptionTypeError (an OptionsError and a TypeError) for a value of
the wrong type, OptionsError (a ValueError) for one out of range, EmulationError for a GPU profile
nbkit does not have.

`env` may also name the options nbkit puts into the ranks' environment itself (NBKIT_STRATEGY,
NBKIT_EMULATE): such an entry is read as that option where the option is not given, and where it is
given and differs, the option wins and a notice names the variable.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nbkit.platform import config, notices
from nbkit.platform.errors import EmulationError, OptionsError, OptionTypeError

__all__ = ["STRATEGIES", "RankOptions", "check_timeout"]

# How the ranks share the model: "ddp" (a full copy on every rank) or "fsdp" (sharded).
STRATEGIES = ("ddp", "fsdp")

_log = notices.logger(__name__)


@dataclass(frozen=True)
class RankOptions:
    """How the ranks of one run (a launch, a one-shot cell, a live set) are set up.

    Attributes:
        gpus: processes to run; None: one per visible GPU (without CUDA, gpus=N runs N CPU ranks).
        timeout: seconds (a finite number above 0) before every rank is stopped; None: no limit.
            A live set takes it as the default limit of each call.
        env: extra environment variables for the ranks, as (name, value) pairs (`env_dict()`).
        strategy: "ddp" or "fsdp"; None: not given, which means "ddp" (`rank_strategy`), except in a
            rank of an outside launcher (torchrun), where that launcher's environment stands.
        emulate: the GPU profile the ranks emulate, by its own name ("T4"), or None.
        all_ranks: show every rank's output, not only rank 0's.
        dashboard: show the ranks' reports as a dashboard (one-shot runs).
        spawn: start fresh processes even where forking would work (one-shot cells).

    Raises (on construction): OptionTypeError, OptionsError or EmulationError, naming the option.
    """

    gpus: int | None = None
    timeout: float | None = None
    env: tuple[tuple[str, str], ...] = ()
    strategy: str | None = None
    emulate: str | None = None
    all_ranks: bool = False
    dashboard: bool = True
    spawn: bool = False

    def __post_init__(self) -> None:
        checked = {
            "gpus": check_gpus(self.gpus),
            "timeout": check_timeout(self.timeout),
            "env": tuple(check_env(self.env).items()),
            "strategy": None if self.strategy is None else check_strategy(self.strategy),
            "emulate": None if self.emulate is None else check_emulate(self.emulate),
            "all_ranks": bool(self.all_ranks),
            "dashboard": bool(self.dashboard),
            "spawn": bool(self.spawn),
        }
        for name, value in checked.items():  # frozen: the checked values replace what was passed
            object.__setattr__(self, name, value)

    @classmethod
    def build(
        cls,
        *,
        gpus: Any = None,
        timeout: Any = None,
        env: Any = None,
        strategy: Any = None,
        emulate: Any = None,
        all_ranks: bool = False,
        dashboard: bool = True,
        spawn: bool = False,
    ) -> RankOptions:
        """The options from the user's words (an API call's arguments, a magic line's options).

        Takes each option as given (env: a mapping or None); an NBKIT_STRATEGY / NBKIT_EMULATE entry
        of `env` is read as that option (see the module doc). Raises as the class does.
        """
        variables = check_env(env)
        strategy = _from_env(variables, config.STRATEGY, "strategy", strategy, check_strategy)
        emulate = _from_env(variables, config.EMULATE, "emulate", emulate, check_emulate)
        return cls(
            gpus=gpus,
            timeout=timeout,
            env=tuple(variables.items()),
            strategy=strategy,
            emulate=emulate,
            all_ranks=all_ranks,
            dashboard=dashboard,
            spawn=spawn,
        )

    @property
    def rank_strategy(self) -> str:
        """The strategy the ranks use: `strategy`, "ddp" where it was not given."""
        return self.strategy or "ddp"

    def env_dict(self) -> dict[str, str]:
        """`env` as a dict."""
        return dict(self.env)

    def strategy_environment(self) -> dict[str, str]:
        """NBKIT_STRATEGY (`rank_strategy`) and, where `emulate` is given, NBKIT_EMULATE: the variables
        the ranks read these options from (nbkit.config).
        """
        values = {config.STRATEGY: self.rank_strategy}
        if self.emulate is not None:
            values[config.EMULATE] = self.emulate
        return values

    def process_options(self) -> list[str]:
        """The options given that choose how processes start (gpus, env, spawn, strategy, emulate), by name:
        a live set's processes run already, so a cell there refuses them.
        """
        return [name for name in ("gpus", "env", "spawn", "strategy", "emulate") if getattr(self, name)]


def _shown(value: Any) -> str:
    """A value as the messages show it: numbers as numbers (0 for 0 and 0.0), anything else with its type."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return f"{value:g}"
    return f"{type(value).__name__} {value!r}"


def check_gpus(gpus: Any) -> int | None:
    """`gpus` as an int, or None; OptionsError for anything but a whole number >= 1 or None."""
    if gpus is None:
        return None
    if not isinstance(gpus, numbers.Integral) or isinstance(gpus, bool):
        raise OptionTypeError(f"gpus must be a positive whole number or None (all visible GPUs); got {_shown(gpus)}.")
    if gpus < 1:
        raise OptionsError(f"gpus must be a positive whole number or None (all visible GPUs); got {_shown(gpus)}.")
    return int(gpus)


def check_timeout(timeout: Any) -> float | None:
    """`timeout` as seconds (float), or None; OptionTypeError / OptionsError, saying what is accepted, for
    anything but a finite number > 0 or None (strings, booleans, 0, negatives, NaN, inf).
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise OptionTypeError(f"timeout must be a number of seconds (or None for no limit); got {_shown(timeout)}.")
    if not math.isfinite(timeout) or timeout <= 0:
        raise OptionsError(
            f"timeout must be a finite number of seconds above 0 (or None for no limit); got {_shown(timeout)}."
        )
    return float(timeout)


def check_strategy(strategy: Any) -> str:
    """`strategy` if it is one of STRATEGIES (any case, surrounding spaces ignored); OptionsError otherwise."""
    name = strategy.strip().lower() if isinstance(strategy, str) else strategy
    if name not in STRATEGIES:
        raise OptionsError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}; got {strategy!r}.")
    return str(name)


def check_emulate(emulate: Any) -> str:
    """The profile `emulate` names, by its own name ("t4" -> "T4"); EmulationError naming the profiles otherwise."""
    from nbkit.training.emulation import PROFILES, lookup

    try:
        return lookup(emulate).name
    except EmulationError:
        raise EmulationError(
            f"emulate must name a GPU profile, one of {', '.join(map(repr, PROFILES))} (or None for none); "
            f"got {emulate!r}."
        ) from None


def check_env(env: Any) -> dict[str, str]:
    """`env` (a mapping of names to text, (name, value) pairs, or None) as a new dict; OptionTypeError /
    OptionsError naming the entry that is not a variable name with a text value.
    """
    if env is None:
        return {}
    if isinstance(env, Mapping):
        items = list(env.items())
    elif isinstance(env, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in env):
        items = list(env)
    else:
        raise OptionTypeError(
            f"env must be a dict of environment variables, e.g. env={{'HF_HOME': '/tmp/hf'}} (or None); "
            f"got {_shown(env)}."
        )
    for name, value in items:
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise OptionsError(
                f"env names must be environment variable names (text without '='), e.g. env={{'HF_HOME': "
                f"'/tmp/hf'}}; got {name!r}."
            )
        if not isinstance(value, str):
            raise OptionTypeError(
                f"env values must be text, as environment variables are: env={{{name!r}: {str(value)!r}}}; "
                f"got {type(value).__name__} {value!r} for {name!r}."
            )
    return dict(items)


def _from_env(variables: dict[str, str], name: str, option: str, given: Any, check: Callable[[Any], str]) -> Any:
    """The option `option` where `env` (`variables`, changed in place) also names its variable `name`:
    that entry is taken out, and read as the option where the option is not given; where it is given and
    the entry says otherwise, the option wins and a notice says so.
    """
    if not variables.get(name, "").strip():
        return given
    value = variables.pop(name)
    try:
        wanted = check(value)
    except OptionsError as exc:
        raise type(exc)(f"env={{{name!r}: {value!r}}}: {exc}") from None
    if given is None:
        return wanted
    if check(given) != wanted:
        _log.warning(
            "nbkit: env sets %s=%s, and %s=%r is given: the ranks get %s=%s (the %s argument decides).",
            name,
            value,
            option,
            given,
            name,
            check(given),
            option,
        )
    return given
