"""Metrics from the training ranks to the notebook: `nbkit.report` and the Trainer callback.

Inside `nbkit.launch` every rank sends its metrics over the launch channel; the notebook process
shows them as one dashboard (nbkit.dashboard) for all ranks. Every transformers `Trainer` (and so
TRL's SFTTrainer) created inside a launched rank reports by itself: `setup_rank()` patches
`Trainer.__init__` to add `DashboardCallback` and to drop transformers' own progress bars, which
would otherwise be drawn once per rank.

Outside a launch `report()` feeds a dashboard in the current process: in a notebook, one panel per
cell (closed, as a static summary, when the cell finishes); in a script or under torchrun, text
lines printed by rank 0.

An event is a flat dict. Keys the dashboard understands (all optional):

    step, total_steps, loss, learning_rate, grad_norm, epoch,
    tokens_per_second (this rank), tokens_seen (this rank, cumulative),
    peak_memory_gib + memory_device (added automatically), elapsed, time (added automatically)

Any other number is kept in the event log; the panel shows rank 0's latest ones as its "last log".
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import numbers
import os
import resource
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from nbkit.messages import rank as channel
from nbkit.notebook import dashboard
from nbkit.notebook.dashboard import board
from nbkit.platform import distributed, patching
from nbkit.platform import shell as nbkit_shell
from nbkit.training import callbacks

__all__ = ["DashboardCallback", "peak_memory_gib", "report", "setup_rank", "trainer_pace"]  # noqa: F822 (DashboardCallback: built on first use)


class _Clock:
    """Per-process reporting state: when this rank started, and its token counter."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.tokens_seen = 0
        self.tokens_since = 0  # tokens reported but not yet turned into a rate
        self.mark = self.start  # when the current rate span began


_clock = _Clock()


def report(step: int | None = None, loss: Any = None, **metrics: Any) -> None:
    """Send this rank's metrics to the notebook's dashboard.

    Adds `elapsed` (seconds since the rank started), `time`, and the rank's peak memory
    (`peak_memory_gib`: torch.cuda.max_memory_allocated where this process uses CUDA, else the
    process's peak resident memory; `memory_device` says which).

    Where it goes: inside nbkit.launch, to the notebook's dashboard (every rank may call it; the
    dashboard sums tokens/s over ranks and shows one row per rank). Outside a launch, to a
    dashboard in this process (a notebook panel per cell, or text lines); under torchrun or
    accelerate launch only rank 0's reports are shown. Never raises for a value it cannot
    turn into a number: such values are sent as text.

    Args:
        step: the optimizer step just finished (drives the progress bar and the loss curve).
        loss: this rank's loss at that step (a float or a one-element tensor; the dashboard
            averages the ranks).
        **metrics: more numbers. Names with a meaning: total_steps (progress bar and ETA),
            learning_rate, grad_norm, epoch, and `tokens`: how many tokens this rank processed
            since its previous report(); nbkit turns it into tokens_per_second and tokens_seen.
    """
    event = _event(step, loss, metrics)
    if channel.connected():
        channel.send(channel.Report(event))
        return
    if distributed.is_distributed() and not distributed.is_main():
        return
    _local.event(distributed.rank(), event)


def setup_rank() -> None:
    """Per-rank set-up run by nbkit.launch before the user's function (on every rank).

    Restarts this rank's clock and token counter and applies the "reporting" patches, which only
    take effect in ranks launched by nbkit.launch (where a dashboard listens).
    """
    global _clock
    _clock = _Clock()
    # Importing transformers takes seconds to tens of seconds: a rank that never builds a Trainer
    # must not pay for it, so the patches wait for transformers.trainer to be imported
    # (nbkit.patching's import hook applies them right after).
    patching.apply("reporting")
    if channel.connected():
        _library_output_in_rank()


def _library_output_in_rank() -> None:
    """In a rank forked from a notebook kernel, tqdm bars (transformers' "Loading weights",
    datasets' map) are notebook widgets whose messages ipykernel drops from a forked process, with a
    warning in the kernel log for every update; and N ranks would draw N of them. So every rank but
    a live set's rank 0 turns the hub's bars, which transformers uses, and datasets' own off (a saved
    notebook showed each of SFTTrainer's four dataset bars as "Loading widget..." when reopened in
    JupyterLab). Rank 0 of a live set keeps them as text bars (see _text_bars): a download of
    gigabytes shows its progress in the cell, once. Training progress is the dashboard's either way
    (the Trainer patch below). And transformers' log lines go where this rank's other output goes.
    """
    if not _text_bars_here():
        _progress_bars_off()
    # transformers reads the hub's switch once, at import: where the notebook imported it already,
    # its own switch is the one that counts.
    transformers_logging = sys.modules.get("transformers.utils.logging")
    if transformers_logging is None:
        return
    if not _text_bars_here():
        transformers_logging.disable_progress_bar()
    # Its log handler kept the stream of the notebook, where transformers was imported, so
    # every rank printed its notices there (the PAD/BOS/EOS one twice on 2 ranks, seen in
    # JupyterLab): it writes to this rank's stderr (silenced or "[rank N]"-prefixed) instead.
    # (Not setStream(): it flushes the old stream first, which may be closed by now.)
    for handler in transformers_logging.get_logger().handlers:
        if isinstance(handler, logging.StreamHandler):
            with handler.lock or contextlib.nullcontext():
                handler.stream = sys.stderr


def _progress_bars_off() -> None:
    """The hub's (and so transformers') and datasets' progress bars off in this process."""
    # datasets reads this at import (an explicit 0 from the user wins); where the notebook imported
    # datasets already, its switch is the one that counts.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    datasets_tqdm = sys.modules.get("datasets.utils.tqdm")
    if datasets_tqdm is not None and os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1":
        datasets_tqdm.disable_progress_bars()
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        return
    disable_progress_bars()


def _text_bars_here() -> bool:
    """Rank 0 of a rank whose Python streams are nbkit's line relay to the notebook (a live set).

    Text lines redrawn with a carriage return reach the cell from there, and only one rank should draw them.
    """
    from nbkit.rank_side import output

    return channel.connected() and distributed.rank() == 0 and isinstance(sys.stderr, output.LineStream)


@patching.patch(
    "tqdm.auto:tqdm",
    reason="a live rank runs in an ipyparallel engine, an ipykernel process, where tqdm.auto picks ipywidgets bars; "
    "a widget's state lives in the rank, which has no frontend, so the cell would show 'Loading widget...': rank 0 "
    "draws text bars instead (tqdm.auto's class outside a kernel), which its relay carries to the cell; the hub's, "
    "transformers' and datasets' bars subclass or call tqdm.auto's class, in the rank",
    upstream="none known: tqdm has no switch to force text bars inside an ipykernel process "
    "(tqdm/autonotebook.py decides by 'ipykernel.zmqshell' in sys.modules)",
    group="reporting",
    when=_text_bars_here,
    value=True,
)
def _text_bars(original: Any) -> Any:
    from tqdm.asyncio import tqdm  # what tqdm.auto gives outside a kernel: text bars, async iteration too

    return tqdm


# --------------------------------------------------------------------------------------------
# Building an event
# --------------------------------------------------------------------------------------------


def _event(step: Any, loss: Any, metrics: dict[str, Any]) -> dict[str, Any]:
    now = time.monotonic()
    event: dict[str, Any] = {}
    if step is not None:
        event["step"] = _plain(step)
    if loss is not None:
        event["loss"] = _plain(loss)
    tokens = metrics.pop("tokens", None)
    event.update({name: _plain(value) for name, value in metrics.items()})
    if tokens is not None:
        _clock.tokens_seen += int(_plain(tokens))
        _clock.tokens_since += int(_plain(tokens))
        event["tokens_seen"] = _clock.tokens_seen
        span = now - _clock.mark
        # Two reports in the same millisecond give no usable rate: keep counting until the span is
        # long enough to measure.
        if span >= 1e-3:
            event["tokens_per_second"] = _clock.tokens_since / span
            _clock.tokens_since, _clock.mark = 0, now
    elif _clock.tokens_since == 0:
        _clock.mark = now  # `tokens` counts what was processed since the previous report
    event.setdefault("elapsed", now - _clock.start)
    event["time"] = time.time()
    event.update(_peak_memory())
    return event


def _plain(value: Any) -> Any:
    """A number (or text) that pickles anywhere: tensors and numpy scalars become Python numbers."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return _plain(item())
        except (ValueError, RuntimeError, TypeError):  # a tensor of several elements
            pass
    return str(value)


def peak_memory_gib() -> float:
    """This process's peak memory in GiB, as the dashboard shows it: torch.cuda.max_memory_allocated
    of the current GPU where this process uses CUDA, else the process's peak resident memory (RSS).
    """
    return _peak_memory()["peak_memory_gib"]


def _peak_memory() -> dict[str, Any]:
    torch = sys.modules.get("torch")
    # Asking torch.cuda anything in a process that has not initialised CUDA would initialise it
    # (and in the notebook process make every later fork fail): only where it is already live.
    if torch is not None and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        return {"peak_memory_gib": torch.cuda.max_memory_allocated(index) / 2**30, "memory_device": f"cuda:{index}"}
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    scale = 2**30 if sys.platform == "darwin" else 2**20  # macOS reports bytes
    return {"peak_memory_gib": peak_kib / scale, "memory_device": "cpu"}


# --------------------------------------------------------------------------------------------
# Outside a launch: a dashboard in this process
# --------------------------------------------------------------------------------------------


class _LocalDashboard:
    """The dashboard that report() feeds when no launch is listening.

    In IPython, one dashboard per cell execution: it is closed (leaving its summary) when the cell
    finishes. Elsewhere one dashboard for the process, closed at exit.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._board: Any = None
        self._cell: int | None = None
        self._hooked: set[int] = set()

    def event(self, rank: int, event: dict[str, Any]) -> None:
        shell = nbkit_shell.current()
        cell = getattr(shell, "execution_count", None)
        with self._lock:
            if self._board is not None and cell != self._cell:
                self._board.close(success=True)
                self._board = None
            if self._board is None:
                self._board, self._cell = dashboard.create(1), cell
                self._close_later(shell)
            board = self._board
        board.event(rank, event)

    def close(self, *_: Any) -> None:
        with self._lock:
            board, self._board = self._board, None
        if board is not None:
            board.close(success=True)

    def _close_later(self, shell: Any) -> None:
        if shell is None:
            if not self._hooked:
                atexit.register(self.close)
                self._hooked.add(0)
            return
        if id(shell) not in self._hooked:
            shell.events.register("post_run_cell", self.close)
            self._hooked.add(id(shell))


_local = _LocalDashboard()


# --------------------------------------------------------------------------------------------
# transformers: the callback, and the patches that add it to every Trainer in a launched rank
# --------------------------------------------------------------------------------------------


def trainer_pace(trainer: Any) -> dict[str, Any]:
    """The pace of `trainer`'s last train() as nbkit's dashboard callback clocked it on this rank
    (`_StepReporter.pace`); {} for a Trainer without the callback (outside a rank nbkit started).
    """
    reporter = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, _StepReporter)), None)
    return reporter.pace() if reporter is not None else {}


def _dashboard_callback() -> type:
    return callbacks.trainer_callback("DashboardCallback", _StepReporter, __name__)


# What a step event carries already, and Trainer's FLOP count (no use to a reader).
_STEP_KEYS = frozenset({"loss", "learning_rate", "epoch", "total_flos"})


class _StepReporter:
    """A transformers TrainerCallback that reports every optimizer step to the dashboard.

    Each step it sends step, total_steps, this rank's loss for the step (the sum of its
    micro-batch losses, as Trainer logs it, without the cross-rank average), learning_rate,
    epoch, tokens (input tokens of the step's batches, padding included) and peak memory; each
    Trainer log adds grad_norm and evaluation metrics. nbkit adds it to every Trainer created
    inside nbkit.launch (the loss and token counts come from the trainer's training_step, which
    nbkit wraps there too: _count_micro_batches).
    """

    def __init__(self) -> None:
        self._loss: Any = None
        self._tokens = 0
        # The run's pace, first step apart (it holds compilation and warm-up): when train() began, and
        # (monotonic time, tokens) at the end of each optimizer step.
        self.began: float | None = None
        self.steps: list[tuple[float, int]] = []

    def add_micro_batch(self, loss: Any, tokens: int) -> None:
        """Count one micro-batch (called from Trainer.training_step); the loss stays a tensor so
        that no device synchronisation happens before the step ends.
        """
        if loss is not None:
            self._loss = loss if self._loss is None else self._loss + loss
        self._tokens += tokens

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._loss, self._tokens = None, 0
        self.began, self.steps = time.monotonic(), []
        report(step=state.global_step, total_steps=state.max_steps)

    def pace(self) -> dict[str, Any]:
        """This rank's pace in the last train(): "first_step_seconds"; "seconds_per_step" and
        "tokens_per_second", the steady pace the dashboard's summary also gives (board.steady_pace: medians
        over the steps after the first, None where fewer than two ran); and "step_seconds", every step's
        seconds in order, the first included.
        """
        if self.began is None or not self.steps:
            return {"first_step_seconds": None, "seconds_per_step": None, "tokens_per_second": None, "step_seconds": []}
        ends = [self.began] + [end for end, _ in self.steps]
        seen = itertools.accumulate(tokens for _, tokens in self.steps)
        marks = [(end, step, total) for step, ((end, _), total) in enumerate(zip(self.steps, seen), start=1)]
        per_step, rate = board.steady_pace(marks)
        return {
            "first_step_seconds": ends[1] - ends[0],
            "seconds_per_step": per_step,
            "tokens_per_second": rate,
            "step_seconds": [later - earlier for earlier, later in itertools.pairwise(ends)],
        }

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        metrics: dict[str, Any] = {"total_steps": state.max_steps, "epoch": state.epoch}
        scheduler = kwargs.get("lr_scheduler")
        if scheduler is not None and hasattr(scheduler, "get_last_lr"):
            metrics["learning_rate"] = scheduler.get_last_lr()[0]
        if self._tokens:
            metrics["tokens"] = self._tokens
        self.steps.append((time.monotonic(), self._tokens))
        loss, self._loss, self._tokens = self._loss, None, 0
        report(step=state.global_step, loss=loss, **metrics)

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        # The logged loss is a window average over all ranks; the per-step, per-rank loss went
        # out in on_step_end, so only what a step event lacks is sent here (grad_norm, eval and
        # end-of-training figures, and SFTTrainer's entropy, token accuracy, ...): the panel shows
        # them in place of the log lines it suppresses.
        extra = {
            k: v
            for k, v in (logs or {}).items()
            if k == "grad_norm" or (k not in _STEP_KEYS and isinstance(v, numbers.Real) and not isinstance(v, bool))
        }
        if extra:
            report(step=state.global_step, **extra)


# DashboardCallback subclasses transformers' TrainerCallback; building it on first use keeps
# `import nbkit.rank_side.reporting` (which every launched rank does) from importing transformers.
__getattr__ = callbacks.lazy_module_attributes(__name__, DashboardCallback=_StepReporter)


def _in_launched_rank() -> bool:
    return channel.connected()


@patching.patch(
    "transformers.trainer:Trainer.__init__",
    reason="in a launched rank, report to nbkit's dashboard and draw no per-rank progress bar: "
    "transformers picks NotebookProgressCallback in every forked rank (it has no rank "
    "check), so a notebook shows one bar per GPU; rank 0 prints the log lines unless a live panel shows them",
    upstream="transformers has no hook to add default callbacks or to silence progress bars "
    "per process: https://github.com/huggingface/transformers/issues/12108 (callbacks "
    "cannot see the step loss) is the nearest thread",
    group="reporting",
    when=_in_launched_rank,
)
def _trainer_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        bars: tuple[type, ...] = (ProgressCallback,)
        notebook = sys.modules.get("transformers.utils.notebook")  # imported only where a notebook bar can exist
        if notebook is not None:
            bars += (notebook.NotebookProgressCallback,)
        had_bar = any(isinstance(cb, bars) for cb in self.callback_handler.callbacks)
        for bar in bars:
            self.remove_callback(bar)
        # The bars also printed the log dicts on rank 0: keep that, once, unless a live panel
        # shows the same numbers (with logging_steps=1 the lines would pile up below it).
        if had_bar and distributed.is_main() and not dashboard.panel_shown():
            self.add_callback(PrinterCallback)
        reporter = next((cb for cb in self.callback_handler.callbacks if isinstance(cb, _StepReporter)), None)
        if reporter is None:
            reporter = _dashboard_callback()()
            self.add_callback(reporter)
        _count_micro_batches(self, reporter)

    return __init__


def _count_micro_batches(trainer: Any, reporter: _StepReporter) -> None:
    """Hand each micro-batch's loss and input size to `reporter` (no TrainerCallback event receives
    them), by wrapping training_step on this trainer object: unsloth replaces Trainer.training_step
    with its own copy of transformers' source when a rank imports it, after nbkit's set-up, so a
    patch of the class was bypassed (its flagship reported no tokens/s on 2 GPUs); whichever
    training_step the class has now runs inside this one.
    """
    step = trainer.training_step

    def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = step(model, inputs, *args, **kwargs)
        reporter.add_micro_batch(loss, _count_tokens(trainer, inputs))
        return loss

    trainer.training_step = training_step


def _count_tokens(trainer: Any, inputs: Any) -> int:
    if not isinstance(inputs, Mapping):
        return 0
    name = getattr(getattr(trainer, "model", None), "main_input_name", "input_ids")
    ids = inputs.get(name, inputs.get("input_ids"))
    return int(ids.numel()) if hasattr(ids, "numel") else 0
