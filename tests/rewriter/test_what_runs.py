"""What the step that runs holds, beside what its traced graph says: arithmetic Grappler removes
(``rewriter.tf_effects.passthrough``) and the constants a step's first call materialises (``memtrace.constant_bytes``)."""

from __future__ import annotations

import tests.tf_helpers as th  # noqa: F401, I001 -- first: configures TF before its runtime starts

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import rewriter
from rewriter.placement import memtrace
from rewriter.trace.tracing import trace_keras_step
from rewriter.tf_effects.passthrough import passthrough_input
from rewriter.check.collected import profiled_first_call
from simulator import SwapPlan, get_device, replay

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
