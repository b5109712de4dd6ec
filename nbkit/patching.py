"""The one place where nbkit changes other libraries' code.

Every patch is declared once with `@patch(...)`: the attribute it replaces (by import path, so
libraries that are not installed are simply skipped), why, and the upstream issue that would make
it unnecessary. `apply()` is idempotent and `revert()` puts back exactly what was there before,
including "nothing" for attributes a class only inherited.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Patch", "applied", "apply", "describe", "patch", "registered", "revert"]

_MISSING = object()


@dataclass
class Patch:
    """One replacement of `owner.attr`.

    target: "module.path:Owner.attr" (or "module.path:attr" for a module attribute).
    factory: takes the original function (unwrapped from classmethod/staticmethod) and returns its
        replacement; the registry re-wraps it the same way.
    group: patches are applied and reverted by group ("guard", "savers", "reporting", ...).
    when: an optional predicate; the patch is skipped where it returns False (feature detection).
    """

    target: str
    factory: Callable[[Callable[..., Any]], Callable[..., Any]]
    reason: str
    upstream: str
    group: str
    when: Callable[[], bool] | None = None
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
        """Install the replacement; returns True if it is in place afterwards."""
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
        if isinstance(raw, classmethod):
            replacement: Any = classmethod(self._switchable(raw.__func__))
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


def patch(
    target: str,
    *,
    reason: str,
    upstream: str,
    group: str,
    when: Callable[[], bool] | None = None,
) -> Callable[[Callable[[Callable[..., Any]], Callable[..., Any]]], Patch]:
    """Decorator that registers a patch factory (see the module docstring) and returns the Patch."""

    def register(factory: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Patch:
        p = Patch(target, factory, reason, upstream, group, when)
        _REGISTRY.append(p)
        return p

    return register


def registered(group: str | None = None) -> list[Patch]:
    """All declared patches (of one group, if given), applied or not."""
    return [p for p in _REGISTRY if group is None or p.group == group]


def apply(group: str | None = None) -> list[str]:
    """Apply every registered patch of `group` (all groups if None). Idempotent.

    Returns the targets that are in place afterwards; targets whose library is not installed, or
    whose `when` predicate says no, are skipped.
    """
    return [p.target for p in registered(group) if p.apply()]


def revert(group: str | None = None) -> None:
    """Undo the patches of `group` (all if None), newest first, restoring the originals exactly."""
    for p in reversed(registered(group)):
        p.revert()


def applied(group: str | None = None) -> list[str]:
    """Targets currently patched."""
    return [p.target for p in registered(group) if p.is_applied]


def describe(group: str | None = None) -> str:
    """A markdown table of the declared patches (of one group, if given): group, target, why, and
    the upstream issue. docs/patches.md holds this table for all of nbkit's patches.
    """
    rows = ["| group | target | why | upstream |", "| --- | --- | --- | --- |"]
    for p in sorted(registered(group), key=lambda p: (p.group, p.target)):
        cells = [p.group, f"`{p.target}`", p.reason, p.upstream]
        rows.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(rows) + "\n"
