"""N simulated ranks of a multi-device model, in one process, on the CPU: the run loop.

The model is cut into stages at its ``DistCollective`` nodes (plan.py). A stage is one
onnxruntime session (ahead.py), built once and run for every rank, or once for all ranks when
all its inputs are the same on every rank (the replicated graph inputs, an all-gathered
tensor). Between stages the collectives run in numpy (collectives.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx

from shardcheck.runtime.sessions import error_text, failed_node, onnxruntime_errors
from shardcheck.runtime.supervised import watched_run
from shardcheck.sharding.rewrite import COLLECTIVE_OP, ShardedModel
from shardcheck.simulation.ahead import AHEAD_WORKERS, StageSessions
from shardcheck.simulation.collectives import (
    CollectiveStep,
    refuse_unknown_group_ranks,
    run_collective,
)
from shardcheck.simulation.fused_attention import FusedAttentionStep, run_fused_attention
from shardcheck.simulation.plan import Stage, downstream, plan_steps, toposorted
from shardcheck.simulation.rank_values import RankFailure, RankValues

# What a timeout's message calls a run of a stage (runtime/supervised.py).
_RUN_LABEL = "a run of the CP simulation"


class RankSimulator:
    """Runs a sharded model on ``ranks`` simulated ranks; sessions are built once per stage.

    ``weights`` is the single-device model: stages take their initializers, opsets and
    functions from it; ``weights_dir`` is where its external weight files are (see
    ``sessions.make_session``). ``share_forms``: stages of one form run on one session (else each
    on its own); ``ahead_workers``: how many threads make the stages' sessions ahead.
    """

    def __init__(
        self,
        sharded: ShardedModel,
        weights: onnx.ModelProto,
        ranks: int,
        weights_dir: Path | None = None,
        *,
        share_forms: bool = True,
        ahead_workers: int = AHEAD_WORKERS,
    ) -> None:
        self.sharded = sharded
        self.ranks = ranks
        self.weights_dir = weights_dir
        self.weights = {tensor.name: tensor for tensor in weights.graph.initializer}
        graph = sharded.model.graph
        self.nodes, reads = toposorted(graph)
        self.producers = {name: node for node in self.nodes for name in node.output}
        # DistCollective node -> the tensor that ends its chain (after the Transpose back).
        self.tail_of_collective = {
            tail.collective_node: name for name, tail in sharded.tails.items()
        }
        self.steps = plan_steps(
            self.nodes,
            reads,
            self.weights,
            {i.name for i in graph.input},
            [o.name for o in graph.output],
        )
        refuse_unknown_group_ranks(self.steps, ranks)
        self.session_runs = 0
        stages = [step for step in self.steps if isinstance(step, Stage)]
        self.sessions = StageSessions(stages, weights, self.weights, weights_dir)
        self.sessions.make_ahead(
            self.nodes, graph.input, share_forms=share_forms, workers=ahead_workers
        )

    @property
    def stage_count(self) -> int:
        return sum(1 for step in self.steps if isinstance(step, Stage))

    def made_by(self, tensor: str) -> tuple[str, str]:
        """The node that made ``tensor`` (for a gathered or scattered tensor: its collective)."""
        tail = self.sharded.tails.get(tensor)
        if tail is not None:
            return tail.collective_node, COLLECTIVE_OP
        node = self.producers.get(tensor)
        return (node.name, node.op_type) if node is not None else ("<graph input>", "")

    def stop_making_ahead(self) -> None:
        """No stage session is left being made in the background (``StageSessions``)."""
        self.sessions.stop_making_ahead()

    def run(self, feeds: Mapping[str, np.ndarray], *, diagnostic: bool = False) -> RankValues:
        """Every rank's tensors. Normally only what later steps read is kept and a failure is
        raised; in diagnostic mode every tensor is kept, and the first failure is recorded in
        the result with what could still be computed."""
        values = RankValues(self.ranks, feeds)
        for step in self.steps:
            try:
                if isinstance(step, CollectiveStep):
                    self._run_collective(step, values)
                elif isinstance(step, FusedAttentionStep):
                    run_fused_attention(step, values, self.ranks)
                else:
                    self._run_stage(step, values, diagnostic)
            except RankFailure as failure:
                if not diagnostic:
                    raise
                values.failure = failure
                break
        return values

    def _run_stage(self, stage: Stage, values: RankValues, diagnostic: bool) -> None:
        if all(name in values.replicated for name in stage.inputs):
            feeds = values.feeds_for(stage.inputs, 0)
            result, failure = self._run_on_rank(stage, feeds, 0, diagnostic)
            values.set_replicated(result)
        else:
            failure = None
            for rank in range(self.ranks):
                feeds = values.feeds_for(stage.inputs, rank)
                result, rank_failure = self._run_on_rank(stage, feeds, rank, diagnostic)
                values.set_rank(rank, result)
                failure = failure or rank_failure
        if failure is not None:
            raise failure

    def _run_on_rank(
        self, stage: Stage, feeds: dict[str, np.ndarray], rank: int, diagnostic: bool
    ) -> tuple[dict[str, np.ndarray], RankFailure | None]:
        """Run a stage for one rank. In diagnostic mode a failing node and everything that
        depends on it are cut off and the rest runs again."""
        if not diagnostic:
            return self._session_run(stage, frozenset(), False, feeds, rank), None
        removed: frozenset[str] = frozenset()
        first: RankFailure | None = None
        while True:
            try:
                return self._session_run(stage, removed, True, feeds, rank), first
            except RankFailure as failure:
                first = first or failure
                if failure.node is None or failure.node in removed:
                    return {}, first
                removed = removed | downstream(stage.nodes, failure.node)

    def _session_run(
        self,
        stage: Stage,
        removed: frozenset[str],
        diagnostic: bool,
        feeds: dict[str, np.ndarray],
        rank: int,
    ) -> dict[str, np.ndarray]:
        wanted = stage.produced if diagnostic else stage.outputs
        cut = {name for node in stage.nodes if node.name in removed for name in node.output}
        outputs = [name for name in wanted if name not in cut]
        try:
            if stage.leader is not None and not removed and not diagnostic:
                shared = self.sessions.run_shared(stage, feeds)
                if shared is not None:
                    self.session_runs += 1
                    return dict(zip(outputs, shared, strict=True))
            session = self.sessions.session(stage, removed, diagnostic, feeds, outputs)
            self.session_runs += 1
            with watched_run(_RUN_LABEL):
                values = session.run(outputs, feeds)
        except onnxruntime_errors() as error:
            message = str(error)
            # An empty name (a subgraph's unnamed node) names no node of the stage.
            raise RankFailure(
                rank,
                failed_node(message) or None,
                f"onnxruntime: {error_text(message, status_only=True)}",
            ) from None
        return dict(zip(outputs, values, strict=True))

    def _run_collective(self, step: CollectiveStep, values: RankValues) -> None:
        tail = self.tail_of_collective.get(step.node.name)
        run_collective(
            step,
            values,
            ranks=self.ranks,
            weights=self.weights,
            weights_dir=self.weights_dir,
            scattered_axis=self.sharded.tails[tail].axis if tail is not None else 0,
        )
