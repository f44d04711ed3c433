from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from conftest import FIXTURES, GOLDEN, embedded_bert_layer, read_json, run_cli

from shardcheck import GenOptions, generate, load_index
from shardcheck.hints.codec import dumps, loads


def test_gen_writes_hints_file(tmp_path: Path) -> None:
    out = tmp_path / "hints.json"
    result = run_cli("gen", FIXTURES / "attention_head.onnx", "-o", out)
    assert result.exit_code == 0, result.stderr
    document = read_json(out)
    assert [layer["q"] for layer in document["attention_layers"]] == ["q"]
    # input is [batch, sequence_len, 16]: the sequence is axis 1, found from the graph.
    assert document["inputs"] == [
        {"name": "input", "seq_len_idx": 1, "rank": 3, "polygraphy_class": "ShardTensor"}
    ]
    # K is gathered after the Transpose: [batch, 16, sequence_len]; V is [batch, seq, 16].
    assert (document["k_seq_len_idx"], document["v_seq_len_idx"], document["kv_rank"]) == (2, 1, 3)


def test_compat_keeps_polygraphy_name_guess(tmp_path: Path) -> None:
    out = tmp_path / "hints.json"
    result = run_cli("gen", FIXTURES / "attention_head.onnx", "-o", out, "--compat", "polygraphy")
    assert result.exit_code == 0, result.stderr
    document = read_json(out)
    # Polygraphy's name guess only knows "sequence_length" and "seq_len"; this dim is
    # "sequence_len", so the default index 0 is written, and K/V indices are the defaults.
    assert document["inputs"][0]["seq_len_idx"] == 0
    assert (document["k_seq_len_idx"], document["v_seq_len_idx"]) == (0, 0)


def test_gen_to_stdout_matches_file(tmp_path: Path) -> None:
    out = tmp_path / "h.json"
    run_cli("gen", FIXTURES / "multi_attention.onnx", "-o", out)
    result = run_cli("gen", FIXTURES / "multi_attention.onnx", "-o", "-")
    assert result.exit_code == 0
    assert result.stdout == out.read_text()


def test_gen_orders_io_by_graph_and_layers_topologically() -> None:
    result = run_cli("gen", FIXTURES / "multi_attention.onnx", "-o", "-", "--compat", "polygraphy")
    document = json.loads(result.stdout)
    assert [t["name"] for t in document["inputs"]] == ["q", "k", "v", "q2", "k2", "v2"]
    assert [t["name"] for t in document["outputs"]] == ["out1", "out2"]
    assert [layer["q"] for layer in document["attention_layers"]] == ["q", "q2"]
    # Named seq dims give the axis; shapeless tensors fall back to the default index and rank.
    axes = {t["name"]: (t["seq_len_idx"], t["rank"]) for t in document["inputs"]}
    assert axes == {
        "q": (1, 3),
        "k": (2, 3),
        "v": (1, 3),
        "q2": (0, None),
        "k2": (0, None),
        "v2": (0, None),
    }


def test_space_separated_lists_as_in_polygraphy() -> None:
    result = run_cli(
        "gen",
        FIXTURES / "attention.onnx",
        "-o",
        "-",
        "--groups",
        "0",
        "1",
        # Polygraphy's mode writes the options' replacement on every layer (the default mode
        # keeps this rank-3 layer native: no [batch, heads, seq, head_dim]).
        "--compat",
        "polygraphy",
        "--cp-type",
        "fused",
        "--q-shuffle",
        "0",
        "2",
        "1",
        "--k-shuffle",
    )
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["dist_collectives"]["groups"] == [0, 1]
    replace = document["attention_layers"][0]["replace"]
    assert replace["q_shuffle"] == [0, 2, 1]
    assert replace["k_shuffle"] == []
    assert replace["v_shuffle"] is None


def test_no_attention_gives_valid_empty_hints_and_warning() -> None:
    result = run_cli("gen", FIXTURES / "no_attention.onnx", "-o", "-")
    assert result.exit_code == 0
    hints = loads(result.stdout)
    assert hints.attention_layers == () and hints.inputs == () and hints.outputs == ()
    assert "no attention layer found" in result.stderr
    assert "Softmax between two MatMuls" in result.stderr
    compat = run_cli("gen", FIXTURES / "no_attention.onnx", "-o", "-", "--compat", "polygraphy")
    assert compat.exit_code == 0
    assert "MatMul(q, k) -> Softmax -> MatMul(., v)" in compat.stderr


@pytest.mark.parametrize(
    ("model", "says"),
    [
        (
            FIXTURES / "scaled_masked_attention.onnx",
            "1 of 1 attention layer matches neither of Polygraphy's patterns (scores); "
            "'polygraphy multi-device shard' would skip it,",
        ),
        (
            FIXTURES / "real" / "ts_bert_tiny.onnx",
            "2 of 2 attention layers match neither of Polygraphy's patterns (first: "
            "/model/encoder/layer.0/attention/self/MatMul); 'polygraphy multi-device shard' "
            "would skip them,",
        ),
    ],
)
def test_layers_polygraphy_would_skip_are_counted_in_a_warning(model: Path, says: str) -> None:
    result = run_cli("gen", model, "-o", "-")
    assert result.exit_code == 0
    assert says in result.stderr


@pytest.mark.parametrize(
    ("base", "ignored", "says"),
    [
        ([], ["--q-shuffle", "0", "1"], "--q-shuffle applies to --cp-type fused only; ignored"),
        (
            [],
            ["--is-causal", "--k-shuffle", "1", "0"],
            "--k-shuffle and --is-causal apply to --cp-type fused only; ignored",
        ),
        ([], ["--attention-pattern", "1"], "--attention-pattern chooses a Polygraphy pattern"),
        (["--no-suggest-io"], ["--io", "graph"], "--io graph changes nothing with --no-suggest"),
        (
            ["--compat", "polygraphy"],
            ["--io", "graph"],
            "--io graph changes nothing with --compat polygraphy",
        ),
    ],
)
def test_options_that_change_nothing_are_warned_of_and_change_nothing(
    base: list[str], ignored: list[str], says: str
) -> None:
    model = FIXTURES / "attention_head.onnx"
    without = run_cli("gen", model, "-o", "-", *base)
    result = run_cli("gen", model, "-o", "-", *base, *ignored)
    assert result.exit_code == 0
    assert f"shardcheck: warning: {says}" in result.stderr
    assert "warning" not in without.stderr
    assert result.stdout == without.stdout


def test_parallelism_tp_changes_only_the_label_and_says_so() -> None:
    model = FIXTURES / "attention_head.onnx"
    cp = run_cli("gen", model, "-o", "-")
    tp = run_cli("gen", model, "-o", "-", "--parallelism", "TP")
    assert tp.exit_code == 0
    assert "shardcheck: warning: --parallelism TP changes only the hints' label" in tp.stderr
    assert "'shardcheck shard' and 'verify --ranks' take CP hints only" in tp.stderr
    assert json.loads(tp.stdout) == {**json.loads(cp.stdout), "parallelism": "TP"}


def test_python_api_equals_cli() -> None:
    model = FIXTURES / "attention_output_chain.onnx"
    result = generate(load_index(model), GenOptions(compat="polygraphy"))
    cli_text = run_cli("gen", model, "-o", "-", "--compat", "polygraphy").stdout
    assert dumps(result.hints) == cli_text
    # The walk stops at a graph output: the residual output behind attn_out is not suggested,
    # and the input nothing depends on never is.
    assert [t.name for t in result.hints.inputs] == ["x"]
    assert [t.name for t in result.hints.outputs] == ["attn_out"]
    assert result.hints.kv_rank == 3  # from the value_info of k_T


@pytest.mark.parametrize("name", sorted(p.stem for p in GOLDEN.glob("*.json")))
def test_gen_equals_golden(name: str) -> None:
    result = run_cli("gen", FIXTURES / f"{name}.onnx", "-o", "-")
    assert result.stdout == (GOLDEN / f"{name}.json").read_text()


def test_output_is_identical_across_hash_seeds(tmp_path: Path) -> None:
    outputs = []
    for seed in ("0", "1", "42", "1234", "987654"):
        out = tmp_path / f"h{seed}.json"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run(
            [
                sys.executable,
                "-m",
                "shardcheck",
                "gen",
                str(FIXTURES / "multi_attention.onnx"),
                "-o",
                str(out),
            ],
            check=True,
            env=env,
            capture_output=True,
        )
        outputs.append(out.read_bytes())
    assert len(set(outputs)) == 1


@pytest.mark.parametrize("command", ["diff", "fmt"])
def test_wrong_typed_field_is_one_line_exit_2(tmp_path: Path, command: str) -> None:
    hints = tmp_path / "hints.json"
    document = read_json(GOLDEN / "attention.json")
    document["inputs"][2]["seq_len_idx"] = "1"
    hints.write_text(json.dumps(document))
    args = (
        ("diff", GOLDEN / "attention.json", hints)
        if command == "diff"
        else ("fmt", hints, "-o", "-")
    )
    result = run_cli(*args)
    assert result.exit_code == 2
    assert result.stderr == (
        f'shardcheck: error: {hints}: inputs[2].seq_len_idx: expected an integer, got "1"\n'
    )
    assert "Traceback" not in result.output


def test_missing_model_is_one_line_exit_2(tmp_path: Path) -> None:
    result = run_cli("gen", tmp_path / "nope.onnx", "-o", "-")
    assert result.exit_code == 2
    assert result.stderr == f"shardcheck: error: {tmp_path / 'nope.onnx'}: no such file\n"


def test_usage_error_is_one_line_exit_2() -> None:
    result = run_cli("gen", FIXTURES / "attention.onnx")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert "Missing option '-o'" in result.stderr


def test_a_model_path_with_a_comma_after_a_list_option_is_the_model(tmp_path: Path) -> None:
    # "--groups 0 1 MODEL": a malformed list after the option is its value, a path is not.
    (tmp_path / "d,1").mkdir()
    model = tmp_path / "d,1" / "a,b.onnx"
    model.write_bytes((FIXTURES / "attention_head.onnx").read_bytes())
    result = run_cli("gen", "--groups", "0", "1", model, "-o", "-")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["dist_collectives"]["groups"] == [0, 1]


def test_a_hinted_tensor_of_unknown_rank_is_warned_of(tmp_path: Path) -> None:
    # An op of a custom domain has no shape rule: what it computes has no known rank, and the
    # cut before the attention (its op reads x, and mixes positions as far as gen knows) is
    # written without one.
    from onnx import TensorProto
    from onnx import helper as oh

    weights = [
        oh.make_tensor(name, TensorProto.FLOAT, [8, 8], [0.01 * (i % 5) for i in range(64)])
        for name in ("wq", "wk", "wv")
    ]
    nodes = [
        oh.make_node("Mystery", ["x"], ["h"], domain="example.custom"),
        oh.make_node("MatMul", ["h", "wq"], ["q"]),
        oh.make_node("MatMul", ["h", "wk"], ["k"]),
        oh.make_node("MatMul", ["h", "wv"], ["v"]),
        oh.make_node("Transpose", ["k"], ["k_t"], perm=[0, 2, 1]),
        oh.make_node("MatMul", ["q", "k_t"], ["scores"]),
        oh.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        oh.make_node("MatMul", ["probs", "v"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "mystery",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=weights,
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("example.custom", 1)]
    )
    model.ir_version = 8
    path = tmp_path / "mystery.onnx"
    path.write_bytes(model.SerializeToString())
    result = run_cli("gen", path, "-o", tmp_path / "h.json")
    assert result.exit_code == 0, result.stderr
    rankless = [t["name"] for t in read_json(tmp_path / "h.json")["inputs"] if t["rank"] is None]
    assert rankless
    assert f"the rank of 1 hinted tensor is not known ({rankless[0]})" in result.stderr
    assert "declare its shape in the model's value_info" in result.stderr


def test_the_console_command_runs_without_the_cyclic_collector(tmp_path: Path) -> None:
    """It leaves with os._exit: the collector would only walk what the command made."""
    code = (
        "import gc, os, sys\n"
        "from shardcheck.cli import main\n"
        "collections, parent, real_exit = [], os.getpid(), os._exit\n"
        "gc.callbacks.append(lambda phase, info: collections.append(phase))\n"
        "def leave(code):\n"
        "    if os.getpid() == parent:  # not gen's checker child\n"
        "        print(code, len(collections), gc.isenabled(), flush=True)\n"
        "    real_exit(code)\n"
        "os._exit = leave\n"
        "sys.argv = ['shardcheck', 'gen', sys.argv[1], '-o', sys.argv[2]]\n"
        "main()\n"
    )
    model = FIXTURES / "real" / "dynamo_llama_tiny_gqa.onnx"
    out = subprocess.run(
        [sys.executable, "-c", code, str(model), str(tmp_path / "hints.json")],
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == ["0", "0", "False"]
    golden = GOLDEN / "real" / "dynamo_llama_tiny_gqa.json"
    assert read_json(tmp_path / "hints.json") == read_json(golden)


def test_a_k_or_v_index_unlike_the_layers_is_written_and_warned_of(tmp_path: Path) -> None:
    # BERT's gathered K, [batch, heads, head, keys], carries the keys on axis 3, V on axis 2.
    model = FIXTURES / "real" / "ts_bert_tiny.onnx"
    result = run_cli("gen", model, "-o", tmp_path / "h.json", "--k-idx", "2", "--v-idx", "2")
    assert result.exit_code == 0
    assert read_json(tmp_path / "h.json")["k_seq_len_idx"] == 2
    [warned] = [line for line in result.stderr.splitlines() if "is written, but" in line]
    assert warned.endswith(
        "--k-idx 2 is written, but 2 layers carry the keys on another axis (first: "
        "/model/encoder/layer.0/attention/self/MatMul, axis 3); verify reports it [SC105]"
    )


@pytest.mark.parametrize("compat", ["none", "polygraphy"])
def test_a_fused_shuffle_that_is_no_permutation_is_written_and_warned_of(
    tmp_path: Path, compat: str
) -> None:
    out = tmp_path / "h.json"
    argv = ["--cp-type", "fused", "--q-shuffle", "0,0,1", "--k-shuffle", "0,2,1"]
    argv += ["--compat", compat]
    result = run_cli("gen", FIXTURES / "attention.onnx", "-o", out, *argv)
    assert result.exit_code == 0
    assert read_json(out)["attention_layers"][0]["replace"]["q_shuffle"] == [0, 0, 1]
    assert [line for line in result.stderr.splitlines() if "permutation" in line] == [
        "shardcheck: warning: --q-shuffle 0,0,1 is not a permutation (each axis from 0 to 2 "
        "once); verify reports it (SC112)"
    ]


def test_attention_that_computes_q_k_and_v_from_one_input_is_warned_of(tmp_path: Path) -> None:
    # Gathering a packed com.microsoft Attention's K and V gathers its input, and so its Q:
    # every rank computes the layer whole. The hints say so (nothing is gathered after it),
    # and the simulation matches.
    model = tmp_path / "packed.onnx"
    onnx.save(embedded_bert_layer(), model)
    result = run_cli("gen", model, "-o", tmp_path / "h.json")
    assert result.exit_code == 0
    assert (
        "1 attention layer (attention) takes Q and K from one tensor: gathering K and V gathers "
        "Q too, so every rank computes it whole, which CP does not speed up (a packed "
        "com.microsoft Attention"
    ) in result.stderr
    hints = read_json(tmp_path / "h.json")
    assert [t["name"] for t in hints["inputs"]] == ["embedded"] and hints["outputs"] == []
    for ranks in ("2", "4"):
        simulated = run_cli(
            "simulate", model, tmp_path / "h.json", "--ranks", ranks, "--seq-len", "8"
        )
        assert simulated.exit_code == 0, simulated.stdout


def test_the_fused_warnings_carry_their_codes(tmp_path: Path) -> None:
    out = tmp_path / "h.json"
    bert = FIXTURES / "real" / "ts_bert_tiny.onnx"
    # attention.onnx's Q, K and V are [batch, seq, hidden]: no fused layout, the layer stays
    # native. BERT's fit one, but a --q-shuffle given applies to every layer all the same.
    cases = [
        ("SC309", FIXTURES / "attention.onnx", [], "cannot be replaced by a fused attention"),
        ("SC310", bert, ["--q-shuffle", "0,1,2,3"], "as the fused options say"),
    ]
    for code, model, extra, says in cases:
        args = ["gen", model, "-o", out, "--cp-type", "fused", *extra]
        warned = run_cli(*args)
        assert warned.exit_code == 0, warned.stderr
        [line] = [line for line in warned.stderr.splitlines() if says in line]
        assert line.endswith(f"[{code}]"), line
        ignored = run_cli(*args, "--ignore", code)
        assert f"[{code}]" not in ignored.stderr and says not in ignored.stderr
