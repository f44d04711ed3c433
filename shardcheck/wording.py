"""How values and counts read in messages: "1 layer", "2 layers", a value as the file wrote it."""

from __future__ import annotations

import json
from typing import Any

# Past this, a value in a message is cut: the message stays one readable line.
MAX_SHOWN_CHARS = 60


def counted(number: int, singular: str, plural: str | None = None) -> str:
    """``number`` and the noun in the form it takes: ``counted(1, "rank")`` is "1 rank"."""
    return f"{number} {singular if number == 1 else plural or singular + 's'}"


def listed(items: list[str]) -> str:
    """``["a", "b", "c"]`` as "a, b and c"."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def shown(value: Any) -> str:
    """``value`` as JSON (repr when JSON cannot say it), cut to one short line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return text[: MAX_SHOWN_CHARS - 3] + "..."
