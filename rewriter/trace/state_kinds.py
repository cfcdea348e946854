"""What each variable a captured step holds is: the split of its resident bytes into weights,
model state, optimizer slots, gradient accumulators and scalars (``simulator.buffers.resident_split_bytes``).

Variables are the step's captured resource handles; a Keras model names them: its trainable
variables are the weights, its other variables model state (BatchNorm's moving statistics), the
optimizer's gradient accumulators (``gradient_accumulation_steps``), its scalars (the step count,
the learning rate) and its slots (Adam's moments, SGD's momentum), and the metrics' variables.
"""

from __future__ import annotations

from typing import Any, Collection

import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.python.ops import handle_data_util

from rewriter.trace.costs import tensor_nbytes

WEIGHTS, MODEL_STATE, SLOTS, ACCUMULATORS, SCALARS, METRICS, VARIABLE = (
    "weights", "model state", "optimizer slots", "gradient accumulators", "optimizer scalars", "metrics", "variable")


def variable_sizes(concrete) -> dict[str, int]:
    """Bytes per captured variable handle (the handle's op name), from the ops that read or write it."""
    graph = concrete.graph
    handles = {t.op.name for _, t in graph.captures if t.dtype == tf.resource}
    size: dict[str, int] = {}
    for op in graph.get_operations():
        if not op.inputs or op.inputs[0].op.name not in handles:
            continue
        handle = op.inputs[0].op.name
        if op.type == "ReadVariableOp":
            size[handle] = max(size.get(handle, 0), tensor_nbytes(op.outputs[0]))
        elif op.type.startswith("Assign") and len(op.inputs) > 1:
            size[handle] = max(size.get(handle, 0), tensor_nbytes(op.inputs[1]))
    for _, internal in graph.captures:  # read only inside a branch or loop (a LossScaleOptimizer's
        if internal.dtype == tf.resource and internal.op.name not in size:  # update under tf.cond)
            size[internal.op.name] = _handle_bytes(internal)
    return size


def _handle_bytes(handle) -> int:
    """Bytes of the variable behind a resource handle, from the shape and dtype it carries (0 if none)."""
    try:
        data = handle_data_util.get_resource_handle_data(handle)
    except (AssertionError, AttributeError, TypeError, ValueError):
        return 0
    total = 0
    for item in data.shape_and_type:
        shape = tf.TensorShape(item.shape)
        if shape.is_fully_defined() and item.dtype not in (types_pb2.DT_RESOURCE, types_pb2.DT_VARIANT):
            total += shape.num_elements() * tf.as_dtype(item.dtype).size
    return total


def keras_kinds(model) -> dict[int, tuple[str, str]]:
    """id of a variable's resource handle -> (its path, its kind), for a compiled Keras model."""
    optimizer = model.optimizer
    accumulators = {id(v) for v in getattr(optimizer, "_accumulated_gradients", None) or []}
    groups = [(model.trainable_variables, WEIGHTS), (model.non_trainable_variables, MODEL_STATE),
              (getattr(model, "metrics_variables", []), METRICS)]
    found: dict[int, tuple[str, str]] = {}
    for variable in optimizer.variables:
        kind = ACCUMULATORS if id(variable) in accumulators else SCALARS if len(variable.shape) == 0 else SLOTS
        found.setdefault(_handle_id(variable), (variable.path, kind))
    for variables, kind in groups:
        for variable in variables:
            found.setdefault(_handle_id(variable), (variable.path, kind))
    return found


def _handle_id(variable) -> int:
    value = getattr(variable, "value", variable)  # a Keras variable wraps a tf.Variable
    return id(getattr(value, "handle", value))


def model_variables(model) -> list:
    """Every variable of a compiled Keras model: weights, optimizer state, metrics (each once)."""
    seen: dict[int, Any] = {}
    for variable in (list(model.variables) + list(model.optimizer.variables)
                     + list(getattr(model, "metrics_variables", []))):
        seen.setdefault(id(variable), variable)
    return list(seen.values())


def describe_variables(concrete, model=None, *, only: Collection[str] | None = None) -> list[dict]:
    """One entry per variable the step captures: ``{"variable", "kind", "bytes"}`` (for ``graph.meta``);
    without a Keras model every kind is ``"variable"``. ``only``: the handles (op names) of one replica's
    variables, for a replicated step (``rewriter.trace.replicas``)."""
    sizes = variable_sizes(concrete)
    if only is not None:
        sizes = {name: size for name, size in sizes.items() if name in only}
    kinds = keras_kinds(model) if model is not None else {}
    described = []
    for external, internal in concrete.graph.captures:
        if internal.dtype != tf.resource or internal.op.name not in sizes:
            continue
        name, kind = kinds.get(id(external), (internal.op.name, VARIABLE))
        described.append({"variable": name, "kind": kind, "bytes": int(sizes[internal.op.name])})
    return described
