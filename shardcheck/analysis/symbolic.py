"""Dims written as expressions (the dynamo exporter's value_info holds its symbolic sizes, such as
``1 - Max(0, 1 - sequence)`` for a slice of length one), evaluated on sample sizes."""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from functools import lru_cache

from shardcheck.graph.index import Dim

# Sizes given to every symbol at once. A dim that is 1 at all of them is taken to be 1 at any
# size a model runs at.
SAMPLE_SIZES = (1, 2, 3, 4, 7, 8, 16, 64, 1000, 4096)

# Dim names that stand for a batch (the feeds give them 1 by default).
BATCH_LIKE = re.compile(r"batch|^(bs|b|n)$", re.IGNORECASE)

_FUNCTIONS = {"Max": max, "Min": min}
# Longer dims are not read: the exporter's run to a few dozen characters, and a parse or a
# walk of a deeply nested expression could exhaust the stack or the memory.
MAX_EXPRESSION_CHARS = 256


def always_one(dim: Dim) -> bool:
    """Whether ``dim`` is 1: the int, or an expression that is 1 at every sample size."""
    if isinstance(dim, str):
        return _always_one(dim)
    return dim == 1


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def is_name(text: str) -> bool:
    """Whether ``text`` is a plain symbol (a name an expression can hold), not an expression."""
    return _NAME.fullmatch(text) is not None


def mentions(dim: Dim, symbol: str) -> bool:
    """Whether ``dim`` is ``symbol`` or an expression naming it (``2*sequence`` names
    ``sequence``; ``sequence_pad`` does not)."""
    if not isinstance(dim, str):
        return False
    if dim == symbol:
        return True
    if is_name(symbol):
        return symbol in _NAME.findall(dim)
    return symbol in dim  # not a name an expression can hold: any occurrence


def size_at(dim: Dim, sizes: Mapping[str, int]) -> int | None:
    """``dim`` with each symbol at its size in ``sizes``: the int, a named dim's size, or an
    expression of named dims (the frames a convolution makes of the samples); None where a
    symbol has no size or the expression cannot be read."""
    if isinstance(dim, int):
        return dim
    if not isinstance(dim, str) or len(dim) > MAX_EXPRESSION_CHARS:
        return None
    if dim in sizes:
        return sizes[dim]
    symbols = [name for name in _NAME.findall(dim) if name not in _FUNCTIONS]
    if not symbols or any(name not in sizes for name in symbols):
        return None
    try:
        return _value(ast.parse(dim, mode="eval").body, sizes)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


@lru_cache(maxsize=256)
def _always_one(expression: str) -> bool:
    if len(expression) > MAX_EXPRESSION_CHARS:
        return False
    try:
        tree = ast.parse(expression, mode="eval")
        return all(_value(tree.body, size) == 1 for size in SAMPLE_SIZES)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False


def _value(node: ast.expr, size: int | Mapping[str, int]) -> int | None:
    """The expression's value with every symbol set to ``size`` (or each to its own); None
    for what it cannot read."""
    if isinstance(node, ast.Constant):
        return node.value if type(node.value) is int else None
    if isinstance(node, ast.Name):
        return size if isinstance(size, int) else size.get(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        operand = _value(node.operand, size)
        return None if operand is None else -operand
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left, size), _value(node.right, size)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right:
            return left // right if isinstance(node.op, ast.FloorDiv) else left % right
        return None
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and node.args
        and not node.keywords
    ):
        values = []
        for argument in node.args:
            value = _value(argument, size)
            if value is None:
                return None
            values.append(value)
        return _FUNCTIONS[node.func.id](values)
    return None
