"""``shardcheck simulate``: run the sharded model on N simulated ranks, compare with one device."""

from __future__ import annotations

from typing import Any

import click

from shardcheck.simulate import simulate


class DimSetting(click.ParamType):
    """``NAME=VALUE``, VALUE a positive integer."""

    name = "NAME=VALUE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        name, sep, number = str(value).partition("=")
        if not sep or not name or not number.isdigit() or int(number) < 1:
            self.fail(f"expected NAME=VALUE with a positive integer, got {value!r}", param, ctx)
        return name, int(number)


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
    type=DimSetting(),
    multiple=True,
    help="Value of a symbolic dim (repeatable); batch-like dims default to 1, others to 2.",
)
@click.option("--rtol", type=float, default=1e-4, show_default=True, help="Relative tolerance.")
@click.option("--atol", type=float, default=1e-5, show_default=True, help="Absolute tolerance.")
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
    names = [name for name, _ in dims]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise click.BadParameter(f"--dim {repeated[0]} is given more than once", param_hint="--dim")
    result = simulate(
        model,
        hints,
        ranks=ranks,
        seq_len=seq_len,
        dims=dict(dims),
        rtol=rtol,
        atol=atol,
        seed=seed,
    )
    click.echo(result.summary())
    return 0 if result.ok else 1
