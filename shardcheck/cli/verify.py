"""``shardcheck verify``: check hints against their model with onnxruntime."""

from __future__ import annotations

from typing import Any

import click

from shardcheck.cli.arguments import (
    DIM_OPTION,
    FORMAT_OPTION,
    QUIET_OPTION,
    ascii_int,
    codes_option,
    dims_mapping,
    tolerance_options,
)
from shardcheck.cli.progress import Progress
from shardcheck.runtime.supervised import runs_bounded
from shardcheck.verification.findings import CODES
from shardcheck.verification.verify import DEFAULT_SEQ_LENS, verify
from shardcheck.wording import shown


def _int_list(_ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        return tuple(ascii_int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(
            f"expected integers separated by commas, got {shown(value)}"
        ) from None


def _own_lengths(
    _ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> dict[str, tuple[int, ...]]:
    found: dict[str, tuple[int, ...]] = {}
    for value in values:
        name, equals, lengths = value.partition("=")
        if not equals or not name.strip():
            raise click.BadParameter(f"expected NAME=L1,L2, got {shown(value)}")
        if name in found:
            raise click.BadParameter(f"--seq-len {shown(name)} is given more than once")
        found[name] = _int_list(_ctx, param, lengths)
    return found


@click.command(name="verify")
@click.argument("model", type=click.Path())
@click.argument("hints", type=click.Path())
@click.option(
    "--seq-lens",
    default=",".join(map(str, DEFAULT_SEQ_LENS)),
    show_default=True,
    callback=_int_list,
    help="Sequence lengths to run at (two or more).",
)
@click.option(
    "--seq-len",
    "seq_len_of",
    multiple=True,
    callback=_own_lengths,
    metavar="NAME=L1,L2",
    help="A sequence dim's own lengths, one per run of --seq-lens (repeatable): an "
    "encoder-decoder's target beside its source, e.g. --seq-lens 8,16 --seq-len target=6,12. "
    "The other sequence dims take --seq-lens.",
)
@DIM_OPTION
@click.option(
    "--ranks",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks the CP simulation runs on, compared with one device  [default: the hints' "
    "own number of ranks (nb_rank, group size) if above 1, else 2]",
)
@click.option(
    "--no-simulate",
    "simulate",
    is_flag=True,
    flag_value=False,
    default=True,
    help="Skip the CP simulation. Then only the axes, ranks and layers are checked: nothing "
    "proves that the hints give the single-device result when the model runs split.",
)
@tolerance_options(" (the simulation's)", by_type=True)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds each onnxruntime run may take.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@FORMAT_OPTION
@QUIET_OPTION
@codes_option(CODES, "the findings")
@click.option("--strict", is_flag=True, help="Warnings fail too (exit 1), as errors do.")
def verify_command(
    model: str,
    hints: str,
    dims: tuple[tuple[str, int], ...],
    output_format: str,
    quiet: bool,
    ignore: tuple[str, ...],
    strict: bool,
    **settings: Any,
) -> int:
    """Check that HINTS fit MODEL: exit 0 if every check passes, 1 on an error finding (or a
    warning, with --strict)."""
    # The options named like verify's keywords (seq_lens, ranks, simulate, rtol, atol,
    # timeout, seed) are handed on as they are. Past --timeout and its grace, the console
    # command ends (runtime/supervised.py).
    with Progress(enabled=not quiet) as progress, runs_bounded(settings["timeout"], model):
        progress(f"checking {hints} against {model}...")
        report = verify(model, hints, dims=dims_mapping(dims), progress=progress, **settings)
    report = report.judged(strict=strict, ignore=ignore, quiet=quiet)
    text = report.render_json() if output_format == "json" else report.render_text()
    click.echo(text, nl=False)
    return 0 if report.ok else 1
