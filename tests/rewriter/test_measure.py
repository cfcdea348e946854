"""Measured peaks on the CPU testbed: agreement with TF's own figure, the saving from swapping,
and the simulator's prediction against the measurement."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import logging
from collections import Counter

import tests.tf_tools as th  # noqa: I001 -- first: configures TF before its runtime starts

import numpy as np
import pandas as pd
import pytest

import rewriter
import rewriter.environment
import rewriter.trace.tracing as capture_module
from autotune.run.plan_run import run_plan
from benchmarks import fidelity
from benchmarks.models import build_model, example_batch
from benchmarks.zoo import SMALL
from rewriter.placement import placements as placement_module
from simulator import SwapParams, plan_swaps, replay

pytestmark = pytest.mark.tf
MiB = 2**20

# params of the plans compared with the simulator (the U-Net's: UNET3D_PLANS in the default run, all with -m long)
PLANS = [
    SwapParams(threshold=1),
    SwapParams(threshold=5, ub=20),
    SwapParams(threshold=20, lb=3, ub=30),
    SwapParams(threshold=40, min_bytes=2**20),
    SwapParams(threshold=10, sync="in"),
]


def test_measure_small_model_fields():
    model = build_model("small_cnn", seed=0)
    x, y = example_batch(model, 8)
    graph = rewriter.capture(model, 8)
    plan = plan_swaps(graph, SwapParams(threshold=1, min_bytes=4096))
    step = rewriter.apply(model, plan, graph=graph, batch_size=8)
    before = th.weights_of(model)
    m = rewriter.measure(step, x, y, warmup=1, repeats=3)
    assert th.bitwise_equal(before, th.weights_of(model)), "measure restores the model by default"
    assert m.measured_on == "cpu-testbed" and m.batch_size == 8 and len(m.step_s_all) == 3
    assert m.step_s > 0 and m.peak_bytes > m.persistent_bytes > 0 and m.allocator_peak_bytes >= m.peak_bytes
    assert (m.n_swap_outs, m.n_swap_ins) == (step.n_swap_outs, step.n_swap_ins)
    assert m.d2h_bytes == step.swapped_bytes and m.host_peak_bytes > 0
    table = m.compare(replay(graph, plan, "cpu-testbed"))
    assert list(table.index) == list(rewriter.timing.measurement.COMPARED_FIELDS)
    assert table.loc["n_swap_outs", "measured"] == step.n_swap_outs


def test_warns_when_small_allocations_are_hidden(monkeypatch, caplog):
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "false")
    monkeypatch.setattr(placement_module, "_warned_bfc", False)
    with caplog.at_level(logging.WARNING, logger="rewriter.placement.placements"):
        assert placement_module.warn_if_allocations_hidden()
    assert any("TF_CPU_ALLOCATOR_USE_BFC" in r.message for r in caplog.records)
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "true")
    assert not placement_module.warn_if_allocations_hidden()


def test_warns_when_onednn_kernels_are_off(monkeypatch, caplog):
    assert placement_module.onednn_enabled() is True, "import rewriter (tf_tools) turns oneDNN on"
    monkeypatch.setattr(placement_module, "onednn_enabled", lambda: False)
    monkeypatch.setattr(placement_module, "_warned_onednn", False)
    with caplog.at_level(logging.WARNING, logger="rewriter.placement.placements"):
        assert placement_module.warn_if_onednn_off()
        assert placement_module.warn_if_onednn_off()
    assert sum("TF_ENABLE_ONEDNN_OPTS=1" in r.message for r in caplog.records) == 1


def test_import_rewriter_sets_the_testbed_environment_before_tensorflow():
    env = {k: v for k, v in os.environ.items() if k not in rewriter.environment.TESTBED_ENV}
    code = ("import os, rewriter\n"
            "from tensorflow.python.util import _pywrap_util_port\n"
            "print('RESULT', os.environ['TF_CPU_ALLOCATOR_USE_BFC'], _pywrap_util_port.IsMklEnabled())")
    result = subprocess.run([sys.executable, "-c", code], cwd=th.REPO, env=dict(env, PYTHONPATH=str(th.REPO)),
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "RESULT true True" in result.stdout


def test_detect_and_placements():
    place = rewriter.detect()
    assert isinstance(place, rewriter.CpuTestbedPlacement) and not place.single_device
    assert (place.accelerator, place.host, place.swap_op) == ("/device:CPU:0", "/device:CPU:1", "DeepCopy")
    assert place.is_host_op("swap_out/a/b_0") and not place.is_host_op("swap_in/a/b_0/0")
    assert place.swap_out_device == place.accelerator  # the copy is made beside the tensor, then handed over
    gpu = rewriter.GpuPlacement()
    assert (gpu.accelerator, gpu.host, gpu.swap_op, gpu.measured_on) == ("/device:GPU:0", "/device:CPU:0",
                                                                         "Identity", "gpu")
    assert gpu.swap_out_device == gpu.host  # the executor's device-to-host copy is the transfer
    assert placement_module.gpu_memory() is None
    with pytest.raises(ValueError):
        placement_module.resolve("tpu")


REPEATS = 8


def test_swapped_plan_measures_its_predicted_peak_on_every_run():
    """A measured run that confirms a plan must hold on the next run too. norm_mix_24 swapped (the zoo's
    normalization model, a plan of the fidelity set) was measured 14-16 % above its prediction in 3 runs
    of 150 under load, when a swapped tensor's buffer outlived its readers (held by the copy to the host:
    ``CpuTestbedPlacement.swap_out_device``). Each of ``REPEATS`` runs is measured: none may exceed the
    prediction by more than 1 %, and their median is the prediction within 1 %. A single run may fall
    further below it: a swap-in that the host side sends late is allocated after the frees the
    simulator puts after it (the safe side; 2-16 % below in 5 runs of 150)."""
    entry = SMALL["normalization"]
    model = entry.build()
    x, y = entry.example_batch(model)
    graph = rewriter.capture(model, entry.batch, name=entry.name)
    params = SwapParams.from_dict(dict(fidelity.PLANS)["T5 lb2-ub20 g4 sync-out"])
    plan = plan_swaps(graph, params, kept_reads=rewriter.detect().kept_reads)
    predicted = replay(graph, plan, "cpu-testbed").peak_bytes
    step = rewriter.apply(model, plan, graph=graph, batch_size=entry.batch, verify=False)
    assert step.n_swap_outs > 0
    ratios = [rewriter.measure(step, x, y, warmup=1, repeats=1).peak_bytes / predicted for _ in range(REPEATS)]
    assert max(ratios) <= 1.01 and abs(statistics.median(ratios) - 1.0) <= 0.01, [round(r, 4) for r in ratios]


# ---------------------------------------------------------------------- fresh processes
# The measured figure counts everything resident in the process (like get_memory_info on a GPU), so the
# big measurements run in a fresh process holding only the model under test.

_SCRIPT = """
import json, sys
import tests.tf_tools as th
import tensorflow as tf
import rewriter
from benchmarks.models import build_model, example_batch
from simulator import SwapParams, SwapPlan, get_device, plan_swaps, replay
name, kwargs, batch = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
plans = [None] + [SwapParams.from_dict(p) for p in json.loads(sys.argv[4])]
model = build_model(name, seed=0, **kwargs)
x, y = example_batch(model, batch)
out = {}
if sys.argv[5] == "keras":
    for _ in range(2):
        model.train_on_batch(x, y)
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.train_on_batch(x, y)
    out["keras_peak"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
graph = rewriter.capture(model, batch, graph_rewrites=json.loads(sys.argv[6]) if len(sys.argv) > 6 else ())
out["graph_rewrites"] = graph.meta.get("graph_rewrites", [])
rows = []
for params in plans:
    plan = SwapPlan.empty(graph) if params is None else plan_swaps(graph, params, kept_reads=get_device("cpu-testbed").kept_reads)
    step = rewriter.apply(model, plan, graph=graph, batch_size=batch)
    m = rewriter.measure(step, x, y, warmup=1, repeats=1)
    r = replay(graph, plan, "cpu-testbed")
    if params is None:  # the trace's allocator figure against TF's own counter, for one and the same step
        from rewriter.placement import memtrace
        tf.config.experimental.reset_memory_stats("CPU:0")
        current = tf.config.experimental.get_memory_info("CPU:0")["current"]
        events = memtrace.record_memory_events(step, x, y)
        out["own_peak"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        out["own_trace_peak"] = int(memtrace.accelerator_peak(
            events, is_host_op=step.placement.is_host_op, resident_bytes=current).peak_allocated_bytes)
    rows.append(dict(params=None if params is None else params.to_dict(), swaps=step.n_swap_outs,
                     planned=plan.n_swaps, predicted=r.peak_bytes, measured=m.peak_bytes,
                     allocator=m.allocator_peak_bytes, host=m.host_peak_bytes, step_s=m.step_s,
                     verified=step.verification is None or step.verification.ok))
out["rows"] = rows
print("RESULT " + json.dumps(out))
"""


def _run(name, kwargs, batch, plans, keras_peak=False, graph_rewrites=()):
    result = th.run_python(
        f"import sys; sys.argv = ['x', {name!r}, {json.dumps(kwargs)!r}, '{batch}', "
        f"{json.dumps([p.to_dict() for p in plans])!r}, {'keras' if keras_peak else 'no'!r}, "
        f"{json.dumps(list(graph_rewrites))!r}]\n" + _SCRIPT,
        timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _table(name, rows):
    table = pd.DataFrame([{
        "model": name,
        "params": "none" if r["params"] is None else ", ".join(
            f"{k}={v}" for k, v in r["params"].items()
            if k == "threshold" or v != SwapParams.__dataclass_fields__[k].default),
        "swaps": r["swaps"], "predicted_MiB": r["predicted"] / MiB, "measured_MiB": r["measured"] / MiB,
        "allocator_MiB": r["allocator"] / MiB, "ratio": r["predicted"] / r["measured"], "verified": r["verified"],
    } for r in rows])
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print("\n" + table.round(3).to_string(index=False))
    return table


@pytest.fixture(scope="module")
def resnet():
    # one of the plans (every far read), beside the unswapped step: ResNet-50 at 224 px is the longest item
    # of the tests (``-m long``); the U-Net tests below run three of them in the default run, a window and
    # sync-in among them, and ``python -m benchmarks fidelity`` measures ten on ResNet-50
    return _run("resnet50", {}, 8, [PLANS[0]], keras_peak=True)


@pytest.mark.long
def test_unswapped_measurement_agrees_with_tensorflow(resnet):
    """With no swaps, the trace the testbed measures from gives TF's own get_memory_info('CPU:0')
    peak of the same step (allocator chunk bytes, everything the process holds counted as resident),
    and the measured figure (requested bytes, only the step's own state resident) lies below the
    plain Keras step's peak, whose executor runs parallel branches together.

    Peaks of different steps are not compared closely: they move by a few percent from step to step
    (the BFC allocator leaves a free chunk unsplit when it is less than twice the request, so what is
    counted depends on which chunks are free), the plain Keras step's also with the executor's
    interleaving (986-1053 MiB over five steps of one process). The simulator's prediction of the
    unswapped step is that plain Keras step's peak within 25 % (as test_capture's models are)."""
    unswapped, keras_peak = resnet["rows"][0], resnet["keras_peak"]
    own_peak, own_trace_peak = resnet["own_peak"], resnet["own_trace_peak"]
    print(f"\nResNet-50 b8 unswapped: measured {unswapped['measured'] / MiB:.1f} MiB requested, "
          f"{unswapped['allocator'] / MiB:.1f} MiB allocator; one more step: get_memory_info peak "
          f"{own_peak / MiB:.1f} MiB, from its trace {own_trace_peak / MiB:.1f} MiB; plain Keras step "
          f"{keras_peak / MiB:.1f} MiB, predicted {unswapped['predicted'] / MiB:.1f} MiB")
    assert abs(own_trace_peak - own_peak) <= 0.01 * own_peak
    assert unswapped["measured"] <= unswapped["allocator"]
    assert 0.85 * keras_peak <= unswapped["measured"] <= keras_peak
    assert 0.75 <= unswapped["predicted"] / keras_peak <= 1.25


@pytest.mark.long
def test_swapping_every_activation_cuts_resnet50_peak(resnet):
    unswapped, swapped = resnet["rows"][0], resnet["rows"][1]  # PLANS[0]: threshold=1, every far read
    assert swapped["params"]["threshold"] == 1
    print(f"\nResNet-50 b8: unswapped {unswapped['measured'] / MiB:.1f} MiB, all activations swapped "
          f"{swapped['measured'] / MiB:.1f} MiB ({swapped['measured'] / unswapped['measured']:.2f}); allocator "
          f"{unswapped['allocator'] / MiB:.1f} -> {swapped['allocator'] / MiB:.1f} MiB; host copies "
          f"{swapped['host'] / MiB:.1f} MiB; step {unswapped['step_s']:.2f} s -> {swapped['step_s']:.2f} s")
    assert swapped["measured"] <= 0.60 * unswapped["measured"]
    assert swapped["swaps"] > 0.9 * swapped["planned"]


@pytest.mark.long
def test_prediction_matches_measurement_resnet50(resnet):
    table = _table("resnet50", resnet["rows"])
    assert len(table) >= 2
    assert (abs(table["ratio"] - 1.0) <= 0.15).all(), table.to_string()


UNET3D = dict(size=32, base_filters=8, depth=3)


# the default run's U-Net plans: every far read, a window of levels and synchronous swap-ins; the other two of
# ``PLANS`` (a window from level 3, large tensors only) with -m long
UNET3D_PLANS = [PLANS[0], PLANS[1], PLANS[4]]


@pytest.fixture(scope="module")
def unet3d():
    """The plain 3D U-Net step, unswapped and with ``UNET3D_PLANS`` (one process for the tests below)."""
    return _run("unet3d", UNET3D, 2, UNET3D_PLANS)


@pytest.mark.slow
def test_prediction_matches_measurement_unet3d(unet3d):
    table = _table("unet3d", unet3d["rows"])
    assert len(table) == 1 + len(UNET3D_PLANS)
    assert (abs(table["ratio"] - 1.0) <= 0.15).all(), table.to_string()


@pytest.mark.long
def test_prediction_matches_measurement_unet3d_more_plans():
    plans = [plan for plan in PLANS if plan not in UNET3D_PLANS]
    table = _table("unet3d", _run("unet3d", UNET3D, 2, plans)["rows"])
    assert len(table) == 1 + len(plans)
    assert (abs(table["ratio"] - 1.0) <= 0.15).all(), table.to_string()


@pytest.mark.long  # the rewritten step's own measured process; the plain one above stays in the default run
def test_prediction_matches_measurement_unet3d_split_concat(unet3d):
    """The step rewritten by ``split-concat`` runs as the simulator predicts, swapped or not, and
    without swapping its measured peak is below the plain step's (same model, batch and settings)."""
    plans = [SwapParams(threshold=1), SwapParams(threshold=3, ub=8, order="memory"), SwapParams(threshold=10, sync="in"),
             SwapParams(threshold=2, ub=8), SwapParams(threshold=2, ub=8, tensors="all")]
    result = _run("unet3d", UNET3D, 2, plans, graph_rewrites=["split-concat"])
    assert result["graph_rewrites"] == ["split-concat"]
    table = _table("unet3d split-concat", result["rows"])
    assert (abs(table["ratio"] - 1.0) <= 0.15).all(), table.to_string()
    assert table["verified"].all()
    activations, everything = result["rows"][-2:]  # gradients and int64 labels also swapped: more swaps, all applied
    assert everything["planned"] > activations["planned"] and everything["swaps"] == everything["planned"]
    plain = unet3d["rows"][0]  # no swapping, in its own process like the rewritten step
    print(f"unswapped: plain {plain['measured'] / MiB:.1f} MiB, split-concat {result['rows'][0]['measured'] / MiB:.1f} MiB")
    assert result["rows"][0]["measured"] < plain["measured"]


# ---- trace once (rewriter.trace.tracing.trace_keras_step): the capture, the calibration, each plan's apply
# and the measured run share one trace of the Keras step per batch size; a plan edits a copy of it


@pytest.fixture
def traces(monkeypatch):
    """The batch sizes the Keras step was traced at, one entry per trace."""
    made: Counter = Counter()
    real = capture_module._trace_keras_step

    def counted(model, batch_size, *args, **kwargs):
        made[int(batch_size)] += 1
        return real(model, batch_size, *args, **kwargs)

    monkeypatch.setattr(capture_module, "_trace_keras_step", counted)
    return made


def test_capture_calibration_and_measured_runs_trace_each_batch_once(traces):
    model = build_model("small_cnn", image_size=32, seed=0)
    assert th.TESTBED
    graph = rewriter.capture(model, 8)
    traced_by_capture = dict(traces)
    rewriter.calibrate(model, batch_sizes=(4, 8), profile_sessions=1, min_timing_s=0.0, min_passes=2, max_passes=3,
                       contention=False)
    data = example_batch(model, 8)
    plans = [plan_swaps(graph, SwapParams(threshold=1, lb=1, ub=4)), plan_swaps(graph, SwapParams(threshold=3))]
    runs = [run_plan(model, graph, plan, "cpu-testbed", data, repeats=1) for plan in plans]
    assert all(run.measured is not None and run.measured.peak_bytes > 0 for run in runs)
    assert runs[0].step.n_swap_outs > 0  # the plans did change the step they ran
    assert traced_by_capture[8] == 1 and set(traces.values()) == {1}, traces  # every batch size traced once
    assert set(traces) == {4, 8} | set(traced_by_capture)
    # the shared trace is never edited in place: the unswapped step still runs as Keras' own
    step = rewriter.apply(model, plan_swaps(graph, SwapParams(threshold=10**9)), graph=graph, batch_size=8,
                          verify=False)
    assert step.n_swap_outs == 0 and np.isfinite(float(step(*data)))


def test_a_recompiled_model_is_traced_again(traces):
    model = build_model("small_cnn", image_size=32, seed=0)
    first = capture_module.trace_keras_step(model, 4)
    assert capture_module.trace_keras_step(model, 4) is first and traces[4] == 1
    model.compile(optimizer="adam", loss=model.loss)
    assert capture_module.trace_keras_step(model, 4) is not first and traces[4] == 2
