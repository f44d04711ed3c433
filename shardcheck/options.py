"""Options of ``shardcheck gen``: Polygraphy's shard-hints options, same names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from shardcheck.errors import InputError
from shardcheck.hints import PARALLELISMS, REDUCE_OPS

CP_TYPES = ("native", "fused")
COMPAT_MODES = ("none", "polygraphy")


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
    k_idx: int = 0
    v_idx: int = 0
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

    def __post_init__(self) -> None:
        _choice("parallelism", self.parallelism, PARALLELISMS)
        _choice("cp_type", self.cp_type, CP_TYPES)
        _choice("reduce_op", self.reduce_op, REDUCE_OPS)
        _choice("compat", self.compat, COMPAT_MODES)
        if self.attention_pattern not in (0, 1):
            raise InputError(f"attention_pattern: expected 0 or 1, got {self.attention_pattern!r}")

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "options") -> GenOptions:
        """Build from a mapping such as a manifest entry (keys with - or _)."""
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for raw_key, value in values.items():
            key = raw_key.replace("-", "_")
            if key not in known:
                raise InputError(f"{source}: unknown gen option {raw_key!r}")
            if isinstance(value, list):
                value = tuple(value)
            kwargs[key] = value
        return cls(**kwargs)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InputError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
