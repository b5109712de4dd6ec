"""Reading notebook cells as Python: which names a piece of code needs, and running a cell.

Shared by %%ddp (fork and spawn modes: nbkit.magics, nbkit.launching.spawn) and the script exporter
(nbkit.export). The analysis is syntactic (ast): it sees the names code reads and binds, not what
it does at run time; callers use it to decide what to bring along and treat names it reports as
needed but that do not exist as "not ours" (builtins, or defined by the code itself later).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from nbkit.platform.errors import CellSyntaxError

__all__ = ["Usage", "free_names", "parse", "run_cell", "usage"]


@dataclass
class Usage:
    """Names used and bound by some statements at one scope level.

    now: read while the statements run (module level, class bodies, decorators, defaults).
    later: read by function bodies defined here, i.e. when they are called.
    binds: bound at this level (assignments, def, class, import, for/with/except targets).
    """

    now: set[str] = field(default_factory=set)
    later: set[str] = field(default_factory=set)
    binds: set[str] = field(default_factory=set)


def parse(source: str, filename: str = "<cell>") -> ast.Module:
    """The ast of cell `source`; raises CellSyntaxError (the line, a caret, Python's reason) when it does
    not parse, so that callers report it before anything runs.
    """
    try:
        return ast.parse(source, filename)
    except SyntaxError as exc:
        raise CellSyntaxError(exc) from None


def usage(nodes: Iterable[ast.AST]) -> Usage:
    """The Usage of some statements or expressions, taken together (order ignored)."""
    scan = _Scan()
    for node in nodes:
        scan.visit(node)
    return scan.result


def free_names(code: str | list[ast.stmt]) -> set[str]:
    """Names that `code` (module-level statements, in order) reads without binding them first.

    A name read at module level before the code binds it counts; a name read inside a function
    the code defines counts unless the code binds it anywhere at module level (the function may
    only run after that). Builtin names count too: whether `dir` is the builtin or a value the
    notebook bound is the caller's question (the notebook's binding wins, as it does in the notebook).
    """
    stmts = ast.parse(code).body if isinstance(code, str) else code
    bound: set[str] = set()
    free: set[str] = set()
    later: set[str] = set()
    _sequential(stmts, bound, free, later)
    return free | (later - bound)


# Compound statements: the expressions of their header, the targets it binds, their bodies.
def _parts(stmt: ast.stmt) -> tuple[list[ast.AST], list[ast.AST], list[list[ast.stmt]]] | None:
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        return [stmt.iter], [stmt.target], [stmt.body, stmt.orelse]
    if isinstance(stmt, (ast.While, ast.If)):
        return [stmt.test], [], [stmt.body, stmt.orelse]
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return (
            [i.context_expr for i in stmt.items],
            [i.optional_vars for i in stmt.items if i.optional_vars is not None],
            [stmt.body],
        )
    if isinstance(stmt, ast.Try) or (sys.version_info >= (3, 11) and isinstance(stmt, ast.TryStar)):
        bodies = [stmt.body]
        for handler in stmt.handlers:
            # "except E as e:" binds e for the handler's body
            named: list[ast.stmt] = []
            if handler.name:
                named.append(ast.Assign(targets=[ast.Name(handler.name, ast.Store())], value=ast.Constant(None)))
            bodies.append(named + handler.body)
        return [h.type for h in stmt.handlers if h.type is not None], [], [*bodies, stmt.orelse, stmt.finalbody]
    return None


def _sequential(stmts: list[ast.stmt], bound: set[str], free: set[str], later: set[str]) -> None:
    """Statements in order: what each reads that is not bound yet is free."""
    for stmt in stmts:
        parts = _parts(stmt)
        if parts is None:
            use = usage([stmt])
            free |= use.now - bound
            later |= use.later
            bound |= use.binds
            continue
        header, targets, bodies = parts
        use = usage(header)
        free |= use.now - bound
        later |= use.later
        bound |= use.binds | usage(targets).binds
        for body in bodies:
            _sequential(body, bound, free, later)


def run_cell(source: str, namespace: dict[str, Any], filename: str = "<cell>") -> Any:
    """Execute `source` in `namespace` like a notebook cell.

    Args:
        source: the cell's code.
        namespace: the globals it runs in (changed by the cell, as a notebook's are).
        filename: the name in tracebacks (register the source in linecache to get its lines).

    Returns:
        The value of the cell's last expression; None when it does not end with one.

    Raises:
        Exception: whatever the cell raises, unchanged.
    """
    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        tree.body.pop()
    exec(compile(tree, filename, "exec"), namespace)
    return eval(compile(last, filename, "eval"), namespace) if last is not None else None


class _Scan(ast.NodeVisitor):
    def __init__(self) -> None:
        self.result = Usage()

    def _merge(self, nodes: Iterable[ast.AST | None]) -> None:
        inner = usage(n for n in nodes if n is not None)
        self.result.now |= inner.now
        self.result.later |= inner.later
        self.result.binds |= inner.binds

    def visit_Name(self, node: ast.Name) -> None:
        (self.result.now if isinstance(node.ctx, ast.Load) else self.result.binds).add(node.id)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        args = node.args
        params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        params |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        # decorators, defaults and annotations are evaluated when the def runs
        annotations = [a.annotation for a in args.posonlyargs + args.args + args.kwonlyargs]
        annotations += [a.annotation for a in (args.vararg, args.kwarg) if a is not None]
        head: list[ast.AST | None] = [*args.defaults, *args.kw_defaults, *annotations]
        if not isinstance(node, ast.Lambda):
            head += [*node.decorator_list, node.returns]
            self.result.binds.add(node.name)
        self._merge(head)
        body = usage(node.body if not isinstance(node, ast.Lambda) else [node.body])
        self.result.later |= (body.now | body.later) - params - body.binds

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._merge([*node.bases, *(k.value for k in node.keywords), *node.decorator_list])
        self.result.now |= free_names(node.body)  # a class body runs at once
        self.result.binds.add(node.name)

    def _comprehension(self, node: ast.AST) -> None:
        inner = usage(ast.iter_child_nodes(node))
        targets = usage(g.target for g in node.generators).binds  # type: ignore[attr-defined]
        self.result.now |= inner.now - targets
        self.result.later |= inner.later

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.result.binds.add(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.result.binds |= {alias.asname or alias.name for alias in node.names if alias.name != "*"}

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.result.binds.add(node.name)
        self.generic_visit(node)

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        if node.name:
            self.result.binds.add(node.name)
        self.generic_visit(node)

    def visit_MatchStar(self, node: ast.MatchStar) -> None:
        if node.name:
            self.result.binds.add(node.name)

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        if node.rest:
            self.result.binds.add(node.rest)
        self.generic_visit(node)

    def visit_Global(self, node: ast.Global) -> None:
        pass

    def visit_Nonlocal(self, node: ast.Nonlocal) -> None:
        pass
