"""Whether a tensor is a slice: computed, through data, from a tensor CP scatters."""

from __future__ import annotations

from collections.abc import Iterable

from shardcheck.frontier.tensor_ids import TensorIds

# The sliced test's answers, by tensor id (0: not known yet).
_WHOLE, _SLICED = 1, 2


class SlicedTest:
    """Whether a tensor is computed from a scattered one through data (what a rank holds a
    slice of, or derived from a slice). Asked of few tensors, so answered walking back from
    them, memoised, rather than by following every cut forward through the whole graph."""

    def __init__(self, ids: TensorIds, cut: Iterable[int], whole: Iterable[int] = ()) -> None:
        self.parents = ids.parents
        self.memo = bytearray(len(ids.names))
        # ``whole``: what each rank holds whole although computed from a slice (a gathered
        # tensor); what is computed from it alone is whole too.
        for tensor in whole:
            self.memo[tensor] = _WHOLE
        for tensor in cut:
            self.memo[tensor] = _SLICED

    def __call__(self, tensor: int) -> bool:
        memo = self.memo
        if memo[tensor]:
            return memo[tensor] == _SLICED
        parents = self.parents
        # Depth first with an explicit stack (data paths are thousands of nodes long). A
        # tensor waits on the first of its inputs not yet known; ``expanding`` holds the
        # tensors waiting, so that a cycle in a malformed graph ends instead of looping.
        stack = [tensor]
        expanding: set[int] = set()
        while stack:
            current = stack[-1]
            if memo[current]:
                stack.pop()
                continue
            inputs = parents[current]
            if inputs is None:  # a graph input, a weight, or a Shape's output
                memo[current] = _WHOLE
                stack.pop()
                continue
            sliced = False
            waiting = None
            for name in inputs:
                value = memo[name]
                if value == _SLICED:
                    sliced = True
                    break
                if not value and waiting is None and name not in expanding:
                    waiting = name
            if sliced or waiting is None:
                memo[current] = _SLICED if sliced else _WHOLE
                expanding.discard(current)
                stack.pop()
            else:
                expanding.add(current)
                stack.append(waiting)
        return memo[tensor] == _SLICED
