"""Which tensors share a device buffer, and when each buffer is allocated and last used.

TF does not give every tensor its own memory: Identity/Reshape-like ops alias their input, and ops
such as Relu, AddN or BiasAdd write into an input buffer they are the last to read. Counting aliases
as new buffers overestimates the peak by 5-15% (DESIGN.md 4), so memory is accounted per buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.graph import OpGraph
from simulator.ordering import execution_order, position_of


@dataclass(frozen=True)
class Buffers:
    """Buffer analysis in execution-slot terms (see ``ordering.execution_order``).

    ``root[t]``: the tensor owning t's buffer. ``persistent[t]``: t lives in resident memory.
    ``alloc_slot[t]`` / ``free_slot[t]`` (valid for roots): first and last slot the buffer is live.
    ``use_ptr``/``use_slot``/``use_key``: per root buffer, every slot that reads it; ``use_key`` is
    ``tensor * n_ops + consumer`` of the edge (-1 for the producer itself and for step outputs),
    so a plan can drop the reads it rewires to a swap-in.
    """

    root: np.ndarray
    persistent: np.ndarray
    alloc_slot: np.ndarray
    free_slot: np.ndarray
    use_ptr: np.ndarray
    use_slot: np.ndarray
    use_key: np.ndarray


def _find(root: list[int], tensor: int) -> int:
    while root[tensor] != tensor:
        root[tensor] = root[root[tensor]]
        tensor = root[tensor]
    return tensor


def _analyse(g: OpGraph) -> Buffers:
    n_ops, n_tensors = g.n_ops, g.n_tensors
    position = position_of(g)
    root = np.where(g.tensor_alias_of >= 0, g.tensor_alias_of, np.arange(n_tensors))
    for _ in range(64):  # alias chains are short; resolve them to their owner
        nxt = root[root]
        if np.array_equal(nxt, root):
            break
        root = nxt
    persistent = g.tensor_persistent | g.tensor_persistent[root]

    end_slot = n_ops - 1
    last_read = np.full(n_tensors, -1, dtype=np.int64)
    np.maximum.at(last_read, g.edge_tensor, position[g.edge_consumer])
    last_read[g.outputs] = end_slot
    produced = position[g.tensor_producer]
    tensor_last = np.maximum(last_read, produced)
    buffer_last = np.full(n_tensors, -1, dtype=np.int64)
    np.maximum.at(buffer_last, root, tensor_last)

    # Buffer forwarding, decided in execution order: op k reuses the buffer of an input it is the
    # last to read when sizes and dtypes match (TF's forward_input_or_allocate_output).
    forwarding = np.flatnonzero(g.op_forwards_input)
    if len(forwarding):
        root_list = root.tolist()
        last_list = buffer_last.tolist()
        owns = (g.tensor_alias_of < 0) & ~persistent
        outputs_of: dict[int, list[int]] = {}
        for tensor in np.flatnonzero(owns & g.op_forwards_input[g.tensor_producer]).tolist():
            outputs_of.setdefault(int(g.tensor_producer[tensor]), []).append(tensor)
        by_consumer = np.argsort(g.edge_consumer, kind="stable")
        inputs_sorted = g.edge_tensor[by_consumer]
        consumer_sorted = g.edge_consumer[by_consumer]
        starts = np.searchsorted(consumer_sorted, forwarding, side="left")
        stops = np.searchsorted(consumer_sorted, forwarding, side="right")
        inputs_of = {int(op): inputs_sorted[a:b].tolist() for op, a, b in zip(forwarding, starts, stops)}
        bytes_ab = [tuple(row) for row in g.tensor_bytes_ab.tolist()]
        dtype = g.tensor_dtype.tolist()
        is_output = np.zeros(n_tensors, bool)
        is_output[g.outputs] = True
        persistent_list = persistent.tolist()
        for op in sorted(outputs_of, key=lambda o: position[o]):
            slot = int(position[op])
            inputs = inputs_of.get(op, [])
            for out in outputs_of[op]:
                for source in inputs:
                    owner = _find(root_list, source)
                    if (persistent_list[owner] or is_output[owner] or last_list[owner] != slot
                            or bytes_ab[owner] != bytes_ab[out] or dtype[owner] != dtype[out]
                            or inputs.count(source) > 1):
                        continue
                    root_list[out] = owner
                    last_list[owner] = max(last_list[owner], last_list[out])
                    break
        root = np.asarray([_find(root_list, t) for t in range(n_tensors)], dtype=np.int64)
        buffer_last = np.asarray(last_list, dtype=np.int64)

    # reads of each root buffer, for plans that rewire some of them
    use_root = np.concatenate([root[g.edge_tensor], root, root[g.outputs]])
    use_slot = np.concatenate([position[g.edge_consumer], produced, np.full(len(g.outputs), end_slot)])
    use_key = np.concatenate([g.edge_tensor * n_ops + g.edge_consumer, np.full(n_tensors + len(g.outputs), -1)])
    order = np.argsort(use_root, kind="stable")
    use_ptr = np.zeros(n_tensors + 1, dtype=np.int64)
    np.cumsum(np.bincount(use_root, minlength=n_tensors), out=use_ptr[1:])

    alloc_slot = np.full(n_tensors, -1, dtype=np.int64)
    free_slot = np.full(n_tensors, -1, dtype=np.int64)
    owners = np.flatnonzero((root == np.arange(n_tensors)) & ~persistent)
    alloc_slot[owners] = produced[owners]
    free_slot[owners] = np.maximum(buffer_last[owners], produced[owners])
    return Buffers(root=root, persistent=persistent, alloc_slot=alloc_slot, free_slot=free_slot,
                   use_ptr=use_ptr, use_slot=use_slot[order], use_key=use_key[order])


def buffers(g: OpGraph) -> Buffers:
    """The buffer analysis of ``g`` (shared by every batch size of the same structure)."""
    return g.cached("buffers", _analyse, structural=True)


def baseline_slot_bytes(g: OpGraph) -> np.ndarray:
    """Bytes of non-resident buffers live during each execution slot, without any swap."""

    def compute(graph: OpGraph) -> np.ndarray:
        info = buffers(graph)
        owners = np.flatnonzero(info.alloc_slot >= 0)
        size = graph.tensor_bytes[owners].astype(np.float64)
        delta = np.bincount(info.alloc_slot[owners], size, minlength=graph.n_ops + 1)
        delta -= np.bincount(info.free_slot[owners] + 1, size, minlength=graph.n_ops + 1)
        return np.cumsum(delta[:-1])

    return g.cached("baseline_slot_bytes", compute, structural=False)


def slot_levels(g: OpGraph) -> np.ndarray:
    """Level of each execution slot (non-decreasing)."""
    from simulator.ordering import categorized_levels

    return g.cached("slot_levels", lambda graph: categorized_levels(graph)[execution_order(graph)], structural=True)
