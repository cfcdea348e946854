"""rewriter.step.apply_plan on a small CNN: graph structure, bitwise equivalence, verification, bad input."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import tests.tf_tools as th  # noqa: I001 -- first: configures TF before its runtime starts

import keras
import numpy as np
import pytest
import tensorflow as tf

import rewriter
from benchmarks.models import build_model, example_batch
from rewriter.edit.graph_edit import GraphEditor
from rewriter.step.apply_plan import PlanError
from rewriter.trace.tracing import CaptureError, synthetic_batch
from simulator import OpGraph, SwapParams, SwapPlan, get_device, plan_swaps, replay

pytestmark = pytest.mark.tf

BATCH = 8


@pytest.fixture(scope="module")
def cnn_graph():
    th.deterministic()
    model = build_model("small_cnn", seed=0)
    graph = rewriter.capture(model, BATCH)
    # every activation of 4 KiB or more (the BN statistics vectors are left out: swapping those through
    # Identity ops changes how Grappler's arithmetic optimizer rewrites the BN gamma gradient, ~1e-11)
    plan = plan_swaps(graph, SwapParams(threshold=1, min_bytes=4096))
    return graph, plan


@pytest.fixture(scope="module")
def full_plan(cnn_graph):
    """Every far read of every forward tensor, however small."""
    return plan_swaps(cnn_graph[0], SwapParams(threshold=1))


def _pair():
    return build_model("small_cnn", seed=0), build_model("small_cnn", seed=0)


def _nodes(step):
    return {node.name: node for node in step.graph_def.node}


def test_graph_carries_the_plan(cnn_graph, full_plan):
    graph, plan = cnn_graph[0], full_plan
    model = build_model("small_cnn", seed=0)
    step = rewriter.apply(model, plan, graph=graph, batch_size=BATCH, swap_op="DeepCopy", verify=False)
    data = plan.to_dict(graph)
    nodes = _nodes(step)
    # reads by MaxPool gradients stay on the device on the CPU testbed (oneDNN workspace pairing)
    assert all("MaxPool" in item.reason for item in step.skipped)
    kept = {a.tensor for a in step.applied}
    assert step.n_swap_ins + len(step.skipped) == plan.n_swap_ins
    for record, applied in zip([r for r in data["swaps"] if r["tensor"] in kept], step.applied, strict=True):
        out = nodes[applied.swap_out]
        producer, _, index = record["tensor"].partition(":")
        assert applied.swap_out.startswith("swap_out/") and out.op == "DeepCopy"
        # the copy runs on the accelerator side; the host holds the copy (placement.swap_out_device)
        assert out.device == "/device:CPU:0" and out.attr["_grappler_do_not_remove"].b
        assert list(out.input) == [producer if index == "0" else record["tensor"]]
        items = [i for i in record["swap_ins"] if set(i["consumers"]) & {c for s in applied.swap_ins for c in s.consumers}]
        for item, swap_in in zip(items, applied.swap_ins, strict=True):
            node, host = nodes[swap_in.name], nodes[swap_in.host_node]
            assert swap_in.name.startswith(f"{applied.swap_out.replace('swap_out/', 'swap_in/')}/")
            assert node.device == "/device:CPU:0" and node.attr["_grappler_do_not_remove"].b
            # the wait is on the host side (TFLMS): the accelerator-side copy reads it and waits for nothing else
            assert host.op == "Identity" and host.device == "/device:CPU:1" and host.attr["_grappler_do_not_remove"].b
            assert host.input[0] == applied.swap_out and list(node.input) == [swap_in.host_node]
            controls = [ref[1:] for ref in host.input if ref.startswith("^")]
            assert controls == list(swap_in.controls)
            for consumer in item["consumers"]:
                assert swap_in.name in nodes[consumer].input  # rewired in its own input slot
            if item["trigger"]:
                # the trigger, or its inputs when it could be fused with the consumer (graph_edit.GraphEditor.safe_controls)
                assert controls


def test_sync_out_holds_a_reader_or_the_next_op(cnn_graph):
    """sync "out": the ops still reading a swapped tensor wait for its copy; a tensor whose reads all
    go through swap-ins holds the op the plan runs after its producer instead (as the replay has it)."""
    graph = cnn_graph[0]
    plan = plan_swaps(graph, SwapParams(threshold=1, sync="out", min_bytes=4096))
    model = build_model("small_cnn", seed=0)
    step = rewriter.apply(model, plan, graph=graph, batch_size=BATCH)
    assert step.verification.ok, step.verification.summary()
    nodes = _nodes(step)
    order = [str(name) for name in graph.op_name[plan.order]]
    held_next = 0
    for applied in step.applied:
        assert applied.sync_out and applied.sync_controls
        for name in applied.sync_controls:
            assert f"^{applied.swap_out}" in nodes[name].input
        producer = applied.tensor.partition(":")[0]
        reads = {ref.split(":")[0] for name in applied.sync_controls for ref in nodes[name].input if ref[0] != "^"}
        if producer not in reads:  # no device reader left: the next op in the order waits
            assert applied.sync_controls == (order[order.index(producer) + 1],)
            held_next += 1
    assert held_next > 0


@pytest.mark.parametrize("placement", [None, rewriter.GpuPlacement()], ids=["testbed", "gpu-identity-swaps"])
def test_the_readers_of_a_swapped_tensor_are_those_a_scan_of_every_node_finds(cnn_graph, monkeypatch, placement):
    """``GraphEditor.readers`` answers from an index made once, checked on the graph as edited: for every swap
    of a plan with sync "out" it gives what a scan of every input of every node gives at that point of the edit
    (on a GPU, swaps are Identity ops that reads resolve through)."""
    graph = cnn_graph[0]
    plan = plan_swaps(graph, SwapParams(threshold=1, sync="out", min_bytes=4096))
    indexed, asked = GraphEditor.readers, []

    def checked(editor, tensor):
        found = indexed(editor, tensor)
        scanned = [(node.name, slot) for node in editor.graph_def.node if not editor.bypassed(node)
                   for slot, ref in editor.data_inputs(node) if editor.resolve(ref) == tensor]
        assert found == scanned, tensor
        asked.append(tensor)
        return found

    monkeypatch.setattr(GraphEditor, "readers", checked)
    step = rewriter.apply(build_model("small_cnn", seed=0), plan, graph=graph, batch_size=BATCH, verify=False,
                          **({} if placement is None else {"placement": placement}))
    assert len(asked) == len(step.applied) == plan.n_swaps > 3


def test_swap_ins_after_copies_out_wait_for_their_triggers_copies(cnn_graph):
    """after_copies_out: a swap-in whose trigger makes a swapped tensor also waits for that copy out,
    as the replay has it; the edges survive Grappler."""
    graph = cnn_graph[0]
    params = SwapParams(threshold=1, ub=1, trigger="level", tensors="all", distance="slot", after_copies_out=True)
    plan = plan_swaps(graph, params)
    model = build_model("small_cnn", seed=0)
    step = rewriter.apply(model, plan, graph=graph, batch_size=BATCH)
    assert step.verification.ok, step.verification.summary()
    assert step.plan.after_copies_out is True
    nodes = _nodes(step)
    copies_of = {}
    for applied in step.applied:
        copies_of.setdefault(applied.tensor.partition(":")[0], []).append(applied.swap_out)
    waiting = 0
    for applied in step.applied:
        for item in applied.swap_ins:
            for copy in copies_of.get(item.trigger or "", []):
                assert copy in item.controls and f"^{copy}" in nodes[item.host_node].input
                waiting += 1
    assert waiting > 0
    # without the flag the same waits on the testbed, whose copies wait for the compute threads: its executor ran
    # a swap-in before the copy out its trigger made now and then, both buffers on the device together
    assert step.placement.copies_wait_for_compute
    plain = rewriter.apply(model, plan_swaps(graph, dataclasses.replace(params, after_copies_out=False)), graph=graph,
                           batch_size=BATCH, verify=False)

    def copy_waits(nodes):
        return sorted((name, ref) for name, node in nodes.items() if name.startswith("swap_in/")
                      for ref in node.input if ref.startswith("^swap_out/"))
    assert copy_waits(_nodes(plain)) == copy_waits(nodes) and copy_waits(nodes)


def test_consumer_reading_through_identity_is_rewired_in_its_slot():
    """A consumer that reads the tensor through bypassed ops (Identity...) gets the swap-in in that slot."""
    model = build_model("small_cnn", seed=0)
    traced = rewriter.trace_keras_step(model, BATCH)
    graph_def = traced.concrete.graph.as_graph_def()
    nodes = {n.name: n for n in graph_def.node}
    # find a consumer input that goes through a bypassed op
    from rewriter.edit.graph_edit import GraphEditor

    editor = GraphEditor(graph_def)
    found = None
    for node in graph_def.node:
        if node.op in rewriter.trace.tracing.BYPASS_TYPES:
            continue
        for slot, ref in editor.data_inputs(node):
            source = ref.split(":")[0]
            if nodes[source].op in rewriter.trace.tracing.BYPASS_TYPES:
                resolved = editor.resolve(ref)
                if nodes[resolved[0]].op not in ("Const", "Placeholder", "ReadVariableOp") \
                        and nodes[resolved[0]].op not in rewriter.trace.tracing.BYPASS_TYPES:
                    found = (node.name, slot, resolved)
                    break
        if found:
            break
    assert found, "small_cnn has no consumer reading through an Identity-like op"
    consumer, slot, (producer, index) = found
    tensor = f"{producer}:{index}"
    plan = {"format": "swap-plan/1", "swaps": [{"tensor": tensor, "sync_out": False, "swap_ins": [
        {"consumers": [consumer], "trigger": None, "after": producer}]}]}
    step = rewriter.apply(model, plan, batch_size=BATCH, verify=False)
    assert _nodes(step)[consumer].input[slot] == step.applied[0].swap_ins[0].name


def _run_steps(step_fn, x, y, n=3):
    return [float(step_fn(x, y)) for _ in range(n)]


def test_identity_swaps_bitwise_equal(cnn_graph):
    """Loss of every step, weights and optimizer slots after 3 steps: bitwise equal to the original
    step (the same traced step without swaps, and Keras' own train_on_batch)."""
    th.deterministic()
    graph, plan = cnn_graph
    plain, swapped = _pair()
    keras_model = build_model("small_cnn", seed=0)
    x, y = example_batch(plain, BATCH)
    ref = rewriter.apply(plain, SwapPlan.empty(), batch_size=BATCH, verify=False)
    # unserialized, so TF's optimizer treats the graph exactly as Keras' own step
    step = rewriter.apply(swapped, plan, graph=graph, batch_size=BATCH, swap_op="Identity", serialize=False)
    assert step.verification is not None and step.verification.ok, step.verification.summary()
    losses_ref, losses_swap = _run_steps(ref, x, y), _run_steps(step, x, y)
    losses_keras = [float(keras_model.train_on_batch(x, y)) for _ in range(3)]
    assert losses_ref == losses_swap == losses_keras
    assert th.bitwise_equal(th.weights_of(plain), th.weights_of(swapped))
    assert th.bitwise_equal(th.optimizer_state(plain), th.optimizer_state(swapped))
    assert th.bitwise_equal(th.weights_of(keras_model), th.weights_of(swapped))


def test_serialized_swaps_bitwise_equal_to_the_serialized_step(cnn_graph):
    """With the step chained in the plan's order (the default), swaps still change nothing; the
    chain itself moves Grappler's rewrite of a few batch-norm gradients by ~1e-11."""
    th.deterministic()
    graph, plan = cnn_graph
    plain, swapped = _pair()
    keras_model = build_model("small_cnn", seed=0)
    x, y = example_batch(plain, BATCH)
    ref = rewriter.apply(plain, SwapPlan.empty(graph), graph=graph, batch_size=BATCH, verify=False)
    step = rewriter.apply(swapped, plan, graph=graph, batch_size=BATCH, swap_op="Identity")
    assert step.plan.order and step.verification.ok, step.verification.summary()
    assert _run_steps(ref, x, y) == _run_steps(step, x, y)
    assert th.bitwise_equal(th.weights_of(plain), th.weights_of(swapped))
    assert th.bitwise_equal(th.optimizer_state(plain), th.optimizer_state(swapped))
    for _ in range(3):
        keras_model.train_on_batch(x, y)
    assert th.max_relative_difference(th.weights_of(keras_model), th.weights_of(swapped)) <= 1e-6
    assert th.max_relative_difference(th.optimizer_state(keras_model), th.optimizer_state(swapped)) <= 1e-6


def test_gradients_bitwise_equal_after_one_step(cnn_graph):
    """One SGD step: the weight change is -lr * gradient (+ momentum 0 on the first step)."""
    th.deterministic()
    graph, plan = cnn_graph
    plain, swapped = _pair()
    x, y = example_batch(plain, BATCH)
    before = th.weights_of(plain)
    ref = rewriter.apply(plain, SwapPlan.empty(), batch_size=BATCH, verify=False)
    step = rewriter.apply(swapped, plan, graph=graph, batch_size=BATCH, swap_op="Identity", verify=False)
    ref(x, y)
    step(x, y)
    grads_ref = [b - a for a, b in zip(th.weights_of(plain), before)]
    grads_swap = [b - a for a, b in zip(th.weights_of(swapped), before)]
    assert th.bitwise_equal(grads_ref, grads_swap)
    assert any(np.abs(g).max() > 0 for g in grads_ref)


@pytest.mark.parametrize("arithmetic", [True, False])
def test_copying_swaps_equal(cnn_graph, full_plan, arithmetic):
    th.deterministic()
    graph, plan = cnn_graph[0], full_plan
    with th.grappler_options(arithmetic_optimization=arithmetic):
        plain, swapped = _pair()
        x, y = example_batch(plain, BATCH)
        ref = rewriter.apply(plain, SwapPlan.empty(), batch_size=BATCH, verify=False)
        step = rewriter.apply(swapped, plan, graph=graph, batch_size=BATCH, swap_op="DeepCopy")
        losses_ref, losses_swap = _run_steps(ref, x, y), _run_steps(step, x, y)
    assert step.verification.ok, step.verification.summary()
    assert np.allclose(losses_ref, losses_swap, rtol=1e-5, atol=0)
    assert th.max_relative_difference(th.weights_of(plain), th.weights_of(swapped)) <= 1e-5
    if not arithmetic:
        assert losses_ref == losses_swap
        assert th.bitwise_equal(th.weights_of(plain), th.weights_of(swapped))


def test_verification_counts_every_swap_op(cnn_graph, full_plan):
    graph, plan = cnn_graph[0], full_plan
    model = build_model("small_cnn", seed=0)
    before = th.weights_of(model)
    step = rewriter.apply(model, plan, graph=graph, batch_size=BATCH)
    v = step.verification
    assert v.collected and v.ok, v.summary()
    assert (v.swap_outs, v.swap_ins) == (step.n_swap_outs, step.n_swap_ins)
    assert step.n_swap_ins + len(step.skipped) == plan.n_swap_ins
    assert v.rewired_inputs == v.planned_rewired_inputs
    assert v.triggers_ordered == v.planned_triggers
    assert v.control_edges_kept + v.control_edges_implied == v.planned_control_edges
    # two logical CPUs: every swap-out receives from the accelerator, every swap-in from the host
    assert v.transfers_to_host == step.n_swap_outs
    assert v.transfers_to_accelerator >= step.n_swap_outs
    assert th.bitwise_equal(before, th.weights_of(model)), "verification must not change the model"
    again = rewriter.verify(step)
    assert again.ok and again.swap_outs == v.swap_outs
    assert "swap-outs" in v.summary()


def test_tensors_kept_on_the_device_get_no_swap_nodes(cnn_graph):
    """Parameters that keep tensors on the device (``keep_tensors``, what the host-room pass adds)
    make a plan without them; the rewriter applies it as any other, and it verifies."""
    graph, plan = cnn_graph
    names = tuple(graph.tensor_name(t) for t in plan.tensor[:2])
    kept = plan_swaps(graph, dataclasses.replace(plan.params, keep_tensors=names))
    assert kept.n_swaps == plan.n_swaps - 2
    step = rewriter.apply(build_model("small_cnn", seed=0), kept, graph=graph, batch_size=BATCH)
    assert step.verification.ok, step.verification.summary()
    applied = {a.tensor for a in step.applied}
    assert applied and applied <= {graph.tensor_name(t) for t in kept.tensor} and not applied & set(names)


def test_sync_swap_ins_never_wait_on_a_reshape_grappler_removes():
    """A layer norm's gradient reshapes its reduced sum to the shape it already has; Grappler drops
    that Reshape, so a synchronous swap-in must not hang its control edge on it."""
    model = build_model("transformer_encoder", seq_len=16, vocab=64, d_model=32, heads=2, ff=64, layers=1, seed=0)
    graph = rewriter.capture(model, 4)
    plan = plan_swaps(graph, SwapParams(threshold=3, ub=5, groupby=2, sync="both", order="memory"))
    step = rewriter.apply(model, plan, graph=graph, batch_size=4)
    assert step.verification.ok, step.verification.summary()
    assert step.verification.triggers_ordered == step.verification.planned_triggers


def test_plan_forms_and_step_interface(cnn_graph, tmp_path):
    graph, plan = cnn_graph
    model = build_model("small_cnn", seed=0)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json(graph))
    for form in (plan.to_dict(graph), plan.to_json(graph), str(path), path):
        step = rewriter.apply(model, form, batch_size=BATCH, verify=False)
        assert step.n_swap_ins + len(step.skipped) == plan.n_swap_ins
    step = rewriter.apply(model, path, verify=False)  # batch size from the plan
    assert step.batch_size == BATCH and "SwapStep" in repr(step)
    x, y = example_batch(model, BATCH)
    logs = step.run(x, y)
    assert set(logs) == {"loss"}
    assert np.isfinite(float(step(tf.constant(x), tf.constant(y.astype(np.int64)))))  # dtype converted
    with pytest.raises(ValueError, match="batch size 8"):
        step(x[:4], y[:4])
    small = step.for_batch(4)
    assert small.batch_size == 4 and step.for_batch(4) is small and step.for_batch(BATCH) is step
    assert np.isfinite(float(small(x[:4], y[:4])))
    with pytest.raises(ValueError, match="input"):
        step([x, x], y)


def test_a_plan_file_written_before_the_contract_applies():
    """tests/data/plans: a plan.json written by the code before simulator.plan existed (95ea400), for
    small_cnn at batch 4 (tests/simulator/test_plan.py loads it in the simulator). The rewriter applies every
    swap it holds, and the file and the plan the simulator reads from it build the same step."""
    from tests.simulator.test_plan import FIXTURE_GRAPH, FIXTURE_PLAN

    model = build_model("small_cnn", seed=0)
    step = rewriter.apply(model, FIXTURE_PLAN)  # batch size and order from the file
    assert (step.batch_size, step.n_swap_outs, step.n_swap_ins, step.skipped) == (4, 6, 12, [])
    assert step.plan.ordering == "memory" and step.plan.after_copies_out and step.plan.order
    assert step.verification.ok, step.verification.summary()
    graph = OpGraph.load(FIXTURE_GRAPH)
    simulated = SwapPlan.from_json(graph, FIXTURE_PLAN.read_text())
    again = rewriter.apply(model, simulated, graph=graph, verify=False)
    assert again.applied == step.applied and again.graph_def == step.graph_def
    x, y = example_batch(model, 4)
    assert np.isfinite(float(step(x, y)))


# ---------------------------------------------------------------------- bad input


def test_stale_plan_is_one_clear_error_and_model_untouched(cnn_graph):
    graph, plan = cnn_graph
    data = plan.to_dict(graph)
    data["swaps"][0]["tensor"] = "old_model/conv9/Conv2D:0"
    data["swaps"][1]["swap_ins"][0]["consumers"] = ["old_model/gradients/conv9_grad"]
    model = build_model("small_cnn", seed=0)
    before = th.weights_of(model)
    function_before = model.train_function
    with pytest.raises(PlanError, match=r"2 op\(s\)/tensor\(s\).*old_model/conv9/Conv2D:0") as info:
        rewriter.apply(model, data, batch_size=BATCH)
    assert isinstance(info.value, ValueError)
    assert th.bitwise_equal(before, th.weights_of(model))
    assert model.train_function is function_before
    x, y = example_batch(model, BATCH)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # still trains normally
    assert np.isfinite(history.history["loss"][0])
    assert not th.bitwise_equal(before, th.weights_of(model))


def test_plan_for_another_model_is_rejected(cnn_graph):
    graph, plan = cnn_graph
    other = build_model("mlp", seed=0)
    with pytest.raises(PlanError, match="does not have"):
        rewriter.apply(other, plan.to_dict(graph), batch_size=BATCH)


def test_malformed_plans(cnn_graph):
    model = build_model("small_cnn", seed=0)
    with pytest.raises(PlanError, match="not a swap plan"):
        rewriter.apply(model, {"swaps": []}, batch_size=BATCH)
    with pytest.raises(PlanError, match="not valid JSON"):
        rewriter.apply(model, "{nope", batch_size=BATCH)
    with pytest.raises(PlanError, match="cannot read"):
        rewriter.apply(model, "/nonexistent/plan.json", batch_size=BATCH)
    with pytest.raises(PlanError, match="graph="):
        rewriter.apply(model, cnn_graph[1], batch_size=BATCH)
    bad = {"format": "swap-plan/1", "swaps": [{"tensor": "x:0", "swap_ins": [{"consumers": []}]}]}
    with pytest.raises(PlanError, match="consumers"):
        rewriter.apply(model, bad, batch_size=BATCH)
    bad["swaps"][0]["swap_ins"] = []
    with pytest.raises(PlanError, match="no swap-in"):
        rewriter.apply(model, bad, batch_size=BATCH)


def test_consumer_that_does_not_read_the_tensor(cnn_graph):
    graph, plan = cnn_graph
    data = plan.to_dict(graph)
    record = data["swaps"][0]
    record["swap_ins"][0]["consumers"] = [data["swaps"][1]["swap_ins"][0]["consumers"][0]]
    if record["swap_ins"][0]["consumers"][0] in [c for item in data["swaps"][0]["swap_ins"][1:] for c in item["consumers"]]:
        pytest.skip("consumer reads both tensors")
    with pytest.raises(PlanError, match="does not read tensor"):
        rewriter.apply(build_model("small_cnn", seed=0), data, batch_size=BATCH)


def test_cyclic_trigger_is_rejected(cnn_graph):
    graph, plan = cnn_graph
    data = plan.to_dict(graph)
    record = data["swaps"][-1]
    # trigger = the loss: it depends on everything forward, including the consumer if that is forward
    consumer = record["swap_ins"][0]["consumers"][0]
    record["swap_ins"][0]["trigger"] = graph.meta["loss_op"]
    model = build_model("small_cnn", seed=0)
    traced = rewriter.trace_keras_step(model, BATCH)
    forward = consumer in {op.name for op in traced.concrete.graph.get_operations()} and not consumer.startswith("gradient")
    if not forward:
        record["swap_ins"][0]["trigger"] = "AddN" if any(n.name == "AddN" for n in traced.concrete.graph.as_graph_def().node) else None
    if record["swap_ins"][0]["trigger"] is None:
        pytest.skip("no op downstream of the consumer found")
    with pytest.raises(PlanError, match="cyclic"):
        rewriter.apply(model, data, batch_size=BATCH)


def _rnn_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 4))
    hidden = keras.layers.SimpleRNN(8, name="rnn")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax", name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def test_while_loop_tensors_are_skipped_with_a_reason(caplog):
    model = _rnn_model()
    graph = rewriter.capture(model, 4)
    traced = rewriter.trace_keras_step(model, 4)
    body = next(f for f in traced.concrete.graph.as_graph_def().library.function
                if "while_body" in f.signature.name and "grad" not in f.signature.name)
    inner = next(n.name for n in body.node_def if n.op == "MatMul")
    plan = plan_swaps(graph, SwapParams(threshold=1))
    data = plan.to_dict(graph) if plan.n_swaps else {"format": "swap-plan/1", "swaps": []}
    data["swaps"].append({"tensor": f"{inner}:0", "sync_out": False,
                          "swap_ins": [{"consumers": [inner], "trigger": None, "after": inner}]})
    with caplog.at_level(logging.WARNING, logger="rewriter.step.apply_plan"):
        step = rewriter.apply(model, data, batch_size=4)
    assert [s.tensor for s in step.skipped] == [f"{inner}:0"]
    assert "While loop" in step.skipped[0].reason and "while_body" in step.skipped[0].reason
    assert any("skipped" in r.message and inner in r.message for r in caplog.records)
    assert step.n_swap_outs == len(data["swaps"]) - 1
    x = np.random.default_rng(0).random((4, 6, 4), dtype=np.float32)
    y = np.array([0, 1, 2, 0], dtype=np.int32)
    assert np.isfinite(float(step(x, y)))


def test_model_without_loss_is_a_capture_error():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    with pytest.raises(CaptureError, match="not compiled"):
        rewriter.apply(model, {"format": "swap-plan/1", "swaps": []}, batch_size=2)
    model.compile(optimizer="sgd")
    with pytest.raises(CaptureError, match="loss"):
        rewriter.apply(model, {"format": "swap-plan/1", "swaps": []}, batch_size=2)


def test_a_trigger_grappler_folds_hands_its_edge_to_the_op_before_it():
    """A loss's range of reduction axes is computed from constants: constant folding removes it, and
    a swap-in's control edge from it with it. The op before it in the order carries the edge instead."""
    from rewriter.edit.graph_edit import GraphEditor
    from rewriter.tf_effects.grappler import foldable_ops

    @tf.function
    def step(x):
        squared = tf.square(x)
        same = tf.reduce_max(squared, axis=[])  # a reduction over no axis: Grappler removes it too
        return tf.reduce_sum(same, axis=tf.range(0, 2))

    concrete = step.get_concrete_function(tf.TensorSpec([4, 4], tf.float32))
    ops = {op.type: op.name for op in concrete.graph.get_operations()}
    foldable = foldable_ops(concrete)
    assert ops["Range"] in foldable and ops["Max"] in foldable
    assert ops["Square"] not in foldable and ops["Sum"] not in foldable
    graph_def = concrete.graph.as_graph_def()
    ordered = GraphEditor(graph_def, foldable, previous={ops["Range"]: ops["Square"]})
    assert ordered.safe_controls([ops["Range"]], [ops["Sum"]]) == [ops["Square"]]
    # without an order, its inputs' producers: constants, always ready, so no edge at all
    assert GraphEditor(graph_def, foldable).safe_controls([ops["Range"]], [ops["Sum"]]) == []


def test_verification_follows_a_trigger_grappler_renamed():
    """Grappler's arithmetic optimizer rewrites an add chain under a new name
    ("ArithmeticOptimizer/AddOpsRewrite_<name>"): a control edge from the old name is then ordered
    through the renamed op, not folded away; an edge lost outright still is reported."""
    from types import SimpleNamespace

    from tensorflow.core.framework import graph_pb2

    from rewriter.edit.graph_edit import AppliedSwap, AppliedSwapIn
    from rewriter.check.verification import check

    post = graph_pb2.GraphDef()
    for name, op, inputs in [
        ("x", "Placeholder", []),
        ("ArithmeticOptimizer/AddOpsRewrite_add", "AddV2", ["x", "x"]),
        ("swap_out/x_0", "DeepCopy", ["x"]),
        ("swap_out/add_0", "DeepCopy", ["ArithmeticOptimizer/AddOpsRewrite_add"]),
        ("swap_in/x_0/0", "DeepCopy", ["swap_out/x_0", "^swap_out/add_0"]),
        ("swap_in/x_0/1", "DeepCopy", ["swap_out/x_0"]),
        ("use", "Mul", ["swap_in/x_0/0", "swap_in/x_0/1"]),
    ]:
        post.node.add(name=name, op=op, input=inputs)
    collected = [SimpleNamespace(post_optimization_graph=post, partition_graphs=[])]
    renamed = AppliedSwapIn("swap_in/x_0/0", ("use",), "add", None, ("add",), (("use", 0),))
    lost = AppliedSwapIn("swap_in/x_0/1", ("use",), "gone", None, ("gone",), (("use", 1),))
    result = check(collected, [AppliedSwap("x:0", "swap_out/x_0", "float32", 4, False, (renamed, lost))])
    assert result.control_edges_implied == 1 and result.triggers_ordered == 1
    assert result.triggers_folded == ["swap_in/x_0/1 <- gone"] and not result.ok


def test_sum_of_two_convolutions_waits_for_the_other_half():
    """An Add of two bias-free convolutions (the split concatenation's sum) is no fusion: a sync
    swap-in of one half waits for the other half itself, not its inputs, in the rewritten graph
    as in the replay (simulator.fusion); the step keeps that edge and runs."""
    from simulator import get_device, replay
    from simulator.fusion import safe_wait_slots
    from simulator.planning import Swap, SwapIn

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 4))
    half0 = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="half0")(inputs)
    pooled = keras.layers.MaxPooling2D(1, name="pooled")(inputs)
    half1 = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="half1")(pooled)
    total = keras.layers.Add(name="total")([half0, half1])
    model = keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(total))
    model.compile(optimizer="sgd", loss="mse")
    graph = rewriter.capture(model, 2)
    names = {kind: next(str(n) for n in graph.op_name if str(n).endswith(suffix))
             for kind, suffix in (("half0", "half0_1/convolution"), ("half1", "half1_1/convolution"),
                                  ("total", "total_1/Add"))}
    ops = graph.op_index()
    tensor = next(t for t in range(graph.n_tensors) if graph.tensor_producer[t] == ops[names["half0"]])
    plan = SwapPlan.from_swaps(graph, [Swap(tensor, False, (SwapIn((ops[names["total"]],), None),))])
    fused, _ = safe_wait_slots(graph, plan.tensor[plan.in_swap], plan.in_trigger, plan.in_after,
                               plan.in_consumer_ptr, plan.in_consumers)
    assert not fused.any()
    step = rewriter.apply(model, plan, graph=graph, batch_size=2)
    assert step.verification.ok, step.verification.summary()
    (swap_in,) = step.applied[0].swap_ins
    assert names["half1"] in swap_in.controls
    predicted = replay(graph, plan, get_device("cpu-testbed"))
    assert predicted.swap_in_start_s[0] >= predicted.op_end_s[ops[names["half1"]]]  # after the other half


def test_serialized_order_holds_past_the_reshapes_grappler_removes():
    """A convolution's bias gradient is reshaped [C] -> [1, 1, 1, C] -> [C] (Keras 3 adds the bias
    as a reshaped vector); Grappler removes the pair and, with it, the chain's control edge the next
    op hung on it (multi_io's MaxPoolGrad then ran beside the filter gradient before it, 17 % above
    the prediction). In the partition graphs every op of the order the step is chained in (the plan's,
    with oneDNN's merge partners side by side: ``chain_order.partners_adjacent``) still runs after the one
    before."""
    from rewriter.trace.tracing import import_step
    from rewriter.check.collected import collect_first_call
    from rewriter.edit.chain_order import partners_adjacent
    from rewriter.edit.graph_edit import GraphEditor
    from rewriter.check.verification import CopyWaits, _node_map

    keras.utils.set_random_seed(0)
    inputs = keras.Input((12, 12, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv0")(inputs)
    x = keras.layers.MaxPooling2D(2, name="pool0")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1")(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(x)))
    model.compile(optimizer="adam", loss="mse")
    graph = rewriter.capture(model, 2)
    step = rewriter.apply(model, SwapPlan.empty(graph), graph=graph, batch_size=2)
    serialized = _nodes(step)
    order = [name for name in step.plan.order if name in serialized and serialized[name].op != "Placeholder"]
    assert any(serialized[name].op == "Reshape" and serialized[name].input[0].endswith("BiasAddGrad")
               for name in order)  # the pair Grappler removes is there
    order = partners_adjacent(GraphEditor(step.traced.concrete.graph.as_graph_def()), order)
    snapshot = step.snapshot()
    try:
        _, collected = collect_first_call(import_step(step.graph_def, step.traced), *step.zeros())
    finally:
        snapshot.restore()
    function = max(collected, key=lambda fg: sum(len(p.node) for p in fg.partition_graphs))
    waits = CopyWaits(function.partition_graphs, _node_map(function.post_optimization_graph))
    running = [name for name in order if name in waits.nodes]
    assert len(running) < len(order)  # Grappler removed some
    lost = [(before, after) for before, after in zip(running, running[1:]) if not waits.depends(after, before)]
    assert not lost


def _dense_join():
    """A dense model whose first activation is read again only at the end of the backward pass."""
    keras.utils.set_random_seed(3)
    image, meta = keras.Input((12,), name="image"), keras.Input((3,), name="meta")
    h = keras.layers.Concatenate(name="join")([keras.layers.Dense(128, activation="relu", name="embed")(image), meta])
    for i in range(6):
        h = keras.layers.Dense(32, activation="relu", name=f"hidden{i}")(h)
    model = keras.Model([image, meta], keras.layers.Dense(2, name="head")(h))
    model.compile("sgd", "mse")
    return model


def test_copies_out_on_the_testbed_run_right_after_their_producer():
    """On the testbed a copy out waits for a compute thread: left to the executor, it ran right after
    its producer in some steps and just before its swap-in in others, its buffer held all that while
    (the every_model multi-output model measured 96.1 or 112.1 KiB against 103.8 predicted). The op
    after the producer waits for it, so every step holds what the replay predicts; on a GPU (a copy
    engine of its own) nothing waits."""
    model = _dense_join()
    graph = rewriter.capture(model, 32)
    plan = plan_swaps(graph, SwapParams(threshold=39, lb=4, ub=12, min_bytes=4096, order="memory"))
    assert plan.n_swaps >= 1
    step = rewriter.apply(model, plan, graph=graph, batch_size=32)
    assert step.verification.ok, step.verification.summary()
    nodes = _nodes(step)
    order = [str(name) for name in graph.op_name[plan.order]]
    for applied in step.applied:
        producer = applied.tensor.partition(":")[0]
        assert order.index(applied.started_by) > order.index(producer)
        # an op of a fused chain waits through its kernel or bias, forwarded (the test below)
        waiter = applied.waits_through or applied.started_by
        assert f"^{applied.swap_out}" in nodes[waiter].input
        assert not applied.waits_through or applied.waits_through in nodes[applied.started_by].input
    predicted = replay(graph, plan, get_device("cpu-testbed")).peak_bytes
    x, y = synthetic_batch(model, 32, seed=0)
    peaks = [rewriter.measure(step, x, y, warmup=1, repeats=1).peak_bytes for _ in range(6)]
    assert max(peaks) <= predicted, (peaks, predicted)
    on_gpu = rewriter.apply(model, plan, graph=graph, batch_size=32, placement=rewriter.GpuPlacement(), verify=False)
    assert on_gpu.applied and not any(applied.started_by for applied in on_gpu.applied)


def test_a_fused_convolution_after_the_producer_waits_for_the_copy_out_through_its_kernel():
    """A convolution stack whose swapped activations are each read next by the following Conv2D+BiasAdd+Relu chain:
    a control edge on the Conv2D would leave the chain unfused, so the Conv2D reads its kernel through an Identity
    that waits for the copy out (``AppliedSwap.waits_through``). Waited for past the chains instead, a split stack's
    copy ran after the next two convolutions now and then on a loaded testbed, one part's activation held through
    them (docs/design.md 9). The step is verified and measures no more than the replay predicts."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16, 16, 3)),
                              *[keras.layers.Conv2D(8, 3, padding="same", activation="relu") for _ in range(4)],
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    graph = rewriter.capture(model, 8)
    plan = plan_swaps(graph, SwapParams(threshold=4, min_bytes=4096))
    step = rewriter.apply(model, plan, graph=graph, batch_size=8)
    assert step.verification.ok, step.verification.summary()
    nodes = _nodes(step)
    through = [applied for applied in step.applied if applied.waits_through]
    assert any(nodes[applied.started_by].op == "Conv2D" for applied in through), [
        (applied.tensor, applied.started_by) for applied in step.applied]
    for applied in through:
        waiting = nodes[applied.waits_through]
        assert waiting.op == "Identity" and f"^{applied.swap_out}" in waiting.input
        assert nodes[applied.started_by].op in ("Conv2D", "MatMul")  # the Dense head's chain too
        assert nodes[applied.started_by].input[1] == waiting.name
        assert f"^{applied.swap_out}" not in nodes[applied.started_by].input
    x, y = synthetic_batch(model, 8, seed=0)
    predicted = replay(graph, plan, get_device("cpu-testbed")).peak_bytes
    peaks = [rewriter.measure(step, x, y, warmup=1, repeats=1).peak_bytes for _ in range(3)]
    assert max(peaks) <= predicted, (peaks, predicted)


# ---------------------------------------------------------------------- plans by canonical names
# A plan belongs to the model, not to the names Keras and TensorFlow gave its layers in one process
# (``rewriter.trace.op_names``): a copy of the model loaded in the same process (its layers ``dense_2``,
# ``softmax_3``, ... where the first copy had ``dense``, ``softmax``) or in another process takes the
# plan; another model is refused; no op of a plan's order is dropped silently.

NAMES_BATCH = 4
ROOT = Path(__file__).resolve().parents[2]

BLOCK_SOURCE = textwrap.dedent('''
    import keras

    @keras.saving.register_keras_serializable("test_plan_names")
    class Block(keras.layers.Layer):
        """Sublayers made without names: every copy of the model names them from Keras' counter."""

        def __init__(self, units=16, **kwargs):
            super().__init__(**kwargs)
            self.units = units
            self.dense = keras.layers.Dense(units)
            self.softmax = keras.layers.Softmax()

        def call(self, x):
            return self.softmax(self.dense(x))

        def get_config(self):
            return {**super().get_config(), "units": self.units}
''')


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A model of custom blocks saved, and the module that defines them."""
    directory = tmp_path_factory.mktemp("plan_names")
    (directory / "blocks_for_plan_names.py").write_text(BLOCK_SOURCE)
    sys.path.insert(0, str(directory))
    import blocks_for_plan_names as blocks

    inputs = keras.Input((8,))
    outputs = blocks.Block(3)(blocks.Block(16)(blocks.Block(16)(inputs)))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    model.save(directory / "blocks.keras")
    yield directory, directory / "blocks.keras"
    sys.path.remove(str(directory))


@pytest.fixture(scope="module")
def plan_of_first_copy(saved):
    """Made under op determinism, which this module's other fixtures turn on for the process (it changes
    how some ops are traced): whichever test runs first, the plan is the same, and so is the other
    process's step (``test_another_process_takes_the_plan`` turns it on there too)."""
    th.deterministic()
    directory, path = saved
    first = keras.models.load_model(path)
    graph = rewriter.capture(first, NAMES_BATCH)
    plan = plan_swaps(graph, SwapParams(threshold=1, lb=1, ub=8))
    assert plan.n_swaps > 0
    (directory / "plan.json").write_text(plan.to_json(graph))
    return first, graph, directory / "plan.json"


def _names_batch():
    rng = np.random.default_rng(0)
    return rng.random((NAMES_BATCH, 8), dtype=np.float32), np.eye(3, dtype=np.float32)[rng.integers(0, 3, NAMES_BATCH)]


def test_a_second_copy_in_the_same_process_takes_the_plan(saved, plan_of_first_copy):
    _, path = saved
    first, graph, plan_file = plan_of_first_copy
    second = keras.models.load_model(path)
    inner = [layer.name for layer in second._flatten_layers(include_self=False) if layer.name.startswith("dense")]
    outer = [layer.name for layer in first._flatten_layers(include_self=False) if layer.name.startswith("dense")]
    assert inner != outer  # Keras named the copies' layers apart
    again = rewriter.capture(second, NAMES_BATCH)
    assert again.op_name.tolist() != graph.op_name.tolist()  # the traced names differ, the canonical ones do not
    assert [again.meta["canonical_names"][n] for n in again.op_name] == \
        [graph.meta["canonical_names"][n] for n in graph.op_name]
    step = rewriter.apply(second, plan_file, batch_size=NAMES_BATCH)
    planned = json.loads(plan_file.read_text())
    assert step.n_swap_outs == len(planned["swaps"]) and not step.skipped
    assert step.verification.ok, step.verification.summary()
    assert np.isfinite(float(step(*_names_batch())))


def test_another_process_takes_the_plan(saved, plan_of_first_copy):
    directory, path = saved
    _, _, plan_file = plan_of_first_copy
    script = textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {str(directory)!r})
        import blocks_for_plan_names, keras, rewriter, tensorflow as tf
        tf.config.experimental.enable_op_determinism()
        keras.models.load_model({str(path)!r})  # a copy first: the one the plan is applied to is named apart
        model = keras.models.load_model({str(path)!r})
        step = rewriter.apply(model, {str(plan_file)!r}, batch_size={NAMES_BATCH})
        print("applied", step.n_swap_outs, len(step.skipped), step.verification.ok)
    ''')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    planned = json.loads(plan_file.read_text())
    assert f"applied {len(planned['swaps'])} 0 True" in done.stdout, done.stdout + done.stderr[-3000:]


def test_another_model_is_refused_and_no_op_of_the_order_is_dropped(saved, plan_of_first_copy, caplog):
    _, path = saved
    _, _, plan_file = plan_of_first_copy
    inputs = keras.Input((8,))
    other = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(keras.layers.Dense(16)(inputs)))
    other.compile(optimizer="adam", loss="categorical_crossentropy")
    with pytest.raises(PlanError, match="made for another model"):
        rewriter.apply(other, plan_file, batch_size=NAMES_BATCH)
    # a swap-only plan whose order names an op the step does not have: said, not dropped silently; one whose
    # order is mostly of another step: refused
    data = json.loads(plan_file.read_text())
    data["swaps"] = []
    data["order"] = data["order"][:3] + ["functional/block/no_such_op"] + data["order"][3:]
    with caplog.at_level(logging.WARNING, logger="rewriter.edit.graph_edit"):
        rewriter.apply(keras.models.load_model(path), data, batch_size=NAMES_BATCH, verify=False)
    assert any("1 of the" in r.getMessage() and "no_such_op" in r.getMessage() for r in caplog.records)
    data["order"] = [f"other/{name}" for name in data["order"]]
    with pytest.raises(PlanError, match="made for another model"):
        rewriter.apply(keras.models.load_model(path), data, batch_size=NAMES_BATCH)
