"""nbkit.install() / nbkit.uninstall(): switch nbkit's patches of other libraries on and off.

The patches themselves are declared next to the code they serve (nbkit.guard for the model-loading
guard, nbkit.savers.unsloth for unsloth's savers) through nbkit.patching; this module only imports
those declarations and applies them.

A patch is applied when its library is imported, never by importing it here: `import unsloth`
takes ~25 s and initialises CUDA, so installing in every launched rank must not import it for a
user who trains with plain transformers, and must still catch the user who imports it later,
inside the launched function. Patches whose module is already imported are applied at once; the
others are applied by an import hook right after their module has finished loading.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nbkit import patching

__all__ = ["apply_when_imported", "install", "installed", "pending", "trainer_callback", "uninstall"]

# group -> module declaring its patches
_DECLARATIONS = {"guard": "nbkit.guard", "savers": "nbkit.savers.unsloth"}

_log = logging.getLogger("nbkit")
_lock = threading.RLock()
_groups: list[str] = []  # what install() switched on, in order


def install(*, guard: bool = True, savers: bool = True) -> list[str]:
    """Apply nbkit's patches: the model-loading guard and the unsloth savers fixes.

    Takes which groups to switch on. Returns the targets ("module:Class.attr") patched now;
    patches of libraries not imported yet (unsloth, typically) are applied when they are imported.
    Idempotent: a second call changes nothing. Safe on every rank and in the notebook process; it
    imports none of the patched libraries. A missing savers module (not part of this install) is
    skipped. nbkit.launch calls this in every rank it starts.
    """
    with _lock:
        for group, wanted in (("guard", guard), ("savers", savers)):
            if not wanted or group in _groups:
                continue
            if not _declare(group):
                continue
            _groups.append(group)
            apply_when_imported(group)
        return installed()


def apply_when_imported(group: str) -> None:
    """Apply the registered patches of `group` now where their module is imported, and right
    after its import otherwise. Imports nothing itself (unsloth's import alone takes ~25 s and
    initialises CUDA; transformers' takes seconds that a rank without a Trainer should not pay).
    """
    with _lock:
        for p in patching.registered(group):
            module = p.target.partition(":")[0]
            if module in sys.modules:
                p.apply()
            else:
                _watcher().arm(module, p)


@functools.cache
def trainer_callback(name: str, behaviour: type, module: str) -> type:
    """The transformers TrainerCallback class `name`, made of `behaviour` (a plain class with the
    callback's methods) and TrainerCallback, built on first use and then the same class each time:
    modules that every launched rank imports must not import transformers themselves.
    """
    from transformers import TrainerCallback

    return type(name, (behaviour, TrainerCallback), {"__module__": module, "__doc__": behaviour.__doc__})


def uninstall() -> None:
    """Revert everything install() applied, restoring the original functions exactly.

    Also disarms patches still waiting for their library to be imported. A no-op when nothing is
    installed.
    """
    with _lock:
        for group in reversed(_groups):
            patching.revert(group)
        if _WATCHER is not None:
            _WATCHER.disarm()
            if _WATCHER in sys.meta_path:
                sys.meta_path.remove(_WATCHER)
        _groups.clear()


def installed() -> list[str]:
    """Targets patched now by install()."""
    return [t for g in _groups for t in patching.applied(g)]


def pending() -> list[str]:
    """Targets install() will patch when their library is imported."""
    return [] if _WATCHER is None else _WATCHER.waiting()


def _declare(group: str) -> bool:
    name = _DECLARATIONS[group]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise  # the module exists but something it needs does not: a real error
        return False
    return True


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Runs patches right after the modules they target finish importing.

    It finds nothing itself: for a watched module it asks the other finders for the spec and wraps
    that spec's loader so that, once the module has executed, the waiting patches are applied.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, list[patching.Patch]] = {}

    def arm(self, module: str, p: patching.Patch) -> None:
        if p not in self._waiting.setdefault(module, []):
            self._waiting[module].append(p)

    def disarm(self) -> None:
        self._waiting.clear()

    def waiting(self) -> list[str]:
        return [p.target for patches in self._waiting.values() for p in patches]

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in self._waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader.exec_module = self._after(fullname, spec.loader.exec_module)  # type: ignore[method-assign]
        return spec

    def _after(self, fullname: str, exec_module: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            with _lock:
                patches = self._waiting.pop(fullname, [])
            for p in patches:
                try:
                    p.apply()
                except Exception:  # a patch must never break the user's import
                    _log.exception("nbkit: could not apply the patch of %s", p.target)

        return exec_then_patch


_WATCHER: _ImportWatcher | None = None


def _watcher() -> _ImportWatcher:
    global _WATCHER
    if _WATCHER is None:
        _WATCHER = _ImportWatcher()
    if _WATCHER not in sys.meta_path:
        sys.meta_path.insert(0, _WATCHER)
    return _WATCHER
