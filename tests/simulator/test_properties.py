"""Properties of levels, plans and replays on random DAGs with control edges (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator import (BACKWARD, FORWARD, SwapParams, categorized_levels, edge_distances, execution_order, n_levels,
                       plan_swaps, replay)
from simulator.buffers import peak_lower_bound_bytes
from simulator.fusion import safe_wait_slots
from simulator.ordering import ORDERS, position_of
from simulator.synthetic import OpSpec, from_spec
from tests.conftest import unit_device

TYPES = ["Conv2D", "MatMul", "Relu", "AddV2", "Conv2DBackpropInput", "ReluGrad", "Mul"]


@st.composite
def random_steps(draw):
    """A random DAG: ops in topological order, the first part forward, the rest backward."""
    n = draw(st.integers(2, 28))
    n_forward = draw(st.integers(1, n - 1))
    specs = []
    for i in range(n):
        inputs = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        controls = draw(st.lists(st.integers(0, i - 1), max_size=1, unique=True)) if i else []
        controls = [c for c in controls if c not in inputs]
        specs.append(OpSpec(
            f"op{i}", draw(st.sampled_from(TYPES)), FORWARD if i < n_forward else BACKWARD,
            [f"op{k}" for k in inputs], ((0, draw(st.integers(0, 1000))),), flops=draw(st.integers(1, 5)),
            control_inputs=[f"op{k}" for k in controls], forwards_input=draw(st.booleans()),
        ))
    outputs = [f"op{n - 1}"]
    return from_spec(specs, outputs=outputs, persistent_bytes=(draw(st.integers(0, 100)), 0))


@st.composite
def random_params(draw):
    lb = draw(st.integers(1, 4))
    return SwapParams(threshold=draw(st.integers(1, 6)), lb=lb, ub=draw(st.integers(lb, 10)),
                      groupby=draw(st.integers(0, 3)), sync=draw(st.sampled_from(["none", "out", "in", "both"])),
                      trigger=draw(st.sampled_from(["ancestor", "level"])),
                      order=draw(st.sampled_from(["cto", "memory"])), distance=draw(st.sampled_from(["level", "slot"])),
                      after_copies_out=draw(st.booleans()))


# hypothesis' default 100 examples a property in the default run; ``--hypothesis-profile thorough`` (tests/conftest.py)
# tries 1,000
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(random_steps())
def test_levels_are_a_topological_order(g):
    levels = categorized_levels(g)
    producer_level = levels[g.tensor_producer[g.edge_tensor]]
    assert np.all(levels[g.edge_consumer] > producer_level)
    assert np.all(levels[g.control_dst] > levels[g.control_src])
    assert np.all(edge_distances(g) >= 1)
    # every op on level k > 0 has a predecessor on level k - 1 (longest-path depth, not any order)
    for op in np.flatnonzero(levels > 0):
        preds = np.concatenate([g.tensor_producer[g.edge_tensor[g.edge_consumer == op]], g.control_src[g.control_dst == op]])
        assert levels[preds].max() == levels[op] - 1


@SETTINGS
@given(random_steps())
def test_every_order_is_topological(g):
    src = np.concatenate([g.tensor_producer[g.edge_tensor], g.control_src])
    dst = np.concatenate([g.edge_consumer, g.control_dst])
    for name in ORDERS:
        view = g.with_order(name)
        order, position = execution_order(view), position_of(view)
        assert sorted(order.tolist()) == list(range(g.n_ops))
        assert np.all(position[src] < position[dst])


@SETTINGS
@given(random_steps(), random_params())
def test_threshold_beyond_the_levels_swaps_nothing(g, params):
    beyond = n_levels(g) if params.distance == "level" else g.n_ops
    big = SwapParams(threshold=beyond, lb=params.lb, ub=params.ub, order=params.order, distance=params.distance)
    plan = plan_swaps(g, big)
    assert plan.n_swaps == 0
    device = unit_device()
    assert replay(g, plan, device).as_dict() == replay(g.with_order(params.order), None, device).as_dict()


@SETTINGS
@given(random_steps(), random_params())
def test_free_transfers_never_raise_the_peak(g, params):
    device = unit_device(bandwidth_bytes_per_s=float("inf"))
    base = replay(g.with_order(params.order), None, device)
    plan = plan_swaps(g, params)
    result = replay(g, plan, device)
    ordered = g.with_order(plan.order_name)
    fused, _ = safe_wait_slots(ordered, plan.tensor[plan.in_swap], plan.in_trigger,
                               plan.in_after, plan.in_consumer_ptr, plan.in_consumers)
    # unless a swap-in had to start before the op it would wait for, which may be fused into its
    # consumer (test_sync_swap_in_cannot_wait_for_an_op_fused_into_its_consumer): then it can
    # come back while the original is still live
    if not fused.any():
        assert result.peak_bytes <= base.peak_bytes


@SETTINGS
@given(random_steps(), random_params(), st.floats(1.0, 1000.0), st.floats(0.0, 2.0))
def test_no_plan_goes_below_the_working_set_bound(g, params, bandwidth, latency):
    result = replay(g, plan_swaps(g, params), unit_device(bandwidth, latency))
    assert result.peak_bytes >= peak_lower_bound_bytes(g)


@SETTINGS
@given(random_steps(), random_params(), st.floats(1.0, 1000.0), st.floats(0.0, 2.0))
def test_consumers_wait_for_their_swap_in(g, params, bandwidth, latency):
    plan = plan_swaps(g, params)
    r = replay(g, plan, unit_device(bandwidth, latency))
    ordered = g.with_order(plan.order_name)
    # a trigger that may be fused into a consumer is replaced by the op the rewriter waits for
    fused, safe_slot = safe_wait_slots(ordered, plan.tensor[plan.in_swap], plan.in_trigger,
                                       plan.in_after, plan.in_consumer_ptr, plan.in_consumers)
    for j in range(plan.n_swap_ins):
        consumers = plan.in_consumers[plan.in_consumer_ptr[j]:plan.in_consumer_ptr[j + 1]]
        assert np.all(r.op_start_s[consumers] >= r.swap_in_end_s[j] - 1e-9)
        # and the swap-in starts only after its data reached the host and its trigger ran
        swap = plan.in_swap[j]
        assert r.swap_in_start_s[j] >= r.swap_out_end_s[swap] - 1e-9
        if fused[j] and safe_slot[j] >= 0:
            assert r.swap_in_start_s[j] >= r.op_end_s[execution_order(ordered)[safe_slot[j]]] - 1e-9
        if plan.in_trigger[j] >= 0 and not fused[j]:
            assert r.swap_in_start_s[j] >= r.op_end_s[plan.in_trigger[j]] - 1e-9
            if plan.after_copies_out:  # and after the copies out of what its trigger made
                made = g.tensor_producer[plan.tensor] == plan.in_trigger[j]
                assert np.all(r.swap_in_start_s[j] >= r.swap_out_end_s[made] - 1e-9)
    assert r.step_s >= r.compute_s - 1e-9
    assert r.peak_bytes >= g.persistent_bytes
