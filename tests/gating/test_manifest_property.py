"""Issue 30, acceptance 3: manifests generated with goldens, golden-dirs and reports spelled
every way a careless script would (``..``, absolute paths, links out of the project, NUL bytes,
long names, device files) never make ``check`` write outside the temporary project, and every
refusal is one line with exit 2."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from conftest import FIXTURES, run_cli
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

# Path parts: plain names, the parent, links planted in the project (out of it, to a device,
# to a FIFO, inside it), a NUL byte, names too long for a file system or a temporary file.
PARTS = st.sampled_from(
    [
        "golden",
        "g",
        "..",
        ".",
        "out_link",
        "dev_link",
        "in_link",
        "fifo.json",
        "a\0b",
        "n" * 250,
        "n" * 300,
        "outside",
    ]
)
ROOTS = st.sampled_from(["", "", "", "/", "/dev/", "../", "../../"])
ENDS = st.sampled_from([".json", ".json", "", "/x.json", ".txt"])


@st.composite
def spelled_paths(draw: st.DrawFn) -> str:
    parts = draw(st.lists(PARTS, min_size=1, max_size=4))
    return draw(ROOTS) + "/".join(parts) + draw(ENDS)


DEVICES = st.sampled_from(["/dev/null", "/dev/full", "/dev/stdout", "/dev/zero"])
# Goldens that are fine (so that runs, and --update's writes, are tried too) among the others.
GOOD = st.sampled_from(["golden/a.json", "in_link/a.json", "g/../golden/a.json", "new/dir/a.json"])
GOLDENS = st.one_of(GOOD, spelled_paths(), DEVICES)


def make_tree(base: Path) -> Path:
    """``base/project`` (a model, its manifest written later, planted links and a FIFO) and
    ``base/outside`` (files a user owns, one of them a hints-like JSON)."""
    outside = base / "outside"
    outside.mkdir()
    (outside / "settings.json").write_text('{"inputs": [], "user": "mine"}\n')
    (outside / "notes.txt").write_text("mine\n")
    project = base / "project"
    (project / "fixtures").mkdir(parents=True)
    shutil.copy(FIXTURES / "attention.onnx", project / "fixtures" / "attention.onnx")
    (project / "golden").mkdir()
    (project / "out_link").symlink_to(outside)
    (project / "dev_link").symlink_to("/dev/null")
    (project / "in_link").symlink_to(project / "golden")
    os.mkfifo(project / "fifo.json")
    return project


def _inside(spelled: str, project: Path) -> bool:
    try:
        return Path(os.path.realpath(spelled)).is_relative_to(os.path.realpath(project))
    except (OSError, ValueError):
        return True  # cannot even be resolved: cannot be written either


def snapshot(base: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under ``base`` but the project: its type and, for files, its bytes."""
    found: dict[str, tuple[int, bytes | None]] = {}
    for directory, dirs, files in os.walk(base):
        if Path(directory) == base:
            dirs[:] = [name for name in dirs if name != "project"]
        for name in dirs + files:
            path = Path(directory) / name
            mode = os.lstat(path).st_mode
            data = path.read_bytes() if stat.S_ISREG(mode) else None
            found[str(path.relative_to(base))] = (stat.S_IFMT(mode), data)
    return found


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same examples on every run
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    golden=GOLDENS,
    golden_dir=st.one_of(st.none(), st.just("golden"), spelled_paths()),
    report=st.one_of(st.none(), spelled_paths(), st.just("/dev/null")),
    update=st.booleans(),
)
def test_nothing_is_ever_written_outside_the_project(
    golden: str, golden_dir: str | None, report: str | None, update: bool
) -> None:
    with tempfile.TemporaryDirectory() as temp:
        base = Path(temp)
        project = make_tree(base)
        lines = ["[tool.shardcheck]"]
        if golden_dir is not None:
            lines.append(f"golden-dir = {json.dumps(golden_dir)}")
        lines += [
            "[[tool.shardcheck.models]]",
            'path = "fixtures/attention.onnx"',
            f"golden = {json.dumps(golden)}",
        ]
        manifest = project / "shardcheck.toml"
        manifest.write_text("\n".join(lines) + "\n")
        before = snapshot(base)
        devices = {name: os.stat(name).st_mode for name in ("/dev/null", "/dev/full")}

        options = ["--jobs", "1", *(["--update"] if update else [])]
        if report is not None:
            # --report is the user's own choice of file, written where it says: only the
            # spellings that stay in the project (or cannot be written at all) are tried.
            spelled = report if report.startswith("/") else str(project / report)
            assume(report == "/dev/null" or "\0" in spelled or _inside(spelled, project))
            options += ["--report", spelled]
        result = run_cli("check", "--manifest", manifest, *options)

        assert snapshot(base) == before
        assert {name: os.stat(name).st_mode for name in devices} == devices
        assert (project / "fifo.json").is_fifo()
        assert "Traceback" not in result.stderr and "internal error" not in result.stderr
        event(f"exit {result.exit_code}")
        if result.exit_code == 2:
            assert len(result.stderr.splitlines()) == 1, result.stderr
            assert result.stderr.startswith("shardcheck: error: ")
        else:
            assert result.exit_code in (0, 1), result.stderr
