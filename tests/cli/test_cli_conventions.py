"""The conventions every command keeps: bare usage, exit codes in --help, --format json (errors
included), fmt --check, progress on stderr only, gen's -q and --ignore, SHARDCHECK_DEBUG."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, GOLDEN, ROOT, run_cli

from shardcheck.cli import cli

GPT2 = FIXTURES / "real" / "ts_gpt2_tiny.onnx"
GPT2_HINTS = GOLDEN / "real" / "ts_gpt2_tiny.json"
COMMANDS = sorted(cli.list_commands(None))  # type: ignore[arg-type]


def test_a_bare_shardcheck_prints_its_usage_on_lines_of_their_own() -> None:
    result = run_cli()
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    # (Run in-process, click names the program after the function, cli.)
    assert lines[0].startswith("Usage: ") and lines[0].endswith(" [OPTIONS] COMMAND [ARGS]...")
    # Each command on its own line, not squashed into one error line.
    assert "shardcheck: error" not in result.stderr
    for command in ("gen", "verify", "shard", "simulate", "diff", "check", "fmt"):
        assert any(line.split()[:1] == [command] for line in lines), command


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_lists_its_exit_codes(command: str) -> None:
    result = run_cli(command, "--help")
    assert result.exit_code == 0
    section = result.stdout.split("Exit codes:\n", 1)
    assert len(section) == 2, result.stdout
    codes = [line.split()[0] for line in section[1].splitlines() if line.strip()]
    assert codes[0] == "0" and codes[-1] == "2", section[1]


def test_fmt_check_exits_1_on_a_file_not_in_canonical_form(tmp_path: Path) -> None:
    canonical = GOLDEN / "attention.json"
    compact = tmp_path / "compact.json"
    compact.write_text(json.dumps(json.loads(canonical.read_text())))  # valid, one line
    before = compact.read_bytes()
    assert run_cli("fmt", "--check", canonical).exit_code == 0
    result = run_cli("fmt", "--check", canonical, compact)
    assert result.exit_code == 1
    assert result.stdout == (
        f"{compact}: not in canonical form; 'shardcheck fmt {compact} -o {compact}' fixes it\n"
    )
    assert compact.read_bytes() == before  # --check writes nothing
    # fmt writes the canonical form, which --check then accepts.
    assert run_cli("fmt", compact, "-o", compact).exit_code == 0
    assert compact.read_text() == canonical.read_text()
    assert run_cli("fmt", "--check", compact).exit_code == 0
    # Invalid hints are bad input, not "not canonical".
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert run_cli("fmt", "--check", broken).exit_code == 2


def test_the_pre_commit_hook_of_fmt_runs_fmt_check() -> None:
    hooks = (ROOT / ".pre-commit-hooks.yaml").read_text()
    assert "- id: shardcheck-fmt\n" in hooks
    assert "  entry: shardcheck fmt --check\n" in hooks


def _json_run(*args: object) -> tuple[int, dict[str, object]]:
    result = run_cli(*args, "--format", "json")
    document = json.loads(result.stdout)
    # Every command's object says whether it succeeded, as its exit code does, and a value it
    # does not have is null, not "".
    assert document["ok"] is (result.exit_code == 0), document
    assert "" not in _values(document), document
    return result.exit_code, document


def _values(value: object) -> list[object]:
    """Every value in a JSON document, nested ones included."""
    if isinstance(value, dict):
        return [inner for item in value.values() for inner in [item, *_values(item)]]
    if isinstance(value, list):
        return [inner for item in value for inner in [item, *_values(item)]]
    return []


def test_format_json_works_on_every_command(tmp_path: Path) -> None:
    code, gen = _json_run("gen", GPT2, "-o", tmp_path / "h.json")
    assert code == 0
    assert [w["code"] for w in gen["warnings"]] == ["SC110"]  # type: ignore[index]
    assert gen["hints"] is None  # written to the file, not to stdout
    code, to_stdout = _json_run("gen", GPT2, "-o", "-")
    assert to_stdout["hints"] == json.loads((tmp_path / "h.json").read_text())
    code, shard = _json_run("shard", GPT2, GPT2_HINTS, "-o", tmp_path / "md.onnx")
    assert code == 0 and (tmp_path / "md.onnx").exists()
    operations = {c["operation"] for c in shard["collectives"]}  # type: ignore[attr-defined]
    assert operations == {"reduce_scatter", "all_gather"}
    code, simulated = _json_run("simulate", GPT2, GPT2_HINTS, "--ranks", "2", "--seq-len", "8")
    assert (code, simulated["ok"], simulated["mismatch"]) == (0, True, None)
    code, formatted = _json_run("fmt", GPT2_HINTS, "-o", tmp_path / "f.json")
    assert (code, formatted["ok"]) == (0, True)
    code, checked = _json_run("fmt", "--check", GPT2_HINTS)
    assert (code, checked["not_canonical"]) == (0, [])
    code, differences = _json_run("diff", GPT2_HINTS, tmp_path / "f.json")
    assert (code, differences["equal"]) == (0, True)
    code, verified = _json_run("verify", GPT2, GPT2_HINTS)
    assert (code, verified["ok"]) == (0, True)
    gated = tmp_path / "gated"  # the manifest's paths are inside its directory
    gated.mkdir()
    shutil.copy(FIXTURES / "attention.onnx", gated / "attention.onnx")
    shutil.copy(GOLDEN / "attention.json", gated / "attention.json")
    (gated / "shardcheck.toml").write_text(
        '[tool.shardcheck]\n[[tool.shardcheck.models]]\npath = "attention.onnx"\n'
        'golden = "attention.json"\n'
    )
    code, checked = _json_run("check", "--manifest", gated / "shardcheck.toml")
    models = checked["models"]
    assert code == 0 and [model["ok"] for model in models] == [True]  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", COMMANDS)
def test_under_format_json_an_error_is_a_json_object_on_stdout(
    command: str, tmp_path: Path
) -> None:
    missing = tmp_path / "missing.onnx"
    args = {
        "check": ["--manifest", missing],
        "diff": [missing, GPT2_HINTS],
        "fmt": [missing, "-o", "-"],
        "gen": [missing, "-o", "-"],
        "shard": [missing, GPT2_HINTS, "-o", tmp_path / "md.onnx"],
        "simulate": [missing, GPT2_HINTS, "--ranks", "2", "--seq-len", "8"],
        "verify": [missing, GPT2_HINTS],
    }.get(command, [missing])
    result = run_cli(command, *args, "--format", "json")
    assert result.exit_code == 2
    assert json.loads(result.stdout) == {"ok": False, "error": f"{missing}: no such file"}
    assert result.stderr == f"shardcheck: error: {missing}: no such file\n"
    # A usage error too.
    usage = run_cli(command, "--no-such-option", "--format", "json")
    assert usage.exit_code == 2
    assert "no such option" in json.loads(usage.stdout)["error"].lower()


def test_errors_stay_text_without_format_json(tmp_path: Path) -> None:
    result = run_cli("diff", tmp_path / "missing.json", GPT2_HINTS)
    assert (result.exit_code, result.stdout) == (2, "")


def test_progress_goes_to_stderr_only_and_quiet_silences_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shardcheck.cli import progress

    # Shown from the start instead of after a second (what is shown is the point, not when),
    # as on a terminal: elsewhere nothing is shown.
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)
    args = ("simulate", GPT2, GPT2_HINTS, "--ranks", "2", "--seq-len", "8")
    assert run_cli(*args).stderr == ""
    monkeypatch.setattr(progress, "_is_terminal", lambda: True)
    result = run_cli(*args, "--format", "json")
    assert result.exit_code == 0
    assert "shardcheck: simulating CP on 2 ranks at sequence length 8..." in result.stderr
    assert json.loads(result.stdout)["ok"] is True  # stdout is the JSON alone
    verified = run_cli("verify", GPT2, GPT2_HINTS, "--ranks", "2")
    assert "shardcheck: simulating CP on 2 ranks at sequence length 16..." in verified.stderr
    quiet = run_cli(*args, "-q")
    assert (quiet.exit_code, quiet.stdout, quiet.stderr) == (0, "", "")


def test_gen_quiet_and_ignore_leave_its_warnings_out(tmp_path: Path) -> None:
    out = tmp_path / "h.json"
    warned = run_cli("gen", GPT2, "-o", out)
    [skipped] = [line for line in warned.stderr.splitlines() if "Polygraphy's patterns" in line]
    assert skipped.startswith(f"shardcheck: warning: {GPT2}: 2 of 2 attention layers")
    assert skipped.endswith(" [SC110]")
    written = out.read_text()
    quiet = run_cli("gen", GPT2, "-o", out, "-q")
    assert (quiet.exit_code, quiet.stderr) == (0, "")
    assert out.read_text() == written  # the same hints
    for ignore in ("SC110", "sc110"):
        result = run_cli("gen", GPT2, "-o", out, "--ignore", ignore)
        assert result.exit_code == 0
        assert "[SC110]" not in result.stderr and "Polygraphy's patterns" not in result.stderr
        assert out.read_text() == written
    # Another code leaves it in; a code that does not exist is bad input.
    assert "[SC110]" in run_cli("gen", GPT2, "-o", out, "--ignore", "SC301").stderr
    assert run_cli("gen", GPT2, "-o", out, "--ignore", "SC110x").exit_code == 2


def test_shardcheck_debug_gives_the_traceback_as_debug_does(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    command = [sys.executable, "-m", "shardcheck", "diff", str(broken), str(GPT2_HINTS)]
    plain = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    environment = {**os.environ, "SHARDCHECK_DEBUG": "1"}
    debug = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment)
    assert plain.returncode == debug.returncode == 2
    assert "Traceback" not in plain.stderr
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1]


def test_shell_completion_is_clicks_as_documented() -> None:
    # docs/commands.md: eval "$(_SHARDCHECK_COMPLETE=bash_source shardcheck)".
    command = [sys.executable, "-m", "shardcheck"]
    source = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "_SHARDCHECK_COMPLETE": "bash_source"},
    )
    assert source.returncode == 0
    assert "_shardcheck_completion()" in source.stdout
    completing = {"COMP_WORDS": "shardcheck verify --st", "COMP_CWORD": "2"}
    answer = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "_SHARDCHECK_COMPLETE": "bash_complete", **completing},
    )
    assert answer.stdout.split() == ["plain,--strict"]
    documented = (ROOT / "docs" / "commands.md").read_text()
    assert "_SHARDCHECK_COMPLETE=bash_source shardcheck" in documented
    assert "SHARDCHECK_DEBUG=1" in documented


def test_the_pre_commit_docs_pin_a_commit_that_has_the_hooks() -> None:
    # The repository has no tags: rev: is a sha, which must exist and have every hook named.
    gating = (ROOT / "docs" / "gating.md").read_text()
    revisions = re.findall(r"rev: (\S+)", gating)
    assert revisions and all(re.fullmatch(r"[0-9a-f]{40}", rev) for rev in revisions), revisions
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the commit cannot be looked up")
    named = set(re.findall(r"- id: (shardcheck-[\w-]+)", gating))
    for rev in revisions:
        hooks = subprocess.run(
            ["git", "show", f"{rev}:.pre-commit-hooks.yaml"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if hooks.returncode != 0 and _shallow():
            pytest.skip(f"a shallow clone: {rev} may be past its history")
        assert hooks.returncode == 0, hooks.stderr
        assert named <= set(re.findall(r"- id: (\S+)", hooks.stdout)), named


def _shallow() -> bool:
    answer = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], capture_output=True, text=True, cwd=ROOT
    )
    return answer.stdout.strip() == "true"
