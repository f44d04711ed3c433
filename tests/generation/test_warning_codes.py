"""gen's warnings carry their codes (generation/messages.py), through pickle and copy too: check
sends them from its worker processes."""

from __future__ import annotations

import copy
import pickle

from conftest import FIXTURES

from shardcheck import GenOptions, generate, load_index
from shardcheck.generation.messages import Warned, code_of
from shardcheck.verification.findings import CODES


def test_a_warning_keeps_its_text_and_code_through_pickle_and_copy() -> None:
    warning = Warned("SC110", "m.onnx: 2 of 2 attention layers match neither ...")
    for again in (pickle.loads(pickle.dumps(warning)), copy.copy(warning), copy.deepcopy(warning)):
        assert again == warning and isinstance(again, str)
        assert code_of(again) == "SC110"


def test_every_warning_of_gen_has_a_code_of_the_table() -> None:
    # multi_attention's second layer declares no shapes (SC304); no_attention has no layer
    # (SC301); --attention-pattern without --compat polygraphy changes nothing (SC302).
    seen = {}
    for name, options in (
        ("multi_attention", GenOptions()),
        ("no_attention", GenOptions()),
        ("attention", GenOptions(attention_pattern=1)),
    ):
        for warning in generate(load_index(FIXTURES / f"{name}.onnx"), options).warnings:
            seen[code_of(warning)] = warning
    assert {"SC301", "SC302", "SC304"} <= set(seen), seen
    assert set(seen) <= set(CODES), seen
