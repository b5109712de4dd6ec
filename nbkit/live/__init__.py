"""Live sets: training processes, one per GPU, that stay up across notebook cells.

    ranks = nbkit.start()                 # or %ddp start
    ranks.exec("model = load_model()")    # or a %%ddp cell; `model` stays on every rank
    ranks.exec("trainer.train()")
    ranks.stop()                          # or %ddp stop

See nbkit.live.ranks for the contract and the failure behaviour; nbkit.live.rank is the code that
runs inside each rank.
"""

from __future__ import annotations

from nbkit.live.ranks import LiveRanks, LiveStatus, RankStatus, connect, current, ended, forget_ended, start

__all__ = ["LiveRanks", "LiveStatus", "RankStatus", "connect", "current", "ended", "forget_ended", "start"]
