"""nbkit's settings.

Each setting lives in an environment variable, so launched processes (forked or freshly started)
see what the notebook configured without anything being passed along.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

__all__ = ["SETTINGS", "configure", "environment", "setting"]

# name -> (environment variable, default, allowed values or None for free text)
SETTINGS: dict[str, tuple[str, str, tuple[str, ...] | None]] = {
    "device_map_policy": ("NBKIT_DEVICE_MAP_POLICY", "data_parallel", ("data_parallel", "error")),
    # "reentrant": unsloth VLMs keep unsloth's single-GPU (reentrant, offloading) checkpointing under
    # DDP, with find_unused_parameters=False; "unsloth": unsloth's own DDP choice (non-reentrant).
    "unsloth_vlm_ddp_checkpointing": ("NBKIT_UNSLOTH_VLM_DDP_CHECKPOINTING", "reentrant", ("reentrant", "unsloth")),
}


def setting(name: str) -> str:
    """Current value of one setting (the environment variable wins over the default)."""
    env, default, allowed = SETTINGS[name]
    value = os.environ.get(env, default)
    if allowed is not None and value not in allowed:
        raise ValueError(f"{env}={value!r} is not a valid value for nbkit's {name}; use one of {', '.join(allowed)}.")
    return value


def configure(**settings: str) -> dict[str, str]:
    """Change nbkit settings for this process and every process it launches afterwards.

    Takes keyword arguments named after the settings: device_map_policy ("data_parallel" or
    "error"; see nbkit.guard) and unsloth_vlm_ddp_checkpointing ("reentrant" or "unsloth"; see
    docs/unsloth_patches.md, fix 4). Returns all settings as they now stand. Raises ValueError for an
    unknown setting or value; nothing is changed then.
    """
    for name, value in settings.items():
        if name not in SETTINGS:
            raise ValueError(f"nbkit has no setting {name!r}; known settings: {', '.join(SETTINGS)}.")
        _, _, allowed = SETTINGS[name]
        if allowed is not None and value not in allowed:
            raise ValueError(f"{name}={value!r} is not valid; use one of {', '.join(map(repr, allowed))}.")
    for name, value in settings.items():
        os.environ[SETTINGS[name][0]] = value
    return {name: setting(name) for name in SETTINGS}


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of a `with` block, then put back exactly what
    was there before (including "unset").
    """
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
