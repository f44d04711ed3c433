"""``check --shard K/N``: a deterministic slice of the manifest, for CI matrices, and the merge
of the N slices' reports into the report of the whole run.

Slice K of N is the K-th of N contiguous runs of the manifest's models (in manifest order, as
even as the count allows); the last slice also reports the stale goldens. So the lines of
slices 1 to N, one after the other, are exactly the lines of the whole run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, TypeVar

from shardcheck.errors import InputError
from shardcheck.hints.files import read_text_input

T = TypeVar("T")
_SHARD = re.compile(r"^([0-9]+)/([0-9]+)$")


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/3"`` -> (2, 3); InputError unless 1 <= K <= N."""
    match = _SHARD.match(text.strip())
    if match is None or not 1 <= int(match[1]) <= int(match[2]):
        raise InputError(
            f"--shard {text}: expected K/N with 1 <= K <= N (e.g. 2/3: the second of three slices)"
        )
    return int(match[1]), int(match[2])


def shard_models(models: Sequence[T], shard: tuple[int, int] | None) -> tuple[T, ...]:
    """The models of slice ``shard`` = (K, N); all of them for None."""
    if shard is None:
        return tuple(models)
    k, n = shard
    return tuple(models[(k - 1) * len(models) // n : k * len(models) // n])


def merge_reports(paths: Sequence[str]) -> dict[str, Any]:
    """The report of the whole run from the JSON reports of its N slices (``--report`` of
    ``check --shard K/N``), each slice once; InputError naming the file that does not fit."""
    documents = [(path, _read_report(path)) for path in paths]
    first_path, first = documents[0]
    count = _slice_count(first_path, first)
    seen: dict[int, str] = {}
    for path, document in documents:
        k = _slice_of(path, document, count)
        if k in seen:
            raise InputError(f"{path}: slice {k}/{count} is also {seen[k]}; give each slice once")
        seen[k] = path
        for key in ("manifest", "update", "verify"):
            if document.get(key) != first.get(key):
                raise InputError(
                    f"{path}: {key} is {json.dumps(document.get(key))}, but "
                    f"{json.dumps(first.get(key))} in {first_path}: not slices of one run"
                )
    missing = [f"{k}/{count}" for k in range(1, count + 1) if k not in seen]
    if missing:
        raise InputError(f"{first_path}: the reports of slices {', '.join(missing)} are missing")
    ordered = [document for _, document in documents]
    ordered.sort(key=lambda document: int(document["shard"].split("/")[0]))
    models = [model for document in ordered for model in document["models"]]
    last = ordered[-1]
    return {
        "manifest": first["manifest"],
        "ok": all(document["ok"] for document in ordered),
        "update": first["update"],
        "verify": first["verify"],
        "models": models,
        "stale": last.get("stale", []),
        "removed": last.get("removed", []),
        "shard": None,
        "lines": [line for document in ordered for line in document["lines"]],
        "seconds": sum(float(document.get("seconds", 0.0)) for document in ordered),
    }


def _read_report(path: str) -> dict[str, Any]:
    text = read_text_input(path, "a JSON report of shardcheck check")
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(document, dict) or not isinstance(document.get("models"), list):
        raise InputError(f"{path}: not a report of shardcheck check (no models list)")
    if not isinstance(document.get("lines"), list):
        raise InputError(f"{path}: a report without its lines: write it with this shardcheck")
    return document


def _slice_count(path: str, document: dict[str, Any]) -> int:
    shard = document.get("shard")
    if not isinstance(shard, str) or _SHARD.match(shard) is None:
        raise InputError(f"{path}: not the report of a slice (check --shard K/N)")
    return int(shard.split("/")[1])


def _slice_of(path: str, document: dict[str, Any], count: int) -> int:
    if _slice_count(path, document) != count:
        raise InputError(
            f"{path}: slice {document['shard']}, not one of {count} slices as the first report"
        )
    return int(document["shard"].split("/")[0])
