"""Options of ``shardcheck gen``: Polygraphy's shard-hints options, same names and defaults;
and the sequence lengths verify runs at unless told (the manifest checks its ranks by them)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from shardcheck.errors import InputError
from shardcheck.hints.model import MAX_AXIS, PARALLELISMS, REDUCE_OPS
from shardcheck.wording import shown

DEFAULT_SEQ_LENS = (8, 16)
CP_TYPES = ("native", "fused")
COMPAT_MODES = ("none", "polygraphy")
# frontier: the earliest/latest tensors that make CP exact; graph: graph inputs/outputs only.
IO_MODES = ("frontier", "graph")
INT32_MAX = 2**31 - 1
# The bounds that the hints decoder puts on the fields each option is written to: gen never
# writes a file that shardcheck itself (fmt, diff, verify, shard) would refuse to read.
BOUNDS: dict[str, tuple[int, int]] = {
    "root": (-1, INT32_MAX),
    "gpus": (0, INT32_MAX),
    "groups": (0, INT32_MAX),
    "i_idx": (0, MAX_AXIS - 1),
    "o_idx": (0, MAX_AXIS - 1),
    "k_idx": (0, MAX_AXIS - 1),
    "v_idx": (0, MAX_AXIS - 1),
    "i_rank": (1, MAX_AXIS),
    "o_rank": (1, MAX_AXIS),
    "kv_rank": (1, MAX_AXIS),
    "q_shuffle": (0, MAX_AXIS),
    "k_shuffle": (0, MAX_AXIS),
    "v_shuffle": (0, MAX_AXIS),
    "nb_rank": (1, INT32_MAX),
}


@dataclass(frozen=True)
class GenOptions:
    parallelism: str = "CP"
    root: int = -1
    gpus: int = 0
    groups: tuple[int, ...] = ()
    cp_type: str = "native"
    no_suggest_io: bool = False
    i_idx: int = 0
    o_idx: int = 0
    # None: inferred from the gathered K and V (0 with --compat polygraphy, as in Polygraphy).
    k_idx: int | None = None
    v_idx: int | None = None
    i_rank: int | None = None
    o_rank: int | None = None
    kv_rank: int | None = None
    reduce_op: str = "max"
    attention_pattern: int = 0
    q_shuffle: tuple[int, ...] | None = None
    k_shuffle: tuple[int, ...] | None = None
    v_shuffle: tuple[int, ...] | None = None
    is_causal: bool = False
    nb_rank: int = 1
    compat: str = "none"
    io: str = "frontier"
    # Also the extension's plan where it splits more (generation/extension.py); not with
    # --compat polygraphy nor --io graph.
    extension: bool = True

    def __post_init__(self) -> None:
        # Made in Python as from a manifest: lists taken as tuples, every value's type checked.
        for name, kind in _option_kinds().items():
            value = getattr(self, name)
            if isinstance(value, list):
                value = tuple(value)
                object.__setattr__(self, name, value)
            problem = _type_problem(kind, value)
            if problem:
                raise InputError(f"{name}: expected {problem}, got {shown(value)}")
        _choice("parallelism", self.parallelism, PARALLELISMS)
        _choice("cp_type", self.cp_type, CP_TYPES)
        _choice("reduce_op", self.reduce_op, REDUCE_OPS)
        _choice("compat", self.compat, COMPAT_MODES)
        _choice("io", self.io, IO_MODES)
        if self.attention_pattern not in (0, 1):
            raise InputError(f"attention_pattern: expected 0 or 1, got {self.attention_pattern!r}")
        for name, (low, high) in BOUNDS.items():
            _bounded(name, getattr(self, name), low, high)
        if self.gpus and self.root >= self.gpus:
            # verify would refuse what gen wrote (SC113).
            raise InputError(
                f"root: {self.root} is not a rank of a group of {self.gpus} GPUs; "
                f"expected -1 or 0 to {self.gpus - 1}"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "options") -> GenOptions:
        """Build from a mapping such as a manifest entry (keys with - or _).

        Unknown keys, a key given twice (``reduce-op`` and ``reduce_op``), wrongly typed values
        and bad choices are InputErrors of one line that start with ``source``.
        """
        if not isinstance(values, Mapping):
            raise InputError(f"{source}: expected a table of gen options, got {shown(values)}")
        kinds = _option_kinds()
        kwargs: dict[str, Any] = {}
        spelled: dict[str, str] = {}
        for raw_key, value in values.items():
            key = str(raw_key).replace("-", "_")
            if key not in kinds:
                raise InputError(f"{source}: unknown gen option {raw_key!r}")
            if key in spelled:
                raise InputError(
                    f"{source}: gen option {raw_key!r} given twice (also as {spelled[key]!r})"
                )
            spelled[key] = str(raw_key)
            kwargs[key] = value
        try:
            return cls(**kwargs)
        except InputError as exc:
            # __post_init__ (types, choices, bounds) says "field: problem"; name the key as the
            # mapping spelled it.
            field_name, _, problem = exc.message.partition(": ")
            key = spelled.get(field_name, field_name)
            raise InputError(f"{source}: gen option {key!r}: {problem}") from None


@functools.cache
def _option_kinds() -> dict[str, str]:
    """Each option's kind, read from its annotation (a string under postponed evaluation)."""
    kinds = {
        "str": "str",
        "int": "int",
        "bool": "bool",
        "int | None": "optional int",
        "tuple[int, ...]": "int list",
        "tuple[int, ...] | None": "optional int list",
    }
    return {f.name: kinds[str(f.type)] for f in fields(GenOptions)}


def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_problem(kind: str, value: Any) -> str | None:
    """What ``value`` should have been, or None when it has the type of ``kind``."""
    if kind.startswith("optional ") and value is None:
        return None
    kind = kind.removeprefix("optional ")
    if kind == "str":
        return None if isinstance(value, str) else "a string"
    if kind == "int":
        return None if is_integer(value) else "an integer"
    if kind == "bool":
        return None if isinstance(value, bool) else "true or false"
    if isinstance(value, (list, tuple)) and all(is_integer(v) and v >= 0 for v in value):
        return None
    return "a list of non-negative integers"


def _bounded(name: str, value: int | tuple[int, ...] | None, low: int, high: int) -> None:
    for number in value if isinstance(value, tuple) else (value,):
        if number is not None and not low <= number <= high:
            raise InputError(
                f"{name}: expected an integer between {low} and {high}, got {shown(number)}"
            )


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InputError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
