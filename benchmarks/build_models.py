"""Build the large ONNX models of the benchmark: stacked transformer encoder blocks.

The graphs are written the way the TorchScript exporter writes an encoder when constant folding
is off (``torch.onnx.export(..., do_constant_folding=False)``): every ``x.size(i)`` is its own
``Shape -> Gather`` on the tensor at hand, every Python int in a ``view`` is a ``Constant``, every
``Unsqueeze`` has its own axes ``Constant``, ``nn.Linear`` weights are stored ``[out, in]`` and
transposed by a ``Transpose`` node, the head size is computed from the shape as
``nn.MultiheadAttention`` does, and the additive attention mask is prepared in every layer (as
``nn.MultiheadAttention`` merges masks per layer). That gives about 167 nodes per block (136 in
the plain kind), the size of the real 192-layer export of the performance issue (32k nodes).

Two kinds of attention core:

* ``export`` -- HF eager attention: ``MatMul(q, k^T) -> Div(sqrt(d)) -> Add(mask) -> Softmax ->
  MatMul(., v)``. K^T cycles through the three ways exporters write it (the dynamo one in every
  other layer): ``Transpose`` with perm
  ``[0, 2, 3, 1]`` straight from ``[B, S, H, D]``; ``Transpose [0, 2, 1, 3]`` then
  ``Transpose [0, 1, 3, 2]`` before the score MatMul; the dynamo exporter's ``Reshape`` to 3-D ->
  ``Transpose [0, 2, 1]`` -> ``Reshape`` back to 4-D.
* ``plain`` -- Polygraphy's pattern 0, ``MatMul(q, k^T) -> Softmax -> MatMul(., v)`` with no scale
  and no mask (and no mask input), so that Polygraphy finds the layers too.

Embeddings come first: ``Gather`` of ``input_ids`` (int64 ``[batch, seq]``) plus a position
embedding ``Gather`` of ``Range(seq)``, then ``LayerNormalization``. Each block: Q/K/V
projections, heads, attention core, heads back, output projection, residual, LayerNormalization,
FFN with the Erf form of GELU, residual, LayerNormalization. Weights are seeded random numbers, so
a model is the same on every run; every model runs in onnxruntime.

The ``big`` model has few layers and a large hidden size so that its weights (>= 1 GB by default)
live in ``weights.bin`` next to ``model.onnx``, written by
``onnx.save(..., save_as_external_data=True, location="weights.bin")``.

Models are cached in ``--out`` (default ``/tmp/shardcheck-bench``), never in the repository; a
``manifest.json`` there records what was built with which parameters, so that an unchanged model
is not rebuilt.

    python benchmarks/build_models.py [--out DIR] [--depths 12,48,96,192] [--kinds export,plain]
                                      [--big-gb 1.0 | --no-big] [--force] [--check]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Bump when the generated graphs change, so that cached models are rebuilt.
GENERATOR_VERSION = 3
DEFAULT_OUT = Path("/tmp/shardcheck-bench")
DEFAULT_DEPTHS = (12, 48, 96, 192)
KINDS = ("export", "plain")
OPSET = 17
IR_VERSION = 8
SEED = 20240601
WEIGHT_SCALE = 0.02
VOCAB = 1000
MAX_POSITIONS = 512
MASK_FILL = -10000.0
# Layer i writes K^T in style i % 4; the dynamo exporter (torch.onnx's default since torch 2.9)
# writes half of them.
K_TRANSPOSE_STYLES = (
    "perm0231",
    "dynamo_reshape3d",
    "transpose_before_matmul",
    "dynamo_reshape3d",
)


@dataclass(frozen=True)
class EncoderConfig:
    depth: int
    kind: str = "export"
    hidden: int = 64
    heads: int = 4
    ffn: int = 256
    seed: int = SEED

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class BuiltModel:
    """One model of the cache, as ``run.py`` reads it."""

    name: str
    kind: str
    depth: int
    path: Path
    nodes: int
    file_bytes: int
    external_bytes: int = 0
    external_file: Path | None = None

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["path"] = str(self.path)
        data["external_file"] = str(self.external_file) if self.external_file else None
        return data

    @staticmethod
    def from_json(data: dict[str, object]) -> BuiltModel:
        external = data.get("external_file")
        return BuiltModel(
            name=str(data["name"]),
            kind=str(data["kind"]),
            depth=int(data["depth"]),  # type: ignore[call-overload]
            path=Path(str(data["path"])),
            nodes=int(data["nodes"]),  # type: ignore[call-overload]
            file_bytes=int(data["file_bytes"]),  # type: ignore[call-overload]
            external_bytes=int(data.get("external_bytes") or 0),  # type: ignore[call-overload]
            external_file=Path(str(external)) if external else None,
        )


# --------------------------------------------------------------------------- graph writer


class GraphWriter:
    """Appends nodes named the way the TorchScript exporter names them (``/scope/Op_3``)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._op_counts: Counter[tuple[str, str]] = Counter()

    def node(self, scope: str, op_type: str, inputs: Sequence[str], **attributes: object) -> str:
        index = self._op_counts[(scope, op_type)]
        self._op_counts[(scope, op_type)] += 1
        name = f"{scope}/{op_type}" + (f"_{index}" if index else "")
        output = f"{name}_output_0"
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name, **attributes))
        return output

    def constant(self, scope: str, value: np.ndarray) -> str:
        return self.node(scope, "Constant", [], value=numpy_helper.from_array(value))

    def ints(self, scope: str, values: Sequence[int]) -> str:
        return self.constant(scope, np.array(values, dtype=np.int64))

    def scalar(self, scope: str, value: float | int) -> str:
        dtype = np.int64 if isinstance(value, int) else np.float32
        return self.constant(scope, np.array(value, dtype=dtype))

    def weight(self, name: str, shape: Sequence[int], *, fill: float | None = None) -> str:
        if fill is None:
            values = self.rng.standard_normal(tuple(shape), dtype=np.float32) * WEIGHT_SCALE
        else:
            values = np.full(tuple(shape), fill, dtype=np.float32)
        self.initializers.append(numpy_helper.from_array(values.astype(np.float32), name))
        return name

    # ----------------------------------------------------------- TorchScript idioms

    def size(self, scope: str, tensor: str, axis: int) -> str:
        """``tensor.size(axis)``: a scalar int64."""
        shape = self.node(scope, "Shape", [tensor])
        return self.node(scope, "Gather", [shape, self.scalar(scope, axis)], axis=0)

    def unsqueeze(self, scope: str, tensor: str, axis: int = 0) -> str:
        return self.node(scope, "Unsqueeze", [tensor, self.ints(scope, [axis])])

    def view(self, scope: str, tensor: str, dims: Sequence[str | int]) -> str:
        """``tensor.view(*dims)``: scalar tensors are unsqueezed, ints become constants."""
        parts = [
            self.ints(scope, [dim]) if isinstance(dim, int) else self.unsqueeze(scope, dim)
            for dim in dims
        ]
        shape = self.node(scope, "Concat", parts, axis=0)
        return self.node(scope, "Reshape", [tensor, shape], allowzero=0)

    def linear(self, scope: str, tensor: str, prefix: str, n_in: int, n_out: int) -> str:
        """``nn.Linear`` without constant folding: ``x @ W.t() + b`` with W stored ``[out, in]``."""
        weight = self.weight(f"{prefix}.weight", (n_out, n_in))
        bias = self.weight(f"{prefix}.bias", (n_out,), fill=0.0)
        transposed = self.node(scope, "Transpose", [weight], perm=[1, 0])
        product = self.node(scope, "MatMul", [tensor, transposed])
        return self.node(scope, "Add", [bias, product])

    def layer_norm(self, scope: str, tensor: str, prefix: str, hidden: int) -> str:
        weight = self.weight(f"{prefix}.weight", (hidden,), fill=1.0)
        bias = self.weight(f"{prefix}.bias", (hidden,), fill=0.0)
        return self.node(
            scope, "LayerNormalization", [tensor, weight, bias], axis=-1, epsilon=1e-12
        )

    def gelu_erf(self, scope: str, tensor: str) -> str:
        """HF's exact GELU as exported: ``x * 0.5 * (1 + erf(x / sqrt(2)))``."""
        divided = self.node(scope, "Div", [tensor, self.scalar(scope, math.sqrt(2.0))])
        erf = self.node(scope, "Erf", [divided])
        shifted = self.node(scope, "Add", [erf, self.scalar(scope, 1.0)])
        product = self.node(scope, "Mul", [tensor, shifted])
        return self.node(scope, "Mul", [product, self.scalar(scope, 0.5)])


# --------------------------------------------------------------------------- encoder


def _embeddings(writer: GraphWriter, config: EncoderConfig) -> str:
    scope = "/embeddings"
    words = writer.weight("embeddings.word_embeddings.weight", (VOCAB, config.hidden))
    positions_table = writer.weight(
        "embeddings.position_embeddings.weight", (MAX_POSITIONS, config.hidden)
    )
    word_vectors = writer.node(f"{scope}/word_embeddings", "Gather", [words, "input_ids"])
    seq = writer.size(scope, "input_ids", 1)
    positions = writer.node(scope, "Range", [writer.scalar(scope, 0), seq, writer.scalar(scope, 1)])
    position_ids = writer.unsqueeze(scope, positions, 0)
    position_vectors = writer.node(
        f"{scope}/position_embeddings", "Gather", [positions_table, position_ids]
    )
    summed = writer.node(scope, "Add", [word_vectors, position_vectors])
    return writer.layer_norm(f"{scope}/LayerNorm", summed, "embeddings.LayerNorm", config.hidden)


def _additive_mask(writer: GraphWriter, scope: str, hidden: str) -> str:
    """``attention_mask`` [B, S] -> additive mask [B, 1, S, S]: 0 where kept, -1e4 where masked."""
    mask = writer.unsqueeze(scope, writer.unsqueeze(scope, "attention_mask", 1), 2)
    batch = writer.size(scope, "attention_mask", 0)
    query_len = writer.size(scope, hidden, 1)
    key_len = writer.size(scope, "attention_mask", 1)
    shape = writer.node(
        scope,
        "Concat",
        [
            writer.unsqueeze(scope, batch),
            writer.ints(scope, [1]),
            writer.unsqueeze(scope, query_len),
            writer.unsqueeze(scope, key_len),
        ],
        axis=0,
    )
    expanded = writer.node(scope, "Expand", [mask, shape])
    as_float = writer.node(scope, "Cast", [expanded], to=TensorProto.FLOAT)
    inverted = writer.node(scope, "Sub", [writer.scalar(scope, 1.0), as_float])
    as_bool = writer.node(scope, "Cast", [inverted], to=TensorProto.BOOL)
    fill = writer.scalar(scope, MASK_FILL)
    return writer.node(scope, "Where", [as_bool, fill, inverted])


def _key_transposed(writer: GraphWriter, scope: str, key_heads: str, style: str) -> str:
    """K^T [B, H, D, S] from K [B, S, H, D], written in one of the exporters' ways."""
    if style == "perm0231":
        return writer.node(scope, "Transpose", [key_heads], perm=[0, 2, 3, 1])
    key = writer.node(scope, "Transpose", [key_heads], perm=[0, 2, 1, 3])
    if style == "transpose_before_matmul":
        return writer.node(scope, "Transpose", [key], perm=[0, 1, 3, 2])
    # dynamo: K [B, H, S, D] -> [B*H, S, D] -> [B*H, D, S] -> [B, H, D, S]
    flat = writer.view(scope, key, [-1, writer.size(scope, key, 2), writer.size(scope, key, 3)])
    flat_t = writer.node(scope, "Transpose", [flat], perm=[0, 2, 1])
    dims = [writer.size(scope, key, axis) for axis in (0, 1, 3, 2)]
    return writer.view(scope, flat_t, dims)


def _encoder_block(writer: GraphWriter, config: EncoderConfig, layer: int, hidden: str) -> str:
    prefix = f"encoder.layer.{layer}"
    root = f"/encoder/layer.{layer}"
    scope = f"{root}/attention/self"
    plain = config.kind == "plain"

    mask = None if plain else _additive_mask(writer, scope, hidden)
    # head_dim = embed_dim // num_heads, from the shape (as nn.MultiheadAttention computes it)
    embed = writer.size(scope, hidden, 2)
    head_dim = writer.node(scope, "Div", [embed, writer.scalar(scope, config.heads)])
    head_dim = writer.node(scope, "Cast", [head_dim], to=TensorProto.INT64)
    head_dim = writer.node(scope, "Cast", [head_dim], to=TensorProto.INT64)

    heads: dict[str, str] = {}
    for role in ("query", "key", "value"):
        projected = writer.linear(
            f"{scope}/{role}",
            hidden,
            f"{prefix}.attention.self.{role}",
            config.hidden,
            config.hidden,
        )
        n_heads = writer.node(scope, "Div", [writer.size(scope, projected, 2), head_dim])
        heads[role] = writer.view(
            scope,
            projected,
            [
                writer.size(scope, projected, 0),
                writer.size(scope, projected, 1),
                n_heads,
                head_dim,
            ],
        )
    query = writer.node(scope, "Transpose", [heads["query"]], perm=[0, 2, 1, 3])
    style = K_TRANSPOSE_STYLES[layer % len(K_TRANSPOSE_STYLES)]
    key_t = _key_transposed(writer, scope, heads["key"], style)
    value = writer.node(scope, "Transpose", [heads["value"]], perm=[0, 2, 1, 3])

    scores = writer.node(scope, "MatMul", [query, key_t])
    if mask is not None:
        scale = writer.scalar(scope, float(math.sqrt(config.head_dim)))
        scores = writer.node(scope, "Div", [scores, scale])
        scores = writer.node(scope, "Add", [scores, mask])
    probs = writer.node(scope, "Softmax", [scores], axis=-1)
    context = writer.node(scope, "MatMul", [probs, value])
    context = writer.node(scope, "Transpose", [context], perm=[0, 2, 1, 3])
    context = writer.view(
        scope,
        context,
        [writer.size(scope, context, 0), writer.size(scope, context, 1), embed],
    )

    out_scope = f"{root}/attention/output"
    attended = writer.linear(
        f"{out_scope}/dense",
        context,
        f"{prefix}.attention.output.dense",
        config.hidden,
        config.hidden,
    )
    attended = writer.node(out_scope, "Add", [attended, hidden])
    attended = writer.layer_norm(
        f"{out_scope}/LayerNorm", attended, f"{prefix}.attention.output.LayerNorm", config.hidden
    )

    inner = writer.linear(
        f"{root}/intermediate/dense",
        attended,
        f"{prefix}.intermediate.dense",
        config.hidden,
        config.ffn,
    )
    inner = writer.gelu_erf(f"{root}/intermediate/intermediate_act_fn", inner)
    ffn_scope = f"{root}/output"
    out = writer.linear(
        f"{ffn_scope}/dense", inner, f"{prefix}.output.dense", config.ffn, config.hidden
    )
    out = writer.node(ffn_scope, "Add", [out, attended])
    return writer.layer_norm(
        f"{ffn_scope}/LayerNorm", out, f"{prefix}.output.LayerNorm", config.hidden
    )


def build_encoder(config: EncoderConfig) -> onnx.ModelProto:
    """A stacked encoder of ``config.depth`` blocks; weights inline unless saved externally."""
    if config.kind not in KINDS:
        raise ValueError(f"unknown kind {config.kind!r}; expected one of {KINDS}")
    writer = GraphWriter(np.random.default_rng(config.seed + config.depth))
    hidden = _embeddings(writer, config)
    for layer in range(config.depth):
        hidden = _encoder_block(writer, config, layer, hidden)
    # The exporter names the graph output after the model's return value.
    last = writer.nodes[-1]
    last.output[0] = "last_hidden_state"

    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    inputs = [ids]
    if config.kind != "plain":
        inputs.append(
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])
        )
    output = helper.make_tensor_value_info(
        "last_hidden_state", TensorProto.FLOAT, ["batch", "seq", config.hidden]
    )
    graph = helper.make_graph(
        writer.nodes, "main_graph", inputs, [output], initializer=writer.initializers
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="shardcheck-benchmarks",
        producer_version=str(GENERATOR_VERSION),
    )
    model.ir_version = IR_VERSION
    return model


# --------------------------------------------------------------------------- cache


def _manifest_path(out: Path) -> Path:
    return out / "manifest.json"


def _read_manifest(out: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(_manifest_path(out).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_manifest(out: Path, manifest: dict[str, dict[str, object]]) -> None:
    tmp = _manifest_path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    tmp.replace(_manifest_path(out))


def _record(out: Path, name: str, params: dict[str, object], built: BuiltModel) -> None:
    """Add a model just built to the manifest (read again: another build may have written)."""
    manifest = _read_manifest(out)
    manifest[name] = {"params": params, "model": built.to_json()}
    _write_manifest(out, manifest)


def _cached(
    manifest: dict[str, dict[str, object]], name: str, params: dict[str, object]
) -> BuiltModel | None:
    entry = manifest.get(name)
    if not entry or entry.get("params") != params:
        return None
    model = BuiltModel.from_json(entry["model"])  # type: ignore[arg-type]
    if not model.path.is_file() or model.path.stat().st_size != model.file_bytes:
        return None
    if model.external_file is not None and (
        not model.external_file.is_file()
        or model.external_file.stat().st_size != model.external_bytes
    ):
        return None
    return model


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_encoder(out: Path, config: EncoderConfig, *, force: bool = False) -> BuiltModel:
    name = f"{config.kind}-{config.depth}"
    params = {"version": GENERATOR_VERSION, **asdict(config)}
    manifest = _read_manifest(out)
    cached = None if force else _cached(manifest, name, params)
    if cached is not None:
        return cached
    started = time.perf_counter()
    model = build_encoder(config)
    path = out / f"{name}.onnx"
    onnx.save(model, str(path))
    built = BuiltModel(
        name=name,
        kind=config.kind,
        depth=config.depth,
        path=path,
        nodes=len(model.graph.node),
        file_bytes=path.stat().st_size,
    )
    _record(out, name, params, built)
    _log(f"built {path} ({built.nodes} nodes) in {time.perf_counter() - started:.1f} s")
    return built


def big_config(target_gb: float) -> EncoderConfig:
    """Few layers, large FFN matrices: enough layers for ``target_gb`` GiB of weights."""
    hidden, ffn = 2048, 8192
    per_layer = (4 * hidden * hidden + 2 * hidden * ffn) * 4
    depth = max(1, math.ceil(target_gb * 2**30 / per_layer))
    return EncoderConfig(depth=depth, kind="export", hidden=hidden, heads=16, ffn=ffn)


def ensure_big(
    out: Path, target_gb: float = 1.0, *, force: bool = False, inline: bool = False
) -> BuiltModel:
    """The model with external weights: ``big/model.onnx`` + ``big/weights.bin``; with
    ``inline``, the same encoder with its weights inside the file, ``big-inline/model.onnx``
    (protobuf's 2 GiB cap holds it: at most 10 layers)."""
    config = big_config(target_gb)
    name = "big-inline" if inline else "big-external"
    params = {"version": GENERATOR_VERSION, "target_gb": target_gb, **asdict(config)}
    manifest = _read_manifest(out)
    cached = None if force else _cached(manifest, name, params)
    if cached is not None:
        return cached
    started = time.perf_counter()
    directory = out / ("big-inline" if inline else "big")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.onnx"
    weights = directory / "weights.bin"
    weights.unlink(missing_ok=True)
    model = build_encoder(config)
    if inline:
        onnx.save(model, str(path))
    else:
        onnx.save(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=weights.name,
        )
    del model
    built = BuiltModel(
        name=name,
        kind="big",
        depth=config.depth,
        path=path,
        nodes=len(onnx.load(str(path), load_external_data=False).graph.node),
        file_bytes=path.stat().st_size,
        external_bytes=0 if inline else weights.stat().st_size,
        external_file=None if inline else weights,
    )
    _record(out, name, params, built)
    _log(
        f"built {path}{'' if inline else ' + ' + weights.name} "
        f"({(built.external_bytes or built.file_bytes) / 1e9:.2f} GB, {built.nodes} nodes) "
        f"in {time.perf_counter() - started:.1f} s"
    )
    return built


def ensure_external_copy(out: Path, source: BuiltModel, *, force: bool = False) -> BuiltModel:
    """``source`` with its weights in ``weights.bin``: as deep, as an exporter writes big models."""
    name = f"{source.name}-external"
    params = {"version": GENERATOR_VERSION, "source": source.name, "bytes": source.file_bytes}
    manifest = _read_manifest(out)
    cached = None if force else _cached(manifest, name, params)
    if cached is not None:
        return cached
    started = time.perf_counter()
    directory = out / name
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.onnx"
    weights = directory / "weights.bin"
    weights.unlink(missing_ok=True)
    onnx.save(
        onnx.load(str(source.path)),
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=weights.name,
    )
    built = BuiltModel(
        name=name,
        kind="external",
        depth=source.depth,
        path=path,
        nodes=source.nodes,
        file_bytes=path.stat().st_size,
        external_bytes=weights.stat().st_size,
        external_file=weights,
    )
    _record(out, name, params, built)
    _log(f"built {path} + {weights.name} in {time.perf_counter() - started:.1f} s")
    return built


def ensure_models(
    out: Path = DEFAULT_OUT,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    kinds: Sequence[str] = KINDS,
    big_gb: float | None = 1.0,
    *,
    force: bool = False,
) -> list[BuiltModel]:
    """Every model of the benchmark, built if missing or stale.

    With ``big_gb``: the model with that many GiB of external weights, and the deepest export
    model again with its weights in an external file.
    """
    out.mkdir(parents=True, exist_ok=True)
    models = [
        ensure_encoder(out, EncoderConfig(depth=depth, kind=kind), force=force)
        for kind in kinds
        for depth in depths
    ]
    if big_gb:
        models.append(ensure_big(out, big_gb, force=force))
        exports = [model for model in models if model.kind == "export"]
        if exports:
            deepest = max(exports, key=lambda model: model.depth)
            models.append(ensure_external_copy(out, deepest, force=force))
    return models


def run_in_onnxruntime(model: BuiltModel, batch: int = 2, seq: int = 16) -> tuple[int, ...]:
    """Run a model once in onnxruntime (CPU); returns the output shape."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(SEED)
    feeds: dict[str, np.ndarray] = {}
    for info in session.get_inputs():
        if info.name == "input_ids":
            feeds[info.name] = rng.integers(0, VOCAB, size=(batch, seq), dtype=np.int64)
        else:
            mask = np.ones((batch, seq), dtype=np.int64)
            mask[0, seq // 2 :] = 0
            feeds[info.name] = mask
    (output,) = session.run(None, feeds)
    if not np.all(np.isfinite(output)):
        raise RuntimeError(f"{model.path}: non-finite output")
    return tuple(output.shape)


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.replace(",", " ").split()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model cache directory")
    parser.add_argument("--depths", type=_int_list, default=list(DEFAULT_DEPTHS))
    parser.add_argument("--kinds", default=",".join(KINDS), help="export,plain")
    parser.add_argument("--big-gb", type=float, default=1.0, help="external weights, GB")
    parser.add_argument("--no-big", action="store_true", help="skip the external-weights model")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--check", action="store_true", help="run the models in onnxruntime")
    args = parser.parse_args(argv)
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    models = ensure_models(
        args.out, args.depths, kinds, None if args.no_big else args.big_gb, force=args.force
    )
    for model in models:
        line = f"{model.name:>14}  {model.nodes:>6} nodes  {model.path}"
        if model.external_file is not None:
            line += f"  (+ {model.external_bytes / 1e9:.2f} GB in {model.external_file.name})"
        if args.check:
            line += f"  ort output {run_in_onnxruntime(model)}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
