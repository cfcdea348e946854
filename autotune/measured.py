"""The measured run of a tuned plan: on a GPU at the requested batch, else on the CPU testbed at a
batch this machine can run, with the prediction for that same batch beside it."""

from __future__ import annotations

import logging

from autotune.inputs import format_bytes
from autotune.tuning import Measurement, TuneResult
from simulator import CalibratedDevice, SwapPlan, get_device, plan_swaps, replay

log = logging.getLogger(__name__)

# what a measured run on the CPU testbed may cost this machine
TESTBED_MAX_PEAK_BYTES = 3 * 2**30
TESTBED_MAX_STEP_S = 4.0


def testbed_batch(result: TuneResult) -> int:
    """The largest batch, up to the tuned one, whose unswapped step the CPU testbed runs quickly."""
    return testbed_batch_for(result.graph, result.batch_size)


def testbed_batch_for(graph, batch_size: int) -> int:
    """The largest batch up to ``batch_size`` whose unswapped step of ``graph`` the CPU testbed runs quickly."""
    testbed = get_device("cpu-testbed")
    batch = batch_size
    while batch > 1:
        base = replay(graph.with_batch(batch), None, testbed)
        if base.peak_bytes <= TESTBED_MAX_PEAK_BYTES and base.step_s <= TESTBED_MAX_STEP_S:
            break
        batch = max(1, batch // 2)
    return batch


def measure_result(model, result: TuneResult, *, input_shapes=None, label_shapes=None, label_dtype=None) -> Measurement:
    """Apply the chosen plan to ``model``'s real step, run it, and measure peak memory and time."""
    import rewriter
    from rewriter.capture import synthetic_batch

    placement = rewriter.detect(configure=False)
    shown = result.shown
    params = None if shown is None else shown.params
    on_gpu = placement.measured_on == "gpu"
    if on_gpu:
        batch, device, kept = result.batch_size, result.device, result.device.kept_reads
        note = ""
    else:
        batch = testbed_batch(result)
        calibration = result.calibration
        device = calibration if calibration is not None and calibration.preset == "cpu-testbed" else get_device("cpu-testbed")
        kept = device.kept_reads
        note = (f"No GPU here: the plan's parameters were applied on the CPU testbed (CPU:0 as the "
                f"accelerator, CPU:1 as the host) at batch {batch}"
                + ("" if batch == result.batch_size else f" instead of {result.batch_size}") + ".")
    graph = result.graph.with_batch(batch)
    plan = SwapPlan.empty(graph) if params is None else plan_swaps(graph, params, kept_reads=kept)
    predicted = replay(graph, plan, device)
    predicted_base = replay(graph, None, device)
    x, y = synthetic_batch(model, batch, input_shapes=input_shapes, label_shapes=label_shapes, label_dtype=label_dtype)
    shapes = dict(input_shapes=input_shapes, label_shapes=label_shapes, label_dtype=label_dtype)  # as captured
    step = rewriter.apply(model, plan, graph=graph, batch_size=batch, placement=placement, verify_with=(x, y), **shapes)
    measured, out_of_memory = _measure(step, x, y)
    baseline = plain = None
    if plan.n_swaps:
        if not on_gpu or predicted_base.peak_bytes <= result.budget_bytes:  # on a GPU it may not fit
            reference = rewriter.apply(model, SwapPlan.empty(graph), graph=graph, batch_size=batch,
                                       placement=placement, verify=False, **shapes)
            baseline, _ = _measure(reference, x, y)
    else:  # "fits without swapping" must hold for the step a plain model.fit runs, too
        plain, plain_oom = _measure(rewriter.KerasStep(model), x, y)
        if plain_oom:
            log.info("model.fit's own step ran out of memory at batch %d", batch)
    verification = step.verification
    if measured is not None:
        log.info("measured at batch %d: peak %s (predicted %s)", batch, format_bytes(measured.peak_bytes),
                 format_bytes(predicted.peak_bytes))
    return Measurement(
        measured_on=placement.measured_on if measured is None else measured.measured_on, batch_size=batch,
        peak_bytes=0 if measured is None else measured.peak_bytes,
        step_s=float("nan") if measured is None else measured.step_s,
        baseline_peak_bytes=None if baseline is None else baseline.peak_bytes,
        baseline_step_s=None if baseline is None else baseline.step_s,
        predicted_peak_bytes=predicted.peak_bytes, predicted_step_s=predicted.step_s, time_model=device.name,
        time_calibrated=isinstance(device, CalibratedDevice),
        predicted_baseline_peak_bytes=predicted_base.peak_bytes,
        allocator_peak_bytes=None if measured is None else measured.allocator_peak_bytes,
        note=note, swaps_survived=None if verification is None else verification.swap_outs,
        swaps_planned=plan.n_swaps, plain_peak_bytes=None if plain is None else plain.peak_bytes,
        out_of_memory=out_of_memory,
    )


def _measure(step, x, y):
    """(measurement, False), or (None, True) when the step runs out of memory: on a GPU whose
    memory limit is the budget, that is a measured "does not fit", not a crash."""
    import tensorflow as tf

    import rewriter

    try:
        return rewriter.measure(step, x, y, warmup=1, repeats=3), False
    except tf.errors.ResourceExhaustedError as error:
        log.warning("the measured run ran out of memory: %s", str(error).splitlines()[0][:200])
        return None, True
