"""The host-room pass: plans that fit the device but overflow the host keep tensors on the device."""

from __future__ import annotations

import numpy as np
import pytest

from autotune.search.space import TuningProblem
from simulator import GraphError, ParamsError, SwapParams, get_device, plan_swaps, replay
from simulator.host_room import fit_host, on_host_at_peak
from simulator.synthetic import training_graph

PARAMS = SwapParams(threshold=2, lb=1, ub=4, tensors="all", distance="slot")


@pytest.fixture(scope="module")
def case():
    g = training_graph(40, seed=1, batch_size=8)
    device = get_device("v100-16gb")
    plan = plan_swaps(g, PARAMS, kept_reads=device.kept_reads)
    return g, device, plan, replay(g, plan, device), replay(g, None, device)


def test_keeps_the_briefest_copies_at_the_host_peak_until_the_host_fits(case):
    g, device, plan, result, baseline = case
    limit = result.host_peak_bytes - 1
    fit = fit_host(g, PARAMS, device, baseline.peak_bytes, limit)
    assert fit is not None and fit.params.keep_tensors
    assert fit.result.host_peak_bytes <= limit and fit.result.peak_bytes <= baseline.peak_bytes
    # the first tensor kept: of the copies on the host at its peak, the one away the shortest time
    first = on_host_at_peak(plan, result)[0]
    assert fit.params.keep_tensors[0] == g.tensor_name(first)
    kept = {g.tensor_index()[name] for name in fit.params.keep_tensors}
    assert kept <= set(plan.tensor.tolist()) and not kept & set(fit.plan.tensor.tolist())
    # the parameters are the plan: the same from JSON, at any batch size
    again = SwapParams.from_dict(fit.params.to_dict())
    assert again == fit.params
    replanned = plan_swaps(g, again, kept_reads=device.kept_reads)
    assert np.array_equal(replanned.tensor, fit.plan.tensor)
    assert replay(g, replanned, device).host_peak_bytes == fit.result.host_peak_bytes
    assert plan_swaps(g.with_batch(16), again, kept_reads=device.kept_reads).n_swaps == fit.plan.n_swaps


def test_gives_up_when_the_device_has_no_room_left(case):
    g, device, _, result, _ = case
    assert fit_host(g, PARAMS, device, result.peak_bytes, result.host_peak_bytes // 2) is None
    assert fit_host(g, PARAMS, device, result.peak_bytes - 1, result.host_peak_bytes - 1) is None  # over already


def test_tuning_evaluates_the_mended_plan(case):
    g, device, _, result, baseline = case
    limit = result.host_peak_bytes - 1
    problem = TuningProblem(g, device, baseline.peak_bytes, host_limit_bytes=limit)
    evaluation = problem.evaluate(PARAMS)
    assert evaluation.feasible and evaluation.params.keep_tensors
    assert evaluation.metrics["host_peak_bytes"] <= limit
    assert problem.evaluate(evaluation.params) is evaluation
    assert problem.replay(evaluation.params).host_peak_bytes == evaluation.metrics["host_peak_bytes"]
    # no room on the device: the plan stays as the rules made it, over the host limit
    tight = TuningProblem(g, device, result.peak_bytes, host_limit_bytes=result.host_peak_bytes // 2)
    evaluation = tight.evaluate(PARAMS)
    assert not evaluation.feasible and evaluation.params == PARAMS


def test_kept_tensors_must_be_the_graphs(case):
    g = case[0]
    with pytest.raises(GraphError, match="does not have"):
        plan_swaps(g, SwapParams(threshold=2, keep_tensors=("nothing:0",)))
    for value in ("f1:0", None, [1]):
        with pytest.raises(ParamsError, match="keep_tensors"):
            SwapParams(threshold=2, keep_tensors=value)
    assert SwapParams(threshold=2, keep_tensors=(n for n in ["f1:0"])).keep_tensors == ("f1:0",)
