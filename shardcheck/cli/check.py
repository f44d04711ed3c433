"""``shardcheck check``: gate every model of the manifest against its golden."""

from __future__ import annotations

import json

import click

from shardcheck.cli.arguments import FORMAT_OPTION
from shardcheck.fsio import atomic_write_text
from shardcheck.gate import run_check
from shardcheck.manifest import find_manifest, load_manifest


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
    result = run_check(load_manifest(manifest or find_manifest()), update=update, verify=verify)
    document = json.dumps(result.to_json(), indent=2) + "\n"
    if output_format == "json":
        click.echo(document, nl=False)
    else:
        for line in result.lines():
            click.echo(line)
    if report is not None:  # --report '' is a path that cannot be written, not 'no report'
        atomic_write_text(report, document)
    return 0 if result.ok else 1
