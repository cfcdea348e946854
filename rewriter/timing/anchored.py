"""A calibration re-anchored to unswapped steps timed beside the steps it predicts (docs/design.md 4).

This machine's speed drifts over minutes (the same small_cnn step at 9.1-18.0 ms from run to run),
so the calibration's totals, timed before the search, can be 8-15 % off the speed the machine has when
the plan is measured, and no rejection of disturbed passes within the calibration removes that.
Timing the calibration's own unswapped steps (same batch sizes, never another) in the same
interleaved passes as the steps to predict, and scaling its per-op times to them
(``CalibratedDevice.with_step_times``), cancels the drift: in a quiet step-time run (benchmarks/results/step_time.md) the
median error went from 10.6 % to 3.6 % and the worst from 16.6 % to 12.3 %.
``autotune.run.plan_run`` does this for the measured run, ``benchmarks/step_time.py`` for every plan.
"""

from __future__ import annotations

from typing import Any, Callable

from rewriter.timing.built_steps import unswapped_step
from rewriter.timing.device_calibration import PassTimes, timed_passes
from rewriter.trace.step_inputs import NO_STEP_INPUTS, StepInputs
from simulator.device.calibrated import CalibratedDevice
from simulator.graph import OpGraph

ANCHOR = "anchor"  # the keys of the anchor steps in the timing: (ANCHOR, batch size)


def timed_beside_anchors(calibration: CalibratedDevice, model, graph: OpGraph, calls: dict[Any, Callable[[], Any]], *,
                         placement=None, inputs: StepInputs = NO_STEP_INPUTS, max_passes: int = 20, min_total_s: float = 0.0,
                         max_total_s: float | None = None,
                         between: Callable[[], None] | None = None) -> tuple[CalibratedDevice, PassTimes]:
    """Time ``calls`` (key -> one warmed-up step to predict) in passes interleaved with ``model``'s
    unswapped step at each of the calibration's batch sizes (``graph``: the model's step as captured,
    at any batch; ``inputs``: the shapes it was captured with), and return the calibration
    re-anchored to those steps' times, with the timing (``calls``' keys and ``(ANCHOR, b)``). A model that
    cannot run one of those steps raises ``CalibrationError``.
    ``between`` runs after each pass (e.g. restoring weights the steps update); no pass starts after
    ``max_total_s`` (``timed_passes``)."""
    anchors: dict[Any, Callable[[], Any]] = {  # warmed up; the calibration's own when it ran in this process
        (ANCHOR, batch): unswapped_step(model, graph, batch, placement, inputs,
                                        constants=batch == calibration.batch_sizes[-1]).call  # the baseline's
        for batch in calibration.batch_sizes}
    timing = timed_passes({**calls, **anchors}, max_passes=max_passes, min_total_s=min_total_s, max_total_s=max_total_s,
                          between=between)
    anchored = calibration.with_step_times([timing.step_s[(ANCHOR, b)] for b in calibration.batch_sizes])
    return anchored, timing
