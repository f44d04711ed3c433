"""External weights in one copy (runtime/weights.py): every session and every value the
simulation feeds reads the one mapping of the weight file, and a file cut short is an error
of one line, exit 2, before anything is mapped past its end (which would be SIGBUS)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, ROOT, run_cli, run_script
from onnx import numpy_helper

from shardcheck.errors import InputError
from shardcheck.runtime.sessions import make_session
from shardcheck.runtime.weights import external_weight, is_external

MODEL = FIXTURES / "attention_head.onnx"
HINTS = ROOT / "golden" / "attention_head.json"
DATA = "external.onnx.data"
RUN = {"verify": ["--ranks", "2"], "simulate": ["--ranks", "2", "--seq-len", "8"]}


def _external_copy(directory: Path) -> Path:
    """attention_head.onnx with every weight in ``DATA`` beside it."""
    path = directory / "external.onnx"
    onnx.save_model(
        onnx.load(MODEL), path, save_as_external_data=True, location=DATA, size_threshold=0
    )
    return path


def _external_tensors(path: Path) -> list[onnx.TensorProto]:
    model = onnx.load(path, load_external_data=False)
    return [tensor for tensor in model.graph.initializer if is_external(tensor)]


def test_every_reader_of_a_weight_gets_the_same_memory(tmp_path: Path) -> None:
    """Two reads of one weight are views of one mapping, read-only, and hold the values the
    file holds (onnx's own loader, which copies them, is the reference)."""
    path = _external_copy(tmp_path)
    tensors = _external_tensors(path)
    assert tensors
    expected = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    for tensor in tensors:
        first, second = external_weight(tensor, tmp_path), external_weight(tensor, tmp_path)
        assert first is not None and second is not None
        np.testing.assert_array_equal(first, expected[tensor.name])
        if first.size:
            assert np.shares_memory(first, second)
            assert not first.flags.writeable


def test_a_session_shares_the_mapped_weights_and_runs_as_from_the_file(tmp_path: Path) -> None:
    """The session is handed the mapped weights (kept with it) and computes what the model
    with its weights inline computes."""
    path = _external_copy(tmp_path)
    shared = make_session(onnx.load(path, load_external_data=False), tmp_path)
    inline = make_session(onnx.load(MODEL))
    assert set(shared.shardcheck_weights) == {t.name for t in _external_tensors(path)}
    rng = np.random.default_rng(3)
    feeds = {
        i.name: rng.standard_normal([d if isinstance(d, int) else 4 for d in i.shape]).astype(
            np.float32
        )
        for i in inline.get_inputs()
    }
    (got,), (want,) = shared.run(None, feeds), inline.run(None, feeds)
    np.testing.assert_array_equal(got, want)


def test_a_weight_file_too_short_is_refused_before_it_is_mapped(tmp_path: Path) -> None:
    path = _external_copy(tmp_path)
    tensors = _external_tensors(path)
    last = max(tensors, key=lambda t: int({e.key: e.value for e in t.external_data}["offset"]))
    weights = tmp_path / DATA
    weights.write_bytes(weights.read_bytes()[:-1])
    with pytest.raises(InputError, match=r"the weight file is incomplete") as raised:
        external_weight(last, tmp_path, str(path))
    assert str(raised.value).startswith(f"{path}: tensor {last.name!r} needs the first")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("command", ["verify", "simulate"])
def test_a_truncated_weight_file_is_one_error_line(tmp_path: Path, command: str) -> None:
    path = _external_copy(tmp_path)
    weights = tmp_path / DATA
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = run_cli(command, path, HINTS, *RUN[command])
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"shardcheck: error: {path}: "), lines
    assert "the weight file is incomplete" in lines[0]


# The weight file is cut to half its size right after shardcheck has checked it, before the
# sessions map it: what a file rewritten while shardcheck runs does.
_SHRINK_AFTER_THE_CHECK = """
import sys
from pathlib import Path
import shardcheck.graph.loader as loader
real_check = loader.check_weight_files
def check_then_shrink(index, path):
    real_check(index, path)
    weights = Path(path).parent / {data!r}
    with weights.open("r+b") as file:
        file.truncate(weights.stat().st_size // 2)
loader.check_weight_files = check_then_shrink
from shardcheck.cli import main
sys.argv = ["shardcheck", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("command", ["verify", "simulate"])
def test_a_weight_file_that_shrinks_after_the_check_is_one_error_line(
    tmp_path: Path, command: str
) -> None:
    """Not SIGBUS (exit -7, nothing said): the mapping checks the size of the file it maps."""
    path = _external_copy(tmp_path)
    script = textwrap.dedent(_SHRINK_AFTER_THE_CHECK.format(data=DATA))
    done = run_script(script, command, path, HINTS, *RUN[command])
    lines = done.stderr.splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"shardcheck: error: {path}: "), lines
    assert "now has" in lines[0] and "the weight file is incomplete" in lines[0], lines[0]
