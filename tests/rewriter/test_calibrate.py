"""rewriter.timing.device_calibration on the CPU testbed: a calibration at two batch sizes predicts the step at a
third, orders plans of clearly different stalls as measured, and refuses bad input."""

from __future__ import annotations

import tests.tf_tools as th  # noqa: I001 -- first: configures TF before its runtime starts

import importlib.util
import json
import time

import keras
import numpy as np
import pytest

import rewriter
from autotune.cli.command import main
from benchmarks.models import build_model, example_batch
from rewriter.timing.anchored import timed_beside_anchors
from rewriter.timing.device_calibration import fit_copies, pass_times, timed_passes
from simulator import CalibratedDevice, CalibrationError, CalibrationMismatchError, SwapParams, SwapPlan, plan_swaps, replay
from simulator.device.presets import get_device
from simulator.synthetic import training_graph

pytestmark = pytest.mark.tf

# three plans whose stalls differ clearly on the testbed: none, the larger tensors swapped for every read
# one op ahead of it (after the trigger's copies out), and every tensor swapped so
_SLOTS = dict(threshold=1, ub=1, trigger="level", tensors="all", distance="slot", after_copies_out=True)
STALL_PLANS = {
    "none": None,
    "slots all >= 1 MiB": SwapParams(**_SLOTS, min_bytes=2**20),
    "slots all": SwapParams(**_SLOTS),
}


def _calibrated_cnn(**timing):
    model = build_model("small_cnn", image_size=48, seed=0)
    assert th.TESTBED
    before = th.weights_of(model)
    device = rewriter.calibrate(model, batch_sizes=(4, 8), profile_sessions=1, **timing)
    assert th.bitwise_equal(before, th.weights_of(model)), "calibrating does not train the model"
    return model, device


@pytest.fixture(scope="module")
def calibrated_cnn():
    """A calibration as the CLI makes one (for the timing tests)."""
    return _calibrated_cnn()


@pytest.fixture(scope="module")
def quickly_calibrated_cnn():
    """A calibration with short timing (for what does not depend on its accuracy)."""
    return _calibrated_cnn(min_timing_s=0.0, min_passes=2, max_passes=3, contention=False)


def _timed_step(model, graph, plan, batch: int):
    step = rewriter.apply(model, plan, graph=graph, batch_size=batch, verify=False)
    flat = step._flat_inputs(*example_batch(model, batch))
    step.run_flat(*flat)
    return step, lambda: step.run_flat(*flat)


# Timing on a shared 2-core machine: see the docstrings for how often they pass. Outside the default run
# (pytest -m timing -n 0 runs them, alone on the cores); python -m benchmarks step-time is the measurement.
@pytest.mark.timing
def test_a_calibration_at_two_batch_sizes_predicts_a_third(calibrated_cnn):
    """No step at the predicted batch enters the prediction: the calibration's own measurements only."""
    model, device = calibrated_cnn
    assert isinstance(device, CalibratedDevice) and device.batch_sizes == (4, 8)
    assert device.h2d_bytes_per_s > 1e9 and device.copy_contention >= 0
    batch = 12  # not a calibration batch size
    graph = rewriter.capture(model, batch)
    step, call = _timed_step(model, graph, SwapPlan.empty(graph), batch)
    snapshot = step.snapshot()
    measured = timed_passes({"none": call}, min_total_s=8.0, between=snapshot.restore).step_s["none"]
    snapshot.restore()
    assert replay(graph, None, device).step_s == pytest.approx(measured, rel=0.15)


@pytest.mark.timing
def test_a_calibration_re_anchored_beside_the_step_predicts_a_third(calibrated_cnn):
    """As the measured run predicts (``rewriter.timing.anchored``): the calibration's own unswapped steps (b4, b8)
    timed in the same passes as the b12 step, so that the machine's drift since the calibration cancels
    (under load the plain prediction above was 27 % off either way)."""
    model, device = calibrated_cnn
    batch = 12
    graph = rewriter.capture(model, batch)
    step, call = _timed_step(model, graph, SwapPlan.empty(graph), batch)
    snapshot = step.snapshot()
    anchored, timing = timed_beside_anchors(device, model, graph, {"none": call}, min_total_s=8.0,
                                            between=snapshot.restore)
    snapshot.restore()
    assert anchored.batch_sizes == (4, 8)
    assert replay(graph, None, anchored).step_s == pytest.approx(timing.step_s["none"], rel=0.15)


@pytest.mark.timing
def test_a_calibration_orders_plans_of_clearly_different_stalls_as_measured(calibrated_cnn):
    model, device = calibrated_cnn
    batch = 12
    graph = rewriter.capture(model, batch)
    calls, plans = {}, {}
    for label, params in STALL_PLANS.items():
        plans[label] = SwapPlan.empty(graph) if params is None else plan_swaps(graph, params,
                                                                              kept_reads=device.kept_reads)
        step, calls[label] = _timed_step(model, graph, plans[label], batch)
    snapshot = step.snapshot()
    measured = timed_passes(calls, min_total_s=8.0, between=snapshot.restore).step_s
    snapshot.restore()
    predicted = {label: replay(graph, plan, device).step_s for label, plan in plans.items()}
    assert sorted(predicted, key=predicted.get) == sorted(STALL_PLANS, key=measured.get) == list(STALL_PLANS)


def test_timing_passes_leave_out_the_machines_slowdowns():
    """Other processes only slow steps down, some more than others: each step's slowed passes are left
    out, and what is left is its undisturbed time."""
    undisturbed = {"a": 0.010, "b": 0.020, "c": 0.040}
    slowdowns = [1.0, 1.6, 1.02, 2.2, 1.0, 1.04, 1.0, 1.3, 1.0, 1.01]
    sensitivity = {"a": 0.5, "b": 1.0, "c": 2.0}  # how much of a slowdown each step feels
    rng = np.random.default_rng(0)
    steps = {key: [[t * (1 + sensitivity[key] * (f - 1)) * (1 + 0.003 * rng.standard_normal()) for _ in range(3)]
                   for f in slowdowns] for key, t in undisturbed.items()}
    times = pass_times(steps, tolerance=0.05, min_passes=6)
    assert times.consistent and times.accepted["b"] == [f <= 1.05 for f in slowdowns]
    for key, t in undisturbed.items():
        assert times.step_s[key] == pytest.approx(t, rel=0.02)
        assert times.spread(key) < 0.06
    assert times.slowdown() == pytest.approx(0.03, abs=0.02)
    # too few undisturbed passes: each step's fastest are used, and it says so
    few = pass_times({key: runs[:4] for key, runs in steps.items()}, tolerance=0.05, min_passes=3)
    assert not few.consistent and sum(few.accepted["c"]) == 3
    assert few.step_s["a"] == pytest.approx(undisturbed["a"], rel=0.03)


def test_timing_passes_take_each_steps_cpu_time_beside_its_wall_time():
    """A step that waits costs wall time and next to no CPU time; one that computes costs both (less CPU
    than wall where other processes take the cores)."""
    def compute():
        start = time.perf_counter()
        while time.perf_counter() - start < 0.004:
            pass

    times = timed_passes({"compute": compute, "wait": lambda: time.sleep(0.004)}, min_passes=2, max_passes=4,
                         min_pass_s=0.01)
    assert set(times.cpu_s) == {"compute", "wait"}
    assert times.cpu_s["wait"] < 0.5 * times.step_s["wait"]
    assert 3 * times.cpu_s["wait"] < times.cpu_s["compute"] <= 1.05 * times.step_s["compute"]


def test_the_copies_cost_is_fitted_to_swapped_steps():
    """Given steps measured with a contention of 0.6 and 15 us per copy, the fit on an overlapping and
    a stalling plan finds both."""
    g = training_graph(24, batch_size=8)
    rng = np.random.default_rng(1)
    ab = np.stack([rng.uniform(1e-5, 1e-4, g.n_ops), rng.uniform(1e-5, 1e-4, g.n_ops)], axis=1)

    def device(alpha: float, overhead_s: float) -> CalibratedDevice:
        return CalibratedDevice.from_preset(
            get_device("cpu-testbed"), g, op_seconds_ab=ab, batch_sizes=(4, 8), measured_step_s=(0.01, 0.02),
            h2d_bytes_per_s=2e9, d2h_bytes_per_s=2e9, transfer_latency_s=2e-6, copy_contention=alpha,
            copy_overhead_s=overhead_s)

    plans = {"overlap": plan_swaps(g, SwapParams(threshold=2)),
             "stall": plan_swaps(g, SwapParams(threshold=1, ub=1, trigger="level", tensors="all", distance="slot"))}
    measured = {what: replay(g, plan, device(0.6, 15e-6)).step_s for what, plan in plans.items()}
    plain = {what: replay(g, plan, device(0.0, 0.0)).step_s for what, plan in plans.items()}
    copies = {what: plan.n_swaps + plan.n_swap_ins for what, plan in plans.items()}
    assert all(measured[w] - plain[w] > 15e-6 * copies[w] for w in plans)
    alpha, overhead_s, note = fit_copies(g, plans, measured, device(0.0, 0.0))
    assert alpha == pytest.approx(0.6) and overhead_s == pytest.approx(15e-6)
    assert "contention" in note and "per copy" in note
    # where only the overhead explains the steps, the contention is not made negative
    measured = {what: plain[what] + 20e-6 * copies[what] for what in plans}
    alpha, overhead_s, _ = fit_copies(g, plans, measured, device(0.0, 0.0))
    assert alpha == pytest.approx(0.0, abs=1e-9) and overhead_s == pytest.approx(20e-6, rel=0.01)


def test_a_calibration_refuses_another_models_graph(quickly_calibrated_cnn):
    _, device = quickly_calibrated_cnn
    assert device.copies_out_wait  # the testbed's op after a producer waits for its copy out (rewriter.edit.graph_edit)
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


def test_the_cli_calibrates_a_measured_run_and_shows_predicted_beside_measured(tmp_path, capsys):
    """--calibrate is on by default when the run is measured; with --device cpu-testbed on the testbed the
    search runs on the calibration, and the measured run's step time is predicted by it."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    build_model("small_cnn", image_size=32, seed=0).save(model_dir / "cnn.keras")
    out = tmp_path / "out"
    code = main([str(model_dir), "--batch-size", "8", "--device", "cpu-testbed", "--trials", "4", "--out", str(out),
                 "--no-plots"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["search_time_calibrated"] and summary["step_time_calibrated"]
    assert summary["device"].startswith("cpu-testbed-calibrated-")
    assert summary["calibration"]["batch_sizes"] == [4, 8] and summary["calibration"]["h2d_bytes_per_s"] > 1e9
    ratio = summary["predicted_step_s_at_measured_batch"] / summary["measured_step_s"]
    assert summary["step_time_ratio"] == pytest.approx(ratio)
    assert "calibrated on this machine" in stdout and "predicted / measured" in stdout
    # the measured run re-anchors the prediction to the calibration's own steps timed beside the plan's
    assert "batch sizes 4 (" in summary["step_time_anchored_to"] and ", 8 (" in summary["step_time_anchored_to"]
    assert summary["predicted_step_s_before_anchoring"] > 0
    report = (out / "report.md").read_text()
    assert "from the calibration of this machine" in report and "measured on this machine" in report
    assert "re-anchored to its unswapped steps at batch sizes 4" in report


def test_a_run_without_calibration_says_its_step_times_are_a_datasheet_estimate(tmp_path, capsys):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    build_model("small_cnn", image_size=32, seed=0).save(model_dir / "cnn.keras")
    out = tmp_path / "out"
    assert main([str(model_dir), "--batch-size", "8", "--no-measure", "--trials", "3", "--out", str(out),
                 "--no-plots"]) == 0
    stdout = capsys.readouterr().out
    assert "datasheet estimate of the v100-16gb preset" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["calibration"] is None and not summary["search_time_calibrated"]
    assert "datasheet estimate" in (out / "report.md").read_text()


FIXED_BATCH = """
import keras


@keras.saving.register_keras_serializable(package="test_calibrate")
class FourthExample(keras.layers.Layer):
    \"\"\"Adds the fourth example to every one: the model trains at batch 4 and more, not below.\"\"\"

    def call(self, x):
        return x + x[3]
"""


def test_the_cli_exits_2_when_the_model_cannot_run_at_the_calibration_batch_sizes(tmp_path, capsys):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "fixed_batch.py").write_text(FIXED_BATCH)
    spec = importlib.util.spec_from_file_location("fixed_batch", model_dir / "fixed_batch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    inputs = keras.Input(shape=(8,), name="features")
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(module.FourthExample()(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    model.save(model_dir / "fixed.keras")
    code = main([str(model_dir), "--import", "fixed_batch", "--batch-size", "4", "--device", "cpu-testbed",
                 "--no-plots", "--trials", "2", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "cannot calibrate step times" in err and "batch size" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "report.html").exists()


def test_the_measured_run_times_the_unswapped_steps_the_calibration_built(monkeypatch):
    """Build once (rewriter.timing.built_steps): the anchors and the baseline of a measured run in the same
    process take the unswapped steps the calibration built and warmed, their constants measured on their
    first call; another optimizer makes another step."""
    from rewriter.timing import built_steps
    from rewriter.trace.step_inputs import NO_STEP_INPUTS

    model = build_model("small_cnn", image_size=32, seed=0)
    graph = rewriter.capture(model, 8)
    applied = []
    real = built_steps.apply_plan

    def counted(*args, **kwargs):
        applied.append(kwargs["batch_size"])
        return real(*args, **kwargs)

    monkeypatch.setattr(built_steps, "apply_plan", counted)
    calibration = rewriter.calibrate(model, batch_sizes=(4, 8), profile_sessions=1, min_timing_s=0.0, min_passes=2,
                                     max_passes=3, contention=False, graph=graph)
    assert sorted(applied) == [4, 8]
    _, timing = timed_beside_anchors(calibration, model, graph, {}, max_passes=6)
    step = built_steps.unswapped_step(model, graph, 8, None, NO_STEP_INPUTS).step
    assert sorted(applied) == [4, 8] and timing.n_passes >= 1  # timed again, never built again
    assert step.constant_bytes is not None and step.calls > 2
    model.compile(optimizer="adam", loss=model.loss)
    recaptured = rewriter.capture(model, 8)
    assert built_steps.unswapped_step(model, recaptured, 8, None, NO_STEP_INPUTS).step is not step
    assert len(applied) == 3
