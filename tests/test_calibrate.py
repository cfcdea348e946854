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

# three plans whose stalls differ clearly on the testbed: none, every far read swapped, and every
# tensor swapped for every read one op ahead of it after its trigger's copies out
STALL_PLANS = {
    "none": None,
    "T1": SwapParams(threshold=1),
    "T1 slots all after copies": SwapParams(threshold=1, ub=1, trigger="level", tensors="all", distance="slot",
                                            after_copies_out=True),
}


@pytest.fixture(scope="module")
def calibrated_cnn():
    model = build_model("small_cnn", image_size=48, seed=0)
    assert th.TESTBED
    before = th.weights_of(model)
    device = rewriter.calibrate(model, batch_sizes=(4, 8), max_passes=6, profile_sessions=1)
    assert th.bitwise_equal(before, th.weights_of(model)), "calibrating does not train the model"
    return model, device


def test_calibration_predicts_another_batch_and_orders_plans_by_stall(calibrated_cnn):
    model, device = calibrated_cnn
    assert isinstance(device, CalibratedDevice) and device.batch_sizes == (4, 8)
    assert device.h2d_bytes_per_s > 1e9 and device.copy_contention >= 0
    batch = 12  # not a calibration batch size
    graph = rewriter.capture(model, batch)
    x, y = example_batch(model, batch)
    calls, predicted = {}, {}
    for label, params in STALL_PLANS.items():
        plan = SwapPlan.empty(graph) if params is None else plan_swaps(graph, params, kept_reads=device.kept_reads)
        predicted[label] = replay(graph, plan, device).step_s
        step = rewriter.apply(model, plan, graph=graph, batch_size=batch, verify=False)
        flat = step._flat_inputs(x, y)
        step.run_flat(*flat)
        calls[label] = lambda step=step, flat=flat: step.run_flat(*flat)
    snapshot = step.snapshot()
    measured = timed_passes(calls, max_passes=6, between=snapshot.restore).step_s
    snapshot.restore()
    assert predicted["none"] == pytest.approx(measured["none"], rel=0.15)
    assert sorted(predicted, key=predicted.get) == sorted(measured, key=measured.get) == list(STALL_PLANS)


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
