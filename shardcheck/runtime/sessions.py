"""The one adapter to onnxruntime: making CPU sessions, running them, reading their errors.

onnxruntime is imported inside the functions that need it, never at import time: ``gen``
imports this package's neighbours but must not pay for (or need) onnxruntime.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from shardcheck.runtime.weights import shared_initializers

if TYPE_CHECKING:
    import onnxruntime

# How long a run may take before ``run_session`` says it is still running.
SLOW_RUN_SECONDS = 1.0
_NODE_NAME = re.compile(r"Name:'([^']*)'")
_STATUS = re.compile(r"Status Message: (.*)$")
# onnxruntime prefixes its messages with a source location and a C++ signature.
_SOURCE_PREFIX = re.compile(r"^\S+\.(?:h|cc|cpp):\d+ (?:[^()]*\([^()]*\) )?")


class RunTimedOut(Exception):
    """onnxruntime stopped a run because its ``timeout`` was up."""


_made_a_session = False  # whether this process has made an onnxruntime session


def made_a_session() -> bool:
    """Whether this process has made an onnxruntime session: it may then hold onnxruntime's
    state (its environment, its locks), which a forked child would inherit half-made."""
    return _made_a_session


def make_session(
    model: onnx.ModelProto | bytes,
    weights_dir: str | os.PathLike[str] | None = None,
    *,
    initializers: Iterable[onnx.TensorProto] = (),
    source: str = "<model>",
) -> onnxruntime.InferenceSession:
    """An onnxruntime CPU session, sequential, one intra-op thread (repeatable and light);
    ``model`` is a proto or its serialized bytes.

    The graph runs as written: no graph optimizations. The runs are few and short (small
    sequence lengths), while optimizing a large graph is most of what making its session
    costs. Nor is memory kept in an arena for reuse: with few runs it would only hold on to
    each run's largest allocations, raising the peak.

    Nodes run in onnxruntime's priority-based order, which follows the graph: its default
    order can run every node that reads only weights (a Linear's Transpose) first, so that all
    their outputs, as large as the weights, are alive at once.

    ``weights_dir``: the directory of the model file, where its external weight files are.
    The external initializers (``model``'s own, or ``initializers`` when ``model`` is bytes)
    are handed to onnxruntime over the one mapping of their file that every session of the
    process shares (weights.py); any it cannot take so it reads from there itself. The weights
    so lent are not prepacked: a packed copy of each MatMul weight, beside the lent one that
    onnxruntime cannot free, would double the memory they take (for runs too few and short to
    gain from it). Prepacking stays on otherwise: without it onnxruntime makes the sessions of
    deep graphs slower, more than in proportion to their nodes (docs/performance.md). Either
    way no copy of every weight goes inside ``model``: a model over 2 GB could not be
    serialized with its weights in it, and the copy would double the memory the weights take.
    ``source`` names the model in the error raised for a weight file cut short (InputError).
    """
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 4
    options.enable_cpu_mem_arena = False
    options.execution_order = onnxruntime.ExecutionOrder.PRIORITY_BASED
    shared: dict[str, Any] = {}
    if weights_dir is not None:
        folder = Path(weights_dir).resolve()
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(folder)
        )
        tensors = initializers if isinstance(model, bytes) else model.graph.initializer
        shared = shared_initializers(tensors, folder, source)
        for name, value in shared.items():
            options.add_initializer(name, value)
        if shared:  # onnxruntime cannot free weights it was lent once it has packed them
            options.add_session_config_entry("session.disable_prepacking", "1")
    serialized = model if isinstance(model, bytes) else model.SerializeToString()
    global _made_a_session
    _made_a_session = True
    session = onnxruntime.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
    # onnxruntime reads the shared weights where they are: they live as long as the session.
    session.shardcheck_weights = shared  # type: ignore[attr-defined]
    return session


def run_model(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    outputs: Sequence[str] | None = None,
    weights_dir: str | os.PathLike[str] | None = None,
) -> dict[str, np.ndarray]:
    """Run ``model`` once on the CPU; ``outputs`` are graph output names (default: all);
    ``weights_dir`` as for ``make_session``."""
    session = make_session(model, weights_dir)
    names = list(outputs) if outputs is not None else [o.name for o in session.get_outputs()]
    values = session.run(names, dict(feeds))
    return dict(zip(names, values, strict=True))


def run_session(
    session: Any,
    outputs: list[str],
    feeds: dict[str, np.ndarray],
    *,
    timeout: float | None = None,
    on_slow: Callable[[], None] | None = None,
) -> list[np.ndarray]:
    """One run of ``session``. After ``timeout`` seconds onnxruntime is told to stop, and the
    run raises RunTimedOut; ``on_slow`` is called once the run has taken SLOW_RUN_SECONDS.
    onnxruntime's own errors are raised as they come."""
    import onnxruntime

    run_options = onnxruntime.RunOptions()
    timers: list[threading.Timer] = []
    if on_slow is not None:
        timers.append(threading.Timer(SLOW_RUN_SECONDS, on_slow))
    if timeout is not None:
        timers.append(threading.Timer(timeout, lambda: setattr(run_options, "terminate", True)))
    for timer in timers:
        timer.daemon = True
        timer.start()
    try:
        return session.run(outputs, feeds, run_options)
    except Exception:  # onnxruntime raises its own exception types
        if run_options.terminate:
            raise RunTimedOut() from None
        raise
    finally:
        for timer in timers:
            timer.cancel()


def onnxruntime_errors() -> tuple[type[BaseException], ...]:
    """The exception types onnxruntime raises for a model it cannot load or run."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    names = ("Fail", "InvalidArgument", "RuntimeException", "InvalidGraph", "NotImplemented")
    return tuple(getattr(state, name) for name in names if hasattr(state, name))


def failed_node(message: str) -> str | None:
    """The name of the node an onnxruntime error message blames (empty for an unnamed node),
    or None when it names none."""
    match = _NODE_NAME.search(message)
    return match.group(1) if match else None


def error_text(message: str, *, status_only: bool = False, limit: int | None = None) -> str:
    """An onnxruntime error message on one line. ``status_only``: only its status message,
    without the source location and C++ signature before it; ``limit``: at most that many
    characters, the end cut off and marked "..."."""
    text = " ".join(message.split())
    if status_only:
        status = _STATUS.search(text)
        text = _SOURCE_PREFIX.sub("", status.group(1) if status else text)
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return text
