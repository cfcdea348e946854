"""Execution orders and the swap rules' distances.

Categorized topological ordering (CTO): level 0 holds the ops with no inputs; level k the ops whose
inputs (data and control) all lie on levels < k, i.e. the longest-path depth (``categorized_levels``,
computed with the graph, ``simulator.graph``). The distance of an edge is the level difference; long
edges are what make the memory peak, and a swap splits them. A graph runs in one of ``ORDERS`` (level
order, a memory-aware order, or on a split step its parts one after the other) and counts distances in levels or
in slots of its order (``distance_levels``).
"""

from __future__ import annotations

import numpy as np

from simulator.kernels.order_loops import greedy_order, part_stages, priority_order
from simulator.graph import (ORDER_NAMES, Analysis, OpGraph, categorized_levels, level_order,  # noqa: F401 -- here too
                             part_of_op, slots_of, successor_csr)
from simulator.sharing import SHARING_IN_LEVEL_ORDER


def edge_distances(g: OpGraph) -> np.ndarray:
    """Distance of every data edge in the swap rules' levels (``distance_levels``), indexed like ``g.edge_tensor``."""
    levels = distance_levels(g)
    return levels[g.edge_consumer] - levels[g.tensor_producer[g.edge_tensor]]


# a graph's meta: ops the memory order runs as soon as they are ready (a read on the host whose copies in a plan
# makes, simulator.state.host_update: it holds nothing on the device, and a swap-in's trigger must follow it)
EARLY_OPS = "early_ops"


def memory_order(g: OpGraph) -> np.ndarray:
    """A topological order that keeps little memory live: greedy (whenever several ops are ready,
    run the one that allocates the least beyond what it frees), then every op that allocates
    more than it lets go is moved to just before its first successor.

    Left to level order, parallel branches advance in lockstep and hold their temporaries
    together (two batch-norm backward passes of a ResNet block: 6 activation-sized buffers
    instead of 3). The greedy pass finishes one branch before the next, but it computes the
    cheap first parts of a gradient early and leaves them waiting while it runs a whole branch
    that frees as it goes (ResNet-50 at batch 848: six activation-sized buffers live in
    conv2_block1's backward); the sinking pass allocates them when they are read (lowest peak of
    plans swapping at thresholds 1-4 over a free link: 15.9 -> 10.8 GiB). Sizes are per sample (the
    batch-proportional part), so the order serves every batch size.
    """
    return _sink_allocations(g, _greedy_memory_order(g))


def _early_ops(g: OpGraph) -> np.ndarray:
    return np.asarray(g.meta.get(EARLY_OPS, ()), np.int64)


def _greedy_memory_order(g: OpGraph) -> np.ndarray:
    """Whenever several ops are ready, the one that allocates the least beyond what it frees
    (ties: lower level, then index)."""
    info = SHARING_IN_LEVEL_ORDER(g)
    size = g.tensor_bytes_ab[:, 1] + g.tensor_bytes_ab[:, 0] * 1e-6
    root = info.root
    owners = np.flatnonzero((root == np.arange(g.n_tensors)) & ~info.persistent)
    allocates = np.zeros(g.n_ops)
    np.add.at(allocates, g.tensor_producer[owners], size[owners])
    allocates[_early_ops(g)] = -np.inf
    reads = ~info.persistent[g.edge_tensor]
    pairs = np.unique(np.stack([root[g.edge_tensor[reads]], g.edge_consumer[reads]]), axis=1)
    readers_left = np.bincount(pairs[0], minlength=g.n_tensors).astype(np.int64)
    by_op = np.argsort(pairs[1], kind="stable")  # each op's input buffers in the order the pairs list them
    inputs = np.ascontiguousarray(pairs[0][by_op], dtype=np.int64)
    inputs_ptr = np.zeros(g.n_ops + 1, dtype=np.int64)
    np.cumsum(np.bincount(pairs[1], minlength=g.n_ops), out=inputs_ptr[1:])
    ptr, successor_array = successor_csr(g)
    pending = np.bincount(successor_array, minlength=g.n_ops).astype(np.int64)
    levels = np.ascontiguousarray(categorized_levels(g), dtype=np.int64)
    return greedy_order(allocates, levels, np.ascontiguousarray(size, dtype=np.float64), inputs_ptr, inputs,
                        readers_left, np.ascontiguousarray(ptr, dtype=np.int64),
                        np.ascontiguousarray(successor_array, dtype=np.int64), pending)


def _sink_allocations(g: OpGraph, order: np.ndarray) -> np.ndarray:
    """Move each op whose outputs weigh at least as much as the inputs it would keep alive to just
    before its first successor (walked backwards, so chains move together). Ties move: an output
    that waits costs as much as an input kept alive, but the input may be kept alive anyway."""
    info = SHARING_IN_LEVEL_ORDER(g)
    size = g.tensor_bytes_ab[:, 1] * ~info.persistent  # per sample: what grows with the batch
    position = np.empty(g.n_ops, dtype=np.int64)
    position[order] = np.arange(g.n_ops)
    out_bytes = np.bincount(g.tensor_producer, size, minlength=g.n_ops)
    root = info.root
    last_read = np.full(g.n_tensors, -1, dtype=np.int64)
    np.maximum.at(last_read, root[g.edge_tensor], position[g.edge_consumer])
    ptr, successor_array = successor_csr(g)
    succ_bounds, successors = ptr.tolist(), successor_array.tolist()
    by_consumer = np.argsort(g.edge_consumer, kind="stable")
    in_bounds = np.searchsorted(g.edge_consumer[by_consumer], np.arange(g.n_ops + 1)).tolist()
    inputs = root[g.edge_tensor[by_consumer]].tolist()
    sizes, outs, last = size.tolist(), out_bytes.tolist(), last_read.tolist()
    # Emission keys as tuples: an op moved before ``target`` sorts just before it and before
    # everything moved there earlier in this (backward) walk, i.e. before their subtrees too.
    key: list[tuple[int, ...]] = [(p, 0) for p in position.tolist()]
    attached: dict[int, list[int]] = {}
    moved = [False] * g.n_ops
    early = set(_early_ops(g).tolist())
    for seq, op in enumerate(order[::-1].tolist(), start=1):
        succ = successors[succ_bounds[op]:succ_bounds[op + 1]]
        if not succ or outs[op] <= 0 or op in early:
            continue
        target = min(succ, key=lambda s: key[s])
        if not moved[target] and key[target][0] == key[op][0] + 1 and target not in attached:
            continue  # already right before it
        kept = sum(sizes[b] for b in set(inputs[in_bounds[op]:in_bounds[op + 1]]) if last[b] < key[target][0])
        if outs[op] < kept:
            continue
        moved[op] = True
        key[op] = key[target][:-1] + (-seq, 0)
        attached.setdefault(target, []).append(op)
    result: list[int] = []

    def emit(op: int) -> None:
        stack = [(op, False)]
        while stack:
            current, expanded = stack.pop()
            if expanded:
                result.append(current)
                continue
            stack.append((current, True))
            for before in attached.get(current, ()):  # the last attached comes out first
                stack.append((before, False))

    for op in order.tolist():
        if not moved[op]:
            emit(op)
    return np.asarray(result, dtype=np.int64)


def micro_batch_order(g: OpGraph) -> np.ndarray:
    """A split step's parts one after the other, each forward and backward before the next part's (TSPLIT's
    micro-batches, the gradient accumulation that keeps the step exact, docs/design.md 12): whenever several ops
    are ready, one of the lowest part runs first, in the memory order among equals. An op outside the parts (a
    running combine, what reads a whole tensor, the optimizer's update) belongs to the highest part it waits for,
    so combine ``j`` runs once part ``j + 1``'s partial is made and the update after the last. Where a part's
    backward waits for every part's forward (batch normalisation's combined moments), it runs when it can: then
    the order is the memory order's. On a step not split, the memory order."""
    part = part_of_op(g)
    base = memory_order(g)
    if not (part >= 0).any():
        return base
    ptr, successors = (np.ascontiguousarray(array, dtype=np.int64) for array in successor_csr(g))
    stage = part_stages(np.ascontiguousarray(part, dtype=np.int64), base, ptr, successors)
    return priority_order(stage * g.n_ops + slots_of(base), ptr, successors)


ORDERS = {"cto": level_order, "memory": memory_order, "micro-batch": micro_batch_order}  # graph.ORDER_NAMES


def orders_of(g: OpGraph) -> tuple[str, ...]:
    """The orders a plan of ``g`` may run in: the micro-batch order only where ``g`` runs regions in parts (on any
    other step it is the memory order)."""
    return ORDER_NAMES if (part_of_op(g) >= 0).any() else tuple(name for name in ORDER_NAMES if name != "micro-batch")


def _execution_order(g: OpGraph) -> np.ndarray:
    return ORDERS[g.order](g)


EXECUTION_ORDER = Analysis("execution_order", _execution_order, scope="order")
POSITION = Analysis("position", lambda g: slots_of(execution_order(g)), scope="order")


def execution_order(g: OpGraph) -> np.ndarray:
    """The serial order the replay runs ops in (and the rewriter chains the real step in)."""
    return EXECUTION_ORDER(g)


def position_of(g: OpGraph) -> np.ndarray:
    """Inverse of ``execution_order``: the slot at which each op runs."""
    return POSITION(g)


def _distance_levels(g: OpGraph) -> np.ndarray:
    return position_of(g) if g.distance == "slot" else categorized_levels(g)


DISTANCE_LEVELS = Analysis("distance_levels", _distance_levels, scope="view")


def distance_levels(g: OpGraph) -> np.ndarray:
    """The levels the swap rules count distances in (``g.distance``, ``SwapParams.distance``): each
    op's CTO level, or with "slot" its slot in the execution order (one op per level)."""
    return DISTANCE_LEVELS(g)


def slot_levels_view(g: OpGraph) -> OpGraph:
    """``g`` (same order, same batch) whose swap-rule levels are execution slots, so that rules
    counting levels count steps of the order (``SwapParams.distance="slot"``)."""
    return g.with_distance("slot")


def n_levels(g: OpGraph) -> int:
    """Levels in the swap rules' unit (``distance_levels``)."""
    levels = distance_levels(g)
    return int(levels.max()) + 1 if len(levels) else 0
