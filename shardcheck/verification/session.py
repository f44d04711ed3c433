"""verify's onnxruntime session: the model with the watched tensors as outputs, made in the
background, and its runs (each with its timeout), on runtime/sessions.py."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from shardcheck.errors import InputError
from shardcheck.graph.index import GraphIndex
from shardcheck.graph.loader import check_weight_files, weights_dir
from shardcheck.runtime.background import InBackground
from shardcheck.runtime.sessions import RunTimedOut, error_text, make_session, run_session
from shardcheck.runtime.supervised import watched_run

Progress = Callable[[str], None]
# onnxruntime's messages can run to a dump of the graph; a finding quotes the start.
MESSAGE_LIMIT = 300


class PendingSession:
    """The onnxruntime session of the runs, made in the background from the start.

    Making the session (loading the model, making its kernels) is most of verify's onnxruntime
    time, and onnxruntime releases the GIL while it does it: the analysis (shape inference,
    detection, the static checks) runs meanwhile. The model with the watched tensors as outputs
    is serialized here, in the caller's thread, since that reads the index's model.
    """

    def __init__(
        self,
        index: GraphIndex,
        model_path: Path,
        watched: dict[str, str],
        serialized: bytes | None = None,
    ) -> None:
        self.watched = watched
        extra = [name for name in watched if name not in index.graph_inputs]
        check_weight_files(index, model_path)
        model = serialized_with_outputs(index, extra, serialized)
        self._making = InBackground(
            "shardcheck-session",
            load_session,
            model,
            weights_dir(model_path),
            index.source,
            list(index.initializers.values()),
        )

    def settle(self) -> None:
        """Wait until onnxruntime has made the session, or failed to (its error is not
        raised here)."""
        self._making.wait()

    def session(self, progress: Progress | None = None) -> WatchedSession:
        """The session, once made; ``progress`` hears when that takes more than a second."""
        if progress is not None and not self._making.wait(1.0):
            progress("onnxruntime is still loading the model...")
        return self._making.result()


class WatchedSession:
    """A session whose outputs are the watched tensors; ``last``: the outputs of the last run
    that succeeded, and their values."""

    def __init__(self, session: Any, source: str) -> None:
        self._session = session
        self.source = source  # the model file, for messages
        self.outputs = [o.name for o in session.get_outputs()]
        self.last: tuple[list[str], list[np.ndarray]] = ([], [])

    def run(
        self,
        feeds: dict[str, np.ndarray],
        timeout: float | None,
        progress: Progress | None,
        length: int,
    ) -> str | None:
        """Run once at sequence length ``length``; onnxruntime's error message on failure.
        Past ``timeout`` the run is cancelled and refused (InputError)."""
        on_slow = (
            None
            if progress is None
            else functools.partial(progress, f"running onnxruntime at sequence length {length}...")
        )
        try:
            with watched_run(f"sequence length {length}"):
                values = run_session(
                    self._session, self.outputs, feeds, timeout=timeout, on_slow=on_slow
                )
        except RunTimedOut:
            raise InputError(
                f"{self.source}: onnxruntime did not finish within --timeout {timeout} s "
                f"(sequence length {length}); give it more time or use shorter --seq-lens"
            ) from None
        except Exception as exc:  # onnxruntime raises its own exception types
            return error_text(str(exc))
        self.last = (self.outputs, values)
        return None


def load_session(
    model: bytes, weights_dir: Path, source: str, initializers: Iterable[onnx.TensorProto] = ()
) -> WatchedSession:
    """onnxruntime's session of ``model`` (serialized, with the watched outputs), sharing its
    external ``initializers`` (``make_session``); a model it cannot load is refused
    (InputError)."""
    try:
        session = make_session(model, weights_dir, initializers=initializers, source=source)
    except InputError:
        raise
    except Exception as exc:  # onnxruntime raises its own exception types
        raise InputError(
            f"{source}: onnxruntime cannot load the model: "
            f"{error_text(str(exc), limit=MESSAGE_LIMIT)}"
        ) from None
    return WatchedSession(session, source)


def serialized_with_outputs(
    index: GraphIndex, extra: Iterable[str], serialized: bytes | None = None
) -> bytes:
    """The serialized model with ``extra`` tensors as outputs too; external weights stay in
    their files (onnxruntime reads them there).

    ``serialized``: the model file's own bytes, when it is a protobuf whose weights are all
    inside it. Then nothing is serialized: protobuf merges a message read after another into
    it, appending to repeated fields, so the file's bytes followed by a ModelProto holding only
    the new graph outputs read as the model with those outputs added.
    """
    present = {o.name for o in index.model.graph.output}
    added = []
    for name in extra:
        if name not in present and name not in index.initializers:
            added.append(onnx.ValueInfoProto(name=name))
            present.add(name)
    if serialized is not None:
        return serialized + onnx.ModelProto(graph=onnx.GraphProto(output=added)).SerializeToString()
    # The index's own model is lent: it gets the outputs for the time of the serialization.
    outputs = index.model.graph.output
    declared = len(outputs)
    try:
        outputs.extend(added)
        return index.model.SerializeToString()
    finally:
        del outputs[declared:]
