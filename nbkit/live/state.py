"""A live set's state on the notebook side, shared by the parts of LiveRanks (nbkit.live.notebook): its
engines (nbkit.live.engines), one call (nbkit.live.calls), what the ranks send during a call
(nbkit.live.cell_output) and the notebook names sent to them (nbkit.live.sending).
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nbkit.live.messages import CallDone, EngineInfo, Training
from nbkit.live.relay import Relay
from nbkit.rank_options import RankOptions


@dataclass
class _Rank:
    rank: int
    local_rank: int
    node_rank: int
    engine: int
    info: EngineInfo
    device: str = "?"
    process: subprocess.Popen | None = None  # engines nbkit started (start(), not connect())


class SetState:
    """What every part of a live set reads and writes (attributes only)."""

    def __init__(self, options: RankOptions):
        self._options = options  # how the ranks are set up (gpus, env, strategy, emulate, timeout)
        self.timeout = options.timeout  # the default limit of each call
        self.world_size = 0
        self.nnodes = 0
        self._ranks: list[_Rank] = []
        self._client: Any = None
        self._cluster: Any = None
        self._tmpdir: str | None = None
        self._relay: Relay | None = None
        self._owned = False  # whether nbkit started the engines (start) or found them (connect)
        self._ended: str | None = None
        self._ended_log = ""  # the tail of a dead rank's own output, when it left one
        self._stopped = False
        self._lock = threading.Lock()
        self._call = 0
        self._defined: set[str] = set()  # names the set's cells bound on the ranks
        # {rank: {name: the notebook object sent under that name}}: what each rank holds already. Strong
        # references, so that an object's id cannot pass to another object while it is recorded.
        self._sent: dict[int, dict[str, Any]] = {}
        self._processes: list[subprocess.Popen] = []  # engines nbkit started, from the moment each starts
        self._done: dict[int, CallDone] = {}
        self._training: dict[int, Training] = {}  # each rank's last Trainer.train() state in this call
        self._heard: set[int] = set()  # ranks where Python saw this call's interrupt (Interrupted)
        self._shown: set[int] = set()
        self._streams: dict[tuple[int, str], Any] = {}
        self._board: Any = None
        self._connected: set[int] = set()  # ranks whose relay connection is up (start-up step 2)


def _join(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in ranks) or "none"
