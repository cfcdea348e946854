"""Categorized topological ordering (CTO): every op on a level, ops of one level independent.

Level 0 holds the ops with no inputs; level k the ops whose inputs (data and control) all lie on
levels < k, i.e. the longest-path depth. The distance of an edge is the level difference; long
edges are what make the memory peak, and a swap splits them.
"""

from __future__ import annotations

import numpy as np

from simulator.graph import GraphError, OpGraph


def _successor_csr(g: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """Successor lists over data and control edges (duplicates kept: harmless for levels)."""
    src = np.concatenate([g.tensor_producer[g.edge_tensor], g.control_src])
    dst = np.concatenate([g.edge_consumer, g.control_dst])
    order = np.argsort(src, kind="stable")
    ptr = np.zeros(g.n_ops + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=g.n_ops), out=ptr[1:])
    return ptr, dst[order]


def _compute_levels(g: OpGraph) -> np.ndarray:
    src = np.concatenate([g.tensor_producer[g.edge_tensor], g.control_src])
    dst = np.concatenate([g.edge_consumer, g.control_dst])
    if len(src) and np.any(src == dst):
        raise GraphError(f"op {g.op_name[src[src == dst][0]]!r} depends on itself (the graph has a cycle)")
    ptr, successors = _successor_csr(g)
    remaining = np.bincount(dst, minlength=g.n_ops)
    levels = np.full(g.n_ops, -1, dtype=np.int64)
    frontier = np.flatnonzero(remaining == 0)
    level = 0
    while len(frontier):
        levels[frontier] = level
        starts, stops = ptr[frontier], ptr[frontier + 1]
        counts = stops - starts
        if counts.sum() == 0:
            break
        # gather every successor of the frontier in one go
        offsets = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        touched = successors[offsets]
        remaining -= np.bincount(touched, minlength=g.n_ops)
        candidates = np.unique(touched)
        frontier = candidates[remaining[candidates] == 0]
        level += 1
    if np.any(levels < 0):
        stuck = g.op_name[levels < 0][:5].tolist()
        raise GraphError(f"the graph has a cycle through {len(np.flatnonzero(levels < 0))} ops, e.g. {stuck}")
    return levels


def categorized_levels(g: OpGraph) -> np.ndarray:
    """Each op's level (Kahn's algorithm in rounds over data and control edges), indexed like g's ops."""
    return g.cached("levels", _compute_levels, structural=True)


def edge_distances(g: OpGraph) -> np.ndarray:
    """Level distance of every data edge, indexed like ``g.edge_tensor``."""
    levels = categorized_levels(g)
    return levels[g.edge_consumer] - levels[g.tensor_producer[g.edge_tensor]]


def execution_order(g: OpGraph) -> np.ndarray:
    """The serial order the replay runs ops in: by level, then by op index (stable, deterministic)."""
    return g.cached("order", lambda graph: np.lexsort((np.arange(graph.n_ops), categorized_levels(graph))),
                    structural=True)


def position_of(g: OpGraph) -> np.ndarray:
    """Inverse of ``execution_order``: the slot at which each op runs."""

    def compute(graph: OpGraph) -> np.ndarray:
        position = np.empty(graph.n_ops, dtype=np.int64)
        position[execution_order(graph)] = np.arange(graph.n_ops)
        return position

    return g.cached("position", compute, structural=True)


def n_levels(g: OpGraph) -> int:
    levels = categorized_levels(g)
    return int(levels.max()) + 1 if len(levels) else 0
