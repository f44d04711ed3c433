"""The multi-device model written out, its external weight files beside it."""

from __future__ import annotations

import filecmp
import os
import shutil
from pathlib import Path

import onnx

from shardcheck.errors import InputError, OutputError
from shardcheck.fsio import (
    atomic_write_bytes,
    atomic_write_with,
    atomic_write_written,
    open_stream,
    output_target,
)
from shardcheck.graph.inline_weights import LentWeights
from shardcheck.graph.loader import weights_dir
from shardcheck.graph.tensors import external_tensors, locations_of


def save_sharded_model(
    model: onnx.ModelProto,
    *,
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    lent: LentWeights | None = None,
) -> list[Path]:
    """Write ``model`` to ``output``; its external weight files stay usable. ``lent``: the
    source's inline weights that the parsed model (and so ``model``) marks external, which go
    back inside the model written, as the source has them (read from it as they are written).

    The model keeps the external-data locations of ``source`` (relative to the model file).
    When ``output`` is in another directory, each weight file is copied there (not hard-linked:
    onnx refuses weight files with several links); an identical file already there is reused,
    a different one is an error, never overwritten. Returns the weight files copied.
    """
    source_dir = weights_dir(source)
    # Refuse a bad output path before a weight file is copied next to it.
    output_path, output_dir = output_target(output)
    output_dir = output_dir.resolve()
    locations = locations_of(
        t for t in external_tensors(model) if lent is None or not lent.lends(t)
    )
    _refuse_weight_location(locations, output_path, output_dir, source_dir)
    copied: list[Path] = []
    try:
        # A device, a pipe or a stream (-o /dev/null, /dev/stdout) has no directory to hold
        # weight files.
        beside_output = (
            output_dir != source_dir
            and not (output_path.exists() and not output_path.is_file())
            and open_stream(output_path) is None
        )
        if beside_output:
            for location in sorted(locations):
                if _place_weight_file(source_dir / location, output_dir / location):
                    copied.append(output_dir / location)
        serialized = model.SerializeToString()
        if lent is None:
            atomic_write_bytes(output_path, serialized)
        else:
            atomic_write_written(
                output_path, lambda stream: lent.write_inlined(serialized, stream, str(source))
            )
    except BaseException:
        for path in copied:  # copied by this call: nothing refers to them without the model
            path.unlink(missing_ok=True)
        raise
    return copied


def _refuse_weight_location(
    locations: set[str], output_path: Path, output_dir: Path, source_dir: Path
) -> None:
    """OutputError when the model file would be written where one of its own weight files
    (at ``locations``) goes (``-o out/weights.bin`` for weights at ``weights.bin``): the model
    would overwrite its copied weights, or they it."""
    written = output_dir / output_path.name
    for location in sorted(locations):
        for weights in {output_dir / location, source_dir / location}:
            if os.path.normpath(weights) == os.path.normpath(written):
                raise OutputError(
                    f"{output_path}: is where the model's weight file {location!r} goes; "
                    "give the sharded model another name"
                )


def _place_weight_file(source: Path, target: Path) -> bool:
    """Copy ``source`` to ``target``; False when an identical file is already there."""
    if not source.is_file():
        raise InputError(f"{source}: external weight file of the model is missing")
    if target.exists():
        if filecmp.cmp(source, target, shallow=False):
            return False
        raise OutputError(
            f"{target}: a different file is already there; the sharded model needs a copy of "
            f"{source} at that place (write the model to another directory)"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(source, "rb") as weights:
            atomic_write_with(target, lambda stream: shutil.copyfileobj(weights, stream))
    except OSError as exc:
        raise OutputError(f"{target}: cannot write: {exc.strerror or exc}") from None
    return True
