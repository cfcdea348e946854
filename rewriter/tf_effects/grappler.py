"""What Grappler does to the step, emulated where the tool must know it in advance.

* The capture (``reduce_step``): the ops that really run, with constants and static shapes folded,
  dead ops dropped, Identity-like ops (``BYPASS_TYPES``) and arithmetic reduced to one of its inputs
  (``rewriter.tf_effects.passthrough``) bypassed, as Grappler leaves the step.
* The rewrite: ops Grappler removes (``foldable_ops``), so a swap-in's control edge is never put on
  one; and the Grappler configuration a rewritten step runs with (``swap_grappler_config``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

from rewriter.tf_effects import passthrough
from rewriter.errors import CaptureError

# Ops whose output is their input (Grappler removes them): consumers read the input directly.
BYPASS_TYPES = frozenset({"Identity", "IdentityN", "StopGradient", "PreventGradient", "Snapshot", "EnsureShape"})
SHAPE_TYPES = frozenset({"Shape", "ShapeN", "Rank", "Size", "BroadcastGradientArgs"})
# Sources of a control edge that tell nothing about timing (always ready).
ALWAYS_READY = frozenset({"Const", "Placeholder", "ReadVariableOp", "VarHandleOp", "NoOp"}) | SHAPE_TYPES
RESHAPE_LIKE = frozenset({"Reshape", "Squeeze", "ExpandDims", "BroadcastTo"})
REDUCTIONS = frozenset({"Sum", "Mean", "Prod", "Max", "Min", "All", "Any"})


def passed_on(tensor):
    """The input a bypassed op passes on as ``tensor``: an Identity-like op's, or the operand of
    arithmetic Grappler reduces to it (``x * 1``: ``rewriter.tf_effects.passthrough``); None for other ops."""
    op = tensor.op
    if op.type in BYPASS_TYPES:
        return op.inputs[tensor.value_index if op.type == "IdentityN" else 0] if op.inputs else None
    slot = passthrough.passthrough_input(op)
    return None if slot is None else op.inputs[slot]


def underlying(tensor):
    """The tensor a bypassed op passes on (itself otherwise), through any number of them."""
    while (source := passed_on(tensor)) is not None:
        tensor = source
    return tensor


@dataclass
class Reduced:
    """The ops that run, with inputs resolved through bypassed and folded ops."""

    ops: list[Any]  # tf.Operation
    inputs: dict[str, list[tuple[int, str, int]]]  # op -> [(slot, producer, output index)]
    controls: dict[str, list[str]]
    outputs: list[tuple[str, int]]
    constants: list[Any]  # folded tensors read by ops that run: resident for the whole step


def _resolve(tensor, folded: set[str]):
    """Follow bypassed ops back to the tensor that really flows; None when it is folded."""
    tensor = underlying(tensor)
    return None if tensor.op.name in folded else tensor


def reduce_step(concrete, loss_op: str, *, only: frozenset[str] | None = None) -> Reduced:
    """The ops of the traced step that run once Grappler has folded, pruned and bypassed what it does;
    ``only``: of these ops alone (one replica's of a replicated step, ``rewriter.trace.replicas``)."""
    graph = concrete.graph
    ops = graph.get_operations()
    resources = {t.op.name for _, t in graph.captures if t.dtype == tf.resource}
    folded: set[str] = set()
    for op in ops:  # creation order is a topological order of data edges
        if op.type == "Const":
            folded.add(op.name)
        elif op.type in SHAPE_TYPES and all(t.shape.is_fully_defined() for t in op.inputs):
            folded.add(op.name)
        elif (op.inputs and not op.op_def.is_stateful and op.type not in BYPASS_TYPES
              and all(underlying(t).op.name in folded for t in op.inputs)
              and all(c.name in folded for c in op.control_inputs)):
            folded.add(op.name)
        elif op.type == "Placeholder" and op.name in resources:
            folded.add(op.name)  # variable handles: the variables are counted as resident bytes

    # ops needed by the outputs (data and control), i.e. not dead
    sinks = [t.op for t in concrete.outputs] + [op for op in ops if op.op_def.is_stateful and op.type != "Placeholder"]
    if only is not None:
        sinks = [op for op in sinks if op.name in only]
    needed: set[str] = set()
    stack = list(sinks)
    while stack:
        op = stack.pop()
        if op.name in needed:
            continue
        needed.add(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    if loss_op not in needed:
        raise CaptureError(f"the loss op {loss_op} does not feed the step's outputs or updates")

    kept = [op for op in ops if op.name in needed and op.name not in folded and op.type not in BYPASS_TYPES
            and passthrough.passthrough_input(op) is None and (only is None or op.name in only)]
    kept_names = {op.name for op in kept}

    through: dict[str, frozenset[str]] = {}

    def kept_sources(op) -> frozenset[str]:
        """The kept ops that must have run before ``op`` can (``op`` itself when kept): the step
        runs after them, so the OpGraph keeps them as control edges (folded shape computations,
        bypassed identities)."""
        if op.name in kept_names:
            return frozenset((op.name,))
        if op.name not in through:
            through[op.name] = frozenset()  # guards against revisits while this one is open
            found: set[str] = set()
            for tensor in op.inputs:
                found |= tensor_sources(tensor)
            for parent in op.control_inputs:
                found |= kept_sources(parent)
            through[op.name] = frozenset(found)
        return through[op.name]

    def tensor_sources(tensor) -> frozenset[str]:
        """Like ``kept_sources`` for one tensor: through a bypassed op, only the input it passes on
        (an optimizer's IdentityN must not make each update wait for every gradient)."""
        found: set[str] = set()
        while tensor.op.name not in kept_names and (source := passed_on(tensor)) is not None:
            for parent in tensor.op.control_inputs:
                found |= kept_sources(parent)
            tensor = source
        return frozenset(found | kept_sources(tensor.op))

    inputs: dict[str, list[tuple[int, str, int]]] = {}
    controls: dict[str, list[str]] = {}
    constants: dict[str, Any] = {}
    for op in kept:
        resolved = []
        indirect: set[str] = set()
        for slot, tensor in enumerate(op.inputs):
            source = _resolve(tensor, folded)
            if source is not None and source.op.name in kept_names:
                resolved.append((slot, source.op.name, source.value_index))
            elif source is None and underlying(tensor).op.name not in resources:
                constants[underlying(tensor).name] = underlying(tensor)
            indirect |= tensor_sources(tensor)
        for parent in op.control_inputs:
            indirect |= kept_sources(parent)
        inputs[op.name] = resolved
        data_sources = {src for _, src, _ in resolved}
        controls[op.name] = sorted(indirect - data_sources - {op.name})
    outputs = []
    for tensor in concrete.outputs:
        source = _resolve(tensor, folded)
        if source is not None and source.op.name in kept_names:
            outputs.append((source.op.name, source.value_index))
    return Reduced(kept, inputs, controls, outputs, list(constants.values()))


# ---------------------------------------------------------------------- what Grappler removes


def foldable_ops(concrete) -> frozenset[str]:
    """Ops Grappler removes, so a control edge from one would vanish: shape ops and reductions whose
    output has the static shape of their input (the arithmetic optimizer's
    RemoveRedundantReshapeOrBroadcastTo; a gradient's Sum over the axes BroadcastGradientArgs found
    to be none), ops computed from constants alone (constant folding: a loss's ``range`` of
    reduction axes) and arithmetic it reduces to one operand (``x * 1``: ``rewriter.tf_effects.passthrough``)."""
    found, constant = set(), set()
    for op in concrete.graph.get_operations():  # in creation order: inputs before their readers
        if op.inputs and not op.control_inputs and op.type not in ALWAYS_READY and not op.op_def.is_stateful \
                and all(t.op.type == "Const" or t.op.name in constant for t in op.inputs):
            constant.add(op.name)
            found.add(op.name)
            continue
        if passthrough.passthrough_input(op) is not None:  # x * 1 and the like (rewriter.tf_effects.passthrough)
            found.add(op.name)
            continue
        if op.type in RESHAPE_LIKE | REDUCTIONS and op.inputs and op.outputs:
            before, after = op.inputs[0].shape, op.outputs[0].shape
            if before.is_fully_defined() and after.is_fully_defined() and before == after:
                found.add(op.name)
    return frozenset(found)


# Ops Grappler's arithmetic optimizer and constant folding may remove besides ``foldable_ops``: a
# reshape of a reshape (the bias gradient's [64] -> [1,1,1,64] -> [64]), identities, and arithmetic
# with a constant operand (a loss weight of 1.0). Where one goes, the control edges it carried in the
# chain go with it (not forwarded: measured on multi_io, whose MaxPoolGrad then ran beside the filter
# gradient the order put before it, holding its input: 17 % above the prediction).
_VANISHING_TYPES = RESHAPE_LIKE | REDUCTIONS | frozenset({"Identity", "Snapshot", "StopGradient", "NoOp"})
_ARITHMETIC = frozenset({"Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum"})


def may_vanish(node, nodes: dict[str, Any], foldable: frozenset[str]) -> bool:
    """Whether Grappler may remove ``node`` and the control edges it carries: the chain then also
    ties the next op to the ops before it back to one that stays, edges the order already implies
    (never a cycle; redundant where nothing is removed)."""
    if node.name in foldable or node.op in _VANISHING_TYPES:
        return True
    return node.op in _ARITHMETIC and any(
        nodes.get(ref.partition(":")[0]) is not None and nodes[ref.partition(":")[0]].op == "Const"
        for ref in node.input if not ref.startswith("^"))


# ---------------------------------------------------------------------- the rewritten step's configuration


def swap_grappler_config(config: config_pb2.ConfigProto) -> config_pb2.ConfigProto:
    """Switch off, in ``config``, the graph passes that would move or copy swapped tensors (in place).

    * the memory optimizer: its AddN rewrite and its own swapping depend on a static memory estimate
      against the device's size, which makes the executed graph (and its peak) unpredictable; the
      plan already decides what leaves the device;
    * the layout optimizer: on a GPU it turns fp32 NHWC convolutions into NCHW with ``Transpose``s
      between a producer and its swap-out and between a swap-in and its reader, full-size buffers
      outside the plan (it does nothing on the CPU testbed, so the testbed runs what a GPU would);
    * pin-to-host: it may move small ops, a swap node among them, to the other device;
    * XLA auto-clustering: a cluster would swallow the swap nodes and their control edges.
    """
    rewrite = config.graph_options.rewrite_options
    rewrite.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    rewrite.layout_optimizer = rewriter_config_pb2.RewriterConfig.OFF
    rewrite.pin_to_host_optimization = rewriter_config_pb2.RewriterConfig.OFF
    config.graph_options.optimizer_options.global_jit_level = config_pb2.OptimizerOptions.OFF
    return config


@contextlib.contextmanager
def fixed_grappler_config():
    """Run functions with the Grappler configuration of ``swap_grappler_config``."""
    ctx = context.context()
    saved = ctx.function_call_options
    config = config_pb2.ConfigProto()
    config.ParseFromString(saved.config_proto_serialized)
    swap_grappler_config(config)
    ctx.function_call_options = context.FunctionCallOptions(executor_type=saved.executor_type, config_proto=config)
    try:
        yield
    finally:
        ctx.function_call_options = saved
