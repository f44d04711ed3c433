"""explain -o plan.html: the page is self-contained, a 96-layer model folds into one screen, and
headless Chromium renders it to the plan's picture (skipped where Chromium is absent)."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, run_cli
from onnx import TensorProto, helper

REAL = FIXTURES / "real"
SCREEN = (1280, 800)
# The colours picture.py draws with: a layer box that runs on slices, a bar's sliced part.
LAYER_GREEN = (0x2E, 0x9E, 0x6B)


def _deep_model(path: Path, layers: int, width: int = 8) -> Path:
    """``layers`` attention layers, each x -> q, k, v projections -> softmax(q k^T) v -> + x."""
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    hidden = "x"
    for layer in range(layers):
        p = f"l{layer}"
        for name in "qkv":
            weight = rng.standard_normal((width, width)).astype(np.float32)
            weights.append(onnx.numpy_helper.from_array(weight, f"{p}_w{name}"))
            nodes.append(
                helper.make_node("MatMul", [hidden, f"{p}_w{name}"], [f"{p}_{name}"], f"{p}/{name}")
            )
        nodes += [
            helper.make_node("Transpose", [f"{p}_k"], [f"{p}_kt"], perm=[0, 2, 1]),
            helper.make_node("MatMul", [f"{p}_q", f"{p}_kt"], [f"{p}_scores"], f"{p}/scores"),
            helper.make_node("Softmax", [f"{p}_scores"], [f"{p}_probs"], axis=-1),
            helper.make_node("MatMul", [f"{p}_probs", f"{p}_v"], [f"{p}_context"]),
            helper.make_node("Add", [f"{p}_context", hidden], [f"{p}_out"]),
        ]
        hidden = f"{p}_out"
    graph = helper.make_graph(
        nodes,
        "deep",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", width])],
        [helper.make_tensor_value_info(hidden, TensorProto.FLOAT, ["batch", "sequence", width])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


def _svg_height(page: str) -> int:
    found = re.search(r'<svg [^>]*height="(\d+)"', page)
    assert found is not None
    return int(found.group(1))


def test_the_page_is_self_contained(tmp_path: Path) -> None:
    page_path = tmp_path / "plan.html"
    model = REAL / "dynamo_llama_tiny_gqa.onnx"
    # The Polygraphy-format hints, whose cut a blocker keeps inside the layers (gen's default
    # plan for this model is the extension, which has none).
    hints = tmp_path / "hints.json"
    assert run_cli("gen", model, "-o", hints, "--no-extension", "-q").exit_code == 0
    result = run_cli("explain", model, hints, "--seq-len", "64", "-o", page_path)
    assert result.exit_code == 0, result.stderr
    page = page_path.read_text()
    assert page.count("<svg ") == 1
    assert "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )
    assert "https://" not in page
    # What the picture shows: the layers, the gathers, the figures and the blocker.
    assert "K/V all-gathered" in page and "Q local" in page
    assert "reduce-scatter" in page and "all-gather" in page
    assert "positions are computed from attention_mask.shape[1]" in page
    # The text form prints the same plan.
    assert "32.3% of FLOPs on slices" in result.stdout and "32.3% of FLOPs on slices" in page


def test_96_layers_fold_into_one_box_on_one_screen(tmp_path: Path) -> None:
    model = _deep_model(tmp_path / "deep.onnx", 96)
    page_path = tmp_path / "plan.html"
    result = run_cli("explain", model, "--seq-len", "64", "-o", page_path)
    assert result.exit_code == 0, result.stderr
    page = page_path.read_text()
    # The first layer (it takes the scatter of x) and the 95 of one form after it.
    assert "layers 2 to 96 (x95)" in page
    assert page.count('class="layer"') == 2
    assert _svg_height(page) <= SCREEN[1]
    assert "95 layers from l1/scores" in result.stdout  # the text folds them the same way


def _read_png(path: Path) -> np.ndarray:
    """The pixels of an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks, header = 8, [], None
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
        at += 12 + length
    assert header is not None
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0
    channels = 3 if colour == 2 else 4
    raw = zlib.decompress(b"".join(chunks))
    stride = width * channels
    image = np.zeros((height, stride), dtype=np.uint8)
    previous = np.zeros(stride, dtype=np.int32)
    for row in range(height):
        start = row * (stride + 1)
        kind = raw[start]
        line = np.frombuffer(raw, dtype=np.uint8, count=stride, offset=start + 1).astype(np.int32)
        out = np.zeros(stride, dtype=np.int32)
        for i in range(stride):
            left = out[i - channels] if i >= channels else 0
            up = previous[i]
            corner = previous[i - channels] if i >= channels else 0
            if kind == 0:
                value = line[i]
            elif kind == 1:
                value = line[i] + left
            elif kind == 2:
                value = line[i] + up
            elif kind == 3:
                value = line[i] + (left + up) // 2
            else:
                guess = left + up - corner
                pa, pb, pc = abs(guess - left), abs(guess - up), abs(guess - corner)
                value = line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)
            out[i] = value & 0xFF
        image[row] = out
        previous = out
    return image.reshape(height, width, channels)[:, :, :3]


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    _chromium() is None, reason="Chromium is not installed (apt-get install chromium)"
)
def test_chromium_renders_the_plan(tmp_path: Path) -> None:
    model = _deep_model(tmp_path / "deep.onnx", 96)
    page_path = tmp_path / "plan.html"
    assert run_cli("explain", model, "--seq-len", "64", "-o", page_path).exit_code == 0
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            f"--window-size={SCREEN[0]},{SCREEN[1]}",
            page_path.resolve().as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    pixels = _read_png(shot)
    assert pixels.shape[:2] == (SCREEN[1], SCREEN[0])
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # not blank: text, boxes, bars
    green = np.all(np.abs(pixels.astype(int) - LAYER_GREEN) <= 8, axis=2)
    rows = np.flatnonzero(green.any(axis=1))
    # The layer boxes' borders and the bars on slices are drawn, and all within the screen.
    assert green.sum() > 5000
    assert rows.size and rows.max() < SCREEN[1] - 10
