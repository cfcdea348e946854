"""The replay's memory accounting, compiled: device memory per slot once transfers are timed
(``account``: swapped buffers freed earlier, swap-in buffers, outputs written in place), the waits'
peaks, the host's peak and the compute that runs during copies."""

from __future__ import annotations

import numpy as np
from numba import njit

from simulator.kernels.records import Memory, RootFrees
from simulator.kernels.tools import (array_routine, contains_value, lexsort, precedes, radix_argsort, search_left_near,
                                    search_right_near)


@njit(cache=True, nogil=True)
def account(step, plan, far, slots, lifetimes, transfers):
    """Device memory per slot once the transfers of ``plan`` are timed (``plan_loops.replay_plan`` names
    the records), on top of the unswapped baseline: swapped buffers freed earlier, swap-in buffers,
    outputs written in place, the waits' peaks; and the host's peak (the compute during copies is
    ``copy_overlap``'s). Returns ``Memory``: the peak slot (the first largest) and the peak per level
    (``step.levels_of_slot``; ``step.sorted_levels``: slots sorted by level, as in the "cto" order,
    each level's peak taken from its slots alone; otherwise from 0 bytes up), with the per-buffer
    fields of a Replay. All byte figures
    are whole numbers (in float64, or ``int_bytes`` and the slots' running sums in int64: exact either
    way, so sums agree in any order); times are compared as the numpy code compared them. Only what a
    plan moved is visited, but for one pass over the slots that adds the changes to the baseline."""
    graph = step.graph
    baseline_bytes, alloc_bytes, tensor_bytes, int_bytes = (step.baseline_bytes, step.alloc_bytes, step.tensor_bytes,
                                                            step.int_bytes)
    duration, levels_of_slot = step.duration, step.levels_of_slot
    n_levels, sorted_levels = step.n_levels, step.sorted_levels
    position, n_keys = graph.buffers.position, graph.buffers.n_keys
    late_slot, late_out = graph.late_slot, graph.late_out
    late_root_ptr, late_by_root, late_read_ptr, late_by_read = (graph.late_root_ptr, graph.late_by_root,
                                                                graph.late_read_ptr, graph.late_by_read)
    finish_all, out_end, out_queue = transfers.finish_all, transfers.out_end, transfers.out_queue
    in_ready = transfers.in_ready
    swap_root, roots, need_slot, trigger_slot = slots.swap_root, slots.roots, slots.need, slots.trigger
    root_last_slot, moved_ids, moved_last, home_ids = (lifetimes.root_last, lifetimes.cut_ids, lifetimes.cut_last,
                                                       lifetimes.home_ids)
    in_consumer_ptr, in_consumers = plan.in_consumer_ptr, plan.in_consumers
    in_tensor, far_tensor, far_ids = far.in_tensor, far.tensor, far.ids
    swap_bytes = tensor_bytes[plan.swap_tensor]
    in_bytes = tensor_bytes[in_tensor]
    root_base_free_slot = graph.free_slot[roots]
    n_slots, n_swaps, n_ins, n_roots = len(duration), len(out_end), len(in_ready), len(roots)
    # a copy out frees its buffer in the slot running when it ends; one that ends while the slot's
    # op still waits (a stall) frees it before the op allocates anything: it does not count in that
    # slot (to a nanosecond: the op's start is finish - duration, which rounds differently from the
    # copy's end it waited for), only in the wait (_wait_peaks)
    out_free_slot = np.empty(n_swaps, np.int64)
    found = 0
    for i in out_queue:  # copies end in queue order: each search starts from the last find
        found = search_left_near(finish_all, out_end[i], found)
        slot = min(found, n_slots - 1)
        if out_end[i] <= finish_all[slot] - duration[slot] + 1e-9:
            slot -= 1
        out_free_slot[i] = slot
    # a copy out holds the buffer its tensor lives in: the original, or a swap-in's that a rewired
    # read carried it into (see _lifetimes)
    copy_free_slot = np.full(n_roots, -1, np.int64)
    copy_end = np.zeros(n_roots)
    for i in range(n_swaps):
        if home_ids[i] < 0:
            r = swap_root[i]
            copy_free_slot[r] = max(copy_free_slot[r], out_free_slot[i])
            copy_end[r] = max(copy_end[r], out_end[i])
    new_free = np.maximum(root_last_slot, copy_free_slot)
    # a swap-in's buffer exists from when the copy op may run (its trigger done, the host copy
    # there), not from when the copy engine gets to it: TF allocates the output as the op runs and
    # queues the copy on the stream (GPU), or copies at once (CPU testbed)
    in_alloc_slot = np.empty(n_ins, np.int64)
    in_free_slot = np.empty(n_ins, np.int64)
    for j in range(n_ins):  # ready once its trigger slot ended (at the earliest): searched from there
        found = search_right_near(finish_all, in_ready[j], max(trigger_slot[j] + 1, 0))
        in_alloc_slot[j] = min(found, need_slot[j])
        in_free_slot[j] = max(position[in_consumers[in_consumer_ptr[j + 1] - 1]], in_alloc_slot[j])
    # each rewired read's swap-in, and the read of each rewired read id (set only at the plan's ids)
    n_reads = len(far_ids)
    swap_in_of_read = np.empty(n_reads, np.int64)
    for j in range(n_ins):
        for k in range(in_consumer_ptr[j], in_consumer_ptr[j + 1]):
            swap_in_of_read[k] = j
    read_of_id = np.empty(n_keys + 1, np.int64)
    for k in range(n_reads):
        read_of_id[far_ids[k]] = k
    if len(moved_ids):  # ops that wrote into a rewired read's buffer keep the swap-in alive
        for k in range(len(moved_ids)):  # (a cut link is a rewired read)
            group = swap_in_of_read[read_of_id[moved_ids[k]]]
            in_free_slot[group] = max(in_free_slot[group], moved_last[k])
        for i in range(n_swaps):
            if home_ids[i] >= 0:
                group = swap_in_of_read[read_of_id[home_ids[i]]]
                in_free_slot[group] = max(in_free_slot[group], out_free_slot[i])

    # Forwards a plan makes possible (``buffers.Buffers.late_*``). An op that could not write into an
    # input's buffer because a later op still read it can once that read goes to a swap-in, as TF's
    # forward_input_or_allocate_output does: into the original buffer when it is now its last reader
    # and the copy out is done within its slot (a BatchNorm's SquaredDifference on a swapped
    # convolution output), or into the swap-in's buffer when its own read was rewired and it is that
    # swap-in's last reader. "Within the slot" rather than "before the op starts": on the CPU testbed
    # the first matches ResNet-50's measured peaks under the fidelity plans (within 0.6 %), the second
    # over-predicted two of them by 4.7 %; the two differ only for a copy that ends while the op runs.
    # Only the forwards of the swapped buffers (``late_by_root``) and of the rewired reads
    # (``late_by_read``, by read id) can change.
    # (room for every candidate beforehand: an array reassigned in a loop costs a reference count per turn)
    room = len(late_slot)
    for m in range(len(far_ids)):
        if far_ids[m] >= 0:
            room += late_read_ptr[far_ids[m] + 1] - late_read_ptr[far_ids[m]]
    marked = np.empty(room, np.int64)
    n_marked = 0
    for r in range(n_roots):
        for m in range(late_root_ptr[roots[r]], late_root_ptr[roots[r] + 1]):
            k = late_by_root[m]
            if root_last_slot[r] == late_slot[k] and copy_free_slot[r] <= late_slot[k]:
                marked[n_marked] = k
                n_marked += 1
    n_first = n_marked
    for m in range(n_reads):
        read_id = far_ids[m]
        if read_id < 0:
            continue
        for q in range(late_read_ptr[read_id], late_read_ptr[read_id + 1]):
            k = late_by_read[q]
            if (in_free_slot[swap_in_of_read[m]] == late_slot[k]
                    and tensor_bytes[far_tensor[m]] == tensor_bytes[late_out[k]]
                    and not contains_value(marked, n_first, k)):
                marked[n_marked] = k
                n_marked += 1
    # an output's candidate inputs are consecutive, in input order (as TF's kernels try them): the
    # first possible wins
    in_place = np.sort(marked[:n_marked])
    n_placed, placed_out = 0, -1
    for k in in_place:
        if late_out[k] != placed_out:
            placed_out = late_out[k]
            in_place[n_placed] = k
            n_placed += 1
    in_place_slot = late_slot[in_place[:n_placed]]
    in_place_out = late_out[in_place[:n_placed]]

    # the changes to the baseline, counted in one go; the peaks in the same pass
    delta = np.zeros(n_slots + 1, np.int64)
    for r in range(n_roots):
        size = int_bytes[roots[r]]
        delta[root_base_free_slot[r] + 1] += size
        delta[new_free[r] + 1] -= size
    for j in range(n_ins):
        delta[in_alloc_slot[j]] += int_bytes[in_tensor[j]]
        delta[in_free_slot[j] + 1] -= int_bytes[in_tensor[j]]
    for k in range(len(in_place_slot)):
        delta[in_place_slot[k]] -= int_bytes[in_place_out[k]]
        delta[in_place_slot[k] + 1] += int_bytes[in_place_out[k]]
    slot_bytes = np.empty(n_slots, np.int64)
    level_peak = np.full(n_levels, -np.inf if sorted_levels else 0.0)
    running = 0
    peak_slot, peak = 0, baseline_bytes[0] + delta[0]
    level, level_best = levels_of_slot[0], -np.inf
    for slot in range(n_slots):
        running += delta[slot]
        value = baseline_bytes[slot] + running
        slot_bytes[slot] = value
        if value > peak:
            peak_slot, peak = slot, value
        if sorted_levels:  # a level's slots are consecutive: its peak kept at hand until the next level
            if levels_of_slot[slot] != level:
                level_peak[level] = level_best
                level, level_best = levels_of_slot[slot], value
            elif value > level_best:
                level_best = value
        elif value > level_peak[levels_of_slot[slot]]:
            level_peak[levels_of_slot[slot]] = value
    if sorted_levels:
        level_peak[level] = level_best
    frees = RootFrees(new_free, copy_free_slot, copy_end)
    wait_slots, wait_moment = _wait_peaks(step, transfers, slot_bytes, roots, frees, in_alloc_slot, in_bytes,
                                          in_place_slot, in_place_out)
    for k in range(len(wait_slots)):  # the waits only raise a few slots
        slot = wait_slots[k]
        value = slot_bytes[slot]
        if value > peak or (value == peak and slot < peak_slot):
            peak_slot, peak = slot, value
        if value > level_peak[levels_of_slot[slot]]:
            level_peak[levels_of_slot[slot]] = value
    host_bytes, host_peak_s = host_peak(swap_bytes, plan.in_swap, transfers)
    return Memory(peak_slot, float(peak), level_peak, new_free, copy_end, in_alloc_slot, in_free_slot,
                  in_place_out, wait_slots, wait_moment, host_bytes, host_peak_s)


@array_routine
def _candidate(candidate_of, slots, slot):
    """``slot``'s number among the sorted ``slots`` through the map ``candidate_of`` (set only at
    those slots), or -1."""
    c = candidate_of[slot]
    return c if 0 <= c < len(slots) and slots[c] == slot else -1


@njit(cache=True, nogil=True)
def _wait_peaks(step, transfers, slot_bytes, roots, frees, in_alloc_slot, in_bytes, in_place_slot, in_place_out):
    """Memory during the waits in which a copy out ends after a swap-in was allocated (before the op
    at slot s starts, its wait holds what lives on from slot s-1, the swap-ins allocated so far and the
    swapped buffers whose copy out has not ended, not the op's own outputs; ``frees``: the swapped
    roots' ``RootFrees``). Raises ``slot_bytes`` in place where a wait's peak is larger; returns those
    slots and the moments of their peaks. A wait needs a copy out ending in it: only the slots right
    after such buffers' last (the candidates) and the swap-ins allocated there are visited."""
    alloc_bytes, tensor_bytes, duration = step.alloc_bytes, step.tensor_bytes, step.duration
    finish_all, in_ready = transfers.finish_all, transfers.in_ready
    root_free_slot, copy_free_slot, copy_end = frees.last_slot, frees.copy_slot, frees.copy_end
    n_slots, n_roots, n_ins = len(slot_bytes), len(roots), len(in_ready)
    empty = (np.zeros(0, np.int64), np.zeros(0))
    # roots whose copy out frees them after their last slot ended: in the next slot's wait
    root_slot = np.full(n_roots, -1, np.int64)
    n_waiting = 0
    for r in range(n_roots):
        if (copy_free_slot[r] >= root_free_slot[r] and root_free_slot[r] + 1 < n_slots
                and copy_end[r] > finish_all[min(root_free_slot[r], n_slots - 1)] + 1e-9):
            root_slot[r] = root_free_slot[r] + 1
            n_waiting += 1
    if n_waiting == 0 or n_ins == 0:
        return empty
    # the slots such a copy out ends in (sorted, distinct), the last end in each; each candidate
    # slot's number, valid where slots[number] == slot (unset entries are never trusted: no pass
    # over all slots)
    candidate_of = np.empty(n_slots, np.int64)
    found = np.empty(n_waiting, np.int64)
    n_candidates = 0
    for r in range(n_roots):
        if root_slot[r] >= 0:
            slot = root_slot[r]
            c = candidate_of[slot]
            if not (0 <= c < n_candidates and found[c] == slot):
                candidate_of[slot] = n_candidates
                found[n_candidates] = slot
                n_candidates += 1
    slots = found[:n_candidates]
    slots = slots[radix_argsort(slots, 0, n_slots)]
    for c in range(n_candidates):
        candidate_of[slots[c]] = c
    last_end = np.zeros(n_candidates)
    for r in range(n_roots):
        if root_slot[r] >= 0:
            c = candidate_of[root_slot[r]]
            last_end[c] = max(last_end[c], copy_end[r])
    # the swap-ins allocated at a candidate slot; those allocated before its op starts, the first
    # of them per candidate
    at = np.empty(n_ins, np.int64)
    at_wait = np.empty(n_ins, np.bool_)
    n_at = 0
    first_in = np.full(n_candidates, np.inf)
    for j in range(n_ins):
        slot = in_alloc_slot[j]
        c = candidate_of[slot]
        if c >= 0 and c < n_candidates and slots[c] == slot:
            at[n_at] = j
            at_wait[n_at] = in_ready[j] < finish_all[slot] - duration[slot] - 1e-9
            if at_wait[n_at]:
                first_in[c] = min(first_in[c], in_ready[j])
            n_at += 1
    is_wait = last_end > first_in + 1e-9
    n_waits = 0
    for c in range(n_candidates):
        n_waits += is_wait[c]
    if n_waits == 0:
        return empty
    # each wait starts with what lives on from the slot before, and the buffers copied out in it
    start_bytes = np.empty(n_candidates)
    for c in range(n_candidates):
        start_bytes[c] = slot_bytes[slots[c]] - alloc_bytes[slots[c]]
    for k in range(len(in_place_slot)):
        c = _candidate(candidate_of, slots, in_place_slot[k])
        if c >= 0:
            start_bytes[c] += tensor_bytes[in_place_out[k]]
    for a in range(n_at):
        start_bytes[candidate_of[in_alloc_slot[at[a]]]] -= in_bytes[at[a]]
    # then its events: copies out ending (frees first at the same instant, to a ns), swap-ins allocated;
    # each wait's copies out (in root order) and swap-ins allocated in it, grouped by candidate
    free_ptr = np.zeros(n_candidates + 1, np.int64)
    for r in range(n_roots):
        if root_slot[r] >= 0:
            c = candidate_of[root_slot[r]]
            start_bytes[c] += tensor_bytes[roots[r]]
            free_ptr[c + 1] += 1
    alloc_ptr = np.zeros(n_candidates + 1, np.int64)
    for a in range(n_at):
        if at_wait[a]:
            alloc_ptr[candidate_of[in_alloc_slot[at[a]]] + 1] += 1
    for c in range(n_candidates):
        free_ptr[c + 1] += free_ptr[c]
        alloc_ptr[c + 1] += alloc_ptr[c]
    frees = np.empty(free_ptr[n_candidates], np.int64)
    allocs = np.empty(alloc_ptr[n_candidates], np.int64)
    fill = free_ptr.copy()
    for r in range(n_roots):
        if root_slot[r] >= 0:
            c = candidate_of[root_slot[r]]
            frees[fill[c]] = r
            fill[c] += 1
    fill[:] = alloc_ptr
    for a in range(n_at):
        if at_wait[a]:
            c = candidate_of[in_alloc_slot[at[a]]]
            allocs[fill[c]] = at[a]
            fill[c] += 1
    wait_slots = np.empty(n_waits, np.int64)
    wait_moment = np.empty(n_waits)
    n_higher = 0
    for c in range(n_candidates):
        if not is_wait[c]:
            continue
        # its largest moment in event order (time, bytes, then copies out before swap-ins, each in
        # index order): the bytes only grow at an allocation, so it is the first event or right after
        # an allocation. The (few) allocations are sorted; each copy out is counted between them.
        lo, hi = alloc_ptr[c], alloc_ptr[c + 1]
        for k in range(lo + 1, hi):
            j = allocs[k]
            m = k
            while m > lo and precedes(in_ready[j], in_bytes[j], j, in_ready[allocs[m - 1]], in_bytes[allocs[m - 1]],
                                     allocs[m - 1]):
                allocs[m] = allocs[m - 1]
                m -= 1
            allocs[m] = j
        between = np.zeros(hi - lo + 1)  # bytes of the copies out ending after i allocations
        first_time, first_bytes = np.inf, 0.0
        for q in range(free_ptr[c], free_ptr[c + 1]):
            r = frees[q]
            time, size = copy_end[r] - 1e-9, -tensor_bytes[roots[r]]
            below, above = lo, hi
            while below < above:
                mid = (below + above) >> 1
                if in_ready[allocs[mid]] < time or (in_ready[allocs[mid]] == time and in_bytes[allocs[mid]] < size):
                    below = mid + 1
                else:
                    above = mid
            between[below - lo] += size
            if q == free_ptr[c] or time < first_time or (time == first_time and size < first_bytes):
                first_time, first_bytes = time, size
        running = start_bytes[c]
        best, best_time = -np.inf, 0.0
        first = allocs[lo]
        if not (in_ready[first] < first_time or (in_ready[first] == first_time and in_bytes[first] < first_bytes)):
            best, best_time = running + first_bytes, first_time  # a copy out ends first
        for i in range(hi - lo):
            running += between[i] + in_bytes[allocs[lo + i]]
            if running > best:
                best, best_time = running, in_ready[allocs[lo + i]]
        if best > slot_bytes[slots[c]]:
            slot_bytes[slots[c]] = best
            wait_slots[n_higher], wait_moment[n_higher] = slots[c], best_time
            n_higher += 1
    return wait_slots[:n_higher], wait_moment[:n_higher]


@njit(cache=True, nogil=True)
def host_peak(swap_bytes, in_swap, transfers):
    """Host memory over time, its peak and when: a copy lives from its swap-out to its last swap-in
    (frees before allocations at the same instant; events ordered by time, size, then index with
    the copies out before the frees). One engine per direction copies first in, first out: the
    copies out start in queue order, and the host copies are freed in the order of their last
    swap-ins' copies (``in_processed``, along which copies end in order); each side is checked to be
    in order (else sorted). The memory only grows at a copy out, so the peak is right after one
    (or at the first event)."""
    out_start, out_queue = transfers.out_start, transfers.out_queue
    in_end, in_processed = transfers.in_end, transfers.in_processed
    n_swaps = len(swap_bytes)
    if n_swaps == 0:
        return 0.0, 0.0
    outs_in_order = True  # (``outs`` set once: an array reassigned in a loop costs a reference count per turn)
    for k in range(1, n_swaps):
        a, b = out_queue[k - 1], out_queue[k]
        if not precedes(out_start[a], swap_bytes[a], a, out_start[b], swap_bytes[b], b):
            outs_in_order = False
            break
    outs = out_queue if outs_in_order else lexsort(out_start, swap_bytes, out_queue)
    # each swap's host copy is freed when its last swap-in is copied: walked from the latest
    host_free = np.zeros(n_swaps)
    frees = np.empty(n_swaps, np.int64)
    seen = np.zeros(n_swaps, np.bool_)
    m = n_swaps
    for k in range(len(in_processed) - 1, -1, -1):
        i = in_swap[in_processed[k]]
        if not seen[i]:
            seen[i] = True
            host_free[i] = max(0.0, in_end[in_processed[k]])
            m -= 1
            frees[m] = i
    in_order = m == 0  # (every swap has a swap-in)
    for k in range(1, n_swaps):
        a, b = frees[k - 1], frees[k]
        if in_order and not precedes(host_free[a], -swap_bytes[a], a, host_free[b], -swap_bytes[b], b):
            in_order = False
    if not in_order:
        host_free[:] = 0.0
        for j in range(len(in_swap)):
            host_free[in_swap[j]] = max(host_free[in_swap[j]], in_end[j])
        frees = lexsort(host_free, -swap_bytes, out_queue[::-1].copy())
    best, best_time = -np.inf, 0.0
    first = frees[0]
    if precedes(host_free[first], -swap_bytes[first], n_swaps + first, out_start[outs[0]], swap_bytes[outs[0]],
               outs[0]):
        best, best_time = -swap_bytes[first], host_free[first]  # a free comes first (copies of no time)
    running = 0.0
    b = 0
    for a in range(n_swaps):
        out = outs[a]
        while b < n_swaps and precedes(host_free[frees[b]], -swap_bytes[frees[b]], n_swaps + frees[b],
                                      out_start[out], swap_bytes[out], out):
            running += -swap_bytes[frees[b]]
            b += 1
        running += swap_bytes[out]
        if running > best:
            best, best_time = running, out_start[out]
    return max(0.0, best), best_time


@njit(cache=True, nogil=True)
def _pairwise_sum(values):
    """``np.sum(values)`` for float64, bit for bit: numpy's pairwise summation (blocks of at most 128
    values, ``_block_sum``; above, the two halves, split at a multiple of 8, summed and added),
    walked with a stack of its own (numba does not cache a recursive function called from another).
    tests/simulator/test_kernels.py holds it to numpy's."""
    n = len(values)
    if n <= 128:
        return _block_sum(values, 0, n)
    task_lo = np.empty(192, np.int64)
    task_n = np.empty(192, np.int64)
    task_done = np.empty(192, np.bool_)  # its halves summed: add them
    partial = np.empty(64)
    task_lo[0], task_n[0], task_done[0] = 0, n, False
    n_tasks, n_partial = 1, 0
    while n_tasks:
        n_tasks -= 1
        lo, count, done = task_lo[n_tasks], task_n[n_tasks], task_done[n_tasks]
        if count <= 128:
            partial[n_partial] = _block_sum(values, lo, count)
            n_partial += 1
        elif done:
            n_partial -= 1
            partial[n_partial - 1] = partial[n_partial - 1] + partial[n_partial]
        else:
            half = count // 2
            half -= half % 8
            for task in ((lo, count, True), (lo + half, count - half, False), (lo, half, False)):
                task_lo[n_tasks], task_n[n_tasks], task_done[n_tasks] = task
                n_tasks += 1
    return partial[0]


@njit(cache=True, nogil=True)
def _block_sum(values, lo, n):
    """numpy's sum of at most 128 values: below 8 in order from 0.0, else eight accumulators,
    combined in pairs, then the rest in order."""
    if n < 8:
        total = 0.0
        for i in range(lo, lo + n):
            total += values[i]
        return total
    r0, r1, r2, r3 = values[lo], values[lo + 1], values[lo + 2], values[lo + 3]
    r4, r5, r6, r7 = values[lo + 4], values[lo + 5], values[lo + 6], values[lo + 7]
    i = lo + 8
    stop = lo + n - n % 8
    while i < stop:
        r0 += values[i]
        r1 += values[i + 1]
        r2 += values[i + 2]
        r3 += values[i + 3]
        r4 += values[i + 4]
        r5 += values[i + 5]
        r6 += values[i + 6]
        r7 += values[i + 7]
        i += 8
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < lo + n:
        total += values[i]
        i += 1
    return total


@njit(cache=True, nogil=True)
def _numpy_searchsorted_right(values, keys, found):
    """``found[:] = np.searchsorted(values, keys, side="right")`` as numpy computes it (a binary
    search narrowed by the previous key), so the answer is numpy's even where ``values`` are not
    quite in order."""
    n = len(values)
    lo, hi = 0, n
    last = keys[0] if len(keys) else 0.0
    for q in range(len(keys)):
        key = keys[q]
        if last <= key:
            hi = n
        else:
            lo = 0
            hi = hi + 1 if hi < n else n
        last = key
        while lo < hi:
            mid = lo + ((hi - lo) >> 1)
            if values[mid] <= key:
                lo = mid + 1
            else:
                hi = mid
        found[q] = lo


@njit(cache=True, nogil=True)
def copy_overlap(transfers, duration):
    """``Replay.copy_overlap_s``: the compute of the slots (``transfers.finish_all`` less ``duration``
    to ``finish_all``) that runs inside the copies, summed over them (``_copy_overlap``).
    ``transfers.out_queue``, ``in_processed``: the copies in an order their starts ascend in (the
    engines' queues), where each search starts from the last find (any order gives the same sums,
    only slower)."""
    finish_all = transfers.finish_all
    n_slots = len(finish_all)
    # each slot's start and the compute done by it (np.cumsum of the spans finish - start), and
    # whether the starts ascend
    start, done = np.empty(n_slots), np.empty(n_slots + 1)
    done[0], computed, ascending = 0.0, 0.0, True
    for slot in range(n_slots):
        begin = finish_all[slot] - duration[slot]
        computed = computed + (finish_all[slot] - begin) if slot else finish_all[slot] - begin
        start[slot], done[slot + 1] = begin, computed
        ascending &= slot == 0 or begin >= start[slot - 1]
    return _copy_overlap(transfers, start, done, ascending)


@njit(cache=True, nogil=True)
def _copy_overlap(transfers, start, done, ascending):
    """Compute time of the one compute stream inside the copies (out and in), summed over them: for
    each copy, the compute done by its end less that done by its start, where the compute done by t
    is the time of the slots begun before t, up to t (slots run from ``start`` = finish - duration to
    finish; ``done``: the compute done by each slot's start, a running sum of the slots' spans). What
    ``DeviceModel.copy_contention`` scales (``Replay.copy_overlap_s``). The same float operations as
    numpy on the arrays (``np.cumsum``, ``np.clip``, ``np.sum``); a copy's slots are found from the
    previous copy's (the engines copy first in, first out; a copy starts where the one before ended,
    or later) when the starts are ``ascending``, else by numpy's own search."""
    finish_all, out_start, out_end = transfers.finish_all, transfers.out_start, transfers.out_end
    in_start, in_end = transfers.in_start, transfers.in_end
    out_queue, in_processed = transfers.out_queue, transfers.in_processed
    n_slots, n_outs, n_ins = len(finish_all), len(out_start), len(in_start)
    n = n_outs + n_ins
    if n == 0 or n_slots == 0:
        return 0.0
    # each copy's start and end as the slot running then (-1: before the first)
    begins = np.empty(n, np.int64)
    ends = np.empty(n, np.int64)
    if ascending:
        for early, late, queue, offset in ((out_start, out_end, out_queue, 0),
                                           (in_start, in_end, in_processed, n_outs)):
            k = 0
            for q in queue:
                k = search_right_near(start, early[q], k)
                begins[offset + q] = k
                k = search_right_near(start, late[q], k)
                ends[offset + q] = k
    else:
        keys = np.empty(n)
        keys[:n_outs], keys[n_outs:] = out_end, in_end
        _numpy_searchsorted_right(start, keys, ends)
        keys[:n_outs], keys[n_outs:] = out_start, in_start
        _numpy_searchsorted_right(start, keys, begins)
    inside = np.empty(n)
    for q in range(n):
        late = out_end[q] if q < n_outs else in_end[q - n_outs]
        early = out_start[q] if q < n_outs else in_start[q - n_outs]
        inside[q] = _done_by(late, ends[q] - 1, start, finish_all, done) - _done_by(early, begins[q] - 1, start,
                                                                                    finish_all, done)
    return _pairwise_sum(inside)


@array_routine
def _done_by(time, slot, start, finish_all, done):
    """The compute done by ``time`` in ``slot`` (-1: before the first): ``np.clip`` as numpy does it."""
    if slot < 0:
        return 0.0
    into = time - start[slot]
    into = into if into > 0.0 else 0.0
    span = finish_all[slot] - start[slot]
    return done[slot] + (into if into < span else span)
