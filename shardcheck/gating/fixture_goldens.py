"""Stale goldens of the ``shard_hints_regression`` fixture, found over a pytest session that may
be spread over pytest-xdist workers.

A test file that uses the fixture keeps its goldens in ``<dir>/<stem>/``. A ``*.json`` there is
stale when the whole file ran (none of its tests deselected, each that uses the fixture ran its
call) and no test asked for it. What each worker saw (``SessionGoldens``) travels to the
controller as plain JSON and is merged there, so that a serial run and ``-n auto`` find the same
stale goldens. Nothing here imports pytest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardcheck.gating.golden_files import remove_stale


@dataclass
class SessionGoldens:
    """What one process saw; ``merge`` adds another's."""

    # test file -> the node ids of its tests that use the fixture
    files: dict[str, set[str]] = field(default_factory=dict)
    partial: set[str] = field(default_factory=set)  # test files with a test deselected
    ran: set[str] = field(default_factory=set)  # node ids whose call phase ran
    used: set[str] = field(default_factory=set)  # goldens asked for (absolute paths)
    written: list[str] = field(default_factory=list)  # "updated PATH", "removed PATH" lines

    def to_json(self) -> dict[str, Any]:
        return {
            "files": {path: sorted(ids) for path, ids in self.files.items()},
            "partial": sorted(self.partial),
            "ran": sorted(self.ran),
            "used": sorted(self.used),
            "written": list(self.written),
        }

    def merge(self, document: dict[str, Any]) -> None:
        for path, ids in document.get("files", {}).items():
            self.files.setdefault(path, set()).update(ids)
        self.partial.update(document.get("partial", ()))
        self.ran.update(document.get("ran", ()))
        self.used.update(document.get("used", ()))
        self.written.extend(
            line for line in document.get("written", ()) if line not in self.written
        )

    def stale(self) -> list[Path]:
        """The stale fixture goldens (see the module docstring), sorted."""
        found: list[Path] = []
        for test_file, ids in sorted(self.files.items()):
            if test_file in self.partial or not ids <= self.ran:
                continue
            directory = Path(test_file).parent / Path(test_file).stem
            if not directory.is_dir():
                continue
            found.extend(
                path
                for path in sorted(directory.glob("*.json"))
                if path.is_file() and str(path.resolve()) not in self.used
            )
        return found

    def remove_stale(self) -> tuple[list[Path], list[Path]]:
        """Remove the stale goldens that are hints files: (removed, left)."""
        removed: list[Path] = []
        left: list[Path] = []
        for path in self.stale():
            (removed if remove_stale(path) else left).append(path)
        return removed, left
