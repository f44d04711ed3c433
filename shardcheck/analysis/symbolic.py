"""Arithmetic on symbolic dims: the ints, symbols and expressions shape inference computes with.

A dim is an int, a symbol (a graph input's dim_param, such as ``sequence``), a product of them
(``2*batch``), an expression (the dynamo exporter's value_info holds its symbolic sizes, such as
``1 - Max(0, 1 - sequence)`` for a slice of length one; a strided convolution's frame count) or
None when unknown. Here dims are broadcast, multiplied and divided, shifted and sliced, the small
integer vectors that hold shapes are computed on, and expressions are evaluated on sample sizes.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache

from shardcheck.graph.index import Dim, Shape

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
    ``sequence``; ``sequence_pad`` does not; ``2*batch*sequence`` names ``batch*sequence``,
    ``batch*sequence_on_rank`` does not)."""
    if not isinstance(dim, str):
        return False
    if dim == symbol:
        return True
    if is_name(symbol):
        return symbol in _NAME.findall(dim)
    # An expression (a product): an occurrence that no name character continues on either side.
    return _expression_pattern(symbol).search(dim) is not None


@lru_cache(maxsize=256)
def _expression_pattern(symbol: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape(symbol)}(?![A-Za-z0-9_])")


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


# ------------------------------------------------------------------ arithmetic


def broadcast(shapes: Sequence[Shape]) -> Shape | None:
    """The shape ``shapes`` broadcast to (ONNX's multidirectional broadcasting, dims aligned
    from the right)."""
    first = shapes[0]
    if len(shapes) == 2:
        if shapes[1] == first:
            return first
    elif all(s == first for s in shapes):
        return first
    rank = max(len(s) for s in shapes)
    result: list[Dim] = []
    for axis in range(rank):
        dims = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]
        if all(d == 1 for d in dims):
            result.append(1)
            continue
        # An unknown dim beside a known one other than 1 is 1 or equal to it: either way the
        # result is the known one.
        known = [d for d in dims if d != 1 and d is not None]
        if not known:
            result.append(None)
        elif len(set(known)) == 1:
            result.append(known[0])
        else:
            # Two different symbols (or a symbol and an int > 1): equal at run time.
            ints = [d for d in known if isinstance(d, int)]
            result.append(ints[0] if ints else known[0])
    return tuple(result)


Size = tuple[int, tuple[str, ...]]  # a product of dims: integer factor, symbols sorted


def size_of(dims: Sequence[Dim]) -> Size | None:
    """A product of dims as its integer factor and its symbols, sorted (merged dims are
    written ``a*b``), so that equal products have equal sizes; None when a dim is unknown."""
    number = 1
    symbols: list[str] = []
    for dim in dims:
        if dim is None:
            return None
        if isinstance(dim, int):
            number *= dim
            continue
        factor, names = factors(dim)
        number *= factor
        symbols.extend(names)
    symbols.sort()
    return number, tuple(symbols)


_DIGITS = re.compile(r"[0-9]+")


def factors(dim: str) -> Size:
    """A symbolic dim as its integer factor and its symbols. Only a product as shape
    propagation writes one is read as a product (``2*batch``, ``s*2``, ``batch*heads``: names
    and integers, one name at least); any other dim is one symbol, never arithmetic: a model's
    dim_param ``99999999999*99999999999`` is a name, as are ``²`` and ``seq len``."""
    parts = dim.split("*")
    numbers = [part for part in parts if _DIGITS.fullmatch(part)]
    names = [part for part in parts if is_name(part)]
    if len(parts) == 1 or not names or len(numbers) + len(names) != len(parts):
        return 1, (dim,)
    return math.prod(int(number) for number in numbers), tuple(names)


def _quotient(whole: Size, part: Size) -> Size | None:
    """``whole`` / ``part``, when ``part``'s symbols are among ``whole``'s and its integer
    factor divides ``whole``'s."""
    remaining = list(whole[1])
    for symbol in part[1]:
        if symbol not in remaining:
            return None
        remaining.remove(symbol)
    if part[0] == 0 or whole[0] % part[0]:
        return None
    return whole[0] // part[0], tuple(remaining)


def window_count(size: Dim, extra: int, stride: int) -> Dim:
    """How many windows a convolution fits along a dim: ``(size + extra) // stride + 1``
    (``extra``: the padding less the window's span). A symbolic dim gives an expression over
    it (audio encoders' strided convolutions over the samples), a product of symbols none."""
    if isinstance(size, int):
        return (size + extra) // stride + 1
    if size is None or "*" in size or stride < 1:
        return None
    if stride == 1:
        return shifted(size, extra + 1)
    inner = shifted(size, extra)
    return None if inner is None else f"({inner})//{stride} + 1"


_TRAILING_TERM = re.compile(r"^(.+) ([+-]) (\d+)$")


def shifted(dim: str, shift: int) -> Dim:
    """The symbolic ``dim`` plus ``shift``, a trailing integer term folded in, so that equal
    sizes are written alike: ``s + 1`` shifted by -1 is ``s``. Unknown (None) for a dim too
    long to be read as an expression (a hostile model's dim_param)."""
    if len(dim) > MAX_EXPRESSION_CHARS:
        return None
    if not shift:
        return dim
    match = _TRAILING_TERM.match(dim)
    if match is not None:
        base, sign, number = match.groups()
        return shifted(base, shift + (int(number) if sign == "+" else -int(number)))
    written = f"{dim} {'+' if shift > 0 else '-'} {abs(shift)}"
    return written if len(written) <= MAX_EXPRESSION_CHARS else None


def dim_of(size: Size | None) -> Dim:
    """A size written back as a dim: its int, or its factors joined by ``*``."""
    if size is None:
        return None
    number, symbols = size
    if not symbols:
        return number
    factors = list(symbols)
    if number != 1:
        factors.insert(0, str(number))
    return "*".join(factors)


def reshape_dims(source: Shape, target: Sequence[Dim], allowzero: bool = False) -> Shape | None:
    """The shape a Reshape of ``source`` to ``target`` gives: its 0s copied from ``source``
    (unless ``allowzero``), its -1 what is left of ``source``'s size."""
    dims = list(target)
    for axis, dim in enumerate(dims):
        if dim == 0 and not allowzero:
            if axis >= len(source):
                return None
            dims[axis] = source[axis]
    if -1 in dims:
        position = dims.index(-1)
        whole = size_of(source)
        rest = size_of([d for i, d in enumerate(dims) if i != position])
        dims[position] = None if whole is None or rest is None else dim_of(_quotient(whole, rest))
    return tuple(dims)


def matmul_shape(a: Shape, b: Shape) -> Shape | None:
    """The shape of MatMul(a, b), as numpy's matmul: 1-D operands promoted, batch broadcast."""
    if len(a) < 1 or len(b) < 1:
        return None
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    batch = broadcast([a2[:-2], b2[:-2]]) if len(a2) > 2 or len(b2) > 2 else ()
    out = tuple(batch or ()) + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def slice_length(dim: Dim, start: Dim, end: Dim, step: Dim) -> Dim:
    """The length of ``[start:end:step]`` of an axis of length ``dim``."""
    # x[-n:] of a length n; the dynamo exporter computes -n as -1 times n.
    from_end = isinstance(start, str) and isinstance(dim, str) and _negated(start) == dim
    if step == 1 and from_end and isinstance(end, int) and end >= 2**31 - 1:
        return dim
    if not isinstance(start, int) or not isinstance(step, int):
        return None
    if step == 1 and start == 0 and isinstance(end, str):
        return end  # x[:n] with n a symbol, e.g. a position table cut to the sequence length
    if step == 1 and start == 0 and isinstance(end, int) and end >= 2**31 - 1:
        return dim
    if isinstance(dim, int) and isinstance(end, int):
        return len(range(*slice(start, end, step).indices(dim)))
    if isinstance(dim, str) and "*" not in dim and step == 1 and isinstance(end, int):
        # x[k:] and x[:-k] of a symbolic length (a convolution's padding trimmed, say).
        if end >= 2**31 - 1 and start >= 0:
            return shifted(dim, -start)
        if start == 0 and end < 0:
            return shifted(dim, end)
    return None


def range_length(start: Sequence[Dim], limit: Sequence[Dim], delta: Sequence[Dim]) -> Dim:
    """How many values Range(start, limit, delta) makes, when all three are ints."""
    values = (start[0] if start else None, limit[0] if limit else None, delta[0] if delta else None)
    if all(isinstance(v, int) for v in values):
        s, lim, d = values  # type: ignore[misc]
        return max(0, -(-(lim - s) // d))  # type: ignore[operator]
    return None


def elementwise_value(op: str, values: Sequence[tuple[Dim, ...] | None]) -> tuple[Dim, ...] | None:
    """The value an elementwise op computes from its inputs' small shape values (None for one
    unknown), where it can be written in dims."""
    first = values[0]
    if op in ("Cast", "Identity", "CastLike"):
        return first
    if op == "Where":
        return _where_value(*values)
    if op == "Neg":
        return None if first is None else tuple(_negated(dim) for dim in first)
    second = values[1] if len(values) > 1 else None
    if op == "Equal" and first is not None and second is not None:
        return _equal_value(first, second)
    if first is None or second is None or op not in _VALUE_OPS:
        return None
    if len(second) == 1 and len(first) > 1:
        second = second * len(first)
    if len(first) == 1 and len(second) > 1:
        first = first * len(second)
    if len(first) != len(second):
        return None
    result: list[Dim] = []
    for a, b in zip(first, second, strict=True):
        if isinstance(a, int) and isinstance(b, int):
            result.append(_integer_result(op, a, b))
        elif op in ("Mul", "Div") and b == 1:
            result.append(a)
        elif op == "Mul" and a is not None and b is not None:
            result.append(dim_of(size_of([a, b])))
        elif op == "Div" and isinstance(b, int) and b > 0 and isinstance(a, str):
            result.append(_divide(a, b))
        elif op in ("Add", "Sub") and b == 0:
            result.append(a)
        elif op == "Mul" and a == 1:
            result.append(b)
        else:
            result.append(None)
    return tuple(result)


_VALUE_OPS = frozenset(("Add", "Sub", "Mul", "Div", "Mod", "Max", "Min"))


def _integer_result(op: str, a: int, b: int) -> Dim:
    if op == "Mod":
        # Both of ONNX's Mod (fmod 0 and 1) agree on non-negative operands (TorchScript's
        # nn.MultiheadAttention computes its unflatten's split point with one).
        return a % b if a >= 0 and b > 0 else None
    if op in ("Max", "Min"):
        return max(a, b) if op == "Max" else min(a, b)
    return {"Add": a + b, "Sub": a - b, "Mul": a * b, "Div": a // b if b else 0}[op]


def _negated(dim: Dim) -> Dim:
    """``-dim`` for an integer or a plain symbol (``-sequence``, the start of x[-n:]; the
    negation of ``-1*sequence`` is ``sequence``); None for an expression."""
    if isinstance(dim, int):
        return -dim
    if dim is None:
        return None
    if dim.startswith("-1*") and is_name(dim[3:]):
        return dim[3:]
    negative = dim.startswith("-")
    name = dim[1:] if negative else dim
    if not is_name(name):
        return None
    return name if negative else f"-{name}"


def _align(*values: tuple[Dim, ...]) -> list[tuple[Dim, ...]] | None:
    length = max(len(v) for v in values)
    aligned = []
    for value in values:
        if len(value) == 1 and length > 1:
            value = value * length
        if len(value) != length:
            return None
        aligned.append(value)
    return aligned


def _equal_value(first: tuple[Dim, ...], second: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
    aligned = _align(first, second)
    if aligned is None:
        return None
    result: list[Dim] = []
    for a, b in zip(*aligned, strict=True):
        if isinstance(a, int) and isinstance(b, int):
            result.append(int(a == b))
        elif isinstance(a, str) and isinstance(b, int) and b < 0:
            result.append(0)  # a size is never negative
        elif isinstance(b, str) and isinstance(a, int) and a < 0:
            result.append(0)
        else:
            result.append(None)
    return tuple(result)


def _where_value(
    condition: tuple[Dim, ...] | None, yes: tuple[Dim, ...] | None, no: tuple[Dim, ...] | None
) -> tuple[Dim, ...] | None:
    if condition is None or yes is None or no is None:
        return None
    aligned = _align(condition, yes, no)
    if aligned is None or any(not isinstance(c, int) for c in aligned[0]):
        return None
    return tuple(y if c else n for c, y, n in zip(*aligned, strict=True))


def _divide(dim: str, divisor: int) -> Dim:
    """``2*batch`` / 2 -> ``batch``; None when the factor is not there."""
    size = size_of([dim])
    return None if size is None else dim_of(_quotient(size, (divisor, ())))
