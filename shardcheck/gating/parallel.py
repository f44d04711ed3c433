"""``check --jobs N``: the manifest's models spread over N processes, results in manifest order.

Each model is checked in a worker process (``check_isolated``, as in a serial run), so one
model's onnxruntime threads and memory end with its worker's task. Goldens are distinct per
model (the manifest refuses two models sharing one) and written atomically, so workers never
write one file. Memory: a model whose verify is to run is started only when its estimate
(``runtime/memory.py``'s, at its longest length), with those of the models running, fits in
what was available at the start; one that does not fit even alone runs alone, where verify
refuses it if it must. Nothing is oversubscribed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

from shardcheck.gating.gate import ModelResult, check_isolated
from shardcheck.gating.manifest import ModelEntry
from shardcheck.generation.options import DEFAULT_SEQ_LENS

# prctl's option that asks for a signal when the parent dies (linux/prctl.h).
_PR_SET_PDEATHSIG = 1
# A worker's parent when it started (_follow_parent), and whether it runs a task.
_parent = 0
_in_task = False


def default_jobs() -> int:
    """The CPUs this process may run on (its affinity, which a container or taskset sets)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def check_models(
    entries: Sequence[ModelEntry], *, update: bool, verify: bool, jobs: int
) -> Iterator[ModelResult]:
    """The result of each entry, in the order of ``entries``, checked by ``jobs`` processes."""
    jobs = max(1, min(jobs, len(entries)))
    if jobs == 1:
        for entry in entries:
            yield check_isolated(entry, update=update, verify=verify)
        return
    needs = [memory_need(entry) if verify and entry.verify else 0 for entry in entries]
    from shardcheck.runtime.memory import available_bytes

    budget = available_bytes()
    context = _context()
    done: dict[int, ModelResult] = {}
    running: dict[Future[ModelResult], int] = {}
    submitted = shown = 0
    with ProcessPoolExecutor(
        max_workers=jobs, mp_context=context, initializer=_follow_parent
    ) as pool:
        while shown < len(entries):
            while submitted < len(entries) and len(running) < jobs:
                in_use = sum(needs[i] for i in running.values())
                fits = budget is None or in_use + needs[submitted] <= budget
                if running and not fits:
                    break  # wait for memory: the model runs once enough is free, or alone
                future = pool.submit(_check_in_worker, entries[submitted], update, verify)
                running[future] = submitted
                submitted += 1
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                position = running.pop(future)
                done[position] = _result(future, entries[position])
            while shown in done:
                yield done.pop(shown)
                shown += 1


def _follow_parent() -> None:
    """A worker's start: it ends when the process that started it does, SIGKILL included
    (the command's, or forkserver's, which ends with the command). A pool's workers wait for
    tasks on a pipe whose write end they hold too, so a parent's death alone never wakes them:
    they would wait forever. On Linux the kernel sends the worker SIGTERM then
    (``PR_SET_PDEATHSIG``)."""
    global _parent
    signal.signal(signal.SIGTERM, _on_sigterm)
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    _parent = os.getppid()
    if _parent == 1:  # the parent died before the request took effect: init adopted it
        os._exit(128 + signal.SIGTERM)


def _on_sigterm(signum: int, _frame: object) -> None:
    """A worker's SIGTERM. In a task, the command's interrupt, so that what the task was
    writing is removed on its way out (the atomic writer's temporary file); the task's end
    then exits. Between tasks, the exit at once: the pool would catch an interrupt where it
    sends a result back, and wait for the next task."""
    if _in_task:
        from shardcheck.cli.stops import Signalled

        raise Signalled(signum)
    os._exit(128 + signum)


def _check_in_worker(entry: ModelEntry, update: bool, verify: bool) -> ModelResult:
    """``check_isolated`` in a worker, which ends after the task if its parent has died."""
    global _in_task
    _in_task = True
    try:
        return check_isolated(entry, update=update, verify=verify)
    finally:
        _in_task = False
        if os.getppid() != _parent:
            os._exit(128 + signal.SIGTERM)


def _context() -> multiprocessing.context.BaseContext:
    """``fork``: the workers start at once, with shardcheck, onnx and onnxruntime imported.
    The command makes no onnxruntime session before the pool starts (it checks no model
    itself), so its only other threads are those made at import, idle in a wait (numpy's
    OpenBLAS pool, which re-forms itself in a child): none holds a lock a child could need. A
    caller with Python threads of its own gets ``forkserver``, whose workers start clean
    (slower: each imports what it needs); without fork, ``spawn``."""
    if not hasattr(os, "fork"):  # pragma: no cover - not POSIX
        return multiprocessing.get_context("spawn")
    return multiprocessing.get_context("fork" if threading.active_count() == 1 else "forkserver")


def _result(future: Future[ModelResult], entry: ModelEntry) -> ModelResult:
    try:
        return future.result()
    except Exception as exc:  # the worker died (killed, out of memory): that model fails
        return ModelResult(
            entry, error=f"the worker process checking it failed: {type(exc).__name__}: {exc}"
        )


def memory_need(entry: ModelEntry) -> int:
    """The memory ``entry``'s verify needs at least: ``runtime/memory.py``'s estimate at its
    longest sequence length, every non-batch dim of the inputs set to it (0 if the model
    cannot be read: its check reports that)."""
    from shardcheck.analysis.symbolic import BATCH_LIKE
    from shardcheck.errors import ShardcheckError
    from shardcheck.graph.loader import load_index
    from shardcheck.runtime.memory import estimate
    from shardcheck.runtime.sizes import default_dim, graph_input_dims

    longest = max(entry.seq_lens or DEFAULT_SEQ_LENS)
    try:
        index = load_index(entry.model_path)
        dims = {
            name: default_dim(name) if BATCH_LIKE.search(name) else longest
            for name in graph_input_dims(index)
        }
        return estimate(index, dims).total
    except (ShardcheckError, OSError, ValueError):
        return 0
