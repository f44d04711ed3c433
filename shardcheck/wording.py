"""How values and counts read in messages: "1 layer", "2 layers", a value as the file wrote it,
a byte count ("1.5 KiB")."""

from __future__ import annotations

import json
import re
from typing import Any

# Past this, a value in a message is cut: the message stays one readable line.
MAX_SHOWN_CHARS = 60
# Byte counts from here on are written from their digits: a float cannot hold them all.
_FLOAT_SAFE = 10**300


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


# Characters that a terminal acts on rather than shows: C0 (newline, carriage return, ESC, BEL),
# DEL, C1 (CSI is one byte there) and Unicode's line and paragraph separators.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_line(text: str) -> str:
    """``text`` with every control character escaped as Python writes it (``\\n``,
    ``\\x1b``): a name from a file (a tensor's, a JSON key) can neither forge a line of the
    output nor send a terminal an escape sequence."""
    return _CONTROL.sub(lambda m: _NAMED_ESCAPES.get(m.group(), repr(m.group())[1:-1]), text)


def human(nbytes: int) -> str:
    """``1536`` -> ``1.5 KiB``; past EiB, powers of ten (``2.4e+22 B``)."""
    if nbytes >= _FLOAT_SAFE:  # past a float: the digits say it (--dim batch=10**400)
        digits = str(nbytes)
        return f"{digits[0]}.{digits[1]}e+{len(digits) - 1} B"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{float(nbytes):.2g} B"
