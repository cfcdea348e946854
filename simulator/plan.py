"""The swap plan, the one contract between the simulator and the rewriter (docs/design.md 8).

Two forms of one plan:

* ``SwapPlan``: op and tensor *indices* of one ``OpGraph``, as flat arrays (what ``plan_swaps`` makes
  and the replay reads);
* ``NamedPlan``: the same by *name* (``NamedSwap``, ``NamedSwapIn``), what ``plan.json`` holds and
  the rewriter applies to the real TensorFlow step; a plan made at one batch size applies at another.

Everything about the file lives here: ``FORMAT``, writing (``NamedPlan.to_dict``), reading
(``NamedPlan.from_dict``, ``load_plan``) and the rules of a valid plan: ``check_structure`` (whatever the
graph), ``validate_plan``, ``missing_names_error``, ``not_read_error`` (the rewriter's checks say the same).

Recomputations (docs/design.md 9, ``simulator.recompute.actions.Recompute``) are the second kind of action:
``NamedPlan.recomputes``, written under ``recomputes`` since ``swap-plan/2``; a ``SwapPlan`` made on a
graph that holds them (``with_recomputes``) names them in its graph, and its swaps may name the clones.
A ``swap-plan/1`` file still reads (no recomputations). Split regions (``simulator.split``): ``NamedPlan.splits``
since ``swap-plan/3``, built first; optimizer slots on the host (``NamedPlan.host_state``, ``simulator.state``) since
the same version, weights on the host with them (mode ``host-weights``) since ``swap-plan/4``, slots streamed
around an update on the device (mode ``stream-slots``) since ``swap-plan/5``, their copies in started by triggers
(``triggered_reads``) since ``swap-plan/6``. Another kind of action: records on
``NamedPlan`` under its own key, a new ``FORMAT_VERSION`` and its reader in ``_READERS``, the older readers kept.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from simulator import kernels
from simulator.buffers import buffer_record
from simulator.graph import ORDER_NAMES, GraphError, OpGraph
from simulator.ordering import execution_order, position_of
from simulator.params import ParamsError, SwapParams
from simulator.recompute.actions import Recompute, check_recompute_structure, recomputed_tensors, with_recomputes
from simulator.split.actions import SplitRegion, held_regions, read_split_records, split_records, with_plan_splits
from simulator.state.host_update import HostState, host_state_record, read_host_state_records

FORMAT_NAME = "swap-plan"
FORMAT_VERSION = 6  # what this version writes; it reads every version in _READERS
FORMAT = f"{FORMAT_NAME}/{FORMAT_VERSION}"


class PlanError(GraphError):
    """A plan that is malformed, or that does not fit the graph or the model's step it is used on
    (made for another graph, names it does not have, a trigger that depends on its consumer)."""


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

    ``order`` is the execution order the replay assumed (op indices), which the rewriter chains the
    step in (unchained, a 3D U-Net ran 0.78x its prediction on the testbed, 0.99x chained).
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
    host_state: tuple[HostState, ...] = ()  # variables whose optimizer slots live on the host
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
        check_structure(swaps, g.tensor_name, g.op_name.__getitem__)  # before the arrays are built from them
        position = position_of(g)
        tensors, sync_out, in_swap, in_trigger, ptr, consumers = [], [], [], [], [0], []
        for index, swap in enumerate(swaps):
            tensors.append(swap.tensor)
            sync_out.append(swap.sync_out)
            for swap_in in sorted(swap.swap_ins, key=lambda s: min((position[c] for c in s.consumers), default=-1)):
                in_swap.append(index)
                in_trigger.append(-1 if swap_in.trigger is None else swap_in.trigger)
                consumers.extend(sorted(swap_in.consumers, key=lambda c: position[c]))
                ptr.append(len(consumers))
        tensor = np.asarray(tensors, np.int64)
        in_swap_array = np.asarray(in_swap, np.int64)
        ptr_array = np.asarray(ptr, np.int64)
        consumer_array = np.asarray(consumers, np.int64)
        plan = cls(tensor, np.asarray(sync_out, bool), in_swap_array, np.asarray(in_trigger, np.int64),
                   after_ops(g, tensor[in_swap_array], ptr_array, consumer_array), ptr_array, consumer_array,
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
        return bool(self.n_swaps) or self.order_name != "cto" or bool(self.host_state)

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

    # ------------------------------------------------------------------ by name

    def to_named(self, g: OpGraph) -> "NamedPlan":
        """Names, not indices, so the rewriter can apply the plan to the real graph."""
        if self.graph_fingerprint and self.graph_fingerprint != g.fingerprint():
            raise PlanError("this plan was made for another graph")
        swaps = tuple(
            NamedSwap(tensor=g.tensor_name(swap.tensor), bytes=int(g.tensor_bytes[swap.tensor]), sync_out=swap.sync_out,
                      swap_ins=tuple(NamedSwapIn(consumers=tuple(str(g.op_name[c]) for c in swap_in.consumers),
                                                 trigger=None if swap_in.trigger is None else str(g.op_name[swap_in.trigger]),
                                                 after=str(g.op_name[swap_in.after]))
                                     for swap_in in swap.swap_ins))
            for swap in self.swaps())
        return NamedPlan(
            swaps=swaps, recomputes=tuple(recomputed_tensors(g)), splits=held_regions(g),
            graph_fingerprint=g.fingerprint(), host_state=self.host_state,
            model=str(g.meta.get("model", "")),
            batch_size=self.batch_size if self.batch_size is not None else g.batch_size, params=self.params,
            after_copies_out=self.after_copies_out, ordering=self.order_name,
            order=() if self.order is None else tuple(str(name) for name in g.op_name[self.order]),
            # the graph is of the rewritten step: the rewriter redoes the rewrites
            graph_rewrites=tuple(g.meta.get("graph_rewrites") or ()),
            # the shapes it was captured at (open dimensions): the rewriter uses them
            step_inputs=dict(g.meta["step_inputs"]) if g.meta.get("step_inputs") else None,
            canonical_names=dict(g.meta["canonical_names"]) if g.meta.get("canonical_names") else None)

    @classmethod
    def from_named(cls, g: OpGraph, named: "NamedPlan") -> "SwapPlan":
        """Rebuild a plan on ``g`` by name; names ``g`` does not have make one clear PlanError. A plan
        with recomputations is rebuilt on ``plan_graph(g, named)``, ``g`` with them."""
        g = plan_graph(g, named)
        ops, tensors = g.op_index(), g.tensor_index()
        missing = [name for name in named.names() if name not in ops and name not in tensors]
        if missing:
            raise missing_names_error(missing, "this graph")
        swaps = [Swap(tensors[swap.tensor], swap.sync_out,
                      tuple(SwapIn(tuple(ops[c] for c in swap_in.consumers),
                                   None if swap_in.trigger is None else ops[swap_in.trigger])
                            for swap_in in swap.swap_ins))
                 for swap in named.swaps]
        plan = cls.from_swaps(g.with_order(named.ordering), swaps, named.params, after_copies_out=named.after_copies_out)
        object.__setattr__(plan, "batch_size", named.batch_size)
        object.__setattr__(plan, "host_state", named.host_state)
        return plan

    def to_dict(self, g: OpGraph) -> dict[str, Any]:
        """The plan file's content (``NamedPlan.to_dict``)."""
        return self.to_named(g).to_dict()

    def to_json(self, g: OpGraph, **kwargs: Any) -> str:
        return self.to_named(g).to_json(**kwargs)

    @classmethod
    def from_dict(cls, g: OpGraph, data: Any) -> "SwapPlan":
        return cls.from_named(g, NamedPlan.from_dict(data))

    @classmethod
    def from_json(cls, g: OpGraph, text: str) -> "SwapPlan":
        return cls.from_named(g, NamedPlan.from_json(text))



def check_structure(swaps: Iterable[Swap | NamedSwap], name: Callable[[Any], str] = str,
                    op_name: Callable[[Any], str] = str) -> None:
    """The rules a plan obeys whatever graph it is for, on index or name records alike (``name`` and
    ``op_name`` show a tensor and an op): a tensor is swapped once, every swap reads its tensor back,
    every swap-in feeds a consumer, and a consumer reads the tensor from one swap-in."""
    seen_tensors = set()
    for swap in swaps:
        if swap.tensor in seen_tensors:
            raise PlanError(f"a tensor is swapped twice in one plan ({name(swap.tensor)})")
        seen_tensors.add(swap.tensor)
        if not swap.swap_ins:  # the rewriter adds no copy out that nothing reads back
            raise PlanError(f"the swap of {name(swap.tensor)} has no swap-in: a swapped tensor must be read back")
        fed = set()
        for swap_in in swap.swap_ins:
            if not swap_in.consumers:
                raise PlanError(f"a swap-in of {name(swap.tensor)} has no consumers (it needs a non-empty "
                                "'consumers' list)")
            for consumer in swap_in.consumers:
                if consumer in fed:
                    raise PlanError(f"op {op_name(consumer)} is fed by two swap-ins of {name(swap.tensor)}")
                fed.add(consumer)


def plan_graph(g: OpGraph, named: "NamedPlan") -> OpGraph:
    """The graph ``named``'s swaps are made on: ``g`` with its split regions, then its recomputations (``g``
    itself when it has none, or already holds them); an action ``g`` cannot hold is a PlanError."""
    g = with_plan_splits(g, named.splits, PlanError)
    held = recomputed_tensors(g)
    if not named.recomputes or held == list(named.recomputes):
        return g
    if held:
        raise PlanError("the graph holds other recomputations than the plan's: pass the captured step's graph")
    try:
        return with_recomputes(g, named.recomputes)
    except GraphError as error:
        raise PlanError(f"the plan's recomputations do not fit this graph ({error}): it was made for another "
                        "model or version") from None


def missing_names_error(missing: Sequence[str], where: str) -> PlanError:
    """The error for a plan naming ops or tensors ``where`` (this graph, the model's step) does not have."""
    unique = list(dict.fromkeys(missing))
    return PlanError(f"the plan names {len(unique)} op(s)/tensor(s) {where} does not have (e.g. "
                     f"{', '.join(repr(n) for n in unique[:3])}): it was made for another model, batch structure or "
                     "version; capture the model again and make a new plan")


def not_read_error(consumer: str, tensor: str, where: str = "") -> PlanError:
    """The error for a swap-in consumer that does not read its tensor."""
    return PlanError(f"op {consumer} does not read tensor {tensor}{where}: the plan was made for another graph")


def validate_plan(g: OpGraph, plan: SwapPlan) -> None:
    """Reject plans the rewriter could not apply: ``check_structure``, and on ``g`` a consumer not reading
    its tensor, a trigger after (or depending on) the consumer, a tensor that cannot live on the host."""
    check_structure(plan.swaps(), g.tensor_name, g.op_name.__getitem__)
    position = position_of(g)
    reads = set(zip(g.edge_tensor.tolist(), g.edge_consumer.tolist()))
    for swap in plan.swaps():
        name = g.tensor_name(swap.tensor)
        if g.tensor_persistent[swap.tensor] or not g.tensor_swappable[swap.tensor]:
            raise PlanError(f"tensor {name} cannot be swapped (variable, or a dtype/placement without a host copy)")
        producer_slot = position[g.tensor_producer[swap.tensor]]
        for swap_in in swap.swap_ins:
            for consumer in swap_in.consumers:
                if (swap.tensor, consumer) not in reads:
                    raise not_read_error(g.op_name[consumer], name)
            # in execution order (the rewriter chains the step in it): a plan made with slot
            # distances may take a trigger from its producer's level
            if swap_in.trigger is not None and not position[swap_in.trigger] > producer_slot:
                raise PlanError(f"trigger {g.op_name[swap_in.trigger]} of {name} does not run after its producer")
    after_slot = position[plan.in_after]
    first_slot = position[plan.in_consumers[plan.in_consumer_ptr[:-1]]] if plan.n_swap_ins else after_slot
    for j in np.flatnonzero(after_slot >= first_slot):
        raise PlanError(f"{g.tensor_name(plan.tensor[plan.in_swap[j]])} is still read on the device by "
                        f"{g.op_name[plan.in_after[j]]}, at or after its swapped-in consumer "
                        f"{g.op_name[plan.in_consumers[plan.in_consumer_ptr[j]]]}")
    for j in np.flatnonzero(plan.in_trigger >= 0):
        if position[plan.in_trigger[j]] <= after_slot[j]:
            raise PlanError(f"the swap-in of {g.tensor_name(plan.tensor[plan.in_swap[j]])} is triggered by "
                            f"{g.op_name[plan.in_trigger[j]]}, before {g.op_name[plan.in_after[j]]} has released "
                            "the previous copy: the tensor would be on the device twice")
        if position[plan.in_trigger[j]] >= first_slot[j]:
            raise PlanError(f"trigger {g.op_name[plan.in_trigger[j]]} does not run before the consumer "
                            f"{g.op_name[plan.in_consumers[plan.in_consumer_ptr[j]]]}")


def after_ops(g: OpGraph, group_tensor: np.ndarray, ptr: np.ndarray, consumers: np.ndarray) -> np.ndarray:
    """Per swap-in group (a tensor's groups consecutive, in level order): the op it must follow. The
    first group follows the last op that still reads the tensor's buffer once the far reads are rewired
    (its producer at least; a rewired read may carry it into a swap-in's buffer, on the device until
    that buffer's last reader); each later group the last consumer of the one before (``kernels.after_ops``)."""
    return kernels.after_ops(np.asarray(group_tensor, np.int64), np.asarray(ptr, np.int64),
                             np.asarray(consumers, np.int64), buffer_record(g))


# ---------------------------------------------------------------------- the plan by name (plan.json)


@dataclass(frozen=True)
class NamedSwapIn:
    """One swap-in by name: the ops it feeds, the op whose completion starts it (None: synchronous),
    and the op it must follow (the last reader of the previous copy; derived, see ``SwapPlan``)."""

    consumers: tuple[str, ...]
    trigger: str | None = None
    after: str | None = None


@dataclass(frozen=True)
class NamedSwap:
    """One swapped tensor (``"op:output"``) by name; ``bytes`` at the plan's batch size, for reading only."""

    tensor: str
    swap_ins: tuple[NamedSwapIn, ...]
    sync_out: bool = False
    bytes: int = 0

    @property
    def producer(self) -> str:
        return self.tensor.rpartition(":")[0]

    @property
    def output(self) -> int:
        return int(self.tensor.rpartition(":")[2])


@dataclass(frozen=True)
class NamedPlan:
    """A swap plan by name: what ``plan.json`` holds (docs/design.md 8) and the rewriter applies.
    ``order``: every op in the simulated order (``ordering``), which the rewriter chains the step in.
    ``recomputes``: tensors recomputed for far readers (``simulator.recompute.actions``), built before the
    swaps. ``params``: the ``SwapParams`` that made it (None: hand-made or empty). ``graph_rewrites``,
    ``step_inputs``: how the step was captured (the rewriter redoes the rewrites, traces at those shapes)."""

    swaps: tuple[NamedSwap, ...] = ()
    recomputes: tuple[Recompute, ...] = ()
    splits: tuple[SplitRegion, ...] = ()  # ops run in parts along the batch (simulator.split), built first
    host_state: tuple[HostState, ...] = ()  # variables whose optimizer slots live on the host
    order: tuple[str, ...] = ()
    ordering: str = "cto"
    after_copies_out: bool = False
    graph_fingerprint: str = ""
    model: str = ""
    batch_size: int | None = None
    params: SwapParams | None = None
    graph_rewrites: tuple[str, ...] = ()
    step_inputs: dict[str, Any] | None = field(default=None, hash=False)
    # each name as any copy of the model traces it (graph.meta["canonical_names"], rewriter.trace.op_names)
    canonical_names: dict[str, str] | None = field(default=None, hash=False, compare=False)

    @property
    def changes_step(self) -> bool:
        """Whether applying it does anything but trace the step: swaps, recomputations, an order, rewrites."""
        return bool(self.swaps or self.recomputes or self.splits or self.order or self.graph_rewrites
                    or self.host_state)

    def names(self, swaps: Iterable[NamedSwap] | None = None) -> Iterator[str]:
        """Every op and tensor name the plan (or ``swaps`` of it) refers to, in file order."""
        for swap in self.swaps if swaps is None else swaps:
            yield swap.tensor
            for swap_in in swap.swap_ins:
                yield from swap_in.consumers
                yield from (name for name in (swap_in.trigger, swap_in.after) if name is not None)

    # ------------------------------------------------------------------ writing

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the current ``FORMAT``."""
        plan = {
            "format": FORMAT,
            "graph_fingerprint": self.graph_fingerprint,
            "model": self.model,
            "batch_size": self.batch_size,
            "params": None if self.params is None else self.params.to_dict(),
            "swaps": [{"tensor": swap.tensor, "bytes": swap.bytes, "sync_out": swap.sync_out,
                       "swap_ins": [{"consumers": list(item.consumers), "trigger": item.trigger, "after": item.after}
                                    for item in swap.swap_ins]}
                      for swap in self.swaps],
            "recomputes": [{"tensor": action.tensor, "ops": list(action.ops), "trigger": action.trigger,
                            "consumers": list(action.consumers)} for action in self.recomputes],
            "splits": split_records(self.splits),
            "host_state": [host_state_record(item) for item in self.host_state],
            "after_copies_out": self.after_copies_out,
            "ordering": self.ordering,
            "order": list(self.order),
        }
        if self.graph_rewrites:
            plan["graph_rewrites"] = list(self.graph_rewrites)
        if self.step_inputs:
            plan["step_inputs"] = dict(self.step_inputs)
        return plan | ({"canonical_names": dict(self.canonical_names)} if self.canonical_names else {})

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), indent=kwargs.pop("indent", 1), **kwargs)

    # ------------------------------------------------------------------ reading

    @classmethod
    def from_dict(cls, data: Any) -> "NamedPlan":
        """Read a plan file's JSON object of any readable version; malformed ones raise one PlanError."""
        version = _version(data)
        plan = _READERS[version](data)
        check_structure(plan.swaps)
        check_recompute_structure(plan.recomputes, PlanError)
        return plan

    @classmethod
    def from_json(cls, text: str) -> "NamedPlan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanError(f"the plan is not valid JSON ({error})") from None
        return cls.from_dict(data)


_OUTPUT_REF = re.compile(r".+:[0-9]+")


def _is_output_ref(name: str) -> bool:
    """An "op:output" name with a decimal output index (``str.isdigit`` takes "²", which ``int`` refuses)."""
    return _OUTPUT_REF.fullmatch(name) is not None


_FORMAT_PATTERN = re.compile(rf"^{re.escape(FORMAT_NAME)}/(\d+)$")


def _version(data: Any) -> int:
    found = _FORMAT_PATTERN.match(data.get("format", "")) if isinstance(data, dict) and \
        isinstance(data.get("format"), str) else None
    if found is None:
        raise PlanError(f"not a swap plan (expected a JSON object with format {FORMAT!r})")
    version = int(found.group(1))
    if version not in _READERS:
        raise PlanError(f"the plan has format {data['format']!r}, which this version cannot read (it reads "
                        f"{', '.join(f'{FORMAT_NAME}/{v}' for v in sorted(_READERS))}): it was written by a newer "
                        "version of the tool")
    return version


def _read_v1(data: dict[str, Any]) -> NamedPlan:
    """``swap-plan/1``: swaps, order, and how the step was captured."""
    swaps = data.get("swaps")
    if not isinstance(swaps, list):
        raise PlanError("the plan has no 'swaps' list")
    records = []
    for i, record in enumerate(swaps):
        if not isinstance(record, dict) or not isinstance(record.get("tensor"), str) \
                or not isinstance(record.get("swap_ins"), list) \
                or not _is_output_ref(record["tensor"]):
            raise PlanError(f"swap {i} of the plan is malformed (needs 'tensor' as 'op:output' and 'swap_ins')")
        swap_ins = []
        for item in record["swap_ins"]:
            if not isinstance(item, dict) or not isinstance(item.get("consumers"), list) \
                    or not all(isinstance(c, str) for c in item["consumers"]) \
                    or not all(isinstance(item.get(key), (str, type(None))) for key in ("trigger", "after")):
                raise PlanError(f"a swap-in of {record['tensor']} is malformed (needs a 'consumers' list of op names; "
                                "'trigger' and 'after' are op names or null)")
            swap_ins.append(NamedSwapIn(tuple(item["consumers"]), item.get("trigger"), item.get("after")))
        size = record.get("bytes")
        records.append(NamedSwap(record["tensor"], tuple(swap_ins), bool(record.get("sync_out", False)),
                                 size if isinstance(size, int) and not isinstance(size, bool) else 0))
    ordering = data.get("ordering", "cto")
    if ordering not in ORDER_NAMES:
        raise PlanError(f"the plan's ordering {ordering!r} is not known; known: {', '.join(ORDER_NAMES)}")
    order = data.get("order") or []
    rewrites = data.get("graph_rewrites") or []
    if not isinstance(order, list) or not all(isinstance(name, str) for name in order) \
            or not isinstance(rewrites, list) or not all(isinstance(name, str) for name in rewrites):
        raise PlanError("the plan's 'order' and 'graph_rewrites' must be lists of names")
    batch_size = data.get("batch_size")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)):
        raise PlanError(f"the plan's batch_size must be a whole number, got {batch_size!r}")
    try:
        params = SwapParams.from_dict(data["params"]) if data.get("params") else None
    except (ParamsError, TypeError) as error:
        raise PlanError(f"the plan's params are not valid: {error}") from None
    step_inputs = data.get("step_inputs")
    if step_inputs is not None and not isinstance(step_inputs, dict):
        raise PlanError("the plan's step_inputs must be an object")
    canonical_names = data.get("canonical_names")
    if canonical_names is not None and not (isinstance(canonical_names, dict) and all(isinstance(n, str) for n in [
            *canonical_names, *canonical_names.values()])):
        raise PlanError("the plan's canonical_names must map op names to op names")
    return NamedPlan(swaps=tuple(records), order=tuple(order), ordering=ordering,
                     after_copies_out=bool(data.get("after_copies_out", False)),
                     graph_fingerprint=str(data.get("graph_fingerprint") or ""), model=str(data.get("model") or ""),
                     batch_size=batch_size, params=params, graph_rewrites=tuple(rewrites),
                     step_inputs=step_inputs or None, canonical_names=canonical_names or None)


def _read_v2(data: dict[str, Any]) -> NamedPlan:
    """``swap-plan/2``: version 1 and the recomputations (``recomputes``, a list of records with
    ``tensor``, ``ops``, ``trigger`` and ``consumers``; left out: none)."""
    records = data.get("recomputes", [])
    if not isinstance(records, list):
        raise PlanError("the plan has no 'recomputes' list")
    actions = []
    for k, record in enumerate(records):
        names = (record.get("ops"), record.get("consumers")) if isinstance(record, dict) else (None, None)
        if not isinstance(record, dict) or not all(isinstance(record.get(key), str) for key in ("tensor", "trigger")) \
                or not all(isinstance(value, list) and all(isinstance(n, str) for n in value) for value in names) \
                or not _is_output_ref(record["tensor"]):
            raise PlanError(f"recomputation {k} of the plan is malformed (needs 'tensor' as 'op:output', 'trigger' "
                            "as an op name, and 'ops' and 'consumers' as lists of op names)")
        actions.append(Recompute(record["tensor"], tuple(names[0]), record["trigger"], tuple(names[1])))
    return replace(_read_v1(data), recomputes=tuple(actions))


def _read_v3(data: dict[str, Any], version: int = 3) -> NamedPlan:
    """``swap-plan/3``: version 2, the split regions (``splits``, ``ops`` and ``parts`` each) and the optimizer
    state on the host (``host_state``, ``variable`` and ``mode`` each; a mode newer than ``version`` refused)."""
    return replace(_read_v2(data), splits=read_split_records(data.get("splits", []), PlanError),
                   host_state=read_host_state_records(data.get("host_state", []), PlanError, version, FORMAT_NAME))


# format version -> reader; a new version adds its reader and keeps the older ones. Versions 4-6 add to the
# ``host_state`` records only: mode ``host-weights`` (4, the weight on the host too), mode ``stream-slots`` (5, the
# slots streamed in and out around an update on the device), ``triggered_reads`` (6, the copies in of a weight or of
# streamed slots the plan's swap-ins, started by triggers); ``read_host_state_records`` refuses what a version lacks
_READERS: dict[int, Callable[[dict[str, Any]], NamedPlan]] = {
    1: _read_v1, 2: _read_v2, 3: _read_v3, **{version: partial(_read_v3, version=version) for version in (4, 5, 6)}}


def load_plan(plan: Any, graph: OpGraph | None = None) -> NamedPlan:
    """Any accepted plan form as a ``NamedPlan``: a ``NamedPlan``, a ``SwapPlan`` (with ``graph``, the
    OpGraph it was made on), a plan file's JSON object, JSON text, or a path to a JSON file."""
    if isinstance(plan, NamedPlan):
        return plan
    if isinstance(plan, SwapPlan):
        if graph is None and not plan.changes_step:
            return NamedPlan(batch_size=plan.batch_size)
        if graph is None:
            raise PlanError("a SwapPlan holds op indices: pass graph=, the OpGraph it was made on "
                            "(or pass the plan as JSON, SwapPlan.to_json(graph))")
        try:
            return plan.to_named(graph)
        except (PlanError, IndexError) as error:
            raise PlanError(f"the plan does not belong to the given graph: {error}") from None
    if isinstance(plan, (str, os.PathLike)):
        text = str(plan)
        if isinstance(plan, os.PathLike) or not text.lstrip().startswith("{"):
            path = Path(text)
            try:
                text = path.read_text()
            except OSError as error:
                raise PlanError(f"cannot read the plan file {path}: {error.strerror or error}") from None
            except UnicodeDecodeError:
                raise PlanError(f"the plan file {path} is not text (a plan is UTF-8 JSON)") from None
        return NamedPlan.from_json(text)
    return NamedPlan.from_dict(plan)
