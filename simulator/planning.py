"""Swap rules: which tensors go to the host, which consumers read them back, what starts the swap-in.

``plan_swaps(g, params)`` applies the rules of docs/design.md 1.4 to a graph and returns a ``SwapPlan``:
plain data that the replay simulates and the rewriter applies to the real graph as-is.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import numpy as np

from simulator import kernels
from simulator.buffers import buffers, rewired_lifetimes
from simulator.graph import BACKWARD, FORWARD, UPDATE, GraphError, OpGraph
from simulator.ordering import (categorized_levels, edge_distances, execution_order, n_levels, position_of,
                                slot_levels_view)
from simulator.recompute import RECOMPUTE_SCOPES

SYNC_MODES = ("none", "out", "in", "both")
SYNC_IN_MODES = ("in", "both")  # swap-ins wait for the consumer's other inputs: no trigger window
SWAP_SCOPES = ("activations", "all")  # SwapParams.tensors
DISTANCES = ("level", "slot")  # SwapParams.distance
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "complex64", "complex128"})
TRIGGER_POLICIES = ("ancestor", "level")

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


class ParamsError(ValueError):
    """Swap parameters that make no sense (lb > ub, non-positive values, unknown modes)."""


RECOMPUTE_FIELDS = ("recompute", "recompute_cost", "recompute_per_tensor", "recompute_tensors")


@dataclass(frozen=True)
class SwapParams:
    """The knobs of the swap rules; see docs/design.md 1.4.

    threshold: a consumer is far when its level distance from the producer is > threshold.
    lb, ub: the swap-in trigger lies between ``ub`` and ``lb`` levels before the far consumer.
    groupby: far consumers of one tensor within ``groupby`` levels of the group's first share a swap-in.
    sync: "none", "out" (near consumers wait for the swap-out; with none, the op after the producer
      does, so the device buffer is free before the step goes on), "in" (no early trigger: the
      swap-in waits for the consumer's other inputs) or "both".
    min_bytes: tensors smaller than this (at the plan's batch size) are never swapped.
    include_types/exclude_types/exclude_scopes: filter the producing ops by type or name prefix.
    trigger: "ancestor" takes triggers among the ancestors of the first far consumer (steadier in
      real runs), "level" takes any valid op on the level.
    order: the execution order ("cto": level by level; "memory": a memory-aware topological
      order, see ``simulator.ordering``); the rewriter chains the real step in it.
    tensors: what may be swapped. "activations": the float tensors the forward pass makes, as in
      LMS. "all": also what the backward pass makes and reads much later (a U-Net's gradients that
      wait across a skip connection for the branch that joins them) and integer tensors TF keeps
      on the device (the labels Keras' sparse losses cast to int64).
    distance: what threshold, lb, ub and groupby count. "level": CTO levels, as in LMS (ops of one
      level are independent, so a level can hold many ops). "slot": steps of the execution order,
      one op each: a swap-in can then be started by the op just before its reader, and reads of
      one level that the order runs far apart (the parts of a split convolution's gradient, an op
      the memory order sinks) are far.
    keep_tensors: tensors (by name, "op:output") never swapped whatever the rules say; the host-
      room pass (``simulator.host_room``) names there what it keeps on the device for the host's sake.
    recompute: which ops may be cloned to recompute a tensor for its far readers instead of keeping
      or swapping it ("none", "cheap": elementwise, activations, normalization, shapes, stateless
      random; "expensive": convolutions and matrix products too; ``simulator.recompute``). The
      recomputations are made first (``simulator.recompute_choice.recomputed_graph``) and the swap
      rules then apply to the graph that holds them.
    recompute_cost: the most device seconds a recomputation may cost per byte it frees.
    recompute_per_tensor: per swapped tensor whose swap-in the step waits for, recompute it instead
      where that takes less than the wait (the link cannot hide the swap; the search's per-tensor
      pass, ``autotune.search.TuningProblem.evaluate``, names them in ``recompute_tensors``).
    recompute_tensors: tensors (by name) recomputed whatever the cost rule says, when they can be.
    after_copies_out: a swap-in starts only once the op it starts after (its trigger; for a
      synchronous one, the last of its consumer's other inputs) has its own swapped outputs copied
      out, instead of beside those copies: while an op waits for its swap-ins, the buffers its
      predecessor's outputs are copied out of and the swap-ins' buffers are then never on the
      device together (a later start: more waiting, less memory).
    """

    threshold: int
    lb: int = 1
    ub: int = 10
    groupby: int = 0
    sync: str = "none"
    min_bytes: int = 0
    include_types: tuple[str, ...] = ()
    exclude_types: tuple[str, ...] = ()
    exclude_scopes: tuple[str, ...] = ()
    trigger: str = "ancestor"
    order: str = "cto"
    tensors: str = "activations"
    distance: str = "level"
    after_copies_out: bool = False
    keep_tensors: tuple[str, ...] = ()
    recompute: str = "none"
    recompute_cost: float = math.inf
    recompute_per_tensor: bool = False
    recompute_tensors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.tensors not in SWAP_SCOPES:
            raise ParamsError(f"tensors must be one of {SWAP_SCOPES}, got {self.tensors!r}")
        if self.distance not in DISTANCES:
            raise ParamsError(f"distance must be one of {DISTANCES}, got {self.distance!r}")
        for name in ("threshold", "lb", "ub"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ParamsError(f"{name} must be a positive integer, got {value!r}")
        for name in ("groupby", "min_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ParamsError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.after_copies_out, (bool, np.bool_)):
            raise ParamsError(f"after_copies_out must be true or false, got {self.after_copies_out!r}")
        object.__setattr__(self, "after_copies_out", bool(self.after_copies_out))
        if self.lb > self.ub:
            raise ParamsError(f"lb ({self.lb}) must not exceed ub ({self.ub})")
        if self.sync not in SYNC_MODES:
            raise ParamsError(f"sync must be one of {SYNC_MODES}, got {self.sync!r}")
        if self.trigger not in TRIGGER_POLICIES:
            raise ParamsError(f"trigger must be one of {TRIGGER_POLICIES}, got {self.trigger!r}")
        from simulator.ordering import ORDERS

        if self.order not in ORDERS:
            raise ParamsError(f"order must be one of {tuple(ORDERS)}, got {self.order!r}")
        if self.recompute not in RECOMPUTE_SCOPES:
            raise ParamsError(f"recompute must be one of {tuple(RECOMPUTE_SCOPES)}, got {self.recompute!r}")
        cost = math.inf if self.recompute_cost is None else self.recompute_cost  # None: JSON's infinity
        if isinstance(cost, bool) or not isinstance(cost, (int, float, np.integer, np.floating)) or not cost >= 0:
            raise ParamsError(f"recompute_cost must be a non-negative number of seconds per byte, got {cost!r}")
        object.__setattr__(self, "recompute_cost", float(cost))
        if not isinstance(self.recompute_per_tensor, (bool, np.bool_)):
            raise ParamsError(f"recompute_per_tensor must be true or false, got {self.recompute_per_tensor!r}")
        object.__setattr__(self, "recompute_per_tensor", bool(self.recompute_per_tensor))
        for name in ("include_types", "exclude_types", "exclude_scopes", "keep_tensors", "recompute_tensors"):
            value = getattr(self, name)
            try:
                items = tuple(value) if not isinstance(value, str) else None
            except TypeError:
                items = None
            if items is None or not all(isinstance(item, str) for item in items):
                raise ParamsError(f"{name} must be a list of strings, got {value!r}")
            object.__setattr__(self, name, items)
        for name in ("threshold", "lb", "ub", "groupby", "min_bytes"):
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def recomputes(self) -> bool:
        """Whether these parameters recompute anything (else the swap rules alone make the plan)."""
        return self.recompute != "none" or bool(self.recompute_tensors)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; parameters that recompute nothing leave the recompute fields out (they read
        as before recomputation existed)."""
        data = {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}
        if not self.recomputes:
            for name in RECOMPUTE_FIELDS:
                del data[name]
        elif math.isinf(self.recompute_cost):
            data["recompute_cost"] = None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SwapParams":
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ParamsError(f"unknown swap parameter(s): {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class SwapIn:
    """One swap-in: the consumers it feeds and the op whose completion starts it (None: synchronous).

    ``after`` is derived by the plan (see ``SwapPlan``); it is ignored when building a plan.
    """

    consumers: tuple[int, ...]
    trigger: int | None
    after: int | None = None


@dataclass(frozen=True)
class Swap:
    tensor: int
    sync_out: bool
    swap_ins: tuple[SwapIn, ...]


@dataclass(frozen=True, eq=False)
class SwapPlan:
    """Which tensors to swap and how, as flat arrays (the replay's hot path reads them directly).

    Swap i moves tensor ``tensor[i]`` out; swap-in j brings back ``tensor[in_swap[j]]`` for the
    consumers ``in_consumers[in_consumer_ptr[j]:in_consumer_ptr[j+1]]``, started by op
    ``in_trigger[j]`` (-1: synchronous, waits for the consumer's other inputs). A swap-in never
    starts before op ``in_after[j]``: the last reader of the original buffer (first swap-in of a
    tensor) or the last consumer of the previous swap-in, so one tensor never has two device
    copies at once; a synchronous swap-in carries it as a control edge.

    With ``after_copies_out`` a swap-in also waits for the copies out of what the op it starts
    after made (``SwapParams.after_copies_out``).

    ``order`` is the execution order the replay assumed (op indices). The rewriter chains the real
    step in this order with control edges: left to itself, TF's executor picks its own order among
    ready ops, which moves the peak by 10-30% once swaps are in the graph (measured on the CPU
    testbed: a 3D U-Net ran 0.78x its prediction unchained and 0.99x chained).
    """

    tensor: np.ndarray
    sync_out: np.ndarray
    in_swap: np.ndarray
    in_trigger: np.ndarray
    in_after: np.ndarray
    in_consumer_ptr: np.ndarray
    in_consumers: np.ndarray
    order: np.ndarray | None = None
    order_name: str = "cto"
    graph_fingerprint: str = ""
    params: SwapParams | None = None
    batch_size: int | None = None
    after_copies_out: bool = False
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def empty(cls, g: OpGraph | None = None) -> "SwapPlan":
        nothing = np.zeros(0, dtype=np.int64)
        return cls(nothing, np.zeros(0, bool), nothing, nothing, nothing, np.zeros(1, np.int64), nothing,
                   order=None if g is None else execution_order(g), order_name="cto" if g is None else g.order,
                   graph_fingerprint=g.fingerprint() if g is not None else "",
                   batch_size=None if g is None else g.batch_size)

    @classmethod
    def from_swaps(cls, g: OpGraph, swaps: list[Swap], params: SwapParams | None = None,
                   after_copies_out: bool | None = None) -> "SwapPlan":
        """Build a plan from readable records (hand-made plans, JSON, tests)."""
        position = position_of(g)
        tensors, sync_out, in_swap, in_trigger, ptr, consumers = [], [], [], [], [0], []
        for index, swap in enumerate(swaps):
            tensors.append(swap.tensor)
            sync_out.append(swap.sync_out)
            for swap_in in sorted(swap.swap_ins, key=lambda s: min((position[c] for c in s.consumers), default=-1)):
                if not swap_in.consumers:
                    raise GraphError(f"swap-in of tensor {g.tensor_name(swap.tensor)} has no consumers")
                in_swap.append(index)
                in_trigger.append(-1 if swap_in.trigger is None else swap_in.trigger)
                consumers.extend(sorted(swap_in.consumers, key=lambda c: position[c]))
                ptr.append(len(consumers))
        tensor = np.asarray(tensors, np.int64)
        in_swap_array = np.asarray(in_swap, np.int64)
        ptr_array = np.asarray(ptr, np.int64)
        consumer_array = np.asarray(consumers, np.int64)
        plan = cls(tensor, np.asarray(sync_out, bool), in_swap_array, np.asarray(in_trigger, np.int64),
                   _after_ops(g, tensor[in_swap_array], ptr_array, consumer_array), ptr_array, consumer_array,
                   order=execution_order(g), order_name=g.order, graph_fingerprint=g.fingerprint(), params=params,
                   batch_size=g.batch_size,
                   after_copies_out=bool(params is not None and params.after_copies_out
                                         if after_copies_out is None else after_copies_out))
        validate_plan(g, plan)
        return plan

    # ------------------------------------------------------------------ reading

    @property
    def n_swaps(self) -> int:
        return len(self.tensor)

    @property
    def n_swap_ins(self) -> int:
        return len(self.in_swap)

    @property
    def changes_step(self) -> bool:
        """Whether applying it does anything the unswapped prediction does not assume: swaps, or
        the step run in another order than level order (the memory order alone can be the plan)."""
        return bool(self.n_swaps) or self.order_name != "cto"

    def __len__(self) -> int:
        return self.n_swaps

    def swaps(self) -> Iterator[Swap]:
        """The plan as readable records."""
        by_swap: dict[int, list[SwapIn]] = {i: [] for i in range(self.n_swaps)}
        for j in range(self.n_swap_ins):
            consumers = tuple(int(c) for c in self.in_consumers[self.in_consumer_ptr[j]:self.in_consumer_ptr[j + 1]])
            trigger = int(self.in_trigger[j])
            by_swap[int(self.in_swap[j])].append(SwapIn(consumers, None if trigger < 0 else trigger, int(self.in_after[j])))
        for i in range(self.n_swaps):
            yield Swap(int(self.tensor[i]), bool(self.sync_out[i]), tuple(by_swap[i]))

    def swapped_bytes(self, g: OpGraph) -> int:
        return int(g.tensor_bytes[self.tensor].sum())

    # ------------------------------------------------------------------ files

    def to_dict(self, g: OpGraph) -> dict[str, Any]:
        """Names, not indices, so the rewriter can apply the plan to the real graph."""
        if self.graph_fingerprint and self.graph_fingerprint != g.fingerprint():
            raise GraphError("this plan was made for another graph")
        swaps = []
        for swap in self.swaps():
            swaps.append({
                "tensor": g.tensor_name(swap.tensor),
                "bytes": int(g.tensor_bytes[swap.tensor]),
                "sync_out": swap.sync_out,
                "swap_ins": [
                    {"consumers": [str(g.op_name[c]) for c in swap_in.consumers],
                     "trigger": None if swap_in.trigger is None else str(g.op_name[swap_in.trigger]),
                     "after": str(g.op_name[swap_in.after])}
                    for swap_in in swap.swap_ins
                ],
            })
        plan = {
            "format": "swap-plan/1",
            "graph_fingerprint": g.fingerprint(),
            "model": g.meta.get("model", ""),
            "batch_size": self.batch_size if self.batch_size is not None else g.batch_size,
            "params": None if self.params is None else self.params.to_dict(),
            "swaps": swaps,
            "after_copies_out": self.after_copies_out,
            "ordering": self.order_name,
            "order": [] if self.order is None else [str(name) for name in g.op_name[self.order]],
        }
        if g.meta.get("graph_rewrites"):  # the graph is of the rewritten step: the rewriter redoes them
            plan["graph_rewrites"] = list(g.meta["graph_rewrites"])
        if g.meta.get("step_inputs"):  # the shapes it was captured at (open dimensions): the rewriter uses them
            plan["step_inputs"] = dict(g.meta["step_inputs"])
        return plan

    def to_json(self, g: OpGraph, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(g), indent=kwargs.pop("indent", 1), **kwargs)

    @classmethod
    def from_dict(cls, g: OpGraph, data: dict[str, Any]) -> "SwapPlan":
        """Rebuild a plan on ``g`` by name; names ``g`` does not have make a clear GraphError."""
        if not isinstance(data, dict) or data.get("format") != "swap-plan/1":
            raise GraphError("not a swap plan (expected a JSON object with format 'swap-plan/1')")
        ops, tensors = g.op_index(), g.tensor_index()
        missing: list[str] = []

        def op(name: str | None) -> int | None:
            if name is None:
                return None
            if name not in ops:
                missing.append(name)
                return -1
            return ops[name]

        swaps = []
        for record in data.get("swaps", []):
            tensor = tensors.get(record["tensor"])
            if tensor is None:
                missing.append(record["tensor"])
                continue
            swap_ins = tuple(
                SwapIn(tuple(op(c) for c in item["consumers"]), op(item.get("trigger")))
                for item in record["swap_ins"]
            )
            swaps.append(Swap(tensor, bool(record.get("sync_out", False)), swap_ins))
        if missing:
            shown = ", ".join(missing[:3])
            raise GraphError(f"the plan names {len(missing)} op(s)/tensor(s) this graph does not have "
                             f"(e.g. {shown}): it was made for another model or version")
        params = SwapParams.from_dict(data["params"]) if data.get("params") else None
        try:
            g = g.with_order(data.get("ordering", "cto"))
        except GraphError as error:
            raise GraphError(f"the plan's ordering is not known: {error}") from None
        plan = cls.from_swaps(g, swaps, params, after_copies_out=bool(data.get("after_copies_out", False)))
        object.__setattr__(plan, "batch_size", data.get("batch_size"))
        return plan

    @classmethod
    def from_json(cls, g: OpGraph, text: str) -> "SwapPlan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise GraphError(f"the plan is not valid JSON ({error})") from None
        return cls.from_dict(g, data)


def validate_plan(g: OpGraph, plan: SwapPlan) -> None:
    """Reject plans the rewriter could not apply: a consumer that does not read the tensor, a trigger
    that runs after (or depends on) the consumer, a tensor that cannot live on the host."""
    position = position_of(g)
    reads = set(zip(g.edge_tensor.tolist(), g.edge_consumer.tolist()))
    if len(set(plan.tensor.tolist())) != plan.n_swaps:
        raise GraphError("a tensor is swapped twice in one plan")
    for swap in plan.swaps():
        name = g.tensor_name(swap.tensor)
        if g.tensor_persistent[swap.tensor] or not g.tensor_swappable[swap.tensor]:
            raise GraphError(f"tensor {name} cannot be swapped (variable, or a dtype/placement without a host copy)")
        if not swap.swap_ins:  # the rewriter adds no copy out that nothing reads back
            raise GraphError(f"the swap of {name} has no swap-in: a swapped tensor must be read back")
        producer_slot = position[g.tensor_producer[swap.tensor]]
        seen: set[int] = set()
        for swap_in in swap.swap_ins:
            for consumer in swap_in.consumers:
                if (swap.tensor, consumer) not in reads:
                    raise GraphError(f"op {g.op_name[consumer]} does not read tensor {name}")
                if consumer in seen:
                    raise GraphError(f"op {g.op_name[consumer]} is fed by two swap-ins of {name}")
                seen.add(consumer)
            # in execution order (the rewriter chains the step in it): a plan made with slot
            # distances may take a trigger from its producer's level
            if swap_in.trigger is not None and not position[swap_in.trigger] > producer_slot:
                raise GraphError(f"trigger {g.op_name[swap_in.trigger]} of {name} does not run after its producer")
    after_slot = position[plan.in_after]
    first_slot = position[plan.in_consumers[plan.in_consumer_ptr[:-1]]] if plan.n_swap_ins else after_slot
    for j in np.flatnonzero(after_slot >= first_slot):
        raise GraphError(f"{g.tensor_name(plan.tensor[plan.in_swap[j]])} is still read on the device by "
                         f"{g.op_name[plan.in_after[j]]}, at or after its swapped-in consumer "
                         f"{g.op_name[plan.in_consumers[plan.in_consumer_ptr[j]]]}")
    for j in np.flatnonzero(plan.in_trigger >= 0):
        if position[plan.in_trigger[j]] <= after_slot[j]:
            raise GraphError(f"the swap-in of {g.tensor_name(plan.tensor[plan.in_swap[j]])} is triggered by "
                             f"{g.op_name[plan.in_trigger[j]]}, before {g.op_name[plan.in_after[j]]} has released "
                             "the previous copy: the tensor would be on the device twice")
        if position[plan.in_trigger[j]] >= first_slot[j]:
            raise GraphError(f"trigger {g.op_name[plan.in_trigger[j]]} does not run before the consumer "
                             f"{g.op_name[plan.in_consumers[plan.in_consumer_ptr[j]]]}")


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
    return np.flatnonzero((g.op_phase == BACKWARD) & np.isin(g.op_type, list(TRIGGER_OP_TYPES)))


def _level_triggers(g: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """For every level L: the highest level <= L holding a trigger candidate, and that op (-1 if none)."""
    levels = categorized_levels(g)
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
    """For every backward op: its ancestors among trigger candidates at most ``depth`` levels up.

    Bitsets (Python ints) propagated in level order over data and control edges; bit i of op x
    stands for the trigger of level-order rank ``base[x] + i``, and ranks more than ``depth``
    levels above x are dropped, which keeps the sets small on deep graphs. The answer is a flat
    array sorted by (op, level) with ``key = op * span + level``, so one ``searchsorted`` finds,
    for many ops at once, the latest ancestor trigger at or below a level.
    """
    levels = categorized_levels(g)
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
    ptr = np.zeros(g.n_ops + 1, dtype=np.int64)
    found: list[np.ndarray] = []
    for op in np.flatnonzero(g.op_phase == BACKWARD).tolist():
        bits = bits_of[op]
        if not bits:
            continue
        raw = np.frombuffer(bits.to_bytes((bits.bit_length() + 7) // 8, "little"), dtype=np.uint8)
        ranks = np.flatnonzero(np.unpackbits(raw, bitorder="little")) + base_of[op]
        found.append(candidates[ranks])
        ptr[op + 1] = len(ranks)
    np.cumsum(ptr, out=ptr)
    ops = np.concatenate(found) if found else np.zeros(0, np.int64)
    owner = np.repeat(np.arange(g.n_ops), np.diff(ptr))
    span = count + 1
    return {"ptr": ptr, "ops": ops, "levels": levels[ops], "key": owner * span + levels[ops], "span": span}


def _trigger_depth(ub: int, count: int) -> int:
    """Ancestor tables are built for windows of 16, 32, 64, ... levels (capped at the graph's depth)."""
    depth = 16
    while depth < ub:
        depth *= 2
    return min(depth, max(count, 1))


def _group_far_edges(tensor: np.ndarray, level: np.ndarray, groupby: int) -> np.ndarray:
    """Group id per far edge (edges sorted by tensor, then level): a group spans <= groupby levels."""
    n = len(tensor)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if groupby:
        return kernels.group_far_edges(tensor, level, groupby)
    new_group = np.ones(n, bool)
    new_group[1:] = (tensor[1:] != tensor[:-1]) | (level[1:] != level[:-1])
    return np.cumsum(new_group) - 1


def latest_triggers(g: OpGraph, first_consumer: np.ndarray, lo: np.ndarray, hi: np.ndarray, policy: str,
                    ub: int) -> np.ndarray:
    """Per request: the latest trigger candidate on a level in ``lo..hi`` (``g``'s levels) that
    ``policy`` allows for ``first_consumer`` ("ancestor": one of its ancestors, looked up in a table
    spanning ``ub`` levels; "level": any), -1 where there is none. Swap-ins and recomputations
    (``simulator.recompute``) take their triggers here."""
    trigger = np.full(len(first_consumer), -1, dtype=np.int64)
    if not len(first_consumer):
        return trigger
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
    the device whatever their distance.
    """
    g = g.with_order(params.order)
    if params.distance == "slot":
        g = slot_levels_view(g)
    levels = categorized_levels(g)
    distance = edge_distances(g)
    candidate = _candidate_tensors(g, params)
    is_far = candidate[g.edge_tensor] & (distance > params.threshold) & (g.op_phase[g.edge_consumer] != UPDATE)
    for producer_type, consumer_type in kept_reads:
        is_far &= ~((g.op_type[g.tensor_producer[g.edge_tensor]] == producer_type)
                    & (g.op_type[g.edge_consumer] == consumer_type))
    far = np.flatnonzero(is_far)
    far_tensor = g.edge_tensor[far]
    far_consumer = g.edge_consumer[far]
    # one edge per (tensor, consumer): an op reading t twice needs one rewire
    key = far_tensor * g.n_ops + far_consumer
    _, unique = np.unique(key, return_index=True)
    far_tensor, far_consumer = far_tensor[unique], far_consumer[unique]
    position = position_of(g)
    by_slot = np.lexsort((position[far_consumer], far_tensor))  # a tensor's far reads in execution order
    far_tensor, far_consumer = far_tensor[by_slot], far_consumer[by_slot]
    consumer_level = levels[far_consumer]

    while True:
        group = _group_far_edges(far_tensor, consumer_level, params.groupby)
        n_groups = int(group[-1]) + 1 if len(group) else 0
        group_start = np.searchsorted(group, np.arange(n_groups), side="left")
        ptr = np.append(group_start, len(group)).astype(np.int64)
        first_consumer = far_consumer[group_start]
        group_tensor = far_tensor[group_start]
        first_level = levels[first_consumer]
        after = _after_ops(g, group_tensor, ptr, far_consumer)
        # a group whose tensor is still read on the device at or after its first consumer (through
        # an alias) would gain nothing from a swap-in: drop it and re-derive the rest
        late = position[after] >= position[first_consumer]
        if not late.any():
            break
        keep = ~np.repeat(late, np.diff(ptr))
        far_tensor, far_consumer, consumer_level = far_tensor[keep], far_consumer[keep], consumer_level[keep]

    hi = first_level - params.lb
    lo = np.maximum(first_level - params.ub, levels[g.tensor_producer[group_tensor]] + 1)
    trigger = np.full(n_groups, -1, dtype=np.int64)
    if params.sync not in SYNC_IN_MODES and n_groups:
        trigger = latest_triggers(g, first_consumer, lo, hi, params.trigger, params.ub)
        # the trigger must run after the previous copy is released and before the consumer
        runs = position[np.maximum(trigger, 0)]
        trigger[(trigger >= 0) & ((runs <= position[after]) | (runs >= position[first_consumer]))] = -1

    swapped, in_swap = np.unique(group_tensor, return_inverse=True)
    sync_out = np.full(len(swapped), params.sync in ("out", "both"))
    return SwapPlan(
        tensor=swapped.astype(np.int64),
        sync_out=sync_out,
        in_swap=in_swap.astype(np.int64),
        in_trigger=trigger,
        in_after=after,
        in_consumer_ptr=ptr,
        in_consumers=far_consumer.astype(np.int64),
        order=execution_order(g),
        order_name=g.order,
        graph_fingerprint=g.cached("fingerprint", OpGraph.fingerprint, structural=True),
        params=params,
        batch_size=g.batch_size,
        after_copies_out=params.after_copies_out,
    )


def _after_ops(g: OpGraph, group_tensor: np.ndarray, ptr: np.ndarray, consumers: np.ndarray) -> np.ndarray:
    """Per swap-in group (groups of a tensor consecutive, in level order): the op it must follow.

    The first group follows the last op that still reads the buffer the tensor lives in once the
    far reads are rewired (its producer at least); each later group follows the last consumer of
    the group before it.
    """
    n_groups = len(group_tensor)
    if n_groups == 0:
        return np.zeros(0, dtype=np.int64)
    info = buffers(g)
    position = position_of(g)
    order = execution_order(g)
    far_keys = np.repeat(group_tensor, np.diff(ptr)) * g.n_ops + consumers
    swapped, first_group = np.unique(group_tensor, return_index=True)
    roots, root_of_swapped = np.unique(info.root[swapped], return_inverse=True)
    root_last, links, link_last, home_link = rewired_lifetimes(g, roots, far_keys, swapped)
    near_slot = root_last[root_of_swapped]
    # a tensor a rewired read carried into a swap-in's buffer (written there in place) is on the
    # device until that buffer's last reader, not the original's (which may be done before it exists)
    moved = np.flatnonzero(home_link >= 0)
    if len(moved):
        by_link = np.argsort(links)
        near_slot[moved] = link_last[by_link[np.searchsorted(links[by_link], home_link[moved])]]
    group_last_slot = np.maximum.reduceat(position[consumers], ptr[:-1])
    after_slot = np.empty(n_groups, dtype=np.int64)
    after_slot[1:] = group_last_slot[:-1]
    after_slot[first_group] = near_slot
    return order[after_slot]
