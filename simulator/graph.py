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
from typing import Any

import numpy as np

FORWARD, BACKWARD, UPDATE, OTHER = 0, 1, 2, 3
PHASE_NAMES = ("forward", "backward", "update", "other")

FORMAT_VERSION = 1


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
    batch_size: int = 1
    meta: dict = field(default_factory=dict)
    order: str = "cto"
    _structure_cache: dict = field(default_factory=dict, repr=False, compare=False)

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
        if len(set(self.op_name.tolist())) != n_ops:
            raise GraphError("op names are not unique")
        for name, values, limit in (
            ("tensor_producer", self.tensor_producer, n_ops),
            ("edge_consumer", self.edge_consumer, n_ops),
            ("edge_tensor", self.edge_tensor, n_tensors),
            ("control_src", self.control_src, n_ops),
            ("control_dst", self.control_dst, n_ops),
            ("outputs", self.outputs, n_tensors),
        ):
            if len(values) and (values.min() < 0 or values.max() >= limit):
                raise GraphError(f"{name} holds an index outside 0..{limit - 1}")
        alias = self.tensor_alias_of
        if len(alias) and (alias.min() < -1 or alias.max() >= n_tensors):
            raise GraphError("tensor_alias_of holds an index outside -1..n_tensors-1")
        if np.any((self.op_phase < 0) | (self.op_phase > OTHER)):
            raise GraphError("op_phase must be 0..3 (forward, backward, update, other)")
        if np.any(self.tensor_bytes_ab < 0) or np.any(self.op_flops_ab < 0) or np.any(self.op_touched_bytes_ab < 0):
            raise GraphError("sizes and costs must be non-negative")
        from simulator.ordering import categorized_levels  # local: ordering depends on this module

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
        def compute(graph: OpGraph) -> np.ndarray:
            sizes = _at_batch(graph.tensor_bytes_ab, graph.batch_size).astype(np.int64)
            sizes.flags.writeable = False
            return sizes

        return self.cached("tensor_bytes", compute, structural=False)

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
        return dataclasses.replace(self, batch_size=int(batch_size), _structure_cache=self._structure_cache)

    def with_order(self, order: str) -> "OpGraph":
        """The same step executed in another order (see ``simulator.ordering.ORDERS``); analyses
        that depend on the order are cached per order."""
        if order == self.order:
            return self
        from simulator.ordering import ORDERS

        if order not in ORDERS:
            raise GraphError(f"unknown execution order {order!r}; known: {', '.join(ORDERS)}")
        view = self.cached(("order", order), lambda graph: dataclasses.replace(
            graph, order=order, _structure_cache={"levels": self.cached("levels", _levels, structural=True)}),
            structural=True)
        if view.batch_size == self.batch_size:
            return view
        # the view at this batch size, kept with this graph: a new one per call would rebuild its
        # per-batch analyses (sizes, slot times) at every replay
        return self.cached(("order_view", order), lambda graph: view.with_batch(graph.batch_size), structural=False)

    def cached(self, key: str, compute, *, structural: bool):
        """Memoise an analysis of this graph: structural ones are shared by all batch sizes."""
        store = self._structure_cache if structural else self.__dict__.setdefault("_batch_cache", {})
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
        return self.cached("tensor_index", lambda graph: {graph.tensor_name(t): t for t in range(graph.n_tensors)},
                           structural=True)

    def fingerprint(self) -> str:
        """Identifies the structure (names, types, edges), not sizes: plans carry it to catch stale use."""
        digest = hashlib.sha256()
        for array in (self.op_name, self.op_type, self.tensor_producer, self.tensor_output,
                      self.edge_tensor, self.edge_consumer, self.control_src, self.control_dst):
            digest.update(np.ascontiguousarray(array).tobytes())
            digest.update(b"|")
        return digest.hexdigest()[:16]

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

    def save(self, path: str | Path) -> Path:
        """Write one ``.npz`` file (numpy only, no pickles) that ``OpGraph.load`` reads back."""
        path = Path(path)
        header = {"format_version": FORMAT_VERSION, "batch_size": self.batch_size, "meta": self.meta}
        arrays = {name: getattr(self, name) for name in self._ARRAY_FIELDS}
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
        except (OSError, KeyError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as error:
            raise GraphError(f"{path} is not a saved OpGraph ({error})") from None
        if header.get("format_version") != FORMAT_VERSION:
            raise GraphError(f"{path} has graph format {header.get('format_version')}, expected {FORMAT_VERSION}")
        return cls.build(**arrays, batch_size=header["batch_size"], meta=header.get("meta", {}))


def _levels(g: "OpGraph") -> np.ndarray:
    from simulator.ordering import categorized_levels

    return categorized_levels(g)


def _at_batch(coefficients: np.ndarray, batch_size: int) -> np.ndarray:
    return coefficients[..., 0] + coefficients[..., 1] * float(batch_size)
