"""``check --verify`` proves the extension gen writes beside the hints, by the simulation of
``shardcheck verify MODEL EXT``: a broken extension fails the model, naming its file."""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES, GOLDEN, run_cli

import shardcheck.gating.gate as gate
from shardcheck.generation.options import GenOptions
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.files import read_hints
from shardcheck.hints.model import ShardHints

# One block that gives out its Q: its extension gathers Q for that graph output alone
# (gathered_for_output), and the ranks' layer computes on their queries.
NAME = "ts_query_given_out"
MODEL = FIXTURES / "real" / f"{NAME}.onnx"
EXTENSION = GOLDEN / "real" / f"{NAME}.shardcheck.json"
EXTENSION_TEXT = "golden/model.shardcheck.json"


def project(directory: Path, *, extension: Path = EXTENSION, name: str = NAME) -> Path:
    """A manifest gating a copy of the model against its project goldens, with ``extension``
    as the extension's, verify = true."""
    (directory / "golden").mkdir(exist_ok=True)
    shutil.copy(MODEL, directory / "model.onnx")
    shutil.copy(GOLDEN / "real" / f"{NAME}.json", directory / "golden" / "model.json")
    if extension == EXTENSION:  # the plan recorded is the golden extension's (none: passes)
        shutil.copy(GOLDEN / "real" / f"{NAME}.plan", directory / "golden" / "model.plan")
    shutil.copy(extension, directory / EXTENSION_TEXT)
    manifest = directory / "shardcheck.toml"
    manifest.write_text(
        "[tool.shardcheck]\n"
        'golden-dir = "golden"\n'
        "[[tool.shardcheck.models]]\n"
        f'name = "{name}"\n'
        'path = "model.onnx"\n'
        'golden = "golden/model.json"\n'
        "verify = true\n"
        "ranks = 2\n"
    )
    return manifest


def broken_extension(directory: Path) -> Path:
    """The model's extension with its gathered_for_output removed: Q is then gathered for the
    layer too, which computes every query, and the Reshape of its output to a rank's length
    (read off the scattered input) cannot take them."""
    document = json.loads(EXTENSION.read_text())
    assert document["gathered_for_output"] == ["q"]
    del document["gathered_for_output"]
    path = directory / "broken.shardcheck.json"
    path.write_text(json.dumps(document, indent=4) + "\n")
    return path


@pytest.fixture
def gen_writes(monkeypatch: pytest.MonkeyPatch) -> object:
    """``gen_writes(path)``: from now on gen writes the extension in ``path`` for the gated
    model (``model.onnx``), as a regression of gen would (its hints are gen's own)."""
    real = gate.generate

    def install(path: Path) -> None:
        extension = read_hints(path)

        def generate(index: GraphIndex, options: GenOptions) -> object:
            result = real(index, options)
            if Path(index.source).name != "model.onnx":
                return result
            assert result.extension is not None
            return dataclasses.replace(
                result, extension=dataclasses.replace(result.extension, hints=extension)
            )

        monkeypatch.setattr(gate, "generate", generate)

    return install


def verify_file(model: Path, hints: Path | ShardHints) -> object:
    verify = importlib.import_module("shardcheck.verification.verify").verify
    return verify(str(model), hints, ranks=2)


def test_the_broken_extension_fails_verify_where_the_golden_passes(tmp_path: Path) -> None:
    # By hand, as `shardcheck verify MODEL EXT --ranks 2`: the golden passes, the broken fails
    # in the simulation (SC201) at the Reshape that gets every query.
    assert verify_file(MODEL, EXTENSION).ok
    broken = verify_file(MODEL, broken_extension(tmp_path))
    assert not broken.ok
    (finding,) = [f for f in broken.findings if f.level == "error"]
    assert finding.code == "SC201" and "/block/Reshape_2" in finding.message


def test_check_verify_verifies_the_extension_and_says_so(tmp_path: Path) -> None:
    manifest = project(tmp_path)

    result = run_cli("check", "--manifest", manifest, "--verify", "--format", "json")

    assert result.exit_code == 0, result.stdout
    model = json.loads(result.stdout)["models"][0]
    verify = model["verify"]
    assert (verify["ok"], verify["failed"]) == (True, [])
    assert verify["extension"]["path"] == EXTENSION_TEXT
    assert verify["extension"]["ok"] is True
    # The extension's report is verify's of the extension at the entry's settings.
    direct = verify_file(tmp_path / "model.onnx", read_hints(EXTENSION))
    report = verify["extension"]["report"]
    assert report["findings"] == direct.to_json()["findings"]
    assert report["hints"] == f"the extension gen writes (golden {EXTENSION_TEXT})"
    text = run_cli("check", "--manifest", manifest, "--verify").stdout
    assert text.splitlines()[0] == f"ok       {NAME} (verified; extension verified)"


def test_a_golden_with_a_broken_extension_fails_check_verify_naming_it(
    tmp_path: Path, gen_writes: object
) -> None:
    broken = broken_extension(tmp_path)
    manifest = project(tmp_path, extension=broken)
    gen_writes(broken)  # type: ignore[operator]
    # Without verify the broken extension is what gen writes and what the golden holds: the
    # gate passes. Only the simulation shows that it is wrong.
    assert run_cli("check", "--manifest", manifest).exit_code == 0

    result = run_cli("check", "--manifest", manifest, "--verify")

    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0] == f"FAILED   {NAME} (verified; the extension fails verify)"
    assert lines[1] == (
        f"    extension {EXTENSION_TEXT} (the plan 'shardcheck shard' carries out): fails "
        "verify: SC201 simulated CP differs from single device"
    )
    assert lines[2] == (
        f"    verify {tmp_path / 'model.onnx'} with the extension gen writes "
        f"(golden {EXTENSION_TEXT})"
    )
    assert any("SC201 error: mismatch" in line and "/block/Reshape_2" in line for line in lines)
    assert lines[-1].startswith("1 model: 1 failed")
    document = json.loads(
        run_cli("check", "--manifest", manifest, "--verify", "--format", "json").stdout
    )
    (model,) = document["models"]
    assert (model["status"], document["ok"]) == ("failed", False)
    assert (model["verify"]["ok"], model["verify"]["failed"]) == (False, ["extension"])
    assert model["verify"]["report"]["ok"] is True  # the hints pass
    assert model["verify"]["extension"]["ok"] is False
    assert model["verify"]["extension"]["path"] == EXTENSION_TEXT


def test_update_writes_no_golden_of_an_extension_that_fails_verify(
    tmp_path: Path, gen_writes: object
) -> None:
    broken = broken_extension(tmp_path)
    manifest = project(tmp_path)
    extension = tmp_path / EXTENSION_TEXT
    before = extension.read_bytes()
    gen_writes(broken)  # type: ignore[operator]

    result = run_cli("check", "--manifest", manifest, "--update", "--verify")

    assert result.exit_code == 1
    assert result.stdout.splitlines()[0] == (
        f"DIFFERS  {NAME} (not written: the extension fails verify; verified; the extension "
        "fails verify)"
    )
    assert extension.read_bytes() == before
    # Without verify, --update takes it (nothing proves it wrong).
    assert run_cli("check", "--manifest", manifest, "--update").exit_code == 0
    assert read_hints(extension) == read_hints(broken)


def with_second_model(manifest: Path) -> None:
    """A second model, gated and verified with its own (correct) extension."""
    directory = manifest.parent
    shutil.copy(FIXTURES / "real" / "dynamo_query_given_out.onnx", directory / "other.onnx")
    for suffix in (".json", ".plan", ".shardcheck.json"):
        shutil.copy(
            GOLDEN / "real" / f"dynamo_query_given_out{suffix}", directory / f"golden/other{suffix}"
        )
    manifest.write_text(
        manifest.read_text()
        + '[[tool.shardcheck.models]]\npath = "other.onnx"\ngolden = "golden/other.json"\n'
        "verify = true\nranks = 2\n"
    )


def test_jobs_print_the_lines_of_a_serial_run(tmp_path: Path) -> None:
    manifest = project(tmp_path)
    with_second_model(manifest)
    serial = run_cli("check", "--manifest", manifest, "--verify", "--jobs", "1")
    assert serial.exit_code == 0, serial.stdout
    assert serial.stdout.splitlines()[:2] == [
        f"ok       {NAME} (verified; extension verified)",
        "ok       other (verified; extension verified)",
    ]
    spread = run_cli("check", "--manifest", manifest, "--verify", "--jobs", "2")
    assert spread.stdout.splitlines()[:-1] == serial.stdout.splitlines()[:-1]


def test_shards_merge_into_the_report_of_the_whole_run(tmp_path: Path, gen_writes: object) -> None:
    broken = broken_extension(tmp_path)
    manifest = project(tmp_path, extension=broken)
    with_second_model(manifest)
    gen_writes(broken)  # type: ignore[operator]
    whole = run_cli("check", "--manifest", manifest, "--verify", "--jobs", "1")
    assert whole.exit_code == 1
    arguments = []
    for k in (1, 2):  # one model each: checked in this process, where gen is the broken one
        report = tmp_path / f"report-{k}.json"
        sliced = run_cli(
            "check", "--manifest", manifest, "--verify", "--shard", f"{k}/2", "--report", report
        )
        assert sliced.exit_code == (1 if k == 1 else 0), sliced.stdout
        arguments += ["--merge", str(report)]
    document = json.loads(run_cli("check", *arguments, "--format", "json").stdout)
    assert [m["verify"]["failed"] for m in document["models"]] == [["extension"], []]
    assert document["lines"] == whole.stdout.splitlines()[:-1]


def test_the_plugin_verify_item_fails_on_the_extension_as_check_does(
    pytester: pytest.Pytester, gen_writes: object
) -> None:
    broken = broken_extension(pytester.path)
    project(pytester.path, extension=broken)
    gen_writes(broken)  # type: ignore[operator]

    result = pytester.runpytest("-p", "no:hypothesispytest", "--shardcheck")

    # gen's item passes (the golden holds what gen writes); verify's fails on the extension.
    result.assert_outcomes(passed=2, failed=1)
    output = result.stdout.str()
    assert f"{NAME}::verify" in output and "Traceback" not in output
    assert (
        f"extension {EXTENSION_TEXT} (the plan 'shardcheck shard' carries out): fails verify: "
        "SC201 simulated CP differs from single device"
    ) in output
    assert f"with the extension gen writes (golden {EXTENSION_TEXT})" in output
    assert "SC201 error: mismatch" in output


def test_the_plugin_verify_item_passes_with_a_good_extension(pytester: pytest.Pytester) -> None:
    project(pytester.path)
    result = pytester.runpytest("-p", "no:hypothesispytest", "--shardcheck", "-k", "verify")
    result.assert_outcomes(passed=1, deselected=2)
