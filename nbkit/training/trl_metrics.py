"""TRL's SFTTrainer metrics (entropy, token accuracy, token count) averaged over the ranks once per log, not at
every micro-batch.

Why: SFTTrainer.compute_loss gathers its metrics from every rank after each forward and reads them on the host: in
trl 0.22-1.16 three or four all-gathers and two to four host reads per micro-batch. Each read is a point where a
rank waits for the slowest rank's forward, in the middle of the step; a step bound by its host (the notebooks'
short samples on a fast GPU) has the ranks drift apart by tens of milliseconds between such points, so each one
costs a share of the step that one GPU does not pay (on 2x H200 at 1K x 4 the ranks waited there in turn with the
gradients' all-reduce: benchmarks/RESULTS.md, "What a slow launch does"). unsloth's SFT trainer computes none of
these metrics, and so has no such point. Measured with both ways alternating step by step in one launch (2x H200, 1K x
4, T4 profile): the step without the gathers was shorter in 30 of 44 neighbouring pairs, by a median of 8 ms of
0.22 s (RESULTS.md, "TRL's metrics averaged once per log").

How: while TRL's compute_loss trains a micro-batch on several ranks, the accelerator's gather_for_metrics, when
TRL's compute_loss itself calls it, hands back the rank's own value, as a gather over one rank would. The values
TRL then appends to its metric lists are this rank's; they are noted, and at the end of a step that logs (or ends
training) one all-reduce over every rank replaces each by its mean over the ranks, and the token count by its sum,
before TRL's log reads them. TRL's host reads of its own values stay (they wait only for this rank's GPU).

What differs from TRL's figures: TRL pools entropy and token accuracy over the ranks' label tokens per micro-batch;
here each rank's value counts once. The two agree where the ranks have as many label tokens each (fixed-length or
packed batches), and differ by the ranks' spread otherwise. The token count is the same. Evaluation keeps TRL's
gathers (its loop gathers anyway). `nbkit.configure(trl_metrics="per_batch")` keeps TRL's way everywhere.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from nbkit.platform import config
from nbkit.platform.patching import patch
from nbkit.training import callbacks

__all__ = ["pending_values"]


class _Pending:
    """One trainer's metric values kept local since its last log: each as (list, index, value) in the order TRL
    appended them, the same order on every rank, and the token count this rank added.
    """

    def __init__(self) -> None:
        self.values: list[tuple[list[Any], int, float]] = []
        self.tokens = 0
        self.open = False  # whether a micro-batch ran locally since the last average (the same on every rank)

    def note(self, metrics: dict[str, list[Any]], lengths: dict[str, int]) -> None:
        for key, values in metrics.items():
            if key != "num_tokens":
                self.values += [(values, i, float(values[i])) for i in range(lengths.get(key, 0), len(values))]
        self.open = True


_pending: weakref.WeakKeyDictionary[Any, _Pending] = weakref.WeakKeyDictionary()


def pending_values(trainer: Any) -> int:
    """How many of `trainer`'s metric values wait for the next log's average over the ranks (0 where none or where
    TRL's own gathers ran). Any rank.
    """
    state = _pending.get(trainer)
    return len(state.values) if state is not None else 0


def _kept_local(trainer: Any) -> bool:
    accelerator = getattr(trainer, "accelerator", None)
    return (
        config.setting("trl_metrics") == "at_log"
        and accelerator is not None
        and accelerator.num_processes > 1
        and trainer.model.training
        and isinstance(getattr(trainer, "_metrics", None), dict)
        and isinstance(getattr(trainer, "_total_train_tokens", None), int)
    )


@contextmanager
def _local_gathers(accelerator: Any, caller: Any) -> Iterator[None]:
    """Within the block, `accelerator.gather_for_metrics` called from the code object `caller` returns a tensor's
    own value as a gather over one rank would (a scalar becomes one element); any other call gathers as before.
    """
    import torch

    gather = accelerator.gather_for_metrics
    had_own = "gather_for_metrics" in vars(accelerator)

    def gather_for_metrics(data: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(data, torch.Tensor) and sys._getframe(1).f_code is caller:
            return data.reshape(1) if data.dim() == 0 else data
        return gather(data, *args, **kwargs)

    accelerator.gather_for_metrics = gather_for_metrics
    try:
        yield
    finally:
        if had_own:
            accelerator.gather_for_metrics = gather
        else:
            del accelerator.gather_for_metrics


@patch(
    "trl.trainer.sft_trainer:SFTTrainer.compute_loss",
    reason="on several ranks TRL gathers its entropy, token accuracy and token count after every training forward "
    "and reads them on the host, a point where every rank waits for the slowest in the middle of the step; here "
    "each rank keeps its own values until the step that logs, where one all-reduce averages them (counts summed)",
    upstream="no upstream report yet: TRL's SFTTrainer.compute_loss gathers its metrics at every micro-batch "
    "(trl 0.22-1.16); the same reads without the gathers would cost one rank only its own GPU's time",
    group="trl_metrics",
)
def _compute_loss(original: Callable[..., Any]) -> Callable[..., Any]:
    # TRL's own function, under any patch applied before this one (compat's, on trl 0.x): the one whose calls of
    # gather_for_metrics are kept local.
    caller = inspect.unwrap(original).__code__

    def compute_loss(self: Any, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if not _kept_local(self):
            return original(self, model, inputs, *args, **kwargs)
        state = _pending.get(self)
        if state is None:
            state = _pending[self] = _Pending()
            self.add_callback(_average_at_log_callback()(self))
        metrics = self._metrics["train"]
        lengths = {key: len(values) for key, values in metrics.items()}
        tokens = self._total_train_tokens
        with _local_gathers(self.accelerator, caller):
            result = original(self, model, inputs, *args, **kwargs)
        # TRL added this rank's tokens to a count it keeps for all ranks: they wait for the log's sum instead.
        state.tokens += self._total_train_tokens - tokens
        self._total_train_tokens = tokens
        if "num_tokens" in metrics:
            metrics["num_tokens"] = [tokens]
        state.note(metrics, lengths)
        return result

    return compute_loss


def _average(trainer: Any, state: _Pending) -> None:
    """Replace the values in `state` by their means over the ranks, add the ranks' tokens to the trainer's count
    (a collective: every rank calls it at the same step).
    """
    import torch
    import torch.distributed as dist

    world = trainer.accelerator.num_processes
    local = [value for _, _, value in state.values] + [float(state.tokens)]
    summed = torch.tensor(local, dtype=torch.float64, device=trainer.accelerator.device)
    dist.all_reduce(summed)
    *sums, tokens = summed.tolist()
    for (values, index, _), total in zip(state.values, sums):
        if index < len(values):  # a log of the user's own may have cleared TRL's lists since
            values[index] = total / world
    trainer._total_train_tokens += round(tokens)
    metrics = trainer._metrics["train"]
    if "num_tokens" in metrics:
        metrics["num_tokens"] = [trainer._total_train_tokens]
    state.values, state.tokens, state.open = [], 0, False


class _AverageAtLog:
    """Averages a trainer's locally kept metrics over the ranks at the end of each step (or epoch) that logs or
    ends training, before Trainer logs. Added to the trainer by its first local compute_loss, so after
    transformers' DefaultFlowCallback, which decides whether the step logs; its decision is the same on every
    rank, so every rank averages at the same step. A stop that a callback after this one decides (a live set's
    agreed stop in a later train(), a user's) is seen at on_epoch_end, which Trainer calls after the step that
    stops and before its last log. (Not in TRL's log itself: a user's own `trainer.log(...)` may
    run on one rank only, and a collective there would hang.)
    """

    def __init__(self, trainer: Any) -> None:
        self._trainer = weakref.ref(trainer)

    def _maybe_average(self, control: Any) -> None:
        trainer = self._trainer()
        state = _pending.get(trainer) if trainer is not None else None
        if state is not None and state.open and (control.should_log or control.should_training_stop):
            _average(trainer, state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._maybe_average(control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._maybe_average(control)


def _average_at_log_callback() -> type:
    return callbacks.trainer_callback("TrlMetricsAtLog", _AverageAtLog, __name__)
