"""``shardcheck fmt``: re-save a hints file (either format) in Polygraphy 0.53.6's format."""

from __future__ import annotations

import click

from shardcheck.hints.files import read_hints, write_hints


@click.command()
@click.argument("hints", type=click.Path())
@click.option("-o", "--output", required=True, help="File to write ('-' for stdout; may be HINTS).")
def fmt(hints: str, output: str) -> int:
    """Validate HINTS and write it in the 0.53.6 format (old flat files are converted)."""
    write_hints(output, read_hints(hints))
    return 0
