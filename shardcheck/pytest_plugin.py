"""pytest plugin (``pytest11`` entry point ``shardcheck``).

- ``pytest --shardcheck`` turns the shardcheck manifest into test items, one per model and
  check: ``<manifest>::<model>::gen`` (generate and compare with the golden) and
  ``<model>::verify`` for entries with ``verify = true``; ``[stale goldens]`` when the manifest
  has a golden-dir.
- the ``shard_hints_regression`` fixture compares a model's hints with a golden named after the
  test, in the manner of pytest-regressions.

Both handle goldens the same way: a missing golden is written and its test fails (naming the
file; rerun to compare against it); ``--shardcheck-update`` rewrites the goldens that differ and
removes the stale ones (their tests pass). Stale goldens are those in the manifest's golden-dir
that no model claims, and those in a fixture's golden directory that no test of a file that ran
whole asked for. Under pytest-xdist each worker reports what it wrote and used, and the
controller merges them (``gating/fixture_goldens.py``). shardcheck's modules are imported only
when used.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

    from shardcheck.gating.fixture_goldens import SessionGoldens
    from shardcheck.gating.manifest import Manifest, ModelEntry
    from shardcheck.hints.model import ShardHints

UPDATE_FLAG = "--shardcheck-update"
STALE_ITEM_NAME = "[stale goldens]"
FIXTURE = "shard_hints_regression"
_WORKER_KEY = "shardcheck"  # in pytest-xdist's workeroutput


@dataclass
class _Settings:
    update: bool
    manifest_path: Path | None  # resolved; None unless --shardcheck
    written: list[str] = field(default_factory=list)  # goldens written this session
    # golden path -> the test whose name gave it (two tests' names must not give one)
    fixture_goldens: dict[Path, str] = field(default_factory=dict)
    session_goldens: SessionGoldens | None = None  # made once a test uses the fixture
    stale_lines: list[str] = field(default_factory=list)  # fixture goldens found stale

    def goldens(self) -> SessionGoldens:
        if self.session_goldens is None:
            from shardcheck.gating.fixture_goldens import SessionGoldens

            self.session_goldens = SessionGoldens()
        return self.session_goldens


_SETTINGS = pytest.StashKey[_Settings]()


class ShardcheckFailure(Exception):
    """A check failed; the message is the whole report (no traceback is shown)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardcheck", "shardcheck golden gating")
    group.addoption(
        "--shardcheck",
        action="store_true",
        help="Check the models of the shardcheck manifest against their goldens "
        "(items <manifest>::<model>::gen and ::verify).",
    )
    group.addoption(
        "--shardcheck-manifest",
        metavar="FILE",
        default=None,
        help="The manifest (default: shardcheck.toml in the rootdir if present, "
        "else pyproject.toml).",
    )
    group.addoption(
        UPDATE_FLAG,
        action="store_true",
        help="Rewrite goldens that differ or are missing "
        "(manifest items and the shard_hints_regression fixture).",
    )


def pytest_configure(config: pytest.Config) -> None:
    manifest = _manifest_path(config) if config.getoption("shardcheck") else None
    config.stash[_SETTINGS] = _Settings(
        update=bool(config.getoption("shardcheck_update")), manifest_path=manifest
    )
    # With the default selection (testpaths or the current directory) the manifest, often at
    # the root, would not be walked: collect it as well. Explicit paths are respected.
    if manifest is not None and config.args_source != pytest.Config.ArgsSource.ARGS:
        if not any(_contains(Path(arg), manifest) for arg in config.args):
            config.args = [*config.args, str(manifest)]


def _manifest_path(config: pytest.Config) -> Path:
    from shardcheck.errors import InputError
    from shardcheck.gating.manifest import find_manifest

    option = config.getoption("shardcheck_manifest")
    if option:
        from shardcheck.fsio import nul_problem

        if nul_problem(option) is not None:
            raise pytest.UsageError(f"--shardcheck-manifest {option!r}: {nul_problem(option)}")
        path = config.invocation_params.dir / option
        from shardcheck.fsio import why_unreadable

        problem = why_unreadable(path, "a TOML file")
        if problem:
            raise pytest.UsageError(f"--shardcheck-manifest: {option}: {problem}")
        return path.resolve()
    # As ``shardcheck check`` finds it: in the rootdir or the nearest parent directory.
    try:
        return find_manifest(config.rootpath).resolve()
    except InputError as exc:
        raise pytest.UsageError(
            f"--shardcheck: {exc.message} (or pass --shardcheck-manifest FILE)"
        ) from None


def _contains(directory_or_file: Path, target: Path) -> bool:
    try:
        return target.is_relative_to(directory_or_file.resolve())
    except OSError:
        return False


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    settings = parent.config.stash.get(_SETTINGS, None)
    manifest = None if settings is None else settings.manifest_path
    if manifest is None or file_path.name != manifest.name or file_path.resolve() != manifest:
        return None
    return ManifestFile.from_parent(parent, path=file_path)


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect: every test of a file is seen
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    users = [item for item in items if FIXTURE in getattr(item, "fixturenames", ())]
    if users:
        goldens = _settings(config).goldens()
        for item in users:
            goldens.files.setdefault(str(item.path), set()).add(item.nodeid)


def pytest_deselected(items: list[pytest.Item]) -> None:
    for item in items:
        if FIXTURE in getattr(item, "fixturenames", ()):
            _settings(item.config).goldens().partial.add(str(item.path))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield
    if FIXTURE in getattr(item, "fixturenames", ()):
        _settings(item.config).goldens().ran.add(item.nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist, on the controller: merge what a worker wrote and used."""
    sent = getattr(node, "workeroutput", {}).get(_WORKER_KEY)
    if sent is None:
        return
    settings = _settings(node.config)
    settings.written.extend(line for line in sent["written"] if line not in settings.written)
    if sent["goldens"] is not None:
        settings.goldens().merge(sent["goldens"])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    settings = config.stash.get(_SETTINGS, None)
    if settings is None:
        return
    goldens = settings.session_goldens
    if hasattr(config, "workerinput"):  # an xdist worker: the controller decides
        config.workeroutput[_WORKER_KEY] = {  # type: ignore[attr-defined]
            "written": settings.written,
            "goldens": None if goldens is None else goldens.to_json(),
        }
        return
    if goldens is None:
        return
    root = config.rootpath
    if settings.update:
        removed, left = goldens.remove_stale()
        settings.written.extend(f"removed {_relative(path, root)}" for path in removed)
    else:
        left = goldens.stale()
    settings.stale_lines = [
        f"{_relative(path, root)} (no test asked for it; delete it, or run with "
        f"{UPDATE_FLAG} to remove it)"
        for path in left
    ]
    if settings.stale_lines and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    settings = config.stash.get(_SETTINGS, None)
    if settings is not None and (settings.written or settings.stale_lines):
        terminalreporter.section("shardcheck")
        for line in settings.written:
            terminalreporter.write_line(line)
        for line in settings.stale_lines:
            terminalreporter.write_line(f"stale golden: {line}")


def _settings(config: pytest.Config) -> _Settings:
    return config.stash[_SETTINGS]


def _one_line_error(excinfo: pytest.ExceptionInfo[BaseException]) -> str | None:
    from shardcheck.errors import ShardcheckError

    if isinstance(excinfo.value, ShardcheckFailure):
        return str(excinfo.value)
    if isinstance(excinfo.value, ShardcheckError):
        return excinfo.value.message
    return None


class ManifestFile(pytest.File):
    """The manifest file: one collector per model."""

    def collect(self) -> Iterator[pytest.Item | pytest.Collector]:
        from shardcheck.gating.manifest import load_manifest

        manifest = load_manifest(self.path)
        for entry in manifest.models:
            yield ModelCollector.from_parent(self, name=entry.name, entry=entry)
        if manifest.golden_dir is not None:
            yield StaleGoldensItem.from_parent(self, name=STALE_ITEM_NAME, manifest=manifest)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException]) -> Any:  # type: ignore[override]
        message = _one_line_error(excinfo)
        if message is None:
            return super().repr_failure(excinfo)
        # Name the manifest as the node id does, not by its absolute path.
        return message.replace(str(self.path), self.nodeid, 1)


class ModelCollector(pytest.Collector):
    """One model of the manifest: its ``gen`` item, and ``verify`` if the entry asks for it."""

    def __init__(self, *, entry: ModelEntry, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.entry = entry

    def collect(self) -> Iterator[pytest.Item]:
        yield GenItem.from_parent(self, name="gen", entry=self.entry)
        if self.entry.verify:
            yield VerifyItem.from_parent(self, name="verify", entry=self.entry)


class _ModelItem(pytest.Item):
    def __init__(self, *, entry: ModelEntry, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.entry = entry

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"{self.entry.name}::{self.name}"

    def repr_failure(  # type: ignore[override]
        self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None
    ) -> Any:
        message = _one_line_error(excinfo)
        return super().repr_failure(excinfo, style) if message is None else message


class GenItem(_ModelItem):
    """Generate the model's hints and compare them with its golden (rewrite with update)."""

    def runtest(self) -> None:
        from shardcheck.gating.gate import CREATED, UPDATED, check_model

        settings = _settings(self.config)
        # A missing golden is written (and the item fails below), as the fixture does.
        missing = not os.path.lexists(self.entry.golden_path)
        result = check_model(self.entry, update=settings.update or missing)
        status = None if result.golden is None else result.golden.status
        if status in (UPDATED, CREATED):
            settings.written.append(f"{status} {result.entry.golden_text}")
        if not result.ok:
            raise ShardcheckFailure("\n".join(result.lines(update_flag=UPDATE_FLAG)))
        if status == CREATED and not settings.update:
            raise ShardcheckFailure(_created(result.entry.golden_text))


class VerifyItem(_ModelItem):
    """Verify the model's generated plan (``shardcheck.verification.verify``): its hints, and
    the extension where gen writes one, as ``check --verify`` does."""

    def runtest(self) -> None:
        from shardcheck.gating.extension_verify import failed_plans, failure_text
        from shardcheck.gating.gate import verify_model

        # In a child process: past the entry's timeout it is killed, and this session goes on.
        hints, extension = verify_model(self.entry, in_child=True)
        if failed_plans(hints, extension):
            raise ShardcheckFailure(failure_text(self.entry, hints, extension))


def _created(shown: str) -> str:
    return (
        f"created: {shown} (there was no golden: review it, then rerun to compare against it; "
        f"{UPDATE_FLAG} writes goldens without failing)"
    )


class StaleGoldensItem(pytest.Item):
    """Goldens in the manifest's golden-dir that no model claims (removed by the update)."""

    def __init__(self, *, manifest: Manifest, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.manifest = manifest

    def runtest(self) -> None:
        from shardcheck.gating.gate import find_stale_goldens
        from shardcheck.gating.golden_files import remove_stale

        settings = _settings(self.config)
        stale = find_stale_goldens(self.manifest)
        if settings.update:
            removed = [path for path in stale if remove_stale(path)]
            settings.written.extend(f"removed {self.manifest.display(p)}" for p in removed)
            stale = tuple(path for path in stale if path not in removed)
        if stale:
            shown = "\n".join(f"    {self.manifest.display(path)}" for path in stale)
            advice = (
                "not hints files, so never removed: delete them or list their models"
                if settings.update
                else f"delete them, list their models, or run with {UPDATE_FLAG}"
            )
            raise ShardcheckFailure(
                f"goldens that no model in the manifest claims ({advice}):\n{shown}"
            )

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.name

    def repr_failure(  # type: ignore[override]
        self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None
    ) -> Any:
        message = _one_line_error(excinfo)
        return super().repr_failure(excinfo, style) if message is None else message


class ShardHintsRegression:
    """``shard_hints_regression.check(model_path, **gen_options)`` against a golden file.

    The golden is ``<test file dir>/<test file stem>/<test name>.json`` (or ``<basename>.json``).
    A missing golden is written and the test fails with ``created: PATH``; a different one fails
    with the semantic differences. With --shardcheck-update both are written and the test passes.
    """

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request

    def golden_path(self, basename: str | None = None) -> Path:
        test_file = Path(self._request.path)
        if basename is not None and (
            not basename or basename in (".", "..") or re.search(r"[/\\\0]", basename)
        ):
            # The golden stays in the test file's golden directory.
            pytest.fail(
                f"check(basename={basename!r}): expected a file name without a directory",
                pytrace=False,
            )
        name = basename or re.sub(r"\W", "_", self._request.node.name)
        return test_file.parent / test_file.stem / f"{name}.json"

    def _shown(self, path: Path) -> str:
        """``path`` relative to the rootdir, as pytest shows node ids."""
        try:
            return str(path.relative_to(self._request.config.rootpath))
        except ValueError:
            return str(path)

    def check(
        self,
        model_path: str | os.PathLike[str],
        *,
        basename: str | None = None,
        **gen_options: Any,
    ) -> ShardHints:
        """The hints of ``model_path``; fails the test unless they equal the golden."""
        __tracebackhide__ = True
        from shardcheck.errors import ShardcheckError
        from shardcheck.gating.gate import (
            CREATED,
            DIFFERS,
            INVALID,
            UPDATED,
            compare_with_golden,
            count_text,
        )
        from shardcheck.generation.generate import generate
        from shardcheck.generation.options import GenOptions
        from shardcheck.graph.loader import load_index

        golden = self.golden_path(basename)
        settings = _settings(self._request.config)
        # Test names map to file names many to one ("a-b" and "a_b" both give "a_b"); a
        # basename given is shared on purpose.
        owner = self._request.node.nodeid
        if basename is None:
            owner = settings.fixture_goldens.setdefault(golden, owner)
        if owner != self._request.node.nodeid:
            pytest.fail(
                f"{self._shown(golden)} is the golden of {owner} too; give one of the tests "
                "its own with check(..., basename=...)",
                pytrace=False,
            )
        update = settings.update or not os.path.lexists(golden)
        settings.goldens().used.add(str(golden.resolve()))
        error = None
        try:
            options = GenOptions.from_mapping(gen_options, source="shard_hints_regression.check")
            hints = generate(load_index(model_path), options).hints
            comparison = compare_with_golden(hints, golden, update=update)
        except ShardcheckError as exc:
            error = exc.message
        if error is not None:  # failed outside the except: no "during handling of" chain
            pytest.fail(error, pytrace=False)
        lines = [f"    {difference.line()}" for difference in comparison.differences]
        shown = self._shown(golden)
        if comparison.status in (CREATED, UPDATED):
            settings.written.append(f"{comparison.status} {shown}")
        if comparison.status == CREATED and not settings.update:
            pytest.fail(_created(shown), pytrace=False)
        if comparison.status == DIFFERS:
            count = count_text(comparison.differences)
            pytest.fail(
                "\n".join(
                    [
                        f"{shown}: the hints differ from the golden ({count}; "
                        f"run with {UPDATE_FLAG} to accept them)",
                        *lines,
                    ]
                ),
                pytrace=False,
            )
        if comparison.status == INVALID:
            pytest.fail(f"{comparison.problem} (rewrite it with {UPDATE_FLAG})", pytrace=False)
        return hints


@pytest.fixture
def shard_hints_regression(request: pytest.FixtureRequest) -> ShardHintsRegression:
    """Compare a model's hints with a golden named after the test (see ShardHintsRegression)."""
    return ShardHintsRegression(request)
