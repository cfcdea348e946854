"""A step replicated by ``tf.distribute.MirroredStrategy``: which ops are whose, and one replica's capture.

Traced as ``strategy.run(model.train_step, ...)`` in one ``tf.function``, the step is one graph that holds every
replica's ops, each placed on its replica's device (docs/design.md 14). Replicas run the same step on their share
of the batch, so one replica's graph is what a plan is made for: ``capture_replicated`` captures replica 0's ops
(at the per-replica batch, with the gradients' all-reduce pack ``ConcatV2 -> CollectiveReduceV2 -> SplitV`` and
its buffers) as an ``OpGraph``, and ``ReplicatedTrace.names`` maps each of replica 0's ops to the op that plays
its part on every other replica, found by structure (inputs, slots and types; never by name: TensorFlow names a
later replica's ops with a ``replica_1/`` prefix, a ``_1`` suffix or neither).

``Replicas`` is the strategy resolved once: its replica devices, the host device each replica's swaps go to
(on the testbed ``CPU:2k`` plays replica k's accelerator and ``CPU:2k+1`` its host, ``testbed_replicas``) and
the per-replica batch. Under ``MultiWorkerMirroredStrategy`` each worker process captures and rewrites its own
replicas' step the same way (the all-reduce then runs across the processes). Other strategies are refused in one
line.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from rewriter.errors import CaptureError
from rewriter.tf_effects.collectives import COLLECTIVE_TYPES, strategy_of, unsupported
from rewriter.trace.optimizer_state import describe_movable_state
from rewriter.trace import state_kinds
from rewriter.trace.training_setup import describe_training
from rewriter.trace.step_inputs import NO_STEP_INPUTS, StepInputs, build_if_needed, step_specs
from rewriter.trace.tracing import (TracedStep, _optimizer_scope, _second_batch, build_opgraph, check_compiled,
                                    import_step, rewrite_graph_def, traced_function, with_rewrites)
from rewriter.trace.op_names import canonical, canonical_names
from simulator.graph import OpGraph

SHARED = -1  # an op no replica owns (a NoOp grouping every replica's updates)


def _device_key(device: str) -> tuple[str, int]:
    spec = tf.DeviceSpec.from_string(device)
    return (spec.device_type or "").upper(), int(spec.device_index or 0)


@dataclass(frozen=True)
class Replicas:
    """The strategy a model was built under, resolved once: this process's replica ``k`` runs on ``devices[k]``
    and swaps to ``hosts[k]``; the hosts of one machine share its memory. ``in_sync``: the replicas of every
    worker (``MultiWorkerMirroredStrategy``: each worker process runs ``count`` of them, its first being replica
    ``first_replica`` of the group); under ``MirroredStrategy`` ``in_sync == count``."""

    strategy: Any = field(compare=False, repr=False)
    devices: tuple[str, ...]
    hosts: tuple[str, ...]
    in_sync: int
    first_replica: int

    @property
    def count(self) -> int:
        """Replicas in this process."""
        return len(self.devices)

    @property
    def workers(self) -> int:
        return self.in_sync // self.count

    def per_replica_batch(self, batch_size: int) -> int:
        """The batch each replica runs: the global batch (of every worker) split evenly, as ``model.fit`` splits
        it."""
        batch_size = int(batch_size)
        if batch_size < self.in_sync or batch_size % self.in_sync:
            raise CaptureError(f"the batch size {batch_size} does not split evenly over {self.in_sync} replicas: "
                               f"give a multiple of {self.in_sync}")
        return batch_size // self.in_sync

    def replica_of_device(self, device: str) -> int | None:
        """The replica whose accelerator ``device`` is (None for another device, or none)."""
        if not device:
            return None
        key = _device_key(device)
        found = [k for k, own in enumerate(self.devices) if _device_key(own) == key]
        return found[0] if found else None

    def is_host_of(self, device: str, k: int) -> bool:
        """True where ``device`` is replica ``k``'s host (every replica's, beside GPUs: the machine's CPU)."""
        return bool(device) and _device_key(device) == _device_key(self.hosts[k])

    @property
    def task(self) -> int:
        """This worker's index (0, the chief, under MirroredStrategy)."""
        return self.first_replica // self.count

    def exchange(self, payload: bytes) -> list[bytes]:
        """Every worker's ``payload``, by task, on every worker: two all-reduces of the strategy (the lengths, then
        the bytes padded to the longest, each worker's in its own row, its first replica contributing). Every
        worker must call it together, as any collective; under MirroredStrategy ``[payload]``."""
        if self.workers == 1:
            return [bytes(payload)]

        def own_row(values: np.ndarray):
            def value_for(context):
                mine = context.replica_id_in_sync_group == self.first_replica
                return tf.constant(values if mine else np.zeros_like(values))
            return self.strategy.reduce("SUM", self.strategy.experimental_distribute_values_from_function(value_for),
                                        axis=None).numpy()

        lengths = np.zeros(self.workers, np.int64)
        lengths[self.task] = len(payload)
        lengths = own_row(lengths)
        rows = np.zeros((self.workers, int(lengths.max())), np.int32)  # int32: the collectives sum no uint8
        rows[self.task, :len(payload)] = np.frombuffer(payload, np.uint8)
        rows = own_row(rows)
        return [rows[k, :lengths[k]].astype(np.uint8).tobytes() for k in range(self.workers)]

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "strategy": type(self.strategy).__name__, "devices": list(self.devices),
                "hosts": list(self.hosts), "in_sync": self.in_sync, "workers": self.workers}


def testbed_replicas(count: int = 2) -> list[str]:
    """The replica devices of the testbed with ``count`` replicas: ``CPU:0``, ``CPU:2``, ... (each beside its
    host ``CPU:2k+1``; ``rewriter.placement.configure_testbed(2 * count)`` makes them)."""
    return [f"/device:CPU:{2 * k}" for k in range(count)]


def resolve_replicas(model) -> Replicas:
    """The ``Replicas`` of a model built under a strategy; one ``CaptureError`` for what is not supported."""
    strategy = strategy_of(model)
    if strategy is None:
        raise CaptureError("the model was not built under a tf.distribute strategy: use rewriter.capture and "
                           "rewriter.apply for a single-device step")
    if unsupported(strategy):
        raise CaptureError(unsupported(strategy))
    devices = tuple(tf.DeviceSpec.from_string(d).to_string() for d in strategy.extended.worker_devices)
    logical = {_device_key(d.name) for d in tf.config.list_logical_devices()}
    in_sync = int(strategy.num_replicas_in_sync)
    hosts = []
    for device in devices:
        kind_of, index = _device_key(device)
        host = f"/device:CPU:{index + 1}" if kind_of == "CPU" else "/device:CPU:0"
        if in_sync > len(devices):  # a worker of several: its own task's host, never a CPU of another worker
            spec = tf.DeviceSpec.from_string(device)
            host = tf.DeviceSpec(job=spec.job, replica=spec.replica, task=spec.task).to_string() + host
        if _device_key(host) not in logical or (kind_of == "CPU" and any(_device_key(host) == _device_key(d)
                                                                         for d in devices)):
            raise CaptureError(f"replica device {device} has no host device of its own: on the CPU testbed give "
                               "each replica an even CPU with the next one free (4 logical CPUs, "
                               "MirroredStrategy(['/cpu:0', '/cpu:2']); rewriter.placement.configure_testbed(4))")
        hosts.append(host)
    resolver = strategy.cluster_resolver  # MultiWorkerMirroredStrategy's TF_CONFIG; None under MirroredStrategy
    task = _worker_index(resolver) if resolver is not None and in_sync > len(devices) else 0
    return Replicas(strategy, devices, tuple(hosts), in_sync, task * len(devices))


def _worker_index(resolver) -> int:
    """This worker's place in the group: a ``chief`` job comes first, then the workers by index (as the strategy
    numbers its replicas)."""
    jobs = resolver.cluster_spec().as_dict()
    index = int(resolver.task_id or 0)
    return index + 1 if resolver.task_type == "worker" and jobs.get("chief") else index


@dataclass
class ReplicatedTrace:
    """One trace of the replicated step at a global batch size. ``traced``: the whole step (every replica's
    inputs, its loss replica 0's, ``traced.ops`` replica 0's ops); ``names[k]``: replica 0's op name -> replica
    k's (``names[0]`` the identity); ``owner``: op name -> its replica (``SHARED`` for none)."""

    traced: TracedStep
    replicas: Replicas
    names: tuple[dict[str, str], ...]
    owner: dict[str, int]
    n_flat: int  # inputs and labels of one replica, in the step's flat input order
    # the step's GraphDef after graph rewrites (``rewritten_trace``); None: the traced function's own
    rewritten_graph_def: Any = None

    @property
    def per_replica_batch(self) -> int:
        return self.traced.batch_size

    def step_graph_def(self):
        """The GraphDef a plan edits: the rewritten one, else the traced function's (a fresh copy)."""
        if self.rewritten_graph_def is None:
            return self.traced.concrete.graph.as_graph_def()
        graph_def = type(self.rewritten_graph_def)()
        graph_def.CopyFrom(self.rewritten_graph_def)
        return graph_def

    def capture_step(self) -> TracedStep:
        """The trace a capture reads: with the rewrites, their GraphDef imported (``import_step``; never run)."""
        if self.rewritten_graph_def is None:
            return self.traced
        return dataclasses.replace(self.traced, concrete=import_step(self.rewritten_graph_def, self.traced,
                                                                     keep_input_names=True))


def rewritten_trace(trace: ReplicatedTrace, rewrites: Sequence[str]) -> tuple[ReplicatedTrace, dict[str, list[str]]]:
    """``trace`` with the exact graph rewrites (``rewriter.trace.graph_rewrites``) made on every replica's ops at
    once, and what each changed (replica 0's ops). An op a rewrite adds is named by the op it replaces
    (``<conv>/part0``): it belongs to that op's replica, and replica k's counterpart is named by replica k's op
    (``canonical``'s longest prefix). The function itself is kept: a plan's edit starts from the rewritten GraphDef
    (``step_graph_def``) and is imported with the traced function's inputs and captures."""
    concrete = trace.traced.concrete
    graph_def, changed = rewrite_graph_def(concrete.graph.as_graph_def(), rewrites, concrete.graph)
    if not any(changed.values()):
        return trace, changed
    present = {node.name for node in graph_def.node}
    owner = {name: k for name, k in trace.owner.items() if name in present}
    for name in present - set(owner):
        prefix = name
        while "/" in prefix and prefix not in trace.owner:
            prefix = prefix.rpartition("/")[0]
        owner[name] = trace.owner.get(prefix, SHARED)
    names = tuple({**{a: b for a, b in mine.items() if a in present},
                   **{name: canonical(name, mine) for name in present if owner[name] == 0 and name not in mine}}
                  for mine in trace.names)
    ops = frozenset(name for name, k in owner.items() if k == 0)
    # what each rewrite replaced (gone from the rewritten graph), of replica 0's ops
    mine_changed = {rewrite: [name for name in done if trace.owner.get(name) == 0] for rewrite, done in changed.items()}
    return dataclasses.replace(trace, traced=dataclasses.replace(trace.traced, ops=ops), names=names, owner=owner,
                               rewritten_graph_def=graph_def), mine_changed


def trace_replicated_step(model, replicas: Replicas, batch_size: int, given: StepInputs = NO_STEP_INPUTS, *,
                          sample_weight: bool = False) -> ReplicatedTrace:
    """Trace ``strategy.run(model.train_step, ...)`` at the global ``batch_size``; inputs in flat order, replica
    by replica (replica k's inputs then labels, as ``StepSpecs`` orders one replica's); ``sample_weight``: each
    replica's labels end with a weight per sample of the loss (``rewriter.step.keras_fit``)."""
    check_compiled(model, replicated=True)
    per = replicas.per_replica_batch(batch_size)
    inputs = step_specs(model, per, given, sample_weight=sample_weight)
    strategy = replicas.strategy
    with strategy.scope():
        build_if_needed(model, inputs)
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        compiled = (getattr(model, "_compile_loss", None), getattr(model, "_compile_metrics", None))
        if any(part is not None and not part.built for part in compiled):
            # the compiled loss's trackers (a Mean per output of a multi-output model) are variables made on the
            # first train_step: inside strategy.run in a traced function TensorFlow cannot lift them
            # ("UnliftableError ... depends transitively on placeholder"); Keras' fit builds them first the same way
            try:
                model._symbolic_build(data_batch=inputs.train_data(  # noqa: SLF001
                    [tf.zeros((1,) + tuple(spec.shape)[1:], spec.dtype) for spec in inputs.x_specs],
                    [tf.zeros((1,) + tuple(spec.shape)[1:], spec.dtype) for spec in inputs.label_specs]))
            except Exception as error:  # the model's own loss or metric code failed on these shapes
                raise CaptureError(f"building the compiled loss and metrics before tracing the replicated step "
                                   f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}") from error
    specs = list(inputs.x_specs) + list(inputs.label_specs)
    n_flat, n_x = len(specs), len(inputs.x_specs)
    signature = [tf.TensorSpec(s.shape, s.dtype, name=f"{s.name or 'input'}_r{k}")
                 for k in range(replicas.count) for s in specs]

    def step(*flat):
        def data_for(context):  # the replica's id counts every worker's replicas
            own = flat[(context.replica_id_in_sync_group - replicas.first_replica) * n_flat:][:n_flat]
            return inputs.train_data(list(own[:n_x]), list(own[n_x:]))

        data = strategy.experimental_distribute_values_from_function(data_for)
        return strategy.run(model.train_step, args=(data,))

    function = tf.function(step, input_signature=signature, autograph=False)
    concrete, recorded = traced_function(function, model, "the replicated training step")
    owner = _owners(concrete, replicas, n_flat)
    mine = [[t for t in found if isinstance(t, tf.Tensor) and owner.get(t.op.name) == 0]
            for found in (recorded.computed, recorded.differentiated)]
    # what compute_loss returned, as on one device (a LossScaleOptimizer differentiates the loss times its scale,
    # which feeds no output)
    losses = mine[0] or mine[1]
    if not losses:
        raise CaptureError("the replicated training step computed no loss on its first replica")
    names = _match_replicas(concrete, model, owner, replicas.count, n_flat)
    ops = frozenset(name for name, k in owner.items() if k == 0)
    traced = TracedStep(concrete, per, losses[-1].op.name, _optimizer_scope(model.optimizer),
                        [t.op.name for t in concrete.inputs[: n_flat * replicas.count]], inputs,
                        canonical_names(op.name for op in concrete.graph.get_operations()), ops=ops)
    return ReplicatedTrace(traced, replicas, names, owner, n_flat)


def _owners(concrete, replicas: Replicas, n_flat: int) -> dict[str, int]:
    """Op name -> the replica it belongs to: by its device; unplaced ops (variable reads, inputs, identities)
    by the variable's device, the input's position, else their inputs' or readers' replica; ``SHARED`` for an
    op no replica owns."""
    graph = concrete.graph
    owner: dict[str, int] = {}
    for k, tensor in enumerate(concrete.inputs[: n_flat * replicas.count]):
        owner[tensor.op.name] = k // n_flat
    for external, internal in graph.captures:
        found = replicas.replica_of_device(getattr(external, "device", "") or "")
        if found is not None:
            owner[internal.op.name] = found
    ops = graph.get_operations()
    for op in ops:
        if op.name not in owner:
            found = replicas.replica_of_device(op.device)
            if found is not None:
                owner[op.name] = found
    changed = True
    while changed:  # unplaced ops: the one replica of their inputs, else of their readers
        changed = False
        for op in ops:
            if op.name in owner:
                continue
            around = {owner.get(t.op.name) for t in op.inputs} - {None, SHARED}
            if not around:
                around = {owner.get(c.name) for t in op.outputs for c in t.consumers()} - {None, SHARED}
            if len(around) == 1:
                owner[op.name] = around.pop()
                changed = True
    for op in ops:
        owner.setdefault(op.name, SHARED)
    return owner


def _match_replicas(concrete, model, owner: dict[str, int], count: int, n_flat: int) -> tuple[dict[str, str], ...]:
    """For each replica, replica 0's op name -> the op that plays its part there: from the step's inputs,
    matched pairs spread to readers (the one unmatched reader of the same type at the same slot whose other
    matched inputs agree) and to producers (the op at the same input slot), until nothing changes."""
    graph = concrete.graph
    ops = graph.get_operations()
    readers: dict[tuple[str, int], list[tuple[Any, int]]] = defaultdict(list)
    for op in ops:
        for slot, tensor in enumerate(op.inputs):
            readers[(tensor.op.name, tensor.value_index)].append((op, slot))
    by_name = {op.name: op for op in ops}
    first = [op.name for op in ops if owner[op.name] == 0]
    maps = [{name: name for name in first}]
    for k in range(1, count):
        pairs = {concrete.inputs[i].op.name: concrete.inputs[k * n_flat + i].op.name for i in range(n_flat)}
        pairs.update(_pair_captures(concrete, model, owner, k))
        taken = set(pairs.values())
        queue = list(pairs)
        while queue:
            name = queue.pop()
            a, b = by_name[name], by_name[pairs[name]]
            found = []
            for slot, (ta, tb) in enumerate(zip(a.inputs, b.inputs)):  # producers at the same slot
                pa, pb = ta.op, tb.op
                if pa.name not in pairs and owner[pa.name] == 0 and owner[pb.name] == k and pa.type == pb.type \
                        and pb.name not in taken and ta.value_index == tb.value_index:
                    found.append((pa.name, pb.name))
            for ta_out, tb_out in zip(a.outputs, b.outputs):  # readers
                theirs = readers[(b.name, tb_out.value_index)]
                for reader, slot in readers[(a.name, ta_out.value_index)]:
                    if reader.name in pairs or owner[reader.name] != 0:
                        continue
                    candidates = [r for r, s in theirs if s == slot and r.type == reader.type and r.name not in taken
                                  and owner[r.name] == k and _agrees(reader, r, pairs)]
                    if len(candidates) == 1:
                        found.append((reader.name, candidates[0].name))
                    elif candidates:  # several alike (reads of one variable): the same rank in creation order
                        mine = [r for r, s in readers[(a.name, ta_out.value_index)] if s == slot
                                and r.type == reader.type and r.name not in pairs and owner[r.name] == 0]
                        if len(mine) == len(candidates):
                            found.append((reader.name, candidates[mine.index(reader)].name))
            for left, right in found:
                if left not in pairs and right not in taken:
                    pairs[left] = right
                    taken.add(right)
                    queue.append(left)
            if not queue:  # the rest, by type and rank in creation order where the counts agree (a NoOp)
                queue = _by_rank(ops, owner, pairs, taken, k)
        maps.append({name: pairs[name] for name in first if name in pairs})
    return tuple(maps)


def _by_rank(ops, owner: dict[str, int], pairs: dict[str, str], taken: set[str], k: int) -> list[str]:
    """Replica 0's unmatched ops paired with replica k's of the same type, by rank in creation order, for each
    type whose unmatched counts agree (replicas are traced by the same code in the same order); the new pairs."""
    mine, theirs = defaultdict(list), defaultdict(list)
    for op in ops:
        if owner[op.name] == 0 and op.name not in pairs:
            mine[op.type].append(op.name)
        elif owner[op.name] == k and op.name not in taken:
            theirs[op.type].append(op.name)
    added = []
    for kind, names in mine.items():
        if len(names) == len(theirs[kind]):
            for left, right in zip(names, theirs[kind]):
                pairs[left] = right
                taken.add(right)
                added.append(left)
    return added


def _agrees(a, b, pairs: dict[str, str]) -> bool:
    """Whether ``b`` can be ``a``'s counterpart: same arity, and every input of ``a`` already matched is read
    from its counterpart (or, read across replicas, from the same op)."""
    if len(a.inputs) != len(b.inputs):
        return False
    for ta, tb in zip(a.inputs, b.inputs):
        mate = pairs.get(ta.op.name)
        if mate is not None and tb.op.name not in (mate, ta.op.name):
            return False
        if ta.value_index != tb.value_index:
            return False
    return True


def _pair_captures(concrete, model, owner: dict[str, int], k: int) -> dict[str, str]:
    """Variable handles of replica 0 -> replica k's, for the model's mirrored variables (a ``MirroredVariable``
    lists its per-replica components in ``values``) whose components the step captured."""
    internal_of = {id(external): internal.op.name for external, internal in concrete.graph.captures}
    pairs = {}
    for variable in state_kinds.model_variables(model):
        values = getattr(getattr(variable, "value", variable), "values", None)
        if not values or len(values) <= k:
            continue
        mine, theirs = internal_of.get(id(values[0].handle)), internal_of.get(id(values[k].handle))
        if mine is not None and theirs is not None and owner.get(mine) == 0 and owner.get(theirs) == k:
            pairs[mine] = theirs
    return pairs


def collective_ops(graph: OpGraph) -> list[int]:
    """Ops of a replica graph that all-reduce across the replicas."""
    return [i for i, kind in enumerate(graph.op_type) if kind in COLLECTIVE_TYPES]


def capture_replicated(model, batch_size: int, inputs: StepInputs = NO_STEP_INPUTS, *,
                       name: str | None = None, graph_rewrites: Sequence[str] = ()) -> OpGraph:
    """Capture one replica's training step of a model built in ``MirroredStrategy.scope()``, at the
    per-replica batch of the global ``batch_size`` (``graph.meta["replicas"]``: the replica devices and hosts,
    the global batch, the all-reduce's ops and bytes). ``graph_rewrites``: exact rewrites made on every replica
    first (``rewritten_trace``; those that changed something in ``meta["graph_rewrites"]``, as ``capture`` records
    them). Refused with one ``CaptureError`` for another strategy."""
    replicas = resolve_replicas(model)
    first = trace_replicated_step(model, replicas, int(batch_size), inputs)
    second = trace_replicated_step(model, replicas, _second_batch(first.per_replica_batch) * replicas.in_sync, inputs)
    handles = {n for n in first.traced.ops}
    meta = {"model": name or getattr(model, "name", "model"), "optimizer": type(model.optimizer).__name__,
            "training": describe_training(model),
            "variables": state_kinds.describe_variables(first.traced.concrete, model, only=handles),
            # the first replica's update and reads and writes: its variables are the ones the captures name
            "movable_state": describe_movable_state(first.traced.concrete, model, first.traced.optimizer_scope)}
    if inputs.to_dict():
        meta["step_inputs"] = inputs.to_dict()
    first, second, meta = with_rewrites(first, second, graph_rewrites, meta, rewrite=rewritten_trace)
    graph = build_opgraph(first.capture_step(), second.capture_step(), meta=meta)
    reduce_ops = collective_ops(graph)
    pack = np.isin(graph.tensor_producer, reduce_ops) & (graph.tensor_output == 0)
    graph.meta["replicas"] = dict(replicas.to_dict(), global_batch_size=int(batch_size),
                                  per_replica_batch_size=first.per_replica_batch,
                                  all_reduce_ops=[str(graph.op_name[i]) for i in reduce_ops],
                                  all_reduce_bytes=int(graph.tensor_bytes[pack].sum()))
    return graph
