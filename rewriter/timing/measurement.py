"""Measure a training step: accelerator-side peak memory and step time, comparable with a ``Replay``.

``measure(step, x, y)`` runs ``warmup`` steps, times ``repeats`` steps (median) and measures one more
step's memory with the placement's method (``rewriter.placement.placements``): on a GPU the profiler's trace
of the GPU's allocator in requested bytes, beside TensorFlow's ``get_memory_info('GPU:0')['peak']``;
on the CPU testbed the profiler's memory trace replayed without the swap-out (host) allocations.
Like ``get_memory_info(...)['peak']`` the figure counts everything resident on the accelerator side during the step (weights, optimizer state, inputs,
and the constants the step's kernels hold, taken from its first call: ``memtrace.constant_bytes``) plus the
step's own allocations. By default every variable is restored afterwards, so measuring does not
train the model.

The ``Measurement`` fields carry the names of ``simulator.replay.Replay``'s where they mean the same
(``peak_bytes``, ``host_peak_bytes``, ``step_s``, ``d2h_bytes``, ``h2d_bytes``, ``n_swap_outs``,
``n_swap_ins``, ``persistent_bytes``); ``compare(replay)`` puts them side by side.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import tensorflow as tf

from rewriter.step.gpu_graph import jit_compile_note
from rewriter.placement.placements import Placement, resolve as resolve_placement
from rewriter.check.collected import profiled_first_call

log = logging.getLogger(__name__)

COMPARED_FIELDS = ("peak_bytes", "host_peak_bytes", "step_s", "d2h_bytes", "h2d_bytes", "n_swap_outs",
                   "n_swap_ins", "persistent_bytes")


@dataclass(frozen=True)
class Measurement:
    """One measured step. Sizes in bytes, times in seconds.

    ``peak_bytes``: accelerator-side peak in requested bytes (the allocator's chunk bytes on a GPU
    whose profiler trace holds no allocator events); ``allocator_peak_bytes``: the same peak in allocator
    chunk bytes; ``persistent_bytes``: what was resident before the step (weights, optimizer state,
    inputs, the step's constants); ``host_peak_bytes``: peak of the swap-out copies (None where not measured);
    ``step_s``: median of ``step_s_all``; ``jit_compile``: whether the model's own ``fit`` compiles
    with XLA (``rewriter.step.gpu_graph.jit_compile_note``), None without a Keras model.
    """

    peak_bytes: int
    allocator_peak_bytes: int
    host_peak_bytes: int | None
    step_s: float
    d2h_bytes: int
    h2d_bytes: int
    n_swap_outs: int
    n_swap_ins: int
    persistent_bytes: int
    measured_on: str
    batch_size: int | None = None
    step_s_all: tuple[float, ...] = field(default=(), repr=False)
    jit_compile: bool | None = None  # the model's Keras jit_compile (its own fit uses XLA; the step measured does not)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["step_s_all"] = list(self.step_s_all)
        return data

    def compare(self, replay) -> pd.DataFrame:
        """Predicted (a ``simulator.Replay``) against measured, field by field, with their ratio."""
        rows = []
        for name in COMPARED_FIELDS:
            predicted = getattr(replay, name, None)
            measured = getattr(self, name)
            ratio = (predicted / measured) if predicted is not None and measured else float("nan")
            rows.append({"field": name, "predicted": predicted, "measured": measured, "ratio": ratio})
        return pd.DataFrame(rows).set_index("field")


def _inputs(step, x, y) -> tuple[Any, list[tf.Tensor]]:
    """(callable taking flat tensors, flat tensors) for a SwapStep or any step(x, y) callable."""
    if hasattr(step, "run_flat") and hasattr(step, "_flat_inputs"):
        return step.run_flat, step._flat_inputs(x, y)
    structure = (x, y)  # arrays, lists or dicts of them, as the step takes them
    flat = [tf.convert_to_tensor(v) for v in tf.nest.flatten(structure)]

    def call(*tensors):
        return step(*tf.nest.pack_sequence_as(structure, list(tensors)))

    return call, flat


def _state_bytes(step, flat: list[tf.Tensor], place: Placement) -> int | None:
    """Bytes the step keeps between calls on the accelerator: the model's variables (weights, optimizer and
    metric state) but those on the host (optimizer slots a plan moved, ``rewriter.step.host_state``), and
    the input batch. None when the step has no model to ask."""
    model = getattr(step, "_model", None)
    if model is None:
        return None
    seen: dict[int, Any] = {}
    for variable in list(model.variables) + list(model.optimizer.variables) + list(
            getattr(model, "metrics_variables", [])):
        seen[id(variable)] = variable
    state = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in seen.values()
                if not place.on_host_device(getattr(getattr(v, "value", v), "device", "")))
    return state + sum(int(np.prod(t.shape)) * t.dtype.size for t in flat)


def _constant_bytes(step, call, flat: list[tf.Tensor], place: Placement) -> int:
    """Bytes of the constants the step's kernels hold between calls (``memtrace.constant_bytes`` of
    its first call, the call that makes them): taken here when the step has not run yet, else what
    ``rewriter.check.verification`` took on the first call; 0 for a step that ran before without either."""
    known = getattr(step, "constant_bytes", None)
    if known is None and getattr(step, "calls", None) == 0:
        _, _, known = profiled_first_call(call, *flat, allocator_prefix=place.allocator_prefix)
        step.constant_bytes = known
    if known is None:
        log.debug("the step's constants are not known (its first call was not profiled): not counted as resident")
        return 0
    return int(known)


def _block(result: Any) -> None:
    for tensor in tf.nest.flatten(result):
        if hasattr(tensor, "numpy"):
            tensor.numpy()


def measure(step, x, y, *, warmup: int = 2, repeats: int = 5, placement: Placement | str | None = None,
            restore: bool = True) -> Measurement:
    """Measure ``step`` (a ``SwapStep`` or any ``step(x, y)`` callable) on one batch.

    ``placement`` defaults to the step's own (a SwapStep) or ``placement.detect()``. With ``restore``
    (default) every variable the step captures is put back afterwards (SwapStep only).
    """
    if warmup < 0 or repeats < 1:
        raise ValueError("warmup must be >= 0 and repeats >= 1")
    place = resolve_placement(placement if placement is not None else getattr(step, "placement", None))
    call, flat = _inputs(step, x, y)
    snapshot = step.snapshot() if restore and hasattr(step, "snapshot") else None
    try:
        constants = _constant_bytes(step, call, flat, place)  # the step's first call when it has not run yet
        for _ in range(max(warmup, 1)):  # at least one: the first call optimizes the function
            _block(call(*flat))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _block(call(*flat))
            times.append(time.perf_counter() - start)
        state = _state_bytes(step, flat, place)
        host_ops = frozenset().union(*getattr(step, "host_updates", {}).values())
        reading = place.measure_peak(call, *flat, resident_bytes=None if state is None else state + constants,
                                     **({"host_ops": host_ops} if host_ops else {}))
    finally:
        if snapshot is not None:
            snapshot.restore()
    verification = getattr(step, "verification", None)
    n_outs = getattr(step, "n_swap_outs", 0)
    n_ins = getattr(step, "n_swap_ins", 0)
    if verification is not None and verification.collected:
        n_outs, n_ins = verification.swap_outs, verification.swap_ins
    return Measurement(
        peak_bytes=reading.peak_bytes, allocator_peak_bytes=reading.allocator_peak_bytes,
        host_peak_bytes=reading.host_peak_bytes, step_s=float(statistics.median(times)),
        d2h_bytes=int(getattr(step, "swapped_bytes", 0)), h2d_bytes=int(getattr(step, "swapped_in_bytes", 0)),
        n_swap_outs=int(n_outs), n_swap_ins=int(n_ins), persistent_bytes=reading.resident_bytes,
        measured_on=place.measured_on, batch_size=getattr(step, "batch_size", None), step_s_all=tuple(times),
        jit_compile=_jit_compile(step),
    )


def _jit_compile(step) -> bool | None:
    """The Keras model's resolved ``jit_compile`` (None without one); said when the user's fit differs."""
    model = getattr(step, "_model", None)
    value = getattr(model, "jit_compile", None) if model is not None else None
    if value:
        log.info("%s", jit_compile_note(model)[1])
    return None if value is None else bool(value)
