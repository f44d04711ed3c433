"""What each of shardcheck's speed tricks buys on the commands users run (issue 32, item 5).

    python benchmarks/tricks.py [--pairs 3] [--out DIR]

Each trick is switched off, one at a time, by a few lines run before shardcheck's console
command starts (``VARIANTS``; nothing in shardcheck reads a switch), and the command timed as
a whole process against the same command as shipped, in alternating pairs; the figure is the
median of the pairs' ratios (off / on: above 1, the trick saves time), and that of their CPU
times (user + system), which the load of a shared machine moves less. The commands are gen on
the 16k-node export, ``verify --ranks 2`` on it and on the 8k-node one, and ``simulate --ranks
2`` on the 8k-node one
(``build_models``'s, built in ``--out``). The exit code and the output of each variant must be
those of the command as shipped.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

try:
    from benchmarks import build_models
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import build_models  # type: ignore[no-redef]

DEFAULT_OUT = Path("/tmp/shardcheck-bench")
_START = "import sys\nfrom shardcheck.cli import main\nsys.argv[0] = 'shardcheck'\nmain()\n"
# The tricks still shipped, each switched off. The lowered switch interval and the objects left
# to the exit were measured here too, and removed (docs/performance.md, the speed tricks).
VARIANTS = {
    "as shipped": "",
    # Every pause of the cyclic collector (cli.main, the imports, gc_paused) does nothing.
    "collector never paused": "import gc\ngc.disable = lambda: None\n",
}


def _timed(argv: list[str], cwd: Path) -> tuple[float, float, int, str]:
    """Wall time, CPU time (user + system) of the child, its exit code and stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode, done.stdout


def measure(out: Path, pairs: int = 3, only: Sequence[str] = ()) -> list[str]:
    """The figures' lines; ``only``: the commands to time (their labels; default all)."""
    deep = build_models.ensure_encoder(out, build_models.EncoderConfig(depth=96))
    mid = build_models.ensure_encoder(out, build_models.EncoderConfig(depth=48))
    scratch = out / "tricks"
    scratch.mkdir(parents=True, exist_ok=True)
    hints, deep_hints = scratch / "export-48.json", scratch / "export-96.json"
    for model, written in ((mid, hints), (deep, deep_hints)):
        subprocess.run(
            [sys.executable, "-m", "shardcheck", "gen", str(model.path), "-o", str(written), "-q"],
            check=True,
        )
    commands = {
        "gen export-96": ["gen", str(deep.path), "-o", str(scratch / "out.json"), "-q"],
        "verify --ranks 2 export-48": ["verify", str(mid.path), str(hints), "--ranks", "2"],
        "simulate --ranks 2 export-48": [
            *("simulate", str(mid.path), str(hints), "--ranks", "2", "--seq-len", "16"),
        ],
        "verify --ranks 2 export-96": ["verify", str(deep.path), str(deep_hints), "--ranks", "2"],
    }
    commands = {label: args for label, args in commands.items() if not only or label in only}
    lines = [f"load average {os.getloadavg()[0]:.1f} at the start; {pairs} pairs each"]
    for label, args in commands.items():
        shipped = [sys.executable, "-c", _START, *args]
        _timed(shipped, scratch)  # warm the caches
        for variant, patch in VARIANTS.items():
            if not patch:
                continue
            changed = [sys.executable, "-c", patch + _START, *args]
            ratios, cpu_ratios, on_times, off_times, differs = [], [], [], [], []
            for _ in range(pairs):
                on, on_cpu, on_code, on_out = _timed(shipped, scratch)
                off, off_cpu, off_code, off_out = _timed(changed, scratch)
                ratios.append(off / on)
                cpu_ratios.append(off_cpu / on_cpu)
                on_times.append(on)
                off_times.append(off)
                # verify's report names no time; gen writes a file (stdout is empty).
                if on_code != off_code or on_out != off_out:
                    differs.append(f"exit {on_code} against {off_code}")
            lines.append(
                f"{label}: {variant}: {statistics.median(off_times):.3f} s against "
                f"{statistics.median(on_times):.3f} s, {statistics.median(ratios):.2f}x "
                f"(pairs {', '.join(f'{r:.2f}x' for r in ratios)}); CPU time "
                f"{statistics.median(cpu_ratios):.2f}x"
                + (f"; OUTPUT OR EXIT CODE DIFFERS ({', '.join(differs)})" if differs else "")
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model directory")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--only", action="append", default=[], help="a command's label")
    args = parser.parse_args(argv)
    for line in measure(args.out, args.pairs, args.only):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
