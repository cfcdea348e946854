"""Training with the rewritten step (model.fit), plans from another process, the one-device testbed."""

from __future__ import annotations

import json

import tests.tf_tools as th  # noqa: I001 -- first: configures TF before its runtime starts

import numpy as np
import pytest

import rewriter
from benchmarks.models import build_model, example_batch
from simulator import SwapParams, plan_swaps

pytestmark = pytest.mark.tf

BATCH = 8


@pytest.fixture(scope="module")
def plan_json():
    model = build_model("small_cnn", seed=0)
    graph = rewriter.capture(model, BATCH)
    # activations of 4 KiB and more (see test_rewriter_apply: tiny BN statistics through Identity
    # change Grappler's arithmetic rewrite of the BN gamma gradient by ~1e-11)
    plan = plan_swaps(graph, SwapParams(threshold=1, min_bytes=4096))
    return plan.to_json(graph), plan.n_swaps


def test_fit_with_rewritten_step_equals_plain_fit(plan_json):
    th.deterministic()
    text, n_swaps = plan_json
    plain = build_model("small_cnn", seed=0, metrics=["accuracy"])
    swapped = build_model("small_cnn", seed=0, metrics=["accuracy"])
    x, y = example_batch(plain, 20)  # 8 + 8 + a last batch of 4
    step = rewriter.use_swap_step(swapped, text, batch_size=BATCH, swap_op="Identity", serialize=False)
    assert rewriter.swap_step_of(swapped) is step and step.n_swap_outs <= n_swaps
    history_swapped = swapped.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    history_plain = plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert history_swapped.history == history_plain.history  # loss and accuracy logs as Keras makes them
    assert th.bitwise_equal(th.weights_of(plain), th.weights_of(swapped))
    assert th.bitwise_equal(th.optimizer_state(plain), th.optimizer_state(swapped))
    assert (4, False) in step._others  # the last, smaller batch ran the same plan at its size
    assert swapped.train_on_batch(x[:BATCH], y[:BATCH]) == plain.train_on_batch(x[:BATCH], y[:BATCH])
    rewriter.restore_train_function(swapped)
    assert rewriter.swap_step_of(swapped) is None
    assert swapped.train_on_batch(x[:BATCH], y[:BATCH]) == plain.train_on_batch(x[:BATCH], y[:BATCH])


def test_swapping_context_and_sample_weights(plan_json):
    text, _ = plan_json
    model = build_model("small_cnn", seed=0)
    x, y = example_batch(model, BATCH)
    with rewriter.swapping(model, text, batch_size=BATCH) as step:
        assert rewriter.swap_step_of(model) is step
        model.fit(x, y, sample_weight=np.ones(BATCH), batch_size=BATCH, epochs=1, verbose=0)
        assert step._others[(BATCH, True)].weighted  # the plan on the step traced with the weights
    assert rewriter.swap_step_of(model) is None
    model.fit(x, y, sample_weight=np.ones(BATCH), batch_size=BATCH, epochs=1, verbose=0)  # plain again


def test_plan_json_applied_in_a_later_process(plan_json, tmp_path):
    """The simulator's JSON plan, written here, is applied in a fresh process (which also builds its
    model before the rewriter runs: the single-device testbed) and computes the same first step."""
    text, n_swaps = plan_json
    path = tmp_path / "plan.json"
    path.write_text(text)
    th.deterministic()
    reference = build_model("small_cnn", seed=0)
    x, y = example_batch(reference, BATCH)
    expected = float(rewriter.apply(reference, {"format": "swap-plan/1", "swaps": []}, batch_size=BATCH,
                                    verify=False)(x, y))
    result = th.run_python(f"""
        import json, tensorflow as tf
        tf.config.experimental.enable_op_determinism()
        from benchmarks.models import build_model, example_batch
        model = build_model("small_cnn", seed=0)          # TF initialises here, with one CPU device
        import rewriter
        step = rewriter.apply(model, {str(path)!r})       # batch size from the plan file
        x, y = example_batch(model, {BATCH})
        loss = float(step(x, y))
        m = rewriter.measure(step, x, y, warmup=1, repeats=1)
        print(json.dumps(dict(loss=loss, swaps=step.n_swap_outs, host=step.placement.host,
                              single=step.placement.single_device, ok=step.verification.ok,
                              outs=step.verification.swap_outs, recvs=step.verification.recvs,
                              peak=m.peak_bytes, host_peak=m.host_peak_bytes, on=m.measured_on)))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert 0 < data["swaps"] <= n_swaps and data["outs"] == data["swaps"] and data["ok"]
    assert data["single"] and data["host"] == "/device:CPU:0" and data["recvs"] == 0
    assert data["on"] == "cpu-testbed" and data["host_peak"] > 0
    assert abs(data["loss"] - expected) <= 1e-5 * abs(expected)


def test_single_device_testbed_measures_the_accelerator_side():
    """One CPU device (model built first): swap-outs are told apart by name, and the measured
    accelerator-side peak drops with swapping while the whole-process figure does not."""
    result = th.run_python("""
        import json, tensorflow as tf
        from benchmarks.models import build_model, example_batch
        model = build_model("unet2d", image_size=32, base_filters=8, depth=2, seed=0)
        import rewriter
        from simulator import SwapParams, SwapPlan, plan_swaps
        assert not rewriter.configure_testbed()            # too late: TF is initialised
        placement = rewriter.detect()
        g = rewriter.capture(model, 4)
        x, y = example_batch(model, 4)
        plain = rewriter.measure(rewriter.apply(model, SwapPlan.empty(g), graph=g, batch_size=4), x, y, warmup=1, repeats=1)
        step = rewriter.apply(model, plan_swaps(g, SwapParams(threshold=1)), graph=g, batch_size=4)
        swapped = rewriter.measure(step, x, y, warmup=1, repeats=1)
        print(json.dumps(dict(single=placement.single_device, host=placement.host, ok=step.verification.ok,
                              plain=plain.peak_bytes, swapped=swapped.peak_bytes, host_peak=swapped.host_peak_bytes)))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["single"] and data["host"] == "/device:CPU:0" and data["ok"]
    assert data["host_peak"] > 0
    assert data["swapped"] < 0.8 * data["plain"], data


# ---------------------------------------------------------------------- class_weight and sample_weight


CLASS_WEIGHT = {0: 0.5, 1: 2.0, 2: 1.0, 3: 3.0, 4: 0.25, 5: 1.5, 6: 1.0, 7: 0.75, 8: 2.5, 9: 1.25}


@pytest.mark.long  # Keras makes class weights per-sample ones: test_swapping_context_and_sample_weights
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

    from autotune.run.training import fit_weights_note
    from rewriter.trace.step_inputs import NO_STEP_INPUTS

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
        note = fit_weights_note(model, plan, BATCH, NO_STEP_INPUTS)
        assert (note is None) == takes_weights, note
        if not takes_weights:
            assert "class_weight or sample_weight cannot use this plan" in note and "unpack" in note
