"""``shardcheck gen``: write the hints for a model."""

from __future__ import annotations

from pathlib import Path

import click

from shardcheck.cli import warning_line
from shardcheck.cli.arguments import INT_LIST
from shardcheck.errors import InputError
from shardcheck.fsio import same_file
from shardcheck.generation.generate import generate
from shardcheck.generation.options import COMPAT_MODES, CP_TYPES, IO_MODES, GenOptions
from shardcheck.graph.concurrent_check import checked_concurrently
from shardcheck.graph.index import gc_paused
from shardcheck.graph.loader import index_parsed, parse_model
from shardcheck.hints.files import write_hints
from shardcheck.hints.model import REDUCE_OPS
from shardcheck.lifetime import keep_until_exit


@click.command()
@click.argument("model", type=click.Path(dir_okay=True))
@click.option("-o", "--output", required=True, help="Hints file to write ('-' for stdout).")
@click.option(
    "--parallelism",
    type=click.Choice(["CP", "TP"]),
    default="CP",
    show_default=True,
    help="Kind of parallelism.",
)
@click.option("--root", type=int, default=-1, show_default=True, help="Rank of the root process.")
@click.option(
    "--gpus",
    type=int,
    default=0,
    show_default=True,
    help="Number of participating GPUs (0: all); written as group_size.",
)
@click.option("--groups", type=INT_LIST, default="", help="NCCL group indices (omit for all).")
@click.option(
    "--cp-type",
    type=click.Choice(CP_TYPES),
    default="native",
    show_default=True,
    help="native: gather K/V; fused: replace each layer with a fused attention op.",
)
@click.option("--no-suggest-io", is_flag=True, help="Do not suggest inputs/outputs to shard.")
@click.option(
    "--i-idx",
    type=int,
    default=0,
    show_default=True,
    help="Sequence axis of inputs when it cannot be found.",
)
@click.option(
    "--o-idx",
    type=int,
    default=0,
    show_default=True,
    help="Sequence axis of outputs when it cannot be found.",
)
@click.option(
    "--k-idx",
    type=int,
    default=None,
    help="Sequence axis of the gathered K (default: inferred; 0 with --compat).",
)
@click.option(
    "--v-idx",
    type=int,
    default=None,
    help="Sequence axis of the gathered V (default: inferred; 0 with --compat).",
)
@click.option("--i-rank", type=int, default=None, help="Input rank when the model has none.")
@click.option("--o-rank", type=int, default=None, help="Output rank when the model has none.")
@click.option("--kv-rank", type=int, default=None, help="K/V rank when the model has none.")
@click.option(
    "--reduce-op",
    type=click.Choice(REDUCE_OPS),
    default="max",
    show_default=True,
    help="reduce_op of the reduce-scatter collectives.",
)
@click.option(
    "--attention-pattern",
    type=click.IntRange(0, 1),
    default=0,
    show_default=True,
    help="Polygraphy attention pattern to match (0 or 1).",
)
@click.option("--q-shuffle", type=INT_LIST, default=None, help="Permutation applied to Q (fused).")
@click.option("--k-shuffle", type=INT_LIST, default=None, help="Permutation applied to K (fused).")
@click.option("--v-shuffle", type=INT_LIST, default=None, help="Permutation applied to V (fused).")
@click.option("--is-causal", is_flag=True, help="The fused attention is causal.")
@click.option(
    "--nb-rank",
    type=int,
    default=1,
    show_default=True,
    help="Number of ranks for the attention op.",
)
@click.option(
    "--compat",
    type=click.Choice(COMPAT_MODES),
    default="none",
    show_default=True,
    help="'polygraphy' reproduces 'polygraphy template shard-hints' exactly.",
)
@click.option(
    "--io",
    type=click.Choice(IO_MODES),
    default="frontier",
    show_default=True,
    help="frontier: the tensors that make CP exact (position tables and masks computed whole, "
    "then scattered); graph: graph inputs and outputs only, as Polygraphy suggests them.",
)
def gen(model: str, output: str, **options: object) -> int:
    """Write shard hints for MODEL (an ONNX file) to OUTPUT."""
    try:
        gen_options = GenOptions(**options)  # type: ignore[arg-type]
    except InputError as exc:
        # "i_idx: expected ..." names the field; name the option as it is typed.
        field, _, problem = exc.message.partition(": ")
        raise InputError(f"--{field.replace('_', '-')}: {problem}") from None
    if same_file(output, model):
        raise InputError(f"{output}: is the input model; write the hints elsewhere")
    with gc_paused():
        parsed = parse_model(model)
        _refuse_weight_file(output, model, parsed.initializer_locations())
        with checked_concurrently(parsed):
            index = index_parsed(parsed)
            result = generate(index, gen_options)
    # Weights in node attributes (a Constant's) are known once the checks have run.
    _refuse_weight_file(output, model, parsed.external_locations())
    for warning in result.warnings:
        warning_line(warning)
    write_hints(output, result.hints)
    keep_until_exit(parsed, index)
    return 0


def _refuse_weight_file(output: str, model: str, locations: set[str]) -> None:
    for location in sorted(locations):
        if same_file(output, Path(model).parent / location):
            raise InputError(f"{output}: is a weight file of the model; write the hints elsewhere")
