"""rewriter.edit.recompute_clones: recomputations built in the real step compute what Keras computes, survive Grappler,
and refuse what must not be recomputed (docs/design.md 9)."""

from __future__ import annotations

import tests.tf_tools as th  # noqa: I001 -- first: configures TF before its runtime starts

import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import rewriter
from benchmarks.models import build_model, example_batch
from benchmarks.zoo import ZooModel
from rewriter.step import gpu_graph as gpu
from rewriter.edit.chain_order import partners_adjacent
from rewriter.edit.graph_edit import GraphEditor
from rewriter.edit.graph_refs import Ancestry
from rewriter.tf_effects.grappler import fixed_grappler_config, foldable_ops
from simulator.plan import PlanError
from rewriter.trace.tracing import import_step
from rewriter.tf_effects.passthrough import passthrough_ops
from rewriter.edit.recompute_clones import CLONE_ATTR, KEEP_ATTR, apply_recomputes, unclonable_reason
from rewriter.check.collected import collect_first_call
from rewriter.check.recompute_check import check_recomputes
from simulator import SwapParams, get_device, plan_swaps, replay
from simulator.graph import BACKWARD, FORWARD
from simulator.planning import TRIGGER_OP_TYPES
from simulator.recompute.actions import Recompute, clone_name, with_recomputes
from simulator.recompute.choice import recomputed_graph

pytestmark = pytest.mark.tf

# ops the tests never clone: what recomputation is for is cheap ops (convolutions and matrix products
# are cloned in one test, to show they can be)
_EXPENSIVE = frozenset({"Conv2D", "MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "DepthwiseConv2dNative"})


def far_read_actions(graph, traced, *, chain: int = 3, expensive: bool = False) -> list[Recompute]:
    """One action per forward tensor that backward ops read, made by a pure op: that op and up to
    ``chain - 1`` pure forward ops before it (along first inputs) are cloned; its trigger is a backward
    op of a trigger type a few edges before a far reader, that depends on none of them and that
    Grappler keeps (tensors without one are left out, as the simulator leaves them)."""
    graph_def = traced.concrete.graph.as_graph_def()
    foldable = foldable_ops(traced.concrete)
    nodes = {node.name: node for node in graph_def.node}
    ancestry = Ancestry(graph_def)
    names = graph.op_name.astype(str)
    index = {name: i for i, name in enumerate(names)}

    def clonable(op: int) -> bool:
        return (graph.op_phase[op] == FORWARD and (expensive or graph.op_type[op] not in _EXPENSIVE)
                and unclonable_reason(nodes[names[op]]) is None)

    tf_tensors = {t.name for op in traced.concrete.graph.get_operations() for t in op.outputs}
    actions = []
    for tensor in range(graph.n_tensors):
        producer = int(graph.tensor_producer[tensor])
        if graph.tensor_name(tensor) not in tf_tensors:  # oneDNN's pooling workspace, kernels' scratch
            continue
        if graph.tensor_persistent[tensor] or not clonable(producer):
            continue
        readers = graph.edge_consumer[graph.edge_tensor == tensor]
        far = sorted({str(names[c]) for c in readers if graph.op_phase[c] == BACKWARD})
        if not far:
            continue
        ops = [producer]
        while len(ops) < chain:
            inputs = graph.edge_tensor[(graph.edge_consumer == ops[0]) & (graph.edge_slot == 0)]
            if len(inputs) != 1 or not clonable(int(graph.tensor_producer[inputs[0]])) \
                    or graph.tensor_persistent[inputs[0]]:
                break
            ops.insert(0, int(graph.tensor_producer[inputs[0]]))
        trigger = _trigger(graph, [index[c] for c in far], lambda w: w not in foldable and not any(
            ancestry.depends(w, c) for c in far))
        if trigger is not None:
            actions.append(Recompute(graph.tensor_name(tensor), tuple(str(names[op]) for op in ops), trigger,
                                     tuple(far)))
    return actions


def _trigger(graph, far: list[int], usable, depth: int = 4) -> str | None:
    """A backward op of the simulator's trigger types (``simulator.planning.TRIGGER_OP_TYPES``) among
    the far readers' ancestors, nearest first, that ``usable`` accepts."""
    frontier, seen = list(far), set(far)
    for _ in range(depth):
        parents = []
        for op in frontier:
            for tensor in graph.edge_tensor[graph.edge_consumer == op]:
                parent = int(graph.tensor_producer[tensor])
                if parent not in seen and graph.op_phase[parent] == BACKWARD:
                    seen.add(parent)
                    parents.append(parent)
        for parent in parents:
            name = str(graph.op_name[parent])
            if graph.op_type[parent] in TRIGGER_OP_TYPES and usable(name):
                return name
        frontier = parents
    return None


def _flat(traced, x, y) -> list[tf.Tensor]:
    xs, ys = traced.inputs.flatten(x, y)
    return [tf.convert_to_tensor(v) for v in xs + ys]


def _train_and_compare(build, batch: int, *, steps: int = 3, chain: int = 3, expensive: bool = False):
    """Train ``steps`` steps with every far-read tensor recomputed and with Keras' train_on_batch;
    return (recomputed model weights, Keras weights, verification, actions)."""
    th.deterministic()
    graph = rewriter.capture(build(), batch)
    model, reference = build(), build()
    x, y = example_batch(model, batch)
    traced = rewriter.trace_keras_step(model, batch)
    actions = far_read_actions(graph, traced, chain=chain, expensive=expensive)
    assert actions, "no tensor to recompute"
    graph_def, applied = apply_recomputes(traced.concrete.graph.as_graph_def(), actions,
                                          passthrough=passthrough_ops(traced.concrete.graph))
    function = import_step(graph_def, traced)
    flat = _flat(traced, x, y)
    with fixed_grappler_config():
        _, collected = collect_first_call(function, *flat)
        for _ in range(steps - 1):
            function(*flat)
    for _ in range(steps):
        reference.train_on_batch(x, y)
    return th.weights_of(model), th.weights_of(reference), check_recomputes(collected, applied), actions


# ---------------------------------------------------------------------- training computes what Keras computes


def _norm_mix():
    return ZooModel("norm_mix_16", "normalization", "norm_mix", 4, {"image_size": 16}).build(seed=0)


def _small_cnn():
    return build_model("small_cnn", seed=0, image_size=16)


def _transformer():
    return build_model("transformer_encoder", seed=0, seq_len=16, vocab=64, d_model=16, heads=2, ff=32, layers=1,
                       dropout=0.2)


# weights whose reference value stays below this hold rounding noise only: the attention's key bias
# (softmax is invariant to a constant added per query, so its gradient is zero in exact arithmetic;
# after two steps it is ~4e-12, and any change in the order of a sum changes it by ~100 %)
NOISE_FLOOR = 1e-9


def _assert_trains_as_keras(recomputed, reference, *, bitwise: bool, noise_floor: float = NOISE_FLOOR) -> None:
    if bitwise:
        assert th.bitwise_equal(recomputed, reference), th.max_relative_difference(recomputed, reference)
    signal = [(a, b) for a, b in zip(recomputed, reference) if np.abs(b).max(initial=0.0) >= noise_floor]
    noise = [(a, b) for a, b in zip(recomputed, reference) if np.abs(b).max(initial=0.0) < noise_floor]
    assert th.max_relative_difference(*zip(*signal)) <= 1e-5
    assert all(np.abs(a - b).max(initial=0.0) <= noise_floor for a, b in noise)


# norm_mix's (dropout, batch, group and layer normalisation) in the default run; the CNN's batch norm and the
# transformer's attention (-m long)
@pytest.mark.parametrize("build, batch, bitwise", [(_norm_mix, 4, True),
                                                  pytest.param(_small_cnn, 4, True, marks=pytest.mark.long),
                                                  pytest.param(_transformer, 4, False, marks=pytest.mark.long)],
                         ids=["norm_mix-dropout-bn", "small_cnn-bn", "transformer-dropout"])
def test_recomputing_every_far_read_trains_as_keras(build, batch, bitwise):
    """Every forward tensor the backward pass reads, made by a cheap pure op, recomputed from up to
    three ops (Dropout's masks from the original key and counter, batch, group and layer
    normalisation's arithmetic, activations, softmax): after three steps the weights are Keras'
    within 1e-5 of their scale, bit for bit on the two CNNs (op determinism on); and every clone and
    far read survived Grappler. The transformer is not bitwise: its LayerNorms' sources gain a reader
    (the clone), so Grappler's arithmetic optimizer no longer merges the original add chain into one
    AddN as in Keras' step, and the original rounds differently (rewriter.edit.recompute_clones)."""
    recomputed, reference, verification, actions = _train_and_compare(build, batch)
    _assert_trains_as_keras(recomputed, reference, bitwise=bitwise)
    assert verification.ok, verification.summary()
    assert verification.reads + len(verification.reads_folded) == verification.planned_reads
    assert verification.planned_reads == sum(len(a.consumers) for a in actions)
    assert verification.clones > 0


def test_dropout_mask_is_recomputed_from_the_original_key_and_counter():
    """norm_mix's Dropout masks: the random op itself is cloned and reads the original key/counter."""
    th.deterministic()
    graph = rewriter.capture(_norm_mix(), 4)
    model = _norm_mix()
    traced = rewriter.trace_keras_step(model, 4)
    actions = [a for a in far_read_actions(graph, traced, chain=4) if "dropout" in a.tensor]
    random = [(k, op) for k, a in enumerate(actions) for op in a.ops if "StatelessRandomUniform" in op]
    assert random, [a.ops for a in actions]
    graph_def, _ = apply_recomputes(traced.concrete.graph.as_graph_def(), actions,
                                          passthrough=passthrough_ops(traced.concrete.graph))
    nodes = {node.name: node for node in graph_def.node}
    for k, op in random:
        clone = nodes[clone_name(op, k)]
        original = nodes[op]
        assert clone.op == original.op and list(clone.input[:len(original.input)]) == list(original.input)


def test_recomputed_convolutions_train_as_keras():
    """Contractions can be recomputed too (the simulator's expensive mode): a chain through a Conv2D."""
    recomputed, reference, verification, actions = _train_and_compare(_small_cnn, 4, chain=4, expensive=True)
    assert any(op.endswith("Conv2D") or "convolution" in op for a in actions for op in a.ops)
    _assert_trains_as_keras(recomputed, reference, bitwise=True)
    assert verification.ok, verification.summary()


def _conv_bias_bn(size: int = 16, layers: int = 2) -> keras.Model:
    """Conv2D with a bias, BatchNormalization, ReLU (ResNet-50's blocks): oneDNN merges each filter gradient
    with its bias gradient, each Conv2D with its BiasAdd."""
    keras.utils.set_random_seed(0)
    x = inputs = keras.Input((size, size, 3), name="image")
    for k in range(layers):
        x = keras.layers.Conv2D(8, 3, padding="same", name=f"conv{k}")(x)
        x = keras.layers.BatchNormalization(name=f"bn{k}")(x)
        x = keras.layers.ReLU(name=f"relu{k}")(x)
    outputs = keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling2D(name="pool")(x))
    model = keras.Model(inputs, outputs, name="conv_bias_bn")
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_recomputed_convolutions_chained_in_memory_order_run_with_onednn():
    """The demo's oneDNN cycle, small: recomputed convolutions (no swaps), the step chained in the memory order,
    on the testbed with oneDNN on. The order runs each bias gradient and its update before the clones
    that feed the filter gradient beside it; oneDNN's layout pass merges the two gradients (same
    gradient input, same control inputs: none, the filter gradient's predecessor being its data input),
    and chained through the clones the merged node sat on a cycle: "60 nodes in a cycle" at the first
    call (``rewriter.edit.chain_order.partners_adjacent``). Now the step runs, every clone and far read survives,
    the peak is the predicted one and three steps train as Keras' (within 1e-5 of each weight's scale;
    a convolution's bias before BatchNormalization has no gradient in exact arithmetic, its value is
    rounding noise below 1e-8 that any other summation order changes: the same plan without the
    recomputations differs from Keras there as much)."""
    th.deterministic()
    batch = 4
    graph = rewriter.capture(_conv_bias_bn(), batch)
    model, reference = _conv_bias_bn(), _conv_bias_bn()
    traced = rewriter.trace_keras_step(model, batch)
    actions = far_read_actions(graph, traced, chain=4, expensive=True)
    assert any(op.endswith("convolution") for a in actions for op in a.ops)
    plan_graph = with_recomputes(graph, actions)
    plan = plan_swaps(plan_graph, SwapParams(threshold=10**6, order="memory"))
    assert plan.n_swaps == 0
    x, y = example_batch(model, batch)
    step = rewriter.apply(model, plan.to_json(plan_graph), verify_with=(x, y))
    assert step.verification.ok, step.verification.summary()
    assert step.verification.recompute.reads == step.verification.recompute.planned_reads
    predicted = replay(plan_graph.with_order("memory"), plan, get_device("cpu-testbed")).peak_bytes
    measured = rewriter.measure(step, x, y, warmup=1, repeats=1).peak_bytes
    assert abs(measured / predicted - 1.0) <= 0.02, (measured, predicted)
    for _ in range(3):
        step(x, y)
        reference.train_on_batch(x, y)
    _assert_trains_as_keras(th.weights_of(model), th.weights_of(reference), bitwise=False, noise_floor=1e-8)


def test_merge_partners_are_chained_next_to_each_other():
    """The order the step is chained in puts a bias gradient next to the filter gradient oneDNN merges it
    with, its update after them, and a Conv2D (read by its BiasAdd only) next to its BiasAdd; a Conv2D
    read elsewhere too is never merged, and stays."""
    graph_def = tf.compat.v1.GraphDef()
    for name, op, inputs in [("dy", "Placeholder", []), ("x", "Placeholder", []), ("w", "Placeholder", []),
                             ("bias_grad", "BiasAddGrad", ["dy"]), ("update", "Mul", ["bias_grad", "w"]),
                             ("clone", "Relu", ["x"]), ("other", "Relu", ["x"]),
                             ("filter_grad", "Conv2DBackpropFilter", ["clone", "w", "dy"]),
                             ("conv", "Conv2D", ["x", "w"]), ("bias", "BiasAdd", ["conv", "w"]),
                             ("shared", "Conv2D", ["x", "w"]), ("bias2", "BiasAdd", ["shared", "w"]),
                             ("tap", "Neg", ["shared"])]:
        graph_def.node.add(name=name, op=op, input=inputs)
    order = ["bias_grad", "update", "clone", "filter_grad", "conv", "other", "bias", "shared", "tap", "bias2"]
    assert partners_adjacent(GraphEditor(graph_def), order) == [
        "clone", "bias_grad", "filter_grad", "update", "other", "conv", "bias", "shared", "tap", "bias2"]


# ---------------------------------------------------------------------- the graph it builds


@pytest.fixture(scope="module")
def cnn():
    model = _small_cnn()
    graph = rewriter.capture(model, 4)
    traced = rewriter.trace_keras_step(model, 4)
    return graph, traced, far_read_actions(graph, traced)


def test_clones_are_named_wired_and_started_by_the_trigger(cnn):
    _, traced, actions = cnn
    graph_def, applied = apply_recomputes(traced.concrete.graph.as_graph_def(), actions,
                                          passthrough=passthrough_ops(traced.concrete.graph))
    nodes = {node.name: node for node in graph_def.node}
    original = {node.name: node for node in traced.concrete.graph.as_graph_def().node}
    assert len(graph_def.node) == len(original) + sum(len(a.nodes) for a in applied)
    for k, (action, item) in enumerate(zip(actions, applied, strict=True)):
        assert item.ops == tuple(clone_name(op, k) for op in action.ops)
        assert item.clone == f"{clone_name(action.ops[-1], k)}:{action.tensor.rpartition(':')[2]}"
        for op in action.ops:
            clone, source = nodes[clone_name(op, k)], original[op]
            assert clone.op == source.op and clone.attr[CLONE_ATTR].s.decode() == clone.name
            assert clone.attr[KEEP_ATTR].b
            data = [ref for ref in clone.input if not ref.startswith("^")]
            controls = [ref[1:] for ref in clone.input if ref.startswith("^")]
            expected = [clone_name(ref.split(":")[0], k) + (ref[len(ref.split(":")[0]):])
                        if ref.split(":")[0] in action.ops else ref
                        for ref in source.input if not ref.startswith("^")]
            assert data == expected
            if any(ref.split(":")[0] in action.ops for ref in source.input if not ref.startswith("^")):
                assert controls == [] and clone.name not in item.starts
            else:
                assert controls == list(item.controls) and clone.name in item.starts and controls
        for consumer, slot in item.rewired:
            assert nodes[consumer].input[slot] == item.clone.removesuffix(":0")
        assert {c for c, _ in item.rewired} == set(action.consumers)


def test_bypassed_ops_between_listed_ones_are_cloned_too():
    """An Identity between two listed ops is not an op of the OpGraph, but the clone must compute what
    the original computed: it is cloned (under the clone name scheme), shared inputs stay shared."""
    @tf.function(autograph=False)
    def step(x):
        a = tf.nn.relu(x * 2.0, name="a")
        b = tf.identity(a, name="through")
        c = tf.sigmoid(b, name="c")
        return c + 1.0, tf.math.tanh(c, name="far")

    graph_def = step.get_concrete_function(tf.TensorSpec((2, 2))).graph.as_graph_def()
    graph_def, applied = apply_recomputes(graph_def, [Recompute("c:0", ("a", "c"), "add", ("far",))])
    nodes = {node.name: node for node in graph_def.node}
    assert applied[0].extra == ("through/recompute_0",)
    assert list(nodes["through/recompute_0"].input) == ["a/recompute_0"]
    assert list(nodes["c/recompute_0"].input) == ["through/recompute_0"]
    assert list(nodes["a/recompute_0"].input) == ["mul", "^add"]  # the source stays shared
    assert list(nodes["far"].input) == ["c/recompute_0"]


def _two_relus():
    """A function whose Relu's far reader reads a clone (the GraphDef, its outputs)."""
    @tf.function(autograph=False)
    def step(x):
        a = tf.nn.relu(x * 2.0, name="r")
        near = tf.add(a, 1.0, name="near")
        return near, tf.multiply(tf.identity(a), 3.0, name="far")

    concrete = step.get_concrete_function(tf.TensorSpec((4, 4)))
    return concrete.graph.as_graph_def(), [t.name for t in concrete.outputs]


def _run_collected(graph_def, outputs):
    def imported(x):
        return tf.graph_util.import_graph_def(graph_def, input_map={"x:0": x}, return_elements=outputs, name="")

    function = tf.compat.v1.wrap_function(imported, signature=[tf.TensorSpec((4, 4))])
    with fixed_grappler_config():
        _, collected = collect_first_call(function, tf.ones((4, 4)))
    return collected


def test_grappler_merges_an_undefended_clone_and_verification_says_so():
    """Grappler's common-subgraph elimination merges a clone that has its original's op, inputs and
    attributes: one Relu is left, read by both. The keep mark alone keeps both (so does the trigger's
    control edge); verification reports the merge when both defences are taken away, and a dropped
    trigger edge."""
    graph_def, outputs = _two_relus()
    action = Recompute("r:0", ("r",), "near", ("far",))
    defended, applied = apply_recomputes(graph_def, [action])
    result = check_recomputes(_run_collected(defended, outputs), applied)
    assert result.ok and result.clones == 1 and result.reads == 1 and result.controls_kept == 1, result.summary()

    kept_only, naked = type(defended)(), type(defended)()
    kept_only.CopyFrom(defended)
    naked.CopyFrom(defended)
    for graph in (kept_only, naked):
        clone = next(node for node in graph.node if node.name == "r/recompute_0")
        del clone.input[1:]  # the trigger's control edge
        if graph is naked:
            del clone.attr[KEEP_ATTR]
            del clone.attr[CLONE_ATTR]
    result = check_recomputes(_run_collected(kept_only, outputs), applied)
    assert result.clones == 1 and result.reads == 1 and not result.originals_lost and not result.clones_lost
    assert result.controls_lost and not result.ok  # the trigger edge is gone (taken away above), and said
    merged = check_recomputes(_run_collected(naked, outputs), applied)
    assert not merged.ok and (merged.clones_lost or merged.originals_lost), merged.summary()


def test_clones_survive_grappler_for_a_gpu(cnn):
    """Grappler's passes for a GPU (a virtual V100, offline: ``rewriter.step.gpu_graph.optimize_for_gpu``), whose
    remapper fuses more than the CPU's (FusedBatchNorm/bias/activation chains): every clone survives
    and every far read is served by one."""
    _, traced, actions = cnn
    graph_def, applied = apply_recomputes(traced.concrete.graph.as_graph_def(), actions,
                                          passthrough=passthrough_ops(traced.concrete.graph))
    optimized = gpu.optimize_for_gpu(graph_def, [t.name for t in traced.concrete.outputs])
    collected = types.SimpleNamespace(post_optimization_graph=optimized, partition_graphs=[])
    result = check_recomputes([collected], applied)
    assert result.ok and result.clones == result.planned_clones, result.summary()
    assert result.reads == result.planned_reads


# ---------------------------------------------------------------------- refusals


def test_stateful_ops_are_refused(cnn):
    _, traced, actions = cnn
    graph_def = traced.concrete.graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    reader = next(name for name, node in nodes.items() if node.op == "ReadVariableOp")
    readers = [n.name for n in graph_def.node if any(ref.split(":")[0] == reader for ref in n.input)
               and n.op not in ("Identity",)]
    with pytest.raises(PlanError, match="ReadVariableOp"):
        apply_recomputes(graph_def, [Recompute(f"{reader}:0", (reader,), actions[0].trigger, (readers[0],))])
    write = next(name for name, node in nodes.items() if node.op == "AssignVariableOp")
    with pytest.raises(PlanError, match="stateful AssignVariableOp"):
        apply_recomputes(graph_def, [Recompute(f"{write}:0", (write,), actions[0].trigger, actions[0].consumers)])


@pytest.mark.parametrize("kind", ["RandomUniform", "While"])
def test_stateful_random_ops_and_control_flow_are_refused(kind):
    @tf.function(autograph=False)
    def step(x):
        if kind == "RandomUniform":
            made = tf.random.uniform(tf.shape(x), name="made") * x
        else:
            made = tf.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, v * 2.0), (0, x), name="made")[1]
        return tf.identity(made, name="near"), tf.math.tanh(made, name="far")

    graph_def = step.get_concrete_function(tf.TensorSpec((2, 2))).graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    made = next(name for name, node in nodes.items() if node.op in (kind, "While", "StatelessWhile"))
    far = nodes["far"].input[0]
    producer = far.split(":")[0]
    ops = (made, producer) if producer != made else (made,)
    with pytest.raises(PlanError, match="only pure ops are recomputed"):
        apply_recomputes(graph_def, [Recompute(far if ":" in far else f"{far}:0", ops, "near", ("far",))])


def test_unknown_names_and_malformed_actions_are_refused(cnn):
    _, traced, actions = cnn
    graph_def = traced.concrete.graph.as_graph_def()
    good = actions[0]
    cases = [
        (Recompute(good.tensor, good.ops, "no/such/trigger", good.consumers), "does not have"),
        (Recompute(good.tensor, good.ops, good.trigger, ("no/such/reader",)), "does not have"),
        (Recompute(good.tensor, good.ops[:-1] + ("no/such/op",), good.trigger, good.consumers), "does not make"),
        (Recompute(good.tensor, (), good.trigger, good.consumers), "lists no ops"),
        (Recompute(good.tensor, good.ops, good.trigger, (good.trigger,)), "does not read"),
        ({"tensor": good.tensor, "ops": list(good.ops)}, "must be a simulator.recompute.actions.Recompute"),
    ]
    for action, message in cases:
        with pytest.raises(PlanError, match=message):
            apply_recomputes(graph_def, [action])
    # a listed op that does not feed the tensor
    stray = next(a for a in actions if a.tensor != good.tensor and a.ops[-1] not in good.ops)
    with pytest.raises(PlanError, match="does not feed"):
        apply_recomputes(graph_def, [Recompute(good.tensor, (stray.ops[-1],) + good.ops, good.trigger,
                                               good.consumers)])
    # a trigger that runs after the far reader closes a cycle
    late = next(n.name for n in graph_def.node if good.consumers[0] in {r.split(":")[0] for r in n.input})
    with pytest.raises(PlanError, match="cyclic"):
        apply_recomputes(graph_def, [Recompute(good.tensor, good.ops, late, good.consumers)])


# ---------------------------------------------------------------------- the plan contract, end to end


def test_a_plan_file_with_recomputations_and_swaps_trains_as_keras_and_peaks_as_predicted(tmp_path):
    """The simulator's choice (cheap tensors recomputed, the rest swapped on the graph with the clones),
    written as plan.json, applied by ``rewriter.step.apply_plan`` from the file: every clone, far read and swap
    survives Grappler, three steps train bit for bit as Keras', and the measured peak on the testbed
    is the predicted one within 2 %."""
    th.deterministic()
    batch = 8

    def build():
        return build_model("small_cnn", seed=0, image_size=48)

    graph = rewriter.capture(build(), batch)
    testbed = get_device("cpu-testbed")
    params = SwapParams(threshold=2, recompute="cheap")
    plan_graph, actions = recomputed_graph(graph, params, testbed)
    plan = plan_swaps(plan_graph, params, kept_reads=testbed.kept_reads)
    assert actions and plan.n_swaps
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json(plan_graph))
    model, reference = build(), build()
    x, y = example_batch(model, batch)
    step = rewriter.apply(model, path, verify_with=(x, y))
    assert len(step.recomputed) == len(actions) and step.n_swap_outs == plan.n_swaps
    assert step.verification.ok, step.verification.summary()
    assert step.verification.recompute.clones == sum(len(a.ops) for a in actions)
    predicted = replay(plan_graph, plan, testbed).peak_bytes
    assert replay(graph, None, testbed).peak_bytes > predicted  # the plan saves memory
    measured = rewriter.measure(step, x, y, warmup=1, repeats=1).peak_bytes
    assert abs(measured / predicted - 1.0) <= 0.02, (measured, predicted)
    for _ in range(3):
        step(x, y)
        reference.train_on_batch(x, y)
    assert th.bitwise_equal(th.weights_of(model), th.weights_of(reference))
