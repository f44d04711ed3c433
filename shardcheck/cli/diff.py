"""``shardcheck diff``: compare two hints files semantically."""

from __future__ import annotations

import click

from shardcheck.cli.arguments import FORMAT_OPTION
from shardcheck.hints.diff import diff_hints, render_json, render_text
from shardcheck.hints.files import read_hints


@click.command()
@click.argument("golden", type=click.Path())
@click.argument("candidate", type=click.Path())
@FORMAT_OPTION
@click.option(
    "--ignore",
    "ignore",
    multiple=True,
    metavar="PATH",
    help="Do not report differences at PATH or below (repeatable; * is a wildcard), "
    "e.g. 'dist_collectives.root' or 'inputs[*].rank'.",
)
def diff(golden: str, candidate: str, output_format: str, ignore: tuple[str, ...]) -> int:
    """Compare GOLDEN and CANDIDATE hints: exit 0 if equal, 1 if different, 2 if unreadable."""
    differences = diff_hints(read_hints(golden), read_hints(candidate), ignore)
    if output_format == "json":
        click.echo(render_json(golden, candidate, differences), nl=False)
    else:
        click.echo(render_text(differences), nl=False)
    return 1 if differences else 0
