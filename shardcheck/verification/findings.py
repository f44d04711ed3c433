"""Findings of ``verify``: stable codes, a readable table, the same content as JSON.

Findings of one code that repeat (SC110 once per layer of a 96-layer model) are collapsed in the
text into one row and one message with their count and first fields; the JSON keeps each one.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from shardcheck.wording import counted, listed, one_line

ERROR = "error"
WARNING = "warning"
INFO = "info"
LEVELS = (ERROR, WARNING, INFO)

# Stable codes: CI logs and docs name findings by them. Never renumber; add new ones. SC0nn to
# SC2nn are verify's findings, SC3nn gen's warnings (generation/messages.py).
CODES = {
    "SC001": "model does not run",
    "SC002": "model runs only at its traced sequence length",
    "SC003": "count of a selection fixed by the trace",
    "SC101": "sequence axis mismatch",
    "SC102": "tensor not in model",
    "SC103": "index out of rank",
    "SC104": "rank mismatch",
    "SC105": "K index mismatch",
    "SC106": "V index mismatch",
    "SC107": "kv_rank mismatch",
    "SC108": "Q is not an attention layer",
    "SC109": "attention layer not hinted",
    "SC110": "layer skipped by Polygraphy's shard",
    "SC111": "gather_q differs between layers",
    "SC112": "bad fused-attention shuffle",
    "SC113": "collective settings",
    "SC114": "reduce_op changes replicated values",
    "SC115": "sequence input not scattered",
    "SC116": "key-only tensor scattered",
    "SC117": "hinted tensor has no sequence axis",
    "SC118": "Q query axis",
    "SC119": "sequence input stays whole (key side only)",
    "SC120": "sequence length fixed by the inputs",
    "SC121": "K and V not gathered",
    "SC122": "tensor both scattered and gathered",
    "SC123": "hints not for CP",
    "SC124": "fused is_causal differs from the layer",
    "SC125": "nothing scattered",
    "SC126": "fused nb_rank unlike the ranks",
    "SC127": "Polygraphy's fused scale 1.0 is not the layer's",
    "SC128": "fused replacement drops the layer's mask",
    "SC129": "attention in a subgraph or function",
    "SC201": "simulated CP differs from single device",
    "SC202": "simulated CP passed",
    "SC203": "CP simulation could not shard the model",
    "SC204": "CP not simulated",
    # gen's own warnings (gen also gives the codes above to the warnings verify reports too).
    "SC301": "no attention layer found",
    "SC302": "option changes nothing",
    "SC303": "Q and K from one tensor",
    "SC304": "Q/K/V ranks unknown",
    "SC305": "mask shape unknown",
    "SC306": "no axis carries the sequence",
    "SC307": "hinted tensor rank unknown",
    "SC308": "CP may not be exact",
    "SC309": "layer stays native under --cp-type fused",
    "SC310": "fused options override the layer",
}

# Up to this many findings of one code and level are shown one by one; more are collapsed.
SHOWN_ALIKE = 3
# The fields a collapsed message names before "and N more".
NAMED_ALIKE = 3


@dataclass(frozen=True)
class Finding:
    code: str
    level: str
    field: str  # the hints field at fault, e.g. "inputs[name=x].seq_len_idx"
    tensor: str
    expected: str
    observed: str
    message: str

    @property
    def title(self) -> str:
        return CODES[self.code]


@dataclass
class Report:
    model: str
    hints: str
    findings: list[Finding] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # onnxruntime runs made
    # How the report is judged and shown (verify's --strict, --ignore, -q): judged().
    strict: bool = False  # warnings fail too
    ignored: tuple[str, ...] = ()  # codes left out of the findings
    quiet: bool = False  # the text shows only the findings that fail
    # The plan of the hints (planning.report): its line for the text, its object for JSON.
    plan_line: str = ""
    plan: dict[str, Any] | None = None
    # The (code, field) of every finding, for has(): verify asks once per layer whether a
    # layer before reported it, and a scan of the findings there grew with the square of the
    # layers. Findings are added only by add(), which keeps it.
    _reported: set[tuple[str, str]] = field(
        default_factory=set, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self._reported = {(f.code, f.field) for f in self.findings}

    def has(self, code: str, field: str) -> bool:
        """Whether a finding of ``code`` at ``field`` is in the report."""
        return (code, field) in self._reported

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == WARNING]

    @property
    def failing(self) -> list[Finding]:
        """The findings that fail the report: its errors, and its warnings when strict."""
        levels = (ERROR, WARNING) if self.strict else (ERROR,)
        return [f for f in self.findings if f.level in levels]

    @property
    def ok(self) -> bool:
        return not self.failing

    def judged(
        self, *, strict: bool = False, ignore: Collection[str] = (), quiet: bool = False
    ) -> Report:
        """The report without the findings of the codes in ``ignore``, with warnings failing
        when ``strict``, its text showing only what fails when ``quiet``."""
        unknown = sorted(set(ignore) - set(CODES))
        if unknown:
            raise ValueError(f"not a finding code: {listed(unknown)}")
        return dataclasses.replace(
            self,
            findings=[f for f in self.findings if f.code not in ignore],
            strict=strict,
            ignored=tuple(sorted(set(ignore))),
            quiet=quiet,
        )

    def add(
        self,
        code: str,
        level: str,
        field: str,
        message: str,
        *,
        tensor: str = "",
        expected: object = "",
        observed: object = "",
    ) -> None:
        self.findings.append(
            Finding(code, level, field, tensor, _text(expected), _text(observed), message)
        )
        self._reported.add((code, field))

    def sorted_findings(self) -> list[Finding]:
        return sorted(self.findings, key=lambda f: (LEVELS.index(f.level), f.code, f.field))

    def render_text(self) -> str:
        shown = self.failing if self.quiet else self.findings
        rows = [("code", "level", "check", "field", "expected", "observed")]
        messages = []
        for alike in _alike_groups(shown):
            first = alike[0]
            if len(alike) <= SHOWN_ALIKE:
                for f in sorted(alike, key=lambda f: f.field):
                    rows.append((f.code, f.level, f.title, f.field, f.expected, f.observed))
                    messages.append(f"{f.code} {f.level}: {f.message}")
                continue
            # One row and one message for them all: the count, the first fields, the first
            # message (each finding names its own field and tensor, and is in the JSON).
            rows.append(
                (
                    first.code,
                    first.level,
                    first.title,
                    f"{first.field} (+{len(alike) - 1} more)",
                    _common(f.expected for f in alike),
                    _common(f.observed for f in alike),
                )
            )
            fields = [f.field for f in alike[:NAMED_ALIKE]]
            more = len(alike) - len(fields)
            messages.append(
                f"{first.code} {first.level}: {counted(len(alike), 'finding')}, at "
                f"{listed([*fields, f'{more} more'])}; the first: {first.message}"
            )
        widths = [min(48, max(len(row[i]) for row in rows)) for i in range(len(rows[0]))]
        lines = [f"verify {self.model} with {self.hints}"]
        if len(rows) > 1:
            for row in rows:
                cells = [_clip(cell, widths[i]).ljust(widths[i]) for i, cell in enumerate(row)]
                lines.append("  ".join(cells).rstrip())
            lines.append("")
            lines.extend(messages)
        if self.plan_line and not self.quiet:  # -q: what fails only
            lines.append(self.plan_line)
        verdict = "PASS" if self.ok else "FAIL"
        notes = [f"ignored: {', '.join(self.ignored)}"] if self.ignored else []
        if self.strict:
            notes.append("--strict: warnings fail")
        note = f" ({'; '.join(notes)})" if notes else ""
        lines.append(
            f"{verdict}: {len(self.errors)} error(s), {len(self.warnings)} warning(s){note}"
        )
        # One line each, whatever a tensor's or a key's name holds (a newline, an escape).
        return "\n".join(one_line(line) for line in lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "hints": self.hints,
            "ok": self.ok,
            "strict": self.strict,
            "ignored": list(self.ignored),
            "findings": [_json_finding(f) for f in self.sorted_findings()],
            "runs": self.runs,
            "plan": self.plan,
        }

    def render_json(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"


def _alike_groups(findings: list[Finding]) -> Iterator[list[Finding]]:
    """``findings`` in groups of one code and level, by level and code; each group in the
    order the findings were made (the graph's: its first are the model's first layers)."""
    group: list[Finding] = []
    for finding in sorted(findings, key=lambda f: (LEVELS.index(f.level), f.code)):
        if group and (group[0].code, group[0].level) != (finding.code, finding.level):
            yield group
            group = []
        group.append(finding)
    if group:
        yield group


def _common(values: Iterator[str]) -> str:
    """The value every finding of a group has, else "(varies)"."""
    distinct = set(values)
    return next(iter(distinct)) if len(distinct) == 1 else "(varies)"


def _json_finding(finding: Finding) -> dict[str, Any]:
    """A finding for JSON: a value it does not have (no tensor, nothing expected) is null."""
    document: dict[str, Any] = {
        key: (None if value == "" else value) for key, value in asdict(finding).items()
    }
    return {**document, "check": finding.title}


def _text(value: object) -> str:
    return "" if value is None or value == "" else str(value)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]
