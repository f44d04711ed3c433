"""The protobuf wire format of a serialized ModelProto, walked to its main graph's initializers
and written again with some of them rewritten (inline_weights.py): without parsing it, so that
neither a weight's bytes nor the rest of the model is copied to find them.

A walk reads what it is given (a file, by reads: never mapped, so that a file cut short while
it is walked gives short reads, not SIGBUS; or bytes in memory) a block at a time, and jumps
over the fields it does not look into. The rewritten model is a list of pieces: ranges of what
was walked, ranges of another file, and bytes written anew (the headers of the fields whose
length changed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

# Field numbers of onnx.proto.
GRAPH = 7  # ModelProto.graph
INITIALIZER = 5  # GraphProto.initializer
NODE = 1  # GraphProto.node
LENGTH_DELIMITED = 2  # the wire type of messages, strings and bytes
_NODE_TAG = NODE << 3 | LENGTH_DELIMITED
# What a walk reads at once: a run of nodes is read in long blocks, a field among weights
# (which the walk jumps over) in short ones.
_BLOCK = 1 << 20
_SHORT_BLOCK = 1 << 16


class NotFollowed(Exception):
    """The wire format is not one this walk follows (a parse will say what is wrong), or what
    is walked was cut short while it was read."""


class Elsewhere(NamedTuple):
    """A piece of a rewritten model: the bytes ``start:end`` of another file than the one
    walked (a weight's raw data, from the model file it was left in)."""

    start: int
    end: int


# A piece: a range (start, end) of what was walked, bytes written anew, or Elsewhere.
Piece = tuple[int, int] | bytes | Elsewhere


class Walk:
    """What is walked: ``read(size, at)`` gives at most ``size`` bytes from ``at`` (fewer at
    the end), of the ``size`` bytes there are."""

    def __init__(self, read: Callable[[int, int], bytes], size: int) -> None:
        self._read = read
        self.size = size
        self.block = b""
        self.block_start = 0

    def load(self, at: int, size: int = _BLOCK) -> tuple[bytes, int]:
        """The block of ``size`` bytes that starts at ``at``."""
        self.block = self._read(size, at)
        self.block_start = at
        return self.block, at

    def byte(self, at: int) -> int:
        offset = at - self.block_start
        if not 0 <= offset < len(self.block):
            block, _ = self.load(at, _SHORT_BLOCK)
            if not block:
                raise NotFollowed()
            offset = 0
        return self.block[offset]

    def read(self, start: int, end: int) -> bytes:
        data = self._read(end - start, start)
        if len(data) != end - start:
            raise NotFollowed()  # cut short while it is read
        return data


def rewritten(walk: Walk, rewrite: Callable[[int, int], list[Piece] | None]) -> list[Piece] | None:
    """The model ``walk`` reads, as pieces, with each main-graph initializer that ``rewrite``
    (given where its TensorProto's fields lie) rewrites in their place; None when it rewrites
    none."""
    pieces: list[Piece] = []
    copied = 0  # what was walked up to ``copied`` is in pieces
    at, end = 0, walk.size
    while at < end:
        number, kind, start, value_start, at = field(walk, at, end)
        if number != GRAPH or kind != LENGTH_DELIMITED:
            continue
        graph = _rewritten_graph(walk, value_start, at, rewrite)
        if graph is not None:
            _splice(pieces, (copied, start), GRAPH, graph)
            copied = at
    if not copied:
        return None
    pieces.append((copied, end))
    return pieces


def _rewritten_graph(
    walk: Walk, start: int, end: int, rewrite: Callable[[int, int], list[Piece] | None]
) -> list[Piece] | None:
    pieces: list[Piece] = []
    copied = at = start
    while at < end:
        at = _past_nodes(walk, at, end)
        if at >= end:
            break
        number, kind, field_start, value_start, at = field(walk, at, end)
        if number != INITIALIZER or kind != LENGTH_DELIMITED:
            continue
        tensor = rewrite(value_start, at)
        if tensor is not None:
            _splice(pieces, (copied, field_start), INITIALIZER, tensor)
            copied = at
    if copied == start:
        return None
    pieces.append((copied, end))
    return pieces


def length(piece: Piece) -> int:
    return len(piece) if isinstance(piece, bytes) else piece[1] - piece[0]


def _splice(
    pieces: list[Piece], before: tuple[int, int], number: int, message: list[Piece]
) -> None:
    """Append to ``pieces`` the range ``before`` a field, then the field ``number`` holding
    ``message`` (its pieces) in place of the one that was walked."""
    pieces.append(before)
    pieces.append(header(number, sum(length(p) for p in message)))
    pieces.extend(message)


def _past_nodes(walk: Walk, at: int, end: int) -> int:
    """Where the run of node fields from ``at`` ends: the walk over them is most of what a
    walk costs (one field a node), so their lengths (of one to three bytes) are read from the
    block here without a call."""
    block, base = walk.block, walk.block_start
    while at < end:
        offset = at - base
        if offset < 0 or offset + 4 > len(block):
            block, base = walk.load(at)
            offset = 0
            if len(block) < 4:
                return at  # the last bytes: ``field`` reads them
        if block[offset] != _NODE_TAG:
            return at
        first = block[offset + 1]
        if first < 0x80:
            at += 2 + first
            continue
        second = block[offset + 2]
        if second < 0x80:
            at += 3 + (first & 0x7F | second << 7)
            continue
        third = block[offset + 3]
        if third >= 0x80:
            return at  # a node of 2 MiB or more: ``field`` reads it
        at += 4 + (first & 0x7F | (second & 0x7F) << 7 | third << 14)
    if at > end:
        raise NotFollowed()
    return at


def field(walk: Walk, at: int, end: int) -> tuple[int, int, int, int, int]:
    """The field at ``at`` of a message that ends at ``end``: (number, wire type, start of
    the field, start of its value, end of the field)."""
    start = at
    tag, at = _varint(walk, at)
    kind = tag & 7
    if kind == LENGTH_DELIMITED:
        size, at = _varint(walk, at)
        value_end = at + size
    elif kind == 0:
        _, value_end = _varint(walk, at)
    elif kind == 1:
        value_end = at + 8
    elif kind == 5:
        value_end = at + 4
    else:  # groups (deprecated, not in onnx.proto) and invalid wire types
        raise NotFollowed()
    if value_end > end:
        raise NotFollowed()
    return tag >> 3, kind, start, at, value_end


def _varint(walk: Walk, at: int) -> tuple[int, int]:
    byte = walk.byte(at)
    if byte < 0x80:
        return byte, at + 1
    value, shift = byte & 0x7F, 7
    while True:
        at += 1
        byte = walk.byte(at)
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at + 1
        shift += 7
        if shift > 63:
            raise NotFollowed()


def varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def header(number: int, size: int) -> bytes:
    """The tag and length of a length-delimited field ``number`` of ``size`` bytes."""
    return varint_bytes(number << 3 | LENGTH_DELIMITED) + varint_bytes(size)


def string_field(number: int, text: str) -> bytes:
    encoded = text.encode("utf-8")
    return header(number, len(encoded)) + encoded
