"""The GPU path, checked on CPU: swap-ins wait on the host side, what the copy to the accelerator waits
for (verification), the GPU GraphDef through Grappler for a GPU, memory limits and budgets."""

from __future__ import annotations

import dataclasses

import tests.tf_tools as th  # noqa: I001 -- first: configures TF before its runtime starts

import pytest
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

import rewriter
from benchmarks.models import build_model
from rewriter.check import collected
from rewriter.step import gpu_graph as gpu
from rewriter.check import verification as verify_module
from rewriter.trace.tracing import import_step
from simulator import SwapParams, plan_swaps

BATCH = 8


@pytest.fixture(scope="module")
def cnn():
    model = build_model("small_cnn", seed=0)
    graph = rewriter.capture(model, BATCH)
    plan = plan_swaps(graph, SwapParams(threshold=1, min_bytes=4096))
    return model, graph, plan


@pytest.mark.tf
def test_every_copy_to_the_accelerator_waits_for_its_trigger(cnn):
    """In the partition graphs the testbed runs, each accelerator-side _Recv carrying a swap-in depends on
    every control source of its swap-in (trigger, sync sources, after): the host-side node waits, the
    copy follows. The old construction (control edges on the accelerator-side node) fails the check."""
    model, graph, plan = cnn
    step = rewriter.apply(model, plan, graph=graph, batch_size=BATCH)
    v = step.verification
    assert v.ok, v.summary()
    planned = sum(len(item.controls) for swap in step.applied for item in swap.swap_ins)
    assert planned > 0 and v.copies_checked >= planned and v.copies_waiting == v.copies_checked
    triggered = [item for swap in step.applied for item in swap.swap_ins if item.trigger]
    assert triggered
    for item in triggered:  # what the host-side node waits for, read back through _Send/_Recv pairs
        assert set(item.controls) <= set(v.copy_waits[item.name]), (item.name, v.copy_waits[item.name])

    # the earlier construction: the swap-in on the accelerator carries the control edges
    old = graph_pb2.GraphDef()
    old.CopyFrom(step.graph_def)
    nodes = {node.name: node for node in old.node}
    host_nodes = {item.host_node: item for swap in step.applied for item in swap.swap_ins}
    for swap in step.applied:
        nodes[swap.swap_out].device = step.placement.host  # the copy out made on the host, as it then was
        for item in swap.swap_ins:
            host = nodes[item.host_node]
            del nodes[item.name].input[:]
            nodes[item.name].input.extend([swap.swap_out] + [ref for ref in host.input if ref.startswith("^")])
    kept = [node for node in old.node if node.name not in host_nodes]
    del old.node[:]
    old.node.extend(kept)
    applied = [dataclasses.replace(swap, swap_ins=tuple(dataclasses.replace(item, host_node=item.name)
                                                        for item in swap.swap_ins)) for swap in step.applied]
    snapshot = step.snapshot()
    try:
        _, graphs = collected.collect_first_call(import_step(old, step.traced), *step.zeros())
    finally:
        snapshot.restore()
    early = verify_module.check(graphs, applied, accelerator=step.placement.accelerator, host=step.placement.host)
    assert not early.ok and early.copies_early
    assert early.copies_waiting < early.copies_checked
    assert any(item.trigger and item.trigger in line for line in early.copies_early for item in triggered)


@pytest.mark.tf
def test_gpu_graph_def_waits_on_the_host_and_grappler_for_a_gpu_inserts_nothing(cnn):
    """The GPU GraphDef, built and optimized for a (virtual) GPU without one: every host-side node a GPU
    swap-in reads carries its swap-in's control inputs; with TensorFlow's default configuration the
    layout optimizer puts Transposes between producers and swap-outs (the check can fail), with the
    rewritten step's configuration nothing stands between them."""
    model, graph, plan = cnn
    step = rewriter.apply(model, plan, graph=graph, batch_size=BATCH, placement=rewriter.GpuPlacement(), verify=False)
    graph_def = rewriter.rewritten_graph_def(model, plan, graph=graph, batch_size=BATCH,
                                             placement=rewriter.GpuPlacement())
    assert graph_def == step.graph_def
    nodes = {node.name: node for node in graph_def.node}
    device_copies = 0
    for swap in step.applied:
        assert nodes[swap.swap_out].device == "/device:CPU:0"
        for item in swap.swap_ins:
            node = nodes[item.name]
            assert node.device == "/device:GPU:0" and not [ref for ref in node.input if ref.startswith("^")]
            for ref in node.input:  # every host-side node this GPU node reads waits for the swap-in's sources
                source = nodes[ref.split(":")[0]]
                assert source.device == "/device:CPU:0"
                assert {ref[1:] for ref in source.input if ref.startswith("^")} >= set(item.controls)
                assert source.input[0] == swap.swap_out
                device_copies += 1
    assert device_copies == step.n_swap_ins

    fetches = [tensor.name for tensor in step.traced.concrete.outputs]
    producer_of = {swap.swap_out: swap.tensor for swap in step.applied}

    def between(optimized) -> list[str]:
        """Swap-outs whose input is no longer the planned tensor itself (something was put between)."""
        found = {node.name: node for node in optimized.node}
        wrong = []
        for name, tensor in producer_of.items():
            node = found.get(name)
            assert node is not None, f"{name} removed"
            source = node.input[0]
            if source.split(":")[0] != tensor.split(":")[0] or found[source.split(":")[0]].op == "Transpose":
                wrong.append(f"{name} <- {source} ({found[source.split(':')[0]].op})")
        return wrong

    defaults = config_pb2.ConfigProto()  # the earlier configuration: only the memory optimizer off
    defaults.graph_options.rewrite_options.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    layout = gpu.optimize_for_gpu(graph_def, fetches, config=defaults)
    assert any(node.op == "Transpose" for node in layout.node)
    assert between(layout), "the layout optimizer should have put Transposes before some swap-out"
    ours = gpu.optimize_for_gpu(graph_def, fetches)
    assert not any(node.op == "Transpose" for node in ours.node)
    assert between(ours) == []


@pytest.mark.tf
def test_gpu_check_dry_run_builds_and_checks_the_gpu_graph_def(tmp_path, capsys):
    from benchmarks import gpu_check

    assert gpu_check.main(["--dry-run", "--model", "small_cnn", "--batch", "8", "--swaps", "6",
                           "--out", str(tmp_path)]) == 0
    text = (tmp_path / "gpu_check_dry.md").read_text()
    assert "| swaps |" in text and "_host` (/device:CPU:0), which waits for" in text
    assert "problem:" not in text and "0 host-side problem(s)" in capsys.readouterr().out
    assert gpu_check.main(["--model", "small_cnn"]) == 2  # no GPU here: says so, exit code 2


@pytest.mark.tf
def test_the_rewritten_step_runs_with_the_swap_configuration():
    from tensorflow.python.eager import context

    from rewriter.tf_effects.grappler import fixed_grappler_config

    with fixed_grappler_config():
        config = config_pb2.ConfigProto()
        config.ParseFromString(context.context().function_call_options.config_proto_serialized)
    rewrite = config.graph_options.rewrite_options
    off = rewriter_config_pb2.RewriterConfig.OFF
    assert rewrite.layout_optimizer == off and rewrite.pin_to_host_optimization == off
    assert rewrite.memory_optimization == rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    assert config.graph_options.optimizer_options.global_jit_level == config_pb2.OptimizerOptions.OFF
    outside = config_pb2.ConfigProto()
    outside.ParseFromString(context.context().function_call_options.config_proto_serialized)
    assert outside.graph_options.rewrite_options.layout_optimizer != off  # restored afterwards


@pytest.mark.tf
def test_each_replicas_gpu_peak_is_read_from_its_own_allocator():
    """On GPUs each replica's allocations are its GPU's allocator's alone (GPU_k_bfc), on top of its resident
    bytes; the host copies of both replicas share the machine's pinned allocator, one figure for the machine."""
    from rewriter.timing.replica_peaks import gpu_replica_peaks
    from tests.autotune.run.test_gpu_budgets import _events

    events = _events([
        (1, "alloc", 10, 1000, 1024, "conv", "GPU_0_bfc"),
        (2, "alloc", 11, 3000, 3072, "replica_1/conv", "GPU_1_bfc"),
        (3, "alloc", 20, 500, 512, "swap_out/conv_0", "gpu_host_bfc"),
        (4, "alloc", 21, 700, 768, "swap_out/replica_1/conv_0", "gpu_host_bfc"),
        (5, "free", 10, 1000, 1024, "conv", "GPU_0_bfc"),
        (6, "alloc", 12, 200, 256, "relu", "GPU_0_bfc"),
        (7, "free", 11, 3000, 3072, "replica_1/conv", "GPU_1_bfc"),
    ])
    placements = (rewriter.GpuPlacement(accelerator="/device:GPU:0"), rewriter.GpuPlacement(accelerator="/device:GPU:1"))
    devices = tuple(f"/job:localhost/replica:0/task:0/device:GPU:{k}" for k in range(2))  # as the strategy names them
    peaks = gpu_replica_peaks(events, placements, devices=devices, resident_bytes=[100, 300],
                              allocator_peak_bytes=[4096, 8192])
    assert [p.peak_bytes for p in peaks] == [100 + 1000, 300 + 3000]
    assert [p.resident_bytes for p in peaks] == [100, 300] and tuple(p.device for p in peaks) == devices
    assert [p.host_peak_bytes for p in peaks] == [1200, 1200] and all(p.host_shared for p in peaks)
