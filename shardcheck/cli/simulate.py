"""``shardcheck simulate``: run the sharded model on N simulated ranks, compare with one device."""

from __future__ import annotations

import click

from shardcheck.cli.arguments import DIM_SETTING, dims_mapping, tolerance_options
from shardcheck.simulation.simulate import simulate


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
@click.option(
    "--dim",
    "dims",
    type=DIM_SETTING,
    multiple=True,
    help="Value of a symbolic dim (repeatable); batch-like dims default to 1, others to 2.",
)
@tolerance_options()
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
def simulate_command(
    model: str,
    hints: str,
    ranks: int,
    seq_len: int,
    dims: tuple[tuple[str, int], ...],
    rtol: float,
    atol: float,
    seed: int,
) -> int:
    """Shard MODEL with HINTS, run it on N simulated ranks (onnxruntime, CPU) and compare the
    outputs with the single-device run. Exit 0: they match; 1: they differ (the first tensor
    that differs is named); 2: bad input."""
    result = simulate(
        model,
        hints,
        ranks=ranks,
        seq_len=seq_len,
        dims=dims_mapping(dims),
        rtol=rtol,
        atol=atol,
        seed=seed,
    )
    click.echo(result.summary())
    return 0 if result.ok else 1
