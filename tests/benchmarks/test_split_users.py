"""Users' models that fit only split (``benchmarks.zoo.SPLIT_USERS``), small: splitting the ops that set the
floor lowers it, the rewriter builds the split, and three steps train as Keras' own
(``python -m benchmarks split-users`` runs the CLI on the full-size ones: benchmarks/results/split_user_models.md).
Augmentation layers' random draws end the region and are cut at its entry, so the parts use Keras' draws."""

from __future__ import annotations

import tests.tf_tools as th  # noqa: I001 -- first: configures TF before its runtime starts

import pytest

import rewriter
from benchmarks.zoo import ZooModel
from simulator import SwapParams, SwapPlan, plan_swaps, replay
from simulator.split import floor_after_splitting

pytestmark = pytest.mark.tf

STEPS = 3
PARTS = 2
BATCH = 5  # parts of 3 and 2 samples: uneven
TOLERANCE = 1e-5  # of a weight's scale after three steps (tests/rewriter/edit/test_split_parts.py)

SMALL_USERS = {
    "augmented_cnn": ZooModel("augmented_cnn_16", "augmentation", "augmented_cnn", BATCH, {"image_size": 16}),
    "metrics_cnn": ZooModel("metrics_cnn_16", "metrics", "metrics_cnn", BATCH, {"image_size": 16}),
    "video_classifier": ZooModel("video_classifier_12", "time_distributed", "video_classifier", BATCH,
                                 {"frames": 3, "image_size": 12}),
    "frozen_backbone": ZooModel("frozen_backbone_32", "transfer", "frozen_backbone", BATCH,
                                {"alpha": 0.35, "image_size": 32}),
}
# a keras.applications backbone (its capture and apply take longer), and the CNN compiled with metrics (the
# augmented CNN and the video classifier split in the default run): -m long
LONG = {"frozen_backbone", "metrics_cnn"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.long) if n in LONG else n for n in SMALL_USERS])
def test_a_users_model_splits_and_trains_as_keras(name):
    th.deterministic()
    entry = SMALL_USERS[name]
    graph = rewriter.capture(entry.build(), BATCH)
    peak = replay(graph, None, "cpu-testbed").peak_bytes
    found = floor_after_splitting(graph, PARTS)
    assert found.regions and found.split_floor_bytes < found.floor_bytes <= peak, found.stop_reason
    if name == "augmented_cnn":  # the draws end the region, named: they are not drawn again per part
        assert any("random numbers" in why for _, why in found.ends)
    model, reference = entry.build(), entry.build()
    x, y = entry.example_batch(model)
    step = rewriter.apply(model, SwapPlan.empty(found.split_graph).to_named(found.split_graph), batch_size=BATCH)
    assert step.verification.ok and step.split
    for _ in range(STEPS):
        step(x, y)
        reference.train_on_batch(x, y)
    floating = [i for i, w in enumerate(reference.weights) if "float" in str(w.dtype)]
    split, keras_ = th.weights_of(model), th.weights_of(reference)
    assert th.max_relative_difference([split[i] for i in floating], [keras_[i] for i in floating]) <= TOLERANCE


def test_a_split_steps_swap_ins_wait_for_triggers_grappler_keeps():
    """The TimeDistributed model's backward transposes a part back from ``(frames, batch, ...)``; Grappler moves
    such a transpose's control edges to its input, so a swap-in triggered there would start early. A split step's
    triggers are parts that compute (``simulator.planning.LAYOUT_OP_TYPES`` never): every swap-in waits where
    planned."""
    entry = SMALL_USERS["video_classifier"]
    found = floor_after_splitting(rewriter.capture(entry.build(), BATCH), PARTS)
    plan = plan_swaps(found.split_graph, SwapParams(threshold=10, lb=2, ub=8, min_bytes=4, order="cto"),
                      kept_reads=rewriter.detect().kept_reads)
    model = entry.build()
    step = rewriter.apply(model, plan.to_named(found.split_graph), batch_size=BATCH)
    step(*entry.example_batch(model))
    result = step.verification
    assert plan.n_swaps > 20 and step.split
    assert result.ok and not result.triggers_moved and not result.copies_early, result.triggers_moved[:3]
