"""The least overhead any plan can have at a batch: swaps, recomputations and splits together.

``simulator.buffers.peak_lower_bound_bytes`` says at which batch no plan fits at all; this says how slow
every plan that fits must be, on the simulator's own time model. It rests on a *cut*: an op ``c`` that
reduces over the batch (a batch norm's moments, a loss's mean: ``simulator.split.classes.BATCH_SUM``).
Every tensor made by ``c`` or an op it depends on and read by an op that depends on ``c`` exists when ``c``
has run, in every execution order, and also in every split of the step (the parts of those ops meet in
``c``'s combine). Each byte of that live set is then on the device, on the host, or gone and recomputed
later. With ``D`` the device budget, ``H`` the host's memory, ``P`` the resident state (free to sit on
either side, its own copies not counted) and ``y`` bytes recomputed, ``x = live - D - y`` bytes (at least)
are on the host: copied out before ``c`` starts and back after it ends, over the preset's links, while
at most the ops not after ``c`` and the ops not before it run. Recomputing a byte costs at least its
producer's time per byte made and that of its inputs freed before ``c``, back to what is live there
(``_recompute_prices``), for the part that grows with the batch (``a + b * batch`` time and bytes: a part
of a split op has its share of both). So the step takes at least

    max(compute + rc(y), max(T_before, x / d2h) + t_c + max(T_after + rc(y), x / h2d))

with ``rc`` the cheapest recomputation of ``y`` bytes of the live set (a fractional knapsack, cheapest
bytes first), ``T_before``/``T_after`` the time of ``c``'s ancestors/descendants and ``compute`` the step's
without the optimizer update (which a plan may move to the host). Minimised over ``y`` (on a grid, each
interval bounded below by its ends) and maximised over the cuts. What it leaves out only makes plans
slower: memory after ``c`` (where a recomputation's inputs must be back), copies' latencies, tensors on both
sides while copied, the resident state's copies, the parts' per-op overheads. ``docs/design.md`` 10 has what
it says for ResNet-50.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.device.calibrated import CalibratedDevice
from simulator.device.presets import DeviceModel
from simulator.graph import UPDATE, OpGraph, alias_roots, level_order
from simulator.replay import op_seconds
from simulator.recompute.actions import inputs_of, outputs_of
from simulator.split.classes import BATCH_SUM, batch_dependent, op_split

GRID_POINTS = 2049  # recomputed bytes tried per cut, from the least the memory forces to the whole live set


@dataclass(frozen=True)
class OverheadBound:
    """``overhead``: the least slow-down (against ``compute_s``, the step as captured) of any plan that fits
    ``budget_bytes`` and ``host_bytes``; ``cut_op``: the op whose live set sets it (-1: no cut binds), with
    ``live_bytes`` live after it, ``host_bytes_moved`` copied out and back and ``recomputed_bytes`` recomputed
    at the best split of the two."""

    overhead: float
    compute_s: float
    cut_op: int
    live_bytes: int
    host_bytes_moved: int
    recomputed_bytes: int


@dataclass(frozen=True)
class _Cuts:
    """Per candidate cut: which ops precede it (itself included) and follow it, and which buffers are live
    after it (``live[buffer, cut]``, buffers by their owning tensor ``buffers``)."""

    ops: np.ndarray
    before: np.ndarray
    after: np.ndarray
    buffers: np.ndarray
    live: np.ndarray


def _bits(value: int, n: int) -> np.ndarray:
    raw = value.to_bytes((n + 7) // 8, "little")
    return np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")[:n].astype(bool)


def _cuts(g: OpGraph) -> _Cuts:
    """Ancestor and descendant sets as bit sets over ``level_order``, then the candidates' columns."""
    def compute(graph: OpGraph) -> _Cuts:
        n = graph.n_ops
        producer = graph.tensor_producer
        src = np.concatenate([producer[graph.edge_tensor], graph.control_src]).tolist()
        dst = np.concatenate([graph.edge_consumer, graph.control_dst]).tolist()
        preds: list[list[int]] = [[] for _ in range(n)]
        succs: list[list[int]] = [[] for _ in range(n)]
        for s, d in zip(src, dst):
            preds[d].append(s)
            succs[s].append(d)
        order = level_order(graph).tolist()
        ancestors = [0] * n  # strict
        for op in order:
            acc = 0
            for p in preds[op]:
                acc |= ancestors[p] | (1 << p)
            ancestors[op] = acc
        descendants = [0] * n  # strict
        for op in reversed(order):
            acc = 0
            for s in succs[op]:
                acc |= descendants[s] | (1 << s)
            descendants[op] = acc
        owner = alias_roots(graph)
        read_by: list[int] = [0] * graph.n_tensors  # the cuts each tensor's readers come after
        for t, c in zip(graph.edge_tensor.tolist(), graph.edge_consumer.tolist()):
            read_by[t] |= ancestors[c]
        live_after: dict[int, int] = {}
        for t in range(graph.n_tensors):
            if graph.tensor_persistent[t] or not read_by[t]:
                continue
            p = int(producer[t])
            bits = (descendants[p] | (1 << p)) & read_by[t]
            if bits:
                live_after[int(owner[t])] = live_after.get(int(owner[t]), 0) | bits
        candidates = np.array([op for op in range(n) if op_split(graph, op).kind == BATCH_SUM], np.int64)
        buffers = np.array(sorted(live_after), np.int64)
        live = (np.array([_bits(live_after[b], n)[candidates] for b in buffers.tolist()], bool)
                if len(buffers) else np.zeros((0, len(candidates)), bool))
        before = np.array([_bits(ancestors[c] | (1 << c), n) for c in candidates.tolist()], bool).reshape(-1, n)
        after = np.array([_bits(descendants[c], n) for c in candidates.tolist()], bool).reshape(-1, n)
        return _Cuts(candidates, before, after, buffers, live.reshape(len(buffers), len(candidates)))

    return g.cached("overhead_bound_cuts", compute, structural=True)


def _growing_seconds_per_sample(g: OpGraph, device: DeviceModel) -> np.ndarray:
    """Per op, the part of its time that grows with the batch, per sample: what a part of it on ``n`` samples
    takes at least, ``n`` times this (the roofline's ``max`` of two lines through zero is a line)."""
    if isinstance(device, CalibratedDevice):  # measured as a + b * batch: b from two batches
        two, one = g.with_batch(2), g.with_batch(1)
        return np.maximum(op_seconds(two, device) - op_seconds(one, device), 0.0)
    return np.maximum(g.op_flops_ab[:, 1] / device.effective_flops,
                      g.op_touched_bytes_ab[:, 1] / device.effective_bandwidth).clip(min=0.0)


def _recompute_prices(g: OpGraph, device: DeviceModel) -> np.ndarray:
    """Per live buffer and cut (``_Cuts.live``): the least seconds per sample and growing byte that dropping
    it at the cut costs. Its producer must run again, and so must each input of it that is not live there
    (it was freed before the cut: holding it instead would hold its bytes), back to what is; a tensor
    several ops read counts a share of its chain in each (so dropping all of them counts it once), and so
    does an op's time in each of its outputs. Or the dead inputs are held, and only the bytes the buffer
    has over them are gained, for its producer's time."""
    def compute(graph: OpGraph) -> np.ndarray:
        cuts = _cuts(graph)
        per_sample = _growing_seconds_per_sample(graph, device)
        made, read = outputs_of(graph), inputs_of(graph)
        op_share = per_sample / np.maximum(1, np.array([len(m) for m in made]))
        readers = np.bincount(graph.edge_tensor, minlength=graph.n_tensors).clip(min=1)
        grows = batch_dependent(graph) & ~graph.tensor_persistent
        owner = alias_roots(graph)
        grown_bytes = graph.tensor_bytes_ab[:, 1]
        order = level_order(graph).tolist()
        prices = np.full(cuts.live.shape, np.inf)
        row_of = {int(b): i for i, b in enumerate(cuts.buffers.tolist())}
        for j in range(len(cuts.ops)):
            live = {int(b) for b in cuts.buffers[cuts.live[:, j]].tolist()}
            chain = np.zeros(graph.n_tensors)  # seconds per sample to make a tensor again from what is live
            for op in order:
                if not cuts.before[j, op]:
                    continue
                dead = [t for t, _ in read[op] if grows[t] and int(owner[t]) not in live]
                inputs_s = sum(chain[t] / readers[t] for t in dead)
                for t in made[op]:
                    chain[t] = op_share[op] + inputs_s
            for b in live:
                p = int(graph.tensor_producer[b])
                dead = {int(owner[t]) for t, _ in read[p] if grows[t] and int(owner[t]) not in live}
                price = chain[b] / grown_bytes[b] if grown_bytes[b] > 0 else 0.0
                gain = grown_bytes[b] - sum(grown_bytes[d] for d in dead)
                if gain > 0:
                    price = min(price, op_share[p] / gain)
                prices[row_of[b], j] = price
        return prices

    return g.cached(("overhead_bound_prices", device), compute, structural=True)


def least_overhead(g: OpGraph, device: DeviceModel, budget_bytes: int | None = None) -> OverheadBound:
    """The least overhead of any plan on ``g`` at its batch that fits ``budget_bytes`` (the device's budget by
    default) and the device's host memory (see the module's docstring)."""
    budget = device.budget_bytes if budget_bytes is None else int(budget_bytes)
    host = device.host_memory_bytes
    seconds = op_seconds(g, device)
    compute_s = float(seconds.sum())
    without_update_s = compute_s - float(seconds[g.op_phase == UPDATE].sum())
    prices = _recompute_prices(g, device)
    cuts = _cuts(g)
    sizes = g.tensor_bytes[cuts.buffers].astype(np.float64)
    grown = (g.tensor_bytes_ab[cuts.buffers, 1] * g.batch_size).clip(min=0.0)
    d2h, h2d = device.d2h_bytes_per_s, device.h2d_bytes_per_s
    best = OverheadBound(-np.inf, compute_s, -1, 0, 0, 0)
    for j, cut in enumerate(cuts.ops.tolist()):
        live = cuts.live[:, j]
        live_bytes = float(sizes[live].sum())
        if live_bytes + g.persistent_bytes <= budget:
            continue
        # cheapest bytes first: what does not grow with the batch is free, the rest at its price per sample
        order = np.argsort(prices[live, j], kind="stable")
        steps = np.concatenate([[live_bytes - float(grown[live].sum())], grown[live][order]])
        cum_bytes = np.cumsum(steps)
        cum_s = np.cumsum(np.concatenate([[0.0], grown[live][order] * prices[live, j][order]]))
        y_min = max(0.0, live_bytes + g.persistent_bytes - budget - host)
        grid = np.linspace(y_min, live_bytes, GRID_POINTS)
        rc = np.interp(grid, np.concatenate([[0.0], cum_bytes]), np.concatenate([[0.0], cum_s]))
        moved = np.maximum(0.0, live_bytes - budget - grid)  # on the host at the cut, at least
        before_s = float(seconds[cuts.before[j]].sum()) - float(seconds[cut])
        after_s = float(seconds[cuts.after[j]].sum())
        # over each interval [grid[i], grid[i+1]]: rc at its left end, the bytes moved at its right end
        rc_lo, moved_lo = rc[:-1], moved[1:]
        step = np.maximum(without_update_s + rc_lo,
                          np.maximum(before_s, moved_lo / d2h) + seconds[cut] + np.maximum(after_s + rc_lo,
                                                                                           moved_lo / h2d))
        i = int(np.argmin(step))
        overhead = float(step[i]) / compute_s - 1.0
        if overhead > best.overhead:
            best = OverheadBound(overhead, compute_s, cut, int(live_bytes), int(moved[i + 1]), int(grid[i]))
    return best if best.cut_op >= 0 else OverheadBound(0.0, compute_s, -1, 0, 0, 0)
