"""Each replica's peak of a replicated step on the testbed (``rewriter.step.replicated.ReplicatedStep``), or on GPUs
(``gpu_replica_peaks``: each GPU's own allocator).

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

import time
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from rewriter.placement import memtrace
from rewriter.placement.placements import (GpuPlacement, gpu_reading, is_swap_out_op, warn_if_allocations_hidden,
                                           warn_if_onednn_off)
from rewriter.step.replicated import verify_replicas
from rewriter.trace import state_kinds


@dataclass(frozen=True)
class ReplicaPeak:
    """One replica's measured step: ``peak_bytes`` (its device side, requested bytes, resident included),
    ``host_peak_bytes`` (what its host's ops allocate during the call: its swap-outs' copies, its moved update's
    copies out and temporaries; with ``host_shared``, every replica's on the machine: GPUs share one pinned host
    allocator), ``resident_bytes`` (variables, batch share, constants), ``unowned_bytes`` (allocations of the call
    no replica's op made, left out: the runtime's own), ``host_state_bytes`` (its components of the variables that
    live on its host, held before the call: the optimizer state the plan moved)."""

    replica: int
    device: str
    peak_bytes: int
    host_peak_bytes: int
    resident_bytes: int
    unowned_bytes: int
    host_shared: bool = False
    host_state_bytes: int = 0


def _components(step, k: int) -> list:
    """Replica ``k``'s component of each of the model's variables (mirrored, per-replica or moved to its host)."""
    found = []
    for variable in state_kinds.model_variables(step._model):  # noqa: SLF001
        value = getattr(variable, "value", variable)
        parts = getattr(value, "values", None)
        found.append(parts[k] if parts and len(parts) > k else value)
    return found


def _bytes(tensor) -> int:
    return int(np.prod(tensor.shape)) * tf.as_dtype(tensor.dtype).size


def _state_bytes(step, flat: list[tf.Tensor], k: int) -> int:
    """Replica ``k``'s variables on its device (not a slot on its host) and its batch share."""
    n = step.trace.n_flat
    return sum(_bytes(part) for part in _components(step, k)
               if step.replicas.replica_of_device(getattr(part, "device", "") or "") == k) + sum(
        _bytes(t) for t in flat[k * n:(k + 1) * n])


def _host_state_bytes(step, k: int) -> int:
    """Replica ``k``'s components of the model's variables that live on its host (``Replicas.hosts``), read from
    the variables themselves: the optimizer slots (and weights) the plan moved there."""
    return sum(_bytes(part) for part in _components(step, k)
               if step.replicas.is_host_of(getattr(part, "device", "") or "", k))


def measure_replicas(step, x, y, *, warmup: int = 2) -> tuple[ReplicaPeak, ...]:
    """Each replica's peak of one profiled step on the global batch ``(x, y)``; every variable is put back. On the
    testbed from the one allocator's trace told apart by op; on GPUs from each GPU's own allocator
    (``gpu_replica_peaks``)."""
    on_gpus = all(isinstance(place, GpuPlacement) for place in step.placements)
    if not on_gpus and any(place.measured_on != "cpu-testbed" for place in step.placements):
        raise ValueError("each replica's peak is measured on the CPU testbed or on GPUs, not on a mix of "
                         "devices (docs/design.md 14)")
    if not on_gpus:
        warn_if_allocations_hidden()
        warn_if_onednn_off()
    flat = step.flat_inputs(step.split(x, y))
    if step.constant_bytes is None and step.calls == 0:  # its first call makes the constants its kernels keep
        step.verification = verify_replicas(step, (x, y))
    constants = step.constant_bytes or (0,) * step.replicas.count
    resident = [_state_bytes(step, flat, k) + constants[k] for k in range(step.replicas.count)]
    host_state = [_host_state_bytes(step, k) for k in range(step.replicas.count)]
    snapshot = step.snapshot()

    def call(*inputs):
        loss = step.run_flat(*inputs)[1]
        if on_gpus:
            loss.numpy()  # a GPU's kernels run asynchronously: the trace ends after the step did
        return loss

    try:
        for _ in range(max(warmup, 1) - (0 if on_gpus else 1)):
            call(*flat)
        gpus = [place.accelerator.rsplit("device:", 1)[-1] for place in step.placements] if on_gpus else []
        for gpu in gpus:
            tf.config.experimental.reset_memory_stats(gpu)
        # on the testbed the call before the measured one is traced too: a variable's copy-on-write (AdamW's
        # decay while a read is pending) frees the buffer the call before made, and only that call's trace tells
        # the free's replica (a buffer made before the trace has none: left unowned, it stayed counted). Not in a
        # worker of several: two calls of a step whose all-reduce crosses processes, traced together,
        # aborted the process in TensorFlow ("double free or corruption") in 3 of 10 runs, one call in none
        one_call = on_gpus or step.replicas.workers > 1
        traced = memtrace.record_memory_events(call, *flat, calls=1 if one_call else 2)
        allocator_peaks = [int(tf.config.experimental.get_memory_info(gpu)["peak"]) for gpu in gpus]
    finally:
        snapshot.restore()
    if on_gpus:
        return gpu_replica_peaks(traced, step.placements, devices=step.replicas.devices, resident_bytes=resident,
                                 allocator_peak_bytes=allocator_peaks, host_state_bytes=host_state)
    measured = traced["call"] == traced["call"].max()
    owners = step.event_owners(traced)
    events, mine = traced[measured], owners[measured]
    unowned = events[(mine < 0) & (events["kind"] == "alloc")]
    # the nodes placed beside a replica's optimizer slots allocate on its host
    host_ops = frozenset().union(*(names for updates in step.host_updates for names in updates.values()))

    def is_host_op(name: str) -> bool:
        return is_swap_out_op(name) or name in host_ops

    peaks = []
    for k in range(step.replicas.count):
        # the buffers the call before kept on the host (a slot replaced by its update's copy-on-write) are the host's
        previous = traced[~measured][owners[~measured] == k] if host_ops else None
        peak = memtrace.accelerator_peak(events[mine == k], is_host_op=is_host_op, resident_bytes=resident[k],
                                         resident_unit="requested", previous=previous)
        peaks.append(ReplicaPeak(k, step.replicas.devices[k], int(peak.peak_requested_bytes),
                                 int(peak.host_peak_requested_bytes), resident[k],
                                 int(unowned["requested_bytes"].sum()), host_state_bytes=host_state[k]))
    return tuple(peaks)


def time_replicas(step, x, y, repeats: int) -> float:
    """The median wall time of ``repeats`` calls of the replicated ``step`` on the global batch ``(x, y)`` after
    one untimed; every variable is put back."""
    flat = step.flat_inputs(step.split(x, y))
    snapshot = step.snapshot()
    times = []
    try:
        for _ in range(repeats + 1):
            started = time.perf_counter()
            np.asarray(step.run_flat(*flat)[1])  # the loss: waits for the step
            times.append(time.perf_counter() - started)
    finally:
        snapshot.restore()
    return float(np.median(times[1:]))


def gpu_replica_peaks(events, placements, *, devices, resident_bytes, allocator_peak_bytes,
                      host_state_bytes=()) -> tuple[ReplicaPeak, ...]:
    """Each replica's peak on its GPU from one profiled step's memory events: a GPU's allocator (``GPU_k_bfc``)
    holds its replica's allocations alone, read in requested bytes on top of ``resident_bytes[k]``
    (``rewriter.placement.placements.gpu_reading``). The replicas' host copies share the machine's pinned
    allocator, so ``host_peak_bytes`` is the machine's, the same on every row. Each row is named by the
    strategy's device (``devices[k]``, ``Replicas.devices``), as the capture names it; ``host_state_bytes[k]``: what
    replica ``k``'s variables hold on the host (``ReplicaPeak``), none when left out."""
    peaks = []
    for k, place in enumerate(placements):
        device = place.accelerator.rsplit("device:", 1)[-1]
        reading = gpu_reading(events, device, allocator_peak_bytes=allocator_peak_bytes[k], current_bytes=0,
                              resident_bytes=resident_bytes[k], allocator_prefix=place.allocator_prefix)
        peaks.append(ReplicaPeak(k, devices[k], reading.peak_bytes, int(reading.host_peak_bytes or 0),
                                 reading.resident_bytes, 0, host_shared=True,
                                 host_state_bytes=int(host_state_bytes[k]) if host_state_bytes else 0))
    return tuple(peaks)
