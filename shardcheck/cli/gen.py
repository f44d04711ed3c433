"""``shardcheck gen``: write the hints for a model."""

from __future__ import annotations

from pathlib import Path

import click

from shardcheck.cli import warning_line
from shardcheck.cli.arguments import FORMAT_OPTION, INT_LIST, QUIET_OPTION, codes_option, defaulted
from shardcheck.cli.gen_extension import write_extension
from shardcheck.cli.json_output import echo_json
from shardcheck.errors import InputError
from shardcheck.fsio import same_file
from shardcheck.generation.extension import extension_report
from shardcheck.generation.generate import generate
from shardcheck.generation.messages import code_of
from shardcheck.generation.options import COMPAT_MODES, CP_TYPES, IO_MODES, GenOptions
from shardcheck.generation.parts import GenResult
from shardcheck.graph.concurrent_check import checked_concurrently
from shardcheck.graph.index import GraphIndex, gc_paused
from shardcheck.graph.loader import index_parsed, parse_model
from shardcheck.hints.codec import encode
from shardcheck.hints.files import write_hints
from shardcheck.hints.model import REDUCE_OPS
from shardcheck.verification.findings import CODES
from shardcheck.wording import one_line


@click.command()
@click.argument("model", type=click.Path(dir_okay=True))
@click.option("-o", "--output", required=True, help="Hints file to write ('-' for stdout).")
@defaulted("--parallelism", click.Choice(["CP", "TP"]), "CP", "Kind of parallelism.")
@defaulted("--root", int, -1, "Rank of the root process.")
@defaulted("--gpus", int, 0, "Number of participating GPUs (0: all); written as group_size.")
@click.option("--groups", type=INT_LIST, default="", help="NCCL group indices (omit for all).")
@defaulted(
    "--cp-type",
    click.Choice(CP_TYPES),
    "native",
    "native: gather K/V; fused: replace each layer with a fused attention op.",
)
@click.option("--no-suggest-io", is_flag=True, help="Do not suggest inputs/outputs to shard.")
@defaulted("--i-idx", int, 0, "Sequence axis of inputs when it cannot be found.")
@defaulted("--o-idx", int, 0, "Sequence axis of outputs when it cannot be found.")
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
@defaulted(
    "--reduce-op", click.Choice(REDUCE_OPS), "max", "reduce_op of the reduce-scatter collectives."
)
@defaulted(
    "--attention-pattern",
    click.IntRange(0, 1),
    0,
    "Polygraphy attention pattern to match (0 or 1).",
)
@click.option("--q-shuffle", type=INT_LIST, default=None, help="Permutation applied to Q (fused).")
@click.option("--k-shuffle", type=INT_LIST, default=None, help="Permutation applied to K (fused).")
@click.option("--v-shuffle", type=INT_LIST, default=None, help="Permutation applied to V (fused).")
@click.option("--is-causal", is_flag=True, help="The fused attention is causal.")
@defaulted("--nb-rank", int, 1, "Number of ranks for the attention op.")
@defaulted(
    "--compat",
    click.Choice(COMPAT_MODES),
    "none",
    "'polygraphy' reproduces 'polygraphy template shard-hints' exactly.",
)
@defaulted(
    "--io",
    click.Choice(IO_MODES),
    "frontier",
    "frontier: the tensors that make CP exact (position tables and masks computed whole, "
    "then scattered); graph: graph inputs and outputs only, as Polygraphy suggests them.",
)
@click.option(
    "--extension/--no-extension",
    default=True,
    show_default=True,
    help="Also write HINTS.shardcheck.json, shardcheck's extension, where its plan runs more of "
    "the projections and MLP on slices than the Polygraphy-compatible hints (give it to shard, "
    "verify, simulate, explain). Never with --compat polygraphy or --io graph.",
)
@click.option(
    "--plan/--no-plan",
    "show_plan",
    default=True,
    show_default=True,
    help="Print the summary line of the plan written on stderr (what 'shardcheck explain' "
    "counts; where an extension is written, its line of both plans' shares is that line). "
    "Never with --compat polygraphy or -q.",
)
@FORMAT_OPTION
@QUIET_OPTION
@codes_option(CODES, "the warnings")
def gen(
    model: str,
    output: str,
    output_format: str,
    quiet: bool,
    ignore: tuple[str, ...],
    show_plan: bool,
    **options: object,
) -> int:
    """Write shard hints for MODEL (an ONNX file) to OUTPUT. Its warnings go to stderr, each
    with its code (docs/findings.md); with --format json, a JSON report goes to stdout (the
    hints in it with -o -)."""
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
    warnings = [w for w in result.warnings if code_of(w) not in ignore]
    if output_format == "json":
        if output != "-":
            write_hints(output, result.hints)
        written, _ = _extension(output, model, result, gen_options)
        echo_json(
            {
                "ok": True,
                "model": model,
                "output": output,
                "warnings": [{"code": code_of(w), "message": w} for w in warnings],
                "hints": encode(result.hints) if output == "-" else None,
                "extension": extension_report(result.extension, written),
            }
        )
    else:
        if not quiet:
            for warning in warnings:
                code = code_of(warning)  # named at the end, unless the text names it already
                named = code is None or f"({code})" in warning
                warning_line(warning if named else f"{warning} [{code}]")
        write_hints(output, result.hints)
        _, line = _extension(output, model, result, gen_options)
        if line and not quiet:
            click.echo(f"shardcheck: {one_line(line)}", err=True)
        offered = result.extension is not None and gen_options.extension
        if show_plan and not quiet and gen_options.compat != "polygraphy" and not offered:
            # Where the extension is offered, its line above says how much each plan splits.
            _echo_plan_summary(index, result, gen_options.nb_rank)
    return 0


def _extension(
    output: str, model: str, result: GenResult, options: GenOptions
) -> tuple[str | None, str]:
    """The extension file written beside the hints (cli/gen_extension.py), and its line."""
    if not options.extension or options.compat == "polygraphy" or options.io == "graph":
        return None, ""
    written, line = write_extension(output, model, result.extension)
    if result.extension is None and result.no_extension:
        why = f"no extension written: {result.no_extension}"
        line = f"{line}; {why}" if line else f"{output}: {why}"
    return written, line


def _refuse_weight_file(output: str, model: str, locations: set[str]) -> None:
    for location in sorted(locations):
        if same_file(output, Path(model).parent / location):
            raise InputError(f"{output}: is a weight file of the model; write the hints elsewhere")


def _echo_plan_summary(index: GraphIndex, result: GenResult, nb_rank: int) -> None:
    """The plan written, in one line on stderr (Polygraphy's mode prints as Polygraphy does)."""
    from shardcheck.planning.report import gen_summary

    analysed = None if result.shapes is None else (result.shapes, list(result.layers))
    line = gen_summary(index, result.hints, nb_rank, analysed)
    if line is not None:
        click.echo(f"shardcheck: {one_line(line)}", err=True)
