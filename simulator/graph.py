"""The framework-free graph of one training step: ops, tensors, edges, all as numpy arrays.

Everything the simulator needs is here and nothing of TensorFlow, so a captured graph can be
saved, shared and replayed in a process that never imports TF. Sizes and costs are linear in the
batch size (``a + b * batch``), so one capture serves every candidate batch (``with_batch``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

import numpy as np

FORWARD, BACKWARD, UPDATE, OTHER = 0, 1, 2, 3
PHASE_NAMES = ("forward", "backward", "update", "other")
# the execution orders a graph can be viewed in (``OpGraph.with_order``; ``simulator.ordering.ORDERS`` computes them)
ORDER_NAMES = ("cto", "memory", "micro-batch")
# the mark in the names of a split step's ops (simulator.split): ``<op>/split_part_<i>``, ``<op>/split_combine_<j>``
SPLIT_MARK = "/split_"
PART_MARK = f"{SPLIT_MARK}part_"
COMBINE_MARK = f"{SPLIT_MARK}combine_"
# what the swap rules' distances count (``SwapParams.distance``; a graph's ``distance``, ``ordering.slot_levels_view``)
DISTANCES = ("level", "slot")

FORMAT_VERSION = 1

T = TypeVar("T")

# How far a memoised analysis is shared (``Analysis.scope``), from the widest to the narrowest:
# "graph": the structure alone (names, edges), shared by every view and batch size;
# "order": the structure in one execution order (``with_order``), shared by both distances and every batch size;
# "view": one order and one distance unit, shared by every batch size;
# "batch": sizes and times at one batch size.
SCOPES = ("graph", "order", "view", "batch")


@dataclass(frozen=True, eq=False)
class Analysis(Generic[T]):
    """A named analysis of an ``OpGraph``, memoised on the graph at its ``scope``.

    The object itself is the memo key: two modules cannot share or clash on an entry by a name, and
    nothing but ``compute`` puts a value under it (a view of the graph gets an analysis by computing
    it, or by sharing the memo of a wider scope, never from a seeded entry).
    """

    name: str
    compute: Callable[["OpGraph"], T]
    scope: str = "view"

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")

    def __call__(self, g: "OpGraph") -> T:
        store = g._memo(self.scope)
        if self not in store:
            store[self] = self.compute(g)
        return store[self]

    def __repr__(self) -> str:
        return f"Analysis({self.name!r}, scope={self.scope!r})"


class GraphError(ValueError):
    """A graph that cannot be simulated (cycle, dangling index, inconsistent arrays)."""


def _ints(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _linear(values: Any, rows: int, what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.shape == (rows,):
        array = np.stack([array, np.zeros(rows)], axis=1)
    if array.shape != (rows, 2):
        raise GraphError(f"{what} must have shape ({rows}, 2) (a, b of a + b * batch), got {array.shape}")
    return array


@dataclass(frozen=True, eq=False)
class OpGraph:
    """One training step as arrays indexed by op, tensor and edge number.

    Per op: ``op_name``, ``op_type``, ``op_phase`` (FORWARD/BACKWARD/UPDATE/OTHER),
    ``op_flops_ab`` and ``op_touched_bytes_ab`` (cost coefficients), ``op_forwards_input`` (the op
    may write its output into the buffer of an input it reads last, as TF's kernels do for Relu,
    AddN and friends).
    Per tensor: ``tensor_producer``/``tensor_output`` (op and output slot), ``tensor_dtype``,
    ``tensor_shape`` (text; ``N`` marks the batch dimension), ``tensor_bytes_ab``,
    ``tensor_alias_of`` (index of the tensor whose buffer it shares, -1 when it owns one),
    ``tensor_persistent`` (variable reads: resident for the whole step, never swapped),
    ``tensor_swappable`` (dtype and placement allow a host copy).
    Per data edge: ``edge_tensor`` -> ``edge_consumer`` (input slot ``edge_slot``).
    Control edges: ``control_src`` -> ``control_dst``.
    ``persistent_bytes_ab``: weights, optimizer state and inputs resident through the step.
    ``outputs``: tensors fetched by the step (alive to its end).
    Held variable buffers, pairs ``held_tensor`` -> ``held_read``: a write to a variable while a read
    of it (a persistent tensor) is still read later keeps the variable's old buffer beside the new one
    (TensorFlow's copy-on-write) until that read's last reader; ``held_tensor`` is the write's output
    that stands for the old buffer, ``held_read`` one read it pairs with (``simulator.sharing``).
    """

    op_name: np.ndarray
    op_type: np.ndarray
    op_phase: np.ndarray
    op_flops_ab: np.ndarray
    op_touched_bytes_ab: np.ndarray
    op_forwards_input: np.ndarray
    tensor_producer: np.ndarray
    tensor_output: np.ndarray
    tensor_dtype: np.ndarray
    tensor_shape: np.ndarray
    tensor_bytes_ab: np.ndarray
    tensor_alias_of: np.ndarray
    tensor_persistent: np.ndarray
    tensor_swappable: np.ndarray
    edge_tensor: np.ndarray
    edge_consumer: np.ndarray
    edge_slot: np.ndarray
    control_src: np.ndarray
    control_dst: np.ndarray
    persistent_bytes_ab: np.ndarray
    outputs: np.ndarray
    held_tensor: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    held_read: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    batch_size: int = 1
    meta: dict = field(default_factory=dict)
    order: str = "cto"
    distance: str = "level"
    # memos of analyses (``Analysis.scope``); "batch" lives in the instance's ``_batch_cache``
    _graph_memo: dict = field(default_factory=dict, repr=False, compare=False)
    _order_memo: dict = field(default_factory=dict, repr=False, compare=False)
    _structure_cache: dict = field(default_factory=dict, repr=False, compare=False)  # scope "view"

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(
        cls,
        *,
        op_name,
        op_type,
        op_phase,
        tensor_producer,
        tensor_bytes_ab,
        edge_tensor,
        edge_consumer,
        op_flops_ab=None,
        op_touched_bytes_ab=None,
        op_forwards_input=None,
        tensor_output=None,
        tensor_dtype=None,
        tensor_shape=None,
        tensor_alias_of=None,
        tensor_persistent=None,
        tensor_swappable=None,
        edge_slot=None,
        control_src=(),
        control_dst=(),
        persistent_bytes_ab=(0, 0),
        outputs=(),
        held_tensor=(),
        held_read=(),
        batch_size: int = 1,
        meta: dict | None = None,
    ) -> "OpGraph":
        """Build and validate a graph; optional arrays get neutral defaults (handy in tests)."""
        n_ops = len(op_name)
        producer = _ints(tensor_producer)
        n_tensors = len(producer)
        edge_tensor = _ints(edge_tensor)
        n_edges = len(edge_tensor)
        if tensor_output is None:  # number each op's outputs 0, 1, ... in tensor order
            order = np.argsort(producer, kind="stable")
            first = np.searchsorted(producer[order], producer[order], side="left")
            tensor_output = np.empty(n_tensors, dtype=np.int64)
            tensor_output[order] = np.arange(n_tensors) - first
        graph = cls(
            op_name=np.asarray(op_name, dtype=str).reshape(-1),
            op_type=np.asarray(op_type, dtype=str).reshape(-1),
            op_phase=np.asarray(op_phase, dtype=np.int8).reshape(-1),
            op_flops_ab=_linear(np.zeros(n_ops) if op_flops_ab is None else op_flops_ab, n_ops, "op_flops_ab"),
            op_touched_bytes_ab=_linear(
                np.zeros(n_ops) if op_touched_bytes_ab is None else op_touched_bytes_ab, n_ops, "op_touched_bytes_ab"
            ),
            op_forwards_input=np.zeros(n_ops, bool) if op_forwards_input is None else np.asarray(op_forwards_input, bool),
            tensor_producer=producer,
            tensor_output=_ints(tensor_output),
            tensor_dtype=np.asarray(["float32"] * n_tensors if tensor_dtype is None else tensor_dtype, dtype=str).reshape(-1),
            tensor_shape=np.asarray([""] * n_tensors if tensor_shape is None else tensor_shape, dtype=str).reshape(-1),
            tensor_bytes_ab=_linear(tensor_bytes_ab, n_tensors, "tensor_bytes_ab"),
            tensor_alias_of=np.full(n_tensors, -1, np.int64) if tensor_alias_of is None else _ints(tensor_alias_of),
            tensor_persistent=np.zeros(n_tensors, bool) if tensor_persistent is None else np.asarray(tensor_persistent, bool),
            tensor_swappable=np.ones(n_tensors, bool) if tensor_swappable is None else np.asarray(tensor_swappable, bool),
            edge_tensor=edge_tensor,
            edge_consumer=_ints(edge_consumer),
            edge_slot=np.zeros(n_edges, np.int64) if edge_slot is None else _ints(edge_slot),
            control_src=_ints(control_src),
            control_dst=_ints(control_dst),
            persistent_bytes_ab=np.asarray(persistent_bytes_ab, dtype=np.float64).reshape(2),
            outputs=_ints(outputs),
            held_tensor=_ints(held_tensor),
            held_read=_ints(held_read),
            batch_size=int(batch_size),
            meta=dict(meta or {}),
        )
        graph.validate()
        return graph

    def validate(self) -> None:
        """Raise GraphError on inconsistent arrays or a cycle (a cyclic step cannot be levelled)."""
        n_ops, n_tensors = self.n_ops, self.n_tensors
        for name in ("op_type", "op_phase", "op_forwards_input"):
            if len(getattr(self, name)) != n_ops:
                raise GraphError(f"{name} has {len(getattr(self, name))} entries for {n_ops} ops")
        for name in ("tensor_output", "tensor_dtype", "tensor_shape", "tensor_alias_of", "tensor_persistent", "tensor_swappable"):
            if len(getattr(self, name)) != n_tensors:
                raise GraphError(f"{name} has {len(getattr(self, name))} entries for {n_tensors} tensors")
        if not (len(self.edge_consumer) == len(self.edge_tensor) == len(self.edge_slot)):
            raise GraphError("edge_tensor, edge_consumer and edge_slot differ in length")
        if len(self.control_src) != len(self.control_dst):
            raise GraphError("control_src and control_dst differ in length")
        if len(self.held_tensor) != len(self.held_read):
            raise GraphError("held_tensor and held_read differ in length")
        if len(set(self.op_name.tolist())) != n_ops:
            raise GraphError("op names are not unique")
        for name, values, limit in (
            ("tensor_producer", self.tensor_producer, n_ops),
            ("edge_consumer", self.edge_consumer, n_ops),
            ("edge_tensor", self.edge_tensor, n_tensors),
            ("control_src", self.control_src, n_ops),
            ("control_dst", self.control_dst, n_ops),
            ("outputs", self.outputs, n_tensors),
            ("held_tensor", self.held_tensor, n_tensors),
            ("held_read", self.held_read, n_tensors),
        ):
            if len(values) and (values.min() < 0 or values.max() >= limit):
                raise GraphError(f"{name} holds an index outside 0..{limit - 1}")
        alias = self.tensor_alias_of
        if len(alias) and (alias.min() < -1 or alias.max() >= n_tensors):
            raise GraphError("tensor_alias_of holds an index outside -1..n_tensors-1")
        if len(self.held_read) and not self.tensor_persistent[self.held_read].all():
            raise GraphError("held_read must name persistent tensors (variable reads)")
        if np.any((self.op_phase < 0) | (self.op_phase > OTHER)):
            raise GraphError("op_phase must be 0..3 (forward, backward, update, other)")
        if np.any(self.tensor_bytes_ab < 0) or np.any(self.op_flops_ab < 0) or np.any(self.op_touched_bytes_ab < 0):
            raise GraphError("sizes and costs must be non-negative")
        categorized_levels(self)  # raises GraphError on a cycle

    # ------------------------------------------------------------------ sizes

    @property
    def n_ops(self) -> int:
        return len(self.op_name)

    @property
    def n_tensors(self) -> int:
        return len(self.tensor_producer)

    @property
    def tensor_bytes(self) -> np.ndarray:
        """Bytes of each tensor at this graph's batch size (computed once per batch size, read-only:
        every replay and plan reads it)."""
        return TENSOR_BYTES(self)

    @property
    def op_flops(self) -> np.ndarray:
        return _at_batch(self.op_flops_ab, self.batch_size)

    @property
    def op_touched_bytes(self) -> np.ndarray:
        return _at_batch(self.op_touched_bytes_ab, self.batch_size)

    @property
    def persistent_bytes(self) -> int:
        a, b = self.persistent_bytes_ab
        return int(round(a + b * self.batch_size))

    def with_batch(self, batch_size: int) -> "OpGraph":
        """The same step at another batch size (arrays and structural analyses are shared)."""
        if int(batch_size) < 1:
            raise GraphError(f"batch size must be >= 1, got {batch_size}")
        return dataclasses.replace(self, batch_size=int(batch_size))

    def with_order(self, order: str) -> "OpGraph":
        """The same step executed in another order (``ORDER_NAMES``; ``simulator.ordering.ORDERS``
        computes them); analyses of the structure alone are shared, the others memoised per order."""
        if order == self.order:
            return self
        if order not in ORDER_NAMES:
            raise GraphError(f"unknown execution order {order!r}; known: {', '.join(ORDER_NAMES)}")
        view = self.cached(("order", order), lambda graph: dataclasses.replace(
            graph, order=order, _order_memo={}, _structure_cache={}), structural=True)
        if view.batch_size == self.batch_size:
            return view
        # the view at this batch size, kept with this graph: a new one per call would rebuild its
        # per-batch analyses (sizes, slot times) at every replay
        return self.cached(("order_view", order), lambda graph: view.with_batch(graph.batch_size), structural=False)

    def with_distance(self, distance: str) -> "OpGraph":
        """The same step (same order) whose swap-rule levels count ``distance`` (``DISTANCES``): "level",
        CTO levels, or "slot", steps of the execution order (``simulator.ordering.distance_levels``).
        ``categorized_levels`` is the same in both; the order's analyses are shared."""
        if distance == self.distance:
            return self
        if distance not in DISTANCES:
            raise GraphError(f"unknown distance {distance!r}; known: {', '.join(DISTANCES)}")
        view = self.cached(("distance", distance), lambda graph: dataclasses.replace(
            graph, distance=distance, _structure_cache={}), structural=True)
        if view.batch_size == self.batch_size:
            return view
        return self.cached(("distance_view", distance), lambda graph: view.with_batch(graph.batch_size),
                           structural=False)

    def _memo(self, scope: str) -> dict:
        if scope == "graph":
            return self._graph_memo
        if scope == "order":
            return self._order_memo
        if scope == "view":
            return self._structure_cache
        return self.__dict__.setdefault("_batch_cache", {})

    def __getstate__(self) -> dict:
        """Pickled without its memos (they hold analyses' functions): rebuilt where it is read."""
        return {**{k: v for k, v in self.__dict__.items() if k != "_batch_cache"},
                "_graph_memo": {}, "_order_memo": {}, "_structure_cache": {}}

    def cached(self, key, compute, *, structural: bool):
        """Memoise a module's own analysis of this graph: structural ones are shared by all batch sizes
        (scope "view"), the others kept per batch size. An analysis other modules read is an
        ``Analysis`` (a typed key that cannot clash)."""
        store = self._memo("view" if structural else "batch")
        if key not in store:
            store[key] = compute(self)
        return store[key]

    # ------------------------------------------------------------------ naming

    def tensor_name(self, tensor: int) -> str:
        return f"{self.op_name[self.tensor_producer[tensor]]}:{self.tensor_output[tensor]}"

    def op_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.op_name.tolist())}

    def tensor_index(self) -> dict[str, int]:
        """Tensor name ("op:output") -> index, built once per structure (plans name their tensors):
        shared, so do not modify it."""
        return TENSOR_INDEX(self)

    def fingerprint(self) -> str:
        """Identifies the structure (names, types, edges), not sizes: plans carry it to catch stale use."""
        return FINGERPRINT(self)

    def summary(self) -> dict[str, Any]:
        phases = np.bincount(self.op_phase, minlength=4)
        return {
            "ops": self.n_ops,
            "tensors": self.n_tensors,
            "data_edges": len(self.edge_tensor),
            "control_edges": len(self.control_src),
            "batch_size": self.batch_size,
            "persistent_bytes": self.persistent_bytes,
            **{f"{name}_ops": int(count) for name, count in zip(PHASE_NAMES, phases)},
        }

    # ------------------------------------------------------------------ files

    _ARRAY_FIELDS = (
        "op_name", "op_type", "op_phase", "op_flops_ab", "op_touched_bytes_ab", "op_forwards_input",
        "tensor_producer", "tensor_output", "tensor_dtype", "tensor_shape", "tensor_bytes_ab",
        "tensor_alias_of", "tensor_persistent", "tensor_swappable", "edge_tensor", "edge_consumer",
        "edge_slot", "control_src", "control_dst", "persistent_bytes_ab", "outputs",
    )
    _OPTIONAL_ARRAY_FIELDS = ("held_tensor", "held_read")  # absent from files written before they existed

    def save(self, path: str | Path) -> Path:
        """Write one ``.npz`` file (numpy only, no pickles) that ``OpGraph.load`` reads back."""
        path = Path(path)
        header = {"format_version": FORMAT_VERSION, "batch_size": self.batch_size, "meta": self.meta}
        arrays = {name: getattr(self, name) for name in self._ARRAY_FIELDS + self._OPTIONAL_ARRAY_FIELDS}
        arrays["header_json"] = np.asarray(json.dumps(header))
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            np.savez_compressed(handle, **arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "OpGraph":
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                header = json.loads(str(data["header_json"]))
                arrays = {name: data[name] for name in cls._ARRAY_FIELDS}
                arrays.update({name: data[name] for name in cls._OPTIONAL_ARRAY_FIELDS if name in data.files})
        except (OSError, KeyError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as error:
            raise GraphError(f"{path} is not a saved OpGraph ({error})") from None
        if header.get("format_version") != FORMAT_VERSION:
            raise GraphError(f"{path} has graph format {header.get('format_version')}, expected {FORMAT_VERSION}")
        return cls.build(**arrays, batch_size=header["batch_size"], meta=header.get("meta", {}))


def _at_batch(coefficients: np.ndarray, batch_size: int) -> np.ndarray:
    return coefficients[..., 0] + coefficients[..., 1] * float(batch_size)


def _tensor_bytes(g: OpGraph) -> np.ndarray:
    sizes = _at_batch(g.tensor_bytes_ab, g.batch_size).astype(np.int64)
    sizes.flags.writeable = False
    return sizes


def _fingerprint(g: OpGraph) -> str:
    digest = hashlib.sha256()
    for array in (g.op_name, g.op_type, g.tensor_producer, g.tensor_output,
                  g.edge_tensor, g.edge_consumer, g.control_src, g.control_dst):
        digest.update(np.ascontiguousarray(array).tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]


# every read and every plan needs them: computed once per batch size (sizes) or per structure
TENSOR_BYTES = Analysis("tensor_bytes", _tensor_bytes, scope="batch")
TENSOR_INDEX = Analysis("tensor_index", lambda g: {g.tensor_name(t): t for t in range(g.n_tensors)}, scope="graph")
FINGERPRINT = Analysis("fingerprint", _fingerprint, scope="graph")


def alias_roots(g: OpGraph) -> np.ndarray:
    """Per tensor, the tensor owning its buffer: itself, or the end of its ``tensor_alias_of`` chain."""
    root = np.where(g.tensor_alias_of >= 0, g.tensor_alias_of, np.arange(g.n_tensors))
    for _ in range(64):  # alias chains are short; each pass halves what is left of them
        step = root[root]
        if np.array_equal(step, root):
            break
        root = step
    return root


# ---------------------------------------------------------------------- levels (docs/design.md 1.2)


def successor_csr(g: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """Successor lists over data and control edges (duplicates kept: harmless for levels)."""
    src = np.concatenate([g.tensor_producer[g.edge_tensor], g.control_src])
    dst = np.concatenate([g.edge_consumer, g.control_dst])
    order = np.argsort(src, kind="stable")
    ptr = np.zeros(g.n_ops + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=g.n_ops), out=ptr[1:])
    return ptr, dst[order]


def depending_on(op: int, bounds: list[int], following: list[int]) -> set[int]:
    """``op`` and every op that depends on it, over ``successor_csr``'s lists (as Python lists: walked op by op)."""
    found, stack = {op}, [op]
    while stack:
        current = stack.pop()
        for nxt in following[bounds[current]:bounds[current + 1]]:
            if nxt not in found:
                found.add(nxt)
                stack.append(nxt)
    return found


def _compute_levels(g: OpGraph) -> np.ndarray:
    src = np.concatenate([g.tensor_producer[g.edge_tensor], g.control_src])
    dst = np.concatenate([g.edge_consumer, g.control_dst])
    if len(src) and np.any(src == dst):
        raise GraphError(f"op {g.op_name[src[src == dst][0]]!r} depends on itself (the graph has a cycle)")
    ptr, successors = successor_csr(g)
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


CATEGORIZED_LEVELS = Analysis("categorized_levels", _compute_levels, scope="graph")
LEVEL_ORDER = Analysis("level_order", lambda g: np.lexsort((np.arange(g.n_ops), categorized_levels(g))), scope="graph")


def categorized_levels(g: OpGraph) -> np.ndarray:
    """Each op's level (Kahn's algorithm in rounds over data and control edges), indexed like g's ops.
    The same in every view of the graph (order, distance): the swap rules' own levels are
    ``simulator.ordering.distance_levels``."""
    return CATEGORIZED_LEVELS(g)


def _part_of_op(g: OpGraph) -> np.ndarray:
    names = g.op_name.astype(str)
    found = np.char.rpartition(names, PART_MARK)
    part = np.full(g.n_ops, -1, np.int64)
    marked = (found[:, 1] == PART_MARK) & np.char.isdigit(found[:, 2])
    part[marked] = found[marked, 2].astype(np.int64)
    return part


_PART_OF_OP = Analysis("part of each op", _part_of_op, scope="graph")


def part_of_op(g: OpGraph) -> np.ndarray:
    """Per op: the part of a split region it runs (``<op>/split_part_<i>``, ``simulator.split``), -1 for every
    other op."""
    return _PART_OF_OP(g)


def level_order(g: OpGraph) -> np.ndarray:
    """Ops by level, then by index: the categorized topological order itself."""
    return LEVEL_ORDER(g)


def slots_of(order: np.ndarray) -> np.ndarray:
    """Inverse of an execution order (op indices by slot): the slot at which each op runs."""
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    return position
