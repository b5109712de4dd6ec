"""What spawn mode's launcher process reports when nbkit.launch raises there comes back, through a real pipe,
as the exception the notebook raises: the same class where the notebook can rebuild it, with its fields.
"""

from __future__ import annotations

from multiprocessing import Pipe

import pytest

from nbkit.messages.spawn import LaunchRaised
from nbkit.platform.errors import LaunchError, OptionsError, RankError


def _through_a_pipe(exc: BaseException) -> BaseException:
    reader, writer = Pipe(duplex=False)
    writer.send(LaunchRaised.of(exc))
    return reader.recv().exception()


@pytest.mark.version_independent
def test_a_launch_error_comes_back_with_which_ranks_failed_and_why():
    error = RankError(rank=1, type="ValueError", message="batch 7 has no labels", traceback="Traceback ...", time=5.0)
    sent = LaunchError("Rank 1 failed.", failures={1: "raised ValueError"}, errors={1: error}, timed_out=True)
    back = _through_a_pipe(sent)
    assert type(back) is LaunchError and str(back) == "Rank 1 failed."
    assert (back.failures, back.errors, back.timed_out) == ({1: "raised ValueError"}, {1: error}, True)


@pytest.mark.version_independent
def test_an_interrupt_comes_back_as_keyboard_interrupt():
    assert type(_through_a_pipe(KeyboardInterrupt())) is KeyboardInterrupt


@pytest.mark.version_independent
@pytest.mark.parametrize(
    ("sent", "raised"),
    [
        (ValueError("gpus must be positive"), ValueError),
        (TypeError("nbkit.launch needs a function"), TypeError),
        # a class the notebook may not have (or that takes other arguments) comes back as RuntimeError
        (OptionsError("bad option"), RuntimeError),
        (RuntimeError("forking is blocked"), RuntimeError),
    ],
)
def test_a_launch_that_could_not_start_comes_back_with_its_message(sent, raised):
    back = _through_a_pipe(sent)
    assert type(back) is raised and str(back) == str(sent)
