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

What the step holds around a loop, as the profiler's trace of the zoo's LSTM and GRU classifiers
shows it at their peak (the gradient loop's first iteration):

* A loop carries each variable in one buffer: the output of a dense loop variable (the gradient
  loop's weight-gradient sums, started from ``zeros``) takes the place of its input when the loop
  reads that input last, as an op writes into an input it is the last to read (``forwards_inputs``).
  Counted apart, the gradient loop's sums were counted twice (the LSTM: 0.4 MiB).
* ``ZerosLike`` of a list (the gradient of the input sequence, started from zeros) makes one zero
  tensor per element: as many bytes as the list (``list_bytes``; 0.25 MiB in the LSTM, counted 0 before).
* The forward loop's list of the input sequence's elements (its ``TensorListGetItem`` values, kept for
  the gradient of the input weights) holds the buffers of the sequence's list, which the loop passes
  through: it shares that list's buffer, so the sequence lives until the gradient loop has popped them.
* One iteration's own temporaries (a weight gradient's product before it is added to its sum: 0.25
  MiB in the LSTM, the concatenated gate gradients, ...) are live while the loop runs:
  ``body_working_set_bytes`` replays the body's ops in order with the buffer rules of the top-level
  graph (aliases, forwarding into an input read last, loop variables and popped or read list elements
  already counted, pushed elements counted in their list); ``capture`` adds it as the loop's scratch.

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

from rewriter.tf_effects.passthrough import BROADCASTING_BINARY

WHILE_TYPES = frozenset({"While", "StatelessWhile"})
# Keras' TF backend passes parallel_iterations=32; one makes the loop's memory independent of timing
PARALLEL_ITERATIONS = 1
PASS_THROUGH_TYPES = frozenset({"Identity", "IdentityN", "StopGradient", "Snapshot"})
LIST_SOURCE_TYPES = frozenset({"TensorListFromTensor"})  # lists that copy a dense tensor in
LIST_READ_TYPES = frozenset({"TensorListGetItem", "TensorListPopBack"})  # dense outputs: a list's own element
LIST_WRITE_SLOTS = {"TensorListPushBack": 1, "TensorListSetItem": 2}  # the element a list keeps
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


def _shared_input(op, k: int, body) -> int | None:
    """The input of While ``op`` whose buffer its list output ``k`` holds: the same list passed
    through unchanged, or the elements read from a list the loop passes through (an accumulator of
    ``TensorListGetItem`` values); None otherwise."""
    if body is None or k >= len(body.outputs) or k >= len(body.inputs):
        return None
    produced = _origin(body.outputs[k])
    if produced is body.inputs[k]:
        return k
    if produced.op.type != "TensorListPushBack":
        return None
    element = _origin(produced.op.inputs[1])
    if element.op.type != "TensorListGetItem":
        return None
    read = _origin(element.op.inputs[0])
    for j, placeholder in enumerate(body.inputs[: len(body.outputs)]):
        if read is placeholder and _origin(body.outputs[j]) is placeholder:
            return j
    return None


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
    shared = _shared_input(op, k, body)
    if shared == k:
        return LoopOutput(0, shares_input=k, kind="passed through")
    if shared is not None:
        return LoopOutput(0, shares_input=shared, kind="elements of a list it reads")
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


def list_bytes(tensor, nbytes: Callable[[Any], int]) -> int | None:
    """Bytes a list tensor of the step's top-level graph holds (None: not known): a copied-in
    tensor's, a loop output's (through the lists a loop passes on), or its zeros' (``ZerosLike``)."""
    tensor = _origin(tensor)
    op = tensor.op
    if op.type in LIST_SOURCE_TYPES:
        return nbytes(op.inputs[0])
    if op.type in ("TensorListReserve", "EmptyTensorList"):
        return 0  # no element yet
    if op.type == "ZerosLike" and op.inputs:
        return list_bytes(op.inputs[0], nbytes)
    if op.type in WHILE_TYPES:
        output = while_outputs(op, nbytes)[tensor.value_index]
        if output.shares_input is not None:
            return list_bytes(op.inputs[output.shares_input], nbytes)
        return output.nbytes
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
    if op.type == "ZerosLike" and op.inputs and op.inputs[0].dtype == tf.variant:  # one zero tensor per element
        held = list_bytes(op.inputs[0], nbytes)
        return [held or 0], [] if held is not None else [f"{op.name}:0"]
    return [nbytes(t) for t in op.outputs], []


def shared_inputs(op) -> dict[int, int]:
    """Output index -> input index for the lists a While op passes through unchanged, or whose
    elements it keeps (``_shared_input``)."""
    if op.type not in WHILE_TYPES:
        return {}
    body = _body_graph(op)
    shared = {}
    for k, tensor in enumerate(op.outputs):
        if tensor.dtype == tf.variant and (j := _shared_input(op, k, body)) is not None:
            shared[k] = j
    return shared


def forwards_inputs(op) -> bool:
    """Whether ``op``'s outputs may take the buffers of inputs it reads last (``OpGraph.op_forwards_input``):
    a While loop's, whose variables replace their starting values (module docstring)."""
    return op.type in WHILE_TYPES


def _readiness_order(body, constant: frozenset[str] = frozenset()) -> list:
    """The body's ops in the order an executor runs them when each op's newly ready readers run next
    (TensorFlow's executor runs them inline, depth first): Kahn's algorithm with a stack. Ops of
    ``constant`` (folded by Grappler into constants that exist before the body runs) keep no reader waiting."""
    ops = body.get_operations()
    index = {inner.name: i for i, inner in enumerate(ops)}
    waiting = [0] * len(ops)
    readers: list[list[int]] = [[] for _ in ops]
    for i, inner in enumerate(ops):
        parents = {index[t.op.name] for t in inner.inputs if t.op.name in index and t.op.name not in constant}
        parents |= {index[c.name] for c in inner.control_inputs if c.name in index}
        waiting[i] = len(parents)
        for parent in parents:
            readers[parent].append(i)
    stack = [i for i in reversed(range(len(ops))) if waiting[i] == 0]
    order = []
    while stack:
        i = stack.pop()
        order.append(ops[i])
        ready = []
        for reader in readers[i]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
        stack.extend(sorted(ready, reverse=True))
    return order if len(order) == len(ops) else ops


def body_working_set_bytes(op, nbytes: Callable[[Any], int], *, forwarding: frozenset[str],
                           aliasing: frozenset[str]) -> int:
    """The most bytes one iteration of While ``op``'s body holds at once beyond what the loop's inputs
    and outputs count (``graph_working_set_bytes`` of its body); 0 for other ops."""
    body = _body_graph(op) if op.type in WHILE_TYPES else None
    if body is None:
        return 0
    counted = {body.inputs[k].name for k, t in enumerate(op.inputs)
               if k < len(body.inputs) and t.dtype == tf.variant and (list_bytes(t, nbytes) or 0) > 0}
    return graph_working_set_bytes(body, counted, nbytes, forwarding=forwarding, aliasing=aliasing)


def _sized_by_readers(ops: list, nbytes: Callable[[Any], int]) -> Callable[[Any], int]:
    """``nbytes`` where a tensor of unknown shape (0 bytes) is an operand of an elementwise op whose output's size
    is known: that size, the most a broadcast operand can hold (an optimizer's ``UnsortedSegmentSum`` of an
    embedding's gradient, its segment count read from a shape at run time, then subtracted from a slot)."""
    inferred: dict[str, int] = {}
    for inner in ops:
        if inner.type in BROADCASTING_BINARY and inner.outputs and nbytes(inner.outputs[0]) > 0:
            for tensor in inner.inputs:
                if tensor.dtype == inner.outputs[0].dtype and nbytes(tensor) == 0:
                    inferred[tensor.name] = max(inferred.get(tensor.name, 0), nbytes(inner.outputs[0]))
    return lambda tensor: inferred.get(tensor.name) or nbytes(tensor)


def graph_working_set_bytes(body, counted: set[str], nbytes: Callable[[Any], int], *, forwarding: frozenset[str],
                            aliasing: frozenset[str], constant: frozenset[str] = frozenset(),
                            nested: Callable[[Any], int] | None = None) -> int:
    """The most bytes a function body (a loop's, a conditional's branch) holds at once beyond its inputs
    and outputs: its ops replayed in the executor's order (``_readiness_order``), each output live
    from its op to its last reader in the body (a body output to the body's end). ``aliasing`` ops
    share their input's buffer and ``forwarding`` ops write into an input buffer of the same size they
    read last (a loop variable's too, which costs nothing here); a variable read shares the variable's
    buffer. Elements read from a list are the list's (and stay in it); elements pushed into one are
    counted in it; an element popped from a list of ``counted`` (the body's list inputs the caller
    counts) is freed after its last reader (the lists are counted whole until the loop ends, so the
    first iteration, where the peak is, holds one element less). ``constant``: ops whose outputs are
    constants Grappler folds (resident, counted by the caller); a variable assigned one of them shares
    its buffer and frees its own from then on (an accumulator's reset to zeros). ``nested``: what an op of the
    body holds beyond its inputs and outputs while it runs (a conditional's own branches), live at its position."""
    ops = _readiness_order(body, constant)
    nbytes = _sized_by_readers(ops, nbytes)
    end = len(ops)
    last_read: dict[str, int] = {}
    for i, inner in enumerate(ops):
        for tensor in inner.inputs:
            last_read[tensor.name] = i
    for tensor in body.outputs:
        last_read[tensor.name] = end
    root: dict[str, str] = {}  # tensor -> the tensor owning its buffer
    size: dict[str, int] = {}  # owner -> bytes this iteration allocates for it (0: counted elsewhere,
    # negative: a counted list element this iteration frees)
    start: dict[str, int] = {}
    stop: dict[str, int] = {}  # owner -> last position a tensor in its buffer is read
    locked: set[str] = set()  # owners no op may write into (constants, elements a list still holds)
    variable_reads: dict[str, list[Any]] = {}  # a variable's handle -> its reads so far

    def own(tensor, at: int, nbytes_: int, *, writable: bool = True) -> None:
        root[tensor.name], size[tensor.name], start[tensor.name] = tensor.name, nbytes_, at
        stop[tensor.name] = max(at, last_read.get(tensor.name, at))
        if not writable:
            locked.add(tensor.name)

    def join(tensor, owner: str) -> None:
        root[tensor.name] = owner
        stop[owner] = max(stop[owner], last_read.get(tensor.name, -1))

    for i, inner in enumerate(ops):
        kind = inner.type
        inside = nested(inner) if nested is not None else 0
        if inside > 0:
            size[f"{inner.name}/nested"], start[f"{inner.name}/nested"], stop[f"{inner.name}/nested"] = inside, i, i
        sources = [root.get(t.name) for t in inner.inputs]
        names = [t.name for t in inner.inputs]
        if kind == "ReadVariableOp" and inner.inputs:
            variable_reads.setdefault(inner.inputs[0].name, []).append(inner.outputs[0])
        if kind == "AssignVariableOp" and len(inner.inputs) > 1 and inner.inputs[1].op.name in constant:
            # a variable reset from a constant takes the constant's buffer and frees its own once the
            # reads before it are read
            held = [last_read.get(t.name, i) for t in variable_reads.get(inner.inputs[0].name, [])]
            size[inner.name], start[inner.name] = -nbytes(inner.inputs[1]), i
            stop[inner.name] = max([i] + held)
        written = LIST_WRITE_SLOTS.get(kind, len(sources))
        if written < len(sources) and sources[written] is not None:
            size[sources[written]] = 0  # kept by the list: counted in the loop's output
            locked.add(sources[written])
        for k, tensor in enumerate(inner.outputs):
            if kind in ("Placeholder", "Const", "ReadVariableOp") or inner.name in constant:
                own(tensor, i, 0, writable=kind == "Placeholder")
            elif kind in LIST_READ_TYPES and tensor.dtype != tf.variant:
                popped = kind == "TensorListPopBack" and _origin(inner.inputs[0]).name in counted
                own(tensor, i, -nbytes(tensor) if popped else 0, writable=popped)
            elif kind in aliasing | PASS_THROUGH_TYPES and inner.inputs and sources[0 if kind != "IdentityN" else k]:
                join(tensor, sources[0 if kind != "IdentityN" else k])
            else:
                owner = None
                if kind in forwarding:
                    owner = next((r for t, r in zip(inner.inputs, sources)
                                  if r is not None and r not in locked and stop[r] <= i and t.dtype == tensor.dtype
                                  and nbytes(t) == nbytes(tensor) and names.count(t.name) == 1), None)
                if owner is not None:
                    join(tensor, owner)
                else:
                    own(tensor, i, nbytes(tensor))
    delta = [0] * (end + 2)
    for owner, nbytes_ in size.items():
        if nbytes_ > 0:
            delta[start[owner]] += nbytes_
            delta[stop[owner] + 1] -= nbytes_
        elif nbytes_ < 0:  # a popped element: freed after its last reader, for the rest of the iteration
            delta[stop[owner] + 1] += nbytes_
    peak = live = 0
    for change in delta:
        live += change
        peak = max(peak, live)
    return int(peak)
