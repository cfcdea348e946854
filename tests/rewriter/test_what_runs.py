"""What the step that runs holds, beside what its traced graph says: arithmetic Grappler removes
(``rewriter.tf_effects.passthrough``), the constants a step's first call materialises (``memtrace.constant_bytes``)
and the fused oneDNN ops a swapped step keeps (``simulator.fusion``)."""

from __future__ import annotations

import tests.tf_tools as th  # noqa: F401, I001 -- first: configures TF before its runtime starts

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import rewriter
from rewriter.check.collected import collect_first_call
from rewriter.placement import memtrace
from rewriter.trace.tracing import trace_keras_step
from rewriter.tf_effects.passthrough import passthrough_input
from rewriter.check.collected import profiled_first_call
from simulator import SwapParams, SwapPlan, get_device, plan_swaps, replay

pytestmark = pytest.mark.tf


def _ops_of(build, *specs):
    graph = tf.function(build).get_concrete_function(*specs).graph
    return {op.name: op for op in graph.get_operations()}


def test_arithmetic_with_ones_or_zeros_passes_an_operand_on():
    x = tf.TensorSpec((4, 8), tf.float32)

    def build(x):
        one = tf.constant(3.0) - tf.constant(2.0)  # folded to 1, as a dropout's maxval - minval
        tf.identity(x * one, name="times_one")
        tf.identity(tf.constant(1.0) * x, name="one_times")
        tf.identity(x / 1.0, name="over_one")
        tf.identity(x + 0.0, name="plus_zero")
        tf.identity(x - 0.0, name="minus_zero")
        tf.identity(x * 2.0, name="times_two")
        tf.identity(0.0 - x, name="zero_minus")  # Grappler makes it a Neg: an op of its own
        tf.identity(tf.ones((3, 4, 8)) * x, name="broadcast")  # the output is larger than x
        return x

    ops = _ops_of(build, x)
    passed = {name: passthrough_input(ops[name].inputs[0].op) for name in
              ("times_one", "one_times", "over_one", "plus_zero", "minus_zero", "times_two", "zero_minus",
               "broadcast")}
    assert passed == {"times_one": 0, "one_times": 1, "over_one": 0, "plus_zero": 0, "minus_zero": 0,
                      "times_two": None, "zero_minus": None, "broadcast": None}


def test_swish_gradient_reads_its_input_directly():
    """tf.nn.silu's beta * x (beta 1), in the forward pass and in the gradient that recomputes the
    sigmoid: Grappler removes both, so the captured graph has no such op and the prediction is the
    measured peak (EfficientNetB0 was predicted 10 % above it while they were counted)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 8))
    x = keras.layers.Conv2D(16, 3, padding="same", activation="swish")(inputs)
    x = keras.layers.Conv2D(16, 3, padding="same", activation="swish")(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(x)))
    model.compile(optimizer="sgd", loss="mse")
    graph = rewriter.capture(model, 4)
    assert (graph.op_type == "Sigmoid").sum() == 4  # two activations, each recomputed in its gradient
    traced = trace_keras_step(model, 4).concrete.graph
    betas = [op.name for op in traced.get_operations() if op.type == "Mul" and passthrough_input(op) is not None]
    assert len(betas) >= 4 and not set(betas) & set(graph.op_name)  # beta * x, twice per activation: gone
    x_batch = np.random.default_rng(0).normal(size=(4, 16, 16, 8)).astype("float32")
    step = rewriter.apply(model, SwapPlan.empty(graph), graph=graph, batch_size=4, verify=False)
    measured = rewriter.measure(step, x_batch, np.zeros((4, 2), "float32"), warmup=1, repeats=1).peak_bytes
    predicted = replay(graph, SwapPlan.empty(graph), get_device("cpu-testbed")).peak_bytes
    assert abs(predicted / measured - 1) <= 0.02, (predicted, measured)


def _trace(*events):
    return pd.DataFrame([{"kind": kind, "addr": addr, "requested_bytes": size, "tf_op": op}
                         for kind, addr, size, op in events])


def test_constants_are_the_kept_allocations_of_constant_nodes():
    events = _trace(("free", 1, 100, ""),               # a variable's buffer from before the call
                    ("alloc", 2, 100, "sgd/Mul"),        # ... replaced by this one, kept
                    ("alloc", 5, 100, "sgd/Mul_1"),      # a replacement whose old buffer is still held
                    ("alloc", 3, 1000, "conv"),          # a temporary
                    ("free", 3, 1000, ""),
                    ("alloc", 4, 64, "loss/Reshape_1"),  # a constant Grappler folded, kept by its kernel
                    ("alloc", 6, 32, "loss/truediv/_0__cf__0"))  # one the runtime folded
    assert memtrace.kept_allocations(events)["requested_bytes"].sum() == 100 + 100 + 64 + 32
    assert memtrace.constant_bytes(events, {"loss/Reshape_1", "sgd/Const"}) == 64 + 32


def test_on_a_gpu_only_the_devices_own_constants_count():
    """A GPU's trace holds its allocator and the pinned host's, which may hand out equal addresses."""
    events = _trace(("alloc", 7, 64, "loss/Reshape_1"), ("alloc", 7, 16, "host/Const"), ("free", 7, 16, ""),
                    ("alloc", 8, 32, "sgd/Const"))
    events["allocator_name"] = ["GPU_0_bfc", "gpu_host_bfc", "gpu_host_bfc", "gpu_host_bfc"]
    constants = {"loss/Reshape_1", "sgd/Const", "host/Const"}
    assert memtrace.constant_bytes(events, constants) == 64 + 32  # the host's free is not the device's
    assert memtrace.constant_bytes(events, constants, allocator_prefix="GPU_0_") == 64


def test_first_call_keeps_the_constants_it_folds():
    """A tile of constants is folded when the function first runs and held by its kernel from then on."""
    @tf.function
    def step(x):
        scale = tf.tile(tf.reshape(tf.range(1024, dtype=tf.float32), (1, 1024)), (64, 1))  # 256 KiB
        return tf.reduce_sum(x * scale)

    x = tf.ones((64, 1024))
    _, graphs, constants = profiled_first_call(step, x)
    assert graphs and 64 * 1024 * 4 <= constants < 64 * 1024 * 4 + 8192


FUSED_OPS = ("_MklNativeFusedConv2D", "_MklNativeFusedMatMul", "_MklSwish", "_MklNativeConv2DBackpropFilterWithBias")


def _fused_op_counts(step, x, y) -> dict[str, int]:
    """The fused oneDNN ops in the partition graphs of ``step``'s first call (one training step on x, y)."""
    _, graphs = collect_first_call(step, tf.constant(x), tf.constant(y))
    kinds = [node.op for function in graphs for part in function.partition_graphs for node in part.node]
    return {kind: kinds.count(kind) for kind in FUSED_OPS}


def _fusion_model():
    """Conv2D+BN+swish, a squeeze-excite style Conv2D+bias+swish, Dropout and Dense+bias+relu."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12, 12, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.Activation("swish")(keras.layers.BatchNormalization()(x))
    x = keras.layers.Conv2D(8, 1, activation="swish")(x)
    x = keras.layers.Dropout(0.2)(keras.layers.GlobalAveragePooling2D()(x))
    x = keras.layers.Dense(16, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def test_swaps_keep_onednns_forward_fusions_and_train_as_keras():
    """A plan that swaps across every fused chain (a threshold of one level: swish's Mul is two levels from
    the BN output it reads beside its Sigmoid) keeps the fusions Keras' step runs: the testbed's wait for a
    copy out lands past the chain and swish's two reads of x stay one tensor (``simulator.fusion``).
    Left in the chain, the wait or the swap-in kept them unfused and EfficientNetB0 drifted from Keras."""
    th.deterministic()
    batch = 4
    x = np.random.default_rng(0).normal(size=(batch, 12, 12, 3)).astype("float32")
    y = np.random.default_rng(1).normal(size=(batch, 3)).astype("float32")
    keras_model, model = _fusion_model(), _fusion_model()
    graph = rewriter.capture(model, batch)
    plan = plan_swaps(graph, SwapParams(threshold=1, min_bytes=256))
    swapped_types = {graph.op_type[graph.tensor_producer[t]] for t in plan.tensor}
    assert {"BiasAdd", "AddV2"} <= swapped_types, swapped_types  # swish inputs: the conv's bias, the BN's output
    plain = rewriter.apply(_fusion_model(), SwapPlan.empty(), batch_size=batch, serialize=False, verify=False)
    step = rewriter.apply(model, plan, graph=graph, batch_size=batch, verify=False)
    assert any(swap.started_by for swap in step.applied)  # the testbed's waits for copies out are there
    expected = _fused_op_counts(plain, x, y)
    assert all(expected[kind] for kind in FUSED_OPS) and expected["_MklSwish"] >= 2
    assert _fused_op_counts(step, x, y) == expected  # the first call: one training step
    for _ in range(2):
        step(x, y)
    for _ in range(3):
        keras_model.train_on_batch(x, y)
    assert th.max_relative_difference(th.weights_of(keras_model), th.weights_of(model)) <= 1e-6
    assert th.max_relative_difference(th.optimizer_state(keras_model), th.optimizer_state(model)) <= 1e-6
