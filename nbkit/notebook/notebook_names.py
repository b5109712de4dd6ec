"""Which notebook names travel to the ranks, and how: one rule and one pickler for spawn mode and live sets.

Runs in the notebook process (choosing and pickling) and in the ranks (`BroughtAlong.load_into`).
Fork mode needs neither: a forked rank has every notebook name already.

Which names: those the cell's code reads (nbkit.notebook.cell_code.free_names) that the notebook binds, whatever
they are called, `_private` names included (a cell that reads `_cfg` needs it on the rank, or it
fails there with NameError), and names of builtins the notebook rebinds (`dir = "outputs"`: the
cell reads the notebook's value, as it does in the notebook), except IPython's own (In, Out, `_`,
`__`, `_i3`, `_5`, get_ipython, exit, quit, open, dunders) and a builtin's own value (ipykernel's
`input`), which are the kernel's and mean nothing in a rank; a live set also keeps the names its own
cells defined (the ranks' model is never replaced by a notebook object).

How: cloudpickle, by value, through NotebookPickler: notebook functions and classes travel with
their code and the notebook values they read; tensors arrive on the CPU (a notebook's CUDA tensor
would otherwise be rebuilt on cuda:0 in every rank); modules are imported again by name. Spawn mode
pickles every name in one go, so shared objects stay shared, and makes the notebook functions'
globals the rank's namespace (as in the notebook). A live set pickles each value on its own
(`pickle_value`), so that a rank that holds an object need not get it again; its notebook functions
keep their own globals, so the names the set's cells defined stay the ranks'.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import linecache
import pickle
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from nbkit.launching import rank_contract
from nbkit.notebook import cell_code
from nbkit.platform.errors import BringAlongError

__all__ = ["BroughtAlong", "NotebookPickler", "bring_along", "needed", "pickle_value", "sent_each_time", "travels"]

_NO_BUILTIN = object()
# IPython's own names in a notebook namespace (history, output cache, helpers, the kernel's open()).
_IPYTHON_NAME = re.compile(r"^(In|Out|get_ipython|exit|quit|open|_(i+|\d+|i\d+|oh|ih|dh)?|__+|__\w+__)$")


def travels(name: str, value: Any) -> bool:
    """Whether notebook name `name` bound to `value` may travel to the ranks: False for IPython's own
    names and for a builtin's own value (the rank has its own builtins; the kernel's `input` is the
    kernel's).
    """
    return not _IPYTHON_NAME.match(name) and value is not getattr(builtins, name, _NO_BUILTIN)


def needed(
    code: str | list[Any], namespace: Mapping[str, Any], *, kept: frozenset[str] | set[str] = frozenset()
) -> list[str]:
    """The names of `namespace` that `code` (source, or parsed statements) reads and that travel, sorted;
    `kept` names (a live set's own) never do. Raises CellSyntaxError when source does not parse.
    """
    tree = cell_code.parse(code, "<cell>").body if isinstance(code, str) else code
    return sorted(n for n in cell_code.free_names(tree) - set(kept) if n in namespace and travels(n, namespace[n]))


def sent_each_time(value: Any) -> bool:
    """A function or class defined in the notebook: cloudpickle sends it by value with the notebook
    values it reads at that moment, so a live set sends it every time rather than once.
    """
    return isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == "__main__"


def pickle_value(value: Any) -> bytes:
    """One notebook value pickled for a live set's ranks (NotebookPickler, the function's own globals).

    Raises whatever pickling raises for a value that cannot travel (the caller names it).
    """
    pickler = NotebookPickler({})
    pickler.dump(value)
    return pickler.buffer.getvalue()


@dataclass(frozen=True)
class BroughtAlong:
    """The notebook names a cell needs, pickled together (so shared objects stay shared).

    Attributes:
        names: the names bound in each rank's namespace: those the cell reads, and the notebook
            functions and classes that their values reach (so that rank 0's return value, pickled
            by reference to them, comes back).
        reached: every notebook name that comes along, including the globals that notebook
            functions read (what the user is told).
        payload: cloudpickle's bytes of {name: value}; load them with `load_into(namespace)`.
        sources: linecache entries of the notebook cells those functions were defined in, so
            the ranks' tracebacks show their lines.
    """

    names: tuple[str, ...]
    reached: tuple[str, ...]
    payload: bytes
    sources: dict[str, list[str]] = field(default_factory=dict)

    def load_into(self, namespace: dict[str, Any]) -> None:
        """Unpickle the values into `namespace`, which becomes the notebook functions' globals."""
        for filename, lines in self.sources.items():
            linecache.cache.setdefault(filename, (sum(map(len, lines)), None, lines, filename))
        namespace.update(_RankUnpickler(io.BytesIO(self.payload), namespace).load())


def bring_along(source: str, namespace: Mapping[str, Any]) -> BroughtAlong:
    """The notebook names `source` needs, pickled by value with cloudpickle.

    Raises BringAlongError naming the first needed name whose value cannot be pickled.
    """
    names = needed(source, namespace)
    pickler = _pickle(names, namespace)
    # Notebook functions and classes the values reach, still bound under their name here.
    reached = sorted(n for n, obj in pickler.defined.items() if n not in names and namespace.get(n) is obj)
    if reached:
        names = sorted(names + reached)
        pickler = _pickle(names, namespace)
    globals_read = sorted(pickler.globals_read - set(names))
    return BroughtAlong(
        names=tuple(names),
        reached=tuple(names + globals_read),
        payload=pickler.buffer.getvalue(),
        sources={f: list(linecache.getlines(f)) for f in sorted(pickler.filenames) if linecache.getlines(f)},
    )


# Stands for the notebook's namespace in the pickle: cloudpickle pickles the globals of a notebook
# function as a dict of the names it reads, which the rank then merges into its own namespace.
_NOTEBOOK_GLOBALS = "nbkit:notebook-globals"


class NotebookPickler(cloudpickle.Pickler):
    """cloudpickle (notebook functions and classes by value; tensors to the CPU) that notes what
    of the notebook it reaches, and makes notebook functions whose globals are `namespace` share the
    rank's namespace (spawn mode passes the notebook's; a live set an empty one, so nothing shares).
    """

    def __init__(self, namespace: Mapping[str, Any]):
        self.buffer = io.BytesIO()
        super().__init__(self.buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self.namespace = namespace
        self.defined: dict[str, Any] = {}
        self.globals_read: set[str] = set()
        self.filenames: set[str] = set()
        # cloudpickle.Pickler.globals_ref maps id(a function's __globals__) to the dict that
        # stands for it in the pickle (documented in cloudpickle's _function_getnewargs); ours
        # is pickled as a persistent id that the rank resolves to its own namespace.
        self._globals_stand_in: dict[str, Any] = {}
        self.globals_ref[id(namespace)] = self._globals_stand_in

    def persistent_id(self, obj: Any) -> str | None:
        """The stand-in for the notebook's namespace, pickled as a reference the rank resolves."""
        return _NOTEBOOK_GLOBALS if obj is self._globals_stand_in else None

    def reducer_override(self, obj: Any) -> Any:
        """Notes the notebook functions and classes it meets; tensors go as CPU tensors."""
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            self.defined.setdefault(obj.__qualname__.split(".")[0], obj)
            if isinstance(obj, types.FunctionType):
                self.globals_read |= _names_read(obj.__code__) & self.namespace.keys()
                self.filenames.add(obj.__code__.co_filename)
        reduction = rank_contract.cpu_reduction(obj)
        return reduction if reduction is not NotImplemented else super().reducer_override(obj)


class _RankUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, namespace: dict[str, Any]):
        super().__init__(file)
        self.namespace = namespace

    def persistent_load(self, pid: Any) -> Any:
        if pid == _NOTEBOOK_GLOBALS:
            return self.namespace
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def _names_read(code: types.CodeType) -> set[str]:
    """Global (and attribute) names a code object and the code nested in it refer to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_read(const)
    return names


def _pickle(names: list[str], namespace: Mapping[str, Any]) -> NotebookPickler:
    pickler = NotebookPickler(namespace)
    try:
        pickler.dump({name: namespace[name] for name in names})
    except Exception as exc:
        for name in names:  # which one: the first that fails alone
            with contextlib.suppress(Exception):
                NotebookPickler(namespace).dump(namespace[name])
                continue
            value = namespace[name]
            raise BringAlongError(name, f"its value ({type(value).__name__}) cannot be pickled ({exc})") from exc
        raise BringAlongError(", ".join(names), f"they cannot be pickled together ({exc})") from exc
    return pickler
