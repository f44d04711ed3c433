"""What keeps the work on deep models in proportion to their depth, counted (not timed: the
benchmark, benchmarks/run.py, measures time). The models are the benchmark's own stacked
encoders (benchmarks/build_models.py), small: their blocks repeat, but for names, weights and
the layout of K, which cycles through three kinds from block to block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import benchmark_models

from shardcheck import load_index
from shardcheck.analysis import shapes as shapes_module
from shardcheck.analysis.shapes import ShapeInference
from shardcheck.generation.generate import generate
from shardcheck.generation.options import GenOptions
from shardcheck.graph.index import Node
from shardcheck.simulation.plan import Stage
from shardcheck.simulation.simulate import Simulation
from shardcheck.verification import verify as verify_module
from shardcheck.verification.findings import Finding, Report

Encoder = Callable[[str, int], Path]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Encoder:
    import onnx

    builder = benchmark_models()
    directory = tmp_path_factory.mktemp("encoders")

    def build(kind: str, depth: int) -> Path:
        path = directory / f"{kind}-{depth}.onnx"
        if not path.exists():
            config = builder.EncoderConfig(depth=depth, kind=kind, hidden=16, heads=2, ffn=32)
            onnx.save(builder.build_encoder(config), path)
        return path

    return build


@pytest.mark.parametrize("kind", ["export", "plain"])
def test_shape_rules_run_once_per_distinct_node_at_any_depth(
    encoder: Encoder, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rule = shapes_module.apply_rule
    rule_runs = [0]

    def counted(shapes: ShapeInference, node: Node) -> object:
        rule_runs[0] += 1
        return rule(shapes, node)

    monkeypatch.setattr(shapes_module, "apply_rule", counted)
    runs: dict[int, tuple[int, int]] = {}
    for depth in (4, 8):
        index = load_index(encoder(kind, depth))
        rule_runs[0] = 0
        ShapeInference(index)
        runs[depth] = (rule_runs[0], len(index.nodes))
    (shallow_runs, shallow_nodes), (deep_runs, deep_nodes) = runs[4], runs[8]
    assert deep_nodes > 1.9 * shallow_nodes
    # Every layout of K is in both: twice the blocks, not one rule run more.
    assert deep_runs == shallow_runs < shallow_nodes / 4


@pytest.mark.parametrize("kind", ["export", "plain"])
def test_the_simulation_makes_no_more_sessions_for_more_blocks(encoder: Encoder, kind: str) -> None:
    made: dict[int, tuple[int, int]] = {}
    for depth in (6, 9):
        path = encoder(kind, depth)
        hints = generate(load_index(path), GenOptions()).hints
        simulation = Simulation(path, hints, ranks=2)
        try:
            stages = [s for s in simulation.simulator.steps if isinstance(s, Stage)]
            sessions = {id(stage.leader or stage) for stage in stages}
            assert simulation.run(8).ok
        finally:
            simulation.settle()
        made[depth] = (len(stages), len(sessions))
    (shallow_stages, shallow_sessions), (deep_stages, deep_sessions) = made[6], made[9]
    assert deep_stages > shallow_stages
    assert deep_sessions == shallow_sessions < shallow_stages


class _CountedFindings(list):  # type: ignore[type-arg]
    """A report's findings that count each one read by a walk over them."""

    reads = 0

    def __iter__(self) -> Iterator[Finding]:
        for finding in super().__iter__():
            _CountedFindings.reads += 1
            yield finding


@dataclass
class _CountingReport(Report):
    def __post_init__(self) -> None:
        self.findings = _CountedFindings(self.findings)
        super().__post_init__()


def test_verify_reads_its_findings_in_proportion_to_the_depth(
    encoder: Encoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each layer adds a finding (SC110) and hints tensors whose axes verify checks; asking,
    # for each such tensor, whether a finding of it was reported by scanning the findings read
    # them in proportion to the square of the depth (1.8M reads at 600 layers).
    monkeypatch.setattr(verify_module, "Report", _CountingReport)
    reads: dict[int, tuple[int, int, int]] = {}
    for depth in (4, 8):
        path = encoder("export", depth)
        index = load_index(path)
        hints = generate(index, GenOptions()).hints
        _CountedFindings.reads = 0
        report = verify_module.verify(path, hints, ranks=2)
        assert report.ok, report.render_text()
        reads[depth] = (_CountedFindings.reads, len(report.findings), len(index.nodes))
    (shallow_reads, shallow_findings, shallow_nodes) = reads[4]
    (deep_reads, deep_findings, deep_nodes) = reads[8]
    assert deep_findings >= shallow_findings + 4  # one more finding per layer
    assert deep_nodes > 1.9 * shallow_nodes
    assert 0 < deep_reads <= 2.1 * shallow_reads
