"""``shardcheck check``: gate every model of the manifest against its golden."""

from __future__ import annotations

import json

import click

from shardcheck.cli.arguments import FORMAT_OPTION
from shardcheck.errors import InputError
from shardcheck.fsio import atomic_write_text, output_target, same_file
from shardcheck.gating.gate import looks_like_a_golden, run_check
from shardcheck.gating.manifest import Manifest, find_manifest, load_manifest
from shardcheck.lifetime import free_when_done


@click.command()
@click.option(
    "--manifest",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML file with a [tool.shardcheck] table "
    "(default: ./shardcheck.toml if present, else ./pyproject.toml).",
)
@click.option("--update", is_flag=True, help="Rewrite the goldens that differ or are missing.")
@click.option(
    "--verify", is_flag=True, help="Also verify the models whose entry has verify = true."
)
@FORMAT_OPTION
@click.option("--report", type=click.Path(dir_okay=False), help="Also write the JSON report here.")
def check(
    manifest: str | None, update: bool, verify: bool, output_format: str, report: str | None
) -> int:
    """Regenerate every model's hints and compare them with its golden.

    Exit 0 if all match, 1 if any model differs, has no golden, fails or a golden is stale,
    2 if the manifest cannot be used.
    """
    free_when_done()  # many models, one after the other
    if manifest == "":
        raise InputError("--manifest '': the manifest path is empty")
    loaded = load_manifest(find_manifest() if manifest is None else manifest)
    if report is not None:  # refused before any golden is written
        _refuse_report_path(report, loaded)
    result = run_check(loaded, update=update, verify=verify)
    document = json.dumps(result.to_json(), indent=2) + "\n"
    if output_format == "json":
        click.echo(document, nl=False)
    else:
        for line in result.lines():
            click.echo(line)
    if report is not None:  # --report '' is a path that cannot be written, not 'no report'
        atomic_write_text(report, document)
    return 0 if result.ok else 1


def _refuse_report_path(report: str, manifest: Manifest) -> None:
    """InputError for a --report path that cannot be written or names one of the gate's own
    files: the manifest, a model, a golden, or a file in golden-dir that the stale-golden
    check would take for a golden."""
    if report == "-":
        raise InputError(
            "--report -: the report is written to a file; for the JSON report on standard "
            "output use --format json"
        )
    target, _ = output_target(report)
    inputs = [("the manifest", manifest.source)]
    for entry in manifest.models:
        inputs += [(f"the model of {entry.name}", entry.model_path)]
        inputs += [(f"the golden of {entry.name}", entry.golden_path)]
    for what, path in inputs:
        if same_file(target, path) or target.resolve() == path.resolve():
            raise InputError(f"--report {report}: is {what}; write the report elsewhere")
    if looks_like_a_golden(manifest, target):
        raise InputError(
            f"--report {report}: is a .json file in golden-dir, where it would be taken for "
            "a stale golden; write the report elsewhere"
        )
