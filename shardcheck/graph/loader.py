"""Reading ONNX models without their weights, and refusing what cannot be used.

gen needs the graph, not the weights: external data files are never opened here, and need not
exist. Their locations are still checked, so that a model pointing outside its own directory is
refused before anything else (verify or shard) would follow the path: the initializers' when the
file is parsed, those in node attributes (a Constant's) by the walk over the nodes, made when
first needed (by the check, or when the external tensors are asked for).

A model file with large inline weights is parsed without them: they stay in the file's one
read-only mapping, and the parsed model marks them external, in the file itself
(inline_weights.py). Otherwise the file is read once: the bytes are parsed, and the same bytes
are given to ``onnx.checker``
(``check_model(model)`` would serialize the whole model, weights included, only for the checker
to parse it again). A model with external data is checked with each external tensor replaced by
an empty stand-in: the checker would otherwise look for the data file relative to the current
directory. Everything the checker says about an external tensor except that its file exists is
checked here instead (see ``_check_external_tensor``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from shardcheck.errors import InputError, ModelError
from shardcheck.fsio import nothing_read, why_unreadable
from shardcheck.graph import protos
from shardcheck.graph.index import GraphIndex
from shardcheck.graph.inline_weights import LentWeights, parse_lending
from shardcheck.graph.protos import full_onnx
from shardcheck.graph.tensors import (
    attribute_tensors,
    locations_of,
    model_tensors,
    node_tensors,
    sparse_as_dense,
)
from shardcheck.wording import shown

if TYPE_CHECKING:
    import onnx

_MISSING_SHAPE = "Field 'shape' of 'type' is required but missing"
_PROTOBUF = "protobuf"
# The value fields of a TensorProto; an external tensor must have none of them.
_VALUE_FIELDS = (
    "float_data",
    "int32_data",
    "string_data",
    "int64_data",
    "raw_data",
    "double_data",
    "uint64_data",
)
_TENSOR = protos.AttributeProto.TENSOR
_NESTED = frozenset(
    (protos.AttributeProto.TENSORS, protos.AttributeProto.GRAPH, protos.AttributeProto.GRAPHS)
)
_EXTERNAL = protos.TensorProto.EXTERNAL
# The longest file name and path the usual file systems take (Linux's NAME_MAX, PATH_MAX).
_NAME_MAX = 255
_PATH_MAX = 4096


def read_model(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Parse an ONNX file (weights in external files are not loaded) and validate it."""
    parsed = parse_model(path)
    parsed.check()
    return parsed.model


def weights_dir(path: str | os.PathLike[str]) -> Path:
    """Where a model's external weight files are: beside the file (links followed). Their
    locations are relative to it."""
    return Path(path).resolve().parent


def check_weight_files(index: GraphIndex, path: str | os.PathLike[str]) -> None:
    """Refuse (InputError) a model whose external weight files are missing or too short for
    the tensors they hold, before onnxruntime is asked to read them or shard writes a model
    that refers to them; gen never calls this. The files are looked at, not read."""
    base = weights_dir(path)
    sizes: dict[str, int | None] = {}  # location -> its file's size (None: not a file)
    lent = index.lent_weights
    for tensor in index.external_tensors():
        if lent is not None and lent.lends(tensor):
            continue  # in the model file itself, checked as it is read (mapped_files.py)
        entries = {entry.key: entry.value for entry in tensor.external_data}
        location = entries.get("location", "")
        if location not in sizes:
            file = base / location
            sizes[location] = file.stat().st_size if file.is_file() else None
        size = sizes[location]
        if size is None:
            raise InputError(
                f"{path}: external weight file {location!r} of tensor {tensor.name!r} is "
                f"missing (looked for {base / location})"
            )
        try:
            offset = int(entries.get("offset") or 0)
            length = int(entries["length"]) if entries.get("length") else size - offset
        except ValueError:
            raise InputError(
                f"{path}: tensor {tensor.name!r}: external data offset or length is not a number"
            ) from None
        if offset < 0 or length < 0 or offset + length > size:
            raise InputError(
                f"{path}: tensor {tensor.name!r} needs bytes {offset} to {offset + length} of "
                f"{location!r}, which has {size}: the weight file is incomplete"
            )


def load_index(path: str | os.PathLike[str]) -> GraphIndex:
    parsed = parse_model(path)
    parsed.check()
    return index_parsed(parsed)


def index_parsed(parsed: ParsedModel) -> GraphIndex:
    """The index of a parsed model, with the external weight files the parse finds (looked
    for when first asked)."""
    return GraphIndex(
        parsed.model,
        source=parsed.source,
        external_tensors=parsed.external_tensors,
        lent_weights=parsed.lent_weights,
    )


class ParsedModel:
    """A model read and parsed, whose ``onnx.checker`` validation is still to run (``check``).

    verify hands the model to onnxruntime first, and runs the checker while onnxruntime loads
    it (the checker holds the GIL for its whole run, onnxruntime only now and then). Everything
    else ``read_model`` refuses (unreadable files, external data outside the model's
    directory) is refused here.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        source: str,
        file: Path,
        content: bytes | None,
        initializers: _InitializerScan,
        lent_weights: LentWeights | None = None,
    ) -> None:
        self.model = model
        # The large inline weights the model marks external, left in the file's mapping.
        self.lent_weights = lent_weights
        self.source = source
        self._file = file
        self._content = content
        self._initializers = initializers
        self._scan: _Scan | None = None
        self._locations: set[str] | None = None
        self._no_location: bool | None = None
        self._checked = False

    @property
    def serialized(self) -> bytes | None:
        """The file's bytes, when they are the model's protobuf with every weight inside (for
        the checker and onnxruntime, which take bytes)."""
        if self._content is None or self.external_tensors():
            return None
        return self._content

    def _full_scan(self) -> _Scan:
        """The external initializers, found by the parse, and the walk over the nodes (their
        names, the tensors in their attributes), made when first needed: gen has the checker's
        child make it (see concurrent_check), beside the analysis. External tensors in
        attributes are refused here as initializers are by the parse."""
        if self._scan is None:
            if self._spells_no_location():  # no tensor can be external: the names only
                names = [node.name for node in self.model.graph.node]
                duplicates, in_nodes = _duplicate_names(names), []
            else:
                duplicates, in_nodes = _scan_nodes(self.model)
            _check_external_tensors(in_nodes, self._file, "tensor in a node attribute")
            initializers = self._initializers
            self._scan = _Scan(
                duplicates,
                [*initializers.external, *in_nodes],
                None if in_nodes else initializers.positions,
            )
        return self._scan

    def external_tensors(self) -> list[onnx.TensorProto]:
        """The model's tensors whose data is in external files."""
        if self._scan is None and self._spells_no_location():
            return []
        return self._full_scan().external

    def _spells_no_location(self) -> bool:
        """Whether the file's bytes, read into memory (verify's, which onnxruntime is given),
        never spell "location", the key every external tensor needs, and no initializer is
        external: then no tensor in an attribute is either, known without the walk over the
        nodes, which verify's path to onnxruntime would wait for (the search of the bytes
        costs less than the walk)."""
        if self._no_location is None:
            content = self._content
            self._no_location = (
                isinstance(content, bytes)
                and not self._initializers.external
                and b"location" not in content
            )
        return self._no_location

    def external_locations(self) -> set[str]:
        """The files that hold the model's external tensors."""
        if self._locations is None:
            self._locations = locations_of(self.external_tensors())
        return self._locations

    def initializer_locations(self) -> set[str]:
        """The files that hold the model's external initializers (the parse found them)."""
        return locations_of(self._initializers.external)

    def mark_checked(self, external_locations: set[str]) -> None:
        """The checks of ``check`` passed elsewhere (in a child process), which found the
        model's external tensors in these files."""
        self._checked = True
        self._locations = external_locations

    def check(self) -> None:
        """``onnx.checker``, the unique node names and the locations of external tensors in
        attributes (ModelError); once."""
        if self._checked:
            return
        scan = self._full_scan()
        _check_model(self.model, self.source, self.serialized, scan=scan)
        _refuse_duplicate_names(scan.duplicate_names, self.source)
        self._checked = True


def parse_model(path: str | os.PathLike[str]) -> ParsedModel:
    """Read and parse an ONNX file as ``read_model`` does, but for ``ParsedModel.check``."""
    file = Path(path)
    source = str(path)
    if not source:  # Path("") is the current directory
        raise ModelError("'': the model path is empty")
    problem = why_unreadable(file, "an ONNX model file")
    if problem:
        raise ModelError(f"{source}: {problem}")
    content: bytes | None = None
    lent: LentWeights | None = None
    try:
        # A protobuf file with large inline weights is mapped, and its weights are read from
        # the mapping (see inline_weights.py); the mapping is made only after its size is
        # known, but one truncated while mapped kills the process (SIGBUS), as an external
        # weight file does.
        lending = parse_lending(file) if file.suffix == ".onnx" else None
        if lending is not None:
            model_format, (model, lent) = _PROTOBUF, lending
        else:
            # Read: a file read is whatever it held when read. A pipe (``<(...)``) is read to
            # its end.
            content = file.read_bytes()
            if not content:
                raise ModelError(f"{source}: {nothing_read(file, 'an ONNX model')}")
            model_format, model = _deserialize(file, content)
    except ModelError:
        raise
    except PermissionError:
        raise ModelError(f"{source}: permission denied") from None
    except (DecodeError, ValueError, RuntimeError, OSError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        detail = detail if len(detail) <= 200 else detail[:197] + "..."
        raise ModelError(
            f"{source}: not a readable ONNX model (protobuf parse failed: {detail})"
        ) from None
    if not model.HasField("graph") or model.ir_version <= 0:
        raise ModelError(f"{source}: not an ONNX model (the protobuf has no graph or IR version)")
    _densify_sparse_initializers(model)
    initializers = _scan_initializers(model)
    _check_external_tensors(initializers.external, file)
    # The bytes are kept for the checker and onnxruntime only if they are all the model is.
    kept = content if model_format == _PROTOBUF and not initializers.external else None
    return ParsedModel(model, source, file, kept, initializers, lent)


def _densify_sparse_initializers(model: onnx.ModelProto) -> None:
    """Make the main graph's sparse initializers (a pruned projection weight) initializers like
    the others, so that every stage sees them as weights: the index (their shapes), the
    simulation's stages, the shard. One whose values are external stays as it is."""
    graph = model.graph
    if not graph.sparse_initializer:
        return
    kept = []
    for sparse in graph.sparse_initializer:
        dense = sparse_as_dense(sparse)
        if dense is None:
            kept.append(sparse)
        else:
            graph.initializer.append(dense)
    del graph.sparse_initializer[:]
    graph.sparse_initializer.extend(kept)


def _deserialize(file: Path, content: bytes) -> tuple[str, onnx.ModelProto]:
    """The model, read as ``onnx.load`` reads it: in the format its extension names."""
    if file.suffix == ".onnx":  # the usual case: protobuf, without importing the onnx package
        model = protos.ModelProto()
        with memoryview(content) as view:
            # The message copies what it keeps: the mapping can be closed afterwards.
            decoded = model.ParseFromString(view)
        if decoded is not None and decoded != len(content):
            raise DecodeError(f"consumed {decoded} of {len(content)} bytes")
        return _PROTOBUF, model
    onnx = full_onnx()
    from google.protobuf import json_format, text_format
    from onnx import serialization

    model_format = serialization.registry.get_format_from_file_extension(file.suffix)
    model_format = model_format or _PROTOBUF
    try:
        model = serialization.registry.get(model_format).deserialize_proto(
            content, protos.ModelProto()
        )
    # A file named *.json, *.textproto or *.onnxtxt is read in that text format, as onnx.load
    # does; hints.json given as the model lands here.
    except (json_format.ParseError, text_format.ParseError, onnx.parser.ParseError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None
    return model_format, model


@dataclass(frozen=True)
class _InitializerScan:
    # The external initializers, and their positions in graph.initializer.
    external: list[onnx.TensorProto]
    positions: tuple[int, ...]


@dataclass(frozen=True)
class _Scan:
    duplicate_names: set[str]
    # The external tensors, in ``graph.model_tensors`` order.
    external: list[onnx.TensorProto]
    # Their positions in graph.initializer, when they are all main-graph initializers (the
    # usual case): the checker's copy is then patched by position, without another walk.
    initializer_positions: tuple[int, ...] | None


def _scan_initializers(model: onnx.ModelProto) -> _InitializerScan:
    initializers = model.graph.initializer
    positions = tuple(
        i for i, tensor in enumerate(initializers) if tensor.data_location == _EXTERNAL
    )
    return _InitializerScan([initializers[i] for i in positions], positions)


def _duplicate_names(names: list[str]) -> set[str]:
    """The node names given more than once ("" is no name)."""
    named = set(names)
    named.discard("")
    if len(named) == len(names) - names.count(""):
        return set()
    seen: set[str] = set()
    duplicates: set[str] = set()
    for name in names:
        if name in seen:
            duplicates.add(name)
        elif name:
            seen.add(name)
    return duplicates


def _scan_nodes(model: onnx.ModelProto) -> tuple[set[str], list[onnx.TensorProto]]:
    """The walk over the main graph's nodes: duplicate node names, and the external tensors
    in attributes (then in functions)."""
    names: list[str] = []
    external: list[onnx.TensorProto] = []
    for node in model.graph.node:
        names.append(node.name)
        for attribute in node.attribute:
            kind = attribute.type
            if kind == _TENSOR:
                if attribute.t.data_location == _EXTERNAL:
                    external.append(attribute.t)
            elif kind in _NESTED:
                external.extend(
                    t for t in attribute_tensors(attribute) if t.data_location == _EXTERNAL
                )
    for function in model.functions:
        external.extend(t for t in node_tensors(function.node) if t.data_location == _EXTERNAL)
    return _duplicate_names(names), external


def _check_external_tensors(
    external: list[onnx.TensorProto], file: Path, kind: str = "initializer"
) -> None:
    if not external:
        return
    base = weights_dir(file)
    inside: dict[str, bool] = {}  # location -> inside the model's directory
    for tensor in external:
        _check_external_tensor(tensor, file, base, inside, kind)


def _check_external_tensor(
    tensor: onnx.TensorProto, file: Path, base: Path, inside: dict[str, bool], kind: str
) -> None:
    """What ``onnx.checker`` checks of an external tensor, but the existence of its file."""
    for name in _VALUE_FIELDS:
        if len(getattr(tensor, name)):
            raise ModelError(
                f"{file}: fails onnx.checker: Data of TensorProto ( tensor name: {tensor.name}) "
                f"is stored externally and should not have data field.{name}"
            )
    location = next((e.value for e in tensor.external_data if e.key == "location"), None)
    if not location:
        raise ModelError(f"{file}: {kind} {tensor.name!r}: external data has no location")
    if location not in inside:
        unusable = _unusable_location(location)
        if unusable:
            raise ModelError(
                f"{file}: {kind} {tensor.name!r}: external data location {shown(location)} "
                f"{unusable}; refused"
            )
        inside[location] = not (
            Path(location).is_absolute()
            or ".." in os.path.normpath(location)
            or not (base / location).resolve().is_relative_to(base)
        )
    if not inside[location]:
        raise ModelError(
            f"{file}: {kind} {tensor.name!r}: external data location {location!r} is "
            "outside the model's directory; refused"
        )


def _unusable_location(location: str) -> str | None:
    """Why an external data location cannot name a file at all, or None."""
    if "\0" in location:
        return "holds a NUL byte"
    parts = os.fsencode(location).split(b"/")
    if len(os.fsencode(location)) >= _PATH_MAX or any(len(p) > _NAME_MAX for p in parts):
        return "is too long to be a file name"
    return None


def _copy_for_checker(model: onnx.ModelProto, scan: _Scan | None) -> onnx.ModelProto:
    """A copy in which every external tensor is an empty tensor of the same name and type."""
    copy = protos.ModelProto()
    copy.CopyFrom(model)
    if scan is None or not scan.external:
        return copy
    if scan.initializer_positions is not None:
        initializers = copy.graph.initializer
        external = [initializers[i] for i in scan.initializer_positions]
    else:
        external = [t for t in model_tensors(copy) if t.data_location == _EXTERNAL]
    for tensor in external:
        tensor.ClearField("external_data")
        tensor.ClearField("data_location")
        del tensor.dims[:]
        tensor.dims.append(0)
    return copy


def _check_model(
    model: onnx.ModelProto,
    source: str,
    serialized: bytes | None = None,
    *,
    scan: _Scan | None = None,
) -> None:
    """``onnx.checker.check_model``; ``serialized``, when given, must be the model's bytes."""
    if scan is not None and scan.external:
        checked: onnx.ModelProto | bytes = _copy_for_checker(model, scan)
    else:
        checked = serialized if serialized is not None else model
    checker = protos.checker()
    try:
        _run_checker(checked)
    except checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid model"
        # Polygraphy's own test models declare inputs without shapes; newer checkers reject
        # that, although every consumer of the model accepts it. Only that one rule is waived.
        if _MISSING_SHAPE in first and _passes_with_shapes(model, scan):
            return
        raise ModelError(f"{source}: fails onnx.checker: {first}") from None
    except (ValueError, RuntimeError) as exc:
        raise ModelError(f"{source}: fails onnx.checker: {exc}") from None


def _run_checker(model: onnx.ModelProto | bytes) -> None:
    """What ``onnx.checker.check_model(model)`` runs, with its default options, without
    importing the onnx package for it (see protos.checker)."""
    content = model if isinstance(model, bytes) else model.SerializeToString()
    if len(content) > protos.MAX_CHECKED_BYTES:
        raise ValueError("the model is over 2 GiB serialized; keep its weights in external data")
    protos.checker().check_model(content, False, False, False)


def _passes_with_shapes(model: onnx.ModelProto, scan: _Scan | None) -> bool:
    copy = _copy_for_checker(model, scan)
    graph = copy.graph
    for info in (*graph.input, *graph.output, *graph.value_info):
        tensor_type = info.type.tensor_type
        if info.type.HasField("tensor_type") and not tensor_type.HasField("shape"):
            tensor_type.shape.SetInParent()
    try:
        _run_checker(copy)
    except (protos.checker().ValidationError, ValueError, RuntimeError):
        return False
    return True


def _refuse_duplicate_names(duplicates: set[str], source: str) -> None:
    if duplicates:
        ordered = sorted(duplicates)
        shown = ", ".join(repr(d) for d in ordered[:5])
        more = f" and {len(ordered) - 5} more" if len(ordered) > 5 else ""
        raise ModelError(
            f"{source}: duplicate node names {shown}{more}; node names must be unique "
            "(Polygraphy's shard tools abort on them too)"
        )
