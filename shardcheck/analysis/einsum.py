"""Einsum equations as labelled axes: which input axes each output axis comes from.

Each axis gets a label: its letter, or, for the axes an ellipsis stands for, ``...0`` (the last
of them), ``...1`` and so on, counted from the right as broadcasting aligns them. An equation
without ``->`` has the implicit output: the ellipsis axes, then the letters that appear once,
in alphabetical order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardcheck.graph.index import Node

ELLIPSIS = "..."
MAX_EQUATION_CHARS = 256


@dataclass(frozen=True)
class Equation:
    inputs: tuple[tuple[str, ...], ...]  # each input's axis labels
    output: tuple[str, ...]

    def sources(self, out_axis: int) -> list[tuple[int, int]] | None:
        """(input position, axis) of each input that holds output axis ``out_axis``; None
        when an input holds its label twice (a diagonal)."""
        label = self.output[out_axis]
        found = []
        for position, labels in enumerate(self.inputs):
            if labels.count(label) > 1:
                return None
            if label in labels:
                found.append((position, labels.index(label)))
        return found


def parse(equation: str, ranks: Sequence[int | None]) -> Equation | None:
    """``equation`` for inputs of ``ranks``; None if it cannot be read (an unknown rank is
    fine unless that input has an ellipsis)."""
    if len(equation) > MAX_EQUATION_CHARS:
        return None
    text = equation.replace(" ", "")
    left, arrow, right = text.partition("->")
    terms = left.split(",")
    if len(terms) != len(ranks):
        return None
    inputs = []
    for term, rank in zip(terms, ranks, strict=True):
        labels = _labels(term, rank)
        if labels is None:
            return None
        inputs.append(labels)
    widest = max(_spread(labels) for labels in inputs)
    if arrow:
        output = _labels(right, None, widest)
    else:
        counts = Counter(label for labels in inputs for label in labels)
        once = sorted(
            label for label, n in counts.items() if n == 1 and not label.startswith(ELLIPSIS)
        )
        output = (*_ellipsis(widest), *once)
    if output is None or len(set(output)) != len(output):
        return None
    known = {label for labels in inputs for label in labels}
    if any(label not in known for label in output):
        return None
    return Equation(tuple(inputs), tuple(output))


def _spread(labels: tuple[str, ...]) -> int:
    return sum(1 for label in labels if label.startswith(ELLIPSIS))


def _ellipsis(count: int) -> tuple[str, ...]:
    return tuple(f"{ELLIPSIS}{i}" for i in reversed(range(count)))


def _labels(term: str, rank: int | None, spread: int | None = None) -> tuple[str, ...] | None:
    """The labels of one term; the ellipsis spans ``rank`` less the letters (an input) or
    ``spread`` axes (the output)."""
    before, dots, after = term.partition(ELLIPSIS)
    if not all(c.isascii() and c.isalpha() for c in before + after):
        return None
    if not dots:
        return None if rank is not None and rank != len(term) else tuple(term)
    if ELLIPSIS in after:
        return None
    count = spread if rank is None else rank - len(before) - len(after)
    if count is None or count < 0:
        return None
    return (*before, *_ellipsis(count), *after)


def node_equation(node: Node, ranks: Sequence[int | None]) -> Equation | None:
    """The equation of an Einsum node, for inputs of ``ranks``."""
    raw = node.attr("equation")
    if not isinstance(raw, bytes) or not raw.isascii():
        return None
    return parse(raw.decode("ascii"), ranks)


@dataclass(frozen=True)
class ScoreRoles:
    """Q and K of an Einsum that computes attention scores."""

    q: int  # Q's input position
    k: int
    q_axis: int  # Q's query axis
    k_axis: int  # K's key axis


@dataclass(frozen=True)
class ContextRoles:
    """V of an Einsum that applies attention probabilities to it."""

    v: int  # V's input position
    v_axis: int  # V's key axis
    output_axis: int  # the output's query axis


def _plain(equation: Equation) -> bool:
    """Two inputs, no ellipsis, no label twice in one input: what attention einsums look like."""
    return len(equation.inputs) == 2 and all(
        len(set(labels)) == len(labels) and not any(x.startswith(ELLIPSIS) for x in labels)
        for labels in equation.inputs
    )


def score_roles(equation: Equation, key_axis: int) -> ScoreRoles | None:
    """Which input is Q and which K, for scores whose ``key_axis`` is the keys' (the axis the
    Softmax normalises): K holds the key label; Q holds the one query label; they contract
    at least one label (the head dim)."""
    if not _plain(equation) or not -len(equation.output) <= key_axis < len(equation.output):
        return None
    key = equation.output[key_axis]
    holders = [position for position, labels in enumerate(equation.inputs) if key in labels]
    if len(holders) != 1:
        return None
    k = holders[0]
    q = 1 - k
    q_labels, k_labels = equation.inputs[q], equation.inputs[k]
    queries = [x for x in equation.output if x in q_labels and x not in k_labels]
    contracted = [x for x in q_labels if x in k_labels and x not in equation.output]
    if len(queries) != 1 or not contracted:
        return None
    return ScoreRoles(q, k, q_labels.index(queries[0]), k_labels.index(key))


def context_roles(equation: Equation, probs: int) -> ContextRoles | None:
    """V and its key axis, for probabilities at input ``probs``: the one label they contract
    is the keys'; the probabilities' other label that V lacks is the queries'."""
    if not _plain(equation):
        return None
    v = 1 - probs
    p_labels, v_labels = equation.inputs[probs], equation.inputs[v]
    contracted = [x for x in p_labels if x in v_labels and x not in equation.output]
    queries = [x for x in p_labels if x in equation.output and x not in v_labels]
    if len(contracted) != 1 or len(queries) != 1:
        return None
    return ContextRoles(v, v_labels.index(contracted[0]), equation.output.index(queries[0]))
