"""``shardcheck simulate``: run the sharded model on N simulated ranks, compare with one device."""

from __future__ import annotations

from typing import Any

import click

from shardcheck.cli.arguments import (
    DIM_OPTION,
    FORMAT_OPTION,
    QUIET_OPTION,
    dims_mapping,
    tolerance_options,
)
from shardcheck.cli.json_output import echo_json
from shardcheck.cli.progress import Progress
from shardcheck.simulation.simulate import SimulationResult, simulate
from shardcheck.wording import one_line


@click.command(name="simulate")
@click.argument("model", type=click.Path())
@click.argument("hints", type=click.Path())
@click.option("--ranks", type=click.IntRange(min=1), required=True, help="Number of ranks.")
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    required=True,
    help="Sequence length (a multiple of --ranks).",
)
@DIM_OPTION
@tolerance_options(by_type=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@FORMAT_OPTION
@QUIET_OPTION
def simulate_command(
    model: str,
    hints: str,
    dims: tuple[tuple[str, int], ...],
    output_format: str,
    quiet: bool,
    **settings: Any,
) -> int:
    """Shard MODEL with HINTS, run it on N simulated ranks (onnxruntime, CPU) and compare the
    outputs with the single-device run. Exit 0: they match; 1: they differ (the first tensor
    that differs is named); 2: bad input."""
    # The options named like simulate's keywords (ranks, seq_len, rtol, atol, seed) are handed
    # on as they are.
    with Progress(enabled=not quiet) as progress:
        progress(
            f"simulating CP on {settings['ranks']} ranks at sequence length "
            f"{settings['seq_len']}..."
        )
        result = simulate(model, hints, dims=dims_mapping(dims), **settings)
    if output_format == "json":
        echo_json(_result_json(model, hints, result))
    elif not (quiet and result.ok):
        click.echo(one_line(result.summary()))
    return 0 if result.ok else 1


def _result_json(model: str, hints: str, result: SimulationResult) -> dict[str, Any]:
    """The simulation's result for --format json: what the summary says, as fields."""
    mismatch = result.mismatch
    return {
        "ok": result.ok,
        "model": model,
        "hints": hints,
        "ranks": result.ranks,
        "seq_len": result.seq_len,
        "dims": result.dims,
        "outputs": list(result.outputs),
        "stages": result.stages,
        "rtol": result.rtol,
        "atol": result.atol,
        "max_abs_error": result.max_abs_error,
        "length_fixed": result.length_fixed,
        "mismatch": None if mismatch is None else {"tensor": mismatch.tensor or None},
        "summary": result.summary(),
    }
