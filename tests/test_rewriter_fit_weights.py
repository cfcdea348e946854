"""model.fit with class_weight or sample_weight on the rewritten step: the weights only weight the
loss, so the plan is applied to the step traced with them as one more input (``rewriter.keras``)
and trains as Keras' own step does."""

from __future__ import annotations

import tests.tf_helpers as th  # noqa: I001 -- first: configures TF before its runtime starts

import numpy as np
import pytest

import rewriter
from benchmarks.models import build_model, example_batch
from simulator import SwapParams, plan_swaps

pytestmark = pytest.mark.tf

BATCH = 8
CLASS_WEIGHT = {0: 0.5, 1: 2.0, 2: 1.0, 3: 3.0, 4: 0.25, 5: 1.5, 6: 1.0, 7: 0.75, 8: 2.5, 9: 1.25}


def test_class_weight_with_the_plan_trains_as_plain_fit_does():
    th.deterministic()
    model = build_model("small_cnn", seed=0)
    graph = rewriter.capture(model, BATCH)
    plan = plan_swaps(graph, SwapParams(threshold=1, min_bytes=4096))
    assert plan.n_swaps > 0
    plain = build_model("small_cnn", seed=0)
    swapped = build_model("small_cnn", seed=0)
    x, y = example_batch(plain, 20)  # 8 + 8 + a last batch of 4
    assert set(np.unique(y)) <= set(CLASS_WEIGHT)
    step = rewriter.use_swap_step(swapped, plan.to_json(graph), batch_size=BATCH, swap_op="Identity", serialize=False)
    weighted = swapped.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, class_weight=CLASS_WEIGHT)
    reference = plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, class_weight=CLASS_WEIGHT)
    assert step._others[(BATCH, True)].n_swap_outs == step.n_swap_outs  # every swap of the plan, with the weights
    assert (4, True) in step._others  # the last, smaller batch too
    np.testing.assert_allclose(weighted.history["loss"], reference.history["loss"], rtol=1e-6)
    for mine, theirs in zip(th.weights_of(swapped), th.weights_of(plain), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-7)
    # the weights matter: without them the same start trains to other weights
    unweighted = build_model("small_cnn", seed=0)
    unweighted.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert not all(np.allclose(a, b) for a, b in zip(th.weights_of(unweighted), th.weights_of(plain)))


def test_a_train_step_that_takes_no_weights_is_said_at_tuning_time():
    """A model whose train_step unpacks (x, y) cannot take a weight per sample: the tuning says so
    (autotune.training.fit_weights_note), a model with Keras' own train_step can."""
    import keras
    import tensorflow as tf

    from autotune.training import fit_weights_note

    class Unweighted(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
            return {"loss": loss}

    def build(cls):
        inputs = keras.Input((6,))
        model = cls(inputs, keras.layers.Dense(3)(keras.layers.Dense(16, activation="relu")(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        return model

    for cls, takes_weights in ((keras.Model, True), (Unweighted, False)):
        model = build(cls)
        graph = rewriter.capture(model, BATCH)
        plan = plan_swaps(graph, SwapParams(threshold=1)).to_named(graph)
        note = fit_weights_note(model, plan, BATCH)
        assert (note is None) == takes_weights, note
        if not takes_weights:
            assert "class_weight or sample_weight cannot use this plan" in note and "unpack" in note
