"""The replay's event pass, compiled: slots that wait for a transfer walked in order, the
copy engines' queues, the stalls shifting later ops (``schedule``)."""

from __future__ import annotations

import numpy as np
from numba import njit

from simulator.kernels.records import LateCopies, Transfers
from simulator.kernels.tools import array_routine, heap_pop, heap_push, search_left, search_right, slot_argsort


@array_routine
def _swap_out_end(i, out_end, late, finish_plain, seg_slot, seg_shift, seg_count, shift):
    """The end of copy out ``i``, scheduling the late copies out (``LateCopies``) in queue order up to it
    (``late.cursor[0]``: the next late copy out, ``late.cursor[1]``: the segment of the last one's
    slot, which only moves on, as their slots do; ``late.d2h_free[0]``: when the d2h engine is free)."""
    cursor, d2h_free, late_queue, late_slot = late.cursor, late.d2h_free, late.queue, late.slot
    late_duration, late_start = late.duration, late.start
    while out_end[i] < 0.0:
        k = cursor[0]
        slot = late_slot[k]  # before the waiting slot at hand: its finish is settled
        if slot >= seg_slot[seg_count - 1]:
            start = finish_plain[slot] + shift
        else:
            segment = cursor[1]
            while segment + 1 < seg_count and seg_slot[segment + 1] <= slot:
                segment += 1
            cursor[1] = segment
            start = finish_plain[slot] + seg_shift[segment]
        if d2h_free[0] > start:
            start = d2h_free[0]
        late_start[k] = start
        d2h_free[0] = start + late_duration[k]
        out_end[late_queue[k]] = d2h_free[0]
        cursor[0] = k + 1
    return out_end[i]


@njit(cache=True, nogil=True)
def schedule(step, plan, slots, in_tensor, sync_wait):
    """The event pass of ``plan`` (``PlanArrays``; ``slots``: its ``SlotPlan``; ``in_tensor``: each
    swap-in's tensor; ``sync_wait``: ``plan_loops._sync_copy_waiters``) on ``step`` (a
    ``StepRecord``): walk the slots that wait for a transfer in order, shifting later ops by the stall.

    Queues are FIFO by ready time; a transfer's ready time depends only on slots before the one
    waiting for it, so one pass suffices. Finish times are plain finish + a piecewise-constant shift
    (``seg_slot``/``seg_shift``). Copies out that become ready before the first waiting slot are
    scheduled in bulk; swap-ins are released in trigger order at the first waiting slot after their
    trigger, after the stalls of the slots before. With ``after_copies_out`` swap-in j also waits for
    the copies out of what the op at ``slots.copies[j]`` made. Transfer ends not known yet are -1.0.
    Returns ``Transfers``: the copies' start and end times, each swap-in's ready time, every slot's
    finish time with the stalls (each op's end and start follow from it, ``replay.Replay.op_end_s``,
    read on demand), the copies out in queue order and the swap-ins in the order they are copied."""
    finish_plain = step.finish_plain
    out_ready, trigger, need, copies_slot = slots.out_ready, slots.trigger, slots.need, slots.copies
    in_swap, after_copies_out = plan.in_swap, plan.after_copies_out
    out_duration = step.d2h_seconds[plan.swap_tensor]
    in_duration = step.h2d_seconds[in_tensor]
    n_slots, n_swaps, n_ins = len(finish_plain), len(out_ready), len(trigger)
    in_ready = np.zeros(n_ins)
    in_start = np.zeros(n_ins)
    in_end = np.full(n_ins, -1.0)

    # waiting slots in order: swap-ins' consumers (item j >= 0), then sync swap-out readers (item -1 - i)
    n_out_waits = 0
    for i in range(n_swaps):
        if sync_wait[i] >= 0:
            n_out_waits += 1
    n_waits = n_ins + n_out_waits
    # in ascending item order (copies out from the last swap down, then swap-ins), so that a stable
    # sort by slot orders by slot, then item (np.lexsort((wait_item, wait_slot)))
    wait_slot = np.empty(n_waits, np.int64)
    wait_item = np.empty(n_waits, np.int64)
    k = 0
    for i in range(n_swaps - 1, -1, -1):
        if sync_wait[i] >= 0:
            wait_slot[k] = sync_wait[i]
            wait_item[k] = -1 - i
            k += 1
    for j in range(n_ins):
        wait_slot[k] = need[j]
        wait_item[k] = j
        k += 1
    by_slot = slot_argsort(wait_slot, n_slots)
    wait_slots = np.empty(n_waits + 1, np.int64)
    wait_slots[:n_waits] = wait_slot[by_slot]
    wait_slots[n_waits] = -1  # a sentinel after the last
    wait_items = wait_item[by_slot]
    first_wait = wait_slots[0] if n_waits else n_slots

    seg_slot = np.empty(n_waits + 1, np.int64)
    seg_shift = np.empty(n_waits + 1)
    seg_slot[0], seg_shift[0] = 0, 0.0
    seg_count = 1
    shift = 0.0  # the shift of the latest segment

    # copies out: FIFO in ready order; those ready before any stall in bulk, the rest in the pass
    out_queue = slot_argsort(out_ready, n_slots)
    ready_slots = out_ready[out_queue]
    early = search_left(ready_slots, first_wait)
    durations = out_duration[out_queue]
    out_end = np.full(n_swaps, -1.0)
    out_start = np.empty(n_swaps)
    cumulative = 0.0
    latest = -np.inf
    end = 0.0
    for k in range(early):
        cumulative += durations[k]
        candidate = finish_plain[ready_slots[k]] - (cumulative - durations[k])
        if candidate > latest or k == 0:
            latest = candidate
        end = cumulative + latest
        out_end[out_queue[k]] = end
        out_start[out_queue[k]] = end - durations[k]
    d2h_free = np.zeros(1)
    d2h_free[0] = end if early else 0.0
    late = LateCopies(out_queue[early:], ready_slots[early:], durations[early:], np.empty(n_swaps - early),
                      np.zeros(2, np.int64), d2h_free)

    # a swap-in after the copies out of the op it starts after: the swaps made at each slot (CSR)
    outs_order, outs_slots = out_queue, ready_slots

    # swap-ins in trigger order; all whose trigger runs before a waiting slot are released at that slot
    in_order = slot_argsort(trigger, n_slots)
    release_slots = np.empty(n_ins + 1, np.int64)
    release_finish = np.empty(n_ins)
    for k in range(n_ins):
        j = in_order[k]
        release_slots[k] = trigger[j]
        release_finish[k] = finish_plain[trigger[j]] if trigger[j] >= 0 else 0.0
    release_slots[n_ins] = n_slots  # a sentinel after the last
    in_cursor = 0
    heap_times = np.empty(max(n_ins, 1))
    heap_items = np.empty(max(n_ins, 1), np.int64)
    heap_size = 0
    in_processed = np.empty(n_ins, np.int64)  # the swap-ins in the order the engine copies them
    n_processed = 0
    h2d_free = 0.0
    index = 0
    while index < n_waits:
        slot = wait_slots[index]
        while release_slots[in_cursor] < slot:  # triggers that have run
            j = in_order[in_cursor]
            ready = release_finish[in_cursor] + shift
            in_cursor += 1
            source = in_swap[j]
            data = out_end[source]
            if data < 0.0:
                data = _swap_out_end(source, out_end, late, finish_plain, seg_slot, seg_shift, seg_count, shift)
            if after_copies_out:
                lo = search_left(outs_slots, copies_slot[j])
                hi = search_right(outs_slots, copies_slot[j])
                for m in range(lo, hi):
                    other = outs_order[m]
                    copied = out_end[other]
                    if copied < 0.0:
                        copied = _swap_out_end(other, out_end, late, finish_plain, seg_slot, seg_shift, seg_count,
                                               shift)
                    if copied > data:
                        data = copied
            if data > ready:
                ready = data
            in_ready[j] = ready
            heap_size = heap_push(heap_times, heap_items, heap_size, ready, j)
        required = 0.0
        while wait_slots[index] == slot:
            item = wait_items[index]
            index += 1
            if item < 0:
                done = _swap_out_end(-1 - item, out_end, late, finish_plain, seg_slot, seg_shift, seg_count, shift)
            else:
                while in_end[item] < 0.0:
                    ready, j, heap_size = heap_pop(heap_times, heap_items, heap_size)
                    in_processed[n_processed] = j
                    n_processed += 1
                    if h2d_free > ready:
                        ready = h2d_free
                    in_start[j] = ready
                    h2d_free = ready + in_duration[j]
                    in_end[j] = h2d_free
                done = in_end[item]
            if done > required:
                required = done
        previous_finish = (finish_plain[slot - 1] + shift) if slot > 0 else 0.0
        if required > previous_finish:
            shift += required - previous_finish
            seg_slot[seg_count] = slot
            seg_shift[seg_count] = shift
            seg_count += 1
    if len(late.queue):  # a swap-out nobody waited for still happens
        _swap_out_end(late.queue[-1], out_end, late, finish_plain, seg_slot, seg_shift, seg_count, shift)
    for k in range(len(late.queue)):
        out_start[late.queue[k]] = late.start[k]
    # before the first stall nothing moves (finish + 0.0 is finish): copied; then each segment's shift
    finish_all = np.empty(n_slots)
    unmoved = seg_slot[1] if seg_count > 1 else n_slots
    finish_all[:unmoved] = finish_plain[:unmoved]
    for s in range(1, seg_count):
        stop = seg_slot[s + 1] if s + 1 < seg_count else n_slots
        for slot in range(seg_slot[s], stop):
            finish_all[slot] = finish_plain[slot] + seg_shift[s]
    return Transfers(out_start, out_end, in_ready, in_start, in_end, finish_all, out_queue, in_processed)
