"""Steps built to be timed: a plan applied at one batch size with its inputs (``build_step``), and the
unswapped steps a calibration built, kept for the measured run of the same process (``unswapped_step``).

Each built step costs an apply (edit and import of the traced graph) and a first call that Grappler
optimizes: on DenseNet-121 32x32 about 10 s each on 2 cores. The measured run's re-anchoring
(``rewriter.timing.anchored``) times the calibration's own unswapped steps again, the same steps at the
same batch sizes: it takes those the calibration built instead of building them twice (a CLI run of
DenseNet-121 built 9 steps before, benchmarks/results/cli_time_densenet121.md).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

from rewriter.check.collected import profiled_first_call
from rewriter.placement.placements import Placement, resolve as resolve_placement
from rewriter.step.apply_plan import PlanError, apply as apply_plan
from rewriter.trace.tracing import CaptureError, StepInputs, synthetic_batch
from simulator.device.calibrated import CalibrationError
from simulator.graph import OpGraph
from simulator.plan import SwapPlan

# the unswapped steps kept (a calibration's two batch sizes, for the latest two models at most)
UNSWAPPED_KEPT = 4
_UNSWAPPED: dict[tuple, tuple[Any, "BuiltStep"]] = {}


@dataclass
class BuiltStep:
    """One built step at one batch size and the call that runs it on fixed inputs."""

    batch: int
    graph: OpGraph
    step: Any
    flat: list = field(repr=False)

    def call(self):
        return self.step.run_flat(*self.flat)


def build_step(model, plan: SwapPlan, graph: OpGraph, batch: int, place: Placement | None, inputs: StepInputs, *,
               warm: bool = True) -> BuiltStep:
    """The rewritten step at ``batch`` (run twice with ``warm``: the first call optimizes the
    function); errors of a model that cannot run there become a ``CalibrationError``."""
    with cannot_run(model, graph, batch):
        step = apply_plan(model, plan, graph=graph, batch_size=batch, placement=place, verify=False, inputs=inputs)
        x, y = synthetic_batch(model, batch, inputs)
        built = BuiltStep(batch, graph, step, step._flat_inputs(x, y))
    if warm:
        warm_up(model, built)
    return built


def unswapped_step(model, graph: OpGraph, batch: int, place: Placement | None, inputs: StepInputs, *,
                   warm: bool = True, constants: bool = False) -> BuiltStep:
    """``build_step`` of the empty plan at ``batch``: the one built before in this process for the same
    model (compiled with the same optimizer and loss), graph, placement and inputs when there is one
    (warmed up already), else a new one, kept for the next caller. ``constants``: the step's peak is to be
    measured (``rewriter.timing.measurement``), so its first call measures its constants (``warm_up`` with
    ``place``: 4 s more on DenseNet-121, only where asked); a step kept without them is built again."""
    at_batch = graph.with_batch(batch)
    key = (id(model), int(batch), graph.fingerprint(), resolve_placement(place).describe(),
           json.dumps(inputs.to_dict(), sort_keys=True, default=str))
    compiled = (model, getattr(model, "optimizer", None), getattr(model, "loss", None))
    found = _UNSWAPPED.get(key)
    if found is not None and all(a is b for a, b in zip(found[0], compiled)) and (
            not constants or found[1].step.constant_bytes is not None or found[1].step.calls == 0):
        return found[1]
    built = build_step(model, SwapPlan.empty(at_batch), at_batch, batch, place, inputs, warm=False)
    if warm:
        warm_up(model, built, resolve_placement(place) if constants else None)
    _UNSWAPPED.pop(key, None)
    _UNSWAPPED[key] = (compiled, built)
    while len(_UNSWAPPED) > UNSWAPPED_KEPT:
        _UNSWAPPED.pop(next(iter(_UNSWAPPED)))
    return built


def forget_unswapped(model) -> None:
    """Drop the unswapped steps kept for ``model`` (``unswapped_step``): a copy of a model built only to be
    calibrated then holds no memory of the device the model itself is measured on."""
    for key in [key for key in _UNSWAPPED if key[0] == id(model)]:
        _UNSWAPPED.pop(key)


def warm_up(model, built: BuiltStep, place: Placement | None = None) -> None:
    """Two calls of ``built``: the first optimizes the function, the second runs as every later one. With
    ``place``, a first call is profiled for the constants its kernels make (``SwapStep.constant_bytes``, what
    ``rewriter.timing.measurement`` counts as resident): the measured run then measures this step's peak
    as it measures a step it built (its baseline, ``autotune.run.plan_run``)."""
    with cannot_run(model, built.graph, built.batch):
        step = built.step
        if place is not None and step.calls == 0 and step.constant_bytes is None:
            result, _, step.constant_bytes = profiled_first_call(built.call, allocator_prefix=place.allocator_prefix)
            block(result)
        else:
            block(built.call())
        block(built.call())


def block(result: Any) -> None:
    """Wait for every tensor of ``result``."""
    for tensor in tf.nest.flatten(result):
        if hasattr(tensor, "numpy"):
            tensor.numpy()


@contextlib.contextmanager
def cannot_run(model, graph: OpGraph, batch: int):
    """Errors of a model that cannot build or run its step at ``batch``, as a ``CalibrationError``."""
    try:
        yield
    except (tf.errors.OpError, CaptureError, PlanError, ValueError, TypeError, MemoryError) as error:
        name = str(graph.meta.get("model", getattr(model, "name", "model")))
        raise CalibrationError(f"model {name!r} cannot run a training step at batch size {batch} "
                               f"({type(error).__name__}: {first_line(error)})") from None


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else ""
