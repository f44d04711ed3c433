"""The settings of a run, refused (InputError) before anything runs when they cannot serve:
sequence lengths, tolerances, ranks, a timeout, collectives over part of the ranks. verify and
the CP simulation both ask here, so that one option is refused in one wording."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence

from shardcheck.errors import InputError
from shardcheck.graph.protos import TensorProto
from shardcheck.wording import shown

# The default (rtol, atol) of a comparison with one device, by the element type of the
# outputs compared, finest first. A split run adds and multiplies in another order (a softmax
# over the keys of every rank, sums over slices), so its values differ from one device's by a
# few roundings: the tolerances are a number of the type's epsilons (docs/commands.md#verify).
# float32's are the long-standing 1e-4 and 1e-5, about 840 and 84 of its epsilons (1.2e-7);
# float16 (epsilon 9.8e-4) and bfloat16 (7.8e-3) keep about 10 and 1 epsilons, as their
# roundings are as large as the values' last digits; float64 (2.2e-16) is held a hundred
# thousand times tighter than float32.
TOLERANCES_BY_TYPE = {
    TensorProto.DOUBLE: (1e-9, 1e-10),
    TensorProto.FLOAT: (1e-4, 1e-5),
    TensorProto.FLOAT16: (1e-2, 1e-3),
    TensorProto.BFLOAT16: (8e-2, 8e-3),
}


def refuse_bad_seq_lens(seq_lens: Sequence[int]) -> None:
    """verify's lengths: at least two, different, positive (the axes that change between two
    runs are the sequence axes)."""
    if len(seq_lens) < 2 or len(set(seq_lens)) != len(seq_lens) or min(seq_lens) < 1:
        raise InputError(
            f"--seq-lens {','.join(map(shown, seq_lens))}: give at least two different positive "
            "lengths, e.g. 8,16"
        )


def refuse_bad_own_lengths(
    own_lengths: Mapping[str, Sequence[int]], seq_lens: Sequence[int]
) -> None:
    """verify's ``--seq-len NAME=L1,L2``: one positive length per run of ``--seq-lens``, two
    different at least (the runs show the dim's axes by what changes)."""
    for name, lengths in own_lengths.items():
        given = f"--seq-len {name}={','.join(map(shown, lengths))}"
        if len(lengths) != len(seq_lens):
            raise InputError(
                f"{given}: give one length per run of --seq-lens "
                f"{','.join(map(shown, seq_lens))} ({len(seq_lens)}), in the same order"
            )
        if len(set(lengths)) != len(lengths) or min(lengths) < 1:
            raise InputError(f"{given}: give different positive lengths, e.g. 6,12")


def refuse_bad_seq_len(seq_len: int) -> None:
    if seq_len < 1:
        raise InputError(f"--seq-len {shown(seq_len)}: the sequence length must be positive")


def refuse_bad_timeout(timeout: float | None) -> None:
    # threading.Timer takes no NaN, infinity or wait past TIMEOUT_MAX (it fails in its thread).
    if timeout is not None and not 0 < timeout <= threading.TIMEOUT_MAX:
        raise InputError(
            f"--timeout {timeout}: expected a positive number of seconds "
            f"(at most {threading.TIMEOUT_MAX:.0f})"
        )


def refuse_bad_tolerances(rtol: float | None, atol: float | None) -> None:
    """None: the default of the outputs' type (``default_tolerances``), nothing to refuse."""
    for option, value in (("--rtol", rtol), ("--atol", atol)):
        if value is not None and not 0 <= value < math.inf:  # NaN too: no comparison holds
            raise InputError(f"{option} {value}: expected a finite number >= 0")


def default_tolerances(elem_types: Iterable[int | None]) -> tuple[float, float]:
    """The (rtol, atol) of the coarsest floating type among ``elem_types`` (an output's), or
    float32's where none is floating: a split run of an fp16 model is as close as fp16 is."""
    known = [TOLERANCES_BY_TYPE[t] for t in elem_types if t in TOLERANCES_BY_TYPE]
    return max(known, default=TOLERANCES_BY_TYPE[TensorProto.FLOAT])


def tolerances_or_defaults(
    rtol: float | None, atol: float | None, elem_types: Iterable[int | None]
) -> tuple[float, float]:
    """``rtol`` and ``atol`` as given, each one None replaced by the default of the outputs'
    ``elem_types`` (``default_tolerances``)."""
    default_rtol, default_atol = default_tolerances(elem_types)
    return (default_rtol if rtol is None else rtol), (default_atol if atol is None else atol)


def refuse_bad_ranks(ranks: int) -> None:
    if ranks < 1:
        raise InputError(f"--ranks {ranks}: expected at least 1 rank")


def refuse_bad_run_settings(seq_len: int, rtol: float | None, atol: float | None) -> None:
    """The settings of one simulated run: its tolerances, then its length."""
    refuse_bad_tolerances(rtol, atol)
    refuse_bad_seq_len(seq_len)
