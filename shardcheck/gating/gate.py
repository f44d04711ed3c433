"""Golden gating: regenerate each model's hints, compare them with its golden, optionally verify.

Results are objects (and lines of text, for the front ends); nothing here prints. A golden is
only ever written by ``compare_with_golden(..., update=True)``, atomically, and only after its
model was loaded and its hints generated.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardcheck.errors import InputError, OutputError, ShardcheckError
from shardcheck.fsio import atomic_write_text
from shardcheck.gating.extension_golden import (
    compare_extension,
    extension_golden_path,
    extension_json,
    extension_lines,
)
from shardcheck.gating.extension_verify import (
    EXTENSION_PLAN,
    extension_verify_lines,
    extension_verify_note,
    failed_plans,
    verify_extension,
    verify_json,
)
from shardcheck.gating.golden_files import may_replace, not_a_regular_file, remove_stale
from shardcheck.gating.manifest import Manifest, ModelEntry
from shardcheck.generation.generate import generate
from shardcheck.generation.messages import code_of
from shardcheck.generation.parts import GenResult
from shardcheck.graph.loader import load_index
from shardcheck.hints.codec import dumps
from shardcheck.hints.diff import Difference, diff_hints
from shardcheck.hints.files import read_hints
from shardcheck.hints.model import ShardHints
from shardcheck.planning.golden import PlanComparison, compare_plan
from shardcheck.wording import counted

OK = "ok"
DIFFERS = "differs"
MISSING = "missing"
INVALID = "invalid"  # the golden exists but is not a readable hints file
UPDATED = "updated"
CREATED = "created"
ERROR = "error"
FAILED = "failed"  # the hints match the golden but verify found errors
WARNED = "warned"  # all else passed, but gen warned and the entry is strict
STALE = "stale"
REMOVED = "removed"  # a stale golden that --update deleted
PASSING = (OK, UPDATED, CREATED)  # WARNED fails: only a strict entry has that status
_WROTE = (UPDATED, CREATED)
STATUS_WIDTH = 9
INDENT = "    "


@dataclass(frozen=True)
class GoldenComparison:
    status: str  # OK, DIFFERS, MISSING, INVALID, UPDATED or CREATED
    golden_path: Path
    differences: tuple[Difference, ...] = ()
    problem: str | None = None  # why the old golden could not be read
    # An update may replace the file there (False: not a hints file, or not a regular file).
    replaceable: bool = True

    @property
    def ok(self) -> bool:
        return self.status in PASSING


@dataclass(frozen=True)
class VerifyOutcome:
    ok: bool
    text: str
    report: dict[str, Any] | None = None
    error: str | None = None  # verify could not run at all


@dataclass(frozen=True)
class ModelResult:
    entry: ModelEntry
    golden: GoldenComparison | None = None
    error: str | None = None  # the model could not be loaded or generated, or its golden written
    warnings: tuple[str, ...] = ()
    verify: VerifyOutcome | None = None
    # --update left the golden as it was: the hints it would have written failed verify, or
    # verify could not check them.
    held_back: bool = False
    plan: PlanComparison | None = None  # the plan against its sidecar (planning/golden.py)
    # The extension gen writes beside the hints against its golden (extension_golden.py).
    extension: GoldenComparison | None = None
    # verify of that extension (extension_verify.py): None where gen writes none or unasked.
    extension_verify: VerifyOutcome | None = None

    @property
    def status(self) -> str:
        if self.error is not None or self.golden is None:
            return ERROR
        if any(o is not None and o.error is not None for o in self._verify_outcomes()):
            return ERROR
        if not self.golden.ok:
            return self.golden.status
        if self.extension is not None and not self.extension.ok:
            return self.extension.status
        if self.plan is not None and not self.plan.ok:
            return DIFFERS  # the hints split the model less than the golden's
        if failed_plans(*self._verify_outcomes()):
            return FAILED
        if self.entry.strict and self.warnings:
            return WARNED
        return self.golden.status

    @property
    def ok(self) -> bool:
        return self.status in PASSING

    def lines(self, *, update_flag: str = "--update") -> list[str]:
        """A summary line, then the details (differences, verify findings) indented."""
        word = _status_word(self.status)
        name = self.entry.name
        if self.error is not None or self.golden is None:
            return [f"{word}{name}: {self.error}"]
        notes = [
            *_golden_notes(self.entry, self.golden, None if self.held_back else update_flag),
            *([f"not written: {self._held_back_why()}"] if self.held_back else []),
            *self._verify_notes(),
            *(
                [f"{counted(len(self.warnings), 'warning')}, strict"]
                if self.status == WARNED
                else []
            ),
        ]
        headline = f"{word}{name}" + (f" ({'; '.join(notes)})" if notes else "")
        # The headline names the model: its path, which begins gen's warnings, is left out.
        model = f"{self.entry.model_path}: "
        details = [f"warning: {warning.removeprefix(model)}" for warning in self.warnings]
        details += [difference.line() for difference in self.golden.differences]
        details += extension_lines(self.extension, update_flag)
        plan_line = None if self.plan is None else self.plan.line(update_flag)
        details += [plan_line] if plan_line else []
        if self.verify is not None and not self.verify.ok and self.verify.error is None:
            details.extend(self.verify.text.splitlines())
        details += extension_verify_lines(self.entry, self.extension_verify)
        return [headline, *(f"{INDENT}{line}" if line else "" for line in details)]

    def _verify_outcomes(self) -> tuple[VerifyOutcome | None, VerifyOutcome | None]:
        return self.verify, self.extension_verify

    def _held_back_why(self) -> str:
        outcomes = [o for o in self._verify_outcomes() if o is not None]
        if any(o.error is not None for o in outcomes):
            return "verify could not run"
        failed = failed_plans(*self._verify_outcomes())
        verb = "fails" if failed == [EXTENSION_PLAN] else "fail"  # "the hints fail"
        return f"the {' and the '.join(failed)} {verb} verify"

    def _verify_notes(self) -> list[str]:
        if self.verify is None:
            return []
        if self.verify.error is not None:
            return [f"verify: {self.verify.error}"]
        notes = ["verified"] if self.verify.ok else ["verify failed"]
        return notes + extension_verify_note(self.entry, self.extension_verify)

    def to_json(self) -> dict[str, Any]:
        golden = self.golden
        return {
            "name": self.entry.name,
            "model": self.entry.path_text,
            "golden": self.entry.golden_text,
            "status": self.status,
            "ok": self.ok,
            "error": self.error,
            "golden_problem": None if golden is None else golden.problem,
            "differences": [] if golden is None else [d.as_json() for d in golden.differences],
            "warnings": list(self.warnings),
            "held_back": self.held_back,
            "plan": None if self.plan is None else self.plan.to_json(),
            "extension": extension_json(self.extension),
            "verify": verify_json(self.entry, self.verify, self.extension_verify),
        }


@dataclass(frozen=True)
class CheckResult:
    manifest: Manifest
    models: tuple[ModelResult, ...]
    stale: tuple[Path, ...] = ()
    update: bool = False
    verify: bool = False
    removed: tuple[Path, ...] = ()  # stale goldens that --update deleted
    shard: tuple[int, int] | None = None  # (K, N) of --shard K/N
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.stale and all(result.ok for result in self.models)

    @property
    def written(self) -> tuple[ModelResult, ...]:
        """The models whose golden this run wrote."""
        return tuple(r for r in self.models if r.golden is not None and r.golden.status in _WROTE)

    def lines(self, *, update_flag: str = "--update") -> list[str]:
        lines = [line for result in self.models for line in result.lines(update_flag=update_flag)]
        lines.extend(self.stale_lines(update_flag=update_flag))
        return lines

    def stale_lines(self, *, update_flag: str = "--update") -> list[str]:
        """One line per stale golden: those --update removed, then those left."""
        removed = [
            f"{_status_word(REMOVED)}{self.manifest.display(path)} "
            "(stale: no model in the manifest claimed it)"
            for path in self.removed
        ]
        return removed + [
            f"{_status_word(STALE)}{self.manifest.display(path)} "
            f"(no model in the manifest claims it; {self._stale_advice(path, update_flag)})"
            for path in self.stale
        ]

    def _stale_advice(self, path: Path, update_flag: str) -> str:
        if not may_replace(path):
            return "delete it or list its model"  # --update never removes it
        return f"delete it, list its model, or run with {update_flag} to remove it"

    def summary(self) -> str:
        """One line: the models counted by outcome, the stale goldens, the time taken."""
        return summary_line(
            [result.status for result in self.models],
            len(self.stale),
            len(self.removed),
            self.seconds,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest": str(self.manifest.source),
            "ok": self.ok,
            "update": self.update,
            "verify": self.verify,
            "models": [result.to_json() for result in self.models],
            "stale": [self.manifest.display(path) for path in self.stale],
            "removed": [self.manifest.display(path) for path in self.removed],
            "shard": None if self.shard is None else f"{self.shard[0]}/{self.shard[1]}",
            # What the text output prints, so that the reports of --shard slices merge into
            # the output of the whole run.
            "lines": self.lines(),
        }


def run_check(
    manifest: Manifest,
    *,
    update: bool = False,
    verify: bool = False,
    strict: bool = False,
    jobs: int = 1,
    shard: tuple[int, int] | None = None,
    ignore: Collection[str] = (),
    on_result: Callable[[ModelResult], object] | None = None,
) -> CheckResult:
    """Check every model of ``manifest`` (of its slice ``shard``, (K, N)); one model's failure
    never stops the others. ``strict``: gen's warnings fail every model, as the manifest's
    ``strict`` key does; ``ignore``: the codes of gen's warnings left out (they neither show
    nor fail). ``jobs``: processes to spread the models over. ``on_result`` is called with each
    model's result as soon as it and those before it in the manifest are done."""
    from shardcheck.gating.parallel import check_models
    from shardcheck.gating.slices import shard_models

    if verify:
        _load_verify()  # before any golden is written: a run that cannot verify stops here
    started = time.monotonic()
    entries = shard_models(manifest.models, shard)
    if strict:
        entries = tuple(dataclasses.replace(entry, strict=True) for entry in entries)
    results = []
    for result in check_models(entries, update=update, verify=verify, jobs=jobs):
        if ignore:
            kept = tuple(w for w in result.warnings if code_of(w) not in ignore)
            result = dataclasses.replace(result, warnings=kept)
        results.append(result)
        if on_result is not None:
            on_result(result)
    # The stale goldens are the whole manifest's: the last slice reports them, once.
    stale = find_stale_goldens(manifest) if shard is None or shard[0] == shard[1] else ()
    removed = tuple(path for path in stale if update and remove_stale(path))
    return CheckResult(
        manifest=manifest,
        models=tuple(results),
        stale=tuple(path for path in stale if path not in removed),
        update=update,
        verify=verify,
        removed=removed,
        shard=shard,
        seconds=time.monotonic() - started,
    )


def summary_line(statuses: Sequence[str], stale: int, removed: int, seconds: float) -> str:
    """``3 models: 2 ok, 1 differs; 1 stale golden (0.8 s)``, outcomes in a fixed order."""
    order = (OK, CREATED, UPDATED, DIFFERS, MISSING, INVALID, WARNED, FAILED, ERROR)
    counts = [f"{statuses.count(status)} {status}" for status in order if status in statuses]
    goldens = []
    if stale:
        goldens.append(counted(stale, "stale golden"))
    if removed:
        goldens.append(f"{counted(removed, 'stale golden')} removed")
    tail = "".join(f"; {part}" for part in goldens)
    return (
        f"{counted(len(statuses), 'model')}: {', '.join(counts) or 'none'}{tail} ({seconds:.1f} s)"
    )


def check_isolated(entry: ModelEntry, *, update: bool, verify: bool) -> ModelResult:
    try:
        return check_model(entry, update=update, verify=verify)
    except Exception as exc:  # a bug on one model must not hide the results of the others
        return ModelResult(
            entry,
            error=f"internal error: {type(exc).__name__}: {exc} (this is a bug in shardcheck)",
        )


def check_model(entry: ModelEntry, *, update: bool = False, verify: bool = False) -> ModelResult:
    """Generate ``entry``'s hints, compare (and with ``update`` rewrite) its golden, verify."""
    try:
        index = load_index(entry.model_path)
        generated = generate(index, entry.gen)
    except ShardcheckError as exc:
        return ModelResult(entry, error=exc.message)
    outcome = ext_outcome = None
    if verify and entry.verify:
        outcome = run_verify(entry, generated.hints, in_child=True)
        if outcome.error is None:  # verify cannot run on the model: the extension neither
            ext_outcome = verify_extension(entry, _extended(generated), in_child=True)
    # A plan that fails verify is not made the golden (nor any part of it), --update or not.
    failed = bool(failed_plans(outcome, ext_outcome))
    writes = update and not failed
    try:
        golden = compare_with_golden(generated.hints, entry.golden_path, update=writes)
    except ShardcheckError as exc:
        return ModelResult(entry, error=exc.message, warnings=generated.warnings)
    # gen's default plan: the extension where it writes one, else the hints.
    extended = _extended(generated)
    try:
        extension = compare_extension(extended, entry.golden_path, update=writes)
    except ShardcheckError as exc:
        return ModelResult(entry, error=exc.message, warnings=generated.warnings)
    # Held back: a golden that --update would have written.
    held_back = (update and failed) and (
        golden.status != OK or (extension is not None and extension.status != OK)
    )
    plan = compare_plan(
        index,
        extended or generated.hints,
        entry.golden_path,
        update=writes,
        golden_written=golden.status in _WROTE
        or (extension is not None and extension.status in _WROTE),
    )
    return ModelResult(
        entry,
        golden,
        warnings=generated.warnings,
        verify=outcome,
        held_back=held_back,
        plan=plan,
        extension=extension,
        extension_verify=ext_outcome,
    )


def _extended(generated: GenResult) -> ShardHints | None:
    """The extension gen wrote (its hints, with their lengths), or None."""
    return None if generated.extension is None else generated.extension.hints


def verify_model(
    entry: ModelEntry, *, in_child: bool = False
) -> tuple[VerifyOutcome, VerifyOutcome | None]:
    """Generate ``entry``'s plan and verify it: the hints, and the extension where gen writes
    one (None otherwise); InputError if the model is unusable. ``in_child``: as ``run_verify``."""
    generated = generate(load_index(entry.model_path), entry.gen)
    hints = run_verify(entry, generated.hints, in_child=in_child)
    if hints.error is not None:
        return hints, None
    return hints, verify_extension(entry, _extended(generated), in_child=in_child)


def compare_with_golden(
    hints: ShardHints, golden_path: Path, *, update: bool = False
) -> GoldenComparison:
    """Compare ``hints`` with the golden file; with ``update``, rewrite it when it differs.

    Only a regular file is read (a FIFO would block), and only a hints file is rewritten."""
    odd = not_a_regular_file(golden_path)
    if odd is not None:
        return GoldenComparison(
            INVALID, golden_path, problem=f"{golden_path}: {odd}", replaceable=False
        )
    if not golden_path.exists():
        if not update:
            return GoldenComparison(MISSING, golden_path)
        write_golden(golden_path, hints)
        return GoldenComparison(CREATED, golden_path)
    try:
        golden = read_hints(golden_path)
    except InputError as exc:
        replaceable = may_replace(golden_path)
        if not update or not replaceable:
            return GoldenComparison(
                INVALID, golden_path, problem=exc.message, replaceable=replaceable
            )
        write_golden(golden_path, hints)
        return GoldenComparison(UPDATED, golden_path, problem=exc.message)
    differences = tuple(diff_hints(golden, hints))
    if not differences:
        return GoldenComparison(OK, golden_path)
    if not update:
        return GoldenComparison(DIFFERS, golden_path, differences)
    write_golden(golden_path, hints)
    return GoldenComparison(UPDATED, golden_path, differences)


def write_golden(golden_path: Path, hints: ShardHints) -> None:
    try:
        golden_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{golden_path}: cannot create its directory: {exc.strerror}") from None
    atomic_write_text(golden_path, dumps(hints))


def find_stale_goldens(manifest: Manifest) -> tuple[Path, ...]:
    """The ``*.json`` files under the manifest's golden-dir that no model claims."""
    directory = manifest.golden_dir
    if directory is None or not directory.is_dir():
        return ()
    claimed = {entry.golden_path.resolve() for entry in manifest.models}
    # The extensions gen writes beside them are theirs (extension_golden.py).
    claimed |= {extension_golden_path(entry.golden_path).resolve() for entry in manifest.models}
    return tuple(
        sorted(
            path
            for path in directory.rglob("*.json")
            if path.is_file()
            and looks_like_a_golden(manifest, path)
            and path.resolve() not in claimed
        )
    )


def looks_like_a_golden(manifest: Manifest, path: Path) -> bool:
    """Whether the stale-golden check takes ``path`` for a golden: a ``.json`` file in
    golden-dir, none of whose parts below it is hidden."""
    directory = manifest.golden_dir
    if directory is None or path.suffix != ".json":
        return False
    try:
        parts = Path(os.path.abspath(path)).relative_to(os.path.abspath(directory)).parts
    except ValueError:
        return False
    return not any(part.startswith(".") for part in parts)


def run_verify(
    entry: ModelEntry,
    hints: ShardHints,
    *,
    in_child: bool = False,
    source: str = "the hints gen writes",
) -> VerifyOutcome:
    """The one place that calls verify (imported only when asked for). ``in_child``: in a
    child process killed past the entry's timeout, even within one long kernel, as check and
    the pytest plugin verify (their process must go on to the next model); the child is
    forked where that is safe, so it costs little (runtime/supervised.py). ``source``: what
    verify's report calls ``hints``."""
    verify_hints = _load_verify("verify_in_child" if in_child else "verify")
    settings: dict[str, Any] = {}
    if entry.ranks is not None:
        settings["ranks"] = entry.ranks
    if entry.seq_lens is not None:
        settings["seq_lens"] = entry.seq_lens
    if entry.seq_len_of:
        settings["seq_len_of"] = dict(entry.seq_len_of)
    settings.update(rtol=entry.rtol, atol=entry.atol)  # None: by the outputs' type
    try:
        report = verify_hints(
            str(entry.model_path),
            hints,
            hints_source=source,
            timeout=entry.timeout,
            **settings,
        )
    except ShardcheckError as exc:
        return VerifyOutcome(ok=False, text=exc.message, error=exc.message)
    return VerifyOutcome(ok=bool(report.ok), text=report.render_text(), report=report.to_json())


def _load_verify(function: str = "verify") -> Callable[..., Any]:
    try:
        module = importlib.import_module("shardcheck.verification.verify")
    except ModuleNotFoundError as exc:
        if exc.name == "shardcheck.verification.verify":
            raise InputError("verify is not available in this version") from None
        raise InputError(
            f"verify is not available: it needs the Python module {exc.name!r}, "
            "which is not installed"
        ) from None
    return getattr(module, function)


def _status_word(status: str) -> str:
    word = status if status == OK else status.upper()
    return word.ljust(STATUS_WIDTH)


def _golden_notes(
    entry: ModelEntry, golden: GoldenComparison, update_flag: str | None
) -> list[str]:
    """What the comparison found; ``update_flag``: what to run to fix it (None: no advice)."""
    count = count_text(golden.differences)
    advice = "" if update_flag is None else f"; run with {update_flag}"
    if golden.status == DIFFERS:
        return [count]
    if golden.status == MISSING:
        return [f"no golden: {entry.golden_text}{advice}"]
    if golden.status == INVALID:
        if not golden.replaceable:  # --update never writes over it
            kept = (
                "; not a hints file, so never overwritten" if golden.golden_path.is_file() else ""
            )
            return [f"{golden.problem}{kept}: remove it, or give the model another golden path"]
        return [f"{golden.problem}{advice}"]
    if golden.status == CREATED:
        return [f"wrote {entry.golden_text}"]
    if golden.status == UPDATED:
        why = f"was invalid: {golden.problem}" if golden.problem else count
        return [f"rewrote {entry.golden_text}: {why}"]
    return []


def count_text(differences: Sequence[Difference]) -> str:
    return f"{len(differences)} difference" + ("" if len(differences) == 1 else "s")
