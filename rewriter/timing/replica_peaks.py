"""Each replica's peak of a replicated step on the testbed (``rewriter.step.replicated.ReplicatedStep``).

Every logical CPU shares one allocator, so one profiled call's memory trace (``rewriter.placement.memtrace``) holds
every replica's allocations; each is told apart by its op (``ReplicatedTrace.owner``, the swap and recomputation
nodes added for the replica) and replayed alone, without its swap-outs' copies (its host's), on top of what the
replica keeps between steps: its own components of the model's variables, its share of the batch and the
constants its kernels hold (from the step's first call). The figure is the one the simulator predicts for one
replica's graph (``rewriter.trace.replicas.capture_replicated``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import tensorflow as tf

from rewriter.check.collected import collect_first_call, constant_nodes
from rewriter.placement import memtrace
from rewriter.placement.placements import is_swap_out_op, warn_if_allocations_hidden, warn_if_onednn_off
from rewriter.trace import state_kinds


@dataclass(frozen=True)
class ReplicaPeak:
    """One replica's measured step: ``peak_bytes`` (its device side, requested bytes, resident included),
    ``host_peak_bytes`` (its swap-outs' copies), ``resident_bytes`` (variables, batch share, constants),
    ``unowned_bytes`` (allocations of the call no replica's op made, left out: the runtime's transfers)."""

    replica: int
    device: str
    peak_bytes: int
    host_peak_bytes: int
    resident_bytes: int
    unowned_bytes: int


def replica_of_ops(step) -> dict[str, int]:
    """Op name -> replica, for every op of the replicated step and every node added to it."""
    owner = {name: k for name, k in step.trace.owner.items() if k >= 0}
    for k in range(step.replicas.count):
        owner.update({name: k for name in step.replica_ops(k)})
    return owner


def _owner_of(name: str, owner: dict[str, int]) -> int:
    """The replica of an allocation's op; a runtime-folded constant (``__cf__``) by the op it was folded from."""
    if name in owner:
        return owner[name]
    head = name.split(memtrace.CONSTANT_FOLDED, 1)[0].rstrip("/_")
    return owner.get(head, -1)


def event_owners(events: pd.DataFrame, owner: dict[str, int]) -> pd.Series:
    """Each event's replica: an allocation's by its op; a free's by the allocation it frees (its own op is
    whichever released the last reference, often the runtime's or another replica's), by its op when the
    allocation came before the trace."""
    found, by_address = [], {}
    for kind, addr, name in zip(events["kind"], events["addr"], events["tf_op"]):
        mine = _owner_of(str(name), owner)
        if kind == "alloc":
            by_address[addr] = mine
        else:
            mine = by_address.pop(addr, mine)
        found.append(mine)
    return pd.Series(found, index=events.index)


def _state_bytes(step, flat: list[tf.Tensor], k: int) -> int:
    """Replica ``k``'s variables (its component of each mirrored or per-replica variable) and batch share."""
    total = 0
    for variable in state_kinds.model_variables(step._model):  # noqa: SLF001
        value = getattr(variable, "value", variable)
        parts = getattr(value, "values", None)
        part = parts[k] if parts and len(parts) > k else value
        if parts or step.replicas.replica_of_device(getattr(part, "device", "") or "") == k:
            total += int(np.prod(part.shape)) * tf.as_dtype(part.dtype).size
    n = step.trace.n_flat
    return total + sum(int(np.prod(t.shape)) * t.dtype.size for t in flat[k * n:(k + 1) * n])


def measure_replicas(step, x, y, *, warmup: int = 2) -> tuple[ReplicaPeak, ...]:
    """Each replica's peak of one profiled step on the global batch ``(x, y)``; every variable is put back."""
    warn_if_allocations_hidden()
    warn_if_onednn_off()
    flat = step.flat_inputs(step.split(x, y))
    owner = replica_of_ops(step)
    snapshot = step.snapshot()

    def call(*inputs):
        return step.run_flat(*inputs)[1]

    try:
        constants = [0] * step.replicas.count
        if step.calls == 0:  # its first call makes the constants its kernels keep
            found = []

            def first(*inputs):
                found.append(collect_first_call(call, *inputs))
                return found[-1]

            events = memtrace.memory_events(memtrace.profile_call(first, *flat))
            nodes = constant_nodes(found[0][1])
            mine = event_owners(events, owner)
            constants = [memtrace.constant_bytes(events[mine == k], nodes) for k in range(step.replicas.count)]
        for _ in range(max(warmup, 1)):
            call(*flat)
        events = memtrace.record_memory_events(call, *flat)
    finally:
        snapshot.restore()
    mine = event_owners(events, owner)
    unowned = events[(mine < 0) & (events["kind"] == "alloc")]
    peaks = []
    for k in range(step.replicas.count):
        resident = _state_bytes(step, flat, k) + constants[k]
        peak = memtrace.accelerator_peak(events[mine == k], is_host_op=is_swap_out_op, resident_bytes=resident,
                                         resident_unit="requested")
        peaks.append(ReplicaPeak(k, step.replicas.devices[k], int(peak.peak_requested_bytes),
                                 int(peak.host_peak_requested_bytes), resident,
                                 int(unowned["requested_bytes"].sum())))
    return tuple(peaks)


