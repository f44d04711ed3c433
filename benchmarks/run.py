"""The performance benchmark of shardcheck: gen against Polygraphy, verify, the CP simulation.

    python benchmarks/run.py                    # everything, writes benchmarks/RESULTS.md
    python benchmarks/run.py --quick            # depths 12 and 48, one repeat, no big model

It builds (or reuses) the models of ``build_models.py`` in ``--out`` and prints one markdown
table, with notes on linearity, the external-weights model and the targets of the performance
issue; the same text goes to ``benchmarks/RESULTS.md`` with the machine it was taken on.

How each figure is taken:

* whole process: ``python -m shardcheck gen MODEL -q -o OUT`` and ``polygraphy template
  shard-hints MODEL -o OUT.json`` as child processes, paired and alternating (gen, Polygraphy,
  gen, Polygraphy, ...), ``--repeats`` pairs per model (``--deep-repeats`` for the deepest
  models, whose ratios the targets are judged on; each pair's ratio is listed too), median
  wall time; the speed-up is the median of the pairs' ratios (the ratio of the median times is
  shown beside it in the targets); peak memory is the child's ``ru_maxrss`` from
  ``os.wait4``. Polygraphy's log goes to /dev/null. The children run in a scratch directory,
  not in the model's.
* in process (one fresh interpreter per model): ``onnx.load(path, load_external_data=False)``
  against what gen does after the parse, the way ``shardcheck gen`` runs it: the rest of
  ``parse_model`` (its checks: ``parse_model`` time minus the parse time of the same round),
  ``GraphIndex`` and ``generate`` with default options (and the hints serialized); median over
  ``--repeats`` rounds (at least 3). ``onnx.checker`` (``ParsedModel.check``), which gen runs in
  a child process beside these, is timed on its own and shown apart.
* linearity: the same in-process analysis of each kind's shallowest and deepest models, in
  ``--linearity-pairs`` alternating pairs of fresh interpreters (shallow, deep, ...): per pair,
  the deep model's time per node over the shallow one's; the median of those ratios.
* external weights: gen's peak memory on the big model (>= 1 GiB of external weights) and on the
  deepest export model saved with external weights; that a weight file is never opened is shown
  by tracing gen's ``open``/``openat`` calls with strace when it is installed, and by running gen
  with the weight file renamed away (it must succeed and write the same hints).
* verify: ``shardcheck.verify`` on the hints gen wrote, timed whole, against the same onnxruntime
  work (its sessions and runs, recorded by wrapping ``onnxruntime.InferenceSession``)
  replayed alone right after, alternating, ``--verify-pairs`` pairs (at least 3): the median of the
  pairs' ratios (and the median times) are shown. verify
  makes its session in a thread while it analyses the model, so the onnxruntime time measured
  inside verify is longer than alone; it is shown too, but the ratio is against the replay.
  verify simulates CP on 2 ranks by default, so its whole time is also shown in inferences of
  the model at its longest length (issue 28's target: about N + 2, its two runs and the
  simulation of N ranks at each length).
* simulation: ``shardcheck.simulate`` with each of ``--ranks`` (2 and 4 ranks by
  default), against one inference of the model (an onnxruntime session made and run once,
  options as shardcheck's), alternating, in up to 3 pairs (as many as fit in 20 s, at least
  one): the median of the pairs' ratios. Neither clock pays for freeing the sessions: the
  inference's is freed after its clock stops, and the simulation's are left to the end of
  the measurement, as ``shardcheck simulate`` leaves them to the process's exit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import hashlib
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

try:
    from benchmarks import build_models, check_jobs, scale
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import build_models  # type: ignore[no-redef]
    import check_jobs  # type: ignore[no-redef]
    import scale  # type: ignore[no-redef]

BuiltModel = build_models.BuiltModel

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"
MIB = 1024  # ru_maxrss is in KiB on Linux
PACKAGES = (
    "shardcheck",
    "onnx",
    "onnxruntime",
    "numpy",
    "protobuf",
    "polygraphy",
    "onnx_graphsurgeon",
)
NOT_AVAILABLE = "not available yet"

# The targets of the performance issue.
SPEEDUP_TARGET = 10.0  # gen vs Polygraphy, whole process, on the 32k-node graph
ANALYSIS_TARGET = 2.0  # gen's analysis after the parse, in units of onnx.load
LINEARITY_TARGET = 1.2  # time per node, deepest vs shallowest
BIG_MEMORY_TARGET_MIB = 200.0
VERIFY_TARGET = 1.2  # whole verify vs the onnxruntime work it does
SIMULATION_PAIRS = 3  # simulation / inference pairs, as many as fit in 20 s (at least one)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ChildRun:
    seconds: float
    peak_kib: int
    returncode: int
    stderr: str = ""
    # The child's CPU time, user and system (os.wait4): a loaded machine moves it far less than
    # the wall time.
    cpu_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass(frozen=True)
class InProcess:
    """Medians in seconds: parse, and what gen does after it."""

    load: float
    checks: float
    index: float
    generate: float
    checker: float  # in a child process beside the rest, in gen

    @property
    def analysis(self) -> float:
        return self.checks + self.index + self.generate


@dataclass
class ModelResult:
    model: BuiltModel
    in_process: InProcess | None = None
    gen: list[ChildRun] = field(default_factory=list)
    polygraphy: list[ChildRun] | None = None
    hints: Path | None = None
    verify: str = "-"
    verify_ratio: float | None = None
    simulate: str = "-"
    # Per number of ranks: the simulation's time in inferences.
    simulate_ratios: dict[int, float] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class BigModelProof:
    lines: tuple[str, ...]
    never_opened: bool


# --------------------------------------------------------------------------- environment


def environment() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = []
    for package in PACKAGES:
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            name = package.replace("_", "-")
            versions.append(f"{package} {version(name)}")
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = " + uncommitted changes" if _git("status", "--porcelain", "--", "shardcheck") else ""
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{platform.machine()}, {cpu}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "packages": ", ".join(versions),
        "shardcheck": f"{commit or 'unknown'}{dirty}",
    }


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=False, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def source_fingerprint() -> str:
    """Changes when any shardcheck source file changes (others may edit the tree mid-run)."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "shardcheck").rglob("*.py")):
        with contextlib.suppress(OSError):
            digest.update(str(path).encode() + path.read_bytes())
    return digest.hexdigest()


def find_polygraphy() -> str | None:
    """Polygraphy's command on PATH, or next to this Python (a virtualenv's bin)."""
    beside = Path(sys.executable).parent / "polygraphy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("polygraphy")


def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


# --------------------------------------------------------------------------- child processes


# The children are started by this small helper process and not by the benchmark itself: a
# child's ru_maxrss counts the memory of the process that forked it (Linux keeps the high-water
# mark across exec), and the benchmark holds hundreds of MB of models. The helper stays small.
LAUNCHER = r"""
import json, os, sys, time
for line in sys.stdin:
    request = json.loads(line)
    os.chdir(request["cwd"])
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
        (os.POSIX_SPAWN_DUP2, err, 2),
        (os.POSIX_SPAWN_CLOSE, err),
    ]
    started = time.perf_counter()
    pid = os.posix_spawnp(request["argv"][0], request["argv"], request["env"], file_actions=actions)
    _, status, usage = os.wait4(pid, 0)
    seconds = time.perf_counter() - started
    os.close(err)
    reply = {"seconds": seconds, "maxrss": usage.ru_maxrss,
             "code": os.waitstatus_to_exitcode(status),
             "cpu": usage.ru_utime + usage.ru_stime}
    print(json.dumps(reply), flush=True)
"""


class Launcher:
    """Runs commands from a small helper process; wall time and ``os.wait4``'s ru_maxrss and
    CPU time."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        # Bytecode caching on, as in a normal install (this sandbox sets
        # PYTHONDONTWRITEBYTECODE, which would make every gen run compile shardcheck again).
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        self.env["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
        self.process = subprocess.Popen(
            [sys.executable, "-S", "-c", LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, argv: Sequence[str], cwd: Path) -> ChildRun:
        assert self.process.stdin is not None and self.process.stdout is not None
        stderr = self.scratch / "child.stderr"
        request = {"argv": list(argv), "cwd": str(cwd), "env": self.env, "stderr": str(stderr)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline())
        text = stderr.read_text(errors="replace") if stderr.exists() else ""
        return ChildRun(
            reply["seconds"], int(reply["maxrss"]), int(reply["code"]), text[-2000:], reply["cpu"]
        )

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def gen_command(model: Path, output: Path) -> list[str]:
    return [sys.executable, "-m", "shardcheck", "gen", str(model), "-o", str(output)]


def polygraphy_command(polygraphy: str, model: Path, output: Path) -> list[str]:
    return [polygraphy, "template", "shard-hints", str(model), "-o", str(output)]


def measure_processes(
    launcher: Launcher, model: BuiltModel, polygraphy: str | None, repeats: int, scratch: Path
) -> tuple[list[ChildRun], list[ChildRun] | None, Path]:
    """gen and Polygraphy as child processes, paired and alternating (A B A B ...)."""
    hints = scratch / f"{model.name}.gen.json"
    theirs = scratch / f"{model.name}.polygraphy.json"
    gen_runs: list[ChildRun] = []
    polygraphy_runs: list[ChildRun] | None = [] if polygraphy else None
    for _ in range(repeats):
        gen_runs.append(launcher.run(gen_command(model.path, hints), scratch))
        if polygraphy and polygraphy_runs is not None:
            polygraphy_runs.append(
                launcher.run(polygraphy_command(polygraphy, model.path, theirs), scratch)
            )
    return gen_runs, polygraphy_runs, hints


# --------------------------------------------------------------------------- in process


def measure_in_process(model: BuiltModel, repeats: int, env: dict[str, str]) -> InProcess:
    """``in_process`` in a fresh interpreter (this one holds the other models' leftovers)."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--in-process", str(model.path)]
        + ["--repeats", str(repeats)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise RuntimeError(f"exit {done.returncode}: {lines[-1]}")
    return InProcess(**json.loads(done.stdout.strip().splitlines()[-1]))


def in_process(path: str, repeats: int) -> InProcess:
    """onnx.load against gen's own steps after the parse, as ``shardcheck gen`` runs them."""
    from shardcheck.generation.generate import generate
    from shardcheck.generation.options import GenOptions
    from shardcheck.graph.loader import index_parsed, parse_model
    from shardcheck.hints.codec import dumps

    loads, checks, indexes, generates, checkers = [], [], [], [], []
    for _ in range(max(3, repeats)):
        gc.collect()
        started = time.perf_counter()
        parsed = onnx.load(path, load_external_data=False)
        load = time.perf_counter() - started
        del parsed
        gc.collect()
        started = time.perf_counter()
        parsed_model = parse_model(path)
        read = time.perf_counter() - started
        started = time.perf_counter()
        index = index_parsed(parsed_model)
        indexed = time.perf_counter() - started
        started = time.perf_counter()
        dumps(generate(index, GenOptions()).hints)
        generated = time.perf_counter() - started
        started = time.perf_counter()
        parsed_model.check()
        checked = time.perf_counter() - started
        del parsed_model, index
        loads.append(load)
        checks.append(max(0.0, read - load))
        indexes.append(indexed)
        generates.append(generated)
        checkers.append(checked)
    median = statistics.median
    return InProcess(
        median(loads), median(checks), median(indexes), median(generates), median(checkers)
    )


def python_floors(results: Sequence[ModelResult]) -> list[str]:
    """On the largest model with inline weights, against its onnx.load: onnx.checker alone
    (on the file's bytes, as gen's child process runs it), and one bare Python pass reading
    each node's op_type, inputs and outputs, the least any analysis in Python does (once)."""
    inline = [r for r in results if r.model.external_file is None and r.in_process is not None]
    if not inline:
        return []
    result = max(inline, key=lambda r: r.model.nodes)
    assert result.in_process is not None
    serialized = result.model.path.read_bytes()
    checks, passes = [], []
    for _ in range(3):
        started = time.perf_counter()
        onnx.checker.check_model(serialized)
        checks.append(time.perf_counter() - started)
        model = onnx.ModelProto.FromString(serialized)
        started = time.perf_counter()
        for node in model.graph.node:
            node.op_type, node.input[:], node.output[:]  # the reads are the point
        passes.append(time.perf_counter() - started)
        del model
    checker, bare = statistics.median(checks), statistics.median(passes)
    inner = result.in_process
    small, large = (dict_walk_cost(nodes) for nodes in (2_000, 32_000))
    return [
        f"onnx.checker alone (on the file's bytes, as gen's child process runs it) on "
        f"{result.model.name}: {_s(checker)}, {checker / inner.load:.1f}x onnx.load",
        f"one bare Python pass reading each node's op_type, inputs and outputs on "
        f"{result.model.name}: {_s(bare)}, {bare / inner.load:.1f}x onnx.load (the floor of any "
        "analysis in Python)",
        f"the same breadth-first walk over a synthetic producer map (tensor names as exporters "
        f"write them) costs {small * 1e6:.2f} µs/node at 2k nodes and {large * 1e6:.2f} µs/node "
        f"at 32k: {large / small:.2f}x per node for the same linear work (the working set "
        "outgrows the caches); the linearity figures include this",
    ]


def dict_walk_cost(nodes: int) -> float:
    """Seconds per node of a breadth-first walk back through a dict of producers (best of 5)."""
    names = [f"/encoder/layer.{i // 170}/attention/self/Op_{i}_output_0" for i in range(nodes)]
    rng = np.random.default_rng(0)
    back = rng.integers(1, 50, size=nodes)
    producer = {names[i]: (names[i - 1], names[max(0, i - int(back[i]))]) for i in range(1, nodes)}
    best = math.inf
    for _ in range(5):
        started = time.perf_counter()
        seen = {names[-1]}
        queue = deque([names[-1]])
        while queue:
            for name in producer.get(queue.popleft(), ()):
                if name not in seen:
                    seen.add(name)
                    queue.append(name)
        best = min(best, time.perf_counter() - started)
    return best / nodes


# --------------------------------------------------------------------------- big model


def prove_weights_unopened(launcher: Launcher, model: BuiltModel, scratch: Path) -> BigModelProof:
    """Trace gen's opens (strace, when installed) and run it with the weight file moved away."""
    assert model.external_file is not None
    weights = model.external_file
    lines: list[str] = []
    never_opened = True
    reference = scratch / f"{model.name}.reference.json"
    first = launcher.run(gen_command(model.path, reference), scratch)
    if not first.ok:
        return BigModelProof((f"gen failed: {first.stderr.strip()}",), False)

    strace = shutil.which("strace")
    if strace:
        log = scratch / "gen.strace"
        traced = launcher.run(
            [strace, "-f", "-qq", "-e", "trace=open,openat,openat2", "-o", str(log)]
            + gen_command(model.path, scratch / f"{model.name}.traced.json"),
            scratch,
        )
        opens = log.read_text(errors="replace").splitlines() if log.exists() else []
        of_weights = [line for line in opens if weights.name in line]
        of_model = [line for line in opens if model.path.name in line]
        if traced.ok and of_model:
            never_opened &= not of_weights
            lines.append(
                f"strace: gen made {len(opens)} open/openat calls, {len(of_model)} of "
                f"{model.path.name} and {len(of_weights)} of {weights.name}"
            )
        else:
            lines.append(f"strace could not trace gen (exit {traced.returncode}); not used")
    else:
        lines.append("strace is not installed (apt-get install strace); not used")

    moved = weights.with_name(weights.name + ".moved-away")
    moved_hints = scratch / f"{model.name}.moved.json"
    weights.rename(moved)
    try:
        without = launcher.run(gen_command(model.path, moved_hints), scratch)
    finally:
        moved.rename(weights)
    same = without.ok and moved_hints.read_bytes() == reference.read_bytes()
    never_opened &= same
    lines.append(
        f"{weights.name} renamed away: gen exit {without.returncode}, "
        + ("the same hints" if same else "DIFFERENT hints or failure: " + without.stderr.strip())
    )
    lines.append(verify_with_external_weights(launcher, model, reference, scratch))
    return BigModelProof(tuple(lines), never_opened)


def verify_with_external_weights(
    launcher: Launcher, model: BuiltModel, hints: Path, scratch: Path
) -> str:
    """``verify --ranks 2`` as a whole process: its time and peak memory next to the size of
    the weights, which onnxruntime maps from their file rather than getting a copy."""
    argv = [sys.executable, "-m", "shardcheck", "verify", str(model.path), str(hints)]
    run = launcher.run([*argv, "--ranks", "2"], scratch)
    outcome = "passed" if run.ok else f"exit {run.returncode}: {run.stderr.strip()[:200]}"
    return (
        f"verify --ranks 2 (whole process, the weights {model.external_bytes / 2**30:.2f} GiB): "
        f"{_s(run.seconds)}, peak {run.peak_kib / MIB:.0f} MiB, {outcome}"
    )


# --------------------------------------------------------------------------- verify, simulate


@contextlib.contextmanager
def onnxruntime_clock() -> Iterator[dict[str, Any]]:
    """Seconds spent creating onnxruntime sessions and in ``run`` while the block runs, and
    the calls themselves (``calls``: ("session", key, args, kwargs) or ("run", key, args,
    kwargs), ``key`` the session's number in the order they were made: verify's simulation
    makes several, some in the background) so that the same work can be replayed alone."""
    import onnxruntime

    spent: dict[str, Any] = {"sessions": 0.0, "runs": 0.0, "run_calls": 0, "calls": []}
    keys: dict[int, int] = {}  # id of a live session -> its number
    cls = onnxruntime.InferenceSession
    original_init, original_run = cls.__init__, cls.run

    def timed_init(self: object, *args: object, **kwargs: object) -> None:
        keys[id(self)] = key = sum(1 for call in spent["calls"] if call[0] == "session")
        spent["calls"].append(("session", key, args, kwargs))
        started = time.perf_counter()
        try:
            original_init(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            spent["sessions"] += time.perf_counter() - started

    def timed_run(self: object, *args: object, **kwargs: object) -> object:
        spent["calls"].append(("run", keys.get(id(self)), args, kwargs))
        started = time.perf_counter()
        try:
            return original_run(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            spent["runs"] += time.perf_counter() - started
            spent["run_calls"] += 1

    cls.__init__, cls.run = timed_init, timed_run  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        cls.__init__, cls.run = original_init, original_run  # type: ignore[method-assign]


def replay_onnxruntime(
    calls: Sequence[tuple[str, int | None, tuple[Any, ...], dict[str, Any]]],
) -> float:
    """Seconds to make the same sessions and the same runs again, one after the other, with
    nothing else running: what verify's onnxruntime work costs alone."""
    import onnxruntime

    started = time.perf_counter()
    sessions: dict[int | None, Any] = {}
    for kind, key, args, kwargs in calls:
        if kind == "session":
            sessions[key] = onnxruntime.InferenceSession(*args, **kwargs)
        elif key in sessions:
            sessions[key].run(*args, **kwargs)
    sessions.clear()
    return time.perf_counter() - started


def measure_verify(model: BuiltModel, hints: Path, pairs: int) -> tuple[str, float | None]:
    """Whole ``verify`` against the onnxruntime work it makes, replayed alone (``pairs``
    alternating pairs); the onnxruntime time inside verify is shown too."""
    if not module_available("shardcheck.verification.verify"):
        return NOT_AVAILABLE, None
    try:
        from shardcheck.verification.verify import verify

        verify(model.path, hints)  # warm-up: imports, file cache
        wholes, inside, alone = [], [], []
        for _ in range(max(pairs, 3)):
            with onnxruntime_clock() as spent:
                started = time.perf_counter()
                report = verify(model.path, hints)
                wholes.append(time.perf_counter() - started)
            inside.append(spent["sessions"] + spent["runs"])
            gc.collect()
            alone.append(replay_onnxruntime(spent["calls"]))
            gc.collect()
        from shardcheck.generation.options import DEFAULT_SEQ_LENS

        inference = statistics.median(
            one_inference(model, max(DEFAULT_SEQ_LENS)) for _ in range(SIMULATION_PAIRS)
        )
    except Exception as exc:  # the module is being written; show why it did not run
        return f"error: {type(exc).__name__}: {exc}"[:120], None
    whole, ort, ort_alone = (statistics.median(v) for v in (wholes, inside, alone))
    # Each verify and its replay ran back to back: the median of their ratios cancels the
    # machine's drift better than a ratio of medians.
    ratio = statistics.median(w / a for w, a in zip(wholes, alone, strict=True) if a)
    status = "" if getattr(report, "ok", True) else ", report not ok"
    return (
        f"{_s(whole)} whole, onnxruntime alone {_s(ort_alone)} = {_ratio(ratio)} "
        f"(inside verify {_s(ort)} = {_ratio(whole / ort if ort else None)}); "
        f"{_ratio(whole / inference if inference else None, 'inferences')} (2 ranks "
        f"simulated; target about 4, N + 2){status}",
        ratio,
    )


def one_inference(model: BuiltModel, seq_len: int) -> float:
    """An onnxruntime session made and run once on seeded inputs, made as shardcheck makes
    its sessions (``make_session``: its options, no graph optimizations)."""
    from shardcheck.runtime.sessions import make_session

    proto = onnx.load(str(model.path))
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    started = time.perf_counter()
    session = make_session(proto)
    for info in session.get_inputs():
        if info.name == "input_ids":
            feeds[info.name] = rng.integers(0, build_models.VOCAB, (1, seq_len), dtype=np.int64)
        else:
            feeds[info.name] = np.ones((1, seq_len), dtype=np.int64)
    session.run(None, feeds)
    return time.perf_counter() - started


def measure_simulation(
    model: BuiltModel, hints: Path, ranks: int, seq_len: int
) -> tuple[str, float | None]:
    """``simulate`` on N ranks against one inference of the model."""
    if not module_available("shardcheck.simulation.simulate"):
        return NOT_AVAILABLE, None
    try:
        from shardcheck.simulation.simulate import simulate

        wholes: list[float] = []
        inferences: list[float] = []
        while len(wholes) < SIMULATION_PAIRS and sum(wholes) + sum(inferences) < 20.0:
            inferences.append(one_inference(model, seq_len))
            started = time.perf_counter()
            result = simulate(model.path, hints, ranks=ranks, seq_len=seq_len)
            wholes.append(time.perf_counter() - started)
    except Exception as exc:  # the module is being written; show why it did not run
        return f"error: {type(exc).__name__}: {exc}"[:120], None
    # Back to back, as for verify: the median of the pairs' ratios follows the machine's drift.
    ratio = statistics.median(w / i for w, i in zip(wholes, inferences, strict=True) if i)
    whole, inference = statistics.median(wholes), statistics.median(inferences)
    status = "" if getattr(result, "ok", True) else ", MISMATCH"
    return (
        f"N={ranks}: {_s(whole)} = {_ratio(ratio, 'inferences')} of {_s(inference)} "
        f"({len(wholes)} pairs){status}",
        ratio,
    )


# --------------------------------------------------------------------------- report


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def _ratio(value: float | None, unit: str = "x") -> str:
    if value is None:
        return "-"
    return f"{value:.2f}{unit}" if unit == "x" else f"{value:.1f} {unit}"


def _median_run(runs: Sequence[ChildRun] | None) -> ChildRun | None:
    if not runs:
        return None
    failed = [run for run in runs if not run.ok]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda run: run.seconds)
    seconds = statistics.median(run.seconds for run in runs)
    peak = max(run.peak_kib for run in runs)
    return ChildRun(seconds, peak, 0, ordered[0].stderr)


def _process_cells(runs: Sequence[ChildRun] | None, absent: str) -> tuple[str, str]:
    run = _median_run(runs)
    if run is None:
        return absent, absent
    if not run.ok:
        return f"failed (exit {run.returncode})", "-"
    return f"{run.seconds:.2f}", f"{run.peak_kib / MIB:.0f}"


def speedup(result: ModelResult) -> float | None:
    """Polygraphy's median time over gen's."""
    ours, theirs = _median_run(result.gen), _median_run(result.polygraphy)
    if ours is None or theirs is None or not ours.ok or not theirs.ok:
        return None
    return theirs.seconds / ours.seconds


def pair_speedups(result: ModelResult) -> list[float]:
    """Polygraphy / gen for each pair of runs, in run order (both ran back to back)."""
    pairs = zip(result.gen, result.polygraphy or [], strict=False)
    return [p.seconds / g.seconds for g, p in pairs if g.ok and p.ok and g.seconds]


def paired_speedup(result: ModelResult) -> float | None:
    """The median of the pairs' ratios: each pair shares the machine's state of its moment,
    so drift between pairs cancels (as for verify and the simulation)."""
    ratios = pair_speedups(result)
    return statistics.median(ratios) if ratios else None


TABLE_HEADER = (
    "| model | nodes | onnx.load ms | gen analysis ms (checks + index + generate; "
    "onnx.checker and the walk over the nodes beside them) "
    "| analysis / load | gen s | gen peak MiB | Polygraphy s | Polygraphy peak MiB "
    "| Polygraphy / gen (median of pairs) | verify: whole vs its onnxruntime work "
    "| simulation vs 1 inference |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
)


def table_row(result: ModelResult, polygraphy_absent: str) -> str:
    model = result.model
    name = model.name
    if model.external_file is not None:
        name += f" ({model.external_bytes / 2**30:.2f} GiB external)"
    inner = result.in_process
    if inner is None:
        load = analysis = ratio = "-"
    else:
        load = _ms(inner.load)
        analysis = (
            f"{_ms(inner.analysis)} ({_ms(inner.checks)} + {_ms(inner.index)} + "
            f"{_ms(inner.generate)}; {_ms(inner.checker)})"
        )
        ratio = _ratio(inner.analysis / inner.load if inner.load else None)
    gen_s, gen_mib = _process_cells(result.gen, "-")
    poly_s, poly_mib = _process_cells(result.polygraphy, polygraphy_absent)
    cells = [
        name,
        str(model.nodes),
        load,
        analysis,
        ratio,
        gen_s,
        gen_mib,
        poly_s,
        poly_mib,
        _ratio(paired_speedup(result)),
        result.verify,
        result.simulate,
    ]
    return "| " + " | ".join(cells) + " |"


def pair_ratios(results: Sequence[ModelResult]) -> list[str]:
    """Polygraphy / gen for each pair of runs (in run order) of the deepest models: how far
    the machine's noise moves the ratio the speed target is judged on."""
    deepest = max((r.model.depth for r in results), default=0)
    lines = []
    for result in results:
        ratios = pair_speedups(result) if result.model.depth == deepest else []
        if ratios:
            shown = ", ".join(f"{ratio:.2f}x" for ratio in ratios)
            lines.append(f"- {result.model.name}: Polygraphy / gen pair by pair: {shown}")
    return lines


@dataclass(frozen=True)
class LinearityPairs:
    """The analysis per node of a kind's shallowest and deepest models, measured alternately
    in fresh interpreters (shallow, deep, shallow, deep, ...): one ratio per pair."""

    kind: str
    low: BuiltModel
    high: BuiltModel
    per_node: tuple[tuple[float, float], ...]  # (shallow, deep) seconds per node, per pair


def measure_linearity(
    models: Sequence[BuiltModel], kinds: Sequence[str], pairs: int, env: dict[str, str]
) -> list[LinearityPairs]:
    """Each model's analysis is also timed on its own (the table), but minutes apart from the
    other depths, and the machine drifts in between; pairs taken back to back cancel that."""
    found = []
    for kind in kinds:
        rows = sorted((m for m in models if m.kind == kind), key=lambda m: m.depth)
        if len(rows) < 2:
            continue
        low, high = rows[0], rows[-1]
        per_node = []
        for _ in range(pairs):
            shallow = measure_in_process(low, 3, env).analysis / low.nodes
            deep = measure_in_process(high, 3, env).analysis / high.nodes
            per_node.append((shallow, deep))
        found.append(LinearityPairs(kind, low, high, tuple(per_node)))
    return found


def linearity(measured: Sequence[LinearityPairs]) -> list[tuple[str, float, str]]:
    """Per kind: analysis time per node at the deepest vs the shallowest model, the median of
    the pairs' ratios."""
    found = []
    for pairs in measured:
        ratios = [deep / shallow for shallow, deep in pairs.per_node if shallow]
        if not ratios:
            continue
        ratio = statistics.median(ratios)
        per_low = statistics.median(shallow for shallow, _ in pairs.per_node)
        per_high = statistics.median(deep for _, deep in pairs.per_node)
        found.append(
            (
                pairs.kind,
                ratio,
                f"{pairs.kind}: {per_low * 1e6:.1f} µs/node at {pairs.low.depth} layers, "
                f"{per_high * 1e6:.1f} µs/node at {pairs.high.depth} layers (medians of "
                f"{len(ratios)} alternating pair{'s' if len(ratios) != 1 else ''}; pair by pair "
                f"{', '.join(f'{r:.2f}x' for r in ratios)}): {ratio:.2f}x",
            )
        )
    return found


def targets(
    results: Sequence[ModelResult],
    lines: Sequence[tuple[str, float, str]],
    proofs: dict[str, BigModelProof],
) -> list[str]:
    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "NOT met")

    deepest = [r for r in results if r.model.kind in build_models.KINDS]
    out = []
    largest = max(deepest, key=lambda r: r.model.nodes, default=None)
    for result in [r for r in deepest if largest and r.model.depth == largest.model.depth]:
        value = paired_speedup(result)
        out.append(
            f"target 1 (speed): gen {_ratio(value)} faster than Polygraphy on {result.model.name} "
            f"({result.model.nodes} nodes), whole process, the median of "
            f"{len(pair_speedups(result))} paired runs' ratios (ratio of the median times: "
            f"{_ratio(speedup(result))}); target >= {SPEEDUP_TARGET:g}x: "
            f"{verdict(None if value is None else value >= SPEEDUP_TARGET)}"
        )
    for result in [r for r in deepest if largest and r.model.depth == largest.model.depth]:
        inner = result.in_process
        value = inner.analysis / inner.load if inner and inner.load else None
        out.append(
            f"target 2 (analysis): gen's analysis after the parse on {result.model.name}: "
            f"{_ratio(value)} onnx.load; target <= {ANALYSIS_TARGET:g}x: "
            f"{verdict(None if value is None else value <= ANALYSIS_TARGET)}"
        )
    for _kind, ratio, text in lines:
        out.append(
            f"target 2 (linearity): {text}; target <= {LINEARITY_TARGET:g}x: "
            f"{verdict(ratio <= LINEARITY_TARGET)}"
        )
    for external in [r for r in results if r.model.external_file is not None]:
        run = _median_run(external.gen)
        peak = run.peak_kib / MIB if run and run.ok else None
        proof = proofs.get(external.model.name)
        label = "memory" if external.model.kind == "big" else "memory, same on a deep model"
        out.append(
            f"target 3 ({label}): gen's peak memory on {external.model.name} "
            f"({external.model.nodes} nodes, "
            f"{external.model.external_bytes / 2**30:.2f} GiB external): "
            + (f"{peak:.0f} MiB" if peak is not None else "failed")
            + f"; target < {BIG_MEMORY_TARGET_MIB:g} MiB: "
            f"{verdict(None if peak is None else peak < BIG_MEMORY_TARGET_MIB)}; weight file "
            f"never opened: {verdict(proof.never_opened if proof else None)}"
        )
    verify_ratios = [r.verify_ratio for r in results if r.verify_ratio is not None]
    out.append(
        "target 4 (verify): whole verify vs the onnxruntime work it makes, replayed alone: "
        + (
            f"{min(verify_ratios):.2f}x to {max(verify_ratios):.2f}x; target <= "
            f"{VERIFY_TARGET:g}x: {verdict(max(verify_ratios) <= VERIFY_TARGET)}"
            if verify_ratios
            else "n/a (" + next((r.verify for r in results if r.verify != "-"), "not run") + ")"
        )
    )
    by_ranks: dict[int, list[float]] = {}
    for result in results:
        for ranks, ratio in result.simulate_ratios.items():
            by_ranks.setdefault(ranks, []).append(ratio)
    for ranks, ratios in sorted(by_ranks.items()):
        out.append(
            f"target 4 (simulation): simulation of {ranks} ranks vs one inference: "
            f"{min(ratios):.1f} to {max(ratios):.1f} inferences; target: about {ranks + 1} "
            f"(N+1): {verdict(max(ratios) <= ranks + 1)}"
        )
    if not by_ranks:
        out.append(
            "target 4 (simulation): n/a ("
            + next((r.simulate for r in results if r.simulate != "-"), "not run")
            + ")"
        )
    return out


def render(
    env: dict[str, str],
    results: Sequence[ModelResult],
    polygraphy: str | None,
    proofs: dict[str, BigModelProof],
    settings: str,
    floors: Sequence[str] = (),
    linearity_pairs: Sequence[LinearityPairs] = (),
) -> str:
    absent = "polygraphy not installed" if polygraphy is None else "-"
    rows = [table_row(result, absent) for result in results]
    lines = linearity(linearity_pairs)
    notes = [
        f"- Taken {env['date']} on {env['machine']}; Python {env['python']}; "
        f"{env['packages']}; shardcheck at {env['shardcheck']}.",
        f"- {settings}",
        "- gen and Polygraphy: whole processes, paired and alternating, median wall time; the "
        "speed-up is the median of the pairs' ratios (the ratio of the median times is given "
        "beside it in the targets); peak memory is the child's ru_maxrss. Polygraphy's log went "
        "to /dev/null.",
        "- analysis = what gen does after the parse: parse_model's checks (parse_model minus "
        "onnx.load), GraphIndex, generate (default options) and the hints' serialization. "
        "onnx.checker, and the walk over the nodes for duplicate names and external tensors in "
        "attributes, run in a child process beside them (on the second core), so they are "
        "shown apart, after the semicolon.",
    ]
    notes += [f"- linearity: {text}" for _kind, _ratio_value, text in lines]
    notes += pair_ratios(results)
    for name, proof in proofs.items():
        notes += [f"- {name}: {line}" for line in proof.lines]
    errors = [f"- {r.model.name}: {r.error}" for r in results if r.error]
    for result in results:
        for label, runs in (("gen", result.gen), ("Polygraphy", result.polygraphy or [])):
            failed = next((run for run in runs if not run.ok), None)
            if failed is not None:
                last = (failed.stderr.strip().splitlines() or ["no output"])[-1]
                errors.append(
                    f"- {result.model.name}: {label} failed (exit {failed.returncode}): {last}"
                )
    notes.extend(f"- {line}" for line in floors)
    target_lines = targets(results, lines, proofs)
    return "\n".join(
        [
            "# shardcheck benchmark",
            "",
            "Re-run with `python benchmarks/run.py` (models are cached in "
            "`/tmp/shardcheck-bench`; see `benchmarks/build_models.py`).",
            "",
            TABLE_HEADER,
            *rows,
            "",
            *notes,
            *errors,
            "",
            "Targets of the performance issue:",
            "",
            *[f"- {line}" for line in target_lines],
            "",
        ]
    )


# --------------------------------------------------------------------------- main


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _section(label: str, action: Callable[[], None], result: ModelResult) -> None:
    started = time.perf_counter()
    try:
        action()
    except Exception as exc:  # keep the other figures of the run
        result.error = f"{label} failed: {type(exc).__name__}: {exc}"
    _log(f"  {label}: {time.perf_counter() - started:.1f} s")


def benchmark_model(
    launcher: Launcher,
    model: BuiltModel,
    args: argparse.Namespace,
    polygraphy: str | None,
    scratch: Path,
) -> ModelResult:
    result = ModelResult(model)
    _log(f"{model.name} ({model.nodes} nodes)")

    def run_in_process() -> None:
        result.in_process = measure_in_process(model, args.repeats, launcher.env)

    # The targets are judged on the deepest models, where the machine's noise matters most.
    pairs = args.deep_repeats if model.depth == max(args.depths) else args.repeats

    def processes() -> None:
        result.gen, result.polygraphy, result.hints = measure_processes(
            launcher, model, None if args.no_polygraphy else polygraphy, pairs, scratch
        )

    _section("in process", run_in_process, result)
    _section("gen vs Polygraphy", processes, result)
    runs_verify = model.kind in args.verify_kinds and result.hints and result.hints.exists()
    if runs_verify and result.hints is not None:
        hints = result.hints

        def run_verify() -> None:
            result.verify, result.verify_ratio = measure_verify(model, hints, args.verify_pairs)

        def run_simulation() -> None:
            cells = []
            for ranks in args.ranks:
                cell, ratio = measure_simulation(model, hints, ranks, args.seq_len)
                cells.append(cell)
                if ratio is not None:
                    result.simulate_ratios[ranks] = ratio
            result.simulate = "; ".join(cells)

        _section("verify", run_verify, result)
        _section("simulation", run_simulation, result)
    return result


def warm_up(launcher: Launcher, model: BuiltModel, polygraphy: str | None, scratch: Path) -> int:
    """One untimed run of each command (bytecode, page cache); the peak memory floor."""
    launcher.run(gen_command(model.path, scratch / "warm-up.json"), scratch)
    if polygraphy:
        launcher.run(polygraphy_command(polygraphy, model.path, scratch / "warm-up.json"), scratch)
    return launcher.run(["true"], scratch).peak_kib


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="shardcheck's performance benchmark")
    parser.add_argument("--out", type=Path, default=build_models.DEFAULT_OUT)
    parser.add_argument("--depths", type=build_models._int_list, default=None)
    parser.add_argument("--kinds", default=",".join(build_models.KINDS))
    parser.add_argument("--repeats", type=int, default=3, help="process pairs per model")
    parser.add_argument(
        "--deep-repeats", type=int, default=9, help="process pairs per model of the deepest depth"
    )
    parser.add_argument("--big-gb", type=float, default=1.0, help="GiB of external weights")
    parser.add_argument("--no-big", action="store_true")
    parser.add_argument("--no-polygraphy", action="store_true")
    parser.add_argument("--verify-kinds", default="export", help="kinds verify/simulate run on")
    parser.add_argument(
        "--verify-pairs", type=int, default=9, help="verify/replay pairs per model (noise)"
    )
    parser.add_argument(
        "--linearity-pairs",
        type=int,
        default=9,
        help="alternating shallow/deep in-process pairs per kind (noise)",
    )
    parser.add_argument(
        "--ranks", type=build_models._int_list, default=[2, 4], help="ranks to simulate, e.g. 2,4"
    )
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--no-write", action="store_true", help="do not write RESULTS.md")
    parser.add_argument("--quick", action="store_true", help="depths 12,48; 1 repeat; no big")
    parser.add_argument(
        "--zoo", type=int, default=200, help="models for check --jobs 2 vs 1 (0: skip)"
    )
    parser.add_argument(
        "--scale-gb",
        type=float,
        default=2.1,
        help="GiB of external weights for verify's peak memory, with the 100k-node depth "
        "figures (scale.py; 0: skip)",
    )
    parser.add_argument("--in-process", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.depths = args.depths or [12, 48]
        args.repeats = args.deep_repeats = 1
        args.linearity_pairs = 1
        args.no_big = True
        args.zoo = min(args.zoo, 20)
        args.scale_gb = 0
    args.depths = args.depths or list(build_models.DEFAULT_DEPTHS)
    args.kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    args.verify_kinds = {kind.strip() for kind in args.verify_kinds.split(",") if kind.strip()}
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.in_process:  # the child of measure_in_process
        print(json.dumps(dataclasses.asdict(in_process(args.in_process, args.repeats))))
        return 0
    polygraphy = find_polygraphy()
    if polygraphy is None:
        _log("polygraphy not installed (pip install '.[test]'); its columns stay empty")
    models = build_models.ensure_models(
        args.out, args.depths, args.kinds, None if args.no_big else args.big_gb
    )
    env = environment()
    fingerprint = source_fingerprint()
    results: list[ModelResult] = []
    proofs: dict[str, BigModelProof] = {}
    linearity_pairs: list[LinearityPairs] = []
    with tempfile.TemporaryDirectory(prefix="shardcheck-bench-") as directory:
        scratch = Path(directory)
        launcher = Launcher(scratch)
        try:
            floor = warm_up(launcher, models[0], polygraphy, scratch)
            for model in models:
                results.append(benchmark_model(launcher, model, args, polygraphy, scratch))
                if model.external_file is not None:
                    _log("  proving the weight file is never opened")
                    proofs[model.name] = prove_weights_unopened(launcher, model, scratch)
            _log(f"linearity: {args.linearity_pairs} alternating pairs per kind")
            try:
                linearity_pairs = measure_linearity(
                    models, args.kinds, args.linearity_pairs, launcher.env
                )
            except Exception as exc:  # keep the other figures of the run
                _log(f"linearity failed: {type(exc).__name__}: {exc}")
        finally:
            launcher.close()
    settings = (
        f"{args.repeats} process pairs per model ({args.deep_repeats} at {max(args.depths)} "
        "layers), after one untimed run of each command (the "
        f"children run with bytecode caching on, as in a normal install); the launcher's own "
        f"ru_maxrss floor is {floor / MIB:.0f} MiB. verify and simulation "
        f"({'/'.join(map(str, args.ranks))} ranks, "
        f"sequence length {args.seq_len}) on the {', '.join(sorted(args.verify_kinds))} models."
    )
    if source_fingerprint() != fingerprint:
        settings += (
            " WARNING: shardcheck's sources changed during this run; the figures mix versions."
        )
        _log("warning: shardcheck's sources changed during the run; re-run for clean figures")
    text = render(
        env, results, polygraphy, proofs, settings, python_floors(results), linearity_pairs
    )
    if args.zoo:
        _log(f"check --verify --jobs 2 vs --jobs 1 on {args.zoo} models")
        text += f"\n## check --jobs\n\n{check_jobs.measure(args.zoo, pairs=1).line()}\n"
    if args.scale_gb:
        _log(f"scale: verify's peak memory on {args.scale_gb} GiB of external weights")
        memory = scale.measure_memory(scale.DEFAULT_OUT, args.scale_gb, delete=True).line()
        _log("scale: time per node at 161, 8040 and 100362 nodes")
        depth = scale.measure_depth(scale.DEFAULT_OUT, rounds=args.repeats).lines()
        text += "\n## Scale\n\n" + "\n".join(f"- {line}" for line in [memory, *depth]) + "\n"
    print(text)
    if not args.no_write:
        args.results.write_text(text)
        _log(f"written to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
