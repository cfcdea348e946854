"""One plan on every replica of a ``tf.distribute.MirroredStrategy`` step, and ``model.fit`` with it.

The plan is made for one replica's graph (``rewriter.trace.replicas.capture_replicated``); replicas run the same
step, so ``apply_replicated`` edits the replicated step's GraphDef once per replica: replica 0 by the plan's
names, replica k by the names ``ReplicatedTrace.names[k]`` gives the same ops there (a recomputation's clones by
their original's), each replica's swaps to its own host device (``Replicas.hosts``) and its ops chained in the
plan's order. The edited step is imported once (``rewriter.trace.tracing.import_step``): every replica's
variables and slots update in place, and the all-reduce runs as Keras' optimizer built it.

``use_replicated_step(model, step)`` makes ``model.fit`` run it: each batch of the strategy's distributed dataset
is fed replica by replica and the logs are averaged over the replicas, as Keras does under a strategy. A batch with
``sample_weight`` or ``class_weight`` runs the plan applied to the step traced with a weight per sample after each
replica's labels (``apply_replicated(..., sample_weight=True)``, cached), as on one device.

A plan's split regions are built on every replica first (``rewriter.edit.split_parts``, replica k's regions and
parts named from its own ops), then its recomputations and swaps, as on one device. A plan's optimizer slots on the
host (updated there or streamed, with the weight or without) live on each replica's host: replica k's component of
each mirrored variable is made anew there (``rewriter.step.host_state.place_replica_state``) and replica k's update
is placed beside it, its nodes named from the first replica's. A plan's graph rewrites are made before all that,
on every replica (``rewritten_trace``). The first call checks what survived Grappler on each replica
(``verify_replicas``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from rewriter.check.collected import collect_first_call, constant_nodes
from rewriter.check.verification import Verification, check
from rewriter.edit.graph_edit import SWAP_OPS, AppliedSwap, edit_graph_def
from rewriter.edit.recompute_clones import apply_recomputes, clone_tensor_info
from rewriter.edit.split_parts import AppliedSplit, BatchShapes, apply_splits, check_part_shapes, with_weighted_ops
from rewriter.placement import memtrace
from rewriter.placement.placements import CpuTestbedPlacement, GpuPlacement, Placement
from rewriter.step.apply_plan import _step_facts
from rewriter.step.host_state import StateNodes, place_replica_state, place_state_nodes, state_nodes
from rewriter.step.keras_fit import WEIGHT_PER_OUTPUT, install_train_function, train_function_of
from rewriter.step.swap_step import StateSnapshot
from rewriter.trace.op_names import traced_names
from rewriter.trace.replicas import (Replicas, ReplicatedTrace, resolve_replicas, rewritten_trace,
                                     trace_replicated_step)
from rewriter.trace.step_inputs import NO_STEP_INPUTS, StepInputs
from rewriter.trace.tracing import call_time_values, import_step, rewritten_step
from simulator.plan import NamedPlan, NamedSwap, NamedSwapIn, PlanError, load_plan
from simulator.recompute.actions import Recompute, original_name
from simulator.split import SplitRegion, split_origin

log = logging.getLogger(__name__)


def replica_placement(replicas: Replicas, k: int) -> Placement:
    """Where replica ``k``'s swaps run: its device and its host (the testbed's ``CPU:2k`` and ``CPU:2k+1``); a
    worker of ``MultiWorkerMirroredStrategy`` names its own task's devices in full."""
    device, host = replicas.devices[k], replicas.hosts[k]
    short = device if replicas.workers > 1 else "/device:" + device.rsplit("device:", 1)[-1]
    if "GPU" in short.upper():
        return GpuPlacement(accelerator=short, host=host)
    return CpuTestbedPlacement(accelerator=short, host=host)


def replica_plan(plan: NamedPlan, names: dict[str, str]) -> NamedPlan:
    """``plan`` (replica 0's names) with replica k's names (``names``: replica 0's op -> replica k's; a split's
    part or a recomputation's clone named from its original's): one ``PlanError`` when a region, swap or
    recomputation names an op that has no counterpart there; ops of the order without one (an op replica k reads
    from replica 0, as the step count) are left out of its order."""
    missing: list[str] = []

    def origin(name: str) -> str:
        return split_origin(original_name(name))

    def op(name: str | None) -> str | None:
        if name is None:
            return None
        base = origin(name)
        found = names.get(base)
        if found is None:
            missing.append(name)
            return name
        return found + name[len(base):] if base != name else found

    def tensor(name: str) -> str:
        producer, _, index = name.rpartition(":")
        return f"{op(producer)}:{index}"

    swaps = tuple(NamedSwap(tensor=tensor(s.tensor), bytes=s.bytes, sync_out=s.sync_out,
                            swap_ins=tuple(NamedSwapIn(consumers=tuple(op(c) for c in item.consumers),
                                                       trigger=op(item.trigger), after=op(item.after))
                                           for item in s.swap_ins)) for s in plan.swaps)
    recomputes = tuple(Recompute(tensor=tensor(r.tensor), ops=tuple(op(o) for o in r.ops), trigger=op(r.trigger),
                                 consumers=tuple(op(c) for c in r.consumers)) for r in plan.recomputes)
    splits = tuple(SplitRegion(tuple(op(o) for o in region.ops), region.parts) for region in plan.splits)
    if missing:
        raise PlanError(f"{len(missing)} name(s) of the plan have no counterpart on another replica (e.g. "
                        f"{', '.join(missing[:3])}): the plan was made for another step")
    order = tuple(names[origin(o)] + o[len(origin(o)):] for o in plan.order if origin(o) in names)
    return replace(plan, swaps=swaps, recomputes=recomputes, splits=splits, order=order, canonical_names={})


class ReplicatedStep:
    """One optimizer step of the replicated, rewritten step: ``step(x, y)`` on a global batch (split evenly over
    the replicas, replica 0 first, as a distributed dataset splits it) -> the replicas' mean loss.

    ``applied[k]``/``skipped[k]``/``placements[k]``/``splits[k]``/``host_updates[k]``: replica k's swaps, devices,
    split regions and nodes placed on its host beside its optimizer slots as built (empty without); ``trace``: the
    ``ReplicatedTrace`` (its ``owner`` tells each op's replica); ``plan``: replica 0's plan as applied."""

    def __init__(self, *, function, trace: ReplicatedTrace, graph_def, plan: NamedPlan,
                 applied: tuple[list[AppliedSwap], ...], skipped: tuple[list, ...], placements: tuple[Placement, ...],
                 swap_op: str, model, recomputed: tuple[tuple, ...] = (),
                 splits: tuple[tuple[AppliedSplit, ...], ...] = (), inputs: StepInputs = NO_STEP_INPUTS,
                 host_updates: tuple[dict[str, set[str]], ...] = (), state_nodes: tuple[frozenset[str], ...] = ()):
        self._function = function
        self.trace = trace
        self.traced = trace.traced
        self.graph_def = graph_def
        self.plan = plan
        self.applied = applied
        self.skipped = skipped
        self.recomputed = recomputed
        self.splits = splits
        self.host_updates = host_updates
        self._state_nodes = state_nodes
        self.placements = placements
        self.swap_op = swap_op
        self.replicas = trace.replicas
        self.batch_size = trace.per_replica_batch * self.replicas.in_sync  # the global batch (of every worker)
        self.verification: tuple[Verification, ...] | None = None  # per replica, from the first call
        self.constant_bytes: tuple[int, ...] | None = None  # per replica, what its kernels' constants take
        self.calls = 0
        self._model = model
        self._inputs = inputs
        self._owners: dict[str, int] | None = None
        self._others: dict[tuple[int, bool], ReplicatedStep] = {}
        signature = self.traced.concrete.structured_outputs
        self._output_structure = signature

    @property
    def n_swap_outs(self) -> int:
        """Swaps per replica (the same plan on each)."""
        return len(self.applied[0])

    @property
    def swapped_bytes(self) -> int:
        """Bytes one replica copies to its host per step."""
        return sum(s.bytes for s in self.applied[0])

    def replica_ops(self, k: int) -> frozenset[str]:
        """Replica ``k``'s op names, the swap and recomputation nodes added for it included."""
        own = {name for name, owner in self.trace.owner.items() if owner == k}
        for swap in self.applied[k]:
            own.add(swap.swap_out)
            own.update(node for item in swap.swap_ins for node in (item.name, item.host_node) if node)
        own.update(clone for item in (self.recomputed[k] if self.recomputed else ()) for clone in item.ops + item.extra)
        own.update(node for item in (self.splits[k] if self.splits else ()) for node in item.nodes)
        own.update(self._state_nodes[k] if self._state_nodes else ())
        return frozenset(own)

    def owner_of(self, name: str) -> int:
        """The replica an op of the step belongs to (the nodes added for it included; a constant TensorFlow's
        runtime folded, ``__cf__``, by the op it was folded from, and a node made inside a split part, as its
        shape constants, by the op it was split from); -1 for none."""
        if self._owners is None:
            owners = {op: k for op, k in self.trace.owner.items() if k >= 0}
            for k in range(self.replicas.count):
                owners.update(dict.fromkeys(self.replica_ops(k), k))
            self._owners = owners
        if name in self._owners:
            return self._owners[name]
        base = name.split(memtrace.CONSTANT_FOLDED, 1)[0].rstrip("/_")
        return self._owners.get(base, self._owners.get(split_origin(base), -1))

    def event_owners(self, events):
        """Each memory event's replica (``memtrace.event_owners``); -1 for an allocation no op of a replica made:
        the collective's ring chunks (``CollectiveAdapterImpl::TempChunk``) name neither an op nor a device, and
        the replicas' chunks are allocated within a millisecond of each other in either order."""
        return memtrace.event_owners(events, self.owner_of)

    @property
    def weighted(self) -> bool:
        """Whether each replica's labels end with a weight per sample of the loss (``apply_replicated``)."""
        return self.traced.inputs.weight_spec is not None

    def flat_inputs(self, per_replica: list[tuple]) -> list[tf.Tensor]:
        """Flat step inputs from (x, y) or (x, y, sample_weight) per replica (dicts by name, lists in flat order,
        or arrays); a weighted step given no weights weighs every sample 1, the unweighted loss."""
        specs = self.traced.inputs
        flat = []
        for x, y, *weight in per_replica:
            xs, ys = specs.flatten(x, y)
            weight = weight[0] if weight else None
            if weight is not None and not self.weighted:
                raise ValueError("this step takes no sample weights: use step.for_batch(n, weighted=True)")
            if self.weighted:
                ys.append(tf.ones((self.trace.per_replica_batch,)) if weight is None
                          else tf.reshape(tf.convert_to_tensor(weight), (-1,)))
            flat.extend(xs + ys)
        wanted = self.traced.concrete.inputs[: len(flat)]
        if len(flat) != self.trace.n_flat * self.replicas.count:
            raise ValueError(f"the replicated step takes {self.trace.n_flat} input(s) and label(s) per replica")
        return [tf.cast(tf.convert_to_tensor(value), spec.dtype) for value, spec in zip(flat, wanted)]

    def split(self, x, y, sample_weight=None) -> list[tuple]:
        """A global batch -> one (x, y) (or (x, y, sample_weight)) per replica of this process, in order, as
        ``experimental_distribute_dataset`` splits it (a worker of ``MultiWorkerMirroredStrategy`` takes its replicas'
        shares)."""
        first, per = self.replicas.first_replica, self.trace.per_replica_batch

        def part(value, k):
            if value is None:
                return None
            return tf.nest.map_structure(lambda v: np.asarray(v)[(first + k) * per:(first + k + 1) * per], value)

        return [(part(x, k), part(y, k)) + (() if sample_weight is None else (part(sample_weight, k),))
                for k in range(self.replicas.count)]

    def run_flat(self, *flat):
        """One step on flat inputs: (the logs of each replica, each replica's loss)."""
        self.calls += 1
        outputs = self._function(*flat, *call_time_values(self.traced.concrete))
        logs = tf.nest.pack_sequence_as(self._output_structure, list(outputs[:-1]), expand_composites=True)
        return logs, outputs[-1]

    def logs_of(self, logs) -> dict[str, tf.Tensor]:
        """The replicas' logs averaged (Keras' ``reduce_per_replica(..., "auto")`` off a TPU)."""
        strategy = self.replicas.strategy
        return tf.nest.map_structure(
            lambda v: tf.reduce_mean(strategy.experimental_local_results(v), axis=0), logs)

    def run(self, x, y=None, sample_weight=None):
        """One optimizer step on a global batch; returns the replicas' mean logs."""
        return self.logs_of(self.run_flat(*self.flat_inputs(self.split(x, y, sample_weight)))[0])

    def __call__(self, x, y=None):
        """One optimizer step on a global batch; returns the replicas' mean loss."""
        return self.run(x, y)["loss"]

    def for_batch(self, batch_size: int, weighted: bool | None = None) -> "ReplicatedStep":
        """The same plan applied at another global batch (an epoch's last, smaller batch) or to the step that takes
        sample weights (``weighted``), cached; one ``ValueError`` for a batch that does not split evenly over the
        replicas."""
        weighted = self.weighted if weighted is None else bool(weighted)
        if int(batch_size) == self.batch_size and weighted == self.weighted:
            return self
        if int(batch_size) % self.replicas.in_sync:
            raise ValueError(f"a batch of {batch_size} samples does not split evenly over {self.replicas.in_sync} "
                             "replicas: give a dataset whose size is a multiple of the batch size, or drop the "
                             "remainder")
        key = (int(batch_size), weighted)
        if key not in self._others:
            self._others[key] = apply_replicated(self._model, self.plan, batch_size=int(batch_size),
                                                 inputs=self._inputs, swap_op=self.swap_op, verify=False,
                                                 sample_weight=weighted)
        return self._others[key]

    def zeros(self) -> list[tf.Tensor]:
        return [tf.zeros(t.shape, t.dtype) for t in self.traced.concrete.inputs[: self.trace.n_flat *
                                                                                  self.replicas.count]]

    def snapshot(self) -> StateSnapshot:
        """Host copies of every replica's variables (``.restore()`` puts them back)."""
        return StateSnapshot(self.traced.concrete)

    def __repr__(self) -> str:
        return (f"ReplicatedStep(replicas={self.replicas.count}, batch_size={self.batch_size}, "
                f"swaps={self.n_swap_outs} per replica)")


@dataclass(frozen=True)
class ReplicatedEdit:
    """The replicated step's GraphDef with one plan on every replica, before anything runs it: per replica its
    swaps (``applied``, ``skipped``), its recomputations' clones, its split regions as built and its placement
    (``rewriter.step.gpu_graph`` builds one for GPUs without a GPU)."""

    trace: ReplicatedTrace
    plan: NamedPlan
    graph_def: Any
    applied: tuple[list[AppliedSwap], ...]
    skipped: tuple[list, ...]
    recomputed: tuple[tuple, ...]
    placements: tuple[Placement, ...]
    splits: tuple[tuple[AppliedSplit, ...], ...] = ()
    host_updates: tuple[dict[str, set[str]], ...] = ()  # per replica: variable path -> its nodes on the host
    state_nodes: tuple[frozenset[str], ...] = ()  # per replica: every node the state's placement added or moved
    on_host: tuple[frozenset[str], ...] = ()  # per replica: the state's nodes that run on its host


def trace_for_plan(model, plan, *, batch_size: int | None = None, graph=None, inputs: StepInputs = NO_STEP_INPUTS,
                   serialize: bool = True, sample_weight: bool = False,
                   placements: tuple[Placement, ...] | None = None) -> tuple[NamedPlan, StepInputs, ReplicatedTrace]:
    """The plan by the replicated step's names, the step's inputs and its trace at the global ``batch_size``
    (default: the plan's per-replica batch times the replicas), with a weight per sample when ``sample_weight``.
    ``placements``: each replica's, where the plan's optimizer slots are put before the trace (None: the variables
    are left where they are, as for a GraphDef built for other devices, ``rewriter.step.gpu_graph``)."""
    replicas = resolve_replicas(model)
    named = load_plan(plan, graph)
    if placements is not None:
        place_replica_state(model, named.host_state, placements)
    inputs = inputs.or_planned(named)
    if not serialize:
        named = replace(named, order=())
    if batch_size is None:
        batch_size = int(named.batch_size or 0) * replicas.in_sync
    trace = trace_replicated_step(model, replicas, int(batch_size), inputs, sample_weight=sample_weight)
    if named.graph_rewrites:  # the plan was made on the rewritten step: every replica rewritten the same way first
        try:
            trace, _ = rewritten_trace(trace, named.graph_rewrites)
        except ValueError as error:
            raise PlanError(f"the plan asks for a graph rewrite this version does not have: {error}") from None
    return traced_names(named, trace.traced.canonical), inputs, trace


def replicated_batch_shapes(model, trace: ReplicatedTrace, inputs: StepInputs = NO_STEP_INPUTS,
                            rewrites: Sequence[str] = ()) -> BatchShapes:
    """Which tensors of the replicated step grow with a replica's batch: the step traced again at one sample more
    a replica (``BatchShapes``, as ``apply`` reads a single device's step), both traces with the plan's graph
    ``rewrites`` made (the regions name the rewritten step's ops)."""
    second = trace_replicated_step(model, trace.replicas, (trace.per_replica_batch + 1) * trace.replicas.in_sync,
                                   inputs, sample_weight=trace.traced.inputs.weight_spec is not None)
    if rewrites:
        return BatchShapes.of(rewritten_step(trace.traced, rewrites)[0], rewritten_step(second.traced, rewrites)[0])
    return BatchShapes.of(trace.traced, second.traced)


def _split_replicas(trace: ReplicatedTrace, plans: list[NamedPlan], placements: tuple[Placement, ...], graph_def,
                    shapes: BatchShapes, passthrough):
    """Every replica's split regions built in ``graph_def`` (replica k's by ``plans[k]``, the nodes made anew for it
    without a device, a combine, on its accelerator: left unplaced, TensorFlow's placer puts every replica's on one),
    checked after import: the edited GraphDef, each replica's regions as built, and the split step's facts for the
    edits after."""
    concrete = trace.traced.concrete
    losses = [names.get(trace.traced.loss_op) for names in trace.names]
    fetches = [t.op.name for t in concrete.outputs] + [loss for loss in losses if loss]
    split = []
    # each replica's weight per sample, the last of its inputs (``model.fit`` with ``sample_weight``)
    weights = [trace.traced.input_names[(k + 1) * trace.n_flat - 1] for k in range(len(plans))] \
        if trace.traced.inputs.weight_spec is not None else []
    for mine, place in zip(plans, placements):
        before = {node.name for node in graph_def.node}
        regions = with_weighted_ops(graph_def, mine.splits, shapes, mine.order, weights)
        graph_def, built = apply_splits(graph_def, regions, shapes, passthrough=passthrough, fetches=fetches)
        for node in graph_def.node:
            if not node.device and node.name not in before:
                node.device = place.accelerator
        split.append(tuple(built))
    parted = import_step(graph_def, trace.traced)  # the split step as TF reads it: its shapes, what Grappler folds
    for built in split:
        check_part_shapes(parted.graph, built, shapes)
    return graph_def, tuple(split), _step_facts(parted)


def edit_replicas(trace: ReplicatedTrace, named: NamedPlan, placements: tuple[Placement, ...], *, graph_def=None,
                  swap_op: str = "auto", shapes: BatchShapes | None = None,
                  state: StateNodes | None = None) -> ReplicatedEdit:
    """Edit the replicated step's GraphDef (default: the traced one) once per replica: replica 0 by the plan's
    names, replica k by its counterparts' (``replica_plan``), its swaps on ``placements[k]``; a plan's split
    regions first, on every replica (``shapes``: ``replicated_batch_shapes``, needed then); its optimizer state
    last (``state``: the first replica's ``StateNodes``, needed then)."""
    # the step as TensorFlow reads it (rewritten: imported so): its shapes, what Grappler folds
    as_read = trace.traced.concrete if trace.rewritten_graph_def is None else import_step(trace.rewritten_graph_def,
                                                                                          trace.traced)
    foldable, tensor_info, passthrough = _step_facts(as_read)
    graph_def = trace.step_graph_def() if graph_def is None else graph_def
    plans = [named if k == 0 else replica_plan(named, trace.names[k]) for k in range(len(placements))]
    split: tuple[tuple[AppliedSplit, ...], ...] = ()
    if named.splits:  # first: the plan's recomputations and swaps were made on the split step
        if shapes is None:
            raise ValueError("a plan with split regions needs the step's batch shapes (replicated_batch_shapes)")
        graph_def, split, (foldable, tensor_info, passthrough) = _split_replicas(trace, plans, placements, graph_def,
                                                                                 shapes, passthrough)
    applied, skipped, recomputed, host_updates, state_nodes, on_host = [], [], [], [], [], []
    for k, place in enumerate(placements):
        chosen = place.swap_op if swap_op in (None, "auto") else swap_op
        if chosen not in SWAP_OPS:
            raise ValueError(f"swap_op must be 'auto' or one of {SWAP_OPS}, got {swap_op!r}")
        mine = plans[k]
        info = tensor_info
        if mine.recomputes:
            graph_def, clones = apply_recomputes(graph_def, mine.recomputes, foldable=foldable, order=mine.order,
                                                 passthrough=passthrough)
            info = clone_tensor_info(tensor_info, clones)
            recomputed.append(tuple(clones))
        graph_def, done, left = edit_graph_def(graph_def, mine, place, swap_op=chosen, tensor_info=info,
                                               foldable=foldable, kept_reads=place.kept_reads, passthrough=passthrough)
        applied.append(done)
        skipped.append(left)
        if named.host_state:
            if state is None:
                raise ValueError("a plan that moves optimizer state needs the first replica's StateNodes")
            before = {node.name for node in graph_def.node}
            nodes = state if k == 0 else state.renamed(trace.names[k])
            graph_def, updates = place_state_nodes(graph_def, nodes, place, info)
            # the reads and writes of the slots (and weights) moved run with them, on the host: said in the
            # GraphDef, which a GPU machine imports with the variables where the plan puts them
            accesses = set().union(*nodes.slot_ops.values(), *nodes.weight_ops.values())
            for node in graph_def.node:
                if node.name in accesses:
                    node.device = place.host
            host_updates.append(updates)
            on_host.append(frozenset(accesses).union(*updates.values()))
            state_nodes.append(frozenset({node.name for node in graph_def.node} - before) | on_host[-1])
    return ReplicatedEdit(trace, named, graph_def, tuple(applied), tuple(skipped), tuple(recomputed),
                          tuple(placements), split, tuple(host_updates), tuple(state_nodes), tuple(on_host))


def apply_replicated(model, plan, *, batch_size: int | None = None, graph=None, inputs: StepInputs = NO_STEP_INPUTS,
                     swap_op: str = "auto", serialize: bool = True, verify: bool = True, verify_with=None,
                     sample_weight: bool = False) -> ReplicatedStep:
    """Apply ``plan`` (made on ``capture_replicated``'s graph of one replica) to every replica of ``model``'s
    ``MirroredStrategy`` step at the global ``batch_size`` (default: the plan's per-replica batch times the
    replicas). One ``PlanError`` for a plan that does not fit; one ``CaptureError`` for another strategy.
    ``verify``: the first call (on ``verify_with`` = (x, y), else zeros) checks each replica's swaps survived
    Grappler (``ReplicatedStep.verification``), then every variable is put back. ``sample_weight``: the step takes
    a weight per sample after each replica's labels (``model.fit`` with ``sample_weight`` or ``class_weight``)."""
    replicas = resolve_replicas(model)
    placements = tuple(replica_placement(replicas, k) for k in range(replicas.count))
    named, inputs, trace = trace_for_plan(model, plan, batch_size=batch_size, graph=graph, inputs=inputs,
                                          serialize=serialize, sample_weight=sample_weight, placements=placements)
    shapes = replicated_batch_shapes(model, trace, inputs, named.graph_rewrites) if named.splits else None
    graph_def = trace.step_graph_def()  # once: the state's nodes are found in the one edited
    state = state_nodes(graph_def, trace.traced, model, named.host_state) if named.host_state else None
    edit = edit_replicas(trace, named, placements, graph_def=graph_def, swap_op=swap_op, shapes=shapes, state=state)
    function = import_step(edit.graph_def, trace.traced)
    step = ReplicatedStep(function=function, trace=trace, graph_def=edit.graph_def, plan=named, applied=edit.applied,
                          skipped=edit.skipped, placements=edit.placements, swap_op=edit.placements[0].swap_op,
                          model=model, recomputed=edit.recomputed, splits=edit.splits, inputs=inputs,
                          host_updates=edit.host_updates, state_nodes=edit.state_nodes)
    log.info("applied %d swap(s), %d recomputation(s), %d split region(s) and the slots of %d variable(s) on the host "
             "on each of %d replicas (%s)", step.n_swap_outs, len(named.recomputes), len(named.splits),
             len(named.host_state), replicas.count, ", ".join(p.describe() for p in edit.placements))
    if verify and (named.swaps or named.recomputes or named.splits or named.host_state):
        step.verification = verify_replicas(step, verify_with)
    return step


def verify_replicas(step: ReplicatedStep, example=None) -> tuple[Verification, ...]:
    """The step's first call, collected and profiled (then every variable restored): per replica, what survived
    Grappler of its swaps and recomputations (``rewriter.check.verification.check`` on its own nodes and devices)
    and the constants its kernels made (``step.constant_bytes``); empty for a step without either."""
    flat = step.flat_inputs(step.split(*example)) if example is not None else step.zeros()
    snapshot = step.snapshot()
    found = []

    def first(*inputs):
        found.append(collect_first_call(lambda *args: step.run_flat(*args)[1], *inputs))
        return found[-1]

    try:
        events = memtrace.memory_events(memtrace.profile_call(first, *flat))
    finally:
        snapshot.restore()
    graphs = found[0][1]
    owners = step.event_owners(events)
    nodes = constant_nodes(graphs)
    step.constant_bytes = tuple(memtrace.constant_bytes(events[owners == k], nodes)
                                for k in range(step.replicas.count))
    results = []
    if not any(step.applied) and not any(step.recomputed) and not any(step.splits) and not step.host_updates:
        return ()  # the constants alone
    for k, place in enumerate(step.placements):
        result = check(graphs, step.applied[k], accelerator=place.accelerator, host=place.host,
                       recomputed=step.recomputed[k] if step.recomputed else (),
                       split=step.splits[k] if step.splits else (),
                       host_updates=frozenset().union(*step.host_updates[k].values()) if step.host_updates
                       else frozenset())
        if not result.ok:
            log.warning("replica %d: %s", k, result.headline())
        results.append(result)
    return tuple(results)


def make_replicated_train_function(model, step: ReplicatedStep):
    """A Keras ``train_function(iterator) -> logs`` that feeds each distributed batch to ``step``, replica by
    replica."""
    strategy = step.replicas.strategy

    def local(value, k):
        return None if value is None else tf.nest.map_structure(
            lambda v: strategy.experimental_local_results(v)[k], value)

    def run_batch(x, y, sample_weight):
        if isinstance(sample_weight, (dict, list, tuple)):
            raise ValueError(f"{WEIGHT_PER_OUTPUT}; undo it with rewriter.step.keras_fit.restore_train_function(model)")
        per_replica = [(local(x, k), local(y, k)) + (() if sample_weight is None else (local(sample_weight, k),))
                       for k in range(step.replicas.count)]
        shares = [int(tf.nest.flatten(part[0])[0].shape[0]) for part in per_replica]
        if len(set(shares)) > 1:  # the strategy split an epoch's last batch unevenly
            raise ValueError(f"a batch of {sum(shares)} samples does not split evenly over {len(shares)} "
                             "replicas: give a dataset whose size is a multiple of the batch size")
        # every worker's replicas have one share each; with sample_weight or class_weight the plan applied to the
        # step traced with the weights
        target = step.for_batch(shares[0] * step.replicas.in_sync, weighted=sample_weight is not None or step.weighted)
        return target.logs_of(target.run_flat(*target.flat_inputs(per_replica))[0])

    return train_function_of(model, step, run_batch)


def build_from_first_replica(model) -> None:
    """Let ``model.fit`` start under ``MultiWorkerMirroredStrategy`` with Keras 3.15: before its first step ``fit``
    builds the model symbolically from the first distributed batch, reduced with ``strategy.reduce("MEAN", (x,
    y))``, which that strategy's all-reduce refuses for a structure ("Attempt to convert a value (PerReplica..."; the
    same with or without a plan, keras-team/keras#20585). The build needs shapes only: this model's build takes the
    first local replica's batch instead (an attribute of this model; Keras' training step is not touched)."""
    strategy = model.distribute_strategy

    def build(iterator=None, data_batch=None):
        if iterator is not None:
            for _, _, batches in iterator:
                data_batch = tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], next(batches))
                break
        with strategy.scope():
            model._symbolic_build(data_batch=data_batch)  # noqa: SLF001

    model._maybe_symbolic_build = build  # noqa: SLF001


def use_replicated_step(model, step_or_plan, *, batch_size: int | None = None, **apply_kwargs) -> ReplicatedStep:
    """``rewriter.use_swap_step`` for a model built in ``MirroredStrategy.scope()`` or
    ``MultiWorkerMirroredStrategy.scope()`` (called in every worker): ``model.fit`` (global ``batch_size``) runs
    the plan on every replica. ``rewriter.restore_train_function`` undoes it."""
    if isinstance(step_or_plan, ReplicatedStep):
        step = step_or_plan
        if step._model is not model:  # noqa: SLF001
            raise ValueError("this ReplicatedStep was built for another model")
    else:
        step = apply_replicated(model, step_or_plan, batch_size=batch_size, **apply_kwargs)
    if step.replicas.workers > 1:
        build_from_first_replica(model)
    install_train_function(model, make_replicated_train_function(model, step), step)
    return step
