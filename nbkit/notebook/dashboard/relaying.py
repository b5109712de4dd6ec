"""Relaying: spawn mode's launcher process forwards its dashboard to the notebook's.

The launcher process (nbkit.launching.spawn) calls `relay_to(connection)`; every Dashboard it creates
afterwards sends nbkit.messages.spawn' DashboardOpened once and each rank's event as the rank channel's
Envelope(rank, Report(metrics)) over that connection instead of showing anything, and the notebook
feeds them to its own dashboard.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["connection", "relay", "relay_to"]

_connection: Any = None
_lock = threading.Lock()


def relay_to(connection: Any) -> None:
    """Make every Dashboard created afterwards in this process forward its events to `connection`.

    Takes a multiprocessing Connection (None: show again instead of relaying). Used by
    nbkit.launching.spawn's launcher process, whose dashboard lives in the notebook.
    """
    global _connection
    _connection = connection


def connection() -> Any:
    """The connection given to relay_to(), or None when this process's dashboards show themselves."""
    return _connection


def relay(message: Any) -> None:
    """Send one message (a picklable object) over the connection given to relay_to(); thread-safe."""
    with _lock:
        _connection.send(message)
