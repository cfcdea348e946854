"""The micro-batch order of a split step (``simulator.ordering.micro_batch_order``, docs/design.md 12): each
part's forward and backward before the next part's, where nothing but the combines joins the parts."""

from __future__ import annotations

import numpy as np

from simulator import BACKWARD, FORWARD, UPDATE, replay
from simulator.graph import part_of_op
from simulator.ordering import execution_order, orders_of
from simulator.split import SplitRegion, floor_after_splitting, with_splits
from simulator.synthetic import OpSpec, from_spec, training_graph
from tests.conftest import unit_device

PARTS = 4


def _layers():
    """Three layers, a loss summed over the batch, their gradients (each layer's weight gradient a sum over the
    batch, read by its update): per sample 100 B an activation and a gradient."""
    return from_spec([
        OpSpec("x0", "Conv2D", FORWARD, [], ((0.0, 100.0),), flops=(0.0, 10.0)),
        OpSpec("x1", "Relu", FORWARD, ["x0"], ((0.0, 100.0),), flops=(0.0, 1.0)),
        OpSpec("x2", "Conv2D", FORWARD, ["x1"], ((0.0, 100.0),), flops=(0.0, 10.0)),
        OpSpec("loss", "Sum", FORWARD, ["x2"], (4,), flops=(0.0, 1.0)),
        OpSpec("g2", "Mul", BACKWARD, ["x2"], ((0.0, 100.0),), flops=(0.0, 1.0)),
        OpSpec("dw2", "Conv2DBackpropFilter", BACKWARD, ["x1", "g2"], (64,), flops=(0.0, 10.0)),
        OpSpec("g1", "Conv2DBackpropInput", BACKWARD, ["g2"], ((0.0, 100.0),), flops=(0.0, 10.0)),
        OpSpec("g0", "ReluGrad", BACKWARD, ["g1", "x0"], ((0.0, 100.0),), flops=(0.0, 1.0)),
        OpSpec("dw0", "Conv2DBackpropFilter", BACKWARD, ["g0"], (64,), flops=(0.0, 10.0)),
        OpSpec("u2", "AssignSubVariableOp", UPDATE, ["dw2"], (4,)),
        OpSpec("u0", "AssignSubVariableOp", UPDATE, ["dw0"], (4,)),
    ], outputs=["loss", "u0", "u2"], batch_size=8)


def _split_step():
    g = _layers()
    return g, floor_after_splitting(g, PARTS).split_graph


def test_each_part_runs_forward_and_backward_before_the_next():
    """Ops of part i all run before any of part i + 1; an op outside the parts runs once the parts it waits for
    ran (the running combines between, the updates after the last); the peak without swapping is about a part's
    activations, where level order runs the parts side by side (on a step this small the memory order's greedy
    choice finds the same; on a transformer block it keeps 1.5x more, tests/rewriter/edit/test_micro_batches.py)."""
    g, split = _split_step()
    part = part_of_op(split)
    assert part.max() == PARTS - 1 and split.n_ops > 3 * g.n_ops
    order = execution_order(split.with_order("micro-batch"))
    assert sorted(order.tolist()) == list(range(split.n_ops))
    ran = part[order]
    assert (np.diff(ran[ran >= 0]) >= 0).all()
    position = {str(split.op_name[op]): k for k, op in enumerate(order)}
    assert position["u0"] > position["dw0/split_part_3"] and position["u2"] > position["dw2/split_part_3"]
    device = unit_device()
    micro, memory, level = (replay(split.with_order(name), None, device) for name in ("micro-batch", "memory", "cto"))
    assert micro.peak_bytes <= memory.peak_bytes and micro.peak_bytes < 0.5 * level.peak_bytes
    assert micro.peak_bytes < 0.5 * replay(g.with_order("memory"), None, device).peak_bytes
    assert micro.compute_s == level.compute_s  # the same ops, run in another order


def test_only_a_split_step_has_the_micro_batch_order():
    g = training_graph(6, seed=3, batch_size=8)
    split = floor_after_splitting(g, PARTS).split_graph
    assert "micro-batch" in orders_of(split) and "micro-batch" not in orders_of(g)
    assert np.array_equal(execution_order(g.with_order("micro-batch")), execution_order(g.with_order("memory")))


def test_parts_that_wait_for_every_part_run_when_they_can():
    """A batch sum every part's backward reads (a batch norm's moments): no part's backward runs before the last
    part's forward, and the order is still one the step can run."""
    g = from_spec([
        OpSpec("x", "Conv2D", FORWARD, [], ((0.0, 100.0),)),
        OpSpec("moments", "Sum", FORWARD, ["x"], (4,)),
        OpSpec("y", "Mul", FORWARD, ["x", "moments"], ((0.0, 100.0),)),
        OpSpec("loss", "Sum", FORWARD, ["y"], (4,)),
        OpSpec("dy", "Mul", BACKWARD, ["loss", "y"], ((0.0, 100.0),)),
        OpSpec("dx", "Mul", BACKWARD, ["dy", "moments"], ((0.0, 100.0),)),
        OpSpec("dw", "Sum", BACKWARD, ["dx", "x"], (4,)),
    ], outputs=["dw"], batch_size=4)
    split = with_splits(g, [SplitRegion(tuple(g.op_name.tolist()), 2)])
    order = execution_order(split.with_order("micro-batch"))
    position = {str(split.op_name[op]): k for k, op in enumerate(order)}
    assert position["y/split_part_0"] > position["x/split_part_1"]  # the moments' combine waits for both parts
    for op in range(split.n_ops):  # topological
        assert all(position[str(split.op_name[p])] < position[str(split.op_name[op])]
                   for p in split.tensor_producer[split.edge_tensor[split.edge_consumer == op]])
