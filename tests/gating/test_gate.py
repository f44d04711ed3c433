"""The gate as a library: statuses, lines, goldens written only when they should be."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import FIXTURES, MULTI_ATTENTION_WARNING

from shardcheck.errors import InputError
from shardcheck.gating.gate import (
    CREATED,
    DIFFERS,
    ERROR,
    INVALID,
    OK,
    UPDATED,
    run_check,
    run_verify,
)
from shardcheck.gating.manifest import Manifest, load_manifest
from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.graph.loader import load_index
from shardcheck.hints.codec import dumps
from shardcheck.hints.files import read_hints
from shardcheck.hints.model import ShardHints

MODELS = ("attention", "attention_head", "multi_attention")
OLD_MTIME_NS = 1_000_000_000_000_000_000  # 2001: any write by the gate changes it


def generated(name: str) -> str:
    """The hints text gen writes today for a fixture (default options)."""
    return dumps(generate(load_index(FIXTURES / f"{name}.onnx"), GenOptions()).hints)


def make_project(tmp_path: Path, models: tuple[str, ...] = MODELS) -> Path:
    """Fixture models with up-to-date goldens in ``tmp_path``, and a shardcheck.toml."""
    (tmp_path / "fixtures").mkdir()
    (tmp_path / "golden").mkdir()
    lines = ["[tool.shardcheck]", 'golden-dir = "golden"']
    for name in models:
        shutil.copy(FIXTURES / f"{name}.onnx", tmp_path / "fixtures")
        (tmp_path / "golden" / f"{name}.json").write_text(generated(name))
        lines += [
            "[[tool.shardcheck.models]]",
            f'path = "fixtures/{name}.onnx"',
            f'golden = "golden/{name}.json"',
        ]
    manifest = tmp_path / "shardcheck.toml"
    manifest.write_text("\n".join(lines) + "\n")
    for golden in (tmp_path / "golden").iterdir():
        os.utime(golden, ns=(OLD_MTIME_NS, OLD_MTIME_NS))
    return manifest


def golden_state(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def with_reduce_op(hints: ShardHints, reduce_op: str) -> ShardHints:
    return hints.with_changes(dist_collectives=replace(hints.dist_collectives, reduce_op=reduce_op))


def check(manifest_path: Path, **kwargs: bool) -> tuple[Manifest, list[str]]:
    manifest = load_manifest(manifest_path)
    result = run_check(manifest, **kwargs)
    return manifest, result.lines()


def test_matching_goldens_are_ok(tmp_path: Path) -> None:
    result = run_check(load_manifest(make_project(tmp_path)))

    assert result.ok
    assert [r.status for r in result.models] == [OK, OK, OK]
    assert result.lines() == [
        "ok       attention",
        "ok       attention_head",
        "ok       multi_attention",
        f"    warning: {MULTI_ATTENTION_WARNING}",
    ]
    assert result.written == ()


def test_changed_golden_differs_and_names_each_difference(tmp_path: Path) -> None:
    manifest = make_project(tmp_path)
    golden = tmp_path / "golden" / "attention_head.json"
    golden.write_text(dumps(with_reduce_op(read_hints(golden), "sum")))

    result = run_check(load_manifest(manifest))

    assert not result.ok
    assert [r.status for r in result.models] == [OK, DIFFERS, OK]
    # The golden says "sum"; generation gives the default "max".
    assert result.lines() == [
        "ok       attention",
        "DIFFERS  attention_head (1 difference)",
        '    dist_collectives.reduce_op: "sum" -> "max"',
        "ok       multi_attention",
        f"    warning: {MULTI_ATTENTION_WARNING}",
    ]


def test_update_rewrites_only_the_differing_golden(tmp_path: Path) -> None:
    manifest = make_project(tmp_path)
    changed = tmp_path / "golden" / "attention_head.json"
    expected = changed.read_text()
    changed.write_text(dumps(with_reduce_op(read_hints(changed), "sum")))
    os.utime(changed, ns=(OLD_MTIME_NS, OLD_MTIME_NS))
    before = golden_state(tmp_path / "golden")

    result = run_check(load_manifest(manifest), update=True)

    assert result.ok
    assert [r.status for r in result.models] == [OK, UPDATED, OK]
    assert [r.entry.name for r in result.written] == ["attention_head"]
    assert result.lines()[1] == (
        "UPDATED  attention_head (rewrote golden/attention_head.json: 1 difference)"
    )
    after = golden_state(tmp_path / "golden")
    assert changed.read_text() == expected
    assert after["attention_head.json"][1] != OLD_MTIME_NS
    del before["attention_head.json"], after["attention_head.json"]
    # The golden written gets its plan beside it (tests/planning/test_plan_golden.py).
    assert "attention_head.plan" not in before and after.pop("attention_head.plan")
    assert after == before
    assert run_check(load_manifest(manifest)).ok


def test_missing_golden_fails_and_update_creates_it(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention",))
    with manifest.open("a") as stream:
        stream.write('[[tool.shardcheck.models]]\nname = "gpt2"\n')
        stream.write('path = "fixtures/attention.onnx"\ngolden = "golden/new/gpt2.json"\n')

    _, lines = check(manifest)
    assert lines == [
        "ok       attention",
        "MISSING  gpt2 (no golden: golden/new/gpt2.json; run with --update)",
    ]
    assert not (tmp_path / "golden" / "new").exists()

    result = run_check(load_manifest(manifest), update=True)

    assert result.ok
    assert result.models[1].status == CREATED
    assert result.lines()[1] == "CREATED  gpt2 (wrote golden/new/gpt2.json)"
    assert (tmp_path / "golden/new/gpt2.json").read_text() == generated("attention")


def test_model_that_fails_to_load_is_an_error_and_its_golden_is_untouched(tmp_path: Path) -> None:
    manifest = make_project(tmp_path)
    (tmp_path / "fixtures" / "attention_head.onnx").write_bytes(b"\x08\x07garbage")
    golden = tmp_path / "golden" / "attention_head.json"
    golden.write_text('{"stale": true}\n')
    os.utime(golden, ns=(OLD_MTIME_NS, OLD_MTIME_NS))
    before = golden_state(tmp_path / "golden")

    result = run_check(load_manifest(manifest), update=True)

    assert not result.ok
    assert [r.status for r in result.models] == [OK, ERROR, OK]
    line = result.lines()[1]
    assert line.startswith(
        f"ERROR    attention_head: {tmp_path}/fixtures/attention_head.onnx: not a readable ONNX "
        "model"
    )
    assert golden_state(tmp_path / "golden") == before


def test_unreadable_golden_is_invalid_and_update_replaces_it(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention",))
    golden = tmp_path / "golden" / "attention.json"
    golden.write_text('{"parallelism": "CP"')

    result = run_check(load_manifest(manifest))
    assert result.models[0].status == INVALID
    assert result.lines() == [
        f"INVALID  attention ({golden}: not valid JSON (Expecting ',' delimiter at line 1 "
        "column 21); run with --update)"
    ]

    updated = run_check(load_manifest(manifest), update=True)
    assert updated.ok
    assert updated.models[0].status == UPDATED
    assert golden.read_text() == generated("attention")


def test_gen_options_of_the_entry_are_used(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention",))
    text = manifest.read_text().replace(
        'golden = "golden/attention.json"',
        'golden = "golden/attention.json"\ngen = { cp-type = "fused", is-causal = true }',
    )
    manifest.write_text(text)

    result = run_check(load_manifest(manifest))

    # fused: no K/V gather, the layer (Q is the graph input q) is replaced by a causal fused op,
    # which gen warns of: the layer has no causal mask.
    assert result.lines() == [
        "DIFFERS  attention (2 differences)",
        "    warning: the fused attention is told is_causal true for every layer, but the mask of "
        "1 layer (attn_mm1) is not causal; verify reports it (SC124)",
        "    warning: 1 attention layer of 1 replaced as the fused options say, although the "
        "first, attn_mm1, does not fit a fused attention: its Q, K, V and output have ranks 3, "
        "3, 3, 3, not 4 each ([batch, heads, seq, head_dim]); check with 'shardcheck verify "
        f"{manifest.parent / 'fixtures' / 'attention.onnx'} HINTS --ranks N'",
        "    attention_layers[q=q].gather_kv: true -> false",
        '    attention_layers[q=q].replace: null -> {"is_causal": true, "k_shuffle": null, '
        '"nb_rank": 1, "q_shuffle": null, "v_shuffle": null}',
    ]


def test_unclaimed_goldens_are_stale(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention",))
    (tmp_path / "golden" / "old.json").write_text("{}")
    (tmp_path / "golden" / "sub").mkdir()
    (tmp_path / "golden" / "sub" / "older.json").write_text("{}")
    (tmp_path / "golden" / "notes.txt").write_text("not a golden")
    (tmp_path / "golden" / ".attention.json.x1.tmp").write_text("left by a killed run")
    (tmp_path / "golden" / ".cache").mkdir()
    (tmp_path / "golden" / ".cache" / "hidden.json").write_text("{}")

    result = run_check(load_manifest(manifest))

    assert not result.ok
    assert result.models[0].ok
    assert result.lines()[1:] == [
        "STALE    golden/old.json (no model in the manifest claims it; delete it or list its "
        "model)",
        "STALE    golden/sub/older.json (no model in the manifest claims it; delete it or list "
        "its model)",
    ]
    assert result.to_json()["stale"] == ["golden/old.json", "golden/sub/older.json"]


def test_without_golden_dir_nothing_is_stale(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention",))
    manifest.write_text(manifest.read_text().replace('golden-dir = "golden"\n', ""))
    (tmp_path / "golden" / "old.json").write_text("{}")

    assert run_check(load_manifest(manifest)).ok


def test_json_report(tmp_path: Path) -> None:
    manifest = make_project(tmp_path, ("attention", "attention_head"))
    golden = tmp_path / "golden" / "attention_head.json"
    golden.write_text(dumps(with_reduce_op(read_hints(golden), "min")))

    document = run_check(load_manifest(manifest)).to_json()

    assert document["ok"] is False
    assert (document["update"], document["verify"], document["stale"]) == (False, False, [])
    assert document["manifest"] == str(manifest)
    assert document["models"][1] == {
        "name": "attention_head",
        "model": "fixtures/attention_head.onnx",
        "golden": "golden/attention_head.json",
        "status": DIFFERS,
        "ok": False,
        "error": None,
        "golden_problem": None,
        "differences": [
            {
                "kind": "changed",
                "path": "dist_collectives.reduce_op",
                "golden": "min",
                "candidate": "max",
            }
        ],
        "warnings": [],
        "held_back": False,
        "plan": document["models"][1]["plan"],  # tests/planning/test_plan_golden.py
        "extension": None,  # tests/gating/test_extension_golden.py
        "verify": None,
    }
    assert document["models"][1]["plan"]["status"] == "unrecorded"
    assert document["models"][0]["status"] == OK


def test_verify_request_without_verify_module_is_an_input_error_before_any_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "shardcheck.verification.verify", None)  # import now fails
    manifest = make_project(tmp_path, ("attention",))
    golden = tmp_path / "golden" / "attention.json"
    golden.write_text(dumps(with_reduce_op(read_hints(golden), "min")))
    before = golden.read_bytes()

    with pytest.raises(InputError) as error:
        run_check(load_manifest(manifest), update=True, verify=True)

    assert error.value.message == "verify is not available in this version"
    assert golden.read_bytes() == before


def test_verify_runs_only_for_entries_that_ask_with_their_settings(tmp_path: Path) -> None:
    verify_module = importlib.import_module("shardcheck.verification.verify")
    manifest_path = make_project(tmp_path, ("attention", "attention_head"))
    text = manifest_path.read_text().replace(
        'golden = "golden/attention.json"',
        'golden = "golden/attention.json"\nverify = true\nranks = 2\nseq-lens = [4, 8]',
    )
    manifest_path.write_text(text)
    manifest = load_manifest(manifest_path)

    result = run_check(manifest, verify=True)

    verified, not_asked = result.models
    assert not_asked.verify is None
    assert verified.verify is not None
    hints = read_hints(tmp_path / "golden" / "attention.json")
    direct = verify_module.verify(
        str(tmp_path / "fixtures" / "attention.onnx"),
        hints,
        ranks=2,
        seq_lens=(4, 8),
        hints_source="the hints gen writes",
    )
    # Same settings, same report.
    assert verified.verify.ok == direct.ok
    assert verified.verify.text == direct.render_text()
    assert verified.verify.report == direct.to_json()
    again = run_verify(manifest.models[0], hints)
    assert (again.ok, again.text) == (verified.verify.ok, verified.verify.text)
    assert result.to_json()["models"][0]["verify"]["ok"] == direct.ok


@pytest.mark.parametrize(
    ("tolerances", "said"),
    # float32 outputs: verify's defaults for them, unless the entry gives its own.
    [("", "rtol 0.0001, atol 1e-05"), ("rtol = 0.5\natol = 0.25\n", "rtol 0.5, atol 0.25")],
)
def test_check_verify_simulates_cp_on_2_ranks_and_fails_hints_the_simulation_rejects(
    tmp_path: Path, tolerances: str, said: str
) -> None:
    # GPT-2 with gen's --io graph (Polygraphy's cut of the graph inputs): its axes fit, but each
    # rank counts its positions from 0, which only the simulation shows. The entry names no
    # ranks: check --verify simulates on verify's 2, as plain verify does.
    shutil.copy(FIXTURES / "real" / "ts_gpt2_tiny.onnx", tmp_path)
    options = GenOptions.from_mapping({"io": "graph"})
    hints = generate(load_index(tmp_path / "ts_gpt2_tiny.onnx"), options).hints
    (tmp_path / "gpt2.json").write_text(dumps(hints))
    manifest_path = tmp_path / "shardcheck.toml"
    manifest_path.write_text(
        '[[tool.shardcheck.models]]\npath = "ts_gpt2_tiny.onnx"\ngolden = "gpt2.json"\n'
        'gen = { io = "graph" }\nverify = true\n' + tolerances
    )
    [result] = run_check(load_manifest(manifest_path), verify=True).models
    assert result.golden is not None and result.golden.status == "ok"
    assert result.status == "failed"
    assert result.verify is not None and result.verify.report is not None
    runs = [run for run in result.verify.report["runs"] if run.get("simulation")]
    assert [(run["ranks"], run["seq_len"], run["ok"]) for run in runs] == [(2, 8, False)]
    [error] = [f for f in result.verify.report["findings"] if f["level"] == "error"]
    assert error["code"] == "SC201" and f"dims batch=1, sequence=8, {said}." in error["message"]
