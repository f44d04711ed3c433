"""``shardcheck check`` over a zoo: streaming lines and the summary, --strict, stale goldens
removed by --update, --jobs (same results as one process), --shard K/N and --merge."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES, MULTI_ATTENTION_WARNING, run_cli
from test_cli_check import drift, make_project
from test_cli_check import model_lines as all_model_lines

from shardcheck.gating.slices import parse_shard, shard_models


def model_lines(stdout: str, directory: Path | None = None) -> list[str]:
    """check's lines but the summary and the plan's (tests/planning's business), the
    project's directory spelled ``<dir>``."""
    lines = [line for line in all_model_lines(stdout) if not line.startswith("    plan:")]
    return lines if directory is None else [line.replace(str(directory), "<dir>") for line in lines]


def zoo(directory: Path, count: int) -> Path:
    """``count`` models (copies of three fixtures, names m000...), goldens up to date, and a
    manifest listing them; every third golden drifted, every fifth missing."""
    names = ("attention", "attention_head", "multi_attention")
    manifest = make_project(directory)
    lines = ["[tool.shardcheck]", 'golden-dir = "golden"']
    for number in range(count):
        source = names[number % 3]
        name = f"m{number:03d}"
        shutil.copy(FIXTURES / f"{source}.onnx", directory / "fixtures" / f"{name}.onnx")
        golden = directory / "golden" / f"{name}.json"
        shutil.copy(directory / "golden" / f"{source}.json", golden)
        if number % 3 == 1:
            drift(golden)
        if number % 5 == 4:
            golden.unlink()
        lines += ["[[tool.shardcheck.models]]", f'path = "fixtures/{name}.onnx"']
        lines += [f'golden = "golden/{name}.json"']
    for source in names:  # the three of make_project are stale now, but one
        if source != "attention":
            (directory / "golden" / f"{source}.json").unlink()
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def test_the_summary_counts_each_outcome_and_the_stale_goldens(tmp_path: Path) -> None:
    manifest = zoo(tmp_path, 6)

    result = run_cli("check", "--manifest", manifest, "--jobs", "1")

    assert result.exit_code == 1
    summary = result.stdout.splitlines()[-1]
    # m000 ok, m001 differs, m002 ok (warned), m003 ok, m004 differs and missing: missing,
    # m005 ok; golden/attention.json is claimed by no model.
    assert summary.startswith("6 models: 4 ok, 1 differs, 1 missing; 1 stale golden (")
    assert model_lines(result.stdout)[-1].startswith("STALE    golden/attention.json ")


def test_lines_stream_as_each_model_is_done(tmp_path: Path) -> None:
    """Each model's lines are handed out as soon as it is done: the library calls back once
    per model, in manifest order, before the run returns."""
    from shardcheck.gating.gate import run_check
    from shardcheck.gating.manifest import load_manifest

    manifest = zoo(tmp_path, 4)
    seen: list[str] = []
    result = run_check(load_manifest(manifest), on_result=lambda r: seen.append(r.entry.name))
    assert seen == ["m000", "m001", "m002", "m003"]
    assert [r.entry.name for r in result.models] == seen


def test_strict_fails_the_models_gen_warns_of(tmp_path: Path) -> None:
    manifest = make_project(tmp_path)

    plain = run_cli("check", "--manifest", manifest, "--jobs", "1")
    strict = run_cli("check", "--manifest", manifest, "--jobs", "1", "--strict")

    assert plain.exit_code == 0
    assert strict.exit_code == 1
    assert model_lines(strict.stdout) == [
        "ok       attention",
        "ok       attention_head",
        "WARNED   multi_attention (1 warning, strict)",
        f"    warning: {MULTI_ATTENTION_WARNING}",
    ]
    assert strict.stdout.splitlines()[-1].startswith("3 models: 2 ok, 1 warned (")


def test_strict_through_the_manifest_top_level_or_per_model(tmp_path: Path) -> None:
    manifest = make_project(tmp_path)
    text = manifest.read_text()
    manifest.write_text(text.replace("[tool.shardcheck]\n", "[tool.shardcheck]\nstrict = true\n"))
    assert run_cli("check", "--manifest", manifest, "--jobs", "1").exit_code == 1

    # The entry's own key wins over the table's.
    manifest.write_text(manifest.read_text() + "strict = false\n")  # the last model's entry
    assert run_cli("check", "--manifest", manifest, "--jobs", "1").exit_code == 0


def test_update_removes_stale_hints_goldens_but_no_other_file(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention",))
    stale = tmp_path / "golden" / "old.json"
    shutil.copy(tmp_path / "golden" / "attention.json", stale)
    notes = tmp_path / "golden" / "notes.json"
    notes.write_text('{"owner": "me"}\n')

    before = run_cli("check", "--manifest", manifest, "--jobs", "1")
    assert before.exit_code == 1
    assert model_lines(before.stdout)[1:] == [
        "STALE    golden/notes.json (no model in the manifest claims it; delete it or list its "
        "model)",
        "STALE    golden/old.json (no model in the manifest claims it; delete it, list its "
        "model, or run with --update to remove it)",
    ]

    updated = run_cli("check", "--manifest", manifest, "--jobs", "1", "--update")
    assert model_lines(updated.stdout)[1:] == [
        "REMOVED  golden/old.json (stale: no model in the manifest claimed it)",
        "STALE    golden/notes.json (no model in the manifest claims it; delete it or list its "
        "model)",
    ]
    assert not stale.exists()
    assert notes.read_text() == '{"owner": "me"}\n'
    assert json.loads(run_cli("check", "--manifest", manifest, "--format", "json").stdout)[
        "stale"
    ] == ["golden/notes.json"]


@pytest.mark.parametrize("update", [False, True])
def test_jobs_2_gives_the_lines_of_jobs_1_in_manifest_order(tmp_path: Path, update: bool) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir()
    second.mkdir()
    option = ("--update",) if update else ()
    serial = run_cli("check", "--manifest", zoo(first, 12), "--jobs", "1", *option)
    parallel = run_cli("check", "--manifest", zoo(second, 12), "--jobs", "2", *option)

    assert parallel.exit_code == serial.exit_code
    assert model_lines(parallel.stdout, second) == model_lines(serial.stdout, first)
    assert sorted(p.name for p in (second / "golden").iterdir()) == sorted(
        p.name for p in (first / "golden").iterdir()
    )
    for golden in (first / "golden").iterdir():
        assert (second / "golden" / golden.name).read_bytes() == golden.read_bytes()


def test_jobs_runs_a_model_whose_estimate_does_not_fit_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that needs more than the budget is not refused by the scheduler: it runs when
    nothing else does (verify then judges it), and every model still gets its result."""
    from shardcheck.gating import parallel
    from shardcheck.gating.manifest import load_manifest

    monkeypatch.setattr(parallel, "memory_need", lambda entry: 10**15)
    manifest = make_project(tmp_path, ("attention", "attention_head"))
    manifest.write_text(
        manifest.read_text().replace(
            "[[tool.shardcheck.models]]\n", "[[tool.shardcheck.models]]\nverify = true\n"
        )
    )
    entries = load_manifest(manifest).models
    results = list(parallel.check_models(entries, update=False, verify=True, jobs=2))
    assert [(r.entry.name, r.status, r.verify is not None and r.verify.ok) for r in results] == [
        ("attention", "ok", True),
        ("attention_head", "ok", True),
    ]


def test_shard_slices_are_contiguous_and_cover_the_manifest() -> None:
    models = list(range(10))
    slices = [shard_models(models, (k, 3)) for k in (1, 2, 3)]
    assert slices == [(0, 1, 2), (3, 4, 5), (6, 7, 8, 9)]
    assert shard_models(models, None) == tuple(models)
    assert shard_models([1], (2, 3)) == ()  # more slices than models: some are empty


@pytest.mark.parametrize("text", ["0/3", "4/3", "1/0", "a/b", "1-3", ""])
def test_a_bad_shard_is_one_line(text: str) -> None:
    with pytest.raises(Exception, match=r"--shard .*: expected K/N with 1 <= K <= N"):
        parse_shard(text)


def test_the_lines_of_the_slices_together_are_those_of_the_whole_run(tmp_path: Path) -> None:
    manifest = zoo(tmp_path, 10)
    whole = run_cli("check", "--manifest", manifest, "--jobs", "1", "--report", tmp_path / "w.json")
    reports = [tmp_path / f"r{k}.json" for k in (1, 2, 3)]
    slices = [
        run_cli(
            "check", "--manifest", manifest, "--jobs", "1", "--shard", f"{k}/3", "--report", report
        )
        for k, report in zip((1, 2, 3), reports, strict=True)
    ]

    together = [line for result in slices for line in model_lines(result.stdout)]
    assert together == model_lines(whole.stdout)
    assert [result.exit_code for result in slices] == [1, 1, 1]  # each has a failing model

    merged = run_cli(
        "check",
        "--merge",
        reports[2],
        "--merge",
        reports[0],
        "--merge",
        reports[1],
        "--report",
        tmp_path / "m.json",
    )
    assert merged.exit_code == whole.exit_code == 1
    assert model_lines(merged.stdout) == model_lines(whole.stdout)
    assert (
        merged.stdout.splitlines()[-1].split(" (")[0]
        == whole.stdout.splitlines()[-1].split(" (")[0]
    )
    merged_report = json.loads((tmp_path / "m.json").read_text())
    whole_report = json.loads((tmp_path / "w.json").read_text())
    for key in ("manifest", "ok", "models", "stale", "lines"):
        assert merged_report[key] == whole_report[key], key


def test_merge_refuses_reports_that_are_not_the_slices_of_one_run(tmp_path: Path) -> None:
    manifest = zoo(tmp_path, 4)
    for k in (1, 2):
        run_cli(
            "check",
            "--manifest",
            manifest,
            "--shard",
            f"{k}/2",
            "--report",
            tmp_path / f"r{k}.json",
        )
    run_cli("check", "--manifest", manifest, "--report", tmp_path / "whole.json")

    missing = run_cli("check", "--merge", tmp_path / "r1.json")
    assert missing.exit_code == 2
    assert missing.stderr == (
        f"shardcheck: error: {tmp_path / 'r1.json'}: the reports of slices 2/2 are missing\n"
    )
    twice = run_cli("check", "--merge", tmp_path / "r1.json", "--merge", tmp_path / "r1.json")
    assert "slice 1/2 is also" in twice.stderr and twice.exit_code == 2
    not_a_slice = run_cli("check", "--merge", tmp_path / "whole.json")
    assert not_a_slice.stderr.endswith("not the report of a slice (check --shard K/N)\n")
    with_update = run_cli("check", "--merge", tmp_path / "r1.json", "--update")
    assert with_update.exit_code == 2 and with_update.stderr.startswith(
        "shardcheck: error: --merge:"
    )


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ignore_leaves_a_code_of_gen_out_and_strict_then_passes(tmp_path: Path, jobs: str) -> None:
    # multi_attention's one warning is SC304 (the ranks of its second layer are unknown).
    manifest = make_project(tmp_path)
    args = ("check", "--manifest", manifest, "--jobs", jobs, "--strict")

    warned = run_cli(*args)
    ignored = run_cli(*args, "--ignore", "SC304")

    assert warned.exit_code == 1 and "WARNED   multi_attention" in warned.stdout
    assert ignored.exit_code == 0, ignored.stdout
    assert model_lines(ignored.stdout) == [
        "ok       attention",
        "ok       attention_head",
        "ok       multi_attention",
    ]
    assert run_cli(*args, "--ignore", "SC999").exit_code == 2  # not a code


def test_quiet_shows_only_what_fails_then_the_summary(tmp_path: Path) -> None:
    manifest = make_project(tmp_path)
    passing = run_cli("check", "--manifest", manifest, "--jobs", "1", "-q")
    assert passing.exit_code == 0
    assert model_lines(passing.stdout) == []  # multi_attention's warning left out too
    assert passing.stdout.splitlines()[-1].startswith("3 models: 3 ok (")

    drift(tmp_path / "golden" / "attention.json")
    failing = run_cli("check", "--manifest", manifest, "--jobs", "1", "-q")
    assert failing.exit_code == 1
    lines = model_lines(failing.stdout)
    assert lines[0].startswith("DIFFERS  attention")
    assert not any("warning" in line for line in lines)
