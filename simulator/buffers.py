"""Which tensors share a device buffer, and when each buffer is allocated and last used.

TF does not give every tensor its own memory: Identity/Reshape-like ops alias their input, and ops
such as Relu, AddN or BiasAdd write into an input buffer they are the last to read. Counting aliases
as new buffers overestimates the peak by 5-15% (docs/design.md 4), so memory is accounted per buffer.

A buffer is a tree of tensors. Links that read their parent from two or more levels (or execution
slots) away could be rewired to a swap-in by a plan; such a link starts a *segment*, because once
rewired, the segment (say, a gradient op writing into the activation it read) lives in the
swap-in's buffer instead.

What the resident bytes are made of (``resident_split_bytes``): weights, model state, optimizer slots,
gradient accumulators, optimizer scalars, metrics (each variable's kind, named by the capture in
``graph.meta["variables"]``, ``rewriter.trace.state_kinds``), the inputs (the step's placeholders) and
the constants (the rest); the gradients are not resident but made by the backward pass and read by
the update (``gradient_bytes``). A plan that moves part of the state starts from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator import kernels
from simulator.graph import BACKWARD, UPDATE, Analysis, OpGraph
from simulator.kernels.records import BufferRecord
from simulator.ordering import categorized_levels, distance_levels, execution_order, orders_of, position_of
from simulator.sharing import SHARING_IN_LEVEL_ORDER, share_buffers
from simulator.state.host_update import triggered_reads


@dataclass(frozen=True)
class Buffers:
    """Buffer analysis in execution-slot terms (see ``ordering.execution_order``).

    Per tensor: ``root`` (the tensor owning its buffer), ``persistent`` (resident memory),
    ``segment`` (head tensor of its segment). Per root: ``alloc_slot``/``free_slot`` (first and
    last live slot), uses as CSR ``use_ptr`` -> ``use_slot``, ``use_key`` (``tensor * n_ops +
    consumer`` of the read, -1 for the producer itself and step outputs) and ``use_segment``;
    ``seg_ptr`` -> ``seg_head`` lists each root's segments (root segment first).
    Per segment head: ``link_key`` (``parent * n_ops + op`` of the read that made it, -1 for a
    root) and ``seg_parent`` (head of the parent segment).
    ``late_slot``/``late_key``/``late_root``/``late_out``: forwards that only a later read
    prevents; the op at ``late_slot`` could write ``late_out`` into the buffer of the read
    ``late_key`` (``tensor * n_ops + op``; root ``late_root``) once a plan rewires reads
    (``kernel_memory.account``). One entry per such input, in input order (consecutive per output):
    the first a plan makes possible is taken, as TF's kernels try their inputs in order (a softmax
    gradient's ``dy * softmax`` writes into the swap-in of ``softmax`` when ``dy`` is still read).
    """

    root: np.ndarray
    persistent: np.ndarray
    segment: np.ndarray
    alloc_slot: np.ndarray
    free_slot: np.ndarray
    use_ptr: np.ndarray
    use_slot: np.ndarray
    use_key: np.ndarray
    use_segment: np.ndarray
    seg_ptr: np.ndarray
    seg_head: np.ndarray
    link_key: np.ndarray
    seg_parent: np.ndarray
    late_slot: np.ndarray
    late_key: np.ndarray
    late_root: np.ndarray
    late_out: np.ndarray


def _analyse(g: OpGraph) -> Buffers:
    n_ops, n_tensors = g.n_ops, g.n_tensors
    position = position_of(g)
    levels = distance_levels(g)
    shared = SHARING_IN_LEVEL_ORDER(g) if g.order == "cto" else share_buffers(g, position)
    root, persistent, buffer_last, late = shared.root, shared.persistent, shared.buffer_last, shared.late
    parent, link_op = shared.parent, shared.link_op
    end_slot = n_ops - 1
    produced = position[g.tensor_producer]

    # segments: a link that reads its parent from >= 2 levels or execution slots away may be
    # rewired by a plan (SwapParams.distance counts one or the other), as every read of a copy in a plan
    # makes (planning._always_far)
    has_parent = parent >= 0
    safe_parent = np.maximum(parent, 0)
    link_at, parent_at = np.maximum(link_op, 0), g.tensor_producer[safe_parent]
    far = ((levels[link_at] - levels[parent_at] >= 2) | (position[link_at] - position[parent_at] >= 2)
           | np.isin(safe_parent, triggered_reads(g)) & has_parent)
    is_head = ~has_parent | far
    segment = np.where(is_head, np.arange(n_tensors), parent)
    for _ in range(64):
        nxt = np.where(is_head, segment, segment[segment])
        if np.array_equal(nxt, segment):
            break
        segment = nxt
    link_key = np.where(is_head & has_parent, parent * n_ops + link_op, -1)
    seg_parent = np.where(is_head & has_parent, segment[safe_parent], -1)

    # reads of each root buffer, for plans that rewire some of them
    use_owner = np.concatenate([g.edge_tensor, np.arange(n_tensors), g.outputs])
    use_root = root[use_owner]
    use_slot = np.concatenate([position[g.edge_consumer], produced, np.full(len(g.outputs), end_slot)])
    use_key = np.concatenate([g.edge_tensor * n_ops + g.edge_consumer, np.full(n_tensors + len(g.outputs), -1)])
    order = np.argsort(use_root, kind="stable")
    use_ptr = np.zeros(n_tensors + 1, dtype=np.int64)
    np.cumsum(np.bincount(use_root, minlength=n_tensors), out=use_ptr[1:])
    heads = np.flatnonzero(is_head)
    heads = heads[np.lexsort((produced[heads], root[heads]))]  # per root, parents before children
    seg_ptr = np.zeros(n_tensors + 1, dtype=np.int64)
    np.cumsum(np.bincount(root[heads], minlength=n_tensors), out=seg_ptr[1:])

    alloc_slot = np.full(n_tensors, -1, dtype=np.int64)
    free_slot = np.full(n_tensors, -1, dtype=np.int64)
    owners = np.flatnonzero((root == np.arange(n_tensors)) & ~persistent)
    alloc_slot[owners] = produced[owners]
    free_slot[owners] = np.maximum(buffer_last[owners], produced[owners])
    # contiguous columns: the compiled replay takes them as they are (one machine-code version)
    late_slot, late_source, late_out = np.ascontiguousarray(np.asarray(late, dtype=np.int64).reshape(-1, 3).T)
    return Buffers(root=root, persistent=persistent, segment=segment, alloc_slot=alloc_slot, free_slot=free_slot,
                   use_ptr=use_ptr, use_slot=use_slot[order], use_key=use_key[order],
                   use_segment=segment[use_owner][order], seg_ptr=seg_ptr, seg_head=heads,
                   link_key=link_key, seg_parent=seg_parent,
                   late_slot=late_slot, late_key=late_source * n_ops + execution_order(g)[late_slot],
                   late_root=root[late_source], late_out=late_out)


BUFFERS = Analysis("buffers", _analyse, scope="view")


def buffers(g: OpGraph) -> Buffers:
    """The buffer analysis of ``g`` (shared by every batch size of the same structure)."""
    return BUFFERS(g)


def ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(start, stop)`` for each pair, without a Python loop."""
    counts = stops - starts
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(total)


def contains(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``np.isin`` for a small sorted set, without sorting ``keys``."""
    if len(sorted_keys) == 0:
        return np.zeros(len(keys), bool)
    where = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    return sorted_keys[where] == keys


@dataclass(frozen=True)
class RewireTables:
    """``Buffers`` as the compiled lifetimes read them (``kernels.after_ops``, ``kernels.replay_plan``). Reads a plan
    may rewire (uses' and segment links') get ids: their rank among the sorted unique ``read_keys``
    (``tensor * n_ops + consumer``). Per tensor, its reads (``tensor_read_ptr`` -> consumer, id; in
    edge order), so a plan's far read finds its id among a few. Segments are numbered by their place
    in ``Buffers.seg_head`` (a root's segments are numbers ``seg_ptr[root]`` on, root segment first):
    per segment its uses, latest slot first (``seg_use_ptr`` -> slot, read id or -1), its link's read
    id and key and its parent's number (-1 for a root segment); per tensor its segment's number."""

    read_keys: np.ndarray
    tensor_read_ptr: np.ndarray
    tensor_read_consumer: np.ndarray
    tensor_read_id: np.ndarray
    seg_use_ptr: np.ndarray
    seg_use_slot: np.ndarray
    seg_use_id: np.ndarray
    seg_ptr: np.ndarray
    seg_link_id: np.ndarray
    seg_link_key: np.ndarray
    seg_parent: np.ndarray
    tensor_segment: np.ndarray

    def record_fields(self) -> dict[str, np.ndarray | int]:
        """Every table but ``read_keys`` by name, and their number (``n_keys``): a ``BufferRecord``'s."""
        return {**{name: getattr(self, name) for name in self.__dataclass_fields__ if name != "read_keys"},
                "n_keys": len(self.read_keys)}


def rewire_tables(g: OpGraph) -> RewireTables:
    """``RewireTables`` of ``g`` (structural)."""
    def compute(graph: OpGraph) -> RewireTables:
        info = buffers(graph)
        keys = np.unique(np.concatenate([info.use_key, info.link_key]))
        keys = keys[keys >= 0]
        number = np.full(graph.n_tensors, -1, np.int64)  # segment number of each head
        number[info.seg_head] = np.arange(len(info.seg_head))
        link_key = info.link_key[info.seg_head]
        parent = info.seg_parent[info.seg_head]
        read_ptr = np.zeros(graph.n_tensors + 1, np.int64)
        np.cumsum(np.bincount(graph.edge_tensor, minlength=graph.n_tensors), out=read_ptr[1:])
        by_tensor = np.argsort(graph.edge_tensor, kind="stable")
        consumer = graph.edge_consumer[by_tensor]
        use_segment = number[info.use_segment]
        by_segment = np.lexsort((-info.use_slot, use_segment))
        seg_use_ptr = np.zeros(len(info.seg_head) + 1, np.int64)
        np.cumsum(np.bincount(use_segment, minlength=len(info.seg_head)), out=seg_use_ptr[1:])
        return RewireTables(
            read_keys=keys, tensor_read_ptr=read_ptr, tensor_read_consumer=consumer,
            tensor_read_id=np.searchsorted(keys, graph.edge_tensor[by_tensor] * graph.n_ops + consumer),
            seg_use_ptr=seg_use_ptr, seg_use_slot=info.use_slot[by_segment],
            seg_use_id=np.where(info.use_key >= 0, np.searchsorted(keys, info.use_key), -1)[by_segment],
            seg_ptr=info.seg_ptr,
            seg_link_id=np.where(link_key >= 0, np.searchsorted(keys, link_key), -1), seg_link_key=link_key,
            seg_parent=np.where(parent >= 0, number[np.maximum(parent, 0)], -1),
            tensor_segment=number[info.segment])
    return g.cached("rewire_tables", compute, structural=True)


def buffer_record(g: OpGraph) -> BufferRecord:
    """``g``'s buffers as the compiled lifetimes take them (``kernels.after_ops``, ``kernels.plan_reads``,
    ``kernels.replay_plan``), built once per view."""
    def compute(graph: OpGraph) -> BufferRecord:
        return BufferRecord(position=position_of(graph), order=execution_order(graph),
                            tensor_producer=graph.tensor_producer, root=buffers(graph).root,
                            **rewire_tables(graph).record_fields())
    return g.cached("buffer_record", compute, structural=True)


def alloc_slot_bytes(g: OpGraph) -> np.ndarray:
    """Bytes of the non-resident buffers each execution slot allocates (its op's outputs), length n_ops + 1."""

    def compute(graph: OpGraph) -> np.ndarray:
        info = buffers(graph)
        owners = np.flatnonzero(info.alloc_slot >= 0)
        return np.bincount(info.alloc_slot[owners], graph.tensor_bytes[owners].astype(np.float64),
                           minlength=graph.n_ops + 1)

    return g.cached("alloc_slot_bytes", compute, structural=False)


def baseline_slot_bytes(g: OpGraph) -> np.ndarray:
    """Bytes of non-resident buffers live during each execution slot, without any swap."""

    def compute(graph: OpGraph) -> np.ndarray:
        info = buffers(graph)
        owners = np.flatnonzero(info.alloc_slot >= 0)
        delta = alloc_slot_bytes(graph).copy()
        delta -= np.bincount(info.free_slot[owners] + 1, graph.tensor_bytes[owners].astype(np.float64),
                             minlength=graph.n_ops + 1)
        return np.cumsum(delta[:-1])

    return g.cached("baseline_slot_bytes", compute, structural=False)


def slot_levels(g: OpGraph) -> np.ndarray:
    """Level of each execution slot (non-decreasing in the "cto" order only)."""
    return g.cached("slot_levels", lambda graph: categorized_levels(graph)[execution_order(graph)], structural=True)


def op_working_set_bytes(g: OpGraph) -> np.ndarray:
    """Per op, in ``g``'s order: bytes of the non-resident buffers it reads or writes (shared
    buffers counted once), all on the device while it runs; a plan can only lower it by letting
    the op write in place (``least_working_set_bytes``)."""

    def compute(graph: OpGraph) -> np.ndarray:
        info = buffers(graph)
        ops = np.concatenate([graph.edge_consumer, graph.tensor_producer])
        tensors = np.concatenate([graph.edge_tensor, np.arange(graph.n_tensors)])
        keep = ~info.persistent[tensors]
        pairs = np.unique(np.stack([ops[keep], info.root[tensors[keep]]]), axis=1)
        return np.bincount(pairs[0], graph.tensor_bytes[pairs[1]].astype(np.float64), minlength=graph.n_ops)

    return g.cached("op_working_set_bytes", compute, structural=False)


def least_working_set_bytes(g: OpGraph) -> np.ndarray:
    """Per op, in ``g``'s order: its working set without the outputs a plan may let it write in
    place (forwards only a later read prevented, see ``kernel_memory.account``)."""

    def compute(graph: OpGraph) -> np.ndarray:
        working_set = op_working_set_bytes(graph).copy()
        info = buffers(graph)
        if len(info.late_slot):
            op_out = np.unique(np.stack([execution_order(graph)[info.late_slot], info.late_out]), axis=1)
            working_set -= np.bincount(op_out[0], graph.tensor_bytes[op_out[1]].astype(np.float64),
                                       minlength=graph.n_ops)
        return working_set

    return g.cached("least_working_set_bytes", compute, structural=False)


def _binding_working_set_bytes(g: OpGraph) -> np.ndarray:
    """``least_working_set_bytes`` in the execution order (of those a plan may pick) whose largest
    working set is least."""
    return g.cached("binding_working_set_bytes", lambda graph: min(
        (least_working_set_bytes(graph.with_order(name)) for name in orders_of(graph)),
        key=lambda ws: ws.max(initial=0)), structural=False)


def largest_working_set_op(g: OpGraph) -> int:
    """The op whose working set sets ``peak_lower_bound_bytes`` (what to name when it binds)."""
    return int(np.argmax(_binding_working_set_bytes(g)))


def peak_lower_bound_bytes(g: OpGraph) -> int:
    """The least peak any swap plan can reach: resident memory plus the largest op working set.
    A plan picks its execution order, and buffer forwarding depends on it, so the bound is taken
    in the order where it is least; outputs a plan may let an op write in place do not count."""
    return int(g.persistent_bytes + _binding_working_set_bytes(g).max(initial=0))


# ---------------------------------------------------------------------- what resident memory is made of

INPUTS, CONSTANTS = "inputs", "constants"


def input_bytes(g: OpGraph) -> int:
    """Bytes of the step's input batch (its placeholders) at ``g``'s batch size."""
    made_by_placeholder = g.op_type[g.tensor_producer] == "Placeholder"
    return int(g.tensor_bytes[g.tensor_persistent & made_by_placeholder].sum())


def resident_split_bytes(g: OpGraph) -> dict[str, int]:
    """Resident bytes by kind at ``g``'s batch size, summing to ``g.persistent_bytes``: the variables'
    kinds the capture named (``"variable"`` where it knew none), ``"inputs"`` and ``"constants"``
    (the rest: what the step's kernels hold)."""
    split: dict[str, int] = {}
    for variable in g.meta.get("variables", []):
        split[variable["kind"]] = split.get(variable["kind"], 0) + int(variable["bytes"])
    split[INPUTS] = input_bytes(g)
    split[CONSTANTS] = max(0, g.persistent_bytes - sum(split.values()))
    return split


# a plain assignment stores a value the backward pass made without a gradient step: a metric's total
STORE_TYPES = frozenset({"AssignVariableOp"})


def gradient_bytes(g: OpGraph) -> int:
    """Bytes of the buffers the backward pass makes and the update reads (the gradients), at ``g``'s
    batch; values a plain assignment stores (``STORE_TYPES``: a metric's running total) are not gradients."""
    info = buffers(g)
    read_by_update = (g.op_phase[g.edge_consumer] == UPDATE) & ~np.isin(g.op_type[g.edge_consumer], list(STORE_TYPES))
    made_in_backward = g.op_phase[g.tensor_producer[g.edge_tensor]] == BACKWARD
    roots = np.unique(info.root[g.edge_tensor[read_by_update & made_in_backward]])
    roots = roots[~info.persistent[roots]]
    return int(g.tensor_bytes[roots].sum())
