"""The tensors every simulated rank holds as a run goes, and a rank's failure to compute one."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np


class RankFailure(Exception):
    """A rank could not compute ``node`` (onnxruntime failed, or a collective cannot split)."""

    def __init__(self, rank: int, node: str | None, message: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.node = node
        self.message = message


class RankValues:
    """The tensors of every rank; a replicated tensor is one array shared by all ranks."""

    def __init__(self, ranks: int, feeds: Mapping[str, np.ndarray]) -> None:
        self.per_rank: list[dict[str, np.ndarray]] = [dict(feeds) for _ in range(ranks)]
        self.replicated: set[str] = set(feeds)
        self.failure: RankFailure | None = None

    def feeds_for(self, inputs: Iterable[str], rank: int) -> dict[str, np.ndarray]:
        return {name: self.per_rank[rank][name] for name in inputs}

    def set_replicated(self, result: Mapping[str, np.ndarray]) -> None:
        for values in self.per_rank:
            values.update(result)
        self.replicated.update(result)

    def set_rank(self, rank: int, result: Mapping[str, np.ndarray]) -> None:
        self.per_rank[rank].update(result)
        self.replicated.difference_update(result)
