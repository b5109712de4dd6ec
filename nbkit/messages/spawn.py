"""What the notebook and spawn mode's launcher process send each other (nbkit.launching.spawn).

    Job              notebook -> launcher, once, pickled over its stdin: the cell, its names, the ranks' set-up
    DashboardOpened  launcher -> notebook: the launch's dashboard opened (the notebook creates its own)
    Envelope(rank, Report(metrics))
                     launcher -> notebook: a rank's dashboard event, the rank channel's message forwarded
    Result           launcher -> notebook, last: rank 0's value (the rank channel's Result, passed on)
    LaunchRaised     launcher -> notebook, last: nbkit.launch raised instead (a failed rank, an interrupt, a
                     launch that could not start)

The bodies a rank sends (Envelope, Report, Result) are nbkit.messages.rank's, defined once there and reused here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nbkit.messages.rank import Envelope, Report, Result
from nbkit.platform.errors import LaunchError, RankError

if TYPE_CHECKING:  # a Job is only built and read where these are imported already (the dashboard, which sends
    # this module's other messages, stays free of cloudpickle)
    from nbkit.launching.rank_options import RankOptions
    from nbkit.notebook.notebook_names import BroughtAlong

__all__ = ["DashboardOpened", "Envelope", "Job", "LaunchRaised", "Report", "Result"]


@dataclass(frozen=True)
class Job:
    """What the launcher process runs: sent once, pickled, over its stdin."""

    source: str
    filename: str
    brought: BroughtAlong
    sys_path: list[str]
    options: RankOptions


@dataclass(frozen=True)
class DashboardOpened:
    """The launcher process created its dashboard for `nprocs` ranks: the notebook creates its own."""

    nprocs: int


@dataclass(frozen=True)
class LaunchRaised:
    """nbkit.launch raised in the launcher process, as the notebook raises it again.

    Attributes:
        type_name: the exception's class: "LaunchError" (a rank failed or the run timed out), "KeyboardInterrupt"
            (interrupted, every rank stopped), else the error of a launch that could not start.
        message: its message.
        failures, errors, timed_out: a LaunchError's fields (empty for the others).
    """

    type_name: str
    message: str
    failures: dict[int, str] = field(default_factory=dict)
    errors: dict[int, RankError] = field(default_factory=dict)
    timed_out: bool = False

    @classmethod
    def of(cls, exc: BaseException) -> LaunchRaised:
        """The message for `exc`, raised by nbkit.launch."""
        if isinstance(exc, LaunchError):
            return cls("LaunchError", str(exc), exc.failures, exc.errors, exc.timed_out)
        return cls(type(exc).__name__, str(exc))

    def exception(self) -> BaseException:
        """The exception to raise in the notebook: a LaunchError with its fields, KeyboardInterrupt, or for a
        launch that could not start its ValueError or TypeError (RuntimeError for any other class, which the
        notebook may not have).
        """
        if self.type_name == "LaunchError":
            return LaunchError(self.message, failures=self.failures, errors=self.errors, timed_out=self.timed_out)
        if self.type_name == "KeyboardInterrupt":
            return KeyboardInterrupt()
        return {"ValueError": ValueError, "TypeError": TypeError}.get(self.type_name, RuntimeError)(self.message)
