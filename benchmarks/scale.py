"""Scale figures of issue 32: verify's peak memory against the size of the weights, and the
time per node of gen, verify and the simulation up to about 100k nodes.

    python benchmarks/scale.py memory [--gb 2.1] [--inline] [--out DIR] [--delete]
    python benchmarks/scale.py depth [--rounds 3] [--out DIR]

``memory`` builds ``build_models``'s big encoder with at least ``--gb`` GiB of external weights
(in ``--out``, never in the repository; ``--delete`` removes it afterwards), runs gen, then
``verify --ranks 2`` as a whole process, and reports verify's peak resident memory
(``ru_maxrss`` from ``os.wait4``, in run.py's small launcher) over the bytes of the weight
file, and whether verify passed. Target: at most 1.3x. With ``--inline`` the same encoder keeps
its weights inside the model file (``--gb`` defaults to 1.6 then: 9 layers, 1.70 GiB, below
protobuf's 2 GiB), and the peak is over the bytes of that file (the graph is a few hundred KiB
of it).

``depth`` builds the export encoder at 1, 48 and 600 layers (161, 8040 and 100362 nodes) and
times ``gen``, ``verify --ranks 2`` and ``simulate --ranks 2 --seq-len 16`` as whole processes,
the three models one after the other in each round (so that a slow spell of the machine hits
all), ``--rounds`` rounds, medians. The time per node is a model's time beyond the one-layer
model's, so that start-up does not hide it, over its nodes beyond the one-layer model's; the
figure is that at 100k nodes over that at 8k. Target: at most 2x. The same figures of the
children's CPU time (user and system) follow: on a machine other work loads, the wall time of
one process at 100k nodes moves by tens of seconds, its CPU time by a few.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.run import Launcher

try:
    from benchmarks import build_models
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import build_models  # type: ignore[no-redef]

DEFAULT_OUT = Path("/tmp/shardcheck-scale")
DEPTHS = (1, 48, 600)  # 161, 8040 and 100362 nodes
SIMULATE = ("--ranks", "2", "--seq-len", "16")


def _launcher(scratch: Path) -> Launcher:
    """run.py's launcher: children started from a small process, whose ru_maxrss is theirs."""
    try:
        from benchmarks import run
    except ImportError:
        import run  # type: ignore[no-redef]
    launcher: Launcher = run.Launcher(scratch)
    return launcher


def _shardcheck(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "shardcheck", *(str(a) for a in args)]


@dataclass(frozen=True)
class MemoryFigure:
    weight_bytes: int
    peak_bytes: int
    seconds: float
    passed: bool
    detail: str
    inline: bool = False

    @property
    def ratio(self) -> float:
        return self.peak_bytes / self.weight_bytes

    def line(self) -> str:
        outcome = "passed" if self.passed else f"FAILED: {self.detail}"
        verdict = "met" if self.passed and self.ratio <= 1.3 else "NOT met"
        return (
            f"verify --ranks 2 on {self.weight_bytes / 2**30:.2f} GiB of "
            f"{'inline' if self.inline else 'external'} weights: "
            f"peak {self.peak_bytes / 2**20:.0f} MiB = {self.ratio:.2f}x the weights, "
            f"{self.seconds:.1f} s, {outcome}; target <= 1.3x: {verdict}"
        )


def measure_memory(
    out: Path, gb: float, *, delete: bool = False, inline: bool = False
) -> MemoryFigure:
    model = build_models.ensure_big(out, gb, inline=inline)
    scratch = out / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    launcher = _launcher(scratch)
    try:
        hints = scratch / "big.json"
        made = launcher.run(_shardcheck("gen", model.path, "-o", hints, "-q"), scratch)
        if not made.ok:
            raise RuntimeError(f"gen failed: {made.stderr.strip()}")
        run = launcher.run(_shardcheck("verify", model.path, hints, "--ranks", "2", "-q"), scratch)
    finally:
        launcher.close()
        if delete:
            shutil.rmtree(model.path.parent, ignore_errors=True)
    return MemoryFigure(
        model.file_bytes if inline else model.external_bytes,
        run.peak_kib * 1024,
        run.seconds,
        run.ok,
        run.stderr.strip()[-300:],
        inline,
    )


@dataclass(frozen=True)
class DepthFigures:
    nodes: tuple[int, ...]
    seconds: dict[str, tuple[float, ...]]  # command -> median time per model, as ``nodes``
    rounds: int
    load: float
    cpu_seconds: dict[str, tuple[float, ...]]  # the same of the children's CPU time

    def per_node(self, command: str, at: int, *, cpu: bool = False) -> float:
        """Seconds (of CPU time with ``cpu``) per node of model ``at`` beyond the first
        (one-layer) model."""
        times = (self.cpu_seconds if cpu else self.seconds)[command]
        return (times[at] - times[0]) / (self.nodes[at] - self.nodes[0])

    def lines(self) -> list[str]:
        lines = []
        for command in self.seconds:
            for cpu in (False, True):
                times = (self.cpu_seconds if cpu else self.seconds)[command]
                shallow = self.per_node(command, 1, cpu=cpu)
                deep = self.per_node(command, 2, cpu=cpu)
                ratio = deep / shallow
                verdict = "met" if ratio <= 2 else "NOT met"
                cells = ", ".join(
                    f"{nodes} nodes {time:.2f} s"
                    for nodes, time in zip(self.nodes, times, strict=True)
                )
                lines.append(
                    f"{command}{' (CPU time)' if cpu else ''}: {cells}; beyond the one-layer "
                    f"model {shallow * 1e6:.0f} µs/node at {self.nodes[1]} nodes, "
                    f"{deep * 1e6:.0f} µs/node at {self.nodes[2]}: {ratio:.2f}x; "
                    f"target <= 2x: {verdict}"
                )
        lines.append(
            f"(whole processes, medians of {self.rounds} rounds; load average {self.load:.1f} "
            "at the start)"
        )
        return lines


def measure_depth(out: Path, rounds: int = 3) -> DepthFigures:
    models = [
        build_models.ensure_encoder(out, build_models.EncoderConfig(depth=depth))
        for depth in DEPTHS
    ]
    scratch = out / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    launcher = _launcher(scratch)
    commands = {
        "gen": lambda m, h: _shardcheck("gen", m.path, "-o", scratch / "out.json", "-q"),
        "verify --ranks 2": lambda m, h: _shardcheck("verify", m.path, h, "--ranks", "2", "-q"),
        "simulate --ranks 2": lambda m, h: _shardcheck("simulate", m.path, h, *SIMULATE),
    }
    try:
        hints = {}
        for model in models:
            hints[model.name] = scratch / f"{model.name}.json"
            made = launcher.run(_shardcheck("gen", model.path, "-o", hints[model.name]), scratch)
            if not made.ok:
                raise RuntimeError(f"gen {model.path} failed: {made.stderr.strip()}")
        load = os.getloadavg()[0]
        times: dict[str, list[list[float]]] = {c: [[] for _ in models] for c in commands}
        cpu: dict[str, list[list[float]]] = {c: [[] for _ in models] for c in commands}
        for _ in range(rounds):
            for command, argv in commands.items():
                for at, model in enumerate(models):
                    run = launcher.run(argv(model, hints[model.name]), scratch)
                    if not run.ok:
                        raise RuntimeError(f"{command} on {model.name}: {run.stderr.strip()}")
                    times[command][at].append(run.seconds)
                    cpu[command][at].append(run.cpu_seconds)
    finally:
        launcher.close()
    return DepthFigures(
        tuple(model.nodes for model in models),
        {c: tuple(statistics.median(t) for t in per_model) for c, per_model in times.items()},
        rounds,
        load,
        {c: tuple(statistics.median(t) for t in per_model) for c, per_model in cpu.items()},
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figure", choices=("memory", "depth"))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model directory")
    parser.add_argument(
        "--gb", type=float, help="GiB of weights (default 2.1 external, 1.6 inline)"
    )
    parser.add_argument(
        "--inline", action="store_true", help="weights inside the model file (below 2 GiB)"
    )
    parser.add_argument("--delete", action="store_true", help="remove the big model after")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.figure == "memory":
        gb = args.gb if args.gb is not None else 1.6 if args.inline else 2.1
        figure = measure_memory(args.out, gb, delete=args.delete, inline=args.inline)
        print(figure.line())
        return 0 if figure.passed else 1
    for line in measure_depth(args.out, args.rounds).lines():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
