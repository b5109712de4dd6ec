"""transformers TrainerCallback classes that nbkit builds on first use.

nbkit.checkpoints (CheckpointMarker) and nbkit.rank_side.reporting (DashboardCallback) are imported in every
launched rank, and a rank that never builds a Trainer must not pay for importing transformers
(seconds to tens of seconds). Their callbacks are therefore written as plain classes and turned
into TrainerCallback subclasses here, the first time someone asks for them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_module_attributes", "trainer_callback"]


@functools.cache
def trainer_callback(name: str, behaviour: type, module: str) -> type:
    """The TrainerCallback class `name`, made of `behaviour` and transformers' TrainerCallback.

    Args:
        name: the class's name.
        behaviour: a plain class with the callback's methods (it comes first in the MRO).
        module: the module the class is said to belong to (for its repr and pickling).

    Returns:
        The class, built on first use and then the same class each time.
    """
    from transformers import TrainerCallback

    return type(name, (behaviour, TrainerCallback), {"__module__": module, "__doc__": behaviour.__doc__})


def lazy_module_attributes(module: str, **behaviours: type) -> Callable[[str], Any]:
    """A module-level `__getattr__` that serves the named callbacks through `trainer_callback`.

    Args:
        module: the `__name__` of the module that assigns the result to its `__getattr__`.
        **behaviours: public callback name -> plain class with its methods.

    Returns:
        The `__getattr__` function; it raises AttributeError for any other name.
    """

    def __getattr__(name: str) -> Any:
        if name in behaviours:
            return trainer_callback(name, behaviours[name], module)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
