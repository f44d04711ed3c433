"""Semantic difference of two hints: what changed, not where the JSON text moved.

Inputs and outputs are keyed by tensor name and attention layers by Q, so order never counts,
and both file formats read into the same model, so the format never counts either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from deepdiff import DeepDiff

from shardcheck.hints.codec import validated
from shardcheck.hints.model import FusedAttention, ShardHints
from shardcheck.wording import one_line

KINDS = ("added", "removed", "changed")
_KEYED_COLLECTIONS = {
    "inputs": "name",
    "outputs": "name",
    "attention_layers": "q",
    "lengths": "node",
    "gathered_for_output": "tensor",
    "gathered_for_readers": "name",
    "inlined_functions": "function",
}


@dataclass(frozen=True)
class Difference:
    kind: str  # one of KINDS
    path: str  # e.g. "inputs[name=input_ids].seq_len_idx"
    golden: Any = None
    candidate: Any = None

    def line(self) -> str:
        if self.kind == "added":
            return f"{self.path}: added {_value(self.candidate)}"
        if self.kind == "removed":
            return f"{self.path}: removed (was {_value(self.golden)})"
        return f"{self.path}: {_value(self.golden)} -> {_value(self.candidate)}"

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": self.path,
            "golden": self.golden,
            "candidate": self.candidate,
        }


def _value(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _fused(fused: FusedAttention | None) -> dict[str, Any] | None:
    if fused is None:
        return None
    return {
        "is_causal": fused.is_causal,
        "q_shuffle": None if fused.q_shuffle is None else list(fused.q_shuffle),
        "k_shuffle": None if fused.k_shuffle is None else list(fused.k_shuffle),
        "v_shuffle": None if fused.v_shuffle is None else list(fused.v_shuffle),
        "nb_rank": fused.nb_rank,
    }


def canonical(hints: ShardHints) -> dict[str, Any]:
    """Hints as nested dicts keyed by what identifies each entry; the extension's lengths
    (an extension file's) as the length each node named is given."""
    document = _canonical_hints(hints)
    if hints.lengths is not None:
        document["lengths"] = {
            **dict.fromkeys(hints.lengths.whole, "whole"),
            **dict.fromkeys(hints.lengths.rank, "rank"),
            **dict.fromkeys(hints.lengths.traced, "traced"),
        }
        if hints.lengths.for_output:  # absent where none, as in the extension file
            document["gathered_for_output"] = dict.fromkeys(hints.lengths.for_output, "output")
        if hints.lengths.for_readers:
            document["gathered_for_readers"] = {
                gather.name: {"seq_len_idx": gather.seq_len_idx, "nodes": list(gather.nodes)}
                for gather in hints.lengths.for_readers
            }
        if hints.lengths.inlined:
            document["inlined_functions"] = {
                f"{domain}:{name}": "inlined" for domain, name in hints.lengths.inlined
            }
    return document


def _canonical_hints(hints: ShardHints) -> dict[str, Any]:
    dist = hints.dist_collectives
    return {
        "parallelism": hints.parallelism,
        "attention_layers": {
            layer.q: {
                "gather_kv": layer.gather_kv,
                "gather_q": layer.gather_q,
                "replace": _fused(layer.replace),
            }
            for layer in hints.attention_layers
        },
        "dist_collectives": {
            "group_size": dist.group_size,
            "root": dist.root,
            "nb_rank": dist.nb_rank,
            "reduce_op": dist.reduce_op,
            "groups": list(dist.groups),
        },
        "inputs": {t.name: {"seq_len_idx": t.seq_len_idx, "rank": t.rank} for t in hints.inputs},
        "outputs": {t.name: {"seq_len_idx": t.seq_len_idx, "rank": t.rank} for t in hints.outputs},
        "k_seq_len_idx": hints.k_seq_len_idx,
        "v_seq_len_idx": hints.v_seq_len_idx,
        "kv_rank": hints.kv_rank,
    }


def readable_path(parts: Sequence[Any]) -> str:
    """``['inputs', 'x', 'rank']`` -> ``inputs[name=x].rank``."""
    text = ""
    position = 0
    while position < len(parts):
        part = parts[position]
        if position == 0 and part in _KEYED_COLLECTIONS and len(parts) > 1:
            text = f"{part}[{_KEYED_COLLECTIONS[part]}={parts[1]}]"
            position += 2
            continue
        text = f"{text}.{part}" if text else str(part)
        position += 1
    return text


def _lookup(document: dict[str, Any], parts: Sequence[Any]) -> Any:
    value: Any = document
    for part in parts:
        value = value[part]
    return value


def diff_hints(
    golden: ShardHints, candidate: ShardHints, ignore: Iterable[str] = ()
) -> list[Difference]:
    """The differences from ``golden`` to ``candidate``: added, then removed, then changed.

    Both must be hints a reader takes (hints made in Python are checked: a tensor given twice
    would hide one entry); ``ignore``: path patterns, a string being one pattern."""
    old = canonical(validated(golden, "golden"))
    new = canonical(validated(candidate, "candidate"))
    if isinstance(ignore, str):
        ignore = (ignore,)
    # threshold_to_diff_deeper=0: a renamed only entry is "removed + added", never "changed".
    tree = DeepDiff(old, new, verbose_level=2, threshold_to_diff_deeper=0).tree
    found: dict[tuple[str, str], Difference] = {}
    for report_type in tree:
        for item in tree[report_type]:
            full = item.path(output_format="list")
            # A list (groups, shuffles) changes as a whole: report the field, not an element.
            cut = next((i for i, p in enumerate(full) if isinstance(p, int)), len(full))
            parts = full[:cut]
            whole = cut == len(full)
            if report_type == "dictionary_item_added" and whole:
                difference = Difference("added", readable_path(parts), None, _lookup(new, parts))
            elif report_type == "dictionary_item_removed" and whole:
                difference = Difference("removed", readable_path(parts), _lookup(old, parts), None)
            else:
                difference = Difference(
                    "changed", readable_path(parts), _lookup(old, parts), _lookup(new, parts)
                )
            found[(difference.kind, difference.path)] = difference
    matchers = [_ignore_matcher(pattern) for pattern in ignore]
    kept = [d for d in found.values() if not any(m(d.path) for m in matchers)]
    return sorted(kept, key=lambda d: (KINDS.index(d.kind), d.path))


def _ignore_matcher(pattern: str) -> Any:
    """``*`` matches anything; a pattern also covers everything below the path it names."""
    body = ".*".join(re.escape(piece) for piece in pattern.split("*"))
    regex = re.compile(rf"{body}(?:[.\[].*)?")
    return lambda path: regex.fullmatch(path) is not None


def render_text(differences: Sequence[Difference]) -> str:
    return "".join(f"{one_line(d.line())}\n" for d in differences)


def render_json(golden: str, candidate: str, differences: Sequence[Difference]) -> str:
    document = {
        "ok": not differences,  # the key every command's JSON has (cli/json_output.py)
        "golden": golden,
        "candidate": candidate,
        "equal": not differences,
        "differences": [d.as_json() for d in differences],
    }
    return json.dumps(document, indent=2) + "\n"
