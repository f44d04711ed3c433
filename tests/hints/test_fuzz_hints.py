"""Property tests of the hints loader and the diff (hypothesis, derandomized: CI repeats them).

- Any JSON value, any mutation of a real hints file and any text gives either loaded hints or
  the clean error (HintsFormatError), never another exception.
- Whatever loads saves and loads back to the same hints, in the 0.53.6 format and (without
  fused replacements) from the flat TensorRT 10.14 format.
- The diff of hints with themselves is empty; two hints differ exactly when their canonical
  forms do, and the diff the other way round swaps added and removed.
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path
from typing import Any

from conftest import GOLDEN
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardcheck.errors import HintsFormatError
from shardcheck.hints.codec import CLASS_KEY, FLAT_KEYS, NEW_KEYS, decode, dumps, encode, loads
from shardcheck.hints.diff import canonical, diff_hints
from shardcheck.hints.files import read_hints, write_hints
from shardcheck.hints.model import (
    MAX_AXIS,
    PARALLELISMS,
    REDUCE_OPS,
    AttentionLayerHint,
    DistCollective,
    FusedAttention,
    ShardHints,
    ShardTensor,
)

INT32_MAX = 2**31 - 1
GOLDENS = [json.loads(path.read_text()) for path in sorted(GOLDEN.glob("*.json"))]
CLASSES = ["ShardHints", "ShardTensor", "AttentionLayerHint", "DistCollective", "FusedAttention"]
KEYS = sorted(
    {*NEW_KEYS, *FLAT_KEYS, CLASS_KEY, "name", "seq_len_idx", "rank", "q", "gather_kv"}
    | {"gather_q", "replace", "is_causal", "q_shuffle", "k_shuffle", "v_shuffle", "reduce_op"}
)


def fuzz(examples: int) -> Any:
    """Derandomized settings: the same examples on every run, no deadline on slow machines."""
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ------------------------------------------------------------------ strategies

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-2, max_value=70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from([*CLASSES, *REDUCE_OPS, *PARALLELISMS, "", "\ud800"])
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=8,
)


def _paths(document: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(document, dict):
        for key, value in document.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(document, list):
        for position, value in enumerate(document):
            found += _paths(value, (*prefix, position))
    return found


def _flat(document: dict[str, Any]) -> dict[str, Any]:
    """A 0.53.6 document rewritten in TensorRT 10.14's flat format."""
    flat = {key: value for key, value in document.items() if key != "dist_collectives"}
    dist = document["dist_collectives"]
    flat.update(
        group_size=dist["group_size"],
        root=dist["root"],
        groups=dist["groups"],
        reduce_scatter_reduce_op=dist["reduce_op"],
        nb_rank=dist["nb_rank"],
    )
    flat["attention_layers"] = [
        {key: value for key, value in layer.items() if key != "replace"}
        for layer in document["attention_layers"]
    ]
    return flat


REAL_DOCUMENTS = GOLDENS + [_flat(document) for document in GOLDENS]


@st.composite
def mutated_documents(draw: st.DrawFn) -> Any:
    """A real hints file (either format) with one to four fields replaced, removed or added."""
    document = copy.deepcopy(draw(st.sampled_from(REAL_DOCUMENTS)))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        path = draw(st.sampled_from(_paths(document)))
        if not path:
            continue
        parent = document
        try:
            for part in path[:-1]:
                parent = parent[part]
            action = draw(st.sampled_from(["replace", "remove", "add"]))
            if action == "replace":
                parent[path[-1]] = draw(JSON_VALUES)
            elif action == "remove":
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[draw(st.sampled_from(KEYS))] = draw(JSON_VALUES)
            else:
                parent.append(draw(JSON_VALUES))
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation changed the path
    return document


NAMES = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=10
) | st.sampled_from(["input_ids", "q", "/model/h.0/attn/MatMul_output_0", "0", "a.b[1]"])
AXES = st.integers(min_value=0, max_value=MAX_AXIS - 1)
RANKS = st.none() | st.integers(min_value=1, max_value=MAX_AXIS)
SHUFFLES = st.none() | st.lists(st.integers(min_value=0, max_value=MAX_AXIS), max_size=6).map(tuple)

TENSORS = st.builds(ShardTensor, name=NAMES, seq_len_idx=AXES, rank=RANKS)
FUSED = st.builds(
    FusedAttention,
    is_causal=st.booleans(),
    q_shuffle=SHUFFLES,
    k_shuffle=SHUFFLES,
    v_shuffle=SHUFFLES,
    nb_rank=st.integers(min_value=1, max_value=INT32_MAX),
)
LAYERS = st.builds(
    AttentionLayerHint,
    q=NAMES,
    gather_kv=st.booleans(),
    gather_q=st.booleans(),
    replace=st.none() | FUSED,
)
COLLECTIVES = st.builds(
    DistCollective,
    group_size=st.integers(min_value=0, max_value=INT32_MAX),
    root=st.integers(min_value=-1, max_value=INT32_MAX),
    nb_rank=st.integers(min_value=1, max_value=INT32_MAX),
    groups=st.lists(st.integers(min_value=0, max_value=INT32_MAX), max_size=4).map(tuple),
    reduce_op=st.sampled_from(REDUCE_OPS),
)
HINTS = st.builds(
    ShardHints,
    parallelism=st.sampled_from(PARALLELISMS),
    attention_layers=st.lists(LAYERS, max_size=3, unique_by=lambda layer: layer.q).map(tuple),
    dist_collectives=COLLECTIVES,
    inputs=st.lists(TENSORS, max_size=3, unique_by=lambda t: t.name).map(tuple),
    outputs=st.lists(TENSORS, max_size=3, unique_by=lambda t: t.name).map(tuple),
    k_seq_len_idx=AXES,
    v_seq_len_idx=AXES,
    kv_rank=RANKS,
)


# ------------------------------------------------------------------ the loader never crashes


def load_or_clean_error(document: Any) -> ShardHints | None:
    """decode, and loads of the same document as text: hints, or None for the clean error."""
    try:
        hints = decode(document, "fuzz.json")
    except HintsFormatError as error:
        assert error.message.startswith("fuzz.json"), error.message
        assert "\n" not in error.message
        hints = None
    try:
        text = json.dumps(document)
    except ValueError:  # a lone surrogate in a key still dumps; nothing else should fail
        return hints
    try:
        from_text = loads(text, "fuzz.json")
    except HintsFormatError:
        from_text = None
    assert from_text == hints
    return hints


@fuzz(2000)
@given(JSON_VALUES)
def test_any_json_value_loads_or_gives_the_clean_error(document: Any) -> None:
    load_or_clean_error(document)


@fuzz(1200)
@given(mutated_documents())
def test_any_mutated_hints_file_loads_or_gives_the_clean_error(document: Any) -> None:
    hints = load_or_clean_error(document)
    if hints is not None:
        assert loads(dumps(hints)) == hints


@st.composite
def damaged_texts(draw: st.DrawFn) -> str:
    """The text of a real hints file with characters cut, repeated or inserted."""
    text = json.dumps(draw(st.sampled_from(REAL_DOCUMENTS)), indent=4)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        position = draw(st.integers(min_value=0, max_value=len(text)))
        action = draw(st.sampled_from(["cut", "insert", "repeat"]))
        if action == "cut":
            text = text[:position] + text[position + draw(st.integers(1, 20)) :]
        elif action == "insert":
            text = text[:position] + draw(st.text(max_size=4)) + text[position:]
        else:
            text = text[:position] + text[position : position + 30] + text[position:]
    return text


@fuzz(600)
@given(st.text(max_size=60) | damaged_texts())
def test_any_text_loads_or_gives_the_clean_error(text: str) -> None:
    try:
        loads(text, "fuzz.json")
    except HintsFormatError as error:
        assert error.message.startswith("fuzz.json: ")
        assert "\n" not in error.message


# ------------------------------------------------------------------ round trips


@fuzz(200)
@given(HINTS)
def test_saving_and_loading_round_trips(hints: ShardHints) -> None:
    assert loads(dumps(hints)) == hints
    assert decode(json.loads(dumps(hints))) == hints
    without_fused = hints.with_changes(
        attention_layers=tuple(
            AttentionLayerHint(layer.q, layer.gather_kv, layer.gather_q)
            for layer in hints.attention_layers
        )
    )
    assert decode(_flat(encode(without_fused))) == without_fused


@fuzz(40)
@given(HINTS)
def test_a_hints_file_round_trips_and_diffs_empty_with_itself(hints: ShardHints) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "hints.json"
        write_hints(str(path), hints)
        assert read_hints(path) == hints
        assert diff_hints(read_hints(path), read_hints(path)) == []
        write_hints(str(path), read_hints(path))  # fmt over itself: same bytes
        assert path.read_text() == dumps(hints)


# ------------------------------------------------------------------ the diff


@fuzz(150)
@given(HINTS, HINTS)
def test_diff_is_empty_exactly_when_the_hints_mean_the_same(a: ShardHints, b: ShardHints) -> None:
    assert diff_hints(a, a) == []
    forward = diff_hints(a, b)
    assert (forward == []) == (canonical(a) == canonical(b))
    backward = diff_hints(b, a)
    swap = {"added": "removed", "removed": "added", "changed": "changed"}
    assert sorted((swap[d.kind], d.path) for d in forward) == sorted(
        (d.kind, d.path) for d in backward
    )


@fuzz(60)
@given(HINTS, st.data())
def test_diff_ignores_order(hints: ShardHints, data: st.DataObject) -> None:
    shuffled = hints.with_changes(
        inputs=tuple(data.draw(st.permutations(hints.inputs))),
        outputs=tuple(data.draw(st.permutations(hints.outputs))),
        attention_layers=tuple(data.draw(st.permutations(hints.attention_layers))),
    )
    assert diff_hints(hints, shuffled) == []
