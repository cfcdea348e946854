"""Exact graph rewrites (rewriter.trace.graph_rewrites): what they change, and that the step still
computes the same update."""

from __future__ import annotations

import tests.tf_tools as th  # noqa: I001 -- first: configures TF before its runtime starts

import numpy as np
import pytest
import tensorflow as tf

import rewriter
from benchmarks.models import build_model, example_batch
from rewriter.trace.tracing import CaptureError, capture, capture_step
from simulator import SwapParams, SwapPlan, plan_swaps, replay
from simulator.buffers import op_working_set_bytes

pytestmark = pytest.mark.tf
UNET = dict(size=16, base_filters=4, depth=2)


@pytest.fixture(scope="module")
def unet():
    """One small 3D U-Net and its step captured plain, with split-concat, and with both rewrites: the
    tests read them (a capture costs seconds) and leave the model's variables as they found them."""
    model = build_model("unet3d", seed=0, **UNET)
    return (model, capture(model, 2), capture(model, 2, graph_rewrites=["split-concat"]),
            capture(model, 2, graph_rewrites=["split-concat", "elide-broadcasts"]))


def _state(model) -> list[np.ndarray]:
    return th.weights_of(model) + th.optimizer_state(model)


def _restore(model, state) -> None:
    for variable, value in zip(list(model.weights) + list(model.optimizer.variables), state, strict=True):
        variable.assign(value)


def _update(model, plan, graph, x, y, start) -> list[np.ndarray]:
    """The change one step of ``plan`` makes to every variable, from ``start`` (restored after it)."""
    _restore(model, start)
    step = rewriter.apply(model, plan, graph=graph, batch_size=len(x))
    step(x, y)
    after = _state(model)
    _restore(model, start)
    return [a - before for a, before in zip(after, start, strict=True)]


def test_split_concat_removes_the_concatenations_and_keeps_the_update(unet):
    model, plain, split, _ = unet
    assert split.meta["graph_rewrites"] == ["split-concat"]
    assert split.meta["graph_rewrite_changes"]["split-concat"] == ["unet3d_1/up1_concat_1/concat",
                                                                   "unet3d_1/up0_concat_1/concat"]
    assert "ConcatV2" in set(plain.op_type)
    # the only ConcatV2 left join the per-part kernel gradients (weight-sized, no batch dimension)
    joins = np.flatnonzero(split.op_type == "ConcatV2")
    assert len(joins) == 2 and all(split.tensor_bytes_ab[np.flatnonzero(split.tensor_producer == op), 1].sum() == 0
                                   for op in joins)
    assert op_working_set_bytes(split).max() < op_working_set_bytes(plain).max()
    assert replay(split, None, "cpu-testbed").peak_bytes < replay(plain, None, "cpu-testbed").peak_bytes
    # readers of the replaced ops read tensors of the same names
    assert "unet3d_1/up0_conv1_1/convolution:0" in split.tensor_index()

    x, y = example_batch(model, 2)
    start = _state(model)
    reference = _update(model, SwapPlan.empty(plain), plain, x, y, start)
    rewritten = _update(model, SwapPlan.empty(split), split, x, y, start)
    swapped = _update(model, plan_swaps(split, SwapParams(threshold=1)), split, x, y, start)
    # a wrong kernel slice or part order moves whole updates; float rounding moves them by ~1e-4
    assert th.max_relative_difference(rewritten, reference) < 2e-3
    assert th.max_relative_difference(swapped, reference) < 2e-3


def test_split_concat_plan_carries_the_rewrite_and_apply_redoes_it(unet):
    model, _, split, _ = unet
    plan = plan_swaps(split, SwapParams(threshold=2)).to_dict(split)
    assert plan["graph_rewrites"] == ["split-concat"]
    assert any("/part" in name for name in plan["order"])
    step = rewriter.apply(model, plan, batch_size=2)
    assert step.n_swap_outs > 0 and step.verification.ok
    with pytest.raises(rewriter.PlanError, match="graph rewrite"):
        rewriter.apply(model, dict(plan, graph_rewrites=["no-such-rewrite"]), batch_size=2)
    with pytest.raises(CaptureError, match="unknown graph rewrite"):
        capture(model, 2, graph_rewrites=["no-such-rewrite"])


def test_a_concatenation_read_elsewhere_stays_whole():
    """The rewrite needs the convolution (and its gradients) to be the concatenation's only readers."""
    kernel = tf.Variable(tf.random.stateless_normal((3, 3, 4, 2), seed=(1, 2)))

    def step_of(read_elsewhere: bool):
        def step(a, b):
            with tf.GradientTape() as tape:
                joined = tf.concat([a * kernel[0, 0, 0, 0], b], axis=-1)
                loss = tf.reduce_mean(tf.nn.conv2d(joined, kernel, 1, "SAME"))
                if read_elsewhere:
                    loss += tf.reduce_mean(joined)
            kernel.assign_sub(0.1 * tape.gradient(loss, kernel))
            return loss
        return step

    def specs(batch):
        return [tf.TensorSpec((batch, 8, 8, 2), tf.float32)] * 2

    alone = capture_step(step_of(False), specs, 2, graph_rewrites=["split-concat"])
    assert alone.meta["graph_rewrites"] == ["split-concat"]
    shared = capture_step(step_of(True), specs, 2, graph_rewrites=["split-concat"])
    assert "graph_rewrites" not in shared.meta and "ConcatV2" in set(shared.op_type)


def test_tuning_points_to_the_rewrite_when_a_concatenation_sets_the_floor(unet):
    """A budget below what any swap plan can reach because of a U-Net's concatenation: the note says
    which op and that --rewrite split-concat removes it; on the rewritten graph it says no such thing."""
    from autotune.run.tuning import tune_graph
    from simulator.buffers import peak_lower_bound_bytes

    _, plain, split, both = unet
    budget = (plain.persistent_bytes + peak_lower_bound_bytes(plain)) // 2
    result = tune_graph(plain, device="cpu-testbed", memory=budget, trials=5, progress=False)
    assert any("ConcatV2" in n and "--rewrite split-concat" in n for n in result.notes), result.notes
    budget = (split.persistent_bytes + peak_lower_bound_bytes(split)) // 2
    result = tune_graph(split, device="cpu-testbed", memory=budget, trials=5, progress=False)
    assert any("no swap plan can fit" in n for n in result.notes)
    assert not any("split-concat" in n for n in result.notes), result.notes
    # the batch norms' tiled gradients are left: the other rewrite is pointed to, until it is made
    assert any("--rewrite elide-broadcasts" in n for n in result.notes), result.notes
    budget = (both.persistent_bytes + peak_lower_bound_bytes(both)) // 2
    result = tune_graph(both, device="cpu-testbed", memory=budget, trials=5, progress=False)
    assert any("no swap plan can fit" in n for n in result.notes), result.notes
    assert not any("--rewrite" in n for n in result.notes), result.notes


def test_elide_broadcasts_shrinks_the_batch_norm_gradient_and_keeps_the_update(unet):
    """Keras' batch norm: its moments' gradients tile per-channel values to the activation's shape;
    the rewrite divides them per channel, sums the terms by broadcasting adds, same update."""
    model, _, split, both = unet
    assert both.meta["graph_rewrites"] == ["split-concat", "elide-broadcasts"]
    dropped = both.meta["graph_rewrite_changes"]["elide-broadcasts"]
    n_norms = sum(1 for layer in model.layers if isinstance(layer, tf.keras.layers.BatchNormalization))
    assert len(dropped) == 2 * n_norms and all(name.endswith(("moments/Tile", "moments/Tile_1")) for name in dropped)
    assert "Tile" not in set(both.op_type)
    # the sums of full-shape terms that read a tiled term are chains of adds now
    assert (both.op_type == "AddN").sum() < (split.op_type == "AddN").sum()
    assert op_working_set_bytes(both).max() <= op_working_set_bytes(split).max()
    from simulator.buffers import peak_lower_bound_bytes
    assert peak_lower_bound_bytes(both) < peak_lower_bound_bytes(split)

    x, y = example_batch(model, 2)
    start = _state(model)
    reference = _update(model, SwapPlan.empty(split), split, x, y, start)
    rewritten = _update(model, SwapPlan.empty(both), both, x, y, start)
    swapped = _update(model, plan_swaps(both, SwapParams(threshold=1, distance="slot", tensors="all")), both, x, y,
                      start)
    # a term summed twice or dropped moves whole updates; the order of the additions by ~1e-6
    assert th.max_relative_difference(rewritten, reference) < 2e-3
    assert th.max_relative_difference(swapped, reference) < 2e-3


def test_a_broadcast_read_by_an_op_that_does_not_broadcast_stays():
    weight = tf.Variable(tf.ones((3,)))

    def step_of(reader):
        def step(x):
            with tf.GradientTape() as tape:
                tiled = tf.tile(tf.reduce_mean(x, axis=(0, 1), keepdims=True), (4, 5, 1)) / 2.0
                loss = tf.reduce_sum(reader(tiled, x * weight))
            weight.assign_sub(0.1 * tape.gradient(loss, weight))
            return loss
        return step

    def specs(batch):
        return [tf.TensorSpec((4, 5, 3), tf.float32)]

    def dropped(reader) -> list[str]:
        graph = capture_step(step_of(reader), specs, 2, graph_rewrites=["elide-broadcasts"])
        return graph.meta.get("graph_rewrite_changes", {}).get("elide-broadcasts", [])

    assert "Tile" in dropped(lambda t, x: t * x)  # the forward tile; a gradient's may go too
    assert "Tile" not in dropped(lambda t, x: tf.concat([t, x], -1))
