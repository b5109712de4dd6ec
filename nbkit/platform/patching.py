"""The one place where nbkit changes other libraries' code.

Every patch is declared once with `@patch(...)`: the attribute it replaces (by import path, so
libraries that are not installed are simply skipped), why, the upstream issue that would make it
unnecessary, and its group. Groups are applied and reverted as a whole: `apply(group)` patches what
is imported now and arms an import hook for the rest (a patch then waits, "pending", until its
module has finished importing: nothing here imports a patched library), `revert(group)` puts back
exactly what was there before, including "nothing" for attributes a class only inherited, and
drops the group's pending patches. Which groups exist, which module declares each and when each is
applied: nbkit.platform.patch_groups.GROUPS.

Example::

    @patch("transformers.modeling_utils:PreTrainedModel.from_pretrained",
           reason="device maps must not split a model inside a DDP rank",
           upstream="https://github.com/unslothai/unsloth/pull/3809")
    def _guarded_from_pretrained(original):
        def from_pretrained(cls, *args, **kwargs):
            ...
            return original(cls, *args, **kwargs)
        return from_pretrained
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from nbkit.platform import notices

__all__ = ["Patch", "applied", "apply", "describe", "patch", "pending", "registered", "revert"]

_MISSING = object()


@dataclass
class Patch:
    """One replacement of `owner.attr`.

    Attributes:
        target: "module.path:Owner.attr" (or "module.path:attr" for a module attribute).
        factory: takes the original function (unwrapped from classmethod/staticmethod) and returns
            its replacement; the registry re-wraps it the same way.
        reason: why nbkit changes the attribute (docs/patches.md shows it).
        upstream: the upstream issue or pull request that would make the patch unnecessary.
        group: patches are applied and reverted by group (nbkit.platform.patch_groups.GROUPS lists them).
        when: an optional predicate; the patch is skipped where it returns False (feature detection).
        value: the attribute is a value, not a function (a class other code subclasses or calls): the
            factory's result replaces it as it is, with no switch around it; revert() puts the original back.
    """

    target: str
    factory: Callable[[Callable[..., Any]], Callable[..., Any]]
    reason: str
    upstream: str
    group: str
    when: Callable[[], bool] | None = None
    value: bool = False
    # Filled while applied: (owner, attr, value found in owner.__dict__ or _MISSING, replacement).
    _saved: tuple[Any, str, Any, Any] | None = field(default=None, repr=False)
    # The replacement dispatches to the original while this is False (see revert()).
    _active: bool = field(default=False, repr=False)
    # A reverted replacement that another library had wrapped, so it could not be taken out.
    _dormant: tuple[Any, str, Any, Any] | None = field(default=None, repr=False)

    @property
    def is_applied(self) -> bool:
        """Whether the replacement is in place now."""
        return self._saved is not None

    @property
    def module(self) -> str:
        """The module that holds the patched attribute (the part of `target` before the colon)."""
        return self.target.partition(":")[0]

    def _resolve(self) -> tuple[Any, str] | None:
        module_name, _, path = self.target.partition(":")
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            return None
        *parents, attr = path.split(".")
        for name in parents:
            owner = getattr(owner, name, None)
            if owner is None:
                return None
        if not hasattr(owner, attr):
            return None
        return owner, attr

    def apply(self) -> bool:
        """Install the replacement now (importing its module if need be).

        Returns:
            True if the replacement is in place afterwards; False where the library or attribute
            does not exist or `when` says no.
        """
        if self._saved is not None:
            return True
        if self._dormant is not None:  # still in the call chain under someone else's wrapper
            self._saved, self._dormant, self._active = self._dormant, None, True
            return True
        if self.when is not None and not self.when():
            return False
        resolved = self._resolve()
        if resolved is None:
            return False
        owner, attr = resolved
        own = vars(owner).get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr)
        raw = own if own is not _MISSING else _inherited_raw(owner, attr)
        if self.value:
            replacement: Any = self.factory(raw)
        elif isinstance(raw, classmethod):
            replacement = classmethod(self._switchable(raw.__func__))
        elif isinstance(raw, staticmethod):
            replacement = staticmethod(self._switchable(raw.__func__))
        else:
            replacement = self._switchable(raw)
        setattr(owner, attr, replacement)
        self._saved, self._active = (owner, attr, own, replacement), True
        return True

    def _switchable(self, original: Callable[..., Any]) -> Callable[..., Any]:
        new = self.factory(original)

        @functools.wraps(new)
        def switch(*args: Any, **kwargs: Any) -> Any:
            return (new if self._active else original)(*args, **kwargs)

        switch.__wrapped__ = original  # what callers and inspect see through: the patched function
        return switch

    def revert(self) -> None:
        """Put back exactly what was there before apply(); a no-op when not applied.

        If another library has since wrapped our replacement (unsloth re-wraps
        PreTrainedModel.from_pretrained when it is imported), taking ours out would take theirs
        out too; ours then stays in the chain but passes every call straight to the original.
        """
        if self._saved is None:
            return
        owner, attr, own, replacement = self._saved
        self._saved, self._active = None, False
        current = vars(owner).get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr, _MISSING)
        if current is not replacement:
            self._dormant = (owner, attr, own, replacement)
            return
        if own is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, own)


def _inherited_raw(cls: type, attr: str) -> Any:
    for base in cls.__mro__:
        if attr in vars(base):
            return vars(base)[attr]
    return getattr(cls, attr)


_REGISTRY: list[Patch] = []
_log = notices.logger(__name__)
# Guards the registry's state across threads: an import in another thread can apply pending patches.
_lock = threading.RLock()


def patch(
    target: str,
    *,
    reason: str,
    upstream: str,
    group: str,
    when: Callable[[], bool] | None = None,
    value: bool = False,
) -> Callable[[Callable[[Callable[..., Any]], Callable[..., Any]]], Patch]:
    """Decorator that registers a patch factory (see the module docstring).

    Args:
        target: "module.path:Owner.attr" or "module.path:attr".
        reason: why the attribute is replaced.
        upstream: the upstream issue or pull request that would make the patch unnecessary.
        group: the group it is applied and reverted with (one of nbkit.platform.patch_groups.GROUPS).
        when: an optional predicate; the patch is skipped where it returns False.
        value: replace a value (a class) as it is, not a function through a switch (see Patch).

    Returns:
        A decorator that takes the factory and returns the registered Patch.
    """

    def register(factory: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Patch:
        p = Patch(target, factory, reason, upstream, group, when, value)
        _REGISTRY.append(p)
        return p

    return register


def registered(group: str | None = None) -> list[Patch]:
    """All declared patches (of one group, if given), applied or not, in declaration order."""
    return [p for p in _REGISTRY if group is None or p.group == group]


def apply(group: str | None = None) -> list[str]:
    """Apply the declared patches of `group` (all groups if None). Idempotent; safe on any rank.

    A patch whose module is imported is applied now; the others wait (`pending()`) and are applied
    right after their module finishes importing. Nothing is imported here: unsloth's import alone
    takes ~25 s and initialises CUDA, and transformers' takes seconds that a rank without a Trainer
    should not pay.

    Args:
        group: the group to apply, or None for every declared patch.

    Returns:
        The group's targets in place now. Targets whose library is not installed stay pending;
        those whose `when` predicate says no are skipped.
    """
    with _lock:
        for p in registered(group):
            if p.module in sys.modules:
                p.apply()
            else:
                _watcher().arm(p)
        return applied(group)


def revert(group: str | None = None) -> None:
    """Undo the patches of `group` (all if None), newest first, restoring the originals exactly.

    Also drops the group's pending patches, and takes the import hook out of sys.meta_path once no
    patch waits. A no-op for a group that is not applied.
    """
    with _lock:
        if _WATCHER is not None:
            _WATCHER.disarm(group)
            if not _WATCHER.waiting() and _WATCHER in sys.meta_path:
                sys.meta_path.remove(_WATCHER)
        for p in reversed(registered(group)):
            p.revert()


def applied(group: str | None = None) -> list[str]:
    """Targets (of `group`, or all) patched now."""
    return [p.target for p in registered(group) if p.is_applied]


def pending(group: str | None = None) -> list[str]:
    """Targets (of `group`, or all) that `apply()` armed and that wait for their module's import."""
    return [] if _WATCHER is None else _WATCHER.waiting(group)


def describe(group: str | None = None) -> str:
    """A markdown table of the declared patches (of one group, if given).

    Returns:
        One row per patch: group, target, why, and the upstream issue. docs/patches.md holds this
        table for all of nbkit's patches.
    """
    rows = ["| group | target | why | upstream |", "| --- | --- | --- | --- |"]
    for p in sorted(registered(group), key=lambda p: (p.group, p.target)):
        cells = [p.group, f"`{p.target}`", p.reason, p.upstream]
        rows.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(rows) + "\n"


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Runs patches right after the modules they target finish importing.

    It finds nothing itself: for a watched module it asks the other finders for the spec and wraps
    that spec's loader so that, once the module has executed, the waiting patches are applied.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, list[Patch]] = {}

    def arm(self, p: Patch) -> None:
        if p not in self._waiting.setdefault(p.module, []):
            self._waiting[p.module].append(p)

    def disarm(self, group: str | None) -> None:
        for module in list(self._waiting):
            kept = [p for p in self._waiting[module] if group is not None and p.group != group]
            if kept:
                self._waiting[module] = kept
            else:
                del self._waiting[module]

    def waiting(self, group: str | None = None) -> list[str]:
        return [p.target for patches in self._waiting.values() for p in patches if group is None or p.group == group]

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
        spec.loader.exec_module = self._after(fullname, spec.loader.exec_module)  # type: ignore[method-assign,assignment]
        return spec

    def _after(self, fullname: str, exec_module: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            with _lock:
                patches = self._waiting.pop(fullname, [])
            # Outside the lock: another thread may hold it while waiting for this import to finish.
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
