"""Capture a Keras (or hand-written) training step as a framework-free ``simulator.OpGraph``.

The step is traced with fixed shapes into a FuncGraph; the graph is then reduced to what will
really run (constants and static shapes folded, dead ops dropped, Identity-like ops bypassed, the
optimizer's IdentityN barrier removed, as Grappler does: ``rewriter.tf_effects.grappler``), every op is given a
phase (forward = ancestors of the loss, update = optimizer and variable writes, backward = the rest
that leads to them) and a cost (``rewriter.trace.costs``), and tensor sizes are fitted as ``a + b * batch``
from two traces.
"""

from __future__ import annotations

import json
import logging
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from rewriter.tf_effects import collectives, conditionals, loops, mixed_precision, onednn, variable_writes, xla_scratch
from rewriter.tf_effects.variable_writes import WRITE_TYPES_PREFIX
from rewriter.trace.costs import op_flops, op_touched_bytes, static_dims, tensor_nbytes
from rewriter.tf_effects.grappler import BYPASS_TYPES, SHAPE_TYPES, Reduced, reduce_step, underlying  # noqa: F401 -- types: here too
from rewriter.trace.graph_rewrites import apply_rewrites
from rewriter.trace.step_inputs import (NO_STEP_INPUTS, CaptureError, StepInputs, StepSpecs, build_if_needed, step_specs,  # noqa: F401
                                  synthetic_batch, trains_itself)  # CaptureError and synthetic_batch: still importable from here
from rewriter.trace import state_kinds
from rewriter.trace.optimizer_state import describe_movable_state
from rewriter.trace.step_loss import recording_losses
from rewriter.trace.op_names import canonical, canonical_names
from rewriter.trace.training_setup import describe_training
from simulator.graph import BACKWARD, FORWARD, OTHER, UPDATE, OpGraph
from simulator.planning import FLOAT_DTYPES

log = logging.getLogger(__name__)


# Ops whose output shares the input buffer (docs/design.md 4).
ALIAS_TYPES = frozenset({"Reshape", "Squeeze", "ExpandDims"})
# Ops that write their output into an input buffer they read last (TF's forward_input_or_allocate_output).
FORWARDING_TYPES = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Sigmoid", "Tanh", "Softplus", "Softsign",
    "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "SigmoidGrad", "TanhGrad", "SoftplusGrad",
    "AddN", "AddV2", "Add", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "Pow",
    "BiasAdd", "Rsqrt", "RsqrtGrad", "Sqrt", "SqrtGrad", "Neg", "Square", "Exp", "Log", "Log1p", "Reciprocal",
    "SquaredDifference", "Abs", "Sign", "Erf", "Gelu", "GeluGrad", "Softmax", "LogSoftmax", "ClipByValue", "SelectV2",
    "CollectiveReduceV2",  # the all-reduce writes into its pack (rewriter.tf_effects.collectives)
    # the cross-entropy's gradient takes its logits' buffer (forward_input_or_allocate_output({0}, 1, ...))
    "SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits",
})
# what a swap may move: floats, and int64 (the labels Keras' sparse losses cast, as large as an
# activation and kept from the forward pass's start to the loss; plans swap them with tensors="all");
# int32 stays out, as TF keeps it in host memory beside a GPU
SWAPPABLE_DTYPES = FLOAT_DTYPES | {"int64"}


@dataclass
class TracedStep:
    """One trace of the training step at a fixed batch size."""

    concrete: Any  # tf ConcreteFunction
    batch_size: int
    loss_op: str
    optimizer_scope: str | None
    input_names: list[str] = field(default_factory=list)
    inputs: StepSpecs | None = None  # names and structures of a Keras step's inputs and labels
    # traced op name -> the name the capture and plans use (rewriter.trace.op_names; empty: the traced names)
    canonical: dict[str, str] = field(default_factory=dict)
    # a replicated step's trace: the ops of the replica captured (rewriter.trace.replicas); None: all
    ops: frozenset[str] | None = None


# ---------------------------------------------------------------------- Keras entry point


def check_compiled(model, *, replicated: bool = False) -> None:
    """Refuse models the step cannot be traced for, with what to do about it (``replicated``: the caller traces
    the step a strategy replicates, ``rewriter.trace.replicas``)."""
    if not hasattr(model, "train_step"):
        raise CaptureError(f"{type(model).__name__} is not a Keras model")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise CaptureError("the model is not compiled: call model.compile(optimizer=..., loss=...) first")
    if getattr(model, "loss", None) is None and not trains_itself(model):
        raise CaptureError("the model is compiled without a loss: call model.compile(loss=...) first (a model "
                           "whose own train_step computes its losses needs none)")
    strategy = collectives.strategy_of(model)
    if strategy is not None and collectives.unsupported(strategy):
        raise CaptureError(collectives.unsupported(strategy))
    if strategy is not None and not replicated:
        raise CaptureError(f"the model was built under tf.distribute.{type(strategy).__name__}: its replicated step "
                           "is captured by rewriter.capture_replicated and trained with rewriter.use_replicated_step "
                           "(docs/design.md 14)")


def _optimizer_scope(optimizer) -> str | None:
    name = getattr(optimizer, "name", None)
    return re.escape(str(name)) if name else None


TRACE_HINT = ("the step is traced once into a graph with fixed shapes, without autograph: Python branches on "
              "tensor values, .numpy() and other eager-only code in train_step or call() cannot be captured")


# the traces of each model's step (a model traced at one batch size and step inputs is traced once: the
# capture, the calibration, each plan's apply and the measured run share the trace), the latest few kept
_TRACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
TRACES_KEPT = 4


def trace_keras_step(model, batch_size: int, given: StepInputs = NO_STEP_INPUTS, *,
                     sample_weight: bool = False) -> TracedStep:
    """Trace ``model.train_step`` at ``batch_size``; the loss is what ``(_)compute_loss`` returns
    (``rewriter.trace.step_loss``); inputs and labels by name, at the shapes ``given`` sets
    (``rewriter.trace.step_inputs``). A step traced before at the same batch size and inputs, with the same
    optimizer, loss and trainable variables, is not traced again: plans are edits of the traced graph
    (``rewriter.step.apply_plan`` imports an edited copy), never of the trace itself."""
    check_compiled(model)
    key = (int(batch_size), json.dumps([given.to_dict(), sample_weight], sort_keys=True, default=str))
    try:
        traces = _TRACES.setdefault(model, {})
    except TypeError:  # an object weak references cannot point to: traced each time
        traces = {}
    found, compiled = traces.get(key), (model.optimizer, model.loss, len(model.trainable_variables))
    if found is not None and found[0] is compiled[0] and found[1] is compiled[1] and found[2] == compiled[2]:
        return found[3]
    traced = _trace_keras_step(model, int(batch_size), given, sample_weight=sample_weight)
    traces.pop(key, None)
    traces[key] = (*compiled, traced)
    while len(traces) > TRACES_KEPT:
        traces.pop(next(iter(traces)))
    return traced


def forget_traces(model) -> None:
    """Drop the traces kept of ``model``'s step (they captured variables that were since replaced)."""
    try:
        _TRACES.pop(model, None)
    except TypeError:  # never kept
        pass


def traced_function(function, model, what: str):
    """``function``'s concrete function, with the losses ``model`` computed while it was traced; anything Keras or
    TF raises while tracing is one ``CaptureError`` naming ``what`` was traced."""
    with recording_losses(model) as recorded:
        try:
            concrete = function.get_concrete_function()
        except CaptureError:
            raise
        except Exception as error:
            raise CaptureError(f"tracing {what} failed: {type(error).__name__}: {error} ({TRACE_HINT})") from error
    loops.serialize_loops(concrete.graph)  # loop memory independent of thread timing (rewriter.tf_effects.loops)
    return concrete, recorded


def _trace_keras_step(model, batch_size: int, given: StepInputs, *, sample_weight: bool = False) -> TracedStep:
    inputs = step_specs(model, batch_size, given, sample_weight=sample_weight)
    build_if_needed(model, inputs)
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)

    def step(x, y):
        return model.train_step(inputs.train_data(x, y))

    function = tf.function(step, input_signature=[inputs.x_specs, inputs.label_specs], autograph=False)
    concrete, recorded = traced_function(function, model, "the training step")
    loss = recorded.loss()
    if loss is None:
        raise CaptureError("the training step computed no loss: its train_step neither called self.compute_loss "
                           "nor took a gradient of a scalar loss (tape.gradient)")
    return TracedStep(concrete, batch_size, underlying(loss).op.name, _optimizer_scope(model.optimizer),
                      [s.name for s in inputs.x_specs + inputs.label_specs], inputs,
                      canonical_names(op.name for op in concrete.graph.get_operations()))


def trace_function_step(step_fn: Callable, specs_at: Callable[[int], Sequence[tf.TensorSpec]], batch_size: int,
                        *, optimizer=None) -> TracedStep:
    """Trace a hand-written ``step_fn(*inputs)`` that returns its loss (or a dict with 'loss')."""
    specs = list(specs_at(batch_size))
    function = step_fn if isinstance(step_fn, tf.types.experimental.PolymorphicFunction) else tf.function(step_fn)
    try:
        concrete = function.get_concrete_function(*specs)
    except Exception as error:
        raise CaptureError(f"tracing the step function failed: {type(error).__name__}: {error}") from error
    collectives.refuse_collectives(concrete.graph)
    loops.serialize_loops(concrete.graph)
    result = concrete.structured_outputs
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, tf.Tensor):
        raise CaptureError("the step function must return its loss tensor (or a dict with a 'loss' entry)")
    return TracedStep(concrete, batch_size, underlying(loss).op.name, _optimizer_scope(optimizer),
                      [s.name for s in specs], canonical=canonical_names(op.name for op in concrete.graph.get_operations()))


def import_step(graph_def, traced: TracedStep, *, keep_input_names: bool = False):
    """Re-import an edited step GraphDef as a callable with the model's variables re-bound.
    ``keep_input_names``: its input placeholders take the traced step's names (for a capture of it)."""
    concrete = traced.concrete
    n_inputs = len(traced.input_names)
    # values captured by reference are fed on each call after the inputs (a collective's instance key, new
    # each step: ``call_time_values``); a single-device step has none
    inputs = concrete.inputs[:n_inputs] + list(concrete.graph.function_captures.by_ref_internal.values())
    input_names = [t.name for t in inputs]
    fetches = [t.name for t in concrete.outputs] + [f"{traced.loss_op}:0"]
    captures = list(concrete.graph.captures)
    specs = [tf.TensorSpec(t.shape, t.dtype, name=t.op.name if keep_input_names else f"swapstep_input_{i}")
             for i, t in enumerate(inputs)]

    def imported(*args):
        graph = tf.compat.v1.get_default_graph()
        input_map = dict(zip(input_names, args))
        for external, internal in captures:
            input_map[internal.name] = graph.capture(external)
        return tf.graph_util.import_graph_def(graph_def, input_map=input_map, return_elements=fetches, name="")

    return tf.compat.v1.wrap_function(imported, signature=specs)


def call_time_values(concrete) -> list:
    """The values a step captured by reference, taken now (``import_step`` takes them after the inputs)."""
    snapshot = concrete.graph.function_captures.get_by_ref_snapshot()  # key -> the value's flat components
    return [part for key in concrete.graph.function_captures.by_ref_internal for part in tf.nest.flatten(snapshot[key])]


def rewrite_graph_def(graph_def, rewrites: Sequence[str], graph) -> tuple[Any, dict[str, list[str]]]:
    """``rewriter.trace.graph_rewrites`` on a step's GraphDef, with static shapes from its traced ``graph``."""
    def shape_of(name: str) -> list[int] | None:
        try:
            shape = graph.get_tensor_by_name(name).shape
        except (KeyError, ValueError):
            return None
        return shape.as_list() if shape.is_fully_defined() else None

    return apply_rewrites(graph_def, rewrites, shape_of)


def rewritten_step(traced: TracedStep, rewrites: Sequence[str]) -> tuple[TracedStep, dict[str, list[str]]]:
    """The traced step with ``rewrites`` applied (itself when they change nothing)."""
    graph_def, changed = rewrite_graph_def(traced.concrete.graph.as_graph_def(), rewrites, traced.concrete.graph)
    if not any(changed.values()):
        return traced, changed
    function = import_step(graph_def, traced, keep_input_names=True)
    return TracedStep(function, traced.batch_size, traced.loss_op, traced.optimizer_scope, traced.input_names,
                      traced.inputs, traced.canonical), changed


# ---------------------------------------------------------------------- phases


def _phases(reduced: Reduced, loss_op: str, optimizer_scope: str | None) -> dict[str, int]:
    names = [op.name for op in reduced.ops]
    data_parents = {name: [src for _, src, _ in reduced.inputs[name]] for name in names}
    children: dict[str, list[str]] = {name: [] for name in names}
    for name in names:
        for src in data_parents[name] + reduced.controls[name]:
            children[src].append(name)

    forward: set[str] = set()
    stack = [loss_op]
    while stack:
        name = stack.pop()
        if name in forward:
            continue
        forward.add(name)
        stack.extend(data_parents.get(name, []))

    scope = re.compile(rf"^{optimizer_scope}(_\d+)?/") if optimizer_scope else None
    types = {op.name: op.type for op in reduced.ops}
    update = {n for n in names if n not in forward and (types[n].startswith(WRITE_TYPES_PREFIX)
                                                          or (scope is not None and scope.match(n)))}
    # backward: depends on the forward pass and leads to an update (or a step output)
    depends = set()
    for name in names:  # names are in topological order
        if name in forward or any(p in depends for p in data_parents[name]):
            depends.add(name)
    leads = set(update) | {src for src, _ in reduced.outputs}
    for name in reversed(names):
        if name in leads:
            continue
        if any(child in leads for child in children[name]):
            leads.add(name)
    phase = {}
    for name in names:
        if name in forward:
            phase[name] = FORWARD
        elif name in update:
            phase[name] = UPDATE
        elif name in depends and name in leads:
            phase[name] = BACKWARD
        else:
            phase[name] = OTHER
    return phase


# ---------------------------------------------------------------------- OpGraph


def _snapshot(traced: TracedStep) -> dict[str, Any]:
    """Everything batch-dependent of one trace, keyed by op name."""
    reduced = reduce_step(traced.concrete, traced.loss_op, only=traced.ops)
    paired = {pool for pool, _ in _pool_pairs(reduced)}
    xla = {op.name: xla_scratch.call_scratch_bytes(op) for op in reduced.ops}
    loop = {op.name: loops.body_working_set_bytes(op, tensor_nbytes, forwarding=FORWARDING_TYPES,
                                                  aliasing=ALIAS_TYPES | BYPASS_TYPES) for op in reduced.ops}
    branch = {op.name: conditionals.working_set_bytes(op, tensor_nbytes, forwarding=FORWARDING_TYPES,
                                                      aliasing=ALIAS_TYPES | BYPASS_TYPES) for op in reduced.ops}
    constants = list(reduced.constants) + [t for op in reduced.ops for t in conditionals.constant_tensors(op)]
    sized = {op.name: loops.output_bytes(op, tensor_nbytes) for op in reduced.ops}  # While loops' lists resolved
    return {
        "reduced": reduced,
        "shapes": {op.name: [static_dims(t.shape) for t in op.outputs] for op in reduced.ops},
        "bytes": {name: nbytes for name, (nbytes, _) in sized.items()},
        "unsized": [tensor for _, unknown in sized.values() for tensor in unknown],
        "scratch": {op.name: mixed_precision.kernel_scratch_bytes(op) + xla[op.name] + loop[op.name] + branch[op.name]
                    + collectives.scratch_bytes(op) for op in reduced.ops},
        "xla_scratch": xla,
        "loop_scratch": loop,
        "branch_scratch": branch,
        "workspace": {op.name: onednn.pool_workspace_bytes(op, op.name in paired) for op in reduced.ops},
        "flops": {op.name: op_flops(op) for op in reduced.ops},
        "touched": {op.name: op_touched_bytes(op) for op in reduced.ops},
        "resident": _resident_bytes(traced.concrete, traced.ops) + (sum(tensor_nbytes(t) for t in constants),),
    }


def _pool_pairs(reduced: Reduced) -> list[tuple[str, str]]:
    """(max pooling, its gradient) pairs oneDNN joins through a workspace: the gradient reads the
    pooled output as its input 1 (``rewriter.tf_effects.onednn``)."""
    kinds = {op.name: op.type for op in reduced.ops}
    return [(src, op.name) for op in reduced.ops for slot, src, k in reduced.inputs[op.name]
            if slot == onednn.POOLED_OUTPUT_SLOT and k == 0 and onednn.POOL_GRADS.get(kinds.get(src)) == op.type]


def _resident_bytes(concrete, only: frozenset[str] | None = None) -> tuple[int, int]:
    """(variables, inputs) bytes: variable sizes from the ops that read or write them (``only``: one replica's)."""
    def mine(name: str) -> bool:
        return only is None or name in only

    inputs = sum(tensor_nbytes(t) for t in concrete.inputs if t.dtype != tf.resource and mine(t.op.name))
    return sum(size for name, size in state_kinds.variable_sizes(concrete).items() if mine(name)), inputs


def _linear_fit(small: float, large: float, b1: int, b2: int) -> tuple[float, float]:
    slope = (large - small) / (b2 - b1)
    return small - slope * b1, slope


def _check_scaling(name: str, small, large, b1: int, b2: int) -> None:
    if small is None or large is None:
        return
    if len(small) != len(large) or any(s != l and s * b2 != l * b1 for s, l in zip(small, large)):
        raise CaptureError(f"tensor {name} does not scale linearly with the batch size "
                           f"({small} at batch {b1}, {large} at batch {b2})")


def build_opgraph(first: TracedStep, second: TracedStep, *, meta: dict | None = None) -> OpGraph:
    """Combine two traces of the same step at different batch sizes into one OpGraph."""
    b1, b2 = first.batch_size, second.batch_size
    if b1 == b2:
        raise CaptureError("the two traces must be at different batch sizes")
    one, two = _snapshot(first), _snapshot(second)
    ops = one["reduced"].ops
    names = [op.name for op in ops]
    if names != [op.name for op in two["reduced"].ops]:
        raise CaptureError("the step traces to different graphs at different batch sizes "
                           "(data-dependent structure cannot be captured)")
    reduced = one["reduced"]
    index = {name: i for i, name in enumerate(names)}
    phase = _phases(reduced, first.loss_op, first.optimizer_scope)

    producer, output, dtype, shape_text, bytes_ab, alias, persistent, swappable = [], [], [], [], [], [], [], []
    tensor_of: dict[tuple[str, int], int] = {}
    unknown = 0
    unresolved = [{"tensor": name, "reason": "a TensorList whose size nothing in the loop states"}
                  for name in one["unsized"]]
    for op in ops:
        for k, tensor in enumerate(op.outputs):
            small, large = one["shapes"][op.name][k], two["shapes"][op.name][k]
            _check_scaling(f"{op.name}:{k}", small, large, b1, b2)
            if small is None and tensor.dtype not in (tf.resource, tf.variant, tf.string):
                unknown += 1
                unresolved.append({"tensor": f"{op.name}:{k}", "reason": "unknown static shape"})
            tensor_of[(op.name, k)] = len(producer)
            producer.append(index[op.name])
            output.append(k)
            dtype.append(tensor.dtype.name)
            shape_text.append(_shape_text(small, large, b1, b2))
            bytes_ab.append(_linear_fit(one["bytes"][op.name][k], two["bytes"][op.name][k], b1, b2))
            is_input = op.type == "Placeholder"
            persistent.append(op.type == "ReadVariableOp" or is_input)
            swappable.append(tensor.dtype.name in SWAPPABLE_DTYPES and not is_input and op.type != "ReadVariableOp")
            alias.append(-1)
    # kernels' temporaries (rewriter.tf_effects.mixed_precision, rewriter.tf_effects.xla_scratch) and a loop iteration's
    # (rewriter.tf_effects.loops): an output nothing reads, live while the op runs
    scratch = []
    for op in ops:
        if one["scratch"][op.name] or two["scratch"][op.name]:
            scratch.append(op.name)
            producer.append(index[op.name])
            output.append(len(op.outputs))
            dtype.append("uint8")
            shape_text.append("(scratch)")
            bytes_ab.append(mixed_precision.scratch_fit(op, one["scratch"][op.name], two["scratch"][op.name], b1, b2))
            persistent.append(False)
            swappable.append(False)
            alias.append(-1)
    workspace = {}  # oneDNN's max pooling workspaces (rewriter.tf_effects.onednn): an output its gradient reads
    for op in ops:
        if one["workspace"][op.name] or two["workspace"][op.name]:
            workspace[op.name] = len(producer)
            producer.append(index[op.name])
            output.append(len(op.outputs))
            dtype.append(onednn.WORKSPACE_DTYPE)
            shape_text.append("(workspace)")
            bytes_ab.append(_linear_fit(one["workspace"][op.name], two["workspace"][op.name], b1, b2))
            persistent.append(False)
            swappable.append(False)
            alias.append(-1)
    held_tensor, held_read = [], []  # a write's old variable buffer, held by pending reads (variable_writes)
    for write, reads in variable_writes.held_reads(first.concrete.graph, set(names)).items():
        read_tensors = [tensor_of[(read, 0)] for read in reads if (read, 0) in tensor_of]
        if not read_tensors:
            continue
        held_tensor.extend([len(producer)] * len(read_tensors))
        held_read.extend(read_tensors)
        output.append(sum(p == index[write] for p in producer))
        producer.append(index[write])
        dtype.append("uint8")
        shape_text.append("(held variable buffer)")
        bytes_ab.append(max((bytes_ab[t] for t in read_tensors), key=lambda ab: ab[0] + ab[1] * b1))
        persistent.append(False)
        swappable.append(False)
        alias.append(-1)
    for op in ops:  # static aliases: input 0's buffer (resolved after all tensors are numbered)
        if op.type in ALIAS_TYPES and reduced.inputs[op.name] and reduced.inputs[op.name][0][0] == 0:
            _, src, k = reduced.inputs[op.name][0]
            alias[tensor_of[(op.name, 0)]] = tensor_of[(src, k)]
        for out, slot in loops.shared_inputs(op).items():  # a list a While loop passes through
            source = next(((src, k) for at, src, k in reduced.inputs[op.name] if at == slot), None)
            if source is not None:
                alias[tensor_of[(op.name, out)]] = tensor_of[source]
    if unresolved:
        log.warning("%d tensor(s) of unknown size are counted as 0 bytes: %s (graph.meta['unresolved_tensors'])",
                    len(unresolved), ", ".join(item["tensor"] for item in unresolved[:5]))

    edge_tensor, edge_consumer, edge_slot, control_src, control_dst = [], [], [], [], []
    for op in ops:
        for slot, src, k in reduced.inputs[op.name]:
            edge_tensor.append(tensor_of[(src, k)])
            edge_consumer.append(index[op.name])
            edge_slot.append(slot)
        for src in reduced.controls[op.name]:
            control_src.append(index[src])
            control_dst.append(index[op.name])
    for pool, grad in _pool_pairs(reduced):
        if pool in workspace:  # read after the gradient's own inputs
            edge_tensor.append(workspace[pool])
            edge_consumer.append(index[grad])
            edge_slot.append(1 + max(slot for slot, _, _ in reduced.inputs[grad]))

    resident = np.sum([_linear_fit(small, large, b1, b2) for small, large in zip(one["resident"], two["resident"])],
                      axis=0)
    variables_1, _, constants_1 = one["resident"]
    info = {"captured_batches": [b1, b2], "loss_op": first.loss_op, "tf_version": tf.__version__,
            "variable_bytes": variables_1, "constant_bytes": constants_1, "unknown_shapes": unknown, "inputs": first.input_names,
            "unresolved_tensors": unresolved, "unswappable": _unswappable(producer, dtype, bytes_ab, names, output, b1),
            "mixed_precision": _mixed_precision_facts(one, scratch, dtype),
            "pool_workspace_bytes": int(sum(one["workspace"].values())),
            "xla_scratch_bytes": int(sum(one["xla_scratch"].values())),
            "loop_working_set_bytes": int(sum(one["loop_scratch"].values())),
            "branch_working_set_bytes": int(sum(one["branch_scratch"].values())),
            # each op's name as any copy of the model traces it (rewriter.trace.op_names): plans carry it
            "canonical_names": {name: canonical(name, first.canonical) for name in names} if first.canonical else {}}
    info.update(meta or {})
    return OpGraph.build(
        op_name=names,
        op_type=[op.type for op in ops],
        op_phase=[phase[name] for name in names],
        op_flops_ab=[_linear_fit(one["flops"][n], two["flops"][n], b1, b2) for n in names],
        op_touched_bytes_ab=[_linear_fit(one["touched"][n], two["touched"][n], b1, b2) for n in names],
        op_forwards_input=[op.type in FORWARDING_TYPES or loops.forwards_inputs(op) for op in ops],
        tensor_producer=producer,
        tensor_output=output,
        tensor_dtype=dtype,
        tensor_shape=shape_text,
        tensor_bytes_ab=np.maximum(np.asarray(bytes_ab, dtype=np.float64), 0.0) if bytes_ab else np.zeros((0, 2)),
        tensor_alias_of=alias,
        tensor_persistent=persistent,
        tensor_swappable=swappable,
        edge_tensor=edge_tensor,
        edge_consumer=edge_consumer,
        edge_slot=edge_slot,
        control_src=control_src,
        control_dst=control_dst,
        persistent_bytes_ab=resident,
        outputs=[tensor_of[o] for o in reduced.outputs],
        held_tensor=held_tensor,
        held_read=held_read,
        batch_size=b1,
        meta=info,
    )


def _unswappable(producer, dtype, bytes_ab, names, output, batch: int) -> dict[str, Any]:
    """Memory no plan can move (While loops' TensorLists), at the first captured batch, for reports."""
    held = [{"tensor": f"{names[p]}:{k}", "bytes": int(round(a + b * batch))}
            for p, d, (a, b), k in zip(producer, dtype, bytes_ab, output) if d == "variant" and a + b * batch > 0]
    held.sort(key=lambda item: -item["bytes"])
    return {"bytes": sum(item["bytes"] for item in held), "batch": batch, "tensors": held,
            "reason": loops.UNSWAPPABLE_REASON if held else ""}


def _mixed_precision_facts(snapshot: dict[str, Any], scratch: list[str], dtype: list[str]) -> dict[str, Any]:
    """What float16 brings (empty without it): tensors, and the kernels' scratch buffers at the first batch."""
    if "float16" not in dtype:
        return {}
    sizes = [snapshot["scratch"][name] - snapshot["xla_scratch"][name] - snapshot["loop_scratch"][name]
             - snapshot["branch_scratch"][name] for name in scratch]
    return {"float16_tensors": dtype.count("float16"), "kernel_scratch_ops": sum(size > 0 for size in sizes),
            "largest_kernel_scratch_bytes": max(sizes, default=0),
            "eigen_half_kernels": mixed_precision.eigen_half_kernels()}


def _shape_text(small, large, b1: int = 1, b2: int = 2) -> str:
    """``N`` marks a dimension that is the batch (``b1`` samples in ``small``, ``b2`` in ``large``); one that
    grows otherwise is ``N*k`` (``k`` rows a sample: a batch flattened with other axes, whose rows
    ``simulator.split.sample_major`` tells blocks of samples or not) or ``N?``."""
    if small is None:
        return "?"
    if large is None:
        large = small

    def dim(s: int, l: int) -> str:
        if s == l:
            return str(s)
        if (s, l) == (b1, b2):
            return "N"
        return f"N*{s // b1}" if s % b1 == 0 and l == s // b1 * b2 else "N?"

    return "(" + ",".join(dim(s, l) for s, l in zip(small, large)) + ")"


def _second_batch(batch_size: int) -> int:
    return batch_size * 2 if batch_size > 1 else 2


def capture(model, batch_size: int, inputs: StepInputs = NO_STEP_INPUTS, *, name: str | None = None,
            graph_rewrites: Sequence[str] = ()) -> OpGraph:
    """Capture a compiled Keras 3 model's training step (loss and optimizer from ``model.compile``).

    ``inputs``: ``StepInputs(input_shapes=...)`` (without the batch) where the model leaves dimensions
    open; its ``label_shapes``/``label_dtype`` override the labels inferred from the outputs and the loss.
    ``graph_rewrites`` (``rewriter.trace.graph_rewrites.REWRITES``): exact rewrites applied to the step
    first; those that changed something are in ``meta["graph_rewrites"]``, and plans made on the
    graph carry them to ``rewriter.step.apply_plan``.
    """
    if batch_size is None or int(batch_size) < 1:
        raise CaptureError(f"batch size must be a positive integer, got {batch_size!r}")
    first = trace_keras_step(model, int(batch_size), inputs)
    second = trace_keras_step(model, _second_batch(int(batch_size)), inputs)
    meta = {"model": name or getattr(model, "name", "model"), "optimizer": type(model.optimizer).__name__,
            "training": describe_training(model),
            "variables": state_kinds.describe_variables(first.concrete, model),
            "movable_state": describe_movable_state(first.concrete, model, first.optimizer_scope)}
    if inputs.to_dict():  # plans made on the graph are applied at these shapes
        meta["step_inputs"] = inputs.to_dict()
    first, second, meta = with_rewrites(first, second, graph_rewrites, meta)
    return build_opgraph(first, second, meta=meta)


def capture_step(step_fn: Callable, specs_at: Callable[[int], Sequence[tf.TensorSpec]], batch_size: int, *,
                 optimizer=None, name: str = "step", graph_rewrites: Sequence[str] = ()) -> OpGraph:
    """Capture a hand-written step: ``step_fn(*inputs)`` returns its loss; ``specs_at(batch)`` gives
    the TensorSpecs of its inputs at a batch size; ``optimizer`` (optional) names the update scope;
    ``graph_rewrites`` as for ``capture``."""
    first = trace_function_step(step_fn, specs_at, int(batch_size), optimizer=optimizer)
    second = trace_function_step(step_fn, specs_at, _second_batch(int(batch_size)), optimizer=optimizer)
    meta = {"model": name, "variables": state_kinds.describe_variables(first.concrete)}
    first, second, meta = with_rewrites(first, second, graph_rewrites, meta)
    return build_opgraph(first, second, meta=meta)


def with_rewrites(first, second, rewrites: Sequence[str], meta: dict, rewrite: Callable = rewritten_step):
    """Both traces rewritten by ``rewrite`` (``rewritten_step``, or a replicated step's ``rewritten_trace``); the
    rewrites that changed something recorded in ``meta``."""
    if not rewrites:
        return first, second, meta
    try:
        first, changed = rewrite(first, rewrites)
        second, _ = rewrite(second, rewrites)
    except ValueError as error:  # an unknown rewrite name
        raise CaptureError(str(error)) from None
    done = [r for r in rewrites if changed.get(r)]
    if done:
        meta = dict(meta, graph_rewrites=done, graph_rewrite_changes={r: changed[r] for r in done})
    return first, second, meta
