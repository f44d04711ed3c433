"""Counts in messages: "1 layer", "2 layers"."""

from __future__ import annotations


def counted(number: int, singular: str, plural: str | None = None) -> str:
    """``number`` and the noun in the form it takes: ``counted(1, "rank")`` is "1 rank"."""
    return f"{number} {singular if number == 1 else plural or singular + 's'}"


def listed(items: list[str]) -> str:
    """``["a", "b", "c"]`` as "a, b and c"."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
