from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from click.testing import CliRunner, Result

from shardcheck.cli import cli

pytest_plugins = ("pytester",)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
# Every bundled model: the hand-built fixtures and the real exports.
FIXTURE_MODELS = sorted([*FIXTURES.glob("*.onnx"), *(FIXTURES / "real").glob("*.onnx")])
GOLDEN = ROOT / "golden"
# What gen warns of fixtures/multi_attention.onnx (its second layer declares no shapes).
MULTI_ATTENTION_WARNING = (
    "the ranks of Q/K/V are unknown for layer attn2_mm1; their axes fall back to the "
    "--k-idx/--v-idx/--kv-rank options"
)
SHARED = ROOT.parent / "shared"
ANCHORS = SHARED / "anchor-models"


def cli_runner() -> CliRunner:
    """A runner that keeps stderr apart from stdout: click 8.2 and later do so and take no
    ``mix_stderr``; click 8.1 (the oldest shardcheck supports) mixes them unless told not to."""
    try:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:
        return CliRunner()


def run_cli(*args: str) -> Result:
    """Run the shardcheck CLI in-process; stdout and stderr are kept apart."""
    return cli_runner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def gen_plan(model: Path, directory: Path) -> tuple[Path, Path | None]:
    """gen's default plan of ``model``, written into ``directory``: the hints, and the
    extension beside them (None where gen writes none)."""
    hints = directory / f"{model.stem}.json"
    result = run_cli("gen", model, "-o", hints, "-q")
    assert result.exit_code == 0, result.stderr
    extension = directory / f"{model.stem}.shardcheck.json"
    return hints, extension if extension.exists() else None


def run_script(script: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -c script ARGS`` from the repository (a CLI run with something patched in, in
    a process of its own: a crash there, SIGBUS, cannot take pytest down); output as text."""
    return subprocess.run(
        [sys.executable, "-c", script, *(str(a) for a in args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@functools.cache
def benchmark_models() -> ModuleType:
    """The benchmark's model builder, benchmarks/build_models.py (not a package tests import)."""
    spec = importlib.util.spec_from_file_location(
        "shardcheck_bench_models", ROOT / "benchmarks" / "build_models.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def sorted_io(document: dict[str, Any]) -> dict[str, Any]:
    """A hints document with inputs/outputs ordered by name (Polygraphy's order is random)."""
    result = dict(document)
    for key in ("inputs", "outputs"):
        result[key] = sorted(document[key], key=lambda t: t["name"])
    return result


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def one_model_manifest(directory: Path, model: Path, gen: str = "") -> Path:
    """A manifest in ``directory`` gating a copy of ``model`` against ``golden/model.json``;
    ``gen``: the entry's gen options, as TOML (``extension = false``)."""
    import shutil

    shutil.copy(model, directory / model.name)
    manifest = directory / "shardcheck.toml"
    manifest.write_text(
        "[tool.shardcheck]\n"
        'golden-dir = "golden"\n'
        "[[tool.shardcheck.models]]\n"
        f'path = "{model.name}"\n'
        'golden = "golden/model.json"\n' + (f"gen = {{ {gen} }}\n" if gen else "")
    )
    return manifest


def simulated_lengths(report: Any) -> list[tuple[int, bool]]:
    """The lengths a verify report simulated CP at, each with whether it matched."""
    return [(run["seq_len"], run["ok"]) for run in report.runs if run.get("simulation")]


@pytest.fixture
def fixture_model() -> Any:
    def get(name: str) -> Path:
        return FIXTURES / f"{name}.onnx"

    return get


def attention_nodes() -> list[Any]:
    """One attention layer on ``x`` [seq, 4]: projections by the weights W_q, W_k and W_v,
    scores against the transposed K (``k_T``, [4, seq]), softmax, context ``y`` [seq, 4]."""
    from onnx import helper

    return [
        *(helper.make_node("MatMul", ["x", f"W_{p}"], [p], name=f"proj_{p}") for p in "qkv"),
        helper.make_node("Transpose", ["k"], ["k_T"], name="t", perm=[1, 0]),
        helper.make_node("MatMul", ["q", "k_T"], ["s"], name="scores"),
        helper.make_node("Softmax", ["s"], ["p"], name="softmax"),
        helper.make_node("MatMul", ["p", "v"], ["y"], name="context"),
    ]


# A length at which long_matmul_model's one MatMul (2.2 TFLOP) runs many seconds on any CPU
# with one thread: far past a timeout of 1 s and its grace of 2 s.
LONG_LENGTH = 16384


def long_matmul_model(path: Path) -> Path:
    """One MatMul of [seq, 4096] by [4096, seq], saved to ``path``: one long kernel, which
    onnxruntime's own stop (between nodes) cannot end early."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "y"], ["z"], name="long_matmul")],
        "long",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", 4096]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [4096, "seq"]),
        ],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["seq", "seq"])],
    )
    # IR 8: what every onnxruntime the project supports reads (onnx writes its newest).
    opsets = [helper.make_opsetid("", 17)]
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=8), path)
    return path


def attention_model(directory: Path, *, positions: bool = False, external: bool = False) -> Path:
    """``attention_nodes`` as a model on the input ``x`` [seq, 4]. With ``positions``, on
    ``x = tokens + pos`` instead: a position table of 8 rows added whole (as Whisper's
    encoder adds its own), so the model runs at length 8 only. With ``external``, the
    weights lie in ``weights.bin`` beside the model."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    shapes = {"pos": (8, 4)} if positions else {}
    shapes.update({f"W_{x}": (4, 4) for x in "qkv"})
    weights = [
        numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
        for name, shape in shapes.items()
    ]
    nodes = attention_nodes()
    if positions:
        nodes.insert(0, helper.make_node("Add", ["tokens", "pos"], ["x"], name="add_positions"))
    graph = helper.make_graph(
        nodes,
        "attention",
        [
            helper.make_tensor_value_info(
                "tokens" if positions else "x", TensorProto.FLOAT, ["seq", 4]
            )
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["seq", 4])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = directory / "attention.onnx"
    if external:
        onnx.save(model, path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    else:
        onnx.save(model, path)
    return path


def embedded_bert_layer() -> Any:
    """onnxruntime's BERT fusion: com.microsoft EmbedLayerNormalization of the ids (and the
    mask's index), then one packed com.microsoft Attention computing Q, K and V from it."""
    import numpy as np
    import onnx
    from onnx import helper as oh
    from onnx import numpy_helper

    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> Any:
        return numpy_helper.from_array((0.1 * rng.standard_normal(shape)).astype(np.float32), name)

    weights = [
        weight("words", 16, 8),
        weight("positions", 32, 8),
        weight("gamma", 8),
        weight("beta", 8),
        weight("qkv", 8, 24),
        weight("qkv_bias", 24),
    ]
    nodes = [
        oh.make_node(
            "EmbedLayerNormalization",
            ["ids", "", "words", "positions", "", "gamma", "beta", "mask"],
            ["embedded", "mask_index"],
            domain="com.microsoft",
            name="embed",
        ),
        oh.make_node(
            "Attention",
            ["embedded", "qkv", "qkv_bias", "mask_index"],
            ["y"],
            domain="com.microsoft",
            name="attention",
            num_heads=2,
        ),
    ]
    graph = oh.make_graph(
        nodes,
        "embedded_bert",
        [
            oh.make_tensor_value_info("ids", onnx.TensorProto.INT32, ["batch", "sequence"]),
            oh.make_tensor_value_info("mask", onnx.TensorProto.INT32, ["batch", "sequence"]),
        ],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", "sequence", 8])],
        initializer=weights,
    )
    opsets = [oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)]
    return oh.make_model(graph, opset_imports=opsets, ir_version=8)


def int64_constant(name: str, values: list[int] | int) -> Any:
    """An int64 initializer: a scalar from an int, a vector from a list."""
    from onnx import TensorProto, helper

    if isinstance(values, int):
        return helper.make_tensor(name, TensorProto.INT64, [], [values])
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def checked_model(graph: Any, opset: int = 18) -> Any:
    """``graph`` as a model of the default domain's ``opset``, IR version 8, that onnx's full
    check accepts."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def assert_verified_at_two_and_four_ranks(model: Path, plan: Path) -> None:
    """``verify MODEL PLAN`` passes at 2 and 4 ranks, at batch 1 and 2 (issue 27's bar)."""
    for ranks in (2, 4):
        for batch in (1, 2):
            result = run_cli(
                "verify", model, plan, "--ranks", ranks, "--dim", f"batch={batch}", "-q"
            )  # fmt: skip
            assert result.exit_code == 0, (ranks, batch, result.stdout, result.stderr)
