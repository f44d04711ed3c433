"""check's golden of the extension: ``NAME.shardcheck.json`` beside the golden ``NAME.json``.

Where gen writes an extension beside the hints (generation/extension.py), the extension is
part of the plan gen writes by default, so check gates it as it gates the hints: the same
semantic diff, a missing one fails (``--update`` writes it), and one left where gen writes
none any more fails too (``--update`` removes it, if shardcheck wrote it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardcheck.errors import ShardcheckError
from shardcheck.fsio import atomic_write_text
from shardcheck.hints.diff import Difference, diff_hints
from shardcheck.hints.extension import dumps_extension, extension_path, is_extension_file
from shardcheck.hints.files import read_hints
from shardcheck.hints.model import ShardHints

if TYPE_CHECKING:
    from shardcheck.gating.gate import GoldenComparison


def extension_golden_path(golden_path: Path) -> Path:
    return Path(extension_path(str(golden_path)))


def compare_extension(
    extended: ShardHints | None, golden_path: Path, *, update: bool = False
) -> GoldenComparison | None:
    """The extension ``extended`` (gen's; None where it writes none) against the one beside
    ``golden_path``; None where neither exists."""
    from shardcheck.gating.gate import (
        GoldenComparison,
    )

    found = _compare(extended, extension_golden_path(golden_path), update)
    if found is None:
        return None
    status, path, differences, problem = found
    return GoldenComparison(status, path, differences, problem)


def _compare(
    extended: ShardHints | None, path: Path, update: bool
) -> tuple[str, Path, tuple[Difference, ...], str | None] | None:
    from shardcheck.gating.gate import CREATED, DIFFERS, INVALID, MISSING, OK, UPDATED

    if extended is None:
        if not path.exists():
            return None
        if update and is_extension_file(path):
            os.remove(path)
            return UPDATED, path, (), "removed: gen writes no extension now"
        return DIFFERS, path, (), "gen writes no extension now"
    if not path.exists():
        if update:
            atomic_write_text(path, dumps_extension(extended))
            return CREATED, path, (), None
        return MISSING, path, (), None
    try:
        golden = read_hints(path)
    except ShardcheckError as exc:
        if update and is_extension_file(path):
            atomic_write_text(path, dumps_extension(extended))
            return UPDATED, path, (), exc.message
        return INVALID, path, (), exc.message
    differences = tuple(diff_hints(golden, extended))
    if not differences:
        return OK, path, (), None
    if update:
        atomic_write_text(path, dumps_extension(extended))
        return UPDATED, path, differences, None
    return DIFFERS, path, differences, None


def extension_lines(comparison: GoldenComparison | None, update_flag: str) -> list[str]:
    """check's lines of the extension's golden: what differs, or what is wrong with it."""
    from shardcheck.gating.gate import MISSING, OK

    if comparison is None or comparison.status == OK:
        return []
    where = f"extension {comparison.golden_path}"
    if comparison.status == MISSING:
        return [f"{where}: no golden; {update_flag} writes it"]
    problem = f" ({comparison.problem})" if comparison.problem else ""
    lines = [f"{where}: {comparison.status}{problem}"]
    lines += [f"extension: {difference.line()}" for difference in comparison.differences]
    return lines


def extension_json(comparison: GoldenComparison | None) -> dict[str, Any] | None:
    """The extension's golden in check's JSON report (null where there is neither)."""
    if comparison is None:
        return None
    return {
        "status": comparison.status,
        "path": str(comparison.golden_path),
        "problem": comparison.problem,
        "differences": [difference.as_json() for difference in comparison.differences],
    }
