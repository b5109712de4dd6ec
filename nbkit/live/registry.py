"""The live set of this process (one per notebook), and the last one a failure ended: written by the
engines part of a set as it starts and ends (nbkit.live.engines), read by nbkit.live.notebook's
current() and ended().
"""

from __future__ import annotations

from typing import Any

running: Any = None  # the LiveRanks running now, or None
ended: Any = None  # the last LiveRanks a failure ended, until a new one starts or forget_ended()
