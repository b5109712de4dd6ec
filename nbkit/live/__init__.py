"""Live sets: training processes, one per GPU, that stay up across notebook cells.

    ranks = nbkit.start()                 # or %ddp start
    ranks.exec("model = load_model()")    # or a %%ddp cell; `model` stays on every rank
    ranks.exec("trainer.train()")
    ranks.stop()                          # or %ddp stop

See nbkit.live.notebook for the contract and the failure behaviour (the notebook's side of the
wire); nbkit.rank_side.live_engine is the code that runs inside each rank (the engine's side).
"""

from __future__ import annotations

from nbkit.live.notebook import (
    LiveRanks,
    LiveStatus,
    RankStatus,
    connect,
    current,
    ended,
    forget_ended,
    start,
    start_with,
)

__all__ = [
    "LiveRanks",
    "LiveStatus",
    "RankStatus",
    "connect",
    "current",
    "ended",
    "forget_ended",
    "start",
    "start_with",
]
