"""Which tensors share a device buffer: aliases, and inputs an op writes its output into.

TF does not give every tensor its own memory: Identity/Reshape-like ops alias their input, and ops
such as Relu, AddN or BiasAdd write into an input buffer they are the last to read (decided in
execution order). A write to a variable that a read still pending holds keeps the variable's old
buffer beside the new one (``OpGraph.held_tensor``). This is the first half of the buffer analysis (``simulator.buffers``), apart
because the memory-aware execution order (``simulator.ordering``) needs it in level order, before
any other order exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.graph import Analysis, OpGraph, alias_roots, level_order, slots_of


@dataclass(frozen=True)
class Sharing:
    """Per tensor: ``root`` (the tensor owning its buffer), ``persistent`` (resident memory),
    ``parent`` (the tensor whose buffer it joined, -1: owns one) and ``link_op`` (the op that made it
    join: its producer); per root: ``buffer_last`` (last slot that uses the buffer). ``late``:
    (slot, input tensor, output) forwards that only a later read of the input prevents, one entry per
    such input, in input order (consecutive per output: the first a plan makes possible is taken, as
    TF's kernels try their inputs in order; ``kernel_memory.account``)."""

    root: np.ndarray
    persistent: np.ndarray  # resident, or a held variable buffer no pending read holds (no buffer of its own)
    parent: np.ndarray
    link_op: np.ndarray
    buffer_last: np.ndarray
    late: list[tuple[int, int, int]]


def share_buffers(g: OpGraph, position: np.ndarray) -> Sharing:
    """Buffer sharing of ``g`` run in the order whose slot of each op is ``position``."""
    n_ops, n_tensors = g.n_ops, g.n_tensors
    parent = g.tensor_alias_of.copy()  # the tensor whose buffer a tensor joins (-1: owns one)
    link_op = np.where(parent >= 0, g.tensor_producer, -1)
    root = alias_roots(g)
    persistent = g.tensor_persistent | g.tensor_persistent[root]

    end_slot = n_ops - 1
    last_read = np.full(n_tensors, -1, dtype=np.int64)
    np.maximum.at(last_read, g.edge_tensor, position[g.edge_consumer])
    last_read[g.outputs] = end_slot
    produced = position[g.tensor_producer]
    buffer_last = np.full(n_tensors, -1, dtype=np.int64)
    np.maximum.at(buffer_last, root, np.maximum(last_read, produced))

    # Buffer forwarding, decided in execution order: op k reuses the buffer of an input it is the
    # last to read when sizes and dtypes match (TF's forward_input_or_allocate_output).
    forwarding = np.flatnonzero(g.op_forwards_input)
    late: list[tuple[int, int, int]] = []  # (slot, input tensor, output) blocked only by a later read
    if len(forwarding):
        root_list, last_list = root.tolist(), buffer_last.tolist()
        parent_list, link_list = parent.tolist(), link_op.tolist()
        owns = (g.tensor_alias_of < 0) & ~persistent
        outputs_of: dict[int, list[int]] = {}
        for tensor in np.flatnonzero(owns & g.op_forwards_input[g.tensor_producer]).tolist():
            outputs_of.setdefault(int(g.tensor_producer[tensor]), []).append(tensor)
        by_consumer = np.argsort(g.edge_consumer, kind="stable")
        inputs_sorted, consumer_sorted = g.edge_tensor[by_consumer], g.edge_consumer[by_consumer]
        starts = np.searchsorted(consumer_sorted, forwarding, side="left")
        stops = np.searchsorted(consumer_sorted, forwarding, side="right")
        inputs_of = {int(op): inputs_sorted[a:b].tolist() for op, a, b in zip(forwarding, starts, stops)}
        bytes_ab = [tuple(row) for row in g.tensor_bytes_ab.tolist()]
        dtype = g.tensor_dtype.tolist()
        is_output = np.zeros(n_tensors, bool)
        is_output[g.outputs] = True
        persistent_list = persistent.tolist()

        def find(tensor: int) -> int:
            while root_list[tensor] != tensor:
                root_list[tensor] = root_list[root_list[tensor]]
                tensor = root_list[tensor]
            return tensor

        for op in sorted(outputs_of, key=lambda o: position[o]):
            slot = int(position[op])
            inputs = inputs_of.get(op, [])
            for out in outputs_of[op]:
                blocked_by_later_read = []  # in input order: TF tries them in that order
                for source in inputs:
                    owner = find(source)
                    if (persistent_list[owner] or is_output[owner] or bytes_ab[owner] != bytes_ab[out]
                            or dtype[owner] != dtype[out] or inputs.count(source) > 1):
                        continue
                    if last_list[owner] != slot:  # a later op still reads the buffer
                        blocked_by_later_read.append(source)
                        continue
                    root_list[out] = owner
                    parent_list[out], link_list[out] = source, op
                    last_list[owner] = max(last_list[owner], last_list[out])
                    break
                else:
                    late.extend((slot, source, out) for source in blocked_by_later_read)
        root = np.asarray([find(t) for t in range(n_tensors)], dtype=np.int64)
        buffer_last = np.asarray(last_list, dtype=np.int64)
        parent, link_op = np.asarray(parent_list, dtype=np.int64), np.asarray(link_list, dtype=np.int64)
    persistent, buffer_last = _held_variable_buffers(g, position, root, persistent, buffer_last)
    return Sharing(root=root, persistent=persistent, parent=parent, link_op=link_op, buffer_last=buffer_last,
                   late=late)


def _held_variable_buffers(g: OpGraph, position: np.ndarray, root: np.ndarray, persistent: np.ndarray,
                           buffer_last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A variable write's old buffer (``OpGraph.held_tensor``) lives from the write to the last reader of
    the reads it pairs with, when one reads after the write: TensorFlow's update ops copy a variable
    whose buffer another tensor still references (a forward read a backward MatMul has not run yet)
    and ``AssignVariableOp`` leaves the old buffer to its readers. Otherwise the write is in place
    and its held tensor owns no buffer (marked persistent: resident memory counts it already)."""
    if not len(g.held_tensor):
        return persistent, buffer_last
    read_last = np.full(g.n_tensors, -1, dtype=np.int64)
    np.maximum.at(read_last, g.held_tensor, buffer_last[root[g.held_read]])
    holders = np.unique(g.held_tensor)
    written = position[g.tensor_producer[holders]]
    held = read_last[holders] > written
    persistent, buffer_last = persistent.copy(), buffer_last.copy()
    persistent[holders[~held]] = True
    buffer_last[holders[held]] = read_last[holders[held]]
    return persistent, buffer_last


def _in_level_order(g: OpGraph) -> Sharing:
    return share_buffers(g, slots_of(level_order(g)))


# what orderings start from: sharing in level order (the same in every view of the graph)
SHARING_IN_LEVEL_ORDER = Analysis("buffer sharing in level order", _in_level_order, scope="graph")
