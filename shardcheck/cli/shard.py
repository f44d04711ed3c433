"""``shardcheck shard``: write the CP multi-device model of a model and its hints."""

from __future__ import annotations

from pathlib import Path

import click

from shardcheck.cli.arguments import FORMAT_OPTION
from shardcheck.cli.json_output import echo_json
from shardcheck.errors import InputError
from shardcheck.fsio import same_file
from shardcheck.graph.loader import check_weight_files, load_index
from shardcheck.hints.files import read_hints
from shardcheck.sharding.rewrite import shard_model
from shardcheck.sharding.save import save_sharded_model


@click.command()
@click.argument("model", type=click.Path())
@click.argument("hints", type=click.Path())
@click.option("-o", "--output", required=True, help="The multi-device ONNX model to write.")
@FORMAT_OPTION
def shard(model: str, hints: str, output: str, output_format: str) -> int:
    """Write the multi-device model of MODEL for the CP hints HINTS, as Polygraphy's
    'multi-device shard' does: DistCollective reduce-scatters after the hinted inputs,
    all-gathers of K and V (Q with gather_q) and of the hinted outputs; a layer hinted with
    replace (cp-type fused) becomes TensorRT's fused multi-device Attention.

    External weight files stay where they are when OUTPUT is next to MODEL; otherwise they
    are copied next to OUTPUT."""
    if output == "-":
        raise InputError(
            "-o -: shard writes an ONNX model file, not to standard output; give a file path"
        )
    if Path(output).exists() and Path(output).resolve() == Path(model).resolve():
        raise InputError(f"{output}: is the input model; write the sharded model elsewhere")
    index = load_index(model)
    if same_file(output, hints):
        raise InputError(f"{output}: is the hints file; write the sharded model elsewhere")
    for location in index.external_locations():
        if same_file(output, Path(model).parent / location):
            raise InputError(f"{output}: is a weight file of {model}; write the model elsewhere")
    # The weight files are copied or referred to as they are: a truncated one is refused.
    check_weight_files(index, model)
    sharded = shard_model(index, read_hints(hints), hints_source=hints)
    save_sharded_model(sharded.model, source=model, output=output, lent=index.lent_weights)
    if output_format == "json":
        collectives = sorted(sharded.tails.values(), key=lambda tail: tail.collective_node)
        echo_json(
            {
                "ok": True,
                "model": model,
                "hints": hints,
                "output": output,
                "collectives": [
                    {
                        "node": tail.collective_node,
                        "operation": tail.operation,
                        "tensor": tail.source,
                        "axis": tail.axis,
                    }
                    for tail in collectives
                ],
            }
        )
    return 0
