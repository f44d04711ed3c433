"""docs/findings.md: one section per finding code, each saying what to do (issue 31 item 5;
the code table itself is checked by tests/verification/test_verify.py)."""

from __future__ import annotations

import re

from conftest import ROOT

from shardcheck.verification.findings import CODES


def test_every_code_has_one_section_with_what_to_do() -> None:
    text = (ROOT / "docs" / "findings.md").read_text()
    sections = re.split(r"^### ", text, flags=re.MULTILINE)[1:]
    codes = [section.split("\n", 1)[0] for section in sections]
    assert sorted(codes) == sorted(CODES)
    for section in sections:
        code, body = section.split("\n", 1)
        # The title of the code table, then what to do.
        assert f"**{CODES[code]}**" in body, code
        assert "*What to do*" in body, code
