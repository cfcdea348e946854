"""Optimizer slots on the host, one variable at a time (docs/design.md 13).

``HostState(variable, mode)`` names a trainable variable (its Keras path) whose optimizer slots live in
host memory. Mode ``host-update``: the variable's update runs on the host, beside its slots; the
gradient is copied out, the update computed there and the weight's change copied in. A plan holds
these records under ``host_state`` (``simulator.plan``, since ``swap-plan/3``). Mode ``host-weights``
(``swap-plan/4``): the weight lives on the host too and is updated there, nothing copied back; each of its
reads on the device is a copy in (``with_host_state``), which a plan may swap like an activation between its
forward and backward readers. Mode ``stream-slots`` (``swap-plan/5``): the slots live on the host, the update's
arithmetic stays on the device; only the slots' reads and writes run on the host, so each slot the update reads is
copied in and each value it writes to one is copied out. A record with ``triggered_reads`` (``swap-plan/6``) leaves
each of those copies in (of a weight or a streamed slot) to the plan: every read on the device is a swap-in,
started by a trigger as an activation's, so the copy runs beside the compute instead of just before its reader.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from simulator.fusion import fused_shared_reads
from simulator.graph import GraphError, OpGraph, depending_on, successor_csr
from simulator.ordering import EARLY_OPS, position_of
from simulator.sharing import SHARING_IN_LEVEL_ORDER

HOST_UPDATE = "host-update"
HOST_WEIGHTS = "host-weights"  # the weight on the host as well, read on the device through copies in
STREAM_SLOTS = "stream-slots"  # the slots on the host, streamed in and out around an update on the device
_BASE = "host_state_base"  # a moved graph's memo entry: the graph it was made from
WEIGHT_READS = "host_weight_reads"  # a moved graph's meta: the copies in of weights (and streamed slots) on the host
TRIGGERED_READS = "host_triggered_reads"  # of those, the ones every device reader reads through a plan's swap-in
TRIGGERED_READS_VERSION = 6  # the plan format version (simulator.plan) that first wrote ``triggered_reads``
# the plan format version (simulator.plan) that first wrote each mode: an older file naming it is refused
MODE_FORMAT_VERSIONS = {HOST_UPDATE: 3, HOST_WEIGHTS: 4, STREAM_SLOTS: 5}
HOST_STATE_MODES = tuple(MODE_FORMAT_VERSIONS)
# the capture's entry (movable_state) that lists the ops a mode runs on the host beside ``ops``, and what it records
_RECORDED_OPS = {HOST_WEIGHTS: ("weight_ops", "moves the weight", "weights"),
                 STREAM_SLOTS: ("slot_ops", "streams the slots", "slots")}


@dataclass(frozen=True)
class HostState:
    """A variable whose optimizer slots live on the host, and how its update runs."""

    variable: str
    mode: str = HOST_UPDATE
    # the copies in of its weight or streamed slots started by triggers (swap-ins of the plan), not by their reader
    triggered_reads: bool = False


def with_triggered_reads(g: OpGraph, host_state: Sequence[HostState]) -> tuple[HostState, ...]:
    """``host_state`` with the copies in of each record whose mode makes them (a weight's, a streamed slot's) left to
    the plan's swap-ins, started by triggers (``triggered_reads``), where ``g`` (the captured step) lets every read of
    it be one (``untriggered_why``); the others as they are."""
    on_host = np.zeros(g.n_ops, bool)
    on_host[host_ops(g, host_state)] = True
    return tuple(dataclasses.replace(item, triggered_reads=True)
                 if item.mode in _RECORDED_OPS and untriggered_why(g, item, on_host) is None else item
                 for item in host_state)


def untriggered_why(g: OpGraph, item: HostState, on_host: np.ndarray) -> str | None:
    """Why a read of ``item``'s weight or slots on the host cannot be the plan's swap-ins alone (``on_host``: the
    ops on the host), None where each can: an op on the host reads it too (its copy's buffer would stay read), a
    fused chain shares its device reader (``fusion.fused_shared_reads``: the rewriter keeps such a read on the
    device), or another tensor lives in its buffer."""
    reads = np.flatnonzero(np.isin(g.tensor_producer, host_ops(g, [item])) & g.tensor_persistent)
    device_edge = ~on_host[g.edge_consumer]
    reads = reads[np.isin(reads, g.edge_tensor[device_edge])]
    for tensor in reads.tolist():
        edges = g.edge_tensor == tensor
        if (edges & ~device_edge).any():
            return f"{g.tensor_name(tensor)} is read on the host too"
        if (edges & device_edge & fused_shared_reads(g)).any():
            return f"a fused chain shares the device's read of {g.tensor_name(tensor)}"
        if (g.tensor_alias_of == tensor).any():
            return f"another tensor lives in the buffer of {g.tensor_name(tensor)}"
    return None


def read_host_state_records(records, error: type[GraphError] = GraphError, version: int | None = None,
                            format_name: str = "") -> tuple[HostState, ...]:
    """The records of a plan file's ``host_state`` entry, written in version ``version`` of the format
    ``format_name`` (None: the newest; a mode or key newer than it is refused with the version it needs); ``error``
    says what is malformed."""
    version = TRIGGERED_READS_VERSION if version is None else version
    newest = max((r["mode"] for r in records if isinstance(r, dict) and r.get("mode") in HOST_STATE_MODES),
                 key=MODE_FORMAT_VERSIONS.get, default=None) if isinstance(records, list) else None
    if newest is not None and MODE_FORMAT_VERSIONS[newest] > version:
        raise error(f"the plan's host_state names mode '{newest}', which needs format {format_name}/"
                    f"{MODE_FORMAT_VERSIONS[newest]} (this file says {format_name}/{version})")
    if version < TRIGGERED_READS_VERSION and isinstance(records, list) \
            and any(isinstance(r, dict) and "triggered_reads" in r for r in records):
        raise error(f"the plan's host_state says 'triggered_reads', which needs format {format_name}/"
                    f"{TRIGGERED_READS_VERSION} (this file says {format_name}/{version})")
    modes = tuple(mode for mode, since in MODE_FORMAT_VERSIONS.items() if since <= version)
    if not isinstance(records, list) or not all(isinstance(r, dict) and isinstance(r.get("variable"), str)
                                                and r.get("mode") in modes and _triggered_ok(r) for r in records) \
            or len({r["variable"] for r in records}) != len(records):
        raise error(f"the plan's host_state must list each variable once as {{'variable': path, 'mode': one of "
                    f"{modes}}}, 'triggered_reads' (a boolean) true only with a mode that copies reads in "
                    f"({', '.join(_RECORDED_OPS)})")
    return tuple(HostState(r["variable"], r["mode"], r.get("triggered_reads", False)) for r in records)


def _triggered_ok(record: dict) -> bool:
    value = record.get("triggered_reads", False)
    return isinstance(value, bool) and (not value or record["mode"] in _RECORDED_OPS)


def host_state_record(item: HostState) -> dict:
    """``item`` as a plan file's ``host_state`` record (``triggered_reads`` written only when set)."""
    return {"variable": item.variable, "mode": item.mode, **({"triggered_reads": True} if item.triggered_reads else {})}


def captured_variables(g: OpGraph) -> dict[str, dict]:
    """Trainable variable path -> what the capture recorded of its state (``graph.meta["movable_state"]``:
    ``slot_bytes``, ``ops``, ``slot_ops``, ``weight_bytes``, ``weight_ops``); empty in a graph captured before it."""
    return (g.meta.get("movable_state") or {}).get("variables") or {}


def state_refusal(g: OpGraph) -> str | None:
    """Why the capture found no optimizer state that can move (None: some can, or the graph predates it)."""
    return (g.meta.get("movable_state") or {}).get("refusal")


def movable_state(g: OpGraph) -> dict[str, int]:
    """Trainable variable path -> bytes of its optimizer slots, for the variables whose slots can move to
    the host (the capture's ``graph.meta["movable_state"]``; none in a graph captured before it)."""
    found = captured_variables(g)
    return {path: int(entry["slot_bytes"]) for path, entry in found.items()}


def host_ops(g: OpGraph, host_state: Sequence[HostState]) -> np.ndarray:
    """Indices of the ops that run on the host under ``host_state``: each variable's update and the reads
    and writes of its slots (names the capture recorded; those the reduced graph dropped are skipped)."""
    found = captured_variables(g)
    unknown = [item.variable for item in host_state if item.variable not in found]
    if unknown:
        raise GraphError(f"the plan moves the optimizer state of {len(unknown)} variable(s) this graph cannot move "
                         f"(e.g. {unknown[0]!r}): {state_refusal(g) or 'not a trainable variable with slots'}")
    old = [item for item in host_state
           if item.mode in _RECORDED_OPS and _RECORDED_OPS[item.mode][0] not in found[item.variable]]
    if old:
        _, does, what = _RECORDED_OPS[old[0].mode]
        raise GraphError(f"the plan {does} of {old[0].variable!r}, but this graph was captured before captures "
                         f"recorded the reads and writes of {what}: capture it again")
    index = g.op_index()
    return np.asarray(sorted({index[name] for item in host_state for name in _ops_of(found[item.variable], item)
                              if name in index}), np.int64)


def _ops_of(entry: dict, item: HostState) -> list[str]:
    """The ops ``item`` runs on the host: the slots' reads and writes alone when streamed, else the update with
    them (and the weight's reads and writes with ``host-weights``)."""
    if item.mode == STREAM_SLOTS:
        return entry["slot_ops"]
    return entry["ops"] + (entry["weight_ops"] if item.mode == HOST_WEIGHTS else [])


def updates_on_host(host_state: Sequence[HostState]) -> tuple[HostState, ...]:
    """The records of ``host_state`` whose update's arithmetic runs on the host (not those streamed)."""
    return tuple(item for item in host_state if item.mode != STREAM_SLOTS)


def movable_weights(g: OpGraph) -> dict[str, int]:
    """Trainable variable path -> bytes of the weight, for the variables whose weight can move to the host with
    its slots (mode ``host-weights``; none in a graph captured before captures recorded the weights' ops)."""
    found = captured_variables(g)
    return {path: int(entry["weight_bytes"]) for path, entry in found.items() if "weight_ops" in entry}


def moved_kinds(host_state: Sequence[HostState]) -> str:
    """What ``host_state`` keeps on the host, in a report's words."""
    weights = any(item.mode == HOST_WEIGHTS for item in host_state)
    return "weights and optimizer slots" if weights else "optimizer slots"


def where_updated(host_state: Sequence[HostState]) -> str:
    """Where ``host_state``'s updates run, in a report's words (after "on the host, ")."""
    streamed = len(host_state) - len(updates_on_host(host_state))
    if streamed == len(host_state):
        return "streamed in and out around their update on the device"
    return "where their update runs" + (f" ({streamed} streamed around an update on the device)" if streamed else "")


def moved_bytes(g: OpGraph, host_state: Sequence[HostState]) -> int:
    """Resident bytes ``host_state`` takes off the device: the slots, and the weights of ``host-weights``."""
    slots, weights = movable_state(g), movable_weights(g)
    return sum(slots[item.variable] + (weights[item.variable] if item.mode == HOST_WEIGHTS else 0)
               for item in host_state)


def with_host_state(g: OpGraph, host_state: Sequence[HostState], *, copies_in: bool = True) -> OpGraph:
    """``g`` as it runs with ``host_state``'s slots on the host: their bytes leave the resident state, the
    outputs of the ops that run there (``host_ops``) take no device memory, and the old buffers their writes
    keep stay on the host. What the device still holds: each gradient until the host's update read it (its
    copy out), and with ``copies_in`` (not where the host hands its buffers over:
    ``DeviceModel.host_buffers_shared``) the change the update sends to the weight's write (its copy in). Same
    ops, tensors and edges (the same fingerprint), so a plan's indices hold on it; memoised per ``host_state``."""
    moved = tuple(sorted(set(host_state), key=lambda item: item.variable))
    if _BASE not in g._graph_memo and g.meta.get("host_state") is not None:
        # made from a moved graph (its recomputations' clones, its split parts): already moved, never twice
        if g.meta["host_state"] != _records(moved) or g.meta.get("host_state_copies_in") != copies_in:
            raise GraphError("this graph was made from a step with other optimizer state on the host")
        return g
    base = _base(g)
    if not moved:
        return base
    return base.cached(("host_state", moved, copies_in), lambda graph: _moved(graph, moved, copies_in),
                       structural=False)


def _base(g: OpGraph) -> OpGraph:
    """The captured step a moved graph (or a view of one) was made from, at its batch and order; ``g`` itself
    when it is no moved graph. The same object each time (a replay's tables are memoised on it)."""
    base = g._graph_memo.get(_BASE)
    if base is None:
        return g
    if base.batch_size != g.batch_size:
        base = base.cached(("batch_view", g.batch_size), lambda graph: graph.with_batch(g.batch_size), structural=True)
    return base.with_order(g.order)


def state_groups(g: OpGraph, shares: Sequence[float] = (0.25, 0.5, 0.75, 1.0), mode: str = HOST_UPDATE,
                 ) -> list[tuple[HostState, ...]]:
    """Variables whose state a search moves, largest first: the fewest that hold each share of the movable
    bytes (duplicates dropped), so a step moves no more state than it needs. ``mode`` ``host-weights``: the
    weights with their slots, by the bytes of both; ``stream-slots``: the slots of the variables whose capture
    recorded their reads and writes."""
    weights = movable_weights(g) if mode == HOST_WEIGHTS else {}
    found = captured_variables(g)
    needed = _RECORDED_OPS.get(mode, ("ops",))[0]
    sizes = sorted(((path, size + weights.get(path, 0)) for path, size in movable_state(g).items()
                    if needed in found[path]), key=lambda item: (-item[1], item[0]))
    total = sum(size for _, size in sizes)
    groups: list[tuple[HostState, ...]] = []
    for share in shares:
        taken, count = 0, 0
        while count < len(sizes) and taken < share * total:
            taken += sizes[count][1]
            count += 1
        group = tuple(HostState(path, mode) for path, _ in sizes[:count])
        if group and group not in groups:
            groups.append(group)
    return groups


def _moved(g: OpGraph, moved: tuple[HostState, ...], copies_in: bool) -> OpGraph:
    on_host = np.zeros(g.n_ops, bool)
    on_host[host_ops(g, moved)] = True
    read_on_device = np.zeros(g.n_tensors, bool)
    read_on_device[g.edge_tensor[~on_host[g.edge_consumer]]] = True
    # a weight on the host read on the device: its copy in, a buffer of its own there (on the testbed too)
    weight_read = on_host[g.tensor_producer] & read_on_device & g.tensor_persistent
    host_tensor = on_host[g.tensor_producer] & (~read_on_device if copies_in else ~weight_read)
    tensor_bytes_ab = g.tensor_bytes_ab.copy()
    tensor_bytes_ab[host_tensor] = 0.0
    persistent_ab = g.persistent_bytes_ab.copy()
    persistent_ab[0] = max(0.0, persistent_ab[0] - moved_bytes(g, moved))
    kept = ~host_tensor[g.held_tensor] if len(g.held_tensor) else np.zeros(0, bool)
    reads = np.flatnonzero(weight_read)
    triggered = reads[_triggered(g, moved, on_host)[reads]]
    src, dst = _reads_before_readers(g, np.setdiff1d(reads, triggered), on_host)
    meta = dict(g.meta, host_state=_records(moved), host_state_copies_in=copies_in,
                **{WEIGHT_READS: reads.tolist(), TRIGGERED_READS: triggered.tolist(),
                   EARLY_OPS: g.tensor_producer[triggered].tolist()})
    return dataclasses.replace(g, tensor_bytes_ab=tensor_bytes_ab, persistent_bytes_ab=persistent_ab,
                               tensor_persistent=g.tensor_persistent & ~weight_read,
                               tensor_swappable=g.tensor_swappable | weight_read,
                               control_src=np.concatenate([g.control_src, src]),
                               control_dst=np.concatenate([g.control_dst, dst]),
                               held_tensor=g.held_tensor[kept], held_read=g.held_read[kept], meta=meta,
                               _graph_memo={_BASE: g}, _order_memo={}, _structure_cache={})


def _triggered(g: OpGraph, moved: tuple[HostState, ...], on_host: np.ndarray) -> np.ndarray:
    """Per tensor: made by an op of a ``triggered_reads`` record; one ``GraphError`` for a record some read of which
    cannot be the plan's swap-ins alone (``untriggered_why``)."""
    triggered = np.zeros(g.n_tensors, bool)
    items = [item for item in moved if item.triggered_reads]
    for item in items:
        why = untriggered_why(g, item, on_host)
        if why is not None:
            raise GraphError(f"the copies in of {item.variable!r} cannot all be swap-ins of the plan ({why}): move it "
                             "without triggered_reads")
    if items:
        triggered[np.isin(g.tensor_producer, host_ops(g, items))] = True
    return triggered


def triggered_reads(g: OpGraph) -> np.ndarray:
    """The tensors of ``g`` (a moved graph) whose copies in a plan makes: every device reader of them reads a
    swap-in (``planning.plan_swaps``), whatever the swap rules, so none waits for a copy made at the read."""
    return np.asarray(g.meta.get(TRIGGERED_READS, ()), np.int64)


def _reads_before_readers(g: OpGraph, reads: np.ndarray, on_host: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Control edges that run each weight's read (its copy in) just before its first reader on the device in
    ``g``'s order: from the producers of that reader's other inputs (and its control inputs) that do not
    depend on the read. Without them a read with no inputs runs first and its copy would be held from the
    start of the step to its reader."""
    if not len(reads):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    position = position_of(g)
    ptr, successors = successor_csr(g)
    bounds, following = ptr.tolist(), successors.tolist()
    src, dst = [], []
    for tensor in reads.tolist():
        read = int(g.tensor_producer[tensor])
        readers = g.edge_consumer[(g.edge_tensor == tensor) & ~on_host[g.edge_consumer]]
        first = int(readers[np.argmin(position[readers])])
        inputs = set(g.tensor_producer[g.edge_tensor[g.edge_consumer == first]].tolist())
        inputs |= set(g.control_src[g.control_dst == first].tolist())
        inputs.discard(read)
        for source in sorted(inputs - depending_on(read, bounds, following)):  # never an op after the read
            src.append(source)
            dst.append(read)
    return np.asarray(src, np.int64), np.asarray(dst, np.int64)


def _records(moved: tuple[HostState, ...]) -> list[dict]:
    return [host_state_record(item) for item in moved]


def host_transfers(g: OpGraph, host_state: Sequence[HostState], planned: Sequence[int] = ()
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Bytes at ``g``'s batch of each tensor ``host_state``'s updates copy out (what the host ops read from
    the device: the gradients, AdamW's read of the weight) and of each they copy in (what the device reads
    from them: the change to the weight, a read of a weight or slot on the host), one entry per tensor; a read
    of ``planned`` (a plan swaps it in for every device reader, ``triggered_reads``) is the plan's copies."""
    base = _base(g)
    on_host = np.zeros(base.n_ops, bool)
    on_host[host_ops(base, host_state)] = True
    producer_on_host = on_host[base.tensor_producer[base.edge_tensor]]
    reader_on_host = on_host[base.edge_consumer]
    out = np.unique(base.edge_tensor[reader_on_host & ~producer_on_host])
    back = np.setdiff1d(base.edge_tensor[~reader_on_host & producer_on_host], np.asarray(planned, np.int64))
    return base.tensor_bytes[out].astype(np.float64), base.tensor_bytes[back].astype(np.float64)


def host_copy_seconds(g: OpGraph, host_state: Sequence[HostState], device, planned: Sequence[int] = ()) -> float:
    """What the copies of ``host_state``'s update add to the step on ``device``, each in turn after the compute
    (none overlapped: an upper bound where a link runs beside the compute): the gradients copied out and, where
    the host hands over no buffer (``host_buffers_shared``), the changes copied in; the first copies in of the
    weights on the host (``g`` moved: ``with_host_state``) everywhere but of ``planned`` (``host_transfers``), whose
    copies are the plan's swap-ins, timed on the link. The update itself: ``host_cpu_seconds``."""
    out_bytes, in_bytes = host_transfers(g, host_state, planned)
    if device.host_buffers_shared:  # a weight's copy in is a copy all the same (the testbed's DeepCopy)
        reads = np.setdiff1d(np.asarray(g.meta.get(WEIGHT_READS, ()), np.int64), np.asarray(planned, np.int64))
        in_bytes = g.tensor_bytes[reads].astype(np.float64)
    seconds = float(np.sum(device.transfer_seconds(out_bytes, "d2h"))) if len(out_bytes) else 0.0
    if len(in_bytes):
        seconds += float(np.sum(device.transfer_seconds(in_bytes, "h2d")))
    return seconds


def host_cpu_seconds(g: OpGraph, host_state: Sequence[HostState], device) -> float:
    """The host's CPU applying ``host_state``'s update at its rate (``DeviceModel.host_update_s``), after the
    compute (an upper bound: it runs beside the device's), where the device has a rate; its ops then take no
    device time (``host_update_ops``). Without one (the testbed) the update's ops keep the op times the graph
    has (a calibration times them as part of the step), and this is 0. Streamed slots (``stream-slots``) are
    updated on the device, but their writes (Keras' ``m += delta``) still run on the host: their slots' bytes at
    the same rate (an upper bound: Adam's two adds ran at 8.4 GB/s of slots where its update ran at 4.5 of its
    weight, gradient and slots, docs/design.md 13)."""
    if not device.host_update_bytes_per_s > 0:
        return 0.0
    updated = updates_on_host(host_state)
    streamed = [item for item in host_state if item.mode == STREAM_SLOTS]
    slots = movable_state(g)
    return (device.host_update_s(len(updated), updated_bytes(g, updated)) if updated else 0.0) + (
        device.host_update_s(len(streamed), sum(slots[item.variable] for item in streamed)) if streamed else 0.0)


def updated_bytes(g: OpGraph, host_state: Sequence[HostState]) -> int:
    """Bytes the host's update of ``host_state`` reads and writes: each variable's weight, gradient and slots."""
    found = captured_variables(g)
    if any("weight_bytes" not in found.get(item.variable, {}) for item in host_state):
        raise GraphError("this graph was captured before captures recorded the bytes of each weight: capture it again")
    return sum(2 * int(found[item.variable]["weight_bytes"]) + int(found[item.variable]["slot_bytes"])
               for item in host_state)


def host_working_set_bytes(g: OpGraph, host_state: Sequence[HostState]) -> int:
    """A bound, at ``g``'s batch, of what the host holds for ``host_state``'s updates beside the moved state itself
    (``moved_bytes``): every tensor they copy out of the device (``host_transfers``) and every buffer of its own the
    ops on the host make (those that write into an input they read last, as TF's kernels do, make none), as if none
    were freed during the step. Which of them are live together is the executor's choice, as is whether a
    buffer's last reference goes in time for its reader to write in place: Adam's ``g - m``, ``g * g`` and
    ``sqrt(v)`` and the gradients' copies of two kernels, 8 buffers, peaked at 4 or 5 of them in one measured call
    (docs/design.md 14), so no order of the plan bounds them."""
    base = _base(g)
    ops = host_ops(base, host_state)
    if not len(ops):
        return 0
    sharing = SHARING_IN_LEVEL_ORDER(base)
    own = (sharing.root == np.arange(base.n_tensors)) & ~sharing.persistent & ~base.tensor_persistent
    made = np.isin(base.tensor_producer, ops) & own
    out_bytes, _ = host_transfers(base, host_state)
    return int(base.tensor_bytes[made].sum() + out_bytes.sum())


def host_update_ops(g: OpGraph) -> np.ndarray:
    """Indices of the ops of ``g`` (a moved graph, or one made from it) that run on the host's CPU under the
    optimizer state it moved (``with_host_state``); none in a graph that moved none."""
    records = g.meta.get("host_state")
    if not records:
        return np.zeros(0, np.int64)
    return host_ops(g, read_host_state_records(records))
