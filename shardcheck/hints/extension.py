"""shardcheck's extension file: hints that the Polygraphy format cannot hold, beside the hints.

Polygraphy's ``multi-device shard`` rewires every consumer of a scattered tensor, its Shapes
too, and keeps every other Shape on what it reads: no node can read another length than its
tensor's other consumers do. Where that forces the cut deep into each layer (positions and
masks sized by a slice's length, head splits by a whole tensor's), gen also writes a plan that
``shardcheck shard`` carries out with each node given the length it needs
(``sharding/lengths.py``). It lives in its own file, ``HINTS.shardcheck.json`` beside
``HINTS.json`` by default, so that the hints file stays the Polygraphy-compatible one::

    {
        "shardcheck_extension": "lengths",
        "version": 1,
        "hints": {... a whole hints document, Polygraphy 0.53.6's format ...},
        "whole_length": ["node", ...],
        "rank_length": ["node", ...],
        "traced_length": ["node", ...],
        "gathered_for_output": ["tensor", ...],
        "gathered_for_readers": [{"name": "...", "seq_len_idx": 1, "nodes": ["node", ...]}, ...],
        "inlined_functions": [{"domain": "...", "name": "..."}, ...]
    }

``whole_length``: the nodes that compute with the whole length (they index data by positions
computed from a slice's length); ``rank_length``: the Reshapes and Expands of slices whose
target holds a whole length; ``traced_length`` (only where there are some): the Reshapes whose
target holds the length a TorchScript trace ran at (``sharding/traced.py``);
``gathered_for_output`` (only where there are some): the hinted outputs gathered for the graph
output alone, their other consumers left on the rank's slice (a hidden state or attention
probabilities given out beside the layers' compute); ``gathered_for_readers`` (only where
there are some): tensors of a layer's K or V before its gather, all-gathered along
``seq_len_idx`` for the nodes named alone, which read them beside the layer (DeBERTa's
position-to-content scores); ``inlined_functions`` (only where there
are some): the model-local functions the graph calls (its attention or its MLPs), inlined
into the graph before the hints are read, which name tensors of that graph
(``sharding/inlined.py``). What the hints scatter is computed with the whole length always.
The file is used only where it is named: every command that reads hints reads it too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardcheck.errors import HintsFormatError
from shardcheck.hints.codec import decode, dumps, encode, parse
from shardcheck.hints.model import LengthReads, ReaderGather, ShardHints
from shardcheck.wording import shown

TAG_KEY = "shardcheck_extension"
TAG = "lengths"
VERSION = 1
FOR_OUTPUT = "gathered_for_output"
FOR_READERS = "gathered_for_readers"
INLINED = "inlined_functions"
KEYS = (
    TAG_KEY,
    "version",
    "hints",
    "whole_length",
    "rank_length",
    "traced_length",
    FOR_OUTPUT,
    FOR_READERS,
    INLINED,
)
NODE_LISTS = ("whole_length", "rank_length", "traced_length")
SUFFIX = ".shardcheck.json"


def extension_path(hints_path: str) -> str:
    """Where gen writes the extension of ``hints_path``: ``h.json`` -> ``h.shardcheck.json``."""
    stem = hints_path[: -len(".json")] if hints_path.endswith(".json") else hints_path
    return stem + SUFFIX


def is_extension(document: Any) -> bool:
    return isinstance(document, Mapping) and TAG_KEY in document


def encode_extension(hints: ShardHints) -> dict[str, Any]:
    """The extension document of ``hints`` (which hold ``lengths``)."""
    lengths = hints.lengths or LengthReads()
    document = {
        TAG_KEY: TAG,
        "version": VERSION,
        "hints": encode(hints),
        "whole_length": list(lengths.whole),
        "rank_length": list(lengths.rank),
    }
    if lengths.traced:  # absent from the other files, which stay as they were
        document["traced_length"] = list(lengths.traced)
    if lengths.for_output:
        document[FOR_OUTPUT] = list(lengths.for_output)
    if lengths.for_readers:
        document[FOR_READERS] = [
            {"name": gather.name, "seq_len_idx": gather.seq_len_idx, "nodes": list(gather.nodes)}
            for gather in lengths.for_readers
        ]
    if lengths.inlined:
        document[INLINED] = [{"domain": domain, "name": name} for domain, name in lengths.inlined]
    return document


def dumps_extension(hints: ShardHints) -> str:
    """Serialised as the hints are (4-space indent, a final newline)."""
    return json.dumps(encode_extension(hints), indent=4) + "\n"


def hints_text(hints: ShardHints) -> str:
    """The text of the file of ``hints``: an extension file's with lengths, else the hints'."""
    return dumps(hints) if hints.lengths is None else dumps_extension(hints)


def decode_extension(document: Mapping[str, Any], source: str) -> ShardHints:
    """The hints of an extension document, with their ``lengths``; HintsFormatError names the
    field that is wrong."""
    repeated = getattr(document, "repeated", ())
    if repeated:
        raise HintsFormatError(source, repeated[0], "key given twice in the same object")
    unknown = [key for key in document if key not in KEYS]
    if unknown:
        raise HintsFormatError(
            source, unknown[0], f"unknown key of a shardcheck extension file (keys: {KEYS})"
        )
    if document[TAG_KEY] != TAG:
        raise HintsFormatError(source, TAG_KEY, f"expected {TAG!r}, got {shown(document[TAG_KEY])}")
    version = document.get("version")
    if version != VERSION:
        raise HintsFormatError(
            source,
            "version",
            f"version {shown(version)} is not one this shardcheck reads ({VERSION}); "
            "regenerate the file with 'shardcheck gen'",
        )
    if "hints" not in document:
        raise HintsFormatError(source, "hints", "missing: the extension holds the whole hints")
    hints = decode(document["hints"], source)
    names: dict[str, tuple[str, ...]] = {}
    for key in NODE_LISTS:
        value = document.get(key, [])
        if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
            raise HintsFormatError(
                source, key, f"expected a list of node names, got {shown(value)}"
            )
        if len(set(value)) != len(value):
            repeated = next(name for name in value if value.count(name) > 1)
            raise HintsFormatError(source, key, f"names node {shown(repeated)} twice")
        names[key] = tuple(value)
    both = set(names["whole_length"]) & set(names["rank_length"])
    if both:
        raise HintsFormatError(
            source, "rank_length", f"{shown(min(both))} is in whole_length too: it needs one"
        )
    return hints.with_changes(
        lengths=LengthReads(
            whole=names["whole_length"],
            rank=names["rank_length"],
            traced=names["traced_length"],
            for_output=_gathered_for_output(document, hints, source),
            inlined=_inlined_functions(document, source),
            for_readers=_gathered_for_readers(document, source),
        )
    )


def _inlined_functions(document: Mapping[str, Any], source: str) -> tuple[tuple[str, str], ...]:
    """The extension's ``inlined_functions``: (domain, name) of each, named once."""
    value = document.get(INLINED, [])
    entry_form = '{"domain": ..., "name": ...}'
    if not isinstance(value, list):
        raise HintsFormatError(
            source, INLINED, f"expected a list of {entry_form} objects, got {shown(value)}"
        )
    found: list[tuple[str, str]] = []
    for at, entry in enumerate(value):
        if (
            not isinstance(entry, Mapping)
            or sorted(entry) != ["domain", "name"]
            or not all(isinstance(entry[key], str) for key in ("domain", "name"))
            or not entry["name"]
        ):
            raise HintsFormatError(
                source,
                f"{INLINED}[{at}]",
                f"expected a {entry_form} object with a name, got {shown(entry)}",
            )
        function = (entry["domain"], entry["name"])
        if function in found:
            raise HintsFormatError(
                source, f"{INLINED}[{at}]", f"names function {shown(entry)} twice"
            )
        found.append(function)
    return tuple(found)


def _gathered_for_readers(document: Mapping[str, Any], source: str) -> tuple[ReaderGather, ...]:
    """The extension's ``gathered_for_readers``: each tensor named once, with its axis and
    the nodes (one or more, each once) that read it gathered."""
    value = document.get(FOR_READERS, [])
    entry_form = '{"name": ..., "seq_len_idx": ..., "nodes": [...]}'
    if not isinstance(value, list):
        raise HintsFormatError(
            source, FOR_READERS, f"expected a list of {entry_form} objects, got {shown(value)}"
        )
    found: list[ReaderGather] = []
    for at, entry in enumerate(value):
        where = f"{FOR_READERS}[{at}]"
        if not isinstance(entry, Mapping) or sorted(entry) != ["name", "nodes", "seq_len_idx"]:
            raise HintsFormatError(
                source, where, f"expected a {entry_form} object, got {shown(entry)}"
            )
        name, axis, nodes = entry["name"], entry["seq_len_idx"], entry["nodes"]
        if not isinstance(name, str) or not name:
            raise HintsFormatError(
                source, f"{where}.name", f"expected a tensor name, got {shown(name)}"
            )
        if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
            raise HintsFormatError(
                source, f"{where}.seq_len_idx", f"expected an axis (0 or more), got {shown(axis)}"
            )
        if (
            not isinstance(nodes, list)
            or not nodes
            or not all(isinstance(node, str) and node for node in nodes)
            or len(set(nodes)) != len(nodes)
        ):
            raise HintsFormatError(
                source, f"{where}.nodes", f"expected node names, each once, got {shown(nodes)}"
            )
        if any(gather.name == name for gather in found):
            raise HintsFormatError(source, where, f"names tensor {shown(name)} twice")
        found.append(ReaderGather(name, axis, tuple(nodes)))
    return tuple(found)


def _gathered_for_output(
    document: Mapping[str, Any], hints: ShardHints, source: str
) -> tuple[str, ...]:
    """The extension's ``gathered_for_output``: hinted outputs, each named once."""
    value = document.get(FOR_OUTPUT, [])
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise HintsFormatError(
            source, FOR_OUTPUT, f"expected a list of tensor names, got {shown(value)}"
        )
    hinted = {tensor.name for tensor in hints.outputs}
    for name in value:
        if value.count(name) > 1:
            raise HintsFormatError(source, FOR_OUTPUT, f"names tensor {shown(name)} twice")
        if name not in hinted:
            raise HintsFormatError(
                source,
                FOR_OUTPUT,
                f"{shown(name)} is not among the hints' outputs: only a gathered output can "
                "be gathered for the graph output alone",
            )
    return tuple(value)


def loads_hints_or_extension(text: str, source: str) -> ShardHints:
    """Hints from a hints file or from an extension file (its hints, with their lengths)."""
    document = parse(text, source)
    if is_extension(document):
        return decode_extension(document, source)
    return decode(document, source)


def is_extension_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file that shardcheck wrote as an extension (one that
    gen or check may replace or remove)."""
    try:
        if not Path(path).is_file():
            return False
        return is_extension(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError, RecursionError):
        return False
