"""Replay a training step with a swap plan: peak device memory, host memory, step time, transfers.

Time model (issue 2): ops run one after another on one compute stream in the plan's execution
order; one copy engine per direction, transfers queue in the order they become ready; a
swapped-out buffer is freed when its device-to-host copy is done and its remaining readers have
run; a swap-in allocates when it becomes ready (trigger done, data on the host), even if the
engine starts its copy later, and its consumers wait for the copy to finish. A swap-in whose trigger
(or, synchronous, whose consumer's other input) may be fused into its consumer starts after that
op's own inputs instead, as the rewriter builds it (``simulator.fusion``). Rewiring reads can let an
op write its output in place (``buffers.in_place_after_rewiring``).

Memory is accounted per execution slot: a buffer is live from the slot that allocates it to the
slot of its last reader; a transfer event at time t counts in the slot running at t. One moment
is not inside any op: while an op waits for its swap-ins, their buffers are allocated as each
becomes ready, and a copy out that ends during the wait still holds its buffer until then; a
slot's figure is the larger of its op's and its wait's (``wait_slots``). Only swapped tensors are
re-accounted per plan, on top of a cached baseline, which keeps a replay around a millisecond for
ResNet-50-sized graphs.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from simulator.buffers import (alloc_slot_bytes, baseline_slot_bytes, buffers, contains, in_place_after_rewiring,
                               ranges, rewired_lifetimes, slot_levels)
from simulator.devices import CalibratedDevice, DeviceModel, get_device
from simulator.fusion import safe_wait_slots
from simulator.graph import GraphError, OpGraph
from simulator.ordering import execution_order, position_of
from simulator.planning import SwapPlan


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


def _slot_times(g: OpGraph, device: DeviceModel) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """Per execution slot: op duration and finish time without stalls (and the latter as a list)."""
    duration = op_seconds(g, device)[execution_order(g)]
    finish = np.cumsum(duration)
    return duration, finish, finish.tolist()


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
    duration, finish_plain, finish_plain_list = g.cached(("slot_times", device), lambda graph: _slot_times(graph, device),
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

    # ---- when each transfer may start, in slot terms
    out_ready_slot = position[g.tensor_producer[swap_tensor]]
    first_consumer = plan.in_consumers[plan.in_consumer_ptr[:-1]]
    need_slot = position[first_consumer]
    sync_in = plan.in_trigger < 0
    planned_slot = position[np.maximum(plan.in_trigger, 0)]  # the trigger's, where there is one
    trigger_slot = np.where(sync_in, -1, planned_slot)
    if sync_in.any():
        max1, max1_tensor, max2 = g.cached("other_input_slots", _other_input_slots, structural=True)
        other = np.where(max1_tensor[first_consumer] == in_tensor, max2[first_consumer], max1[first_consumer])
        sync_slot = np.maximum(other, position[plan.in_after])
        trigger_slot = np.where(sync_in, sync_slot, trigger_slot)
    # a swap-in the rewriter cannot have wait for an op fused with its consumer starts before that op
    fused_wait, safe_slot = safe_wait_slots(g, in_tensor, plan.in_trigger, plan.in_after,
                                            plan.in_consumer_ptr, plan.in_consumers)
    trigger_slot = np.where(fused_wait, safe_slot, trigger_slot)
    # with after_copies_out, the copies it waits for: its trigger's own (as planned), or those of the
    # op a synchronous one now starts after (the rewriter's rule)
    copies_slot = np.where(sync_in, trigger_slot, planned_slot)

    # far reads rewired per swapped buffer; the original buffer's remaining readers
    reads_per_in = plan.in_consumer_ptr[1:] - plan.in_consumer_ptr[:-1]
    far_keys = in_tensor.repeat(reads_per_in) * g.n_ops + plan.in_consumers
    roots, swap_root = _unique_inverse(info.root[swap_tensor])
    root_last_slot, moved_links, moved_last, home_link = rewired_lifetimes(g, roots, far_keys, swap_tensor)

    # sync swap-out: the first op still reading the buffer after its producer waits for the copy
    sync_wait = np.full(n_swaps, -1, dtype=np.int64)
    if plan.sync_out.any():
        sync_wait = _first_remaining_reader(g, swap_tensor, far_keys, plan.sync_out)

    # ---- discrete-event pass over the few slots that wait for a transfer
    # a swap-in after the copies out of what the op it starts after made: the swaps made at each slot
    outs_at_slot: dict[int, list[int]] = {}
    if plan.after_copies_out:
        for i, slot in enumerate(out_ready_slot.tolist()):
            outs_at_slot.setdefault(slot, []).append(i)
    out_start, out_end, in_ready, in_start, in_end, seg_slot, seg_shift = _schedule(
        finish_plain, finish_plain_list, out_ready_slot, out_duration, trigger_slot, plan.in_swap, in_duration,
        need_slot, sync_wait, outs_at_slot, copies_slot)
    in_swap = plan.in_swap
    seg_bounds = _array(seg_slot + [len(duration)], np.int64)
    finish_all = finish_plain + _array(seg_shift).repeat(seg_bounds[1:] - seg_bounds[:-1])

    # ---- device memory per slot: re-account swapped buffers, add swap-in buffers
    n_slots = len(duration)
    start_all = finish_all - duration
    out_free_slot = np.minimum(np.searchsorted(finish_all, out_end, side="left"), n_slots - 1)
    # a copy that ends while its slot's op still waits (a stall) frees the buffer before the op
    # allocates anything: it does not count in that slot (to a nanosecond: the op's start is
    # finish - duration, which rounds differently from the copy's end it waited for), only in
    # the wait (_wait_peaks)
    out_free_slot -= out_end <= start_all[out_free_slot] + 1e-9
    # a copy out holds the buffer its tensor lives in: the original, or a swap-in's that a
    # rewired read carried it into (see rewired_lifetimes)
    in_original = home_link < 0
    if in_original.all():
        held_root, held_free, held_end = swap_root, out_free_slot, out_end
    else:
        held_root, held_free, held_end = swap_root[in_original], out_free_slot[in_original], out_end[in_original]
    copy_free_slot = np.full(len(roots), -1, dtype=np.int64)
    np.maximum.at(copy_free_slot, held_root, held_free)
    new_free = np.maximum(root_last_slot, copy_free_slot)
    copy_end = np.zeros(len(roots))
    np.maximum.at(copy_end, held_root, held_end)
    # a swap-in's buffer exists from when the copy op may run (its trigger done, the host copy
    # there), not from when the copy engine gets to it: TF allocates the output as the op runs and
    # queues the copy on the stream (GPU), or copies at once (CPU testbed)
    in_alloc_slot = np.minimum(np.searchsorted(finish_all, in_ready, side="right"), need_slot)
    last_consumer = plan.in_consumers[plan.in_consumer_ptr[1:] - 1]
    in_free_slot = np.maximum(position[last_consumer], in_alloc_slot)
    by_key = np.argsort(far_keys, kind="stable")
    sorted_far_keys = far_keys[by_key]
    group_of_read = np.repeat(np.arange(n_ins), reads_per_in)[by_key]
    if len(moved_links):  # ops that wrote into a rewired read's buffer keep the swap-in alive
        group = group_of_read[np.searchsorted(sorted_far_keys, moved_links)]
        np.maximum.at(in_free_slot, group, moved_last)
        moved = ~in_original
        group = group_of_read[np.searchsorted(sorted_far_keys, home_link[moved])]
        np.maximum.at(in_free_slot, group, out_free_slot[moved])
    in_place_slot, in_place_out = in_place_after_rewiring(g, roots, root_last_slot, copy_free_slot, sorted_far_keys,
                                                          in_free_slot[group_of_read])
    # the changes to the baseline, counted in one go (whole byte counts: exact in float64 in any
    # order): swapped buffers freed earlier, swap-in buffers, and outputs that share the buffer
    # their op was the last to read (in place) need none of their own in that slot
    root_bytes = float_bytes[roots]
    in_place_bytes = float_bytes[in_place_out]
    change_slot = np.concatenate([info.free_slot[roots] + 1, new_free + 1, in_alloc_slot, in_free_slot + 1,
                                  in_place_slot, in_place_slot + 1])
    change_bytes = np.concatenate([root_bytes, -root_bytes, in_bytes, -in_bytes, -in_place_bytes, in_place_bytes])
    slot_bytes = slot_bytes + np.cumsum(np.bincount(change_slot, change_bytes, minlength=n_slots + 1)[:-1])
    slot_bytes, wait_slots, wait_moment = _wait_peaks(
        g, slot_bytes, start_all, finish_all, roots, new_free, copy_free_slot, copy_end, in_alloc_slot,
        in_ready, in_bytes, in_place_slot, in_place_out)

    host_peak, host_peak_s = _host_peak(swap_bytes, out_start, in_swap, in_end)

    return _result(g, slot_bytes, levels_of_slot, persistent, finish_all, op_seconds(g, device), compute_s,
                   contention_s=device.copy_contention * float(out_duration.sum() + in_duration.sum()),
                   host_peak=host_peak, d2h=int(swap_bytes.sum()), h2d=int(in_bytes.sum()), plan=plan,
                   outs=(out_start, out_end), ins=(in_start, in_end), position=position,
                   swapped_roots=roots, swapped_root_free_slot=new_free, swap_in_alloc_slot=in_alloc_slot,
                   swap_in_free_slot=in_free_slot, in_place_outputs=in_place_out, swapped_root_copy_end_s=copy_end,
                   swap_in_alloc_s=in_ready, wait_slots=wait_slots, wait_moment_s=wait_moment, host_peak_s=host_peak_s)


def _float_bytes(g: OpGraph) -> np.ndarray:
    """``g.tensor_bytes`` as float64 (what byte sums are taken in), once per batch size."""
    return g.cached("float_tensor_bytes", lambda graph: graph.tensor_bytes.astype(np.float64), structural=False)


def _per_transfer(seconds, n: int) -> np.ndarray:
    """A device's transfer times as a float64 array of length ``n`` (a model may give a scalar)."""
    if isinstance(seconds, np.ndarray) and seconds.dtype == np.float64 and seconds.shape == (n,):
        return seconds
    return np.asarray(seconds, dtype=np.float64) * np.ones(n)


def _unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` for a short 1-d array, at a third of its overhead."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    new = np.empty(len(ordered), bool)
    new[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    inverse = np.empty(len(ordered), np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ordered[new], inverse


def _wait_peaks(g, slot_bytes, start_all, finish_all, roots, root_free_slot, copy_free_slot, copy_end,
                in_alloc_slot, in_ready, in_bytes, in_place_slot, in_place_out):
    """Memory during the waits in which a copy out ends after a swap-in was allocated.

    Before the op at slot s starts, its wait holds what lives on from slot s-1, the swap-ins
    allocated so far (``in_ready``) and the swapped buffers whose copy out has not ended
    (``copy_end``, where the copy frees the buffer: freed in slot s-1 by the rule above), but not
    the op's own outputs. Returns ``slot_bytes`` with each such slot raised to its wait's peak
    where that is larger, those slots and the moments of their peaks."""
    none = (slot_bytes, np.zeros(0, np.int64), np.zeros(0))
    n_slots = len(slot_bytes)
    # roots whose copy out frees them after their last slot ended: in the next slot's wait
    waiting = (copy_free_slot >= root_free_slot) & (root_free_slot + 1 < n_slots)
    waiting &= copy_end > finish_all[np.minimum(root_free_slot, n_slots - 1)] + 1e-9
    if not waiting.any() or not len(in_ready):
        return none
    wait_root = np.flatnonzero(waiting)
    root_slot = root_free_slot[wait_root] + 1
    in_wait = in_ready < start_all[in_alloc_slot] - 1e-9  # allocated before its slot's op starts
    # slots where a swap-in is allocated in the wait before a copy out there ends
    first_in = np.full(n_slots, np.inf)
    np.minimum.at(first_in, in_alloc_slot[in_wait], in_ready[in_wait])
    last_end = np.zeros(n_slots)
    np.maximum.at(last_end, root_slot, copy_end[wait_root])
    slots = np.flatnonzero(last_end > first_in + 1e-9)
    if not len(slots):
        return none
    own_bytes = alloc_slot_bytes(g)[:n_slots].copy()  # what the op at each slot allocates for its outputs
    if len(in_place_slot):
        np.subtract.at(own_bytes, in_place_slot, _float_bytes(g)[in_place_out])
    root_bytes = _float_bytes(g)[roots[wait_root]]
    # each wait starts with what lives on from the slot before, and the buffers copied out in it
    start_bytes = (slot_bytes[slots] - own_bytes[slots]
                   - np.bincount(in_alloc_slot, in_bytes, minlength=n_slots)[slots]
                   + np.bincount(root_slot, root_bytes, minlength=n_slots)[slots])
    # then its events: swap-ins allocated, copies out ending (frees first at the same instant, to a ns)
    held = contains(slots, root_slot)
    allocated = in_wait & contains(slots, in_alloc_slot)
    event_slot = np.concatenate([root_slot[held], in_alloc_slot[allocated]])
    event_time = np.concatenate([copy_end[wait_root][held] - 1e-9, in_ready[allocated]])
    event_bytes = np.concatenate([-root_bytes[held], in_bytes[allocated]])
    by_time = np.lexsort((event_bytes, event_time, event_slot))
    event_slot, event_time, event_bytes = event_slot[by_time], event_time[by_time], event_bytes[by_time]
    group = np.searchsorted(slots, event_slot)
    first = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1])))
    total = np.cumsum(event_bytes)
    before = np.concatenate(([0.0], total))[first]  # the running sum where each wait's events start
    stops = np.append(first[1:], len(total))
    running = total - before.repeat(stops - first) + start_bytes[group]
    best = np.lexsort((-running, group))[first]  # each wait's largest moment (groups are sorted)
    higher = running[best] > slot_bytes[slots]
    result = slot_bytes.copy()
    result[slots[higher]] = running[best][higher]
    return result, slots[higher].astype(np.int64), event_time[best][higher]


def _host_peak(swap_bytes: np.ndarray, out_start: np.ndarray, in_swap: np.ndarray,
               in_end: np.ndarray) -> tuple[int, float]:
    """Host memory over time, its peak and when: a copy lives from its swap-out to its last swap-in."""
    if len(swap_bytes) == 0:
        return 0, 0.0
    host_free = host_free_s(len(swap_bytes), in_swap, in_end)
    times = np.concatenate([out_start, host_free])
    sizes = np.concatenate([swap_bytes, -swap_bytes])
    by_time = np.lexsort((sizes, times))  # frees before allocations at the same instant
    running = np.cumsum(sizes[by_time])
    top = int(np.argmax(running))
    return int(max(0.0, running[top])), float(times[by_time[top]])


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


def _schedule(finish_array, finish_plain, out_ready, out_duration_array, trigger, in_swap_array, in_duration_array,
              need, sync_wait_array, outs_at_slot, copies_slot):
    """Event pass: walk the slots that wait for a transfer in order, shifting later ops by the stall.

    Finish times are plain finish + a piecewise-constant shift (``seg_slot``/``seg_shift``), so
    only the waiting slots cost Python work. Queues are FIFO by ready time; a transfer's ready
    time depends only on slots before the one waiting for it, so one pass suffices. Copies out
    that become ready before the first waiting slot are scheduled in bulk (numpy). Per-slot and
    per-transfer inputs come as arrays (``finish_plain`` also as a list, for scalar lookups).
    ``outs_at_slot``: slot -> swaps its op makes; swap-in j waits for those of ``copies_slot[j]``
    (``SwapPlan.after_copies_out``; empty otherwise). Transfer ends not known yet are -1.0.
    """
    n_swaps, n_ins = len(out_ready), len(trigger)
    in_ready, in_start, in_end = [0.0] * n_ins, [0.0] * n_ins, [-1.0] * n_ins
    seg_slot, seg_shift = [0], [0.0]
    shift = 0.0  # the shift of the latest segment

    # waiting slots in order: swap-in consumers (item j >= 0), then sync swap-out readers (item -1 - i)
    outs_waited = np.flatnonzero(sync_wait_array >= 0)
    if len(outs_waited):
        wait_slot = np.concatenate([need, sync_wait_array[outs_waited]])
        wait_item = np.concatenate([np.arange(n_ins), -1 - outs_waited])
        by_slot = np.lexsort((wait_item, wait_slot))
        wait_slots, wait_items = wait_slot[by_slot].tolist(), wait_item[by_slot].tolist()
    else:  # the same order: swap-ins by slot, then index
        by_slot = np.argsort(need, kind="stable")
        wait_slots, wait_items = need[by_slot].tolist(), by_slot.tolist()
    first_wait = wait_slots[0] if wait_slots else len(finish_plain)

    # copies out: FIFO in ready order; those ready before any stall are computed in bulk, the rest
    # in the pass (their ready slots, durations and indices in queue order, from ``early`` on)
    out_queue = np.argsort(out_ready, kind="stable")
    ready_slots = out_ready[out_queue]
    early = int(np.searchsorted(ready_slots, first_wait, side="left"))
    durations = out_duration_array[out_queue]
    cumulative = np.cumsum(durations[:early])
    ends = cumulative + np.maximum.accumulate(finish_array[ready_slots[:early]] - (cumulative - durations[:early]))
    out_end_array = np.full(n_swaps, -1.0)
    out_end_array[out_queue[:early]] = ends
    out_end = out_end_array.tolist()
    late_queue, late_slot, late_duration = out_queue[early:], ready_slots[early:].tolist(), durations[early:].tolist()
    late_index = late_queue.tolist()
    late_start: list[float] = []
    out_cursor = 0  # into the late copies out
    d2h_free = float(ends[-1]) if early else 0.0

    def swap_out_end(i: int) -> float:
        nonlocal out_cursor, d2h_free
        while out_end[i] < 0.0:
            slot = late_slot[out_cursor]  # before the waiting slot at hand: its finish is settled
            if slot >= seg_slot[-1]:
                start = finish_plain[slot] + shift
            else:
                start = finish_plain[slot] + seg_shift[bisect_right(seg_slot, slot) - 1]
            if d2h_free > start:
                start = d2h_free
            late_start.append(start)
            out_end[late_index[out_cursor]] = d2h_free = start + late_duration[out_cursor]
            out_cursor += 1
        return out_end[i]

    # swap-ins in trigger order; all whose trigger runs before a waiting slot are released at that
    # slot, after the stalls of the slots before: the current shift is their trigger's
    in_order_array = np.argsort(trigger, kind="stable")
    release_slots = trigger[in_order_array].tolist() + [len(finish_plain)]  # a sentinel after the last
    release_finish = np.where(trigger >= 0, finish_array[np.maximum(trigger, 0)], 0.0)[in_order_array].tolist()
    in_order = in_order_array.tolist()
    in_swap, in_duration = in_swap_array.tolist(), in_duration_array.tolist()
    copies_of = copies_slot.tolist() if outs_at_slot else None
    in_cursor = 0
    heap: list[tuple[float, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    h2d_free = 0.0
    index = 0
    n_waits = len(wait_slots)
    wait_slots.append(-1)  # a sentinel after the last
    while index < n_waits:
        slot = wait_slots[index]
        while release_slots[in_cursor] < slot:  # triggers that have run
            j = in_order[in_cursor]
            ready = release_finish[in_cursor] + shift
            in_cursor += 1
            data = out_end[in_swap[j]]
            if data < 0.0:
                data = swap_out_end(in_swap[j])
            if copies_of is not None:
                for other in outs_at_slot.get(copies_of[j], ()):
                    copied = out_end[other] if out_end[other] >= 0.0 else swap_out_end(other)
                    if copied > data:
                        data = copied
            if data > ready:
                ready = data
            in_ready[j] = ready
            push(heap, (ready, j))
        required = 0.0
        while wait_slots[index] == slot:
            item = wait_items[index]
            index += 1
            if item < 0:
                done = swap_out_end(-1 - item)
            else:
                while in_end[item] < 0.0:
                    ready, j = pop(heap)
                    if h2d_free > ready:
                        ready = h2d_free
                    in_start[j] = ready
                    in_end[j] = h2d_free = ready + in_duration[j]
                done = in_end[item]
            if done > required:
                required = done
        previous_finish = (finish_plain[slot - 1] + shift) if slot > 0 else 0.0
        if required > previous_finish:
            shift += required - previous_finish
            seg_slot.append(slot)
            seg_shift.append(shift)
    if len(late_index):  # a swap-out nobody waited for still happens
        swap_out_end(late_index[-1])
    out_start_array = out_end_array  # reused: the early ones' ends become starts, the late ones are set
    out_start_array[out_queue[:early]] -= durations[:early]
    out_start_array[late_queue] = late_start
    return (out_start_array, _array(out_end), _array(in_ready), _array(in_start), _array(in_end), seg_slot,
            seg_shift)


def _array(values: list, dtype=np.float64) -> np.ndarray:
    """A list of Python numbers as an array (np.fromiter: about half np.asarray's cost on lists)."""
    return np.fromiter(values, dtype, len(values))


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
    (``DeviceModel.copy_contention`` x transfer time); ``details``: the plan's per-buffer fields (see Replay)."""
    if len(slot_bytes):
        peak_slot = int(np.argmax(slot_bytes))
        if g.order == "cto":  # slots sorted by level
            level_peak = np.maximum.reduceat(slot_bytes, _level_starts(g)) + persistent
        else:
            level_peak = np.zeros(int(levels_of_slot.max()) + 1)
            np.maximum.at(level_peak, levels_of_slot, slot_bytes)
            level_peak += persistent
        peak = int(round(slot_bytes[peak_slot])) + persistent
        peak_level = int(levels_of_slot[peak_slot])
        step_s = float(finish_all[-1]) + contention_s
    else:
        level_peak, peak, peak_level, step_s = np.zeros(0), persistent, 0, 0.0
    op_end = finish_all[position] if len(position) else np.empty(0)
    op_start = op_end - op_duration if len(position) else op_end
    return Replay(
        peak_bytes=peak, host_peak_bytes=host_peak, step_s=step_s, compute_s=compute_s,
        stall_s=max(0.0, step_s - compute_s), d2h_bytes=d2h, h2d_bytes=h2d,
        n_swap_outs=0 if plan is None else plan.n_swaps, n_swap_ins=0 if plan is None else plan.n_swap_ins,
        persistent_bytes=persistent, peak_level=peak_level, level_peak_bytes=level_peak,
        op_start_s=op_start, op_end_s=op_end, swap_out_start_s=outs[0], swap_out_end_s=outs[1],
        swap_in_start_s=ins[0], swap_in_end_s=ins[1], peak_slot=peak_slot if len(slot_bytes) else 0, **details,
    )
