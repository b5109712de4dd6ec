"""Where the supported transformers lines differ (4.57.x and 5.x), asked in one place.

nbkit supports transformers 4.57.1 through 5.17 (unsloth's Kaggle notebooks pin 4.57.1). Code that
must behave differently on the two lines asks `transformers_major()` instead of importing
transformers to find out: reading the installed version costs nothing and imports nothing.
"""

from __future__ import annotations

import importlib.metadata
from functools import lru_cache

__all__ = ["transformers_major"]


@lru_cache(maxsize=1)
def transformers_major() -> int:
    """The installed transformers' major version (4 or 5).

    Raises:
        importlib.metadata.PackageNotFoundError: transformers is not installed.
    """
    return int(importlib.metadata.version("transformers").split(".")[0])
