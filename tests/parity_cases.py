"""Option combinations on which ``gen --compat polygraphy`` must equal Polygraphy 0.53.6.

Every option is at a non-default value at least once; both patterns and both cp-types occur.
Lists are spelled as Polygraphy spells them (space-separated).
"""

from __future__ import annotations

OPTION_CASES: dict[str, list[str]] = {
    "defaults": [],
    "pattern1": ["--attention-pattern", "1"],
    "fused_shuffles": [
        "--cp-type",
        "fused",
        "--is-causal",
        "--nb-rank",
        "2",
        "--q-shuffle",
        "0",
        "2",
        "1",
        "3",
        "--k-shuffle",
        "0",
        "2",
        "3",
        "1",
        "--v-shuffle",
        "0",
        "2",
        "1",
        "3",
    ],
    "collectives": ["--parallelism", "TP", "--root", "0", "--gpus", "4", "--groups", "0", "1"],
    "no_suggest_io": ["--no-suggest-io"],
    "default_indices": ["--i-idx", "1", "--o-idx", "2", "--k-idx", "2", "--v-idx", "1"],
    "fallback_ranks": ["--i-rank", "4", "--o-rank", "5", "--kv-rank", "6"],
    "reduce_sum": ["--reduce-op", "sum"],
    "fused_plain_avg": ["--cp-type", "fused", "--reduce-op", "avg"],
    "pattern1_fused_min": ["--attention-pattern", "1", "--cp-type", "fused", "--reduce-op", "min"],
    "empty_lists": ["--groups", "--q-shuffle", "--cp-type", "fused"],
    "prod_ranks": ["--reduce-op", "prod", "--nb-rank", "4", "--kv-rank", "3", "--i-idx", "2"],
}

FIXTURES = [
    "attention",
    "attention_same_qkv",
    "multi_attention",
    "attention_head",
    "sdpa_scaled_attention",
    "attention_output_chain",
    "scaled_masked_attention",
    "no_attention",
]

ANCHOR_MODELS = ["attention", "attention_same_qkv", "multi_attention", "attention_head"]


def uses_pattern1(args: list[str]) -> bool:
    return "--attention-pattern" in args and args[args.index("--attention-pattern") + 1] == "1"
