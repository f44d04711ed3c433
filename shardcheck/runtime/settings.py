"""The settings of a run, refused (InputError) before anything runs when they cannot serve:
sequence lengths, tolerances, ranks, a timeout, collectives over part of the ranks. verify and
the CP simulation both ask here, so that one option is refused in one wording."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

from shardcheck.errors import InputError
from shardcheck.wording import shown


def refuse_bad_seq_lens(seq_lens: Sequence[int]) -> None:
    """verify's lengths: at least two, different, positive (the axes that change between two
    runs are the sequence axes)."""
    if len(seq_lens) < 2 or len(set(seq_lens)) != len(seq_lens) or min(seq_lens) < 1:
        raise InputError(
            f"--seq-lens {','.join(map(shown, seq_lens))}: give at least two different positive "
            "lengths, e.g. 8,16"
        )


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


def refuse_bad_tolerances(rtol: float, atol: float) -> None:
    for option, value in (("--rtol", rtol), ("--atol", atol)):
        if not 0 <= value < math.inf:  # NaN too: every comparison with it is false
            raise InputError(f"{option} {value}: expected a finite number >= 0")


def refuse_bad_ranks(ranks: int) -> None:
    if ranks < 1:
        raise InputError(f"--ranks {ranks}: expected at least 1 rank")


def refuse_bad_run_settings(seq_len: int, rtol: float, atol: float) -> None:
    """The settings of one simulated run: its tolerances, then its length."""
    refuse_bad_tolerances(rtol, atol)
    refuse_bad_seq_len(seq_len)
