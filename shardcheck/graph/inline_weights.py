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
from shardcheck.graph.wire import (
    LENGTH_DELIMITED,
    Elsewhere,
    NotFollowed,
    Piece,
    Walk,
    field,
    header,
    length,
    rewritten,
    string_field,
    varint_bytes,
)

if TYPE_CHECKING:
    import onnx

# Inline weights at least this large are left in the model file; smaller ones (shapes,
# scalars) stay in the parsed model.
INLINE_SHARED_BYTES = 1 << 20
# Field numbers of onnx.proto.
_NAME, _RAW_DATA, _EXTERNAL_DATA, _DATA_LOCATION, _SEGMENT = 8, 9, 13, 14, 3  # TensorProto
# TensorProto's other value fields: float_data, int32_data, string_data, int64_data,
# double_data, uint64_data. A tensor with one of them beside raw_data stays as it is.
_OTHER_VALUES = frozenset((4, 5, 6, 7, 10, 11))
_KEY, _VALUE = 1, 2  # StringStringEntryProto
_COPIED_AT_ONCE = 1 << 24  # what shard reads of a weight at once to write it
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

    def write_inlined(self, serialized: bytes, stream: BinaryIO, source: str) -> None:
        """Write to ``stream`` the serialized model ``serialized`` (a copy of the parsed one:
        the sharded model) with these weights back inside it, as the file has them: the bytes
        its serialization would have with them, without a copy of them in memory."""
        walk = Walk(lambda size, at: serialized[at : at + size], len(serialized))
        pieces = rewritten(walk, lambda start, end: _inlined(walk, start, end, self.spans))
        if pieces is None:
            stream.write(serialized)
            return
        view = memoryview(serialized)
        name, (_, last) = max(self.spans.items(), key=lambda item: item[1][1])
        descriptor, _ = checked_open(self.file, last, name, source)
        try:
            for piece in pieces:
                if isinstance(piece, Elsewhere):
                    self._copy(descriptor, piece, stream, source)
                elif isinstance(piece, bytes):
                    stream.write(piece)
                else:
                    stream.write(view[piece[0] : piece[1]])
        finally:
            os.close(descriptor)

    def _copy(self, descriptor: int, piece: Elsewhere, stream: BinaryIO, source: str) -> None:
        at = piece.start
        while at < piece.end:
            data = os.pread(descriptor, min(_COPIED_AT_ONCE, piece.end - at), at)
            if not data:  # cut short since the check
                raise InputError(f"{source}: the model file {self.file.name!r} changed while read")
            stream.write(data)
            at += len(data)


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
            descriptor = stream.fileno()
            walk = Walk(lambda size, at: os.pread(descriptor, size, at), status.st_size)
            spans: dict[str, tuple[int, int]] = {}
            pieces = rewritten(
                walk, lambda start, end: _stripped(walk, start, end, resolved.name, spans)
            )
            if pieces is None:
                return None
            content = _joined(stream, pieces)
            if identity(os.fstat(descriptor)) != before:
                return None
            model = protos.ModelProto()
            model.ParseFromString(memoryview(content))
            for tensor in model.graph.initializer:
                span = spans.get(tensor.name)
                if span is not None and not _lendable(tensor, span[1] - span[0]):
                    # Left as the file has it: its size or type is for the checker to judge.
                    _restore(tensor, walk.read(*span))
                    del spans[tensor.name]
    except (OSError, NotFollowed):
        return None
    if not spans:
        return None
    lent = LentWeights(resolved, before, spans)
    remember_lending(resolved, before, lent)
    return model, lent


def _lendable(tensor: onnx.TensorProto, size: int) -> bool:
    itemsize = ITEMSIZES.get(tensor.data_type)
    if itemsize is None or any(d < 0 for d in tensor.dims):
        return False
    return math.prod(tensor.dims) * itemsize == size


def _restore(tensor: onnx.TensorProto, data: bytes) -> None:
    tensor.ClearField("external_data")
    tensor.ClearField("data_location")
    tensor.raw_data = data


def _joined(stream: BinaryIO, pieces: list[Piece]) -> bytearray:
    """The pieces of the file ``stream`` and the bytes written anew, in one buffer."""
    joined = bytearray(sum(length(piece) for piece in pieces))
    view = memoryview(joined)
    at = 0
    for piece in pieces:
        size = length(piece)
        if isinstance(piece, bytes):
            view[at : at + size] = piece
        else:
            stream.seek(piece[0])
            filled = 0
            while filled < size:
                got = stream.readinto(view[at + filled : at + size])
                if not got:
                    raise NotFollowed()  # cut short while it is read
                filled += got
        at += size
    return joined


def _stripped(
    walk: Walk, start: int, end: int, location: str, spans: dict[str, tuple[int, int]]
) -> list[Piece] | None:
    """The TensorProto whose fields are at ``start:end`` of the file without its raw_data,
    marked external at its place in the file named ``location`` (added to ``spans``), when
    it is large and stored in raw_data alone; else None. A smaller one is not looked into."""
    if end - start < INLINE_SHARED_BYTES:
        return None
    name = None
    raw: list[tuple[int, int, int]] = []  # (field start, value start, end) of each raw_data
    at = start
    while at < end:
        number, _, field_start, value_start, at = field(walk, at, end)
        if number == _RAW_DATA:
            raw.append((field_start, value_start, at))
        elif number == _NAME:
            name = walk.read(value_start, at)
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
    if decoded in spans:  # a name given twice: the checker refuses the model
        raise NotFollowed()
    spans[decoded] = (value_start, value_end)
    pieces: list[Piece] = []
    copied = start
    for field_start, _, field_end in raw:
        pieces.append((copied, field_start))
        copied = field_end
    pieces.append((copied, end))
    for key, value in (
        ("location", location),
        ("offset", str(value_start)),
        ("length", str(value_end - value_start)),
    ):
        entry = string_field(_KEY, key) + string_field(_VALUE, value)
        pieces.append(header(_EXTERNAL_DATA, len(entry)) + entry)
    pieces.append(varint_bytes(_DATA_LOCATION << 3) + varint_bytes(_T.EXTERNAL))
    return pieces


def _inlined(
    walk: Walk, start: int, end: int, spans: dict[str, tuple[int, int]]
) -> list[Piece] | None:
    """The TensorProto whose fields are at ``start:end`` of a serialized model, when it is
    one of the weights at ``spans`` that ``_stripped`` marked external: with its raw data
    from the model file (Elsewhere) in place of the external-data fields. Serialized, a
    message's fields come in the order of their numbers: raw_data goes after the fields
    numbered below its own."""
    fields: list[tuple[int, int, int]] = []  # (number, start, end)
    name = None
    external = False
    at = start
    while at < end:
        number, kind, field_start, value_start, at = field(walk, at, end)
        if number == _NAME and kind == LENGTH_DELIMITED:
            name = walk.read(value_start, at)
        elif number == _DATA_LOCATION and kind == 0:
            external = walk.byte(value_start) == _T.EXTERNAL
        fields.append((number, field_start, at))
    span = spans.get(name.decode("utf-8", "replace")) if name is not None else None
    if not external or span is None:
        return None
    pieces: list[Piece] = [(s, e) for number, s, e in fields if number < _RAW_DATA]
    pieces.append(header(_RAW_DATA, span[1] - span[0]))
    pieces.append(Elsewhere(*span))
    pieces.extend(
        (s, e)
        for number, s, e in fields
        if number > _RAW_DATA and number not in (_EXTERNAL_DATA, _DATA_LOCATION)
    )
    return pieces
