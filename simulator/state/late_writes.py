"""Variable writes that wait for the reads they would hold (docs/design.md 13).

A write to a variable while a read of it is still to be read keeps the old buffer alive (TensorFlow's
copy-on-write, ``OpGraph.held_tensor``): AdamW's weight decay (``var -= var * lr * wd``) needs no gradient,
so every order runs it in the forward pass, and each weight is held twice until the backward MatMul that reads
its forward read has run (at the start of the backward pass, every weight of the model). ``writes_after_reads``
gives the step control edges from each reader of such a read to the write and to the ops that lead only to it
(the decay's read and product: waiting in front of the write, the product would hold as many bytes), so any
order runs them after the readers and the write updates the variable in place. Exact: no data dependency
changes, only when the write runs; the rewriter chains the step in the plan's order, which holds the edges.
Readers that depend on the write themselves (a cycle) are left as they are.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from simulator.graph import OpGraph, depending_on, successor_csr
from simulator.sharing import SHARING_IN_LEVEL_ORDER

_KEY = "writes_after_reads"  # the graph's memo entry, and its meta's count of added edges


def writes_after_reads(g: OpGraph) -> OpGraph:
    """``g`` with each variable write waiting (control edges) for every reader of the reads it holds; ``g``
    itself when no write holds a read. Memoised on ``g``."""
    if not len(g.held_tensor) or g.meta.get(_KEY) is not None:
        return g
    return g.cached(_KEY, _with_edges, structural=True).with_batch(g.batch_size).with_order(g.order)


def _with_edges(g: OpGraph) -> OpGraph:
    root = SHARING_IN_LEVEL_ORDER(g).root
    readers_of: dict[int, set[int]] = {}
    for tensor, consumer in zip(root[g.edge_tensor].tolist(), g.edge_consumer.tolist()):
        readers_of.setdefault(tensor, set()).add(consumer)
    ptr, successors = successor_csr(g)
    bounds, following = ptr.tolist(), successors.tolist()
    preceding: list[list[int]] = [[] for _ in range(g.n_ops)]
    for op in range(g.n_ops):
        for nxt in following[bounds[op]:bounds[op + 1]]:
            preceding[nxt].append(op)
    src, dst = [], []
    writes: dict[int, set[int]] = {}
    for held, read in zip(g.held_tensor.tolist(), g.held_read.tolist()):
        writes.setdefault(int(g.tensor_producer[held]), set()).update(readers_of.get(int(root[read]), ()))
    for write, readers in writes.items():
        after = depending_on(write, bounds, following)
        private = _leading_only_to(write, following, bounds, preceding)
        entries = [op for op in private if not any(p in private for p in preceding[op])]
        for reader in sorted(readers - after - private):
            for entry in entries:
                src.append(reader)
                dst.append(entry)
    meta = dict(g.meta, **{_KEY: len(src)})
    return dataclasses.replace(g, control_src=np.concatenate([g.control_src, np.asarray(src, np.int64)]),
                               control_dst=np.concatenate([g.control_dst, np.asarray(dst, np.int64)]), meta=meta,
                               _graph_memo={}, _order_memo={}, _structure_cache={})


def _leading_only_to(write: int, following: list[int], bounds: list[int], preceding: list[list[int]]) -> set[int]:
    """``write`` and the ops whose every successor is one of them: what runs only for the write."""
    private = {write}
    stack = [write]
    while stack:
        op = stack.pop()
        for before in preceding[op]:
            if before not in private and all(nxt in private for nxt in following[bounds[before]:bounds[before + 1]]):
                private.add(before)
                stack.append(before)
    return private
