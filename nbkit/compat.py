"""Where the supported transformers lines differ (4.57.x and 5.x), asked and bridged in one place.

nbkit supports transformers 4.57.1 through 5.17 (unsloth's Kaggle notebooks pin 4.57.1). Code that
must behave differently on the two lines asks `transformers_major()` instead of importing
transformers to find out: reading the installed version costs nothing and imports nothing.
Differences that would break training in a launched rank are bridged by the patches here, which
`enable()` applies in every rank nbkit.launch starts (they apply on 4.x only).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from nbkit import patching

__all__ = ["enable", "transformers_major"]


@lru_cache(maxsize=1)
def transformers_major() -> int:
    """The installed transformers' major version (4 or 5).

    Raises:
        importlib.metadata.PackageNotFoundError: transformers is not installed.
    """
    return int(importlib.metadata.version("transformers").split(".")[0])


def _transformers_4() -> bool:
    return transformers_major() < 5


@patching.patch(
    "transformers.modeling_utils:PreTrainedModel.gradient_checkpointing_enable",
    reason="transformers 4.x checkpoints reentrantly unless told otherwise, and Trainer wraps PEFT models in "
    "DDP with find_unused_parameters=True; together they fail in the first backward with 'Expected to mark "
    "a variable ready only once' (seen: transformers 4.57.1 and trl 0.22.2, whose SFTConfig turns "
    "checkpointing on by default, LoRA on 2 gloo ranks). In launched ranks the default becomes "
    "non-reentrant, as in transformers 5; an explicit use_reentrant is kept",
    upstream="https://github.com/huggingface/transformers/pull/43203 (the default changed in 5.0)",
    group="compat",
    when=_transformers_4,
)
def _non_reentrant_by_default(original: Callable[..., Any]) -> Callable[..., Any]:
    def gradient_checkpointing_enable(self: Any, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        return original(self, gradient_checkpointing_kwargs=kwargs)

    return gradient_checkpointing_enable


def enable() -> None:
    """Apply the patches above where transformers is imported, and when it is imported otherwise.

    Called in every rank nbkit.launch starts; idempotent; imports nothing itself.
    """
    from nbkit import integration

    integration.apply_when_imported("compat")
