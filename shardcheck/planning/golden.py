"""The plan's golden: the split a model's hints reached, recorded beside its hints golden.

The hints golden stays a plain hints file (Polygraphy's ``ShardHints.load`` reads it); the plan
is a sidecar next to it, ``NAME.plan`` for ``NAME.json`` (not ``.json``: the stale-golden check
takes every ``.json`` of golden-dir for a hints golden), holding JSON:
``{"seq_len": S, "ranks": N, "flops_on_slices": F}``. The gate counts the new hints' plan at
the recorded S and N; a share below the recorded one fails, with both figures. A higher one
passes (``--update`` records it); a missing sidecar passes too, and is written with its
golden: ``--update`` writes it when it writes the golden (to record the plan of a golden that
matches, delete the golden and run ``--update``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shardcheck.errors import ShardcheckError
from shardcheck.fsio import atomic_write_text
from shardcheck.graph.index import GraphIndex
from shardcheck.hints.model import ShardHints
from shardcheck.planning.flop_count import DEFAULT_RANKS, DEFAULT_SEQ_LEN
from shardcheck.planning.plan import make_plan

SUFFIX = ".plan"
# Shares are recorded to 6 decimals: a plan is lower when it is below by more than that.
TOLERANCE = 1e-6

RECORDED, LOWERED, RAISED, SAME, UNRECORDED, UNCOUNTED = (
    "recorded",
    "lowered",
    "raised",
    "same",
    "unrecorded",
    "uncounted",
)


@dataclass(frozen=True)
class PlanComparison:
    status: str
    path: Path
    flops_on_slices: float | None = None
    golden: float | None = None
    seq_len: int = DEFAULT_SEQ_LEN
    ranks: int = DEFAULT_RANKS
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.status != LOWERED

    def line(self, update_flag: str = "--update") -> str | None:
        """What the check's text shows of the plan: only a plan that fails (the rest, a
        figure raised or recorded, is in the JSON report)."""
        return self.detail(update_flag) if self.status == LOWERED else None

    def detail(self, update_flag: str = "--update") -> str | None:
        """The plan in words, whatever its status (None when it says nothing new)."""
        at = f"at length {self.seq_len} on {self.ranks} ranks"
        if self.status == LOWERED:
            return (
                f"plan: {_percent(self.flops_on_slices)} of FLOPs on slices {at}, below the "
                f"golden's {_percent(self.golden)} ({self.path}); the hints split the model "
                f"less than before (run with {update_flag} if that is intended)"
            )
        if self.status == RAISED:
            return (
                f"plan: {_percent(self.flops_on_slices)} of FLOPs on slices {at}, above the "
                f"golden's {_percent(self.golden)} ({self.path}; {update_flag} records it)"
            )
        if self.status == UNRECORDED:
            return f"plan: not recorded ({self.path}; {update_flag} records it)"
        if self.status == RECORDED:
            return f"plan: {_percent(self.flops_on_slices)} of FLOPs on slices, recorded"
        if self.status == UNCOUNTED:
            return f"plan: not counted: {self.problem}"
        return None

    def to_json(self) -> dict[str, object]:
        return {
            "status": self.status,
            "path": str(self.path),
            "flops_on_slices": self.flops_on_slices,
            "golden_flops_on_slices": self.golden,
            "seq_len": self.seq_len,
            "ranks": self.ranks,
        }


def _percent(share: float | None) -> str:
    return "?" if share is None else f"{100 * share:.1f}%"


def plan_path(golden_path: Path) -> Path:
    return golden_path.with_suffix(SUFFIX)


def compare_plan(
    index: GraphIndex,
    hints: ShardHints,
    golden_path: Path,
    *,
    update: bool = False,
    golden_written: bool = False,
) -> PlanComparison:
    """The plan of ``hints`` against the one recorded beside ``golden_path``. With ``update``
    a sidecar that differs is rewritten; a missing one is written with its golden only
    (``golden_written``): --update writes nothing beside a golden that matches."""
    path = plan_path(golden_path)
    recorded = _read(path)
    seq_len = recorded.get("seq_len") if recorded else None
    ranks = recorded.get("ranks") if recorded else None
    seq_len = seq_len if isinstance(seq_len, int) else None
    ranks = ranks if isinstance(ranks, int) and ranks >= 1 else DEFAULT_RANKS
    try:
        plan = make_plan(index, hints, seq_len=seq_len, ranks=ranks)
    except ShardcheckError as exc:
        return PlanComparison(
            UNCOUNTED, path, seq_len=seq_len or 0, ranks=ranks, problem=exc.message
        )
    share = round(plan.flops_on_slices, 6)
    figures = {"seq_len": plan.seq_len, "ranks": plan.ranks, "flops_on_slices": share}
    golden = recorded.get("flops_on_slices") if recorded else None
    if not isinstance(golden, (int, float)):
        if update and golden_written:
            _write(path, figures)
            return PlanComparison(RECORDED, path, share, None, plan.seq_len, plan.ranks)
        return PlanComparison(UNRECORDED, path, share, None, plan.seq_len, plan.ranks)
    if share < golden - TOLERANCE:
        status = LOWERED
    elif share > golden + TOLERANCE:
        status = RAISED
    else:
        status = SAME
    if update and status != SAME:
        _write(path, figures)
        return PlanComparison(RECORDED, path, share, float(golden), plan.seq_len, plan.ranks)
    return PlanComparison(status, path, share, float(golden), plan.seq_len, plan.ranks)


def _read(path: Path) -> dict[str, object] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write(path: Path, figures: dict[str, object]) -> None:
    atomic_write_text(path, json.dumps(figures, indent=4) + "\n")
