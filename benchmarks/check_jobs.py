"""``check --verify --jobs 2`` against ``--jobs 1`` on a zoo of small models (issue 32).

The zoo is copies of one small encoder (``build_models``'s, 2 layers: verify runs it in a
fraction of a second, as it would a small model of a real zoo), each with its golden, listed
in one manifest. Both runs must print the same lines (the summary, which holds the time, aside); the
figure is the ratio of their wall times, the median of alternating pairs. Run alone
(``python benchmarks/check_jobs.py --models 200``) or from ``benchmarks/run.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import onnx

try:
    from benchmarks import build_models
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import build_models  # type: ignore[no-redef]

ZOO_DEPTH = 2  # layers of the zoo's encoder


@dataclass(frozen=True)
class JobsFigures:
    models: int
    jobs1_s: float
    jobs2_s: float
    same_lines: bool
    pairs: int
    jobs1_cpu_s: float = 0.0  # user + system time of the check process and its workers
    jobs2_cpu_s: float = 0.0
    load: float = 0.0  # the 1-minute load average when the runs began

    @property
    def speedup(self) -> float:
        return self.jobs1_s / self.jobs2_s if self.jobs2_s else 0.0

    def line(self) -> str:
        same = "same lines" if self.same_lines else "LINES DIFFER"
        return (
            f"check --verify on {self.models} models: --jobs 1 {self.jobs1_s:.2f} s "
            f"(CPU {self.jobs1_cpu_s:.2f} s), --jobs 2 {self.jobs2_s:.2f} s "
            f"(CPU {self.jobs2_cpu_s:.2f} s): {self.speedup:.2f}x ({same}; median of "
            f"{self.pairs} pairs; load average {self.load:.1f} at the start)"
        )


def build_zoo(directory: Path, count: int) -> Path:
    """``count`` models with up-to-date goldens and a manifest; returns the manifest."""
    (directory / "models").mkdir(parents=True)
    source = directory / "encoder.onnx"
    onnx.save(build_models.build_encoder(build_models.EncoderConfig(depth=ZOO_DEPTH)), source)
    lines = ["[tool.shardcheck]", 'golden-dir = "golden"']
    for number in range(count):
        name = f"m{number:03d}"
        shutil.copy(source, directory / "models" / f"{name}.onnx")
        lines += [
            "[[tool.shardcheck.models]]",
            f'path = "models/{name}.onnx"',
            f'golden = "golden/{name}.json"',
            "verify = true",
        ]
    manifest = directory / "shardcheck.toml"
    manifest.write_text("\n".join(lines) + "\n")
    check(manifest, "--update", "--jobs", "1")
    return manifest


def check(manifest: Path, *options: str) -> tuple[float, float, list[str]]:
    """One ``shardcheck check`` process: its wall time, the CPU time of it and its workers,
    and its lines without the summary."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "shardcheck", "check", "--manifest", str(manifest), *options],
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"check failed ({done.returncode}): {done.stderr.strip()}")
    return elapsed, cpu, done.stdout.splitlines()[:-1]


def measure(count: int = 200, pairs: int = 3) -> JobsFigures:
    with tempfile.TemporaryDirectory(prefix="shardcheck-zoo-") as temp:
        manifest = build_zoo(Path(temp), count)
        load = os.getloadavg()[0]
        serial: list[tuple[float, float]] = []
        parallel: list[tuple[float, float]] = []
        same = True
        for _ in range(pairs):  # alternating, so that a slow spell of the machine hits both
            *one, lines_one = check(manifest, "--verify", "--jobs", "1")
            *two, lines_two = check(manifest, "--verify", "--jobs", "2")
            serial.append((one[0], one[1]))
            parallel.append((two[0], two[1]))
            same = same and lines_one == lines_two
        return JobsFigures(
            count,
            statistics.median(wall for wall, _ in serial),
            statistics.median(wall for wall, _ in parallel),
            same,
            pairs,
            statistics.median(cpu for _, cpu in serial),
            statistics.median(cpu for _, cpu in parallel),
            load,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = measure(args.models, args.pairs)
    if args.json:
        print(json.dumps({**figures.__dict__, "speedup": round(figures.speedup, 3)}))
    else:
        print(figures.line())
    return 0 if figures.same_lines else 1


if __name__ == "__main__":
    sys.exit(main())
