"""The README: at most 150 lines, and its walkthrough runs as written on the bundled fixture."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import onnx
import pytest
from conftest import ROOT, run_cli

README = ROOT / "README.md"
WALKTHROUGH = "## From an exported model to TensorRT on N GPUs"
MAX_LINES = 150
MAX_WALKTHROUGH_LINES = 15


def walkthrough() -> list[str]:
    """The lines of the walkthrough's bash block."""
    text = README.read_text()
    section = text.split(WALKTHROUGH, 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None, "the walkthrough has no ```bash block"
    return block.group(1).splitlines()


def test_the_readme_fits_in_150_lines() -> None:
    assert len(README.read_text().splitlines()) <= MAX_LINES
    assert len(walkthrough()) <= MAX_WALKTHROUGH_LINES


def _expanded(word: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], word)


def test_the_walkthrough_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # From the repository root, as the README says; $(mktemp -d) is this test's directory.
    monkeypatch.chdir(ROOT)
    variables: dict[str, str] = {}
    ran: list[str] = []
    for line in walkthrough():
        if not line.strip() or line.startswith("#"):
            continue
        words = shlex.split(line.replace("$(mktemp -d)", str(tmp_path)))
        if all(re.fullmatch(r"\w+=.*", word) for word in words):
            for word in words:
                name, _, value = word.partition("=")
                variables[name] = _expanded(value, variables)
            continue
        if words[0] == "trtexec":  # on the GPU machine
            continue
        assert words[0] == ".venv/bin/shardcheck", f"the test cannot run: {line}"
        args = [_expanded(word, variables) for word in words[1:]]
        result = run_cli(*args)
        assert result.exit_code == 0, (line, result.stdout, result.stderr)
        ran.append(args[0])
    # gen -> verify -> explain -> shard, then trtexec (issue 31's walkthrough).
    assert ran == ["gen", "verify", "explain", "shard"]
    # What the steps say they make: 2-rank collectives, the plan's page, a multi-device model
    # with DistCollective nodes that trtexec is handed.
    assert '"nb_rank": 2' in (tmp_path / "gpt2.json").read_text()
    assert "<svg" in (tmp_path / "plan.html").read_text()
    sharded = onnx.load(str(tmp_path / "gpt2.md.onnx"))
    assert any(node.op_type == "DistCollective" for node in sharded.graph.node)
