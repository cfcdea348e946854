"""The GPU path, built and checked without a GPU: the GraphDef a placement runs, what Grappler would
make of it on a GPU, the device memory limit, and what XLA means for the plan.

* ``rewritten_graph_def(model, plan, placement=GpuPlacement())``: the rewritten step's GraphDef as the
  placement would run it (swap nodes on its devices); needs no such device.
* ``optimize_for_gpu(graph_def, fetches)``: Grappler's meta-optimizer run offline on a virtual cluster
  with one GPU (``tf_optimizer.OptimizeGraph``), with the rewritten step's configuration
  (``grappler.swap_grappler_config``) or another: what a GPU's graph passes (the layout optimizer, which
  runs only for GPUs) do to the swap nodes, seen on a CPU.
* ``limit_device_memory(budget_bytes)`` (``rewriter.placement.placements``, re-exported): the budget as GPU:0's
  memory limit, before TensorFlow's runtime starts (before the model is loaded), so that a plan that
  does not fit runs out of memory as it would on a GPU of that size.
* ``jit_compile_note(model)``: whether the user's own ``model.fit`` compiles with XLA, and what that
  means for the plan.
* ``replicated_gpu_graph_def(model, plan)``: a ``MirroredStrategy`` step with the plan on every replica as N GPUs
  of one machine run it (replica k on GPU:k, every replica's swaps to the machine's CPU:0), built from a model on
  the testbed's replicas or on GPUs; ``replica_placement_problems`` checks it (docs/design.md 14).
"""

from __future__ import annotations

from typing import Any, Iterable

import tensorflow as tf

from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2, device_properties_pb2, meta_graph_pb2
from tensorflow.python.grappler import cluster as gcluster
from tensorflow.python.grappler import tf_optimizer

from rewriter.step.apply_plan import apply
from rewriter.step.host_state import state_nodes
from rewriter.step.replicated import ReplicatedEdit, edit_replicas, replicated_batch_shapes, trace_for_plan
from rewriter.trace.replicas import SHARED, ReplicatedTrace
from rewriter.tf_effects.grappler import swap_grappler_config
from rewriter.placement.placements import GpuPlacement, Placement, limit_device_memory  # noqa: F401 -- re-exported

GPU_DEVICE = "/job:localhost/replica:0/task:0/device:GPU:0"
CPU_DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"


def rewritten_graph_def(model, plan, *, graph=None, batch_size: int | None = None,
                        placement: Placement | str | None = None, **apply_kwargs: Any) -> graph_pb2.GraphDef:
    """The GraphDef ``rewriter.step.apply_plan`` builds for ``placement`` (default ``GpuPlacement()``), without
    running it: nothing needs the placement's devices. Same arguments as ``rewriter.step.apply_plan``."""
    step = apply(model, plan, graph=graph, batch_size=batch_size,
                 placement=GpuPlacement() if placement is None else placement, verify=False, **apply_kwargs)
    return step.graph_def


def place_unassigned(graph_def: graph_pb2.GraphDef, device: str = "/device:GPU:0") -> graph_pb2.GraphDef:
    """A copy with every node that has no device put on ``device``, as TensorFlow's placer does for ops
    with a kernel there (Grappler runs on placed graphs)."""
    placed = graph_pb2.GraphDef()
    placed.CopyFrom(graph_def)
    for node in placed.node:
        if not node.device:
            node.device = device
    return placed


def virtual_gpu_cluster(*, memory_bytes: int = 16 * 2**30, compute_capability: str = "7.0",
                        gpus: int = 1) -> gcluster.Cluster:
    """A Grappler cluster of ``gpus`` GPUs (V100s by default) and one CPU, for offline optimization."""
    gpu = device_properties_pb2.DeviceProperties(
        type="GPU", vendor="NVIDIA", model="virtual", frequency=1530, num_cores=80, num_registers=65536,
        l1_cache_size=24576, l2_cache_size=6291456, shared_memory_size_per_multiprocessor=98304,
        memory_size=int(memory_bytes), bandwidth=900_000_000,
        environment={"architecture": compute_capability, "cuda": "12030", "cudnn": "8900"})
    cpu = device_properties_pb2.DeviceProperties(type="CPU", frequency=2000, num_cores=8)
    named = [device_properties_pb2.NamedDevice(name=GPU_DEVICE[:-1] + str(k), properties=gpu) for k in range(gpus)]
    return gcluster.Cluster(devices=named + [device_properties_pb2.NamedDevice(name=CPU_DEVICE, properties=cpu)])


def optimize_for_gpu(graph_def: graph_pb2.GraphDef, fetches: Iterable[str], *,
                     config: config_pb2.ConfigProto | None = None, cluster: gcluster.Cluster | None = None,
                     ) -> graph_pb2.GraphDef:
    """Grappler's output for ``graph_def`` on a GPU (``virtual_gpu_cluster``), unplaced nodes on GPU:0.

    ``fetches``: the step's output node names. ``config``: default, the rewritten step's
    (``swap_grappler_config`` on TensorFlow's defaults)."""
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(place_unassigned(graph_def))
    for name in fetches:
        meta.collection_def["train_op"].node_list.value.append(name.split(":")[0].lstrip("^"))
    if config is None:
        config = swap_grappler_config(config_pb2.ConfigProto())
    return tf_optimizer.OptimizeGraph(config, meta, cluster=cluster or virtual_gpu_cluster())


def host_side_problems(graph_def: graph_pb2.GraphDef, applied, host: str) -> list[str]:
    """Swap-ins whose accelerator-side node reads a host-side node (on ``host``) that does not carry its control
    inputs, or carries control inputs itself (the GraphDef as built, before any run): such a copy to the
    accelerator would not wait for its trigger."""
    nodes = {node.name: node for node in graph_def.node}
    problems = []
    for swap in applied:
        for item in swap.swap_ins:
            node = nodes[item.name]
            if any(ref.startswith("^") for ref in node.input):
                problems.append(f"{item.name}: control inputs on the accelerator side")
            for ref in node.input:
                source = nodes.get(ref.split(":")[0])
                if source is None or _device_key(source.device) != _device_key(host):
                    problems.append(f"{item.name}: reads {ref}, not a node on {host}")
                elif not {c[1:] for c in source.input if c.startswith("^")} >= set(item.controls):
                    problems.append(f"{item.name}: {source.name} does not wait for {', '.join(item.controls)}")
    return problems


def _device_key(device: str) -> tuple[str, int | None]:
    spec = tf.DeviceSpec.from_string(device or "")
    return (spec.device_type or "").upper(), spec.device_index


def replica_gpus(trace: ReplicatedTrace) -> tuple[str, ...]:
    """The GPU each replica runs on: its own where the model was built on GPUs, else GPU:k for replica k (the
    testbed's CPU:2k), named as the replica's device is (job, replica, task)."""
    gpus = []
    for k, device in enumerate(trace.replicas.devices):
        spec = tf.DeviceSpec.from_string(device)
        gpus.append(spec.to_string() if (spec.device_type or "").upper() == "GPU"
                    else spec.replace(device_type="GPU", device_index=k).to_string())
    return tuple(gpus)


def replicated_gpu_graph_def(model, plan, *, graph=None, batch_size: int | None = None, host: str = "/device:CPU:0",
                             **trace_kwargs: Any) -> ReplicatedEdit:
    """The ``MirroredStrategy`` step of ``model`` with ``plan`` on every replica, as the machine's GPUs run it, built
    without one: every op of replica k on its GPU (``replica_gpus``; the ops TensorFlow leaves to its placer, a
    variable's reads and the step's inputs, placed there too), each replica's swaps to ``host``, the one host memory
    of the machine the replicas share. ``.graph_def`` is what a GPU machine imports; ``replica_placement_problems``
    checks it. Same arguments as ``rewriter.step.replicated.apply_replicated``."""
    named, inputs, trace = trace_for_plan(model, plan, batch_size=batch_size, graph=graph, **trace_kwargs)
    gpus = replica_gpus(trace)
    graph_def = trace.step_graph_def()
    for node in graph_def.node:
        owner = trace.owner.get(node.name, SHARED)
        if owner != SHARED:
            node.device = gpus[owner]
    placements = tuple(GpuPlacement(accelerator="/device:" + gpu.rsplit("device:", 1)[-1], host=host) for gpu in gpus)
    shapes = replicated_batch_shapes(model, trace, inputs, named.graph_rewrites) if named.splits else None
    state = state_nodes(graph_def, trace.traced, model, named.host_state) if named.host_state else None
    return edit_replicas(trace, named, placements, graph_def=graph_def, shapes=shapes, state=state)


def replica_placement_problems(edit: ReplicatedEdit) -> list[str]:
    """What would make the GPU-placed replicated step (``replicated_gpu_graph_def``) run otherwise than planned: an
    op of replica k off its GPU (a node of its split regions too), a swap node off its device (the copy
    out and the host-side swap-in on the host, the swap-in on the replica's GPU), a copy to a GPU that would not wait
    for its trigger (``host_side_problems``), a node of the optimizer state the plan moves off the host."""
    nodes = {node.name: node for node in edit.graph_def.node}
    on_host = [edit.on_host[k] if edit.on_host else frozenset() for k in range(len(edit.placements))]
    problems = [f"{name} (replica {k}) on {nodes[name].device or 'no device'}, not {edit.placements[k].accelerator}"
                for name, k in edit.trace.owner.items()  # (ops the edit removed, Keras' IdentityN, are not there)
                if k != SHARED and name in nodes and name not in on_host[k]
                and _device_key(nodes[name].device) != _device_key(edit.placements[k].accelerator)]
    for k, place in enumerate(edit.placements):
        problems += [f"{name} (replica {k}'s optimizer state) on {nodes[name].device or 'no device'}, not {place.host}"
                     for name in sorted(on_host[k]) if name in nodes
                     and _device_key(nodes[name].device) != _device_key(place.host)]
        split_nodes = [name for item in (edit.splits[k] if edit.splits else ()) for name in item.nodes]
        problems += [f"{name} (replica {k}) on {nodes[name].device or 'no device'}, not {place.accelerator}"
                     for name in split_nodes if _device_key(nodes[name].device) != _device_key(place.accelerator)]
        for swap in edit.applied[k]:
            wanted = [(swap.swap_out, place.swap_out_device)]
            wanted += [(node, device) for item in swap.swap_ins
                       for node, device in ((item.host_node, place.host), (item.name, place.accelerator))]
            problems += [f"{name} (replica {k}) on {nodes[name].device}, not {device}" for name, device in wanted
                         if _device_key(nodes[name].device) != _device_key(device)]
        problems += [f"replica {k}: {line}" for line in host_side_problems(edit.graph_def, edit.applied[k], place.host)]
    return problems


def jit_compile_note(model) -> tuple[bool | None, str]:
    """(whether the user's ``model.fit`` compiles ``train_step`` with XLA, a sentence on what follows).

    Keras 3 compiles with XLA by default when a GPU is visible (``jit_compile="auto"``); the tool captures,
    simulates, measures and installs the step without XLA."""
    value = getattr(model, "jit_compile", None)
    if value is None:
        return None, "jit_compile: unknown (not a compiled Keras model)"
    if not value:
        return False, "jit_compile: off; model.fit runs the same (non-XLA) step the tool captured and measured"
    return True, ("jit_compile: on (Keras compiles model.fit's train_step with XLA, its default on a GPU): the tool "
                  "captured, measured and installs the step without XLA, so rewriter.use_swap_step makes model.fit "
                  "run without XLA; your own fit without the tool runs another program, whose memory (XLA fuses "
                  "elementwise chains, usually less) and speed the prediction does not describe. Compile with "
                  "jit_compile=False to compare like with like")
