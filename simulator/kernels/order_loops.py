"""The memory-aware execution order's greedy pass (``simulator.ordering.memory_order``), compiled: a search
with recomputation orders each new recomputed graph (ResNet-50: 5,500 ops, 0.1 s an order in Python,
a fifth of the search's time, benchmarks/results/search_speed.md)."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def greedy_order(alloc, levels, sizes, inputs_ptr, inputs, readers_left, successor_ptr, successors, pending):
    """Whenever several ops are ready, run the one whose key (what it allocates less what it frees:
    ``sizes`` of its input buffers (``inputs[inputs_ptr[op]:inputs_ptr[op + 1]]``) read for the last
    time; then its level; then its index) is least. ``readers_left`` and ``pending`` (predecessors
    not run yet) are used up. The keys are unique (the index breaks ties), so the order does not
    depend on how the ready ops are kept; the sums run in the inputs' order, as Python's did."""
    n_ops = alloc.shape[0]
    ready = np.empty(n_ops, dtype=np.int64)
    n_ready = 0
    for op in range(n_ops):
        if pending[op] == 0:
            ready[n_ready] = op
            n_ready += 1
    order = np.empty(n_ops, dtype=np.int64)
    n_done = 0
    while n_ready > 0:
        best = -1
        best_cost, best_level, best_op = 0.0, 0, 0
        for k in range(n_ready):
            op = ready[k]
            freed = 0.0
            for j in range(inputs_ptr[op], inputs_ptr[op + 1]):
                if readers_left[inputs[j]] == 1:
                    freed += sizes[inputs[j]]
            cost = alloc[op] - freed
            if best < 0 or cost < best_cost or (cost == best_cost and (
                    levels[op] < best_level or (levels[op] == best_level and op < best_op))):
                best, best_cost, best_level, best_op = k, cost, levels[op], op
        op = ready[best]
        n_ready -= 1
        ready[best] = ready[n_ready]
        order[n_done] = op
        n_done += 1
        for j in range(inputs_ptr[op], inputs_ptr[op + 1]):
            readers_left[inputs[j]] -= 1
        for j in range(successor_ptr[op], successor_ptr[op + 1]):
            successor = successors[j]
            pending[successor] -= 1
            if pending[successor] == 0:
                ready[n_ready] = successor
                n_ready += 1
    return order[:n_done]


@njit(cache=True, nogil=True)
def part_stages(part, order, successor_ptr, successors):
    """Per op, the part it belongs to in the micro-batch order (``simulator.ordering.micro_batch_order``): a part's
    own (``part >= 0``); for any other op the highest of its predecessors' (0 for none). ``order`` is topological."""
    stage = np.maximum(part, 0)
    for op in order:
        for j in range(successor_ptr[op], successor_ptr[op + 1]):
            successor = successors[j]
            if part[successor] < 0 and stage[op] > stage[successor]:
                stage[successor] = stage[op]
    return stage


@njit(cache=True, nogil=True)
def priority_order(keys, successor_ptr, successors):
    """Whenever several ops are ready, run the one whose key is least (keys unique); a binary heap of the ready."""
    n_ops = keys.shape[0]
    pending = np.zeros(n_ops, dtype=np.int64)
    for j in range(successors.shape[0]):
        pending[successors[j]] += 1
    heap = np.empty(n_ops, dtype=np.int64)
    size = 0
    for op in range(n_ops):
        if pending[op] == 0:
            size = _push(heap, size, keys, op)
    order = np.empty(n_ops, dtype=np.int64)
    n_done = 0
    while size > 0:
        op = heap[0]
        size -= 1
        heap[0] = heap[size]
        _sift_down(heap, size, keys)
        order[n_done] = op
        n_done += 1
        for j in range(successor_ptr[op], successor_ptr[op + 1]):
            successor = successors[j]
            pending[successor] -= 1
            if pending[successor] == 0:
                size = _push(heap, size, keys, successor)
    return order[:n_done]


@njit(cache=True, nogil=True)
def _push(heap, size, keys, op):
    k = size
    heap[k] = op
    while k > 0:
        parent = (k - 1) // 2
        if keys[heap[parent]] <= keys[heap[k]]:
            break
        heap[parent], heap[k] = heap[k], heap[parent]
        k = parent
    return size + 1


@njit(cache=True, nogil=True)
def _sift_down(heap, size, keys):
    k = 0
    while True:
        left = 2 * k + 1
        if left >= size:
            return
        child = left
        if left + 1 < size and keys[heap[left + 1]] < keys[heap[left]]:
            child = left + 1
        if keys[heap[k]] <= keys[heap[child]]:
            return
        heap[k], heap[child] = heap[child], heap[k]
        k = child
