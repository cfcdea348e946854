"""Recomputation beside swapping: the action record both the simulator and the rewriter read.

A tensor the backward pass reads far from where it was made may, instead of being kept or swapped,
be freed after its near readers and made again shortly before its far readers, by clones of the
(pure, cheap) ops that made it. The clones read their inputs (the recomputation's *sources*) as
ordinary tensors, so the swap plan can keep or swap those like any other tensor. See
``docs/design.md`` (recomputation) for the rules; the simulator models a recomputation as new ops in
the step's graph (``with_recomputes``), the rewriter builds the same clones in the TF graph, under
the same names.

Which tensors to recompute is ``simulator.recompute.choice``'s question.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from simulator.graph import BACKWARD, GraphError, OpGraph
from simulator.ordering import categorized_levels

CLONE_MARK = "/recompute_"


@dataclass(frozen=True)
class Recompute:
    """One recomputation, by name: the far reads of ``tensor`` are served by clones of ``ops``.

    ``ops`` lists the ops to clone, producers before readers; ``ops[-1]`` makes ``tensor``
    (``"op:output"``). Each clone reads the clone of an input's producer when that producer is in
    ``ops``, else the original tensor (a source). Every clone with no cloned input waits for
    ``trigger`` (a control edge), so the recomputation starts late, not beside its sources.
    ``consumers`` are the far readers, rewired from ``tensor`` to its clone.
    """

    tensor: str
    ops: tuple[str, ...]
    trigger: str
    consumers: tuple[str, ...]


def clone_name(op: str, index: int) -> str:
    """The clone of ``op`` made by the ``index``-th recomputation of a plan (same in TF and simulator)."""
    return f"{op}{CLONE_MARK}{index}"


def original_name(name: str) -> str:
    """The op a clone was made from (``name`` itself for an op that is not a clone)."""
    head, mark, tail = name.rpartition(CLONE_MARK)
    return head if mark and tail.isdigit() else name


# ---------------------------------------------------------------------- which ops may be cloned

# Op types the simulator will choose to clone, by class (``RecomputeParams.classes``). Only pure ops:
# a clone must compute what its original computed. Stateless random ops are pure (a clone reads the
# original key and counter, so Dropout's mask comes out the same); ``StatelessRandomGetKeyCounter``
# is not listed: it stays upstream, a source. Max pooling is left out: oneDNN joins it to its gradient
# through a workspace (``rewriter.tf_effects.onednn``) that a clone would not share.
RECOMPUTE_CLASSES: dict[str, frozenset[str]] = {
    "activation": frozenset({
        "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Sigmoid", "Tanh", "Softplus", "Softsign", "Erf", "Erfc",
        "Softmax", "LogSoftmax"}),
    "elementwise": frozenset({
        "Add", "AddV2", "AddN", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum",
        "Neg", "Square", "SquaredDifference", "Sqrt", "Rsqrt", "Exp", "Expm1", "Log", "Log1p", "Abs", "Sign",
        "Reciprocal", "Inv", "Pow", "Floor", "Ceil", "Round", "ClipByValue", "BiasAdd", "BiasAddV1", "Cast",
        "Select", "SelectV2", "Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual", "LogicalAnd",
        "LogicalOr", "LogicalNot", "OnesLike", "ZerosLike"}),
    "normalization": frozenset({
        "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "Mean", "Sum", "Max", "Min", "Prod"}),
    "shape": frozenset({
        "Reshape", "Squeeze", "ExpandDims", "Transpose", "Identity", "Pad", "PadV2", "MirrorPad", "Slice",
        "StridedSlice", "ConcatV2", "Tile", "BroadcastTo", "Pack", "Unpack", "Split", "SplitV", "GatherV2"}),
    "random": frozenset({
        "StatelessRandomUniformV2", "StatelessRandomNormalV2", "StatelessTruncatedNormalV2",
        "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2"}),
    # recomputing these costs FLOPs, not only memory traffic: only when asked for
    "expensive": frozenset({
        "Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
        "Einsum", "Conv2DBackpropInput", "Conv3DBackpropInputV2"}),
}
CHEAP_CLASSES = ("activation", "elementwise", "normalization", "shape", "random")
# the op classes of each value of ``SwapParams.recompute``
RECOMPUTE_SCOPES: dict[str, tuple[str, ...]] = {"none": (), "cheap": CHEAP_CLASSES,
                                                "expensive": CHEAP_CLASSES + ("expensive",)}
# Never cloned whatever a class list says: state, stateful randomness, graph inputs, control flow,
# transfers, assertions and IO (the rewriter refuses them too, from TF's own op registry).
NEVER_RECOMPUTED = frozenset({
    "ReadVariableOp", "VarHandleOp", "VariableV2", "AssignVariableOp", "AssignAddVariableOp",
    "AssignSubVariableOp", "ResourceGather", "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "Multinomial", "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "StatelessRandomGetKeyCounter", "StatelessRandomGetKeyCounterAlg", "RngReadAndSkip", "RngSkip",
    "Placeholder", "PlaceholderWithDefault", "While", "StatelessWhile", "If", "StatelessIf", "Case",
    "StatelessCase", "PartitionedCall", "StatefulPartitionedCall", "_Send", "_Recv", "_HostSend", "_HostRecv",
    "Assert", "PrintV2", "Print", "Const", "NoOp",
})


def recomputable_types(classes: Sequence[str]) -> frozenset[str]:
    """The op types of ``classes`` (names of ``RECOMPUTE_CLASSES``), never a stateful one."""
    unknown = [name for name in classes if name not in RECOMPUTE_CLASSES]
    if unknown:
        raise ValueError(f"unknown recompute class(es) {unknown}; known: {', '.join(RECOMPUTE_CLASSES)}")
    types: set[str] = set()
    for name in classes:
        types |= RECOMPUTE_CLASSES[name]
    return frozenset(types - NEVER_RECOMPUTED)


# ---------------------------------------------------------------------- the transformation


def with_recomputes(g: OpGraph, actions: Sequence[Recompute]) -> OpGraph:
    """A new graph: ``g`` with every action's clones added and its far readers rewired (``g`` is
    left as it is).

    Clones keep their originals' type, cost coefficients, output sizes, dtypes, shapes, swappability
    and aliasing (an output aliasing an input aliases what the clone reads there), in the backward
    phase; action k's clone of op ``o`` is ``clone_name(o, k)``. A clone reads the clone of its
    input's producer when that producer is cloned by the same action, else the original tensor (a
    source); each clone with no cloned input gets a control edge from the trigger; the far readers
    read the clone of the tensor. Raises GraphError on an action ``g`` cannot hold.
    """
    if not actions:
        return g
    op_index = g.op_index()
    tensor_index = g.tensor_index()
    n_ops, n_tensors = g.n_ops, g.n_tensors
    made_by = outputs_of(g)
    read_by = inputs_of(g)

    new_op: list[int] = []  # original op of each clone
    new_op_name: list[str] = []
    new_tensor: list[int] = []  # original tensor of each clone output
    new_producer: list[int] = []
    new_alias: list[int] = []
    edge_tensor, edge_consumer, edge_slot = [g.edge_tensor], [g.edge_consumer], [g.edge_slot]
    control_src, control_dst = [g.control_src], [g.control_dst]
    rewired_tensor = g.edge_tensor.copy()
    for k, action in enumerate(actions):
        ops = _action_ops(g, action, k, op_index, tensor_index)
        trigger = op_index.get(action.trigger)
        if trigger is None or original_name(action.trigger) != action.trigger:
            raise GraphError(f"recomputation {k} of {action.tensor}: its trigger {action.trigger!r} is not an op of "
                             "the original step")
        clone_of_tensor: dict[int, int] = {}
        clone_of_op: dict[int, int] = {}
        for op in ops:
            clone = n_ops + len(new_op)
            clone_of_op[op] = clone
            new_op.append(op)
            new_op_name.append(clone_name(str(g.op_name[op]), k))
            for tensor in made_by[op]:
                clone_of_tensor[tensor] = n_tensors + len(new_tensor)
                new_tensor.append(tensor)
                new_producer.append(clone)
        for op in ops:
            clone = clone_of_op[op]
            cloned_input = False
            for tensor, slot in read_by[op]:
                source = clone_of_tensor.get(tensor, tensor)
                cloned_input |= source != tensor
                edge_tensor.append(np.asarray([source]))
                edge_consumer.append(np.asarray([clone]))
                edge_slot.append(np.asarray([slot]))
            if not cloned_input:
                control_src.append(np.asarray([trigger]))
                control_dst.append(np.asarray([clone]))
            for tensor in made_by[op]:
                parent = int(g.tensor_alias_of[tensor])
                new_alias.append(-1 if parent < 0 else clone_of_tensor.get(parent, parent))
        target = tensor_index[action.tensor]
        consumers = [op_index[name] for name in action.consumers]
        unknown = [name for name in action.consumers if name not in op_index]
        if unknown:
            raise GraphError(f"recomputation {k} of {action.tensor}: {unknown[0]!r} is not an op of this step")
        for consumer in consumers:
            reads = (g.edge_tensor == target) & (g.edge_consumer == consumer)
            if not reads.any():
                raise GraphError(f"recomputation {k}: {g.op_name[consumer]} does not read {action.tensor}")
            if consumer in clone_of_op:
                raise GraphError(f"recomputation {k}: {g.op_name[consumer]} is cloned and a far reader at once")
            rewired_tensor[reads] = clone_of_tensor[target]
    edge_tensor[0] = rewired_tensor
    op_rows = np.asarray(new_op, dtype=np.int64)
    tensor_rows = np.asarray(new_tensor, dtype=np.int64)
    graph = OpGraph.build(
        op_name=np.concatenate([g.op_name, np.asarray(new_op_name, dtype=str)]),
        op_type=np.concatenate([g.op_type, g.op_type[op_rows]]),
        op_phase=np.concatenate([g.op_phase, np.full(len(op_rows), BACKWARD, dtype=g.op_phase.dtype)]),
        op_flops_ab=np.concatenate([g.op_flops_ab, g.op_flops_ab[op_rows]]),
        op_touched_bytes_ab=np.concatenate([g.op_touched_bytes_ab, g.op_touched_bytes_ab[op_rows]]),
        op_forwards_input=np.concatenate([g.op_forwards_input, g.op_forwards_input[op_rows]]),
        tensor_producer=np.concatenate([g.tensor_producer, np.asarray(new_producer, dtype=np.int64)]),
        tensor_output=np.concatenate([g.tensor_output, g.tensor_output[tensor_rows]]),
        tensor_dtype=np.concatenate([g.tensor_dtype, g.tensor_dtype[tensor_rows]]),
        tensor_shape=np.concatenate([g.tensor_shape, g.tensor_shape[tensor_rows]]),
        tensor_bytes_ab=np.concatenate([g.tensor_bytes_ab, g.tensor_bytes_ab[tensor_rows]]),
        tensor_alias_of=np.concatenate([g.tensor_alias_of, np.asarray(new_alias, dtype=np.int64)]),
        tensor_persistent=np.concatenate([g.tensor_persistent, np.zeros(len(tensor_rows), bool)]),
        tensor_swappable=np.concatenate([g.tensor_swappable, g.tensor_swappable[tensor_rows]]),
        edge_tensor=np.concatenate(edge_tensor), edge_consumer=np.concatenate(edge_consumer),
        edge_slot=np.concatenate(edge_slot), control_src=np.concatenate(control_src),
        control_dst=np.concatenate(control_dst), persistent_bytes_ab=g.persistent_bytes_ab, outputs=g.outputs,
        held_tensor=g.held_tensor, held_read=g.held_read,
        batch_size=g.batch_size,
        meta={**g.meta, "recomputes": list(g.meta.get("recomputes", [])) + [asdict(a) for a in actions]},
    )
    return graph.with_order(g.order)


def _action_ops(g: OpGraph, action: Recompute, k: int, op_index: dict[str, int],
                tensor_index: dict[str, int]) -> list[int]:
    """The action's ops as indices, checked: known, pure, original, listed producers first, the
    last one making the tensor."""
    if not action.ops or not action.consumers:
        raise GraphError(f"recomputation {k} of {action.tensor} lists no ops or no far readers")
    if action.tensor not in tensor_index:
        raise GraphError(f"recomputation {k}: {action.tensor!r} is not a tensor of this step")
    unknown = [name for name in action.ops if name not in op_index or original_name(name) != name]
    if unknown:
        raise GraphError(f"recomputation {k} of {action.tensor}: {unknown[0]!r} is not an op of the original step")
    ops = [op_index[name] for name in action.ops]
    if len(set(ops)) != len(ops):
        raise GraphError(f"recomputation {k} of {action.tensor} lists an op twice")
    if g.tensor_producer[tensor_index[action.tensor]] != ops[-1]:
        raise GraphError(f"recomputation {k}: its last op {action.ops[-1]!r} does not make {action.tensor}")
    stateful = [name for name, op in zip(action.ops, ops) if g.op_type[op] in NEVER_RECOMPUTED]
    if stateful:
        op = op_index[stateful[0]]
        raise GraphError(f"recomputation {k} of {action.tensor} would clone {stateful[0]!r}, a {g.op_type[op]}: "
                         "only pure ops are recomputed")
    position = {op: i for i, op in enumerate(ops)}
    for i, op in enumerate(ops):
        producers = g.tensor_producer[g.edge_tensor[g.edge_consumer == op]]
        if any(position.get(int(p), -1) > i for p in producers):
            raise GraphError(f"recomputation {k} of {action.tensor} lists {action.ops[i]!r} before an op it reads")
    return ops


def outputs_of(g: OpGraph) -> list[list[int]]:
    """Per op: the tensors it makes (once per structure; shared, do not modify)."""
    def compute(graph: OpGraph) -> list[list[int]]:
        outputs: list[list[int]] = [[] for _ in range(graph.n_ops)]
        for tensor, op in enumerate(graph.tensor_producer.tolist()):
            outputs[op].append(tensor)
        return outputs

    return g.cached("outputs_of", compute, structural=True)


def inputs_of(g: OpGraph) -> list[list[tuple[int, int]]]:
    """Per op: its (tensor, input slot) reads, in edge order (once per structure; shared, do not
    modify)."""
    def compute(graph: OpGraph) -> list[list[tuple[int, int]]]:
        inputs: list[list[tuple[int, int]]] = [[] for _ in range(graph.n_ops)]
        for tensor, op, slot in zip(graph.edge_tensor.tolist(), graph.edge_consumer.tolist(), graph.edge_slot.tolist()):
            inputs[op].append((tensor, slot))
        return inputs

    return g.cached("inputs_of", compute, structural=True)


def recomputed_tensors(g: OpGraph) -> list[Recompute]:
    """The recomputations a transformed graph holds (``with_recomputes`` notes them in its meta)."""
    return [Recompute(**{key: tuple(value) if isinstance(value, list) else value for key, value in record.items()})
            for record in g.meta.get("recomputes", [])]


def original_levels(g: OpGraph, transformed: OpGraph) -> np.ndarray:
    """Per op of ``transformed`` (``g`` with recomputations): the level in ``g`` it stands for, its
    own for an original op, its action's first far reader's for a clone. Plots of the two graphs'
    memory share an axis this way (the clones shift the backward pass's levels)."""
    levels = categorized_levels(g)
    index = g.op_index()
    first_reader = [min(int(levels[index[name]]) for name in action.consumers)
                    for action in recomputed_tensors(transformed)]
    found = np.empty(transformed.n_ops, dtype=np.int64)
    found[:g.n_ops] = levels
    for op in range(g.n_ops, transformed.n_ops):
        k = int(str(transformed.op_name[op]).rpartition(CLONE_MARK)[2])
        found[op] = first_reader[k]
    return found


def check_recompute_structure(recomputes: Sequence[Recompute], error: type[GraphError] = GraphError) -> None:
    """The rules recomputations obey whatever the graph: each lists ops and far readers, its last op
    makes its tensor, one action per tensor, and they name original ops only (no chains of actions:
    a clone's name, ``clone_name``, is the simulator's and the rewriter's, never the plan's)."""
    seen = set()
    for k, action in enumerate(recomputes):
        if not action.ops or not action.consumers:
            raise error(f"recomputation {k} of {action.tensor} lists no ops or no far readers")
        if action.tensor.rpartition(":")[0] != action.ops[-1]:
            raise error(f"recomputation {k}: its last op {action.ops[-1]!r} does not make its tensor "
                        f"{action.tensor!r}")
        if action.tensor in seen:
            raise error(f"a tensor is recomputed twice in one plan ({action.tensor})")
        seen.add(action.tensor)
        clones = [name for name in (*action.ops, action.trigger, *action.consumers) if original_name(name) != name]
        if clones:
            raise error(f"recomputation {k} names the clone {clones[0]!r}: sources, triggers and far readers are "
                        "ops of the original step (no chains of recomputations)")
