"""The manifest: parsing, defaults, and one-line errors naming the file and the key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from shardcheck.errors import InputError
from shardcheck.gating.manifest import find_manifest, load_manifest
from shardcheck.generation.options import GenOptions

TWO_MODELS = """
[tool.shardcheck]
golden-dir = "golden"

[[tool.shardcheck.models]]
path = "fixtures/attention_head.onnx"
golden = "golden/attention_head.json"

[[tool.shardcheck.models]]
name = "gpt2"
path = "models/gpt2.onnx"
golden = "golden/gpt2.json"
gen = { compat = "polygraphy", cp-type = "fused", groups = [0, 1], is_causal = true }
verify = true
ranks = 2
seq-lens = [4, 12]
seq-len = { target = [2, 6], "memory.len" = [8, 10] }
rtol = 1e-2
atol = 0
"""


def write(directory: Path, text: str, name: str = "pyproject.toml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def model(**keys: str) -> str:
    """A [[tool.shardcheck.models]] table from TOML value texts."""
    body = "".join(f"{key} = {value}\n" for key, value in keys.items())
    return f"[[tool.shardcheck.models]]\n{body}\n"


def test_two_models_with_defaults_and_options(tmp_path: Path) -> None:
    manifest = load_manifest(write(tmp_path, TWO_MODELS))

    assert manifest.root == tmp_path
    assert manifest.golden_dir == tmp_path / "golden"
    head, gpt2 = manifest.models
    # The name defaults to the model file's stem; nothing to verify unless asked.
    assert (head.name, head.position, head.verify, head.ranks, head.seq_lens) == (
        "attention_head",
        0,
        False,
        None,
        None,
    )
    assert head.model_path == tmp_path / "fixtures" / "attention_head.onnx"
    assert head.golden_path == tmp_path / "golden" / "attention_head.json"
    assert head.gen == GenOptions()
    assert (gpt2.name, gpt2.verify, gpt2.ranks, gpt2.seq_lens) == ("gpt2", True, 2, (4, 12))
    # Each dim's own lengths, one per run of seq-lens; the dims' names are the model's, as
    # written (no - for _ there).
    assert head.seq_len_of == ()
    assert gpt2.seq_len_of == (("target", (2, 6)), ("memory.len", (8, 10)))
    # Tolerances: None leaves them to verify (by the outputs' element type); an integer is a
    # float too.
    assert (head.rtol, head.atol, gpt2.rtol, gpt2.atol) == (None, None, 0.01, 0.0)
    assert (gpt2.path_text, gpt2.golden_text) == ("models/gpt2.onnx", "golden/gpt2.json")
    assert gpt2.gen == GenOptions(
        compat="polygraphy", cp_type="fused", groups=(0, 1), is_causal=True
    )


def test_shardcheck_toml_holds_the_same_table(tmp_path: Path) -> None:
    from_pyproject = load_manifest(write(tmp_path, TWO_MODELS))
    from_own_file = load_manifest(write(tmp_path, TWO_MODELS, "shardcheck.toml"))

    assert from_own_file.models == from_pyproject.models


def test_golden_dir_is_optional(tmp_path: Path) -> None:
    text = "[tool.shardcheck]\n" + model(path='"m.onnx"', golden='"m.json"')

    manifest = load_manifest(write(tmp_path, text))

    assert manifest.golden_dir is None
    assert [entry.name for entry in manifest.models] == ["m"]


def test_find_manifest_prefers_shardcheck_toml(tmp_path: Path) -> None:
    write(tmp_path, "[project]\nname = 'x'\n")
    assert find_manifest(tmp_path) == tmp_path / "pyproject.toml"
    write(tmp_path, TWO_MODELS, "shardcheck.toml")
    assert find_manifest(tmp_path) == tmp_path / "shardcheck.toml"


def test_find_manifest_without_either_file(tmp_path: Path) -> None:
    with pytest.raises(InputError) as error:
        find_manifest(tmp_path)
    assert error.value.message == (
        f"{tmp_path}: no manifest: no shardcheck.toml, nor a pyproject.toml with a "
        "[tool.shardcheck] table, in this directory or any parent"
    )


def test_pyproject_without_the_table(tmp_path: Path) -> None:
    path = write(tmp_path, "[project]\nname = 'x'\n[tool.ruff]\nline-length = 100\n")
    with pytest.raises(InputError) as error:
        load_manifest(path)
    assert error.value.message == f"{path}: no [tool.shardcheck] table; see docs/gating.md"


def test_bare_table_in_shardcheck_toml_says_where_it_belongs(tmp_path: Path) -> None:
    path = write(
        tmp_path, 'golden-dir = "golden"\n[[models]]\npath = "m.onnx"\n', "shardcheck.toml"
    )
    with pytest.raises(InputError) as error:
        load_manifest(path)
    assert error.value.message == (
        f"{path}: no [tool.shardcheck] table (found top-level golden-dir, models: put them "
        "under [tool.shardcheck]); see docs/gating.md"
    )


def test_missing_and_unparsable_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"nothing\.toml: no such file$"):
        load_manifest(tmp_path / "nothing.toml")
    broken = write(tmp_path, "[tool.shardcheck\n")
    with pytest.raises(InputError) as error:
        load_manifest(broken)
    assert error.value.message.startswith(f"{broken}: not valid TOML (")
    assert "line 1" in error.value.message


GOOD = model(path='"a.onnx"', golden='"golden/a.json"')

# (manifest text after [tool.shardcheck], the error after "FILE: ")
INVALID = {
    "missing golden": (
        GOOD + model(path='"b.onnx"'),
        "tool.shardcheck.models[1].golden: missing",
    ),
    "missing path": (
        model(golden='"golden/a.json"'),
        "tool.shardcheck.models[0].path: missing",
    ),
    "empty path": (
        model(path='""', golden='"a.json"'),
        'tool.shardcheck.models[0].path: expected a path (a non-empty string), got ""',
    ),
    "path not a string": (
        model(path="3", golden='"a.json"'),
        "tool.shardcheck.models[0].path: expected a path (a non-empty string), got 3",
    ),
    "golden not json": (
        model(path='"a.onnx"', golden='"golden/a.txt"'),
        'tool.shardcheck.models[0].golden: expected a .json file, got "golden/a.txt"',
    ),
    "unknown model key": (
        GOOD + model(path='"b.onnx"', golden='"b.json"', rank="2"),
        "tool.shardcheck.models[1].rank: unknown key "
        "(known keys: name, path, golden, gen, verify, ranks, seq-lens, seq-len, rtol, atol, "
        "strict, timeout)",
    ),
    "unknown top key": (
        'golden_directory = "golden"\n' + GOOD,
        "tool.shardcheck.golden_directory: unknown key "
        "(known keys: golden-dir, models, strict, timeout)",
    ),
    "both spellings": (
        model(path='"a.onnx"', golden='"a.json"', seq_lens="[8]", **{"seq-lens": "[8]"}),
        "tool.shardcheck.models[0].seq-lens: given twice (also as seq_lens)",
    ),
    "verify not bool": (
        model(path='"a.onnx"', golden='"a.json"', verify='"yes"'),
        'tool.shardcheck.models[0].verify: expected true or false, got "yes"',
    ),
    "ranks zero": (
        model(path='"a.onnx"', golden='"a.json"', ranks="0"),
        "tool.shardcheck.models[0].ranks: expected an integer >= 1, got 0",
    ),
    "ranks bool": (
        model(path='"a.onnx"', golden='"a.json"', ranks="true"),
        "tool.shardcheck.models[0].ranks: expected an integer >= 1, got true",
    ),
    "rtol negative": (
        model(path='"a.onnx"', golden='"a.json"', rtol="-1e-3"),
        "tool.shardcheck.models[0].rtol: expected a finite number >= 0, got -0.001",
    ),
    "atol not a number": (
        model(path='"a.onnx"', golden='"a.json"', atol='"1e-3"'),
        'tool.shardcheck.models[0].atol: expected a finite number >= 0, got "1e-3"',
    ),
    "atol nan": (
        model(path='"a.onnx"', golden='"a.json"', atol="nan"),
        "tool.shardcheck.models[0].atol: expected a finite number >= 0, got NaN",
    ),
    "rtol infinite": (
        model(path='"a.onnx"', golden='"a.json"', rtol="inf"),
        "tool.shardcheck.models[0].rtol: expected a finite number >= 0, got Infinity",
    ),
    "rtol bool": (
        model(path='"a.onnx"', golden='"a.json"', rtol="true"),
        "tool.shardcheck.models[0].rtol: expected a finite number >= 0, got true",
    ),
    "seq-lens empty": (
        model(path='"a.onnx"', golden='"a.json"', **{"seq-lens": "[]"}),
        "tool.shardcheck.models[0].seq-lens: expected a list of two or more different integers "
        ">= 1, got []",
    ),
    "seq-lens with a string": (
        model(path='"a.onnx"', golden='"a.json"', **{"seq-lens": '[8, "16"]'}),
        "tool.shardcheck.models[0].seq-lens: expected a list of two or more different integers "
        '>= 1, got [8, "16"]',
    ),
    # verify needs two lengths to see which axis changes with them.
    "seq-lens one length twice": (
        model(path='"a.onnx"', golden='"a.json"', **{"seq-lens": "[8, 8]"}),
        "tool.shardcheck.models[0].seq-lens: expected a list of two or more different integers "
        ">= 1, got [8, 8]",
    ),
    "ranks not dividing verify's default lengths": (
        model(path='"a.onnx"', golden='"a.json"', ranks="3"),
        "tool.shardcheck.models[0].ranks: 8 and 16 (verify's default lengths) are not a "
        "multiple of ranks (3): each rank gets an equal part of the sequence",
    ),
    "seq-lens a list in a list": (
        model(path='"a.onnx"', golden='"a.json"', **{"seq-lens": "[8, [16]]"}),
        "tool.shardcheck.models[0].seq-lens: expected a list of two or more different integers "
        ">= 1, got [8, [16]]",
    ),
    "seq-lens not multiples of ranks": (
        model(path='"a.onnx"', golden='"a.json"', ranks="3", **{"seq-lens": "[6, 8, 10]"}),
        "tool.shardcheck.models[0].seq-lens: 8 and 10 are not a multiple of ranks (3): each "
        "rank gets an equal part of the sequence",
    ),
    "seq-len not a table": (
        model(path='"a.onnx"', golden='"a.json"', **{"seq-len": "[4, 8]"}),
        "tool.shardcheck.models[0].seq-len: expected a table of sequence dims and their own "
        "lengths, e.g. { target = [4, 8] }, got [4, 8]",
    ),
    "seq-len an empty table": (
        model(path='"a.onnx"', golden='"a.json"', **{"seq-len": "{}"}),
        "tool.shardcheck.models[0].seq-len: expected a table of sequence dims and their own "
        "lengths, e.g. { target = [4, 8] }, got {}",
    ),
    "seq-len a length not a list": (
        model(path='"a.onnx"', golden='"a.json"', **{"seq-len": "{ target = 4 }"}),
        "tool.shardcheck.models[0].seq-len.target: expected a list of different integers >= 1, "
        "got 4",
    ),
    "seq-len with a string": (
        model(path='"a.onnx"', golden='"a.json"', **{"seq-len": '{ target = [4, "8"] }'}),
        "tool.shardcheck.models[0].seq-len.target: expected a list of different integers >= 1, "
        'got [4, "8"]',
    ),
    "seq-len one length twice": (
        model(path='"a.onnx"', golden='"a.json"', **{"seq-len": "{ target = [4, 4] }"}),
        "tool.shardcheck.models[0].seq-len.target: expected a list of different integers >= 1, "
        "got [4, 4]",
    ),
    "seq-len zero": (
        model(path='"a.onnx"', golden='"a.json"', **{"seq-len": "{ target = [0, 4] }"}),
        "tool.shardcheck.models[0].seq-len.target: expected a list of different integers >= 1, "
        "got [0, 4]",
    ),
    # verify runs the dim's lengths with those of seq-lens, run by run.
    "seq-len fewer lengths than seq-lens": (
        model(
            path='"a.onnx"',
            golden='"a.json"',
            **{"seq-lens": "[8, 16, 32]", "seq-len": "{ target = [4, 8] }"},
        ),
        "tool.shardcheck.models[0].seq-len.target: expected one length per run of seq-lens "
        "[8, 16, 32], 3 in its order, got [4, 8]",
    ),
    "seq-len against verify's default lengths": (
        model(path='"a.onnx"', golden='"a.json"', **{"seq-len": "{ target = [4, 8, 12] }"}),
        "tool.shardcheck.models[0].seq-len.target: expected one length per run of seq-lens "
        "[8, 16] (verify's default lengths), 2 in its order, got [4, 8, 12]",
    ),
    "seq-len not multiples of ranks": (
        model(path='"a.onnx"', golden='"a.json"', ranks="2", **{"seq-len": "{ target = [3, 8] }"}),
        "tool.shardcheck.models[0].seq-len.target: 3 is not a multiple of ranks (2): each rank "
        "gets an equal part of the sequence",
    ),
    "seq-len in both spellings": (
        model(
            path='"a.onnx"',
            golden='"a.json"',
            seq_len="{ t = [4, 8] }",
            **{"seq-len": "{ t = [4, 8] }"},
        ),
        "tool.shardcheck.models[0].seq-len: given twice (also as seq_len)",
    ),
    "name with a space": (
        model(name='"my model"', path='"a.onnx"', golden='"a.json"'),
        "tool.shardcheck.models[0].name: expected a name of letters, digits, _ . + - "
        '(no spaces), got "my model"',
    ),
    "stem unusable as a name": (
        model(path='"my model.onnx"', golden='"a.json"'),
        'tool.shardcheck.models[0].name: the file stem "my model" cannot be a name '
        "(letters, digits, _ . + - only); set name",
    ),
    "duplicate default names": (
        GOOD + model(path='"other/a.onnx"', golden='"golden/a2.json"'),
        'tool.shardcheck.models[1].name: duplicate name "a" (also tool.shardcheck.models[0]); '
        "set distinct names",
    ),
    "one golden for two models": (
        GOOD + model(name='"b"', path='"b.onnx"', golden='"./golden/../golden/a.json"'),
        "tool.shardcheck.models[1].golden: ./golden/../golden/a.json is already the golden of "
        "tool.shardcheck.models[0] (a)",
    ),
    "gen not a table": (
        model(path='"a.onnx"', golden='"a.json"', gen='"fused"'),
        'tool.shardcheck.models[0].gen: expected a table of gen options, got "fused"',
    ),
    "gen unknown option": (
        model(path='"a.onnx"', golden='"a.json"', gen="{ cp_kind = 'fused' }"),
        "tool.shardcheck.models[0].gen: unknown gen option 'cp_kind'",
    ),
    "gen option of the wrong type": (
        model(path='"a.onnx"', golden='"a.json"', gen="{ reduce-op = 3 }"),
        "tool.shardcheck.models[0].gen: gen option 'reduce-op': expected a string, got 3",
    ),
    "gen int option given a string": (
        model(path='"a.onnx"', golden='"a.json"', gen='{ nb_rank = "2" }'),
        "tool.shardcheck.models[0].gen: gen option 'nb_rank': expected an integer, got \"2\"",
    ),
    "gen list with a negative": (
        model(path='"a.onnx"', golden='"a.json"', gen="{ groups = [0, -1] }"),
        "tool.shardcheck.models[0].gen: gen option 'groups': expected a list of "
        "non-negative integers, got [0, -1]",
    ),
    "gen bad choice": (
        model(path='"a.onnx"', golden='"a.json"', gen="{ cp-type = 'ring' }"),
        "tool.shardcheck.models[0].gen: gen option 'cp-type': expected one of native, fused, "
        "got 'ring'",
    ),
    "models missing": (
        'golden-dir = "golden"\n',
        "tool.shardcheck.models: missing (list each model as [[tool.shardcheck.models]])",
    ),
    "models empty": (
        "models = []\n",
        "tool.shardcheck.models: expected one or more [[tool.shardcheck.models]] tables, got []",
    ),
    "model not a table": (
        'models = ["a.onnx"]\n',
        'tool.shardcheck.models[0]: expected a table, got "a.onnx"',
    ),
    # Either would turn the stale-golden check off without a word.
    "golden-dir misspelt": (
        'golden-dir = "goldne"\n' + GOOD,
        "tool.shardcheck.golden-dir: 'goldne' does not exist and holds none of the goldens; "
        "check the path",
    ),
    "golden-dir a file": (
        'golden-dir = "pyproject.toml"\n' + GOOD,
        "tool.shardcheck.golden-dir: 'pyproject.toml' is not a directory",
    ),
    "golden-dir not a string": (
        "golden-dir = 1\n" + GOOD,
        "tool.shardcheck.golden-dir: expected a path (a non-empty string), got 1",
    ),
}


@pytest.mark.parametrize("case", INVALID, ids=str)
def test_invalid_manifest_is_one_line_naming_file_and_key(tmp_path: Path, case: str) -> None:
    body, problem = INVALID[case]
    path = write(tmp_path, "[tool.shardcheck]\n" + body)

    with pytest.raises(InputError) as error:
        load_manifest(path)

    assert error.value.message == f"{path}: {problem}"
    assert "\n" not in error.value.message


def test_gen_options_from_mapping_accept_both_spellings_and_lists() -> None:
    options = GenOptions.from_mapping(
        {"cp-type": "fused", "q_shuffle": [0, 2, 1], "i-rank": 3, "no-suggest-io": True}
    )
    assert options == GenOptions(cp_type="fused", q_shuffle=(0, 2, 1), i_rank=3, no_suggest_io=True)


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"is-causal": 1}, "gen option 'is-causal': expected true or false, got 1"),
        ({"i_rank": True}, "gen option 'i_rank': expected an integer, got true"),
        ({"gpus": 1.5}, "gen option 'gpus': expected an integer, got 1.5"),
        (
            {"k-shuffle": "0,1"},
            "gen option 'k-shuffle': expected a list of non-negative integers, got \"0,1\"",
        ),
        ({"gpus": 1, "gpus_": 2}, "unknown gen option 'gpus_'"),
        (
            {"reduce-op": "sum", "reduce_op": "min"},
            "gen option 'reduce_op' given twice (also as 'reduce-op')",
        ),
        ({"attention-pattern": 2}, "gen option 'attention-pattern': expected 0 or 1, got 2"),
    ],
)
def test_gen_options_from_mapping_rejects_wrong_values(
    values: dict[str, object], problem: str
) -> None:
    with pytest.raises(InputError) as error:
        GenOptions.from_mapping(values, source="m.toml: tool.shardcheck.models[3].gen")
    assert error.value.message == f"m.toml: tool.shardcheck.models[3].gen: {problem}"


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"root": 1.5}, "root: expected an integer, got 1.5"),
        ({"k_idx": 2.0}, "k_idx: expected an integer, got 2.0"),
        ({"no_suggest_io": "false"}, 'no_suggest_io: expected true or false, got "false"'),
        ({"groups": None}, "groups: expected a list of non-negative integers, got null"),
    ],
)
def test_gen_options_made_in_python_have_their_types_checked(
    values: dict[str, object], problem: str
) -> None:
    # gen would otherwise write hints its own reader refuses ("false" counted as true).
    with pytest.raises(InputError) as error:
        GenOptions(**values)  # type: ignore[arg-type]
    assert error.value.message == problem


def test_gen_options_made_in_python_take_lists_as_from_a_manifest() -> None:
    options = GenOptions(groups=[0, 1], q_shuffle=[0, 2, 1])  # type: ignore[arg-type]
    assert (options.groups, options.q_shuffle) == ((0, 1), (0, 2, 1))
    assert options == GenOptions.from_mapping({"groups": [0, 1], "q-shuffle": [0, 2, 1]})
