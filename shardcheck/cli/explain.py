"""``shardcheck explain``: the plan of CP hints, counted (FLOPs on slices, memory, traffic)."""

from __future__ import annotations

import click

from shardcheck.cli.arguments import DIM_OPTION, FORMAT_OPTION, dims_mapping
from shardcheck.errors import InputError
from shardcheck.fsio import atomic_write_text, same_file
from shardcheck.generation.extension import plans_report, shares_line
from shardcheck.generation.generate import generate
from shardcheck.generation.messages import code_of
from shardcheck.generation.options import GenOptions
from shardcheck.graph.loader import load_index
from shardcheck.hints.files import read_hints
from shardcheck.planning.flop_count import DEFAULT_RANKS, DEFAULT_SEQ_LEN
from shardcheck.planning.plan import make_plan
from shardcheck.planning.report import render_json, render_text


@click.command(name="explain")
@click.argument("model", type=click.Path())
@click.argument("hints", type=click.Path(), required=False)
@click.option(
    "--seq-len",
    type=int,
    default=None,
    help=f"Sequence length S to count at (default {DEFAULT_SEQ_LEN}, or the one length the "
    "model runs at).",
)
@click.option(
    "--ranks", type=int, default=DEFAULT_RANKS, show_default=True, help="Number of ranks N."
)
@DIM_OPTION
@click.option(
    "-o",
    "--output",
    default=None,
    help="Also write the plan's picture: a self-contained HTML page (plan.html).",
)
@FORMAT_OPTION
def explain(
    model: str,
    hints: str | None,
    seq_len: int | None,
    ranks: int,
    dims: tuple[tuple[str, int], ...],
    output: str | None,
    output_format: str,
) -> int:
    """Count the plan of HINTS for MODEL: the FLOPs run on slices and whole, each rank's peak
    activation memory, the bytes each rank receives, the speed-up bound. HINTS may be an
    extension file (HINTS.shardcheck.json). Without HINTS, the plan gen writes: its hints, or
    the extension where gen writes one, with how much each splits."""
    if output is not None:
        for path in (model, hints):
            if path is not None and same_file(output, path):
                raise InputError(f"{output}: is an input; write the picture elsewhere")
    given = read_hints(hints) if hints is not None else None  # the cheaper read first
    index = load_index(model)
    extended = None
    not_exact: list[str] | None = None
    if given is not None:
        found = given
        source = hints if given.lengths is None else f"{hints} (shardcheck's extension)"
    else:
        # gen's default plan: its hints, or the extension it writes beside them.
        generated = generate(index, GenOptions())
        extended = generated.extension
        found = generated.hints if extended is None else extended.hints
        # The extension is written only where it leaves no more places without an exact cut,
        # and the lengths it gives make those of the hints exact: what gen warns holds for
        # the hints alone.
        prefix = f"{index.source}: "
        not_exact = (
            []
            if extended is not None
            else [
                warning.removeprefix(prefix)
                for warning in generated.warnings
                if code_of(warning) == "SC308"
            ]
        )
        source = f"gen's default hints of {model}" + (
            "" if extended is None else ", with the extension gen writes beside them"
        )
    plan = make_plan(
        index, found, seq_len=seq_len, ranks=ranks, dims=dims_mapping(dims), hints_source=source
    )
    if output is not None:
        from shardcheck.planning.picture import render_html

        atomic_write_text(output, render_html(plan))
    if output_format == "json":
        click.echo(render_json(plan, plans_report(extended), not_exact), nl=False)
    else:
        line = None if extended is None else shares_line(extended, None)
        click.echo(render_text(plan, line, not_exact or ()), nl=False)
    return 0
