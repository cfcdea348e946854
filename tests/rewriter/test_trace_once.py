"""Trace once (rewriter.trace.tracing.trace_keras_step): the capture, the calibration, each plan's apply and
the measured run share one trace of the Keras step per batch size; a plan edits a copy of it."""

from __future__ import annotations

import tests.tf_helpers as th  # noqa: I001 -- first: configures TF before its runtime starts

from collections import Counter

import numpy as np
import pytest

import rewriter
import rewriter.trace.tracing as capture_module
from autotune.run.plan_run import run_plan
from benchmarks.models import build_model, example_batch
from simulator import SwapParams, plan_swaps

pytestmark = pytest.mark.tf


@pytest.fixture
def traces(monkeypatch):
    """The batch sizes the Keras step was traced at, one entry per trace."""
    made: Counter = Counter()
    real = capture_module._trace_keras_step

    def counted(model, batch_size, **kwargs):
        made[int(batch_size)] += 1
        return real(model, batch_size, **kwargs)

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
