"""``shardcheck check``: exit codes, output, --update, and goldens that survive a SIGKILL."""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import FIXTURES, MULTI_ATTENTION_WARNING, ROOT, run_cli

from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.graph.loader import load_index
from shardcheck.hints.codec import dumps
from shardcheck.hints.files import read_hints
from shardcheck.hints.model import ShardHints

MODELS = ("attention", "attention_head", "multi_attention")
OLD_MTIME_NS = 1_000_000_000_000_000_000


def generated_hints(model: Path) -> ShardHints:
    return generate(load_index(model), GenOptions()).hints


def drifted(hints: ShardHints) -> ShardHints:
    """The hints as an older version might have written them: reduce_op sum, not max."""
    return hints.with_changes(dist_collectives=replace(hints.dist_collectives, reduce_op="sum"))


def make_project(directory: Path, models: tuple[str, ...] = MODELS) -> Path:
    """Fixture models with up-to-date goldens under ``directory``, listed in shardcheck.toml."""
    (directory / "fixtures").mkdir()
    (directory / "golden").mkdir()
    lines = ["[tool.shardcheck]", 'golden-dir = "golden"']
    for name in models:
        model = directory / "fixtures" / f"{name}.onnx"
        shutil.copy(FIXTURES / f"{name}.onnx", model)
        golden = directory / "golden" / f"{name}.json"
        golden.write_text(dumps(generated_hints(model)))
        os.utime(golden, ns=(OLD_MTIME_NS, OLD_MTIME_NS))
        lines += [
            "[[tool.shardcheck.models]]",
            f'path = "fixtures/{name}.onnx"',
            f'golden = "golden/{name}.json"',
        ]
    manifest = directory / "shardcheck.toml"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


SUMMARY = re.compile(r"^[0-9]+ models?: .+ \([0-9]+\.[0-9] s\)$")


def model_lines(stdout: str) -> list[str]:
    """check's lines without its last, the summary (which holds the time taken)."""
    *lines, summary = stdout.splitlines()
    assert SUMMARY.match(summary), summary
    return lines


def drift(golden: Path) -> None:
    golden.write_text(dumps(drifted(read_hints(golden))))
    os.utime(golden, ns=(OLD_MTIME_NS, OLD_MTIME_NS))


def golden_state(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def test_all_ok_exits_0(tmp_path: Path) -> None:
    manifest = make_project(tmp_path)

    result = run_cli("check", "--manifest", manifest)

    assert result.exit_code == 0
    # gen's warnings under their model, as gen prints them (but the model's path).
    assert result.stdout.splitlines()[-1].startswith("3 models: 3 ok (")
    assert model_lines(result.stdout) == [
        "ok       attention",
        "ok       attention_head",
        "ok       multi_attention",
        f"    warning: {MULTI_ATTENTION_WARNING}",
    ]
    assert result.stderr == ""


def test_one_changed_model_exits_1_and_is_named(tmp_path: Path) -> None:
    manifest = make_project(tmp_path)
    drift(tmp_path / "golden" / "attention_head.json")

    result = run_cli("check", "--manifest", manifest)

    assert result.exit_code == 1
    assert result.stdout.splitlines()[-1].startswith("3 models: 2 ok, 1 differs (")
    assert model_lines(result.stdout) == [
        "ok       attention",
        "DIFFERS  attention_head (1 difference)",
        '    dist_collectives.reduce_op: "sum" -> "max"',
        "ok       multi_attention",
        f"    warning: {MULTI_ATTENTION_WARNING}",
    ]
    assert result.stderr == ""


def test_update_rewrites_exactly_the_changed_golden_then_check_passes(tmp_path: Path) -> None:
    manifest = make_project(tmp_path)
    changed = tmp_path / "golden" / "attention_head.json"
    expected = changed.read_bytes()
    drift(changed)
    before = golden_state(tmp_path / "golden")

    updated = run_cli("check", "--manifest", manifest, "--update")

    assert updated.exit_code == 0
    assert updated.stdout.splitlines()[1:3] == [
        "UPDATED  attention_head (rewrote golden/attention_head.json: 1 difference)",
        '    dist_collectives.reduce_op: "sum" -> "max"',
    ]
    after = golden_state(tmp_path / "golden")
    assert after["attention_head.json"][0] == expected
    assert after["attention_head.json"][1] != OLD_MTIME_NS
    del before["attention_head.json"], after["attention_head.json"]
    # The golden written gets its plan beside it (tests/planning/test_plan_golden.py).
    assert "attention_head.plan" not in before and after.pop("attention_head.plan")
    assert after == before  # the other goldens: same bytes, same mtimes

    again = run_cli("check", "--manifest", manifest)
    assert (again.exit_code, again.stderr) == (0, "")


def test_model_that_fails_to_load_is_exit_1_and_keeps_its_golden(tmp_path: Path) -> None:
    manifest = make_project(tmp_path)
    broken = tmp_path / "fixtures" / "attention.onnx"
    broken.write_bytes(b"")
    drift(tmp_path / "golden" / "attention.json")
    drift(tmp_path / "golden" / "multi_attention.json")
    kept = (tmp_path / "golden" / "attention.json").read_bytes()

    result = run_cli("check", "--manifest", manifest, "--update")

    assert result.exit_code == 1
    assert result.stdout.splitlines()[0] == (
        f"ERROR    attention: {broken}: empty file, expected an ONNX model"
    )
    assert result.stdout.splitlines()[2].startswith("UPDATED  multi_attention ")
    assert result.stderr == ""
    golden = tmp_path / "golden" / "attention.json"
    assert (golden.read_bytes(), golden.stat().st_mtime_ns) == (kept, OLD_MTIME_NS)


def test_missing_golden_fails_until_update_writes_it(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention",))
    golden = tmp_path / "golden" / "attention.json"
    expected = golden.read_bytes()
    golden.unlink()

    missing = run_cli("check", "--manifest", manifest)
    assert missing.exit_code == 1
    assert model_lines(missing.stdout) == [
        "MISSING  attention (no golden: golden/attention.json; run with --update)"
    ]

    created = run_cli("check", "--manifest", manifest, "--update")
    assert created.exit_code == 0
    assert model_lines(created.stdout) == ["CREATED  attention (wrote golden/attention.json)"]
    assert golden.read_bytes() == expected


def test_a_golden_that_is_a_directory_is_not_said_to_be_fixed_by_update(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention",))
    golden = tmp_path / "golden" / "attention.json"
    golden.unlink()
    golden.mkdir()

    result = run_cli("check", "--manifest", manifest)

    assert result.exit_code == 1
    assert model_lines(result.stdout) == [
        f"INVALID  attention ({golden}: is a directory, expected a JSON hints file: remove it, "
        "or give the model another golden path)"
    ]


def test_stale_golden_fails(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention",))
    (tmp_path / "golden" / "old.json").write_text("{}\n")

    result = run_cli("check", "--manifest", manifest, "--update")

    assert result.exit_code == 1
    assert model_lines(result.stdout) == [
        "ok       attention",
        "STALE    golden/old.json (no model in the manifest claims it; delete it or list its "
        "model)",
    ]
    assert (tmp_path / "golden" / "old.json").read_text() == "{}\n"


def test_json_format_and_report_file(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention", "attention_head"))
    drift(tmp_path / "golden" / "attention.json")
    report = tmp_path / "out" / "report.json"
    report.parent.mkdir()

    result = run_cli("check", "--manifest", manifest, "--format", "json", "--report", report)

    assert result.exit_code == 1
    assert result.stderr == ""
    document = json.loads(result.stdout)
    assert json.loads(report.read_text()) == document
    assert document["ok"] is False
    assert [(m["name"], m["status"]) for m in document["models"]] == [
        ("attention", "differs"),
        ("attention_head", "ok"),
    ]
    assert document["models"][0]["differences"] == [
        {
            "kind": "changed",
            "path": "dist_collectives.reduce_op",
            "golden": "sum",
            "candidate": "max",
        }
    ]


def test_report_file_with_text_output(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention",))
    report = tmp_path / "report.json"

    result = run_cli("check", "--manifest", manifest, "--report", report)

    assert (result.exit_code, model_lines(result.stdout)) == (0, ["ok       attention"])
    assert json.loads(report.read_text())["ok"] is True


@pytest.mark.parametrize(
    ("report", "says"),
    [
        ("shardcheck.toml", "--report shardcheck.toml: is the manifest"),
        ("golden/attention.json", "--report golden/attention.json: is the golden of attention"),
        ("fixtures/attention.onnx", "--report fixtures/attention.onnx: is the model of attention"),
        ("golden/report.json", "--report golden/report.json: is a .json file in golden-dir"),
        ("-", "--report -: the report is written to a file"),
        ("missing/report.json", "missing/report.json: cannot write: directory 'missing' does"),
    ],
)
def test_a_report_path_that_cannot_be_the_report_is_refused_before_any_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report: str, says: str
) -> None:
    make_project(tmp_path, ("attention",))
    drift(tmp_path / "golden" / "attention.json")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    monkeypatch.chdir(tmp_path)
    # --update would rewrite the drifted golden: the refusal comes first.
    result = run_cli("check", "--update", "--report", report)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"shardcheck: error: {says}"), result.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("report", ["golden/report.txt", "golden/.report.json"])
def test_a_report_in_golden_dir_that_no_check_takes_for_a_golden_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report: str
) -> None:
    make_project(tmp_path, ("attention",))
    monkeypatch.chdir(tmp_path)
    result = run_cli("check", "--report", report)
    assert result.exit_code == 0, result.stderr
    assert json.loads((tmp_path / report).read_text())["ok"] is True
    assert run_cli("check").exit_code == 0  # and it is no stale golden after


def test_an_empty_manifest_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_project(tmp_path, ("attention",))
    monkeypatch.chdir(tmp_path)
    result = run_cli("check", "--manifest", "")
    assert result.exit_code == 2
    assert result.stderr == "shardcheck: error: --manifest '': the manifest path is empty\n"


def test_unusable_manifest_exits_2_with_one_error_line(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention",))
    manifest.write_text(manifest.read_text().replace('golden = "golden/attention.json"\n', ""))

    result = run_cli("check", "--manifest", manifest)

    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == (
        f"shardcheck: error: {manifest}: tool.shardcheck.models[0].golden: missing\n"
    )


def test_default_manifest_prefers_shardcheck_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_project(tmp_path, ("attention",))
    (tmp_path / "pyproject.toml").write_text("[tool.shardcheck]\nmodels = 3\n")
    monkeypatch.chdir(tmp_path)

    result = run_cli("check")

    assert (result.exit_code, model_lines(result.stdout), result.stderr) == (
        0,
        ["ok       attention"],
        "",
    )


def test_run_from_a_subdirectory_finds_the_manifest_above(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_project(tmp_path, ("attention",))
    # A project's own pyproject.toml without the table is passed over for the parent's manifest.
    (tmp_path / "fixtures" / "sub").mkdir()
    (tmp_path / "fixtures" / "sub" / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    monkeypatch.chdir(tmp_path / "fixtures" / "sub")
    drift(tmp_path / "golden" / "attention.json")

    result = run_cli("check", "--format", "json")

    assert result.exit_code == 1, result.stderr
    report = json.loads(result.stdout)
    # The paths in it stay relative to the manifest's directory, not the current one.
    assert report["manifest"] == "../../shardcheck.toml"
    assert [(m["model"], m["golden"], m["status"]) for m in report["models"]] == [
        ("fixtures/attention.onnx", "golden/attention.json", "differs")
    ]


def test_default_pyproject_without_table_is_a_clean_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    monkeypatch.chdir(tmp_path)

    result = run_cli("check")

    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == (
        "shardcheck: error: pyproject.toml: no [tool.shardcheck] table; see docs/gating.md\n"
    )


def test_no_manifest_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    result = run_cli("check")

    assert result.exit_code == 2
    assert result.stderr == (
        "shardcheck: error: .: no manifest: no shardcheck.toml, nor a pyproject.toml with a "
        "[tool.shardcheck] table, in this directory or any parent\n"
    )


def test_verify_without_verify_module_is_a_clean_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "shardcheck.verification.verify", None)  # import now fails
    manifest = make_project(tmp_path, ("attention",))

    result = run_cli("check", "--manifest", manifest, "--verify")

    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == "shardcheck: error: verify is not available in this version\n"


# ------------------------------------------------------------------ SIGKILL during --update

KILLED_MODELS = 24  # 8 fixtures x 3 copies: the update writes for a few hundred ms


def make_drifted_project(directory: Path) -> tuple[Path, dict[Path, str], dict[Path, str]]:
    """A manifest whose every golden differs; returns (manifest, old texts, new texts)."""
    (directory / "fixtures").mkdir()
    (directory / "golden").mkdir()
    lines = ["[tool.shardcheck]"]
    old: dict[Path, str] = {}
    new: dict[Path, str] = {}
    # The fixtures that have goldens: every one of them generates hints (gen refuses some
    # other fixtures on purpose, e.g. mixed_rank_attention).
    goldens = sorted((FIXTURES.parent / "golden").glob("*.json"))
    sources = [FIXTURES / f"{golden.stem}.onnx" for golden in goldens]
    for number in range(KILLED_MODELS):
        source = sources[number % len(sources)]
        name = f"{source.stem}_{number}"
        model = directory / "fixtures" / f"{name}.onnx"
        shutil.copy(source, model)
        golden = directory / "golden" / f"{name}.json"
        hints = generated_hints(model)
        new[golden], old[golden] = dumps(hints), dumps(drifted(hints))
        lines += [
            "[[tool.shardcheck.models]]",
            f'path = "fixtures/{name}.onnx"',
            f'golden = "golden/{name}.json"',
        ]
    manifest = directory / "shardcheck.toml"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest, old, new


def start_update(manifest: Path, *options: str) -> subprocess.Popen[bytes]:
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardcheck",
            "check",
            "--update",
            "--manifest",
            str(manifest),
            *options,
        ],
        cwd=manifest.parent,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_for_first_write(directory: Path, process: subprocess.Popen[bytes]) -> None:
    """Until the update creates its first temporary file (the directory changes) or exits."""
    start = directory.stat().st_mtime_ns
    deadline = time.monotonic() + 30
    while directory.stat().st_mtime_ns == start and process.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError("shardcheck check --update wrote nothing in 30 s")
        time.sleep(0.001)


def test_sigkill_during_update_leaves_every_golden_old_or_new(tmp_path: Path) -> None:
    manifest, old, new = make_drifted_project(tmp_path)
    rng = random.Random(20240611)
    golden_dir = tmp_path / "golden"
    mixed_kills = 0
    # Kill at a random moment from the start (maybe before any write), or a random short
    # time after the first write so that kills land inside the write phase.
    moments = [("start", rng.uniform(0.0, 0.5)) for _ in range(2)]
    moments += [("first write", rng.uniform(0.0, 0.06)) for _ in range(6)]
    for anchor, delay in moments:
        for golden, text in old.items():
            golden.write_text(text)
        process = start_update(manifest)
        if anchor == "first write":
            wait_for_first_write(golden_dir, process)
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)

        rewritten = 0
        for golden in old:
            text = golden.read_text()
            assert text in (old[golden], new[golden]), f"{golden.name} after kill at {delay:.3f}s"
            read_hints(golden)  # parses as a hints file
            rewritten += text == new[golden]
        mixed_kills += 0 < rewritten < len(old)
    # At least one kill landed between two golden writes, so the check above was exercised.
    assert mixed_kills >= 1

    finished = start_update(manifest)
    assert finished.wait(timeout=60) == 0
    assert all(golden.read_text() == new[golden] for golden in new)


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (read off /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # The fields after the command's name, which may hold spaces, in parentheses.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the process ended meanwhile
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_sigkill_of_a_parallel_update_ends_its_workers(tmp_path: Path) -> None:
    # A pool's workers wait for their next task on a pipe whose write end they hold too: left
    # alone, they outlived a killed command forever.
    manifest, _, _ = make_drifted_project(tmp_path)
    process = start_update(manifest, "--jobs", "2")
    wait_for_first_write(tmp_path / "golden", process)
    workers = _children(process.pid)
    assert process.poll() is None and workers, "the update ended before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _alive(pid)]
    # What a worker was writing when it ended is removed: no temporary file is left.
    assert not [path.name for path in (tmp_path / "golden").iterdir() if path.suffix == ".tmp"]


def test_update_does_not_write_hints_that_fail_verify(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention_head",))
    golden = tmp_path / "golden" / "attention_head.json"
    drift(golden)
    before = golden.read_bytes()
    # This head's K has the sequence on axis 2: with k-idx 0 the hints gen writes fail verify.
    manifest.write_text(manifest.read_text() + "gen = { k-idx = 0 }\nverify = true\n")

    result = run_cli("check", "--manifest", manifest, "--update", "--verify")

    assert result.exit_code == 1
    assert result.stdout.splitlines()[0] == (
        # reduce_op (the drift) and k_seq_len_idx (the option)
        "DIFFERS  attention_head (2 differences; not written: the hints fail verify; verify failed)"
    )
    assert golden.read_bytes() == before
    document = json.loads(
        run_cli("check", "--manifest", manifest, "--update", "--verify", "--format", "json").stdout
    )
    assert document["models"][0]["held_back"] is True
    assert golden.read_bytes() == before


def test_update_does_not_write_a_golden_verify_could_not_check(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention_head",))
    golden = tmp_path / "golden" / "attention_head.json"
    golden.unlink()
    # At a length of 10^9 the scores alone need exabytes: verify refuses to run.
    manifest.write_text(manifest.read_text() + "verify = true\nseq-lens = [8, 1000000000]\n")

    result = run_cli("check", "--manifest", manifest, "--update", "--verify")

    assert result.exit_code == 1
    assert result.stdout.splitlines()[0].startswith(
        "ERROR    attention_head (no golden: golden/attention_head.json; not written: verify "
        "could not run; verify: "
    )
    assert "sequence length 1000000000" in result.stdout
    assert not golden.exists()


def test_verify_failure_is_a_failed_model_with_the_report(tmp_path: Path) -> None:
    verify_module = importlib.import_module("shardcheck.verification.verify")
    manifest = make_project(tmp_path, ("attention_head",))
    # Polygraphy's compat mode writes k_seq_len_idx 0; this head's K has the sequence on axis 2.
    compat = GenOptions(compat="polygraphy")
    model = tmp_path / "fixtures" / "attention_head.onnx"
    hints = generate(load_index(model), compat).hints
    (tmp_path / "golden" / "attention_head.json").write_text(dumps(hints))
    manifest.write_text(manifest.read_text() + 'gen = { compat = "polygraphy" }\nverify = true\n')
    report = verify_module.verify(str(model), hints, hints_source="the hints gen writes")
    assert not report.ok

    result = run_cli("check", "--manifest", manifest, "--verify")

    assert result.exit_code == 1
    lines = model_lines(result.stdout)
    assert lines[0] == "FAILED   attention_head (verify failed)"
    # The hints verified are those gen writes now (not a file): said so, not "<hints>".
    assert lines[1] == f"    verify {model} with the hints gen writes"
    assert lines[1:] == [
        f"    {line}" if line else "" for line in report.render_text().splitlines()
    ]
    assert result.stderr == ""
