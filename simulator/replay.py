"""Replay a training step with a swap plan: peak device memory, host memory, step time, transfers.

Time model (issue 2): ops run one after another on one compute stream in the plan's execution
order; one copy engine per direction, transfers queue in the order they become ready; a
swapped-out buffer is freed when its device-to-host copy is done and its remaining readers have
run; a swap-in allocates when it becomes ready (trigger done, data on the host), even if the
engine starts its copy later, and its consumers wait for the copy to finish. A swap-in whose trigger
(or, synchronous, whose consumer's other input) may be fused into its consumer starts after that
op's own inputs instead, as the rewriter builds it (``simulator.fusion``). Rewiring reads can let an
op write its output in place (``kernels.account``).

Memory is accounted per execution slot: a buffer is live from the slot that allocates it to the
slot of its last reader; a transfer event at time t counts in the slot running at t. One moment
is not inside any op: while an op waits for its swap-ins, their buffers are allocated as each
becomes ready, and a copy out that ends during the wait still holds its buffer until then; a
slot's figure is the larger of its op's and its wait's (``wait_slots``). Only swapped tensors are
re-accounted per plan, on top of a cached baseline. The per-plan loops (the plan in slot terms, the
event pass, the memory accounting) are compiled (``simulator.kernels``, numba): a few tenths of a
millisecond per replay of a ResNet-50-sized graph, results bit-identical to the numpy replay they
replaced (tests/test_simulator_golden.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from simulator.buffers import (alloc_slot_bytes, baseline_slot_bytes, buffers, contains, ranges, rewired_lifetimes,
                               slot_levels)
from simulator.calibrated import CalibratedDevice
from simulator.devices import DeviceModel, get_device
from simulator.fusion import safe_wait_slots
from simulator.graph import GraphError, OpGraph
from simulator.ordering import execution_order, position_of
from simulator.planning import SwapPlan
from simulator.kernels import account, prepare, schedule, summarize


@dataclass(frozen=True, eq=False)
class Replay:
    """What one simulated step costs. Times in seconds, sizes in bytes.

    ``peak_bytes`` counts everything resident on the device (weights, optimizer state, inputs)
    plus the live activations at the worst slot, as ``get_memory_info(...)['peak']`` does.
    ``level_peak_bytes[L]`` is the memory timeline over the categorized ordering.
    Per-op and per-transfer times are kept for checking and plotting.
    """

    peak_bytes: int
    host_peak_bytes: int
    step_s: float
    compute_s: float
    stall_s: float
    d2h_bytes: int
    h2d_bytes: int
    n_swap_outs: int
    n_swap_ins: int
    persistent_bytes: int
    peak_level: int
    level_peak_bytes: np.ndarray = field(repr=False)
    op_start_s: np.ndarray = field(repr=False)
    op_end_s: np.ndarray = field(repr=False)
    swap_out_start_s: np.ndarray = field(repr=False)
    swap_out_end_s: np.ndarray = field(repr=False)
    swap_in_start_s: np.ndarray = field(repr=False)
    swap_in_end_s: np.ndarray = field(repr=False)
    peak_slot: int = 0
    # where the plan moved buffers, in execution slots (see simulator.explain)
    swapped_roots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    swapped_root_free_slot: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    swap_in_alloc_slot: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    swap_in_free_slot: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    in_place_outputs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    # when each swapped root's copies out are done, each swap-in's buffer is allocated (seconds), and
    # the slots whose figure is the memory during their op's wait, at the moment given
    swapped_root_copy_end_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    swap_in_alloc_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    wait_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    wait_moment_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    host_peak_s: float = 0.0  # when the host holds host_peak_bytes
    # compute time that runs while copies do (summed over copies): what copies sharing the compute's
    # cores slow down (DeviceModel.copy_contention seconds per second of it; stalls cost nothing more)
    copy_overlap_s: float = 0.0

    @property
    def overhead(self) -> float:
        """Slow-down against running the same ops without waiting for transfers."""
        return self.step_s / self.compute_s - 1.0 if self.compute_s > 0 else 0.0

    def fits(self, budget_bytes: int) -> bool:
        return self.peak_bytes <= budget_bytes

    def as_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes, "host_peak_bytes": self.host_peak_bytes, "step_s": self.step_s,
            "compute_s": self.compute_s, "stall_s": self.stall_s, "overhead": self.overhead,
            "d2h_bytes": self.d2h_bytes, "h2d_bytes": self.h2d_bytes, "n_swap_outs": self.n_swap_outs,
            "n_swap_ins": self.n_swap_ins, "persistent_bytes": self.persistent_bytes, "peak_level": self.peak_level,
        }


def op_seconds(g: OpGraph, device: DeviceModel) -> np.ndarray:
    """Per-op compute time on ``device``, indexed like g's ops: measured on a ``CalibratedDevice`` (which
    refuses another model's graph), else the roofline of FLOPs and bytes touched."""
    if isinstance(device, CalibratedDevice):
        return g.cached(("op_seconds", device), device.graph_op_seconds, structural=False)
    return g.cached(("op_seconds", device), lambda graph: np.asarray(
        device.op_seconds(graph.op_flops, graph.op_touched_bytes), dtype=np.float64), structural=False)


def _slot_times(g: OpGraph, device: DeviceModel) -> tuple[np.ndarray, np.ndarray]:
    """Per execution slot: op duration and finish time without stalls."""
    duration = op_seconds(g, device)[execution_order(g)]
    return duration, np.cumsum(duration)


def _other_input_slots(g: OpGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per op: the latest slot among its inputs' producers and control predecessors (max1), which
    tensor that was (-1 for a control edge), and the latest among the rest (max2). A synchronous
    swap-in of tensor t for consumer c waits for max1 unless t is the one that made max1."""
    position = position_of(g)
    src_slot = np.concatenate([position[g.tensor_producer[g.edge_tensor]], position[g.control_src]])
    src_tensor = np.concatenate([g.edge_tensor, np.full(len(g.control_src), -1)])
    dst = np.concatenate([g.edge_consumer, g.control_dst])
    order = np.lexsort((-src_slot, dst))
    dst, src_slot, src_tensor = dst[order], src_slot[order], src_tensor[order]
    max1 = np.full(g.n_ops, -1, dtype=np.int64)
    max1_tensor = np.full(g.n_ops, -2, dtype=np.int64)
    max2 = np.full(g.n_ops, -1, dtype=np.int64)
    first = np.ones(len(dst), bool)
    first[1:] = dst[1:] != dst[:-1]
    max1[dst[first]] = src_slot[first]
    max1_tensor[dst[first]] = src_tensor[first]
    rest = ~first & (src_tensor != max1_tensor[dst])
    np.maximum.at(max2, dst[rest], src_slot[rest])
    return max1, max1_tensor, max2


def replay(g: OpGraph, plan: SwapPlan | None = None, device: DeviceModel | str = "v100-16gb") -> Replay:
    """Simulate one step of ``g`` at its batch size under ``plan`` (None or empty: no swapping)."""
    if isinstance(device, str):
        device = get_device(device)
    if plan is not None and plan.order_name != g.order:
        g = g.with_order(plan.order_name)
    position = position_of(g)
    duration, finish_plain = g.cached(("slot_times", device), lambda graph: _slot_times(graph, device),
                                      structural=False)
    compute_s = float(finish_plain[-1]) if len(finish_plain) else 0.0
    slot_bytes = baseline_slot_bytes(g)
    persistent = g.persistent_bytes
    levels_of_slot = slot_levels(g)

    if plan is None or plan.n_swaps == 0:
        return _result(g, slot_bytes, levels_of_slot, persistent, finish_plain, op_seconds(g, device), compute_s,
                       host_peak=0, d2h=0, h2d=0, plan=None, outs=(np.zeros(0), np.zeros(0)), ins=(np.zeros(0), np.zeros(0)),
                       position=position)
    if plan.graph_fingerprint and plan.graph_fingerprint != g.cached("fingerprint", OpGraph.fingerprint, structural=True):
        raise GraphError("this plan was made for another graph")

    info = buffers(g)
    swap_tensor = plan.tensor
    float_bytes = _float_bytes(g)
    swap_bytes = float_bytes[swap_tensor]
    n_swaps, n_ins = plan.n_swaps, plan.n_swap_ins
    in_tensor = swap_tensor[plan.in_swap]
    in_bytes = swap_bytes[plan.in_swap]
    out_duration = _per_transfer(device.transfer_seconds(swap_bytes, "d2h"), n_swaps)
    in_duration = _per_transfer(device.transfer_seconds(in_bytes, "h2d"), n_ins)

    # ---- when each transfer may start, in slot terms (compiled); a swap-in the rewriter cannot have
    # wait for an op fused with its consumer starts before that op
    fused_wait, safe_slot = safe_wait_slots(g, in_tensor, plan.in_trigger, plan.in_after,
                                            plan.in_consumer_ptr, plan.in_consumers)
    max1, max1_tensor, max2 = g.cached("other_input_slots", _other_input_slots, structural=True)
    out_ready_slot, need_slot, trigger_slot, copies_slot, far_keys, roots, swap_root = prepare(
        position, g.tensor_producer, info.root, g.n_ops, swap_tensor, plan.in_swap, plan.in_trigger, plan.in_after,
        plan.in_consumer_ptr, plan.in_consumers, max1, max1_tensor, max2, fused_wait, safe_slot)
    # far reads rewired per swapped buffer; the original buffer's remaining readers
    root_last_slot, moved_links, moved_last, home_link = rewired_lifetimes(g, roots, far_keys, swap_tensor)

    # sync swap-out: the first op still reading the buffer after its producer waits for the copy
    sync_wait = np.full(n_swaps, -1, dtype=np.int64)
    if plan.sync_out.any():
        sync_wait = _first_remaining_reader(g, swap_tensor, far_keys, plan.sync_out)

    # ---- discrete-event pass over the few slots that wait for a transfer (compiled)
    out_start, out_end, in_ready, in_start, in_end, finish_all, out_queue = schedule(
        finish_plain, out_ready_slot, out_duration, trigger_slot, plan.in_swap, in_duration, need_slot, sync_wait,
        plan.after_copies_out, copies_slot)
    in_swap = plan.in_swap

    # ---- device memory per slot: swapped buffers re-accounted, swap-in buffers added (compiled; the
    # kernel's comments give the rules), and the host's peak
    (slot_bytes, new_free, copy_end, in_alloc_slot, in_free_slot, in_place_out, wait_slots, wait_moment, host_peak,
     host_peak_s) = account(
        slot_bytes, alloc_slot_bytes(g), float_bytes, duration, finish_all, position, g.n_ops, out_start, out_end,
        out_queue, swap_root, home_link, swap_bytes, roots, info.free_slot[roots], root_last_slot, moved_links, moved_last,
        in_swap, in_ready, in_end, in_bytes, need_slot, plan.in_consumer_ptr, plan.in_consumers, far_keys,
        info.late_slot, info.late_key, info.late_root, info.late_out)
    host_peak, host_peak_s = int(host_peak), float(host_peak_s)

    overlap_s = compute_during(finish_all - duration, finish_all, np.concatenate([out_start, in_start]),
                               np.concatenate([out_end, in_end]))
    return _result(g, slot_bytes, levels_of_slot, persistent, finish_all, op_seconds(g, device), compute_s,
                   contention_s=device.copy_contention * overlap_s + device.copy_overhead_s * (n_swaps + n_ins),
                   copy_overlap_s=overlap_s,
                   host_peak=host_peak, d2h=int(swap_bytes.sum()), h2d=int(in_bytes.sum()), plan=plan,
                   outs=(out_start, out_end), ins=(in_start, in_end), position=position,
                   swapped_roots=roots, swapped_root_free_slot=new_free, swap_in_alloc_slot=in_alloc_slot,
                   swap_in_free_slot=in_free_slot, in_place_outputs=in_place_out, swapped_root_copy_end_s=copy_end,
                   swap_in_alloc_s=in_ready, wait_slots=wait_slots, wait_moment_s=wait_moment, host_peak_s=host_peak_s)


def compute_during(slot_start: np.ndarray, slot_end: np.ndarray, start: np.ndarray, end: np.ndarray) -> float:
    """Compute time of the one compute stream (slots running back to back from ``slot_start`` to
    ``slot_end``, in order) inside the intervals ``[start[i], end[i]]``, summed over them."""
    if not len(start) or not len(slot_start):
        return 0.0
    done = np.concatenate(([0.0], np.cumsum(slot_end - slot_start)))

    def done_by(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(slot_start, t, side="right") - 1
        inside = np.clip(t - slot_start[np.maximum(k, 0)], 0.0, slot_end[np.maximum(k, 0)] - slot_start[np.maximum(k, 0)])
        return np.where(k >= 0, done[np.maximum(k, 0)] + inside, 0.0)

    return float(np.sum(done_by(np.asarray(end)) - done_by(np.asarray(start))))


def _float_bytes(g: OpGraph) -> np.ndarray:
    """``g.tensor_bytes`` as float64 (what byte sums are taken in), once per batch size."""
    return g.cached("float_tensor_bytes", lambda graph: graph.tensor_bytes.astype(np.float64), structural=False)


def _per_transfer(seconds, n: int) -> np.ndarray:
    """A device's transfer times as a float64 array of length ``n`` (a model may give a scalar)."""
    if isinstance(seconds, np.ndarray) and seconds.dtype == np.float64 and seconds.shape == (n,):
        return seconds
    return np.asarray(seconds, dtype=np.float64) * np.ones(n)


def host_free_s(n_swaps: int, in_swap: np.ndarray, in_end: np.ndarray) -> np.ndarray:
    """Per swap: when its host copy is freed (its last swap-in done)."""
    host_free = np.zeros(n_swaps)
    np.maximum.at(host_free, in_swap, in_end)
    return host_free


def _first_remaining_reader(g: OpGraph, tensor: np.ndarray, far_keys: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per swapped tensor (where ``mask``): the first slot that still reads it on the device (its
    reads not rewired to a swap-in; they wait for a synchronous swap-out), or when none does, the
    slot after its producer's (so the copy frees the buffer before the step goes on); -1 where not
    ``mask`` or the producer runs last."""
    position = position_of(g)
    by_tensor = g.cached("edges_by_tensor", lambda graph: np.argsort(graph.edge_tensor, kind="stable"),
                         structural=True)
    waited = np.flatnonzero(mask)
    edge_tensor = g.edge_tensor[by_tensor]
    starts = np.searchsorted(edge_tensor, tensor[waited], side="left")
    stops = np.searchsorted(edge_tensor, tensor[waited], side="right")
    consumers = g.edge_consumer[by_tensor[ranges(starts, stops)]]
    owner = np.repeat(np.arange(len(waited)), stops - starts)  # index into ``waited`` of each read
    kept = ~contains(np.sort(far_keys), tensor[waited][owner] * g.n_ops + consumers)
    first = position[g.tensor_producer[tensor]] + 1  # no reader left: the slot after the producer's
    earliest = np.full(len(waited), g.n_ops, dtype=np.int64)
    np.minimum.at(earliest, owner[kept], position[consumers[kept]])
    first[waited] = np.where(earliest < g.n_ops, earliest, first[waited])
    return np.where(mask & (first < g.n_ops), first, -1).astype(np.int64)


def _level_starts(g: OpGraph) -> np.ndarray:
    """First slot of each level, in the "cto" order (where slots are sorted by level)."""
    def compute(graph: OpGraph) -> np.ndarray:
        levels_of_slot = slot_levels(graph)
        return np.flatnonzero(np.concatenate(([True], levels_of_slot[1:] != levels_of_slot[:-1])))
    return g.cached("level_starts", compute, structural=True)


def _result(g, slot_bytes, levels_of_slot, persistent, finish_all, op_duration, compute_s, *, host_peak, d2h, h2d,
            plan, outs, ins, position, contention_s=0.0, **details) -> Replay:
    """The Replay of a step whose slot memory and finish times are known (``op_duration``: per op,
    ``op_seconds``); ``contention_s``: what copies sharing the compute's cores add to the step
    (``DeviceModel.copy_contention`` x the compute time that overlaps copies, and ``copy_overhead_s`` per
    copy); ``details``: the plan's per-buffer fields (see Replay)."""
    if len(slot_bytes):
        level_starts = _level_starts(g) if g.order == "cto" else np.zeros(0, np.int64)  # cto: slots by level
        peak_slot, level_peak, op_end, op_start = summarize(slot_bytes, levels_of_slot, level_starts, persistent,
                                                            finish_all, position, op_duration)
        peak_slot = int(peak_slot)
        peak = int(round(slot_bytes[peak_slot])) + persistent
        peak_level = int(levels_of_slot[peak_slot])
        step_s = float(finish_all[-1]) + contention_s
    else:
        level_peak, peak, peak_level, step_s = np.zeros(0), persistent, 0, 0.0
        op_end = op_start = np.empty(0)
    return Replay(
        peak_bytes=peak, host_peak_bytes=host_peak, step_s=step_s, compute_s=compute_s,
        stall_s=max(0.0, step_s - compute_s), d2h_bytes=d2h, h2d_bytes=h2d,
        n_swap_outs=0 if plan is None else plan.n_swaps, n_swap_ins=0 if plan is None else plan.n_swap_ins,
        persistent_bytes=persistent, peak_level=peak_level, level_peak_bytes=level_peak,
        op_start_s=op_start, op_end_s=op_end, swap_out_start_s=outs[0], swap_out_end_s=outs[1],
        swap_in_start_s=ins[0], swap_in_end_s=ins[1], peak_slot=peak_slot if len(slot_bytes) else 0, **details,
    )
