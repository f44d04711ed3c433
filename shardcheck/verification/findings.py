"""Findings of ``verify``: stable codes, a readable table, the same content as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

ERROR = "error"
WARNING = "warning"
INFO = "info"
LEVELS = (ERROR, WARNING, INFO)

# Stable codes: CI logs and docs name findings by them. Never renumber; add new ones.
CODES = {
    "SC001": "model does not run",
    "SC002": "model runs only at its traced sequence length",
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
    "SC201": "simulated CP differs from single device",
    "SC202": "simulated CP passed",
    "SC203": "CP simulation could not shard the model",
}


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

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == ERROR]

    @property
    def ok(self) -> bool:
        return not self.errors

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

    def sorted_findings(self) -> list[Finding]:
        return sorted(self.findings, key=lambda f: (LEVELS.index(f.level), f.code, f.field))

    def render_text(self) -> str:
        rows = [("code", "level", "check", "field", "expected", "observed")]
        for f in self.sorted_findings():
            rows.append((f.code, f.level, f.title, f.field, f.expected, f.observed))
        widths = [min(48, max(len(row[i]) for row in rows)) for i in range(len(rows[0]))]
        lines = [f"verify {self.model} with {self.hints}"]
        if self.findings:
            for row in rows:
                cells = [_clip(cell, widths[i]).ljust(widths[i]) for i, cell in enumerate(row)]
                lines.append("  ".join(cells).rstrip())
            lines.append("")
            for f in self.sorted_findings():
                lines.append(f"{f.code} {f.level}: {f.message}")
        errors = len(self.errors)
        warnings = sum(1 for f in self.findings if f.level == WARNING)
        verdict = "FAIL" if errors else "PASS"
        lines.append(f"{verdict}: {errors} error(s), {warnings} warning(s)")
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "hints": self.hints,
            "ok": self.ok,
            "findings": [{**asdict(f), "check": f.title} for f in self.sorted_findings()],
            "runs": self.runs,
        }

    def render_json(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"


def _text(value: object) -> str:
    return "" if value is None or value == "" else str(value)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]
