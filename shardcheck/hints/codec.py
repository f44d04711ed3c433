"""The hints' JSON codec.

The file format is Polygraphy 0.53.6's: objects tagged with ``polygraphy_class``, the collective
settings nested under ``dist_collectives``. The older flat format (TensorRT 10.14's Polygraphy:
``group_size``, ``root``, ``groups`` and ``reduce_scatter_reduce_op`` at top level, attention
layers without ``replace``) is read too. Saving always writes the 0.53.6 format.

Decoding never instantiates a class named by the file: the tag at each position must be the one
class that belongs there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from shardcheck.errors import HintsFormatError
from shardcheck.hints.model import (
    MAX_AXIS,
    PARALLELISMS,
    REDUCE_OPS,
    AttentionLayerHint,
    DistCollective,
    FusedAttention,
    ShardHints,
    ShardTensor,
)
from shardcheck.wording import shown

CLASS_KEY = "polygraphy_class"
FLAT_COLLECTIVE_KEYS = ("group_size", "root", "groups", "reduce_scatter_reduce_op", "nb_rank")


# --------------------------------------------------------------------------- encoding


# Each class's keys, in Polygraphy 0.53.6's order; the tag is the class's name, as there.
_KEYS: dict[type, tuple[str, ...]] = {
    ShardHints: (
        "parallelism",
        "attention_layers",
        "dist_collectives",
        "inputs",
        "outputs",
        "k_seq_len_idx",
        "v_seq_len_idx",
        "kv_rank",
    ),
    AttentionLayerHint: ("q", "gather_kv", "gather_q", "replace"),
    FusedAttention: ("is_causal", "q_shuffle", "k_shuffle", "v_shuffle", "nb_rank"),
    DistCollective: ("group_size", "root", "nb_rank", "reduce_op", "groups"),
    ShardTensor: ("name", "seq_len_idx", "rank"),
}


def encode(hints: ShardHints) -> dict[str, Any]:
    """The JSON document of ``hints``, in Polygraphy 0.53.6's key order."""
    return _encoded(hints)


def _encoded(value: Any) -> Any:
    """A hint object as its tagged JSON object, a tuple as a list, anything else as it is."""
    if isinstance(value, tuple):
        return [_encoded(item) for item in value]
    keys = _KEYS.get(type(value))
    if keys is None:
        return value
    body = {key: _encoded(getattr(value, key)) for key in keys}
    body[CLASS_KEY] = type(value).__name__
    return body


def dumps(hints: ShardHints) -> str:
    """Serialise like Polygraphy (4-space indent), plus a final newline for clean diffs."""
    return json.dumps(encode(hints), indent=4) + "\n"


# --------------------------------------------------------------------------- decoding


class _Reader:
    """Walks a decoded JSON document, raising HintsFormatError with the JSON path at fault."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, problem: str) -> HintsFormatError:
        return HintsFormatError(self.source, path, problem)

    def expect(self, path: str, what: str, value: Any) -> HintsFormatError:
        return self.fail(path, f"expected {what}, got {shown(value)}")

    def obj(self, value: Any, path: str, cls: str, allowed: Sequence[str]) -> Mapping[str, Any]:
        where = path or "top level"
        if not isinstance(value, dict):
            raise self.expect(path, f"a {cls} object", value)
        repeated = getattr(value, "repeated", ())
        if repeated:
            raise self.fail(_join(path, repeated[0]), "key given twice in the same object")
        tag = value.get(CLASS_KEY)
        if tag is None:
            raise self.fail(path, f"missing {CLASS_KEY!r} (expected {cls!r}) at {where}")
        if tag != cls:
            raise self.fail(_join(path, CLASS_KEY), f"expected {cls!r}, got {shown(tag)}")
        for key in value:
            if key != CLASS_KEY and key not in allowed:
                raise self.fail(
                    _join(path, key),
                    f"unknown key in {cls} (known keys: {', '.join(allowed)})",
                )
        return value

    def required(self, obj: Mapping[str, Any], key: str, path: str) -> Any:
        if key not in obj:
            raise self.fail(_join(path, key), "missing required field")
        return obj[key]

    def integer(self, value: Any, path: str, *, low: int, high: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.expect(path, "an integer", value)
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f">= {low}"
            raise self.fail(path, f"expected an integer {bound}, got {shown(value)}")
        return value

    def optional_integer(
        self, value: Any, path: str, *, low: int, high: int | None = None
    ) -> int | None:
        return None if value is None else self.integer(value, path, low=low, high=high)

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.expect(path, "true or false", value)
        return value

    def name(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise self.expect(path, "a tensor name (string)", value)
        if not value:
            raise self.fail(path, "expected a tensor name, got an empty string")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            # A lone surrogate (JSON "\\ud800"): no ONNX tensor, whose names are UTF-8, has it.
            raise self.fail(
                path, f"expected a tensor name, got invalid Unicode (character {exc.start})"
            ) from None
        return value

    def choice(self, value: Any, path: str, choices: Sequence[str]) -> str:
        if not isinstance(value, str) or value not in choices:
            raise self.expect(path, "one of " + ", ".join(map(repr, choices)), value)
        return value

    def int_list(self, value: Any, path: str, *, low: int, high: int) -> tuple[int, ...]:
        if not isinstance(value, list):
            raise self.expect(path, "a list of integers", value)
        return tuple(
            self.integer(item, f"{path}[{i}]", low=low, high=high) for i, item in enumerate(value)
        )

    def items(self, value: Any, path: str) -> list[tuple[str, Any]]:
        if not isinstance(value, list):
            raise self.expect(path, "a list", value)
        return [(f"{path}[{i}]", item) for i, item in enumerate(value)]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _decode_fused(r: _Reader, value: Any, path: str) -> FusedAttention:
    obj = r.obj(value, path, "FusedAttention", _KEYS[FusedAttention])

    def shuffle(key: str) -> tuple[int, ...] | None:
        raw = obj.get(key)
        return None if raw is None else r.int_list(raw, _join(path, key), low=0, high=MAX_AXIS)

    nb_rank = obj.get("nb_rank", 1)
    return FusedAttention(
        is_causal=r.boolean(r.required(obj, "is_causal", path), _join(path, "is_causal")),
        q_shuffle=shuffle("q_shuffle"),
        k_shuffle=shuffle("k_shuffle"),
        v_shuffle=shuffle("v_shuffle"),
        nb_rank=r.integer(nb_rank, _join(path, "nb_rank"), low=1, high=2**31 - 1),
    )


def _decode_layer(r: _Reader, value: Any, path: str, *, flat: bool) -> AttentionLayerHint:
    keys = _KEYS[AttentionLayerHint]
    # The flat format's layers have no ``replace``.
    obj = r.obj(value, path, "AttentionLayerHint", keys[:-1] if flat else keys)
    raw_replace = obj.get("replace")
    return AttentionLayerHint(
        q=r.name(r.required(obj, "q", path), _join(path, "q")),
        gather_kv=r.boolean(r.required(obj, "gather_kv", path), _join(path, "gather_kv")),
        gather_q=r.boolean(r.required(obj, "gather_q", path), _join(path, "gather_q")),
        replace=None
        if raw_replace is None
        else _decode_fused(r, raw_replace, _join(path, "replace")),
    )


def _decode_tensor(r: _Reader, value: Any, path: str) -> ShardTensor:
    obj = r.obj(value, path, "ShardTensor", _KEYS[ShardTensor])
    return ShardTensor(
        name=r.name(r.required(obj, "name", path), _join(path, "name")),
        seq_len_idx=r.integer(
            r.required(obj, "seq_len_idx", path),
            _join(path, "seq_len_idx"),
            low=0,
            high=MAX_AXIS - 1,
        ),
        rank=r.optional_integer(obj.get("rank"), _join(path, "rank"), low=1, high=MAX_AXIS),
    )


def _decode_collective(
    r: _Reader, obj: Mapping[str, Any], path: str, op_key: str
) -> DistCollective:
    def get(key: str, default: Any) -> Any:
        value = obj.get(key)
        return default if value is None else value

    return DistCollective(
        group_size=r.integer(
            get("group_size", 0), _join(path, "group_size"), low=0, high=2**31 - 1
        ),
        root=r.integer(get("root", -1), _join(path, "root"), low=-1, high=2**31 - 1),
        nb_rank=r.integer(get("nb_rank", 1), _join(path, "nb_rank"), low=1, high=2**31 - 1),
        groups=r.int_list(get("groups", []), _join(path, "groups"), low=0, high=2**31 - 1),
        reduce_op=r.choice(get(op_key, "max"), _join(path, op_key), REDUCE_OPS),
    )


def _unique(r: _Reader, entries: Sequence[tuple[str, str]], what: str) -> None:
    seen: dict[str, str] = {}
    for path, name in entries:
        if name in seen:
            raise r.fail(path, f"duplicate {what} {name!r} (also at {seen[name]})")
        seen[name] = path


NEW_KEYS = _KEYS[ShardHints]
FLAT_KEYS = tuple(k for k in NEW_KEYS if k != "dist_collectives") + FLAT_COLLECTIVE_KEYS


def is_flat_format(document: Mapping[str, Any]) -> bool:
    """True for TensorRT 10.14's flat layout (collective settings at top level)."""
    return "dist_collectives" not in document and any(k in document for k in FLAT_COLLECTIVE_KEYS)


def validated(hints: ShardHints, source: str = "<hints>") -> ShardHints:
    """``hints`` as the reader of a file of them would take them: what it refuses (a negative
    axis, a duplicate tensor, a value of the wrong type) is a HintsFormatError naming
    ``source`` and the field. For hints made in Python, which no reader has seen. The
    extension (``lengths``), which the format does not hold, is kept."""
    decoded = decode(encode(hints), source)
    return decoded if hints.lengths is None else decoded.with_changes(lengths=hints.lengths)


def decode(document: Any, source: str = "<hints>") -> ShardHints:
    """Validate a decoded JSON document and build ShardHints; HintsFormatError names the path."""
    r = _Reader(source)
    if not isinstance(document, dict):
        raise r.expect("", "a JSON object (a ShardHints document)", document)
    flat = is_flat_format(document)
    top = r.obj(document, "", "ShardHints", FLAT_KEYS if flat else NEW_KEYS)

    if flat:
        dist = _decode_collective(r, top, "", "reduce_scatter_reduce_op")
    else:
        dist_path = "dist_collectives"
        dist_obj = r.obj(
            r.required(top, "dist_collectives", ""),
            dist_path,
            "DistCollective",
            _KEYS[DistCollective],
        )
        dist = _decode_collective(r, dist_obj, dist_path, "reduce_op")

    layers = tuple(
        _decode_layer(r, item, path, flat=flat)
        for path, item in r.items(r.required(top, "attention_layers", ""), "attention_layers")
    )
    inputs = _decode_tensors(r, r.required(top, "inputs", ""), "inputs")
    outputs = _decode_tensors(r, r.required(top, "outputs", ""), "outputs")
    _unique(r, [(f"attention_layers[{i}].q", x.q) for i, x in enumerate(layers)], "attention Q")

    def axis(key: str) -> int:
        return r.integer(r.required(top, key, ""), key, low=0, high=MAX_AXIS - 1)

    kv_rank_raw = top.get("kv_rank") if flat else r.required(top, "kv_rank", "")
    return ShardHints(
        parallelism=r.choice(r.required(top, "parallelism", ""), "parallelism", PARALLELISMS),
        attention_layers=layers,
        dist_collectives=dist,
        inputs=inputs,
        outputs=outputs,
        k_seq_len_idx=axis("k_seq_len_idx"),
        v_seq_len_idx=axis("v_seq_len_idx"),
        kv_rank=r.optional_integer(kv_rank_raw, "kv_rank", low=1, high=MAX_AXIS),
    )


def _decode_tensors(r: _Reader, value: Any, key: str) -> tuple[ShardTensor, ...]:
    tensors = tuple(_decode_tensor(r, item, path) for path, item in r.items(value, key))
    _unique(r, [(f"{key}[{i}].name", t.name) for i, t in enumerate(tensors)], "tensor")
    return tensors


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not valid JSON")


class _JSONObject(dict):  # type: ignore[type-arg]
    """A JSON object as parsed; ``repeated`` lists the keys that it gives more than once
    (json keeps the last value silently; the decoder refuses them with their path)."""

    repeated: tuple[str, ...] = ()


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = _JSONObject(pairs)
    if len(result) != len(pairs):
        keys = [key for key, _ in pairs]
        result.repeated = tuple(dict.fromkeys(k for k in keys if keys.count(k) > 1))
    return result


def loads(text: str, source: str = "<hints>") -> ShardHints:
    """Parse and validate hints JSON text."""
    return decode(parse(text, source), source)


def parse(text: str, source: str = "<hints>") -> Any:
    """The JSON document of a hints file (no NaN, no BOM; a key given twice is kept in the
    object's ``repeated`` for the decoder to refuse)."""
    if text.startswith("\ufeff"):
        raise HintsFormatError(
            source,
            "",
            "starts with a byte-order mark (BOM), which JSON readers such as Polygraphy's "
            "refuse; save the file as UTF-8 without a BOM",
        )
    try:
        document = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_json_object)
    except (json.JSONDecodeError, ValueError, RecursionError) as exc:
        raise HintsFormatError(source, "", f"not valid JSON ({_json_problem(exc)})") from None
    return document


def _json_problem(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        # Some messages end where the position goes ("Unterminated string starting at").
        at = "" if exc.msg.endswith(" at") else " at"
        return f"{exc.msg}{at} line {exc.lineno} column {exc.colno}"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc)
