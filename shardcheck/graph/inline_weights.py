"""A model file's large inline weights left where they lie: in the file, read from there.

Parsed as a whole, a model with inline weights holds them twice (the file's bytes and
protobuf's copy of each ``raw_data``), and every copy of the model (the sharded one, the
checker's) holds them again. Instead the file's protobuf wire format is walked to where each
main-graph initializer's ``raw_data`` lies (ModelProto field 7, the graph; GraphProto field 5,
an initializer; TensorProto field 9, raw_data, onnx.proto), and the model is parsed from a copy
of the file without those bytes, in which each such tensor says instead that its data is
external, in the model file itself, at its offset (the ONNX external-data format allows it).
Every reader of external weights then reads them from the file's one mapping
(runtime/weights.py lends them to onnxruntime); ``LentWeights`` reads them back where a value is
needed (a causal mask) or the model is written whole again (shard).

The walk and the copy read the file, they do not map it: a file cut short while they read it
gives short reads (the file is then read and parsed as before, and refused with the parse's
message), where a mapping would kill the process with SIGBUS. Only onnxruntime's runs read the
weights through the mapping, as they read an external weight file's.

Only weights of INLINE_SHARED_BYTES and more, of a type numpy computes with, their size that of
their dims, are left in the file; smaller ones (shapes, scalars) stay inline.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from shardcheck.errors import InputError
from shardcheck.graph import protos
from shardcheck.graph.mapped_files import (
    Identity,
    checked_open,
    identity,
    may_lend,
    remember_lending,
)

if TYPE_CHECKING:
    import onnx

# Inline weights at least this large are left in the model file; smaller ones (shapes,
# scalars) stay in the parsed model.
INLINE_SHARED_BYTES = 1 << 20
# Field numbers of onnx.proto.
_GRAPH = 7  # ModelProto.graph
_INITIALIZER = 5  # GraphProto.initializer
_NAME, _RAW_DATA, _EXTERNAL_DATA, _DATA_LOCATION, _SEGMENT = 8, 9, 13, 14, 3  # TensorProto
# TensorProto's other value fields: float_data, int32_data, string_data, int64_data,
# double_data, uint64_data. A tensor with one of them beside raw_data stays as it is.
_OTHER_VALUES = frozenset((4, 5, 6, 7, 10, 11))
_KEY, _VALUE = 1, 2  # StringStringEntryProto
_LENGTH_DELIMITED = 2
_T = protos.TensorProto
# The bytes per element of the types numpy computes with (runtime/weights.py's numpy_dtype
# lends exactly these): a weight of another type (bfloat16, the float8s) stays inline.
ITEMSIZES = {
    _T.FLOAT: 4,
    _T.UINT8: 1,
    _T.INT8: 1,
    _T.UINT16: 2,
    _T.INT16: 2,
    _T.INT32: 4,
    _T.INT64: 8,
    _T.BOOL: 1,
    _T.FLOAT16: 2,
    _T.DOUBLE: 8,
    _T.UINT32: 4,
    _T.UINT64: 8,
    _T.COMPLEX64: 8,
    _T.COMPLEX128: 16,
}


class _NotFollowed(Exception):
    """The wire format is not one this walk follows (the parse will say what is wrong)."""


@dataclass(frozen=True, eq=False)
class LentWeights:
    """The inline weights of a model file left in it: name -> (start, end) of the bytes of
    each in the file (resolved), which the parsed model marks external; ``parsed``: the file's
    identity when it was parsed."""

    file: Path
    parsed: Identity
    spans: dict[str, tuple[int, int]]

    def lends(self, tensor: onnx.TensorProto) -> bool:
        """Whether ``tensor`` is one of these weights, as the parsed model has it."""
        return tensor.data_location == _T.EXTERNAL and tensor.name in self.spans

    def data(self, name: str, source: str) -> bytes:
        """The bytes of weight ``name``, read from the file; a model file that has changed
        since it was parsed is refused (InputError, ``source`` names the model)."""
        start, end = self.spans[name]
        descriptor, _ = checked_open(self.file, end, name, source)
        try:
            data = os.pread(descriptor, end - start, start)
        finally:
            os.close(descriptor)
        if len(data) != end - start:  # cut short since the check
            raise InputError(f"{source}: the model file {self.file.name!r} changed while read")
        return data

    def inlined(self, model: onnx.ModelProto, source: str) -> None:
        """Put these weights back inside ``model`` (a copy of the parsed one: the sharded
        model), as the file has them."""
        for tensor in model.graph.initializer:
            if self.lends(tensor):
                _restore(tensor, self.data(tensor.name, source))


def parse_lending(file: Path) -> tuple[onnx.ModelProto, LentWeights] | None:
    """The model in the protobuf file ``file`` parsed with its large inline weights left in
    the file, and those weights; None when it has none, or the walk cannot follow its wire
    format, or the file changes while it is read: the caller reads and parses the file as
    usual. A DecodeError of the parse is raised as for the whole file."""
    resolved = file.resolve()
    try:
        # Looked at before it is opened: a named pipe opened and closed unread ends its writer.
        if not stat.S_ISREG(os.stat(resolved).st_mode):
            return None
        with open(resolved, "rb", buffering=0) as stream:
            status = os.fstat(stream.fileno())
            before = identity(status)
            if not stat.S_ISREG(status.st_mode) or status.st_size < INLINE_SHARED_BYTES:
                return None
            if not may_lend(resolved, before):
                return None
            walk = _Walk(stream, status.st_size, resolved.name)
            content = walk.stripped()
            if content is None or identity(os.fstat(stream.fileno())) != before:
                return None
            spans = walk.spans
            model = protos.ModelProto()
            model.ParseFromString(memoryview(content))
            for tensor in model.graph.initializer:
                span = spans.get(tensor.name)
                if span is not None and not _lendable(tensor, span[1] - span[0]):
                    # Left as the file has it: its size or type is for the checker to judge.
                    _restore(tensor, walk.read(*span))
                    del spans[tensor.name]
    except (OSError, _NotFollowed):
        return None
    if not spans:
        return None
    lent = LentWeights(resolved, before, spans)
    remember_lending(resolved, before, lent)
    return model, lent


def _lendable(tensor: onnx.TensorProto, length: int) -> bool:
    itemsize = ITEMSIZES.get(tensor.data_type)
    if itemsize is None or any(d < 0 for d in tensor.dims):
        return False
    return math.prod(tensor.dims) * itemsize == length


def _restore(tensor: onnx.TensorProto, data: bytes) -> None:
    tensor.ClearField("external_data")
    tensor.ClearField("data_location")
    tensor.raw_data = data


# Pieces of the stripped model: a range of the file (start, end), or bytes written anew.
Piece = tuple[int, int] | bytes
# What the walk reads at once: a run of nodes is read in long blocks, a field among weights
# (which the walk jumps over) in short ones.
_BLOCK = 1 << 20
_SHORT_BLOCK = 1 << 16


class _Walk:
    """The walk over the serialized model in ``stream`` (``size`` bytes), read a block at a
    time, and the model without the large initializers' raw_data, each marked external at
    its place in the file named ``location``; ``spans``: those places by name."""

    def __init__(self, stream: BinaryIO, size: int, location: str) -> None:
        self.stream = stream
        self.size = size
        self.location = location
        self.spans: dict[str, tuple[int, int]] = {}
        self.block = b""
        self.block_start = 0

    def load(self, at: int, size: int = _BLOCK) -> tuple[bytes, int]:
        """The block of ``size`` bytes that starts at ``at`` (shorter at the end of the
        file)."""
        self.block = os.pread(self.stream.fileno(), size, at)
        self.block_start = at
        return self.block, at

    def byte(self, at: int) -> int:
        offset = at - self.block_start
        if not 0 <= offset < len(self.block):
            block, _ = self.load(at, _SHORT_BLOCK)
            if not block:
                raise _NotFollowed()
            offset = 0
        return self.block[offset]

    def read(self, start: int, end: int) -> bytes:
        data = os.pread(self.stream.fileno(), end - start, start)
        if len(data) != end - start:
            raise _NotFollowed()  # cut short while it is read
        return data

    def stripped(self) -> bytearray | None:
        """The model's bytes so stripped; None when no initializer is large."""
        pieces: list[Piece] = []
        copied = 0  # the file up to ``copied`` is in pieces
        at, end = 0, self.size
        while at < end:
            number, kind, start, value_start, at = _field(self, at, end)
            if number != _GRAPH or kind != _LENGTH_DELIMITED:
                continue
            graph = self._graph(value_start, at)
            if graph is not None:
                _splice(pieces, (copied, start), _GRAPH, graph)
                copied = at
        if not self.spans:
            return None
        pieces.append((copied, end))
        return self._joined(pieces)

    def _joined(self, pieces: list[Piece]) -> bytearray:
        joined = bytearray(sum(_length(piece) for piece in pieces))
        view = memoryview(joined)
        at = 0
        for piece in pieces:
            length = _length(piece)
            if isinstance(piece, bytes):
                view[at : at + length] = piece
            else:
                self.stream.seek(piece[0])
                filled = 0
                while filled < length:
                    got = self.stream.readinto(view[at + filled : at + length])
                    if not got:
                        raise _NotFollowed()  # cut short while it is read
                    filled += got
            at += length
        return joined

    def _graph(self, start: int, end: int) -> list[Piece] | None:
        pieces: list[Piece] = []
        copied = start
        at = start
        while at < end:
            at = _past_nodes(self, at, end)
            if at >= end:
                break
            number, kind, field_start, value_start, at = _field(self, at, end)
            # A tensor smaller than INLINE_SHARED_BYTES is not looked into.
            if number != _INITIALIZER or kind != _LENGTH_DELIMITED:
                continue
            if at - value_start < INLINE_SHARED_BYTES:
                continue
            tensor = self._tensor(value_start, at)
            if tensor is not None:
                _splice(pieces, (copied, field_start), _INITIALIZER, tensor)
                copied = at
        if copied == start:
            return None
        pieces.append((copied, end))
        return pieces

    def _tensor(self, start: int, end: int) -> list[Piece] | None:
        """The TensorProto at ``start:end`` of the file without its raw_data, marked external
        at its place in the file, when it is large and stored in raw_data alone; else None."""
        name = None
        raw: list[tuple[int, int, int]] = []  # (field start, value start, end) of each raw_data
        at = start
        while at < end:
            number, _, field_start, value_start, at = _field(self, at, end)
            if number == _RAW_DATA:
                raw.append((field_start, value_start, at))
            elif number == _NAME:
                name = self.read(value_start, at)
            elif number in _OTHER_VALUES or number in (_EXTERNAL_DATA, _DATA_LOCATION, _SEGMENT):
                return None
        if not raw or name is None:
            return None
        _, value_start, value_end = raw[-1]  # the last one counts, as for protobuf
        if value_end - value_start < INLINE_SHARED_BYTES:
            return None
        try:
            decoded = name.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if decoded in self.spans:  # a name given twice: the checker refuses the model
            raise _NotFollowed()
        self.spans[decoded] = (value_start, value_end)
        pieces: list[Piece] = []
        copied = start
        for field_start, _, field_end in raw:
            pieces.append((copied, field_start))
            copied = field_end
        pieces.append((copied, end))
        for key, value in (
            ("location", self.location),
            ("offset", str(value_start)),
            ("length", str(value_end - value_start)),
        ):
            entry = _string(_KEY, key) + _string(_VALUE, value)
            pieces.append(_header(_EXTERNAL_DATA, len(entry)) + entry)
        pieces.append(_varint_bytes(_DATA_LOCATION << 3) + _varint_bytes(_T.EXTERNAL))
        return pieces


def _length(piece: Piece) -> int:
    return len(piece) if isinstance(piece, bytes) else piece[1] - piece[0]


def _splice(
    pieces: list[Piece], before: tuple[int, int], number: int, message: list[Piece]
) -> None:
    """Append to ``pieces`` the range of the file ``before`` a field, then the field
    ``number`` holding ``message`` (its pieces) in place of the one the file has."""
    pieces.append(before)
    pieces.append(_header(number, sum(_length(p) for p in message)))
    pieces.extend(message)


# GraphProto.node's tag: field 1, length-delimited.
_NODE_TAG = 1 << 3 | _LENGTH_DELIMITED


def _past_nodes(walk: _Walk, at: int, end: int) -> int:
    """Where the run of node fields from ``at`` ends: the walk over them is most of what the
    scan costs (one field a node), so their lengths (of one to three bytes) are read from the
    block here without a call."""
    block, base = walk.block, walk.block_start
    while at < end:
        offset = at - base
        if offset < 0 or offset + 4 > len(block):
            block, base = walk.load(at)
            offset = 0
            if len(block) < 4:
                return at  # the file's last bytes: _field reads them
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
            return at  # a node of 2 MiB or more: _field reads it
        at += 4 + (first & 0x7F | (second & 0x7F) << 7 | third << 14)
    if at > end:
        raise _NotFollowed()
    return at


def _field(walk: _Walk, at: int, end: int) -> tuple[int, int, int, int, int]:
    """The field at ``at`` of a message that ends at ``end``: (number, wire type, start of
    the field, start of its value, end of the field)."""
    start = at
    tag, at = _varint(walk, at)
    kind = tag & 7
    if kind == _LENGTH_DELIMITED:
        length, at = _varint(walk, at)
        value_end = at + length
    elif kind == 0:
        _, value_end = _varint(walk, at)
    elif kind == 1:
        value_end = at + 8
    elif kind == 5:
        value_end = at + 4
    else:  # groups (deprecated, not in onnx.proto) and invalid wire types
        raise _NotFollowed()
    if value_end > end:
        raise _NotFollowed()
    return tag >> 3, kind, start, at, value_end


def _varint(walk: _Walk, at: int) -> tuple[int, int]:
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
            raise _NotFollowed()


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _header(number: int, length: int) -> bytes:
    return _varint_bytes(number << 3 | _LENGTH_DELIMITED) + _varint_bytes(length)


def _string(number: int, text: str) -> bytes:
    encoded = text.encode("utf-8")
    return _header(number, len(encoded)) + encoded
