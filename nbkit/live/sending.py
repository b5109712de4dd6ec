"""The names each rank of a live set holds, and which notebook names travel to them, and how: each value
once, pickled in the notebook, sent ahead of the call's code so that a stop during the send keeps the set.
"""

from __future__ import annotations

import ast
import time
from collections.abc import Iterable, Mapping
from typing import Any

from nbkit.live.engines import Engines
from nbkit.notebook import cell_code, notebook_names
from nbkit.platform import notices
from nbkit.platform.errors import LiveError
from nbkit.rank_side import live_engine

__all__ = ["HeldNames", "refuse_notebook_only"]

_log = notices.logger(__name__)


class HeldNames:
    """The names the ranks of one live set hold: those the set's cells bound (`defined`), and the notebook
    objects each rank got a copy of, so that an object travels once.
    """

    def __init__(self, engines: Engines):
        self._engines = engines
        self.defined: set[str] = set()  # names the set's cells bound on the ranks
        # {rank: {name: the notebook object sent under that name}}: what each rank holds already. Strong
        # references, so that an object's id cannot pass to another object while it is recorded.
        self._sent: dict[int, dict[str, Any]] = {}

    def needed(self, code: str, namespace: Mapping[str, Any]) -> dict[str, Any]:
        """The names of `namespace` that `code` reads and that must be sent along (LiveRanks.names_for)."""
        return {n: namespace[n] for n in notebook_names.needed(code, namespace, kept=self.defined)}

    def missing(self, ranks: Iterable[int], given: Mapping[str, Any], resend: set[str]) -> dict[int, dict[str, Any]]:
        """{rank: {name: value}}: the names of `given` that each of `ranks` lacks (it holds no copy of that
        very object under that name), and those in `resend` regardless.
        """
        return {
            r: {n: given[n] for n in sorted(given) if n in resend or not self._holds(r, n, given[n])} for r in ranks
        }

    def send_ahead(self, call: int, names: Mapping[int, Mapping[str, Any]]) -> None:
        """Send each rank its notebook `names` ({rank: {name: value}}) for call `call`, and wait until every
        rank has them, before that call's code is queued (live_engine.receive): the data of a big notebook
        object takes seconds to travel, and an interrupt then must not find ranks that have not even
        started the call. An interrupt (KeyboardInterrupt) during this send drops it: requests not yet
        run are aborted, and what arrived is never used; every rank keeps its names, nothing is
        interrupted there, and the KeyboardInterrupt goes on after a line that says so.

        Raises LiveError when a value cannot be pickled or the set ends meanwhile.
        """
        wanted = sorted({n for per_rank in names.values() for n in per_rank})
        if not wanted:
            return
        values = {n: next(per_rank[n] for per_rank in names.values() if n in per_rank) for n in wanted}
        pending: list[Any] = []
        sizes: dict[str, int] = {}
        try:
            pickled = _send_names(values, sizes)
            for r, per_rank in names.items():
                if per_rank:
                    pending.append(self._engines.apply(r, live_engine.receive, call, {n: pickled[n] for n in per_rank}))
            while not all(ar.ready() for ar in pending):
                if self._engines.ended is not None:
                    raise LiveError(self._engines.ended_text(), ended=True)
                time.sleep(0.01)
            for ar in pending:
                ar.get()  # an error of ipyparallel's own (the data did not arrive whole)
        except KeyboardInterrupt:
            if pending:
                self._engines.abort(pending, names)
            _log.warning(
                f"nbkit: interrupted while sending {_sizes_text(values, sizes)}; the live set and its names are kept."
            )
            raise

    def hold(self, rank: int, names: Mapping[str, Any]) -> None:
        """Record that `rank` holds these notebook objects under these names now."""
        self._sent.setdefault(rank, {}).update(names)

    def bound(self, ranks: Iterable[int], binds: set[str]) -> None:
        """A call on `ranks` bound `binds` there: they are the set's names, each rank's own value now, so a
        later notebook value under one of them must travel again.
        """
        self.defined.update(binds)
        for r in ranks:
            for n in binds:
                self._sent.get(r, {}).pop(n, None)

    def clear(self) -> None:
        """The set ended: let go of the notebook objects held for the ranks' copies."""
        self._sent.clear()

    def _holds(self, rank: int, name: str, value: Any) -> bool:
        """Whether `rank` holds `value` under `name` from an earlier call (so it need not travel again)."""
        sent = self._sent.get(rank, {})
        return name in sent and sent[name] is value and not notebook_names.sent_each_time(value)


def refuse_notebook_only(code: str, tree: ast.Module) -> None:
    """Raise LiveError where `code` calls get_ipython(), which IPython's transform makes of a %magic or a
    !command too: the ranks are plain Python processes without IPython's shell, where it would fail as
    a NameError that does not say why.
    """
    if "get_ipython" in cell_code.usage(tree.body).binds:
        return
    calls: dict[int, ast.Call] = {}  # id of the get_ipython Name: the call get_ipython().NAME(...) around it
    for n in ast.walk(tree):
        if _is_shell_call(n):
            assert isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Call)
            calls[id(n.func.value.func)] = n
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "get_ipython":
            line = _as_written(calls.get(id(node))) or code.splitlines()[node.lineno - 1].strip()
            raise LiveError(
                f"line {node.lineno} of the cell is IPython syntax (a %magic, a !command or get_ipython()), which "
                f"runs in the notebook, not on the ranks (plain Python processes without IPython):\n    {line}\n"
                "Run it in a cell of its own, without %%ddp. On the ranks, run a shell command with "
                "subprocess.run([...]). Nothing was sent or run; the live set and its names are kept."
            )


def _is_shell_call(node: ast.AST) -> bool:
    """Whether `node` is a call get_ipython().NAME(...)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Call)
        and isinstance(node.func.value.func, ast.Name)
    )


def _as_written(call: ast.Call | None) -> str:
    """The notebook syntax IPython turned into `call` ("%ddp stop", "!ls"), or "" where it is not one of those."""
    if call is None or not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in call.args):
        return ""
    assert isinstance(call.func, ast.Attribute)
    args = [a.value for a in call.args]  # type: ignore[attr-defined]
    if call.func.attr == "run_line_magic" and len(args) >= 2:
        return f"%{args[0]} {args[1]}".rstrip()
    if call.func.attr == "run_cell_magic" and len(args) >= 2:
        return f"%%{args[0]} {args[1]}".rstrip()
    if call.func.attr in ("system", "getoutput") and args:
        return f"!{args[0]}"
    return ""


def _send_names(names: Mapping[str, Any], sizes: dict[str, int]) -> dict[str, bytes]:
    """{name: pickled value} (notebook_names' one serializer); each value pickled once, so that one that
    cannot be is named. Records each pickled size in `sizes` as it goes.
    """
    pickled = {}
    for name, value in names.items():
        try:
            pickled[name] = notebook_names.pickle_value(value)
            sizes[name] = len(pickled[name])
        except Exception as exc:
            raise LiveError(
                f"The notebook's {name!r} ({type(value).__name__}) cannot be sent to the ranks: {exc}. Create it "
                "in a %%ddp cell instead (it then lives on the ranks), or send what it is made from."
            ) from None
    return pickled


def _sizes_text(values: Mapping[str, Any], sizes: Mapping[str, int]) -> str:
    """'big (500 MB), cfg (0 MB)': the names sent, each with its pickled size (before it is pickled, the
    size of its buffer where it has one).
    """
    parts = []
    for name, value in values.items():
        size = sizes.get(name, getattr(value, "nbytes", None))
        parts.append(f"{name} ({size / 2**20:.0f} MB)" if isinstance(size, int) else name)
    return ", ".join(parts)
