"""rewriter.calibrate on the CPU testbed: a calibration at two batch sizes predicts the step at a
third, orders plans of clearly different stalls as measured, and refuses bad input."""

from __future__ import annotations

import tests.tf_helpers as th  # noqa: I001 -- first: configures TF before its runtime starts

import keras
import numpy as np
import pytest

import rewriter
from benchmarks.models import build_model, example_batch
from rewriter.calibrate import timed_passes
from simulator import CalibratedDevice, CalibrationError, CalibrationMismatchError, SwapParams, SwapPlan, plan_swaps, replay

pytestmark = pytest.mark.tf

# three plans whose stalls differ clearly on the testbed: none, the larger tensors swapped for every read
# one op ahead of it (after the trigger's copies out), and every tensor swapped so
_SLOTS = dict(threshold=1, ub=1, trigger="level", tensors="all", distance="slot", after_copies_out=True)
STALL_PLANS = {
    "none": None,
    "slots all >= 1 MiB": SwapParams(**_SLOTS, min_bytes=2**20),
    "slots all": SwapParams(**_SLOTS),
}


@pytest.fixture(scope="module")
def calibrated_cnn():
    model = build_model("small_cnn", image_size=48, seed=0)
    assert th.TESTBED
    before = th.weights_of(model)
    device = rewriter.calibrate(model, batch_sizes=(4, 8), max_passes=6, profile_sessions=1)
    assert th.bitwise_equal(before, th.weights_of(model)), "calibrating does not train the model"
    return model, device


def _timed_step(model, graph, plan, batch: int):
    step = rewriter.apply(model, plan, graph=graph, batch_size=batch, verify=False)
    flat = step._flat_inputs(*example_batch(model, batch))
    step.run_flat(*flat)
    return step, lambda: step.run_flat(*flat)


# Timing on a shared 2-core machine: failed 3 of ~8 runs under other engineers' load, passed on a quiet
# one. Outside the default run (pytest -m timing runs it); python -m benchmarks step-time is the measurement.
@pytest.mark.timing
def test_calibration_predicts_another_batch_and_orders_plans_by_stall(calibrated_cnn):
    """The steps at the calibration's own batch sizes are timed again in the same passes as the measured
    ones and the calibration anchored to them (``with_step_times``): what is checked is the method (shares,
    fit in batch, link, contention), not whether the shared machine's load stayed the same in between."""
    model, device = calibrated_cnn
    assert isinstance(device, CalibratedDevice) and device.batch_sizes == (4, 8)
    assert device.h2d_bytes_per_s > 1e9 and device.copy_contention >= 0
    batch = 12  # not a calibration batch size
    graph = rewriter.capture(model, batch)
    calls, plans = {}, {}
    for label, params in STALL_PLANS.items():
        plans[label] = SwapPlan.empty(graph) if params is None else plan_swaps(graph, params,
                                                                              kept_reads=device.kept_reads)
        step, calls[label] = _timed_step(model, graph, plans[label], batch)
    for b in device.batch_sizes:
        _, calls[b] = _timed_step(model, graph.with_batch(b), SwapPlan.empty(graph.with_batch(b)), b)
    snapshot = step.snapshot()
    measured = timed_passes(calls, max_passes=8, between=snapshot.restore).step_s
    snapshot.restore()
    anchored = device.with_step_times([measured[b] for b in device.batch_sizes])
    predicted = {label: replay(graph, plan, anchored).step_s for label, plan in plans.items()}
    assert predicted["none"] == pytest.approx(measured["none"], rel=0.15)
    assert sorted(predicted, key=predicted.get) == sorted(STALL_PLANS, key=measured.get) == list(STALL_PLANS)


def test_a_calibration_refuses_another_models_graph(calibrated_cnn):
    _, device = calibrated_cnn
    other = rewriter.capture(build_model("mlp", seed=0), 4)
    with pytest.raises(CalibrationMismatchError, match="small_cnn"):
        replay(other, None, device)
    wider = rewriter.capture(build_model("small_cnn", image_size=32, seed=0), 4)  # same layers, other input size
    with pytest.raises(CalibrationMismatchError):
        replay(wider, None, device)


def test_a_model_that_cannot_run_at_the_batch_sizes_is_a_calibration_error():
    inputs = keras.Input(shape=(8,), name="features")
    fixed = keras.layers.Lambda(lambda t: keras.ops.reshape(t, (4, 8)), name="batch_of_four")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(fixed))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(CalibrationError, match="batch size"):
        rewriter.calibrate(model, batch_sizes=(2, 3))
    with pytest.raises(CalibrationError, match="two distinct"):
        rewriter.calibrate(model, batch_sizes=(4, 4))
    assert not np.isnan(th.weights_of(model)[0]).any()
