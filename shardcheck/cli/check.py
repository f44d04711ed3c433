"""``shardcheck check``: gate every model of the manifest against its golden."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import click

from shardcheck.cli.arguments import FORMAT_OPTION, QUIET_OPTION, codes_option
from shardcheck.errors import InputError, OutputError, ShardcheckError
from shardcheck.fsio import atomic_write_text, nul_problem, output_target, same_file
from shardcheck.gating.gate import (
    WARNED,
    CheckResult,
    ModelResult,
    looks_like_a_golden,
    run_check,
)
from shardcheck.gating.manifest import Manifest, find_manifest, load_manifest
from shardcheck.gating.slices import merge_reports, parse_shard
from shardcheck.verification.findings import CODES
from shardcheck.wording import one_line


@click.command()
@click.option(
    "--manifest",
    metavar="FILE",  # checked by load_manifest (click's Path would fail on a NUL byte)
    default=None,
    help="TOML file with a [tool.shardcheck] table (default: shardcheck.toml, else a "
    "pyproject.toml with the table, in the current directory or the nearest parent).",
)
@click.option(
    "--update",
    is_flag=True,
    help="Rewrite the goldens that differ or are missing, and remove the stale ones.",
)
@click.option(
    "--verify", is_flag=True, help="Also verify the models whose entry has verify = true."
)
@click.option("--strict", is_flag=True, help="Fail the models that gen warns of.")
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=1),
    default=None,
    help="Processes to check the models in (default: the CPUs this process may use).",
)
@click.option(
    "--shard",
    metavar="K/N",
    default=None,
    help="Check only the K-th of N slices of the manifest (CI matrices; merge with --merge).",
)
@click.option(
    "--merge",
    "merge",
    multiple=True,
    metavar="REPORT",
    help="Merge the --report files of the N slices (repeat it) into the whole run's report.",
)
@FORMAT_OPTION
@QUIET_OPTION
@codes_option(CODES, "gen's warnings")
@click.option("--report", metavar="FILE", help="Also write the JSON report here.")
def check(
    manifest: str | None,
    update: bool,
    verify: bool,
    strict: bool,
    jobs: int | None,
    shard: str | None,
    merge: tuple[str, ...],
    output_format: str,
    quiet: bool,
    ignore: tuple[str, ...],
    report: str | None,
) -> int:
    """Regenerate every model's hints and compare them with its golden.

    Prints one line per model as it is done (in manifest order), then a summary line.

    Exit 0 if all match, 1 if any model differs, has no golden, fails (or, strict, has
    warnings) or a golden is stale, 2 if the manifest cannot be used.
    """
    # Paths are checked here, not by click.Path: one with a NUL byte would fail inside it.
    for option, path in (
        ("--manifest", manifest),
        ("--report", report),
        *(("--merge", m) for m in merge),
    ):
        problem = None if path is None else nul_problem(path)
        if problem is not None:
            raise InputError(f"{option} {path!r}: {problem}")
    if merge:
        if update or verify or strict or shard is not None or jobs is not None:
            raise InputError(
                "--merge: merges the reports as they are; give it without --update, --verify, "
                "--strict, --jobs or --shard"
            )
        return _merge(merge, output_format, report)
    if manifest == "":
        raise InputError("--manifest '': the manifest path is empty")
    slice_ = None if shard is None else parse_shard(shard)
    loaded = load_manifest(find_manifest() if manifest is None else manifest)
    if report is not None:  # refused before any model runs or any golden is written
        try:
            _refuse_report_path(report, loaded)
        except OSError as exc:  # a name too long, a loop of links...
            raise OutputError(f"{report}: cannot write: {exc.strerror or exc}") from None
    if jobs is None:
        from shardcheck.gating.parallel import default_jobs

        jobs = default_jobs()
    stream = output_format != "json"
    result = run_check(
        loaded,
        update=update,
        verify=verify,
        strict=strict,
        jobs=jobs,
        shard=slice_,
        ignore=ignore,
        on_result=(_echo_failures if quiet else _echo_lines) if stream else None,
    )
    document = _document(result)
    if stream:
        for line in result.stale_lines():
            click.echo(one_line(line))
        click.echo(one_line(result.summary()))
    else:
        click.echo(document, nl=False)
    if report is not None:  # --report '' is a path that cannot be written, not 'no report'
        atomic_write_text(report, document)
    return 0 if result.ok else 1


def _echo_lines(result: ModelResult) -> None:
    for line in result.lines():
        click.echo(one_line(line))


def _echo_failures(result: ModelResult) -> None:
    """-q: a model that passes says nothing; one that fails says why, without gen's warnings
    unless they are what fails it (strict)."""
    if result.ok:
        return
    if result.status != WARNED:
        result = dataclasses.replace(result, warnings=())
    _echo_lines(result)


def _document(result: CheckResult) -> str:
    document = result.to_json()
    document["seconds"] = round(result.seconds, 3)
    return json.dumps(document, indent=2) + "\n"


def _merge(paths: tuple[str, ...], output_format: str, report: str | None) -> int:
    """``--merge``: one report, and the lines of the whole run, from the slices' reports."""
    from shardcheck.gating.gate import summary_line

    merged = merge_reports(paths)
    if report is not None:
        for path in paths:
            if same_file(report, path):
                raise InputError(f"--report {report}: is the report of a slice; write it elsewhere")
        _probe_writable(report)
    document = json.dumps(merged, indent=2) + "\n"
    if output_format == "json":
        click.echo(document, nl=False)
    else:
        for line in merged["lines"]:
            click.echo(one_line(line))
        statuses = [model["status"] for model in merged["models"]]
        click.echo(
            summary_line(statuses, len(merged["stale"]), len(merged["removed"]), merged["seconds"])
        )
    if report is not None:
        atomic_write_text(report, document)
    return 0 if merged["ok"] else 1


def _refuse_report_path(report: str, manifest: Manifest) -> None:
    """InputError for a --report path that cannot be written or names one of the gate's own
    files: the manifest, a model or one of its weight files, a golden, or a file in golden-dir
    that the stale-golden check would take for a golden."""
    if report == "-":
        raise InputError(
            "--report -: the report is written to a file; for the JSON report on standard "
            "output use --format json"
        )
    target, _ = output_target(report)
    for what, path in _gate_files(manifest):
        if same_file(target, path) or target.resolve() == path.resolve():
            raise InputError(f"--report {report}: is {what}; write the report elsewhere")
    if looks_like_a_golden(manifest, target):
        raise InputError(
            f"--report {report}: is a .json file in golden-dir, where it would be taken for "
            "a stale golden; write the report elsewhere"
        )
    _probe_writable(report)


def _gate_files(manifest: Manifest) -> list[tuple[str, Path]]:
    """The files the gate reads or writes, each with what it is."""
    files: list[tuple[str, Path]] = [("the manifest", manifest.source)]
    for entry in manifest.models:
        files.append((f"the model of {entry.name}", entry.model_path))
        files.append((f"the golden of {entry.name}", entry.golden_path))
        files.extend(
            (f"a weight file of the model of {entry.name}", location)
            for location in _weight_files(entry.model_path)
        )
    return files


def _weight_files(model: Path) -> list[Path]:
    """The external weight files of ``model`` (none if it cannot be read: its check says so)."""
    from shardcheck.graph.loader import load_index

    try:
        locations = load_index(model).external_locations()
    except (ShardcheckError, OSError, ValueError):
        return []
    return [model.parent / location for location in sorted(locations)]


def _probe_writable(report: str) -> None:
    """OutputError unless a file can be made beside ``report`` (the atomic writer's way), so
    that a report that cannot be written stops the run before anything runs or is written."""
    target, directory = output_target(report)
    if target.exists() and not target.is_file():
        return  # a device or a stream: written in place
    try:
        handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise OutputError(f"{target}: cannot write: {exc.strerror or exc}") from None
    os.close(handle)
    os.unlink(name)
