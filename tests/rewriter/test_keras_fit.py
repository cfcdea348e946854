"""Training with the rewritten step (model.fit), plans from another process, the one-device testbed."""

from __future__ import annotations

import json

import tests.tf_helpers as th  # noqa: I001 -- first: configures TF before its runtime starts

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
    assert 4 in step._others  # the last, smaller batch ran the same plan at its size
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
        with pytest.raises(ValueError, match="sample_weight"):
            model.fit(x, y, sample_weight=np.ones(BATCH), batch_size=BATCH, epochs=1, verbose=0)
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
        model = build_model("unet2d", image_size=64, base_filters=8, depth=2, seed=0)
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
