"""Row filters on scalar columns (``--filter "relevance_min >= 4"``), applied where rows are read.

The collections ship quality columns beside the data (FineVision: ``relevance_min``,
``formatting_min``..., a ``source`` column); a filter keeps the rows that pass every clause::

    filter  := clause ("and" clause)*
    clause  := COLUMN OP VALUE | COLUMN "in" [VALUE, ...]
    OP      := == | != | < | <= | > | >=
    VALUE   := a number, a quoted string, true, false

A null cell fails its clause. The mask is computed with pyarrow.compute on the filter's columns
alone, once when the units are listed (so each unit knows how many rows it keeps: the blend's
row counts and the per-source "filtered" counts come from the listing) and again when the unit is
read, the same rows by construction. Filtered rows are never decoded and never reach a stage.
Pure module: pyarrow, no ray.
"""
from __future__ import annotations

import ast
import dataclasses
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_CLAUSE = re.compile(r"^\s*([A-Za-z_][\w.\-]*)\s*(==|!=|<=|>=|<|>|\bin\b)\s*(.+?)\s*$")
_OPS = {"==": pc.equal, "!=": pc.not_equal, "<": pc.less, "<=": pc.less_equal, ">": pc.greater,
        ">=": pc.greater_equal}


@dataclasses.dataclass(frozen=True)
class Clause:
    column: str
    op: str
    value: object


def _literal(text: str, expr: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"--filter {expr!r}: {text!r} is not a number, a quoted string, true or false") from None


_AND = re.compile(r"\s+and\s+", re.IGNORECASE)


def _split_clauses(expr: str) -> list[str]:
    """``expr`` cut at each ``and`` that stands outside quotes and brackets ("source == 'q and a'" is one clause)."""
    depth, quote, inside = 0, "", []
    for ch in expr:  # per character: is it inside a quoted string or a [...] list?
        inside.append(bool(quote) or depth > 0)
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[(":
            depth += 1
        elif ch in "])":
            depth = max(0, depth - 1)
    parts, start = [], 0
    for m in _AND.finditer(expr):
        if not inside[m.start()]:
            parts.append(expr[start:m.start()])
            start = m.end()
    return parts + [expr[start:]]


def _kind(value) -> str:
    """A list item's kind for the 'in' check: numbers (int, float) go together, bool and str apart."""
    return "bool" if isinstance(value, bool) else "number" if isinstance(value, (int, float)) else type(value).__name__


def parse(expr: str) -> list[Clause]:
    """The clauses of a filter expression ('' = none); raises ValueError naming what is wrong."""
    if not expr or not expr.strip():
        return []
    out = []
    for part in _split_clauses(expr.strip()):
        m = _CLAUSE.match(part)
        if not m:
            raise ValueError(f"--filter {expr!r}: cannot read {part!r}; write COLUMN OP VALUE (OP one of "
                             "==, !=, <, <=, >, >=, in), clauses joined by 'and', e.g. \"relevance_min >= 4\"")
        column, op, value = m.group(1), m.group(2), _literal(m.group(3), expr)
        if op == "in" and not isinstance(value, (list, tuple, set)):
            raise ValueError(f"--filter {expr!r}: 'in' takes a list, e.g. source in ['ai2d', 'chartqa']")
        if op == "in" and len({_kind(v) for v in value}) > 1:
            kinds = " and ".join(sorted({_kind(v) for v in value}))
            raise ValueError(f"--filter {expr!r}: the list after 'in' mixes {kinds} values; a column holds one "
                             "type, so write them all as that type")
        out.append(Clause(column, op, value))
    return out


def columns(clauses: list[Clause]) -> list[str]:
    return sorted({c.column for c in clauses})


def missing_columns(clauses: list[Clause], arrow_schema: pa.Schema) -> list[str]:
    return [c for c in columns(clauses) if c not in arrow_schema.names]


def mask(table: pa.Table, clauses: list[Clause]) -> np.ndarray:
    """A bool per row: does it pass every clause (nulls fail)?"""
    keep = np.ones(table.num_rows, dtype=bool)
    for c in clauses:
        col = table.column(c.column)
        try:
            if c.op == "in":
                passed = pc.is_in(col, value_set=pa.array(list(c.value)))
            else:
                passed = _OPS[c.op](col, pa.scalar(c.value))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise ValueError(f"--filter: cannot compare column {c.column!r} ({col.type}) with "
                             f"{c.value!r}: {exc}") from None
        keep &= np.asarray(pc.fill_null(passed, False).to_numpy(zero_copy_only=False), dtype=bool)
    return keep
