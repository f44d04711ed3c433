"""``check --verify`` proves the extension too: the plan gen writes by default is the extension
where it writes one, and the multi-device model ``shardcheck shard`` writes from it is what
runs. So where gen writes an extension, it is verified as the hints are, by the same simulation
as ``shardcheck verify MODEL EXT`` at the manifest entry's settings, and a failing extension
fails the model (``FAILED``) with a line naming its file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardcheck.hints.extension import extension_path
from shardcheck.hints.model import ShardHints

if TYPE_CHECKING:
    from shardcheck.gating.gate import VerifyOutcome
    from shardcheck.gating.manifest import ModelEntry

HINTS_PLAN = "hints"
EXTENSION_PLAN = "extension"


def extension_text(entry: ModelEntry) -> str:
    """The extension's golden as the manifest spells the golden: ``golden/x.shardcheck.json``."""
    return extension_path(entry.golden_text)


def verify_extension(
    entry: ModelEntry, extended: ShardHints | None, *, in_child: bool = False
) -> VerifyOutcome | None:
    """verify of the extension gen writes for ``entry`` (None where it writes none), named in
    verify's report by the golden it is gated against."""
    from shardcheck.gating.gate import run_verify

    if extended is None:
        return None
    source = f"the extension gen writes (golden {extension_text(entry)})"
    return run_verify(entry, extended, in_child=in_child, source=source)


def failed_plans(hints: VerifyOutcome | None, extension: VerifyOutcome | None) -> list[str]:
    """The plans that failed verify or that it could not check: ``hints``, ``extension``."""
    plans = ((HINTS_PLAN, hints), (EXTENSION_PLAN, extension))
    return [name for name, outcome in plans if outcome is not None and not outcome.ok]


def extension_verify_note(entry: ModelEntry, extension: VerifyOutcome | None) -> list[str]:
    """The words of check's headline on the extension's verify."""
    if extension is None:
        return []
    if extension.error is not None:
        return [f"verify of the extension {extension_text(entry)}: {extension.error}"]
    return ["extension verified"] if extension.ok else ["the extension fails verify"]


def extension_verify_lines(entry: ModelEntry, extension: VerifyOutcome | None) -> list[str]:
    """check's details of an extension that fails verify: its file and what fails, then
    verify's report (one that verify could not run on is said in the headline)."""
    if extension is None or extension.ok or extension.error is not None:
        return []
    return [
        f"extension {extension_text(entry)} (the plan 'shardcheck shard' carries out): fails "
        f"verify: {_failing_checks(extension)}",
        *extension.text.splitlines(),
    ]


def _failing_checks(outcome: VerifyOutcome) -> str:
    """``SC201 simulated CP differs from single device``: the checks that fail, by code."""
    findings = (outcome.report or {}).get("findings", [])
    failing = sorted({(f["code"], f["check"]) for f in findings if f["level"] == "error"})
    return ", ".join(f"{code} {check}" for code, check in failing) or "see its report"


def verify_json(
    entry: ModelEntry, hints: VerifyOutcome | None, extension: VerifyOutcome | None
) -> dict[str, Any] | None:
    """A model's ``verify`` in check's JSON report: ``ok`` when every plan passed, the hints'
    ``error`` and ``report``, ``failed`` (the plans that did not pass), and ``extension``."""
    if hints is None:
        return None
    return {
        "ok": not failed_plans(hints, extension),
        "error": hints.error,
        "report": hints.report,
        "failed": failed_plans(hints, extension),
        "extension": None
        if extension is None
        else {
            "path": extension_text(entry),
            "ok": extension.ok,
            "error": extension.error,
            "report": extension.report,
        },
    }


def failure_text(entry: ModelEntry, hints: VerifyOutcome, extension: VerifyOutcome | None) -> str:
    """What the pytest plugin's verify item shows when a plan fails: the hints' report where
    they fail, then the extension's lines, as check prints them."""
    parts = [] if hints.ok else hints.text.splitlines()
    parts += extension_verify_lines(entry, extension)
    if extension is not None and extension.error is not None:
        parts += extension_verify_note(entry, extension)
    return "\n".join(parts)
