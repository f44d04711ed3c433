"""The stages' onnxruntime sessions: made ahead of the runs by background workers, shared by
the stages of a form, or made by the run that needs one.

A stage's session is made for the element types of its inputs. Workers make the sessions side
by side before the runs ask for them, for the types inferred from the graph (elem_types.py)
instead of read from the values of the stages before; a stage with an input of unknown type is
left to the runs, which make its session when they reach it, as they do when the values they
have are not of the types a session was made for.

Stages of one form (stage_forms.py: a transformer's layers) run on one session, made from the
first of them (their leader) with the weights they read as inputs; the runs feed each stage's
own weights: a model of L layers makes a few stage sessions instead of about 3L.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from shardcheck.analysis.elem_types import infer_elem_types
from shardcheck.runtime.background import InBackground
from shardcheck.runtime.sessions import make_session, onnxruntime_errors
from shardcheck.runtime.supervised import watched_run
from shardcheck.runtime.weights import external_weight
from shardcheck.sharding.rewrite import COLLECTIVE_OP
from shardcheck.simulation.plan import Stage, stage_model
from shardcheck.simulation.stage_forms import stage_form

# Workers that make stage sessions ahead (onnxruntime makes them without the GIL).
AHEAD_WORKERS = 2


@dataclass
class AheadSession:
    """A stage's session made ahead of the runs by a worker, for inputs of ``types`` (in the
    order of the stage's inputs); one for all the stages of a form."""

    types: tuple[int, ...]
    state: str = "pending"  # -> "making" (a worker took it) or "skipped" (left to the runs)
    done: threading.Event = field(default_factory=threading.Event)
    session: Any = None


class StageSessions:
    """The sessions of ``stages``, kept in each stage (``Stage.sessions``, ``Stage.ahead``).

    ``template`` is the single-device model: the stages take their opsets and functions from
    it, and their initializers from its ``weights`` (by name); ``weights_dir`` is where its
    external weight files are (see ``sessions.make_session``).
    """

    def __init__(
        self,
        stages: list[Stage],
        template: onnx.ModelProto,
        weights: Mapping[str, onnx.TensorProto],
        weights_dir: Path | None,
    ) -> None:
        self.stages = stages
        self.template = template
        self.weights = weights
        self.weights_dir = weights_dir
        self._lock = threading.Lock()
        self._lifted_values: dict[str, np.ndarray] = {}

    # ----------------------------------------------------------------- made ahead

    def make_ahead(
        self,
        nodes: list[onnx.NodeProto],
        graph_inputs: Iterable[onnx.ValueInfoProto],
        *,
        share_forms: bool = True,
        workers: int = AHEAD_WORKERS,
    ) -> None:
        """Start ``workers`` that make the sessions of the stages whose input types the
        graph's ``nodes`` and ``graph_inputs`` tell. ``share_forms``: stages of one form share
        one session (else each has its own)."""
        known = {name: tensor.data_type for name, tensor in self.weights.items()}
        known.update(
            (i.name, i.type.tensor_type.elem_type)
            for i in graph_inputs
            if i.type.tensor_type.elem_type
        )
        types = infer_elem_types(nodes, known, same_as_input=COLLECTIVE_OP)
        typed = [stage for stage in self.stages if all(name in types for name in stage.inputs)]
        for stage in typed:
            stage.ahead = AheadSession(tuple(types[name] for name in stage.inputs))
        if share_forms:
            self._share_sessions(typed)
        queue = [stage for stage in typed if stage.leader in (None, stage)]
        pending = iter(queue)
        for worker in range(min(workers, len(queue))):
            InBackground(f"shardcheck-stages-{worker}", self._make_ahead, pending)

    def _share_sessions(self, stages: list[Stage]) -> None:
        """Stages of one form (two or more) share the ahead session of the first, which is
        made with their weights as inputs. Only stages with the same op types are compared."""
        by_ops: dict[tuple[str, ...], list[Stage]] = {}
        for stage in stages:
            by_ops.setdefault(tuple(node.op_type for node in stage.nodes), []).append(stage)
        for same_ops in by_ops.values():
            if len(same_ops) < 2:
                continue
            by_form: dict[Any, list[tuple[Stage, tuple[str, ...]]]] = {}
            for stage in same_ops:
                assert stage.ahead is not None
                form = stage_form(
                    stage.nodes,
                    stage.reads,
                    stage.inputs,
                    stage.ahead.types,
                    stage.outputs,
                    self.weights,
                )
                if form is not None:
                    by_form.setdefault(form.key, []).append((stage, form.lifted))
            for members in by_form.values():
                if len(members) < 2:
                    continue
                leader = members[0][0]
                for stage, lifted in members:
                    stage.leader, stage.lifted, stage.ahead = leader, lifted, leader.ahead

    def _make_ahead(self, pending: Iterator[Stage]) -> None:
        """One worker: the sessions of the stages no one has taken yet, in order."""
        while (stage := self._claim(pending)) is not None:
            assert stage.ahead is not None
            self._make_claimed(stage, stage.ahead)

    def _make_claimed(self, stage: Stage, ahead: AheadSession) -> None:
        """The session ``ahead`` of ``stage``, claimed ("making"): a leader's has the weights
        it lifts as inputs."""
        try:
            declared = {
                name: (elem, None) for name, elem in zip(stage.inputs, ahead.types, strict=True)
            }
            model = stage_model(
                stage,
                frozenset(),
                declared,
                stage.outputs,
                self.template,
                self.weights,
                lifted=stage.lifted,
            )
            ahead.session = make_session(model, self.weights_dir)
        except Exception:  # the runs make this stage's session again, and report its error
            ahead.session = None
        finally:
            ahead.done.set()

    def _claim(self, pending: Iterator[Stage]) -> Stage | None:
        with self._lock:
            for stage in pending:
                if stage.ahead is not None and stage.ahead.state == "pending":
                    stage.ahead.state = "making"
                    return stage
        return None

    def stop_making_ahead(self) -> None:
        """The workers take no more stages (a run has ended, or none will come), and the
        sessions they are making are waited for: no onnxruntime work is left running in the
        background (a process that ends under it crashes). The stages not taken are left to
        the runs that may still come."""
        with self._lock:
            aheads = [stage.ahead for stage in self.stages if stage.ahead]
            for ahead in aheads:
                if ahead.state == "pending":
                    ahead.state = "skipped"
        for ahead in aheads:
            if ahead.state == "making":
                ahead.done.wait()

    def _ahead_session(self, stage: Stage, feeds: Mapping[str, np.ndarray]) -> Any:
        """The stage's session made ahead, if one was and ``feeds`` have the types it was
        made for; else None (a stage no worker has taken yet is left to the caller, but for
        the session of a form, made here: the form's other stages run on it too)."""
        ahead = stage.ahead
        if ahead is None:
            return None
        with self._lock:
            shared_here = stage.leader is not None and ahead.state != "making"
            if shared_here:
                ahead.state = "making"
            elif ahead.state != "making":  # no worker has it, nor will: the caller makes it
                ahead.state = "skipped"
                return None
        if shared_here:
            assert stage.leader is not None
            self._make_claimed(stage.leader, ahead)
        ahead.done.wait()
        if any(
            _elem_type(feeds[name]) != elem
            for name, elem in zip(stage.inputs, ahead.types, strict=True)
        ):
            return None
        return ahead.session

    # ----------------------------------------------------------------- used by the runs

    def session(
        self,
        stage: Stage,
        removed: frozenset[str],
        diagnostic: bool,
        feeds: Mapping[str, np.ndarray],
        outputs: list[str],
    ) -> Any:
        """The session that runs ``stage`` but for its ``removed`` nodes on ``feeds``: the one
        made before for it, else the one made ahead, else one made now for ``outputs``.
        onnxruntime's errors in making it are raised (``onnxruntime_errors``)."""
        session = stage.sessions.get((removed, diagnostic))
        if session is None and not removed and not diagnostic:
            session = self._ahead_session(stage, feeds)
        if session is None:
            declared = {name: (_elem_type(value), value.ndim) for name, value in feeds.items()}
            model = stage_model(stage, removed, declared, outputs, self.template, self.weights)
            session = make_session(model, self.weights_dir)
        stage.sessions[(removed, diagnostic)] = session
        return session

    def run_shared(self, stage: Stage, feeds: Mapping[str, np.ndarray]) -> list[Any] | None:
        """The outputs of ``stage``, which has a leader, from the session it shares with its
        form, or None when that session is not there or fails (the stage's own session then
        runs it, and names its own nodes in any error)."""
        leader = stage.leader
        assert leader is not None
        session = self._ahead_session(stage, feeds)
        if session is not None:
            shared = {to: feeds[name] for name, to in zip(stage.inputs, leader.inputs, strict=True)}
            try:
                for name, to in zip(stage.lifted, leader.lifted, strict=True):
                    shared[to] = self.lifted_value(name)
                with watched_run("a run of the CP simulation"):
                    return session.run(leader.outputs, shared)
            except (*onnxruntime_errors(), OSError, ValueError):
                pass
        # On its own from now on; a leader's names still serve the other stages of its form.
        stage.leader, stage.ahead = None, None
        return None

    def lifted_value(self, name: str) -> np.ndarray:
        """The value fed for the lifted weight ``name``, read once (mapped from its file when
        external)."""
        value = self._lifted_values.get(name)
        if value is None:
            tensor = self.weights[name]
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                value = mapped_weight(tensor, self.weights_dir)
            else:
                value = numpy_helper.to_array(tensor)
            self._lifted_values[name] = value
        return value


def mapped_weight(tensor: onnx.TensorProto, weights_dir: Path | None) -> np.ndarray:
    """An external weight, a view of its file's one mapping (weights.py); ValueError when it
    cannot be mapped, InputError when its file is too short for it."""
    value = external_weight(tensor, weights_dir)
    if value is None:
        raise ValueError(f"tensor {tensor.name!r}: its external data cannot be mapped")
    return value


def _elem_type(value: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(value.dtype)
