"""Each replica's peak of a replicated step on the testbed (``rewriter.step.replicated.ReplicatedStep``).

Every logical CPU shares one allocator, so one profiled call's memory trace (``rewriter.placement.memtrace``) holds
every replica's allocations; each is told apart by its op (``ReplicatedTrace.owner``, the swap and recomputation
nodes added for the replica) and replayed alone, without its swap-outs' copies (its host's), on top of what the
replica keeps between steps: its own components of the model's variables, its share of the batch and the
constants its kernels hold (from the step's first call). The figure is the one the simulator predicts for one
replica's graph (``rewriter.trace.replicas.capture_replicated``), but for the all-reduce's ring chunk: the
profiler names neither its op nor its device, so it is left out (``unowned_bytes``); the prediction holds it
while the all-reduce runs, beside the pack alone (the gradients, as large, were freed into it before).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from rewriter.placement import memtrace
from rewriter.placement.placements import is_swap_out_op, warn_if_allocations_hidden, warn_if_onednn_off
from rewriter.step.replicated import verify_replicas
from rewriter.trace import state_kinds


@dataclass(frozen=True)
class ReplicaPeak:
    """One replica's measured step: ``peak_bytes`` (its device side, requested bytes, resident included),
    ``host_peak_bytes`` (its swap-outs' copies), ``resident_bytes`` (variables, batch share, constants),
    ``unowned_bytes`` (allocations of the call no replica's op made, left out: the runtime's own)."""

    replica: int
    device: str
    peak_bytes: int
    host_peak_bytes: int
    resident_bytes: int
    unowned_bytes: int


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
    if any(place.measured_on != "cpu-testbed" for place in step.placements):
        raise ValueError("each replica's peak is measured on the CPU testbed only: its logical devices share one "
                         "allocator the profiler's trace is told apart from (docs/design.md 14)")
    warn_if_allocations_hidden()
    warn_if_onednn_off()
    flat = step.flat_inputs(step.split(x, y))
    if step.constant_bytes is None and step.calls == 0:  # its first call makes the constants its kernels keep
        step.verification = verify_replicas(step, (x, y))
    constants = step.constant_bytes or (0,) * step.replicas.count
    snapshot = step.snapshot()

    def call(*inputs):
        return step.run_flat(*inputs)[1]

    try:
        for _ in range(max(warmup, 1)):
            call(*flat)
        events = memtrace.record_memory_events(call, *flat)
    finally:
        snapshot.restore()
    mine = step.event_owners(events)
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


