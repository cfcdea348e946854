"""Swap rules: which tensors go to the host, which consumers read them back, what starts the swap-in.

``plan_swaps(g, params)`` applies the rules of docs/design.md 1.4 to a graph and returns a ``SwapPlan``
(``simulator.plan``): plain data that the replay simulates and the rewriter applies to the real graph as-is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from simulator import kernels
from simulator.buffers import buffer_record
from simulator.fusion import fused_shared_reads, merge_partners, sibling_partners
from simulator.graph import BACKWARD, FORWARD, UPDATE, GraphError, OpGraph, categorized_levels
from simulator.kernels.records import PlanningRecord, TriggerRecord
from simulator.ordering import distance_levels, execution_order, n_levels, position_of, slot_levels_view
from simulator.params import (DISTANCES, SWAP_SCOPES, SYNC_IN_MODES, SYNC_MODES, TRIGGER_POLICIES,  # noqa: F401
                              ParamsError, SwapParams)
from simulator.plan import Swap, SwapIn, SwapPlan, after_ops, validate_plan  # noqa: F401 -- importable from here too
from simulator.split.actions import split_step_ops
from simulator.state.host_update import host_update_ops, triggered_reads

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "complex64", "complex128"})


# Backward ops heavy enough that Grappler neither folds them nor moves their control edges, so a
# control edge from one of them to a swap-in survives optimisation (docs/design.md 3).
TRIGGER_OP_TYPES = frozenset({
    "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2",
    "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter",
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "SigmoidGrad", "TanhGrad",
    "FusedBatchNormGradV3", "MaxPoolGrad", "MaxPool3DGrad", "AvgPoolGrad", "AvgPool3DGrad",
    "BiasAddGrad", "SoftmaxGrad", "Conv2DTranspose", "Conv3DTranspose",
})
# Ops that only relabel their input's layout: Grappler may bypass one and move its control edges to its input,
# even a split part it keeps, so a swap-in would start early (the TimeDistributed model's backward transposes,
# tests/benchmarks/test_split_users.py); never a split step's trigger
LAYOUT_OP_TYPES = frozenset({"Transpose", "Reshape", "Squeeze", "ExpandDims", "Identity"})


# ---------------------------------------------------------------------- rules


def is_activation(g: OpGraph) -> np.ndarray:
    """Per tensor: a float the forward pass makes that can live on the host (what LMS swaps).
    Computed once per structure (read-only; the dtype test on strings cost a fifth of a plan)."""
    def compute(graph: OpGraph) -> np.ndarray:
        mask = (graph.tensor_swappable & ~graph.tensor_persistent & (graph.op_phase[graph.tensor_producer] == FORWARD)
                & np.isin(graph.tensor_dtype, list(FLOAT_DTYPES)))
        mask.flags.writeable = False
        return mask
    return g.cached("is_activation", compute, structural=True)


def _candidate_tensors(g: OpGraph, params: SwapParams) -> np.ndarray:
    """Tensors the rules may swap (``params.tensors``) that can live on the host, after filters."""
    producer = g.tensor_producer
    if params.tensors == "activations":
        ok = is_activation(g).copy()
    else:
        ok = g.tensor_swappable & ~g.tensor_persistent & np.isin(g.op_phase[producer], (FORWARD, BACKWARD))
    if params.min_bytes:
        ok &= g.tensor_bytes >= params.min_bytes
    if params.include_types:
        ok &= np.isin(g.op_type[producer], params.include_types)
    if params.exclude_types:
        ok &= ~np.isin(g.op_type[producer], params.exclude_types)
    if params.exclude_scopes:
        names = g.op_name[producer]
        for scope in params.exclude_scopes:
            ok &= ~np.char.startswith(names, scope)
    if params.keep_tensors:
        index = g.tensor_index()
        unknown = [name for name in params.keep_tensors if name not in index]
        if unknown:
            raise GraphError(f"keep_tensors names {len(unknown)} tensor(s) this graph does not have "
                             f"(e.g. {unknown[0]})")
        ok[[index[name] for name in params.keep_tensors]] = False
    return ok


def _trigger_candidates(g: OpGraph) -> np.ndarray:
    """Ops a swap-in may start after: heavy backward ops (``TRIGGER_OP_TYPES``) and, in a split step, every
    part and combine of a region in any phase (the rewriter marks them for Grappler to keep) but those that
    only relabel a layout (``LAYOUT_OP_TYPES``), so that a tensor read again after its batch norm's sums are
    combined comes back part by part, each just before its reader, forward passes included (docs/design.md 12)."""
    heavy = (g.op_phase == BACKWARD) & np.isin(g.op_type, list(TRIGGER_OP_TYPES))
    parts = split_step_ops(g) & ~np.isin(g.op_type, list(LAYOUT_OP_TYPES))
    return np.flatnonzero(heavy | parts)


def _level_triggers(g: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """For every level L: the highest level <= L holding a trigger candidate, and that op (-1 if none)."""
    levels = distance_levels(g)
    count = n_levels(g)
    candidates = _trigger_candidates(g)
    op_at_level = np.full(count, -1, dtype=np.int64)
    op_at_level[levels[candidates]] = candidates  # the last candidate of each level wins
    has = op_at_level >= 0
    latest_level = np.where(has, np.arange(count), -1)
    latest_level = np.maximum.accumulate(latest_level) if count else latest_level
    latest_op = np.where(latest_level >= 0, op_at_level[np.maximum(latest_level, 0)], -1)
    return latest_level, latest_op


def _ancestor_triggers(g: OpGraph, depth: int) -> dict[str, np.ndarray]:
    """For every op: its ancestors among trigger candidates at most ``depth`` levels up.

    Bitsets (Python ints) propagated in level order over data and control edges; bit i of op x
    stands for the trigger of level-order rank ``base[x] + i``, and ranks more than ``depth``
    levels above x are dropped, which keeps the sets small on deep graphs. The answer is a flat
    array sorted by (op, level) with ``key = op * span + level``, so one ``searchsorted`` finds,
    for many ops at once, the latest ancestor trigger at or below a level.
    """
    levels = distance_levels(g)
    count = n_levels(g)
    candidates = _trigger_candidates(g)
    candidates = candidates[np.lexsort((candidates, levels[candidates]))]
    rank_of = np.full(g.n_ops, -1, dtype=np.int64)
    rank_of[candidates] = np.arange(len(candidates))
    first_rank = np.searchsorted(levels[candidates], np.arange(count + 1), side="left")
    base_of = first_rank[np.maximum(levels - depth, 0)].tolist()
    src = np.concatenate([g.tensor_producer[g.edge_tensor], g.control_src])
    dst = np.concatenate([g.edge_consumer, g.control_dst])
    by_dst = np.argsort(dst, kind="stable")
    src, dst = src[by_dst].tolist(), dst[by_dst]
    starts = np.searchsorted(dst, np.arange(g.n_ops), side="left").tolist()
    stops = np.searchsorted(dst, np.arange(g.n_ops), side="right").tolist()
    rank_list = rank_of.tolist()
    bits_of = [0] * g.n_ops
    for op in execution_order(g).tolist():
        base = base_of[op]
        acc = 0
        for parent in src[starts[op]:stops[op]]:
            bits = bits_of[parent]
            if rank_list[parent] >= 0:
                bits |= 1 << (rank_list[parent] - base_of[parent])
            acc |= bits >> (base - base_of[parent])
        bits_of[op] = acc
    # every op's bits unpacked at once (one row of a fixed width per op; per op it was 150,000 numpy calls a
    # ResNet-50 search with recomputation): rows in op order, ranks ascending in each. Only backward ops have
    # ancestors among the candidates, but in a split step, whose parts are candidates in the forward too
    backward = [op for op in range(g.n_ops) if bits_of[op]]
    width = (max((bits_of[op].bit_length() for op in backward), default=0) + 7) // 8
    raw = np.frombuffer(b"".join(bits_of[op].to_bytes(width, "little") for op in backward), dtype=np.uint8)
    rows, columns = np.nonzero(np.unpackbits(raw.reshape(len(backward), width), axis=1, bitorder="little"))
    owners = np.asarray(backward, dtype=np.int64)[rows]
    ops = candidates[columns + np.asarray(base_of, dtype=np.int64)[owners]].astype(np.int64, copy=False)
    ptr = np.zeros(g.n_ops + 1, dtype=np.int64)
    np.cumsum(np.bincount(owners, minlength=g.n_ops), out=ptr[1:])
    owner = np.repeat(np.arange(g.n_ops), np.diff(ptr))
    span = count + 1
    return {"ptr": ptr, "ops": ops, "levels": levels[ops], "key": owner * span + levels[ops], "span": span}


def _trigger_depth(ub: int, count: int) -> int:
    """Ancestor tables are built for windows of 16, 32, 64, ... levels (capped at the graph's depth)."""
    depth = 16
    while depth < ub:
        depth *= 2
    return min(depth, max(count, 1))


def _edges_by_tensor_slot(g: OpGraph) -> np.ndarray:
    """The data edges by tensor, then their consumer's slot (then edge): a tensor's reads in execution
    order, as the planner walks them (structural, per order)."""
    return g.cached("edges_by_tensor_slot", lambda graph: np.lexsort(
        (np.arange(len(graph.edge_tensor)), position_of(graph)[graph.edge_consumer], graph.edge_tensor)),
        structural=True)


def _never_far(g: OpGraph, kept_reads: tuple[tuple[str, str], ...]) -> np.ndarray:
    """Per data edge: a read no rule moves to a swap-in (an update-phase reader, a (producer type,
    consumer type) pair of ``kept_reads``, or a read a fused chain shares, ``fusion.fused_shared_reads``)."""
    def compute(graph: OpGraph) -> np.ndarray:
        never = (graph.op_phase[graph.edge_consumer] == UPDATE) | fused_shared_reads(graph)
        for producer_type, consumer_type in kept_reads:
            never |= ((graph.op_type[graph.tensor_producer[graph.edge_tensor]] == producer_type)
                      & (graph.op_type[graph.edge_consumer] == consumer_type))
        return never
    return g.cached(("never_far", kept_reads), compute, structural=True)


def _always_far(g: OpGraph) -> np.ndarray:
    """Per data edge: a read every plan moves to a swap-in, whatever its rules: a device read of a weight or slot on
    the host whose copies in are the plan's (``state.triggered_reads``); an op on the host reads it there."""
    def compute(graph: OpGraph) -> np.ndarray:
        on_host = np.zeros(graph.n_ops, bool)
        on_host[host_update_ops(graph)] = True
        return np.isin(graph.edge_tensor, triggered_reads(graph)) & ~on_host[graph.edge_consumer]
    return g.cached("always_far", compute, structural=True)


_NO_TABLE = np.zeros(1, np.int64)


def _planning_record(g: OpGraph) -> PlanningRecord:
    """What ``kernels.plan_reads`` reads of ``g`` (a view in one order and distance), built once."""
    def compute(graph: OpGraph) -> PlanningRecord:
        merge_level, merge_position = sibling_bounds(graph)
        return PlanningRecord(
            edge_order=_edges_by_tensor_slot(graph), edge_tensor=graph.edge_tensor, edge_consumer=graph.edge_consumer,
            levels=distance_levels(graph), buffers=buffer_record(graph), op_level=categorized_levels(graph),
            merge_level=merge_level, merge_position=merge_position, merge_end=merge_end_positions(graph))
    return g.cached("planning_record", compute, structural=True)


def sibling_bounds(g: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """Per op: the lowest categorized level and the earliest slot in ``g``'s order of the ops a graph pass may
    merge it with as siblings (``fusion.sibling_partners``), the largest int64 where there are none. A trigger of
    a swap-in or a recomputation an op reads never lies above the one and after the other (so it depends on none
    of them): merged, an op and its partner take over each other's edges, and a wait on what depends on one closes
    a cycle TensorFlow does not report (the zoo's custom_layer_loss split in 4 parts hung in its first call,
    docs/design.md 12). The partner itself may be one: it is waited for through its sources, as a fused chain's
    part is (``fusion.safe_wait_slots``)."""
    def compute(graph: OpGraph) -> tuple[np.ndarray, np.ndarray]:
        levels, position = categorized_levels(graph), position_of(graph)
        lowest = np.full(graph.n_ops, np.iinfo(np.int64).max, np.int64)
        earliest = lowest.copy()
        for op, partners in enumerate(sibling_partners(graph)):
            if partners:
                lowest[op] = int(levels[list(partners)].min())
                earliest[op] = int(position[list(partners)].min())
        lowest.flags.writeable = earliest.flags.writeable = False
        return lowest, earliest
    return g.cached("sibling_bounds", compute, structural=True)


def merge_end_positions(g: OpGraph) -> np.ndarray:
    """Per op: the latest slot in ``g``'s order of it and the ops a graph pass may merge it with into one node
    (``fusion.merge_partners``). The merged node runs there, after the ops the order puts before it, so a trigger
    of a swap-in or a recomputation lies before every reader by that slot too: the zoo's unet2d_transpose in 2 parts,
    in the cto order, hung on a swap-in started by the head's convolution part 1, read by its bias add part 0, which
    the order runs before the convolution's own bias add part 1 (docs/design.md 12)."""
    def compute(graph: OpGraph) -> np.ndarray:
        position = position_of(graph)
        end = position.astype(np.int64).copy()
        for op, partners in enumerate(merge_partners(graph)):
            if partners:
                end[op] = max(end[op], int(position[list(partners)].max()))
        end.flags.writeable = False
        return end
    return g.cached("merge_end_positions", compute, structural=True)


def _trigger_record(g: OpGraph, params: SwapParams) -> TriggerRecord:
    """How ``params`` picks triggers on ``g``, as ``kernels.plan_reads`` takes it (built once per view and
    policy): none (synchronous swap-ins), by level, or among the first consumer's ancestors."""
    if params.sync in SYNC_IN_MODES:
        key, mode, depth = ("trigger_record", 0), 0, 0
    elif params.trigger == "level":
        key, mode, depth = ("trigger_record", 1), 1, 0
    else:
        depth = _trigger_depth(params.ub, n_levels(g))
        key, mode = ("trigger_record", 2, depth), 2

    def compute(graph: OpGraph) -> TriggerRecord:
        tables = {name: _NO_TABLE for name in ("latest_level", "latest_op", "ancestor_ptr", "ancestor_ops",
                                               "ancestor_levels", "ancestor_key")}
        span = 0
        if mode == 1:
            tables["latest_level"], tables["latest_op"] = graph.cached("level_triggers", _level_triggers,
                                                                       structural=True)
        elif mode == 2:
            table = graph.cached(("ancestor_triggers", depth), lambda view: _ancestor_triggers(view, depth),
                                 structural=True)
            tables.update(ancestor_ptr=table["ptr"], ancestor_ops=table["ops"], ancestor_levels=table["levels"],
                          ancestor_key=table["key"])
            span = int(table["span"])
        return TriggerRecord(mode=mode, span=span, **tables)
    return g.cached(key, compute, structural=True)


def latest_triggers(g: OpGraph, first_consumer: np.ndarray, lo: np.ndarray, hi: np.ndarray, policy: str,
                    ub: int, readers: Sequence[Sequence[int]] | None = None) -> np.ndarray:
    """Per request: the latest trigger candidate on a level in ``lo..hi`` (``g``'s levels) that
    ``policy`` allows for ``first_consumer`` ("ancestor": one of its ancestors, looked up in a table
    spanning ``ub`` levels; "level": any) and that depends on no op its ``readers`` may be merged with
    (``sibling_bounds``), -1 where there is none. Recomputations (``simulator.recompute.choice``) take their
    triggers here; swap-ins by the same rules, compiled (``kernels.plan_reads``)."""
    hi = np.asarray(hi, np.int64).copy()
    trigger = _latest_in_range(g, first_consumer, lo, hi, policy, ub)
    if readers is None:
        return trigger
    levels, op_level, position = distance_levels(g), categorized_levels(g), position_of(g)
    merge_level, merge_position = sibling_bounds(g)
    merge_end = merge_end_positions(g)
    for k, group in enumerate(readers):
        group = np.asarray(group, np.int64)
        while trigger[k] >= 0 and kernels.after_partners(trigger[k], group, op_level, position, merge_level,
                                                         merge_position, merge_end):
            hi[k] = levels[trigger[k]] - 1  # the latest candidate below it
            trigger[k] = _latest_in_range(g, first_consumer[k:k + 1], lo[k:k + 1], hi[k:k + 1], policy, ub)[0]
    return trigger


def _latest_in_range(g: OpGraph, first_consumer: np.ndarray, lo: np.ndarray, hi: np.ndarray, policy: str,
                     ub: int) -> np.ndarray:
    """``latest_triggers`` without the merge limit."""
    trigger = np.full(len(first_consumer), -1, dtype=np.int64)
    if policy == "level":
        latest_level, latest_op = g.cached("level_triggers", _level_triggers, structural=True)
        found_level = latest_level[np.maximum(hi, 0)]
        ok = (hi >= 0) & (found_level >= lo)
        trigger[ok] = latest_op[np.maximum(hi, 0)][ok]
        return trigger
    depth = _trigger_depth(ub, n_levels(g))
    table = g.cached(("ancestor_triggers", depth), lambda graph: _ancestor_triggers(graph, depth), structural=True)
    start, stop = table["ptr"][first_consumer], table["ptr"][first_consumer + 1]
    # per request, the last ancestor trigger whose level <= hi: one searchsorted over all of them
    query = first_consumer * table["span"] + hi
    pick = np.searchsorted(table["key"], query, side="right") - 1
    ok = (hi >= 0) & (pick >= start) & (pick < stop)
    pick_level = np.full(len(first_consumer), -1, dtype=np.int64)
    pick_level[ok] = table["levels"][pick[ok]]
    ok &= pick_level >= lo
    trigger[ok] = table["ops"][pick[ok]]
    return trigger


def plan_swaps(g: OpGraph, params: SwapParams, *, kept_reads: tuple[tuple[str, str], ...] = ()) -> SwapPlan:
    """Apply the swap rules to ``g`` (at its batch size) and return the plan.

    A consumer of tensor t (made by u) is far when level(c) - level(u) > threshold; far consumers
    read t through a swap-in. The swap-in of a group starts when its trigger w finishes:
    the latest valid op with level(c) - ub <= level(w) <= level(c) - lb, level(w) > level(u), searched
    from level(c) - lb downward; no valid trigger (or sync "in"/"both") makes it synchronous.
    With ``params.distance == "slot"`` an op's level is its slot in the execution order.
    ``kept_reads`` (``DeviceModel.kept_reads``): (producer type, consumer type) reads that stay on
    the device whatever their distance. The rules run compiled (``kernels.plan_reads``).
    """
    g = g.with_order(params.order)
    if params.distance == "slot":
        g = slot_levels_view(g)
    forced = _always_far(g)
    candidate = _candidate_tensors(g, params)
    candidate[g.edge_tensor[forced]] = True
    swapped, in_swap, trigger, after, ptr, consumers = kernels.plan_reads(
        _planning_record(g), _trigger_record(g, params), _never_far(g, tuple(kept_reads)), forced,
        candidate, params.threshold, params.groupby, params.lb, params.ub)
    return SwapPlan(
        tensor=swapped,
        sync_out=np.full(len(swapped), params.sync in ("out", "both")),
        in_swap=in_swap,
        in_trigger=trigger,
        in_after=after,
        in_consumer_ptr=ptr,
        in_consumers=consumers,
        order=execution_order(g),
        order_name=g.order,
        graph_fingerprint=g.fingerprint(),
        params=params,
        batch_size=g.batch_size,
        after_copies_out=params.after_copies_out,
    )
