"""Progress on stderr: one line updated in place on a terminal, nothing elsewhere (a CI log,
where an error must stay stderr's one line), nothing with -q. The second of quiet is set to 0:
what is shown is the point, not when."""

from __future__ import annotations

import pytest

from shardcheck.cli import progress


@pytest.fixture(autouse=True)
def shown_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)


def test_off_a_terminal_nothing_is_shown(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(progress, "_is_terminal", lambda: False)
    with progress.Progress() as steps:
        steps("loading the model...")
        steps("simulating CP on 2 ranks at sequence length 8...")
    assert capsys.readouterr() == ("", "")


def test_on_a_terminal_one_line_is_redrawn_and_cleared(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(progress, "_is_terminal", lambda: True)
    with progress.Progress() as steps:
        steps("loading the model...")
        steps("running onnxruntime at sequence length 16...")
    # (click leaves out the erase-line code, ESC [K, on a stream that is no terminal.)
    err = capsys.readouterr().err.replace("\033[K", "")
    assert "\n" not in err  # one line, rewritten
    draws = err.split("\r")
    assert draws[0] == "" and draws[-1] == ""  # cleared on leaving
    assert draws[1].startswith("shardcheck: loading the model... ")
    assert draws[-2].startswith("shardcheck: running onnxruntime at sequence length 16... ")
    assert draws[-2].endswith(" s")


def test_disabled_shows_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with progress.Progress(enabled=False) as steps:
        steps("loading the model...")
    assert capsys.readouterr() == ("", "")
