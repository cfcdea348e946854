"""Which tensors to recompute: candidates with their chain, cost and trigger, and the choice among them.

``recompute_candidates`` finds, per tensor, the chain of whitelisted forward ops
(``simulator.recompute.actions.RECOMPUTE_CLASSES``) back to tensors that are kept anyway (read far by the
backward pass themselves, resident, or too small to matter), what it costs (seconds on a device)
and what it frees, and a trigger (as a swap-in's: ``simulator.planning.latest_triggers``);
``choose_recomputes`` picks among them by op class and cost per byte (``RecomputeParams``). The
picked candidates become ``Recompute`` actions (``actions_of``) that ``with_recomputes`` builds.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from simulator.device.presets import DeviceModel
from simulator.graph import BACKWARD, FORWARD, Analysis, OpGraph, alias_roots
from simulator.ordering import categorized_levels, execution_order, position_of
from simulator.params import TRIGGER_POLICIES, ParamsError, SwapParams
from simulator.plan import SwapPlan
from simulator.planning import latest_triggers
from simulator.recompute.actions import CHEAP_CLASSES, RECOMPUTE_SCOPES, Recompute, inputs_of, recomputable_types, with_recomputes
from simulator.replay import Replay, op_seconds

@dataclass(frozen=True)
class RecomputeParams:
    """What may be recomputed (``SwapParams``' recompute fields, ``from_swap_params``, plus the
    rules the search does not vary).

    classes: the op classes of ``RECOMPUTE_CLASSES`` that may be cloned.
    max_seconds_per_byte: the cost threshold (device seconds per byte freed, at the graph's batch).
    tensors: tensors (by name) recomputed whatever their cost, when they are candidates at all.
    min_distance: a backward reader more than this many levels after the tensor's producer is far.
    max_ops: the longest chain of ops one recomputation clones.
    min_bytes: tensors smaller than this (at the graph's batch) are not recomputed.
    lb, ub, trigger: the trigger window and policy, as for swap-ins (``SwapParams``); the latest
      trigger is the best one: clones run on the compute stream wherever they are, so a late start
      only shortens the time their outputs hold memory.
    """

    classes: tuple[str, ...] = CHEAP_CLASSES
    max_seconds_per_byte: float = math.inf
    tensors: tuple[str, ...] = ()
    min_distance: int = 2
    max_ops: int = 40
    min_bytes: int = 1 << 20
    lb: int = 1
    ub: int = 16
    trigger: str = "ancestor"

    def __post_init__(self) -> None:
        for name in ("classes", "tensors"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(item, str) for item in value):
                raise ParamsError(f"{name} must be a list of names, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        try:
            recomputable_types(self.classes)
        except ValueError as error:
            raise ParamsError(str(error)) from None
        if not (isinstance(self.max_seconds_per_byte, (int, float)) and self.max_seconds_per_byte >= 0):
            raise ParamsError(f"max_seconds_per_byte must be a non-negative number, got {self.max_seconds_per_byte!r}")
        for name in ("min_distance", "max_ops", "lb", "ub"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ParamsError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, (int, np.integer)) or self.min_bytes < 0:
            raise ParamsError(f"min_bytes must be a non-negative integer, got {self.min_bytes!r}")
        if self.lb > self.ub:
            raise ParamsError(f"lb ({self.lb}) must not exceed ub ({self.ub})")
        if self.trigger not in TRIGGER_POLICIES:
            raise ParamsError(f"trigger must be one of {TRIGGER_POLICIES}, got {self.trigger!r}")

    @classmethod
    def from_swap_params(cls, params: SwapParams) -> "RecomputeParams | None":
        """The recompute rules of a plan's parameters (None: they recompute nothing). Named tensors
        alone (``recompute="none"``) may use every cheap class."""
        if not params.recomputes:
            return None
        if params.recompute == "none":  # no cost rule: only the named tensors
            return cls(classes=CHEAP_CLASSES, max_seconds_per_byte=0.0, tensors=params.recompute_tensors)
        return cls(classes=RECOMPUTE_SCOPES[params.recompute], max_seconds_per_byte=params.recompute_cost,
                   tensors=params.recompute_tensors)


@dataclass(frozen=True)
class Candidate:
    """A tensor that can be recomputed, as indices of the graph it was found in: the ops to clone
    (producers first), their sources, the far readers, the trigger, the device seconds the clones
    take and the bytes freed (the tensor's, less the sources that would be kept only for it)."""

    tensor: int
    ops: tuple[int, ...]
    sources: tuple[int, ...]
    consumers: tuple[int, ...]
    trigger: int
    seconds: float
    freed_bytes: int
    extra_bytes: int = 0

    @property
    def seconds_per_byte(self) -> float:
        return self.seconds / self.freed_bytes if self.freed_bytes > 0 else math.inf

    def action(self, g: OpGraph) -> Recompute:
        return Recompute(tensor=g.tensor_name(self.tensor), ops=tuple(str(g.op_name[op]) for op in self.ops),
                         trigger=str(g.op_name[self.trigger]), consumers=tuple(str(g.op_name[c]) for c in self.consumers))


@dataclass(frozen=True)
class _Reads:
    """Per tensor of a graph: its far backward readers and whether it is kept anyway."""

    far: list[list[int]]
    near_last_level: np.ndarray  # highest level of a reader that is not far (-1: none)
    late_reader: np.ndarray  # read by an op neither forward nor backward (an update): never freed early
    kept: np.ndarray  # resident, not growing with the batch, a step output or read far itself


def _reads(g: OpGraph, min_distance: int) -> _Reads:
    levels = categorized_levels(g)
    producer_level = levels[g.tensor_producer[g.edge_tensor]]
    consumer_level = levels[g.edge_consumer]
    consumer_phase = g.op_phase[g.edge_consumer]
    is_far = (consumer_phase == BACKWARD) & (consumer_level - producer_level > min_distance)
    far: list[list[int]] = [[] for _ in range(g.n_tensors)]
    for tensor, consumer in zip(g.edge_tensor[is_far].tolist(), g.edge_consumer[is_far].tolist()):
        if consumer not in far[tensor]:
            far[tensor].append(consumer)
    near_last = np.full(g.n_tensors, -1, dtype=np.int64)
    np.maximum.at(near_last, g.edge_tensor[~is_far], consumer_level[~is_far])
    late = np.zeros(g.n_tensors, bool)
    late[g.edge_tensor[~np.isin(consumer_phase, (FORWARD, BACKWARD))]] = True
    read_far = np.zeros(g.n_tensors, bool)
    read_far[g.edge_tensor[is_far]] = True
    # a buffer shared through aliases is kept when any tensor in it is read far
    root = alias_roots(g)
    group_far = np.zeros(g.n_tensors, bool)
    group_far[root[read_far]] = True
    is_output = np.zeros(g.n_tensors, bool)
    is_output[g.outputs] = True
    kept = (g.tensor_persistent | (g.tensor_bytes_ab[:, 1] <= 0) | is_output | group_far[root] | late)
    return _Reads(far=far, near_last_level=near_last, late_reader=late, kept=kept)


class _CandidateSearch:
    """What ``recompute_candidates`` and the choice need of one graph at one batch size, on one
    device, under one set of rules; candidates for any set of tensors already recomputed."""

    def __init__(self, g: OpGraph, device: DeviceModel, params: RecomputeParams) -> None:
        self.g, self.params = g, params
        self.allowed = (g.op_phase == FORWARD) & np.isin(g.op_type, list(recomputable_types(params.classes)))
        self.levels = categorized_levels(g)
        self.reads = g.cached(("recompute_reads", params.min_distance),
                              lambda graph: _reads(graph, params.min_distance), structural=True)
        self.sizes = g.tensor_bytes
        self.read_by = inputs_of(g)
        self.seconds = op_seconds(g, device)
        root = alias_roots(g)
        aliased = np.zeros(g.n_tensors, bool)
        aliased[root[g.tensor_alias_of >= 0]] = True
        is_output = np.zeros(g.n_tensors, bool)
        is_output[g.outputs] = True
        eligible = (self.allowed[g.tensor_producer] & (g.tensor_alias_of < 0) & ~aliased & ~g.tensor_persistent
                    & (g.tensor_bytes_ab[:, 1] > 0) & (self.sizes >= params.min_bytes) & ~self.reads.late_reader
                    & ~is_output)
        self.targets = [t for t in np.flatnonzero(eligible).tolist() if self.reads.far[t]]
        self.eligible = frozenset(self.targets)

    def candidates(self, recomputed: frozenset[int]) -> list[Candidate]:
        found = (self.candidate(t, recomputed) for t in self.targets if t not in recomputed)
        return [c for c in found if c is not None]

    def candidate(self, tensor: int, recomputed: frozenset[int]) -> Candidate | None:
        """``tensor``'s recomputation with ``recomputed`` (other tensors) freed early, or None."""
        if tensor not in self.eligible:
            return None
        g, params, levels = self.g, self.params, self.levels
        kept = self.reads.kept
        chain = _chain(int(g.tensor_producer[tensor]), self.allowed, lambda t: kept[t] and t not in recomputed,
                       self.read_by, g.tensor_producer, params.max_ops)
        if chain is None:
            return None
        ops, sources = chain
        extra_bytes = int(sum(int(self.sizes[s]) for s in sources if not kept[s] or s in recomputed))
        freed = int(self.sizes[tensor]) - extra_bytes
        if freed <= 0:
            return None
        consumers = tuple(sorted(self.reads.far[tensor], key=lambda c: (levels[c], c)))
        first = consumers[0]
        floor = max([int(levels[g.tensor_producer[s]]) for s in sources]
                    + [int(levels[g.tensor_producer[tensor]]), int(self.reads.near_last_level[tensor])])
        hi = int(levels[first]) - params.lb
        lo = max(int(levels[first]) - params.ub, floor + 1)
        trigger = int(latest_triggers(g, np.asarray([first], np.int64), np.asarray([lo], np.int64),
                                      np.asarray([hi], np.int64), params.trigger, params.ub, [consumers])[0])
        if trigger < 0:
            return None
        return Candidate(tensor=tensor, ops=tuple(ops), sources=tuple(sources), consumers=consumers, trigger=trigger,
                         seconds=float(self.seconds[list(ops)].sum()), freed_bytes=freed, extra_bytes=extra_bytes)

    def add(self, chosen: dict[int, Candidate], tensor: int, *, max_seconds_per_byte: float = math.inf,
            max_seconds: float = math.inf, reclone_readers: bool = True) -> float | None:
        """Recompute ``tensor`` too, if it can be and that costs at most ``max_seconds_per_byte``
        per byte it frees and ``max_seconds`` in all: the recomputations that read it (a source)
        then clone it again instead, and what that adds counts; or (``reclone_readers`` false) they
        keep reading the original, which the swap plan then keeps or swaps for them. Updates
        ``chosen``; returns the seconds added, None when not."""
        if tensor in chosen:
            return None
        before = frozenset(chosen)
        own = self.candidate(tensor, before)
        if own is None:
            return None
        after = before | {tensor}
        readers = [c for c in chosen.values() if tensor in c.sources] if reclone_readers else []
        redone = [self.candidate(c.tensor, after) for c in readers]
        if any(c is None for c in redone):
            return None
        seconds = own.seconds + sum(new.seconds - old.seconds for new, old in zip(redone, readers))
        freed = own.freed_bytes + sum(new.freed_bytes - old.freed_bytes for new, old in zip(redone, readers))
        if freed <= 0 or seconds > max_seconds or seconds > max_seconds_per_byte * freed:
            return None
        chosen[tensor] = own
        chosen.update((c.tensor, c) for c in redone)
        return seconds


def recompute_candidates(g: OpGraph, device: DeviceModel, params: RecomputeParams, *,
                         recomputed: frozenset[int] = frozenset()) -> list[Candidate]:
    """Every tensor of ``g`` that ``params`` lets be recomputed, with its chain, cost and trigger.

    A tensor qualifies when a whitelisted forward op made it, it owns its buffer (no alias of it is
    read far), it grows with the batch, is at least ``min_bytes`` (at g's batch), is read far by
    the backward pass and by no update, and is not a step output. Its chain walks back from its
    producer through inputs that are not kept anyway (read only near their producer, so recomputing
    them costs no memory) and are made by whitelisted ops, at most ``max_ops`` ops; it stops at kept
    inputs (sources) and at inputs no class allows, which become sources too and count against the
    bytes freed (``extra_bytes``): they would live on for the clones alone. The trigger is the
    latest trigger candidate (``planning._trigger_candidates``) between ``ub`` and ``lb``
    levels before the first far reader, after the last near reader and after every source is made;
    without one the tensor is no candidate (its clones would run beside their sources).
    ``recomputed``: tensors already recomputed by other actions; their originals are freed early, so
    a chain walks through them (clones them again) instead of reading them, and they are no candidates.
    """
    return _CandidateSearch(g, device, params).candidates(frozenset(recomputed))


def _chain(producer: int, allowed: np.ndarray, kept, read_by: list[list[tuple[int, int]]],
           tensor_producer: np.ndarray, max_ops: int) -> tuple[list[int], list[int]] | None:
    """The ops to clone for an output of ``producer`` (producers first) and their sources; None when
    the chain would be longer than ``max_ops`` or ``producer`` may not be cloned."""
    if not allowed[producer]:
        return None
    ops = {producer}
    sources: list[int] = []
    stack = [producer]
    while stack:
        op = stack.pop()
        for tensor, _ in read_by[op]:
            maker = int(tensor_producer[tensor])
            if maker in ops or tensor in sources:
                continue
            if kept(tensor) or not allowed[maker]:
                sources.append(tensor)
                continue
            ops.add(maker)
            if len(ops) > max_ops:
                return None
            stack.append(maker)
    # producers first: a topological order of the chain (by the longest path to its sources)
    depth: dict[int, int] = {}

    def level(op: int) -> int:
        if op not in depth:
            depth[op] = 1 + max((level(int(tensor_producer[t])) for t, _ in read_by[op]
                                 if int(tensor_producer[t]) in ops), default=-1)
        return depth[op]

    return sorted(ops, key=lambda op: (level(op), op)), sources


def choose_recomputes(g: OpGraph, device: DeviceModel, params: RecomputeParams) -> list[Candidate]:
    """The candidates ``params`` picks: ranked by seconds per byte freed, each taken when it costs
    at most ``max_seconds_per_byte``, counting what it adds to those taken before that read it
    (they clone it again instead of holding it). The named ``tensors`` come last, whatever they
    cost, recomputed for their own far readers only: the recomputations reading one keep reading
    the original (the per-tensor pass names tensors whose swap-ins the step waits for; cloning
    them again for every reader would cost more than the wait). Sorted by tensor (the order their
    actions are named in)."""
    analysis = _CandidateSearch(g, device, params)
    chosen: dict[int, Candidate] = {}
    ranked = sorted((c for c in analysis.candidates(frozenset()) if c.seconds_per_byte <= params.max_seconds_per_byte),
                    key=lambda c: (c.seconds_per_byte, c.tensor))
    for candidate in ranked:
        analysis.add(chosen, candidate.tensor, max_seconds_per_byte=params.max_seconds_per_byte)
    if params.tensors:
        index = g.tensor_index()
        for name in params.tensors:
            if name in index:
                analysis.add(chosen, index[name], reclone_readers=False)
    return sorted(chosen.values(), key=lambda c: c.tensor)


def chosen_recomputes(g: OpGraph, device: DeviceModel, params: RecomputeParams) -> list[Candidate]:
    """``choose_recomputes``, once per graph, batch size, device and parameters (shared: do not modify)."""
    return g.cached(("recompute_choice", device, params), lambda graph: choose_recomputes(graph, device, params),
                    structural=False)


def actions_of(g: OpGraph, chosen: Sequence[Candidate]) -> list[Recompute]:
    """The chosen candidates as plan actions, in a stable order (by tensor)."""
    return [c.action(g) for c in sorted(chosen, key=lambda c: c.tensor)]


# how many transformed graphs (one per distinct choice of recomputations) a graph keeps: every batch size
# and every swap plan of one choice share one graph's structural analyses (levels, orders, buffers)
RECOMPUTED_GRAPHS_KEPT = 64


class _RecentGraphs:
    """The transformed graphs of a graph's recent choices, by actions (memoised on that graph, so a
    capture with the same names at other sizes never sees them); the lock keeps eviction thread-safe."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[Recompute, ...], OpGraph] = {}
        self.lock = threading.Lock()

    def get(self, g: OpGraph, actions: tuple[Recompute, ...]) -> OpGraph:
        with self.lock:
            found = self.graphs.get(actions)
        if found is not None:
            return found
        made = with_recomputes(g, list(actions))
        with self.lock:
            while len(self.graphs) >= RECOMPUTED_GRAPHS_KEPT:
                self.graphs.pop(next(iter(self.graphs)))
            return self.graphs.setdefault(actions, made)


# shared by every view of one capture (orders, distances, batch sizes), never by another capture
RECENT_GRAPHS = Analysis("recent_recomputed_graphs", lambda g: _RecentGraphs(), scope="graph")


def recomputed_graph(g: OpGraph, params: SwapParams, device: DeviceModel) -> tuple[OpGraph, list[Recompute]]:
    """``g`` with the recomputations ``params`` choose (``RecomputeParams.from_swap_params``) and
    those actions; ``g`` itself and no actions when they recompute nothing. The swap rules then
    apply to the graph returned."""
    rules = RecomputeParams.from_swap_params(params)
    if rules is None:
        return g, []
    actions = actions_of(g, chosen_recomputes(g, device, rules))
    if not actions:
        return g, []
    transformed = RECENT_GRAPHS(g).get(g, tuple(actions))
    return transformed.with_batch(g.batch_size).with_order(g.order), actions


def swap_in_stalls(g: OpGraph, plan: SwapPlan, result: Replay) -> dict[int, float]:
    """Per swapped tensor (index in ``g``, the graph ``plan`` was made for): the seconds the step
    waited for its swap-ins, where a swap-in was the last thing its consumer waited for."""
    position = position_of(g.with_order(plan.order_name))
    order = plan.order if plan.order is not None else execution_order(g)
    stalls: dict[int, float] = {}
    for j in range(plan.n_swap_ins):
        consumer = int(plan.in_consumers[plan.in_consumer_ptr[j]])
        slot = int(position[consumer])
        ready = float(result.op_end_s[order[slot - 1]]) if slot > 0 else 0.0
        start = float(result.op_start_s[consumer])
        if start - ready > 1e-12 and result.swap_in_end_s[j] >= start - 1e-12:
            tensor = int(plan.tensor[plan.in_swap[j]])
            stalls[tensor] = stalls.get(tensor, 0.0) + start - ready
    return stalls


def _per_tensor_analysis(g: OpGraph, device: DeviceModel, params: SwapParams) -> tuple[_CandidateSearch, dict[int, Candidate]]:
    """The per-tensor pass's analysis (every class ``params.recompute`` allows, any cost) and what
    ``params`` recompute already."""
    rules = RecomputeParams.from_swap_params(params)
    scope = RecomputeParams(classes=RECOMPUTE_SCOPES[params.recompute] if params.recompute != "none"
                            else CHEAP_CLASSES)
    chosen = {c.tensor: c for c in (chosen_recomputes(g, device, rules) if rules is not None else [])}
    return _CandidateSearch(g, device, scope), chosen


def stalled_recomputes(g: OpGraph, device: DeviceModel, params: SwapParams, transformed: OpGraph, plan: SwapPlan,
                       result: Replay) -> tuple[tuple[str, ...], float]:
    """Tensors of ``g`` to recompute instead of swapping: swapped in ``plan`` (made on
    ``transformed``, ``g`` with ``params``' recomputations), their swap-ins waited for, and their
    recomputation for their own far readers costs less than that wait
    (``SwapParams.recompute_per_tensor``); the longest waits first. And the seconds that should
    save (the waits less the recomputations)."""
    stalls = swap_in_stalls(transformed, plan, result)
    if not stalls:
        return (), 0.0
    analysis, chosen = _per_tensor_analysis(g, device, params)
    index = g.tensor_index()
    added, saved_s = [], 0.0
    for tensor, wait in sorted(stalls.items(), key=lambda item: -item[1]):
        name = transformed.tensor_name(tensor)
        seconds = analysis.add(chosen, index[name], max_seconds=wait, reclone_readers=False) if name in index else None
        if seconds is not None:
            added.append(name)
            saved_s += wait - seconds
    return tuple(added), saved_s
