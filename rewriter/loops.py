"""While loops in a captured step (Keras' recurrent layers): their memory, and running them predictably.

A ``While`` op is one node of the step's graph, but its outputs are not what their static shapes
say: a recurrent layer's forward loop returns ``TensorList`` handles (dtype ``variant``, shape
``()``) that hold, per iteration, every intermediate its gradient needs (``TensorListPushBack``
in the loop body), and the output sequence (``TensorListSetItem``); the gradient loop pops them
(``TensorListPopBack``) and fills the input sequence's gradient. Counted by their static shape,
those lists are 0 bytes: the LSTM classifier of ``benchmarks.zoo`` measured 7.2 MiB against 3.5
predicted. Here each list output is sized as the trip count times its element's bytes (the
element's static shape in the body graph; an element that is a variable read shares the
variable's buffer and counts 0), or from the ``TensorListStack`` that reads it, and a list the
body passes through unchanged shares its input's buffer.

Keras runs its loops with ``parallel_iterations=32``: iterations whose data do not depend on each
other (the weight-gradient products of the backward loop) run ahead and hold their temporaries at
once, so the peak depends on thread timing (the same LSTM step measured 11.9-17.0 MiB over five
steps). ``serialize_loops`` sets ``parallel_iterations=1`` on the traced step's loops, as the
rewriter serializes the rest of the step: what runs is what was predicted (7.22-7.23 MiB).

None of a loop's lists can be swapped by a top-level rewrite (a copy of a ``variant`` handle does
not move the tensors it holds; TensorFlow's own ``swap_memory`` does that for GPU loops):
``unswappable`` lists them, with their bytes and why, for ``graph.meta["unswappable"]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import tensor_util

WHILE_TYPES = frozenset({"While", "StatelessWhile"})
# Keras' TF backend passes parallel_iterations=32; one makes the loop's memory independent of timing
PARALLEL_ITERATIONS = 1
PASS_THROUGH_TYPES = frozenset({"Identity", "IdentityN", "StopGradient", "Snapshot"})
LIST_SOURCE_TYPES = frozenset({"TensorListFromTensor"})  # lists that copy a dense tensor in
UNSWAPPABLE_REASON = ("held in a While loop's TensorList (the per-iteration values its gradient reads back): a "
                      "top-level copy of the list's variant handle does not move the tensors it holds, and the "
                      "loop's own ops are not in the step's top-level graph")


@dataclass(frozen=True)
class LoopOutput:
    """What one output of a While op holds: ``nbytes`` (None: not known), ``shares_input`` (the loop
    input whose buffer it is, passed through unchanged; None otherwise), ``kind`` for the report."""

    nbytes: int | None
    shares_input: int | None = None
    kind: str = "dense"


def serialize_loops(graph) -> int:
    """Set ``parallel_iterations`` to ``PARALLEL_ITERATIONS`` on every While op of a traced step's
    FuncGraph (before its GraphDef is taken); returns how many were changed."""
    changed = 0
    for op in graph.get_operations():
        if op.type in WHILE_TYPES and op.get_attr("parallel_iterations") != PARALLEL_ITERATIONS:
            op._set_attr("parallel_iterations", attr_value_pb2.AttrValue(i=PARALLEL_ITERATIONS))
            changed += 1
    return changed


def _origin(tensor):
    while tensor.op.type in PASS_THROUGH_TYPES and tensor.op.inputs:
        tensor = tensor.op.inputs[tensor.value_index if tensor.op.type == "IdentityN" else 0]
    return tensor


def _static_int(tensor) -> int | None:
    value = tensor_util.constant_value(tensor)
    if value is None or getattr(value, "ndim", 1) != 0:
        return None
    return int(value)


def trip_count(op) -> int | None:
    """Iterations of a While op: the length of the sequence it reads (a ``TensorListFromTensor``
    input's leading dimension) or of a reserved list it fills, else its ``maximum_iterations``
    input when that is a constant; a gradient loop runs as often as the forward loop whose counter
    it reads. (Keras passes ``maximum_iterations`` as a ``Max`` that constant folding gets wrong.)"""
    if len(op.inputs) > 2 and _origin(op.inputs[2]).op.type in WHILE_TYPES:  # a gradient loop
        forward = _origin(op.inputs[2]).op
        if forward is not op:
            return trip_count(forward)
    for tensor in op.inputs:
        source = _origin(tensor).op
        if source.type in LIST_SOURCE_TYPES:
            dims = source.inputs[0].shape
            if dims.rank and dims[0] is not None:
                return int(dims[0])
    for tensor in op.inputs:
        reserved = _reserved(tensor)
        if reserved is not None:
            return reserved
    if len(op.inputs) > 1 and _origin(op.inputs[1]).op.type == "Const":
        limit = _static_int(op.inputs[1])
        if limit is not None and limit >= 0:
            return limit
    return None


def _reserved(tensor) -> int | None:
    """Elements of a list made by ``TensorListReserve`` with a static count (None otherwise)."""
    source = _origin(tensor).op
    if source.type != "TensorListReserve":
        return None
    reserved = _static_int(source.inputs[1])
    return reserved if reserved is not None and reserved >= 0 else None


def _list_length(tensor) -> int | None:
    """Elements of a list made outside the loop: reserved, or copied from a tensor's leading dimension."""
    source = _origin(tensor).op
    if source.type in LIST_SOURCE_TYPES:
        dims = source.inputs[0].shape
        return int(dims[0]) if dims.rank and dims[0] is not None else None
    return _reserved(tensor)


def _body_graph(op):
    return getattr(op, "_body_graph", None)


def _element_bytes(element, nbytes: Callable[[Any], int]) -> int:
    """Bytes one list element adds: 0 for a variable read (the list holds the variable's buffer)."""
    source = _origin(element).op
    if source.type == "ReadVariableOp":
        return 0
    return nbytes(element)


def while_outputs(op, nbytes: Callable[[Any], int]) -> list[LoopOutput]:
    """What each output of While op ``op`` holds (dense outputs: their static size)."""
    body = _body_graph(op)
    trips = trip_count(op)
    consumers_bytes = _stacked_bytes(op, nbytes)
    result = []
    for k, tensor in enumerate(op.outputs):
        if tensor.dtype != tf.variant:
            result.append(LoopOutput(nbytes(tensor)))
            continue
        result.append(_list_output(op, k, body, trips, consumers_bytes.get(k), nbytes))
    return result


def _stacked_bytes(op, nbytes) -> dict[int, int]:
    """Bytes of list outputs read by a ``TensorListStack`` with a static shape (what the list holds)."""
    found: dict[int, int] = {}
    for k, tensor in enumerate(op.outputs):
        if tensor.dtype != tf.variant:
            continue
        readers, seen = list(tensor.consumers()), set()
        while readers:
            consumer = readers.pop()
            if consumer.name in seen:
                continue
            seen.add(consumer.name)
            if consumer.type in PASS_THROUGH_TYPES:
                readers.extend(c for out in consumer.outputs for c in out.consumers())
            elif consumer.type == "TensorListStack" and consumer.outputs[0].shape.is_fully_defined():
                found[k] = max(found.get(k, 0), nbytes(consumer.outputs[0]))
    return found


def _list_output(op, k: int, body, trips: int | None, stacked: int | None, nbytes) -> LoopOutput:
    if body is None or k >= len(body.outputs):
        return LoopOutput(stacked, kind="list")
    produced = _origin(body.outputs[k])
    source = produced.op
    if source.type == "Placeholder" and k < len(body.inputs) and produced is body.inputs[k]:
        return LoopOutput(0, shares_input=k, kind="passed through")
    if source.type == "TensorListPopBack":
        return LoopOutput(0, kind="popped")  # emptied by the loop: its buffers were the forward loop's
    element, count = None, trips
    if source.type == "TensorListPushBack":
        element = source.inputs[1]
    elif source.type == "TensorListSetItem":  # a reserved list: as many elements as it was given
        element = source.inputs[2]
        reserved = _list_length(op.inputs[k]) if k < len(op.inputs) else None
        count = reserved if reserved is not None and (trips is None or reserved < trips) else trips
    if element is not None and count is not None and element.shape.is_fully_defined():
        return LoopOutput(count * _element_bytes(element, nbytes), kind="accumulator")
    return LoopOutput(stacked, kind="list")


def list_source_bytes(op, nbytes: Callable[[Any], int]) -> list[int] | None:
    """Output bytes of a list op outside a loop that copies a dense tensor in (None: not one)."""
    if op.type in LIST_SOURCE_TYPES:
        return [nbytes(op.inputs[0])]
    return None


def output_bytes(op, nbytes: Callable[[Any], int]) -> tuple[list[int], list[str]]:
    """Bytes of every output of ``op`` with loops and lists resolved, and the names of outputs whose
    size stays unknown (variant lists nothing sizes)."""
    if op.type in WHILE_TYPES:
        outputs = while_outputs(op, nbytes)
        unknown = [f"{op.name}:{k}" for k, o in enumerate(outputs) if o.nbytes is None]
        return [o.nbytes or 0 for o in outputs], unknown
    copied = list_source_bytes(op, nbytes)
    if copied is not None:
        return copied, []
    return [nbytes(t) for t in op.outputs], []


def shared_inputs(op) -> dict[int, int]:
    """Output index -> input index for the lists a While op passes through unchanged."""
    if op.type not in WHILE_TYPES:
        return {}
    body = _body_graph(op)
    if body is None:
        return {}
    shared = {}
    for k, tensor in enumerate(op.outputs):
        if tensor.dtype == tf.variant and k < len(body.outputs) and k < len(body.inputs):
            if _origin(body.outputs[k]) is body.inputs[k]:
                shared[k] = k
    return shared
