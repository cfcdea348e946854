"""A split step run in the micro-batch order (``simulator.ordering.micro_batch_order``, docs/design.md 12): each
part's forward and backward before the next part's, the weight gradients summed over the parts; it trains as
the split step does in any other order, and its peak is measured as predicted."""

from __future__ import annotations

import statistics

import tests.tf_tools as th  # noqa: I001 -- first: configures TF before its runtime starts

import numpy as np
import pytest

import rewriter
from simulator import SwapPlan, replay
from simulator.split import floor_after_splitting
from tests.rewriter.edit.test_split_parts import (BATCH, SEQUENCE, STEPS, VOCAB, _adamw_block, _assert_close, _batch,
                                                  _cnn, _split_plan, _transformer)

pytestmark = pytest.mark.tf

MEASURED_BATCH, MEASURED_PARTS = 16, 4


def test_the_micro_batch_order_measures_its_prediction_below_the_parts_side_by_side():
    """The AdamW encoder block at batch 16 in 4 parts, nothing swapped: in the micro-batch order the testbed's peak
    is the prediction within 5 % and a third under the memory order's (which keeps most parts' activations for
    their backward), and under 60 % of the step unsplit; three steps in either order give the same weights."""
    th.deterministic()
    measured_model = _adamw_block()  # captured and measured in both orders: its step is traced once
    graph = rewriter.capture(measured_model, MEASURED_BATCH)
    split = floor_after_splitting(graph, MEASURED_PARTS).split_graph
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(MEASURED_BATCH, SEQUENCE)).astype("int32")
    y = rng.integers(0, 3, size=(MEASURED_BATCH,)).astype("int32")
    found = {}
    for order in ("memory", "micro-batch"):
        g = split.with_order(order)
        plan = SwapPlan.empty(g).to_named(g)
        step = rewriter.apply(measured_model, plan, batch_size=MEASURED_BATCH, verify=False)
        peaks = [rewriter.measure(step, x, y, warmup=1, repeats=1).peak_bytes for _ in range(3)]
        model = _adamw_block()
        trained = rewriter.apply(model, plan, batch_size=MEASURED_BATCH, verify=False)
        for _ in range(STEPS):
            trained(x, y)
        found[order] = (replay(g, None, "cpu-testbed").peak_bytes, statistics.median(peaks), th.weights_of(model))
    unsplit = replay(graph.with_order("memory"), None, "cpu-testbed").peak_bytes
    print({order: found[order][:2] for order in found}, "unsplit", unsplit)
    (memory_predicted, memory_measured, memory_weights) = found["memory"]
    (predicted, measured, weights) = found["micro-batch"]
    assert abs(measured / predicted - 1) <= 0.05 and abs(memory_measured / memory_predicted - 1) <= 0.05
    assert measured < 0.75 * memory_measured and measured < 0.6 * unsplit
    assert all(np.array_equal(a, b) for a, b in zip(weights, memory_weights, strict=True))


@pytest.mark.parametrize("build", [_cnn, _transformer], ids=["cnn-bn-dropout", "transformer-ln"])
def test_a_split_step_in_the_micro_batch_order_trains_as_keras(build):
    """Three steps in parts of 3 and 2 samples, run one part after the other where no op mixes samples (the
    transformer) and where batch normalisation's moments make every part wait for all (the CNN): every weight
    within 1e-5 of its scale of Keras' own, as the split step in its captured order."""
    th.deterministic()
    plan, _ = _split_plan(build, order="micro-batch")
    assert plan.ordering == "micro-batch"
    model, reference = build(), build()
    x, y = _batch(model)
    step = rewriter.apply(model, plan, batch_size=BATCH, verify=False)
    for _ in range(STEPS):
        step(x, y)
        reference.train_on_batch(x, y)
    _assert_close(th.weights_of(model), th.weights_of(reference))
