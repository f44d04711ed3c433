"""A model file's large inline weights left where they lie: in its one read-only mapping.

Parsed as a whole, a model with inline weights holds them twice (the file's bytes and
protobuf's copy of each ``raw_data``), and every copy of the model (the sharded one, the
checker's) holds them again. Instead the file is mapped (mapped_files.py) and its protobuf wire
format walked to where each main-graph initializer's ``raw_data`` lies (ModelProto field 7, the
graph; GraphProto field 5, an initializer; TensorProto field 9, raw_data, onnx.proto). The model
is parsed from a copy of the file without those bytes, in which each such tensor says instead
that its data is external, in the model file itself, at its offset (the ONNX external-data
format allows it). Every reader of external weights then reads them from the same mapping
(runtime/weights.py lends them to onnxruntime); ``LentWeights`` reads them back where a value is
needed (a causal mask) or the model is written whole again (shard).

Only weights of INLINE_SHARED_BYTES and more, of a type numpy computes with, their size that of
their dims, are left in the file; smaller ones (shapes, scalars) stay inline. A file whose wire
format this walk does not follow (a corrupt or truncated one) is parsed as before, and refused
with the parse's message.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardcheck.graph import protos
from shardcheck.graph.mapped_files import map_model_file, mapped

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


@dataclass(frozen=True)
class LentWeights:
    """The inline weights of a model file left in its mapping: name -> (start, end) of the
    bytes of each in the file (resolved), which the parsed model marks external."""

    file: Path
    mapping: mmap.mmap  # held: it is the mapping every reader of the weights shares
    spans: dict[str, tuple[int, int]]

    def lends(self, tensor: onnx.TensorProto) -> bool:
        """Whether ``tensor`` is one of these weights, as the parsed model has it."""
        return tensor.data_location == _T.EXTERNAL and tensor.name in self.spans

    def data(self, name: str, source: str) -> memoryview:
        """The bytes of weight ``name``, from the mapping; a model file that has changed
        since it was parsed is refused (InputError, ``source`` names the model)."""
        start, end = self.spans[name]
        return memoryview(mapped(self.file, end, name, source))[start:end]

    def inlined(self, model: onnx.ModelProto, source: str) -> None:
        """Put these weights back inside ``model`` (a copy of the parsed one: the sharded
        model), as the file has them."""
        for tensor in model.graph.initializer:
            if self.lends(tensor):
                _restore(tensor, self.data(tensor.name, source))


def parse_lending(file: Path) -> tuple[onnx.ModelProto, LentWeights] | None:
    """The model in the protobuf file ``file`` parsed with its large inline weights left in
    the file's mapping, and those weights; None when it has none (or the walk cannot follow
    its wire format): the caller reads and parses the file as usual. A DecodeError of the
    parse is raised as for the whole file."""
    resolved = file.resolve()
    mapping = map_model_file(resolved, INLINE_SHARED_BYTES)
    if mapping is None:
        return None
    stripping = _Stripping(mapping, resolved.name)
    try:
        content = stripping.model()
    except _NotFollowed:
        return None
    if content is None:
        return None
    spans = stripping.spans
    model = protos.ModelProto()
    model.ParseFromString(content)
    for tensor in model.graph.initializer:
        span = spans.get(tensor.name)
        if span is not None and not _lendable(tensor, span[1] - span[0]):
            # Left as the file has it: its size or type is for the checker to judge.
            _restore(tensor, memoryview(mapping)[span[0] : span[1]])
            del spans[tensor.name]
    if not spans:
        return None
    return model, LentWeights(resolved, mapping, spans)


def _lendable(tensor: onnx.TensorProto, length: int) -> bool:
    itemsize = ITEMSIZES.get(tensor.data_type)
    if itemsize is None or any(d < 0 for d in tensor.dims):
        return False
    return math.prod(tensor.dims) * itemsize == length


def _restore(tensor: onnx.TensorProto, data: memoryview) -> None:
    tensor.ClearField("external_data")
    tensor.ClearField("data_location")
    tensor.raw_data = bytes(data)


class _Stripping:
    """The serialized model in ``data`` (the mapping: indexing it reads a byte fastest) without
    the large initializers' raw_data, each marked external at its place in the file named
    ``location``; ``spans``: those places by name."""

    def __init__(self, data: mmap.mmap, location: str) -> None:
        self.data = data
        self.view = memoryview(data)  # slices of it are not copies
        self.location = location
        self.spans: dict[str, tuple[int, int]] = {}

    def model(self) -> bytes | None:
        """The model's bytes so stripped; None when no initializer is large."""
        data, view = self.data, self.view
        pieces: list[bytes | memoryview] = []
        copied = 0  # data[:copied] is in pieces
        at, end = 0, len(data)
        while at < end:
            number, kind, start, value_start, at = _field(data, at, end)
            if number != _GRAPH or kind != _LENGTH_DELIMITED:
                continue
            graph = self._graph(value_start, at)
            if graph is not None:
                _splice(pieces, view[copied:start], _GRAPH, graph)
                copied = at
        if not self.spans:
            return None
        pieces.append(view[copied:])
        return b"".join(pieces)

    def _graph(self, start: int, end: int) -> list[bytes | memoryview] | None:
        data, view = self.data, self.view
        pieces: list[bytes | memoryview] = []
        copied = start
        at = start
        while at < end:
            at = _past_nodes(data, at, end)
            if at >= end:
                break
            number, kind, field_start, value_start, at = _field(data, at, end)
            # A tensor smaller than INLINE_SHARED_BYTES is not looked into.
            if number != _INITIALIZER or kind != _LENGTH_DELIMITED:
                continue
            if at - value_start < INLINE_SHARED_BYTES:
                continue
            tensor = self._tensor(value_start, at)
            if tensor is not None:
                _splice(pieces, view[copied:field_start], _INITIALIZER, tensor)
                copied = at
        if copied == start:
            return None
        pieces.append(view[copied:end])
        return pieces

    def _tensor(self, start: int, end: int) -> list[bytes | memoryview] | None:
        """The TensorProto ``data[start:end]`` without its raw_data, marked external at its
        place in the file, when it is large and stored in raw_data alone; else None."""
        data, view = self.data, self.view
        name = None
        raw: list[tuple[int, int, int]] = []  # (field start, value start, end) of each raw_data
        at = start
        while at < end:
            number, _, field_start, value_start, at = _field(data, at, end)
            if number == _RAW_DATA:
                raw.append((field_start, value_start, at))
            elif number == _NAME:
                name = bytes(view[value_start:at])
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
        pieces: list[bytes | memoryview] = []
        copied = start
        for field_start, _, field_end in raw:
            pieces.append(view[copied:field_start])
            copied = field_end
        pieces.append(view[copied:end])
        for key, value in (
            ("location", self.location),
            ("offset", str(value_start)),
            ("length", str(value_end - value_start)),
        ):
            entry = _string(_KEY, key) + _string(_VALUE, value)
            pieces.append(_header(_EXTERNAL_DATA, len(entry)) + entry)
        pieces.append(_varint_bytes(_DATA_LOCATION << 3) + _varint_bytes(_T.EXTERNAL))
        return pieces


def _splice(
    pieces: list[bytes | memoryview],
    before: memoryview,
    number: int,
    message: list[bytes | memoryview],
) -> None:
    """Append to ``pieces`` the bytes ``before`` a field, then the field ``number`` holding
    ``message`` (its pieces) in place of the one the file has."""
    pieces.append(before)
    pieces.append(_header(number, sum(len(p) for p in message)))
    pieces.extend(message)


# GraphProto.node's tag: field 1, length-delimited.
_NODE_TAG = 1 << 3 | _LENGTH_DELIMITED


def _past_nodes(data: mmap.mmap, at: int, end: int) -> int:
    """Where the run of node fields from ``at`` ends: the walk over them is most of what the
    scan costs (one field a node), so their lengths (of one to three bytes) are read here
    without a call."""
    try:
        while at < end and data[at] == _NODE_TAG:
            first = data[at + 1]
            if first < 0x80:
                at += 2 + first
                continue
            second = data[at + 2]
            if second < 0x80:
                at += 3 + (first & 0x7F | second << 7)
                continue
            third = data[at + 3]
            if third >= 0x80:
                return at  # a node of 2 MiB or more: _field reads it
            at += 4 + (first & 0x7F | (second & 0x7F) << 7 | third << 14)
    except IndexError:
        raise _NotFollowed() from None
    if at > end:
        raise _NotFollowed()
    return at


def _field(data: mmap.mmap, at: int, end: int) -> tuple[int, int, int, int, int]:
    """The field at ``at`` of a message that ends at ``end``: (number, wire type, start of
    the field, start of its value, end of the field)."""
    start = at
    try:
        tag, at = _varint(data, at)
        kind = tag & 7
        if kind == _LENGTH_DELIMITED:
            length, at = _varint(data, at)
            value_end = at + length
        elif kind == 0:
            _, value_end = _varint(data, at)
        elif kind == 1:
            value_end = at + 8
        elif kind == 5:
            value_end = at + 4
        else:  # groups (deprecated, not in onnx.proto) and invalid wire types
            raise _NotFollowed()
    except IndexError:
        raise _NotFollowed() from None
    if value_end > end:
        raise _NotFollowed()
    return tag >> 3, kind, start, at, value_end


def _varint(data: mmap.mmap, at: int) -> tuple[int, int]:
    byte = data[at]
    if byte < 0x80:
        return byte, at + 1
    value, shift = byte & 0x7F, 7
    while True:
        at += 1
        byte = data[at]
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
