"""``shardcheck fmt``: re-save a hints file (either format) in Polygraphy 0.53.6's format, or
check (``--check``) that hints files are in that canonical form."""

from __future__ import annotations

import click

from shardcheck.cli.arguments import FORMAT_OPTION, QUIET_OPTION
from shardcheck.cli.json_output import echo_json
from shardcheck.errors import InputError
from shardcheck.hints.extension import hints_text, loads_hints_or_extension
from shardcheck.hints.files import read_hints, read_text_input, write_hints
from shardcheck.wording import one_line


@click.command()
@click.argument("hints", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--output", help="File to write ('-' for stdout; may be HINTS).")
@click.option(
    "--check",
    is_flag=True,
    help="Write nothing; exit 1 if a HINTS file is not in canonical form (pre-commit's hook).",
)
@FORMAT_OPTION
@QUIET_OPTION
def fmt(
    hints: tuple[str, ...], output: str | None, check: bool, output_format: str, quiet: bool
) -> int:
    """Validate HINTS and write it in the 0.53.6 format (old flat files are converted); with
    --check, tell whether each HINTS file is already written so."""
    if check:
        if output is not None:
            raise InputError("-o: fmt --check writes nothing; leave -o out")
        return _check(hints, output_format, quiet)
    if output is None:
        raise InputError("-o: give the file to write ('-' for stdout), or use --check")
    if len(hints) > 1:
        raise InputError(f"{hints[1]}: fmt rewrites one file at a time (--check takes several)")
    write_hints(output, read_hints(hints[0]))
    if output_format == "json" and output != "-":
        echo_json({"ok": True, "hints": hints[0], "output": output})
    return 0


def _check(paths: tuple[str, ...], output_format: str, quiet: bool) -> int:
    """0 when every file is as fmt writes it, else 1, naming each that is not."""
    unformatted = []
    for path in paths:
        text = read_text_input(path, "a JSON hints file")
        if hints_text(loads_hints_or_extension(text, source=path)) != text:
            unformatted.append(path)
    if output_format == "json":
        echo_json({"ok": not unformatted, "checked": list(paths), "not_canonical": unformatted})
    elif not quiet:
        for path in unformatted:
            click.echo(
                one_line(
                    f"{path}: not in canonical form; 'shardcheck fmt {path} -o {path}' fixes it"
                )
            )
    return 1 if unformatted else 0
