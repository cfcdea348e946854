"""The per-plan loops of the replay and the planner, compiled with numba (issue 23): the event pass
over waits and stalls, the memory accounting around it, and buffer lifetimes once reads are rewired.

Each kernel does, operation for operation, what the numpy code it replaced did (the same float
additions in the same order, the same tie-breaking), so results are bit-identical to it: the golden
set (tests/test_simulator_golden.py) holds them to that. ``cache=True`` keeps the machine code under
``__pycache__``, so a new process loads it instead of compiling again. Small helpers called in loops
that take arrays and allocate nothing are compiled without numba's reference counting
(``_helper``): inlined or not, numba counted a reference to each array they take, in and out, with an
atomic instruction each (about 5,900 a ResNet-50 replay, a quarter of its time); ones that take only
numbers are inlined (``inline="always"``).
"""

from __future__ import annotations

import inspect

import numpy as np
from numba import njit

# Helpers called per swap, swap-in or wait that take arrays and allocate none: numba's reference
# counting off (its ``_nrt`` option). Inlined at numba's level (``inline="always"``) such a helper
# still took a reference to each array argument and dropped it after its loop, two atomic
# instructions per array and call that LLVM cannot prune across a loop: 647 heap pushes cost 14 us
# that way, 1.2 us without. Such a helper must not create or return an array.
_helper = njit(cache=True, nogil=True, _nrt=False)


@njit(cache=True, nogil=True, inline="always")
def _heap_less(time_a, index_a, time_b, index_b):
    return time_a < time_b or (time_a == time_b and index_a < index_b)


@_helper
def _heap_push(times, items, size, time, item):
    """Push (time, item) onto the binary min-heap in ``times``/``items[:size]``; returns the new size."""
    position = size
    times[position], items[position] = time, item
    while position > 0:
        parent = (position - 1) // 2
        if _heap_less(times[position], items[position], times[parent], items[parent]):
            times[position], times[parent] = times[parent], times[position]
            items[position], items[parent] = items[parent], items[position]
            position = parent
        else:
            break
    return size + 1


@_helper
def _heap_pop(times, items, size):
    """Remove the least (time, item) (ties by item, as heapq's tuples); returns it and the new size."""
    time, item = times[0], items[0]
    size -= 1
    times[0], items[0] = times[size], items[size]
    position = 0
    while True:
        left = 2 * position + 1
        if left >= size:
            break
        least = left
        right = left + 1
        if right < size and _heap_less(times[right], items[right], times[left], items[left]):
            least = right
        if _heap_less(times[least], items[least], times[position], items[position]):
            times[position], times[least] = times[least], times[position]
            items[position], items[least] = items[least], items[position]
            position = least
        else:
            break
    return time, item, size


@_helper
def _left_in(values, lo, hi, x):
    """``np.searchsorted(values[lo:hi], x, "left") + lo`` for a scalar, without a slice (numba's
    own searchsorted allocates per call; a slice costs a reference count in a hot loop)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if values[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@_helper
def _right_in(values, lo, hi, x):
    """``np.searchsorted(values[lo:hi], x, "right") + lo`` for a scalar."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if x < values[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


@_helper
def _left(values, x):
    """``np.searchsorted(values, x, "left")`` for a scalar."""
    return _left_in(values, 0, len(values), x)


@_helper
def _right(values, x):
    """``np.searchsorted(values, x, "right")`` for a scalar."""
    return _right_in(values, 0, len(values), x)


@_helper
def _left_near(values, x, hint):
    """``_left(values, x)`` searched from ``hint`` (a previous answer) upward, doubling the step, so a
    run of ascending look-ups costs about one pass; a look-up below the hint is a plain search."""
    n = len(values)
    where = min(hint, n)
    if where > 0 and values[where - 1] >= x:
        return _left_in(values, 0, where, x)
    step = 1
    while where + step < n and values[where + step] < x:
        where += step
        step *= 2
    return _left_in(values, where, min(where + step + 1, n), x)


@_helper
def _right_near(values, x, hint):
    """``_right(values, x)`` searched from ``hint`` upward (see ``_left_near``)."""
    n = len(values)
    where = min(hint, n)
    if where > 0 and values[where - 1] > x:
        return _right_in(values, 0, where, x)
    step = 1
    while where + step < n and values[where + step] <= x:
        where += step
        step *= 2
    return _right_in(values, where, min(where + step + 1, n), x)


@njit(cache=True, nogil=True, inline="always")
def _before(p, s, i, q, t, j):
    """(p, s, i) < (q, t, j): by primary key, then secondary, then index."""
    return p < q or (p == q and (s < t or (s == t and i < j)))


@njit(cache=True, nogil=True)
def _lexsort(primary, secondary, start):
    """Indices sorted by ``primary``, then ``secondary``, then index (``np.lexsort((secondary,
    primary))``; a total order, so any correct sort gives numpy's answer), starting from the
    permutation ``start`` (a guess: the closer to sorted, the faster). Keys are sorted together with
    their indices (no indirection): insertion sort of runs of 16, then bottom-up merges that skip
    runs already in order, so a nearly sorted start costs about one pass."""
    n = len(primary)
    p, s, order = primary[start], secondary[start], start.copy()
    for lo in range(0, n, 16):
        for k in range(lo + 1, min(lo + 16, n)):
            pk, sk, ok = p[k], s[k], order[k]
            m = k
            while m > lo and _before(pk, sk, ok, p[m - 1], s[m - 1], order[m - 1]):
                p[m], s[m], order[m] = p[m - 1], s[m - 1], order[m - 1]
                m -= 1
            p[m], s[m], order[m] = pk, sk, ok
    p2, s2, order2 = np.empty_like(p), np.empty_like(s), np.empty_like(order)
    width = 16
    while width < n:
        for lo in range(0, n - width, 2 * width):
            mid, hi = lo + width, min(lo + 2 * width, n)
            if not _before(p[mid], s[mid], order[mid], p[mid - 1], s[mid - 1], order[mid - 1]):
                continue  # already in order
            a, b, k = lo, mid, lo
            while a < mid and b < hi:
                if _before(p[b], s[b], order[b], p[a], s[a], order[a]):
                    p2[k], s2[k], order2[k] = p[b], s[b], order[b]
                    b += 1
                else:
                    p2[k], s2[k], order2[k] = p[a], s[a], order[a]
                    a += 1
                k += 1
            while a < mid:
                p2[k], s2[k], order2[k] = p[a], s[a], order[a]
                a += 1
                k += 1
            while b < hi:
                p2[k], s2[k], order2[k] = p[b], s[b], order[b]
                b += 1
                k += 1
            p[lo:hi], s[lo:hi], order[lo:hi] = p2[lo:hi], s2[lo:hi], order2[lo:hi]
        width *= 2
    return order


@njit(cache=True, nogil=True)
def _radix_argsort(keys, offset, n_values):
    """``np.argsort(keys, kind="stable")`` for integers with 0 <= key + offset < n_values: returns at
    once when the keys are in order already, else a least-significant-digit radix sort, 8 bits a
    pass. Its work grows with the number of keys, not with ``n_values`` (a counting sort over every
    slot touched the whole step for a few hundred swap-ins)."""
    n = len(keys)
    order = np.arange(n)
    in_order = True
    for i in range(1, n):
        if keys[i] < keys[i - 1]:
            in_order = False
            break
    if in_order:
        return order
    scratch = np.empty(n, np.int64)
    count = np.empty(257, np.int64)
    shift = 0
    while True:
        count[:] = 0
        for i in range(n):
            count[((keys[order[i]] + offset) >> shift & 255) + 1] += 1
        for digit in range(256):
            count[digit + 1] += count[digit]
        for i in range(n):
            digit = (keys[order[i]] + offset) >> shift & 255
            scratch[count[digit]] = order[i]
            count[digit] += 1
        order, scratch = scratch, order
        shift += 8
        if (n_values - 1) >> shift == 0:
            return order


@njit(cache=True, nogil=True)
def _slot_argsort(slots, n_slots):
    """``np.argsort(slots, kind="stable")`` for slots in -1 .. n_slots - 1."""
    return _radix_argsort(slots, 1, n_slots + 1)


@_helper
def _swap_out_end(i, out_end, cursor, d2h_free, late_queue, late_slot, late_duration, late_start, finish_plain,
                  seg_slot, seg_shift, seg_count, shift):
    """The end of copy out ``i``, scheduling the late copies out in queue order up to it
    (``cursor[0]``: the next late copy out, ``cursor[1]``: the segment of the last one's slot, which
    only moves on, as their slots do; ``d2h_free[0]``: when the d2h engine is free)."""
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
def schedule(finish_plain, plain_op_end, plain_op_start, order, duration, out_ready, out_duration, trigger, in_swap,
             in_duration, need, sync_wait, after_copies_out, copies_slot):
    """The event pass: walk the slots that wait for a transfer in order, shifting later ops by the stall.

    Queues are FIFO by ready time; a transfer's ready time depends only on slots before the one
    waiting for it, so one pass suffices. Finish times are plain finish + a piecewise-constant shift
    (``seg_slot``/``seg_shift``). Copies out that become ready before the first waiting slot are
    scheduled in bulk; swap-ins are released in trigger order at the first waiting slot after their
    trigger, after the stalls of the slots before. With ``after_copies_out`` swap-in j also waits for
    the copies out of what the op at ``copies_slot[j]`` made. Transfer ends not known yet are -1.0.
    Returns the copies' start and
    end times, each swap-in's ready time, every slot's finish time with the stalls, each op's end
    and start (``order``: the op of each slot, ``duration``: its time; ``plain_op_*``: without
    stalls, as they stay before the first), the copies out in queue order and the swap-ins in the
    order they are copied."""
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
    by_slot = _slot_argsort(wait_slot, n_slots)
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
    out_queue = _slot_argsort(out_ready, n_slots)
    ready_slots = out_ready[out_queue]
    early = _left(ready_slots, first_wait)
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
    late_queue = out_queue[early:]
    late_slot = ready_slots[early:]
    late_duration = durations[early:]
    late_start = np.empty(len(late_queue))
    cursor = np.zeros(2, np.int64)
    d2h_free = np.zeros(1)
    d2h_free[0] = end if early else 0.0

    # a swap-in after the copies out of the op it starts after: the swaps made at each slot (CSR)
    outs_order, outs_slots = out_queue, ready_slots

    # swap-ins in trigger order; all whose trigger runs before a waiting slot are released at that slot
    in_order = _slot_argsort(trigger, n_slots)
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
                data = _swap_out_end(source, out_end, cursor, d2h_free, late_queue, late_slot, late_duration,
                                     late_start, finish_plain, seg_slot, seg_shift, seg_count, shift)
            if after_copies_out:
                lo = _left(outs_slots, copies_slot[j])
                hi = _right(outs_slots, copies_slot[j])
                for m in range(lo, hi):
                    other = outs_order[m]
                    copied = out_end[other]
                    if copied < 0.0:
                        copied = _swap_out_end(other, out_end, cursor, d2h_free, late_queue, late_slot,
                                               late_duration, late_start, finish_plain, seg_slot, seg_shift,
                                               seg_count, shift)
                    if copied > data:
                        data = copied
            if data > ready:
                ready = data
            in_ready[j] = ready
            heap_size = _heap_push(heap_times, heap_items, heap_size, ready, j)
        required = 0.0
        while wait_slots[index] == slot:
            item = wait_items[index]
            index += 1
            if item < 0:
                done = _swap_out_end(-1 - item, out_end, cursor, d2h_free, late_queue, late_slot, late_duration,
                                     late_start, finish_plain, seg_slot, seg_shift, seg_count, shift)
            else:
                while in_end[item] < 0.0:
                    ready, j, heap_size = _heap_pop(heap_times, heap_items, heap_size)
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
    if len(late_queue):  # a swap-out nobody waited for still happens
        _swap_out_end(late_queue[-1], out_end, cursor, d2h_free, late_queue, late_slot, late_duration, late_start,
                      finish_plain, seg_slot, seg_shift, seg_count, shift)
    for k in range(len(late_queue)):
        out_start[late_queue[k]] = late_start[k]
    first = 0
    if seg_count == 1 or seg_slot[1] > n_slots // 2:  # nothing moves before the first stall (finish + 0.0
        first = 1                                    # is finish): copied when that is most of the step
        finish_all, op_end, op_start = finish_plain.copy(), plain_op_end.copy(), plain_op_start.copy()
    else:
        finish_all, op_end, op_start = np.empty(n_slots), np.empty(n_slots), np.empty(n_slots)
    for s in range(first, seg_count):
        stop = seg_slot[s + 1] if s + 1 < seg_count else n_slots
        for slot in range(seg_slot[s], stop):
            finish = finish_plain[slot] + seg_shift[s]
            finish_all[slot] = finish
            op_end[order[slot]] = finish
            op_start[order[slot]] = finish - duration[slot]
    return out_start, out_end, in_ready, in_start, in_end, finish_all, op_end, op_start, out_queue, in_processed


@njit(cache=True, nogil=True)
def account(baseline_bytes, alloc_bytes, tensor_bytes, int_bytes, duration, finish_all, position, levels_of_slot,
            n_levels, sorted_levels, out_start, out_end, out_queue, swap_root, swap_bytes, roots, root_base_free_slot,
            root_last_slot, moved_ids, moved_last, home_ids, in_swap, in_tensor, in_ready, in_start, in_end,
            in_processed, in_bytes, need_slot, trigger_slot, in_consumer_ptr, in_consumers, far_tensor, far_ids, n_keys,
            late_slot, late_out, late_root_ptr, late_by_root, late_read_ptr, late_by_read):
    """Device memory per slot once the transfers are timed, on top of the unswapped baseline:
    swapped buffers freed earlier, swap-in buffers, outputs written in place, the waits' peaks; and
    the host's peak. Returns the peak slot (the first largest) and the peak per level (``levels_of_slot``;
    ``sorted_levels``: slots sorted by level, as in the "cto" order, each level's peak taken from its
    slots alone; otherwise from 0 bytes up), with the per-buffer fields of a Replay. All byte figures
    are whole numbers (in float64, or ``int_bytes`` and the slots' running sums in int64: exact either
    way, so sums agree in any order); times are compared as the numpy code compared them. Only what a
    plan moved is visited, but for one pass over the slots that adds the changes to the baseline."""
    n_slots, n_swaps, n_ins, n_roots = len(duration), len(out_end), len(in_ready), len(roots)
    # a copy out frees its buffer in the slot running when it ends; one that ends while the slot's
    # op still waits (a stall) frees it before the op allocates anything: it does not count in that
    # slot (to a nanosecond: the op's start is finish - duration, which rounds differently from the
    # copy's end it waited for), only in the wait (_wait_peaks)
    out_free_slot = np.empty(n_swaps, np.int64)
    found = 0
    for i in out_queue:  # copies end in queue order: each search starts from the last find
        found = _left_near(finish_all, out_end[i], found)
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
        found = _right_near(finish_all, in_ready[j], max(trigger_slot[j] + 1, 0))
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
                    and not _holds(marked, n_first, k)):
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
    # in the same pass (its float sum runs beside the bytes'): each slot's start and the compute done
    # by it (np.cumsum of the spans finish - start, see _copy_overlap), and whether the starts ascend
    start, done = np.empty(n_slots), np.empty(n_slots + 1)
    done[0], computed, ascending = 0.0, 0.0, True
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
        begin = finish_all[slot] - duration[slot]
        computed = computed + (finish_all[slot] - begin) if slot else finish_all[slot] - begin
        start[slot], done[slot + 1] = begin, computed
        ascending &= slot == 0 or begin >= start[slot - 1]
    if sorted_levels:
        level_peak[level] = level_best
    wait_slots, wait_moment = _wait_peaks(slot_bytes, alloc_bytes, tensor_bytes, finish_all, duration, roots,
                                          new_free, copy_free_slot, copy_end, in_alloc_slot, in_ready, in_bytes,
                                          in_place_slot, in_place_out)
    for k in range(len(wait_slots)):  # the waits only raise a few slots
        slot = wait_slots[k]
        value = slot_bytes[slot]
        if value > peak or (value == peak and slot < peak_slot):
            peak_slot, peak = slot, value
        if value > level_peak[levels_of_slot[slot]]:
            level_peak[levels_of_slot[slot]] = value
    host_peak, host_peak_s = _host_peak(swap_bytes, out_start, out_queue, in_swap, in_end, in_processed)
    overlap_s = _copy_overlap(finish_all, start, done, ascending, out_start, out_end, in_start, in_end, out_queue,
                              in_processed)
    return (peak_slot, float(peak), level_peak, new_free, copy_end, in_alloc_slot, in_free_slot,
            in_place_out, wait_slots, wait_moment, host_peak, host_peak_s, overlap_s)


@_helper
def _holds(values, count, value):
    return _holds_in(values, 0, count, value)


@_helper
def _holds_in(values, lo, hi, value):
    """Whether ``value`` is among ``values[lo:hi]`` (a few: searched linearly)."""
    for k in range(lo, hi):
        if values[k] == value:
            return True
    return False


@_helper
def _candidate(candidate_of, slots, slot):
    """``slot``'s number among the sorted ``slots`` through the map ``candidate_of`` (set only at
    those slots), or -1."""
    c = candidate_of[slot]
    return c if 0 <= c < len(slots) and slots[c] == slot else -1


@njit(cache=True, nogil=True)
def _wait_peaks(slot_bytes, alloc_bytes, tensor_bytes, finish_all, duration, roots, root_free_slot,
                copy_free_slot, copy_end, in_alloc_slot, in_ready, in_bytes, in_place_slot, in_place_out):
    """Memory during the waits in which a copy out ends after a swap-in was allocated (before the op
    at slot s starts, its wait holds what lives on from slot s-1, the swap-ins allocated so far and the
    swapped buffers whose copy out has not ended, not the op's own outputs). Raises ``slot_bytes`` in
    place where a wait's peak is larger; returns those slots and the moments of their peaks. A wait
    needs a copy out ending in it: only the slots right after such buffers' last (the candidates)
    and the swap-ins allocated there are visited."""
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
    slots = slots[_radix_argsort(slots, 0, n_slots)]
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
            while m > lo and _before(in_ready[j], in_bytes[j], j, in_ready[allocs[m - 1]], in_bytes[allocs[m - 1]],
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
def _host_peak(swap_bytes, out_start, out_queue, in_swap, in_end, in_processed):
    """Host memory over time, its peak and when: a copy lives from its swap-out to its last swap-in
    (frees before allocations at the same instant; events ordered by time, size, then index with
    the copies out before the frees). One engine per direction copies first in, first out: the
    copies out start in queue order, and the host copies are freed in the order of their last
    swap-ins' copies (``in_processed``, along which copies end in order); each side is checked to be
    in order (else sorted). The memory only grows at a copy out, so the peak is right after one
    (or at the first event)."""
    n_swaps = len(swap_bytes)
    if n_swaps == 0:
        return 0.0, 0.0
    outs_in_order = True  # (``outs`` set once: an array reassigned in a loop costs a reference count per turn)
    for k in range(1, n_swaps):
        a, b = out_queue[k - 1], out_queue[k]
        if not _before(out_start[a], swap_bytes[a], a, out_start[b], swap_bytes[b], b):
            outs_in_order = False
            break
    outs = out_queue if outs_in_order else _lexsort(out_start, swap_bytes, out_queue)
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
        if in_order and not _before(host_free[a], -swap_bytes[a], a, host_free[b], -swap_bytes[b], b):
            in_order = False
    if not in_order:
        host_free[:] = 0.0
        for j in range(len(in_swap)):
            host_free[in_swap[j]] = max(host_free[in_swap[j]], in_end[j])
        frees = _lexsort(host_free, -swap_bytes, out_queue[::-1].copy())
    best, best_time = -np.inf, 0.0
    first = frees[0]
    if _before(host_free[first], -swap_bytes[first], n_swaps + first, out_start[outs[0]], swap_bytes[outs[0]],
               outs[0]):
        best, best_time = -swap_bytes[first], host_free[first]  # a free comes first (copies of no time)
    running = 0.0
    b = 0
    for a in range(n_swaps):
        out = outs[a]
        while b < n_swaps and _before(host_free[frees[b]], -swap_bytes[frees[b]], n_swaps + frees[b],
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
    tests/test_simulator_kernels.py holds it to numpy's."""
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
def _copy_overlap(finish_all, start, done, ascending, out_start, out_end, in_start, in_end, out_queue, in_processed):
    """Compute time of the one compute stream inside the copies (out and in), summed over them: for
    each copy, the compute done by its end less that done by its start, where the compute done by t
    is the time of the slots begun before t, up to t (slots run from ``start`` = finish - duration to
    finish; ``done``: the compute done by each slot's start, a running sum of the slots' spans). What
    ``DeviceModel.copy_contention`` scales (``Replay.copy_overlap_s``). The same float operations as
    numpy on the arrays (``np.cumsum``, ``np.clip``, ``np.sum``); a copy's slots are found from the
    previous copy's (the engines copy first in, first out; a copy starts where the one before ended,
    or later) when the starts are ``ascending``, else by numpy's own search."""
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
                k = _right_near(start, early[q], k)
                begins[offset + q] = k
                k = _right_near(start, late[q], k)
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


@_helper
def _done_by(time, slot, start, finish_all, done):
    """The compute done by ``time`` in ``slot`` (-1: before the first): ``np.clip`` as numpy does it."""
    if slot < 0:
        return 0.0
    into = time - start[slot]
    into = into if into > 0.0 else 0.0
    span = finish_all[slot] - start[slot]
    return done[slot] + (into if into < span else span)


@njit(cache=True, nogil=True)
def _rewired_reads(tensor_read_ptr, tensor_read_consumer, tensor_read_id, n_keys, read_tensor, read_consumer):
    """Which read ids (``buffers.RewireTables``) the reads (``read_tensor``, ``read_consumer``)
    rewire (the last entry: id -1, no read), each read's id and its place in the per-tensor reads
    (-1: not a read of the graph)."""
    rewired = np.zeros(n_keys + 1, np.bool_)
    read_ids = np.full(len(read_tensor), -1, np.int64)
    read_edge = np.full(len(read_tensor), -1, np.int64)
    for k in range(len(read_tensor)):
        for e in range(tensor_read_ptr[read_tensor[k]], tensor_read_ptr[read_tensor[k] + 1]):
            if tensor_read_consumer[e] == read_consumer[k]:
                read_ids[k] = tensor_read_id[e]
                read_edge[k] = e
                rewired[tensor_read_id[e]] = True
                break
    return rewired, read_ids, read_edge


@njit(cache=True, nogil=True)
def _lifetimes(seg_use_ptr, seg_use_slot, seg_use_id, seg_ptr, seg_link_id, seg_link_key, seg_parent, tensor_segment,
               rewired, roots, tensors, tensor_root):
    """Last slots once the reads ``rewired`` (by read id, ``buffers.RewireTables``) go to swap-ins.

    Returns, for each of ``roots`` (unique root buffers, sorted), the last slot that still reads the
    original buffer (its producer at least); the rewired links that carried a segment away (their
    keys ``tensor * n_ops + op`` and read ids) with the last slot of what now lives in the swap-in
    buffer; and for each of ``tensors`` (``tensor_root``: the index in ``roots`` of each one's root)
    the link that carried it into a swap-in's buffer, key and id, -1 where it stays in the original
    buffer. A segment lives in the buffer of its nearest ancestor (itself included) whose link was
    cut, or the root's. Segments are numbered locally, the roots' one after the other (a root's
    segment numbers are consecutive in the tables); a segment's last use is its latest not
    rewired, found from the latest down (the rewired reads are the late ones)."""
    n_roots = len(roots)
    base = np.empty(n_roots + 1, np.int64)  # each root's first local number
    base[0] = 0
    for r in range(n_roots):
        base[r + 1] = base[r] + seg_ptr[roots[r] + 1] - seg_ptr[roots[r]]
    n_segments = base[n_roots]
    cut = np.empty(n_segments, np.bool_)
    owner = np.empty(n_segments, np.int64)
    segment_last = np.empty(n_segments, np.int64)
    root_last = np.empty(n_roots, np.int64)
    cut_links = np.empty(n_segments, np.int64)
    cut_ids = np.empty(n_segments, np.int64)
    cut_last = np.empty(n_segments, np.int64)
    n_cut = 0
    for r in range(n_roots):  # a segment's owner is in its root's buffer: one root at a time
        first, stop = seg_ptr[roots[r]], seg_ptr[roots[r] + 1]
        shift = base[r] - first
        # a segment lives in the buffer of its nearest ancestor (itself included) whose link was cut,
        # or the root's: parents come first, so one pass settles each
        for m in range(first, stop):
            s = m + shift
            last = -1
            for u in range(seg_use_ptr[m], seg_use_ptr[m + 1]):
                if not rewired[seg_use_id[u]]:
                    last = seg_use_slot[u]
                    break
            segment_last[s] = last
            cut[s] = rewired[seg_link_id[m]]
            owner[s] = owner[seg_parent[m] + shift] if seg_parent[m] >= 0 and not cut[s] else s
        if stop - first == 1:  # one segment: its own owner, not cut
            root_last[r] = segment_last[first + shift]
            continue
        for m in range(first, stop):  # each owner's last: the latest of the segments it holds
            if owner[m + shift] != m + shift:
                segment_last[owner[m + shift]] = max(segment_last[owner[m + shift]], segment_last[m + shift])
        root_last[r] = segment_last[owner[tensor_segment[roots[r]] + shift]]
        for m in range(first, stop):
            if cut[m + shift]:
                cut_links[n_cut], cut_ids[n_cut] = seg_link_key[m], seg_link_id[m]
                cut_last[n_cut] = segment_last[m + shift]
                n_cut += 1
    home_link = np.full(len(tensors), -1, np.int64)
    home_ids = np.full(len(tensors), -1, np.int64)
    for i in range(len(tensors)):
        r = tensor_root[i]
        if base[r + 1] - base[r] == 1:  # one segment: never cut
            continue
        shift = base[r] - seg_ptr[roots[r]]
        home = owner[tensor_segment[tensors[i]] + shift]
        if cut[home]:
            home_link[i], home_ids[i] = seg_link_key[home - shift], seg_link_id[home - shift]
    return root_last, cut_links[:n_cut], cut_ids[:n_cut], cut_last[:n_cut], home_link, home_ids


@njit(cache=True, nogil=True)
def safe_wait_slots(position, tensor_producer, has_danger, endangered, danger_ptr, danger_ops, source_ptr,
                    source_ops, input_ptr, input_tensor, input_source, control_ptr, control_ops, tensor, trigger,
                    after, consumer_ptr, consumers):
    """``fusion.safe_wait_slots`` (which documents it) on the tables of ``fusion.FusionTables``: per
    swap-in, whether an op it waits for may be fused with one of its consumers, and if so the latest
    slot among the ops it waits for instead (-1: none). Only swap-ins with a reader in some fusion
    neighbourhood and (synchronous, or a trigger or ``after`` inside one) are looked at."""
    n = len(tensor)
    changed = np.zeros(n, np.bool_)
    slots = np.full(n, -1, np.int64)
    scratch = np.empty((4, 32), np.int64)
    for j in range(n):
        near = False
        for k in range(consumer_ptr[j], consumer_ptr[j + 1]):
            near |= has_danger[consumers[k]]
        if not near or (trigger[j] >= 0 and not (endangered[trigger[j]] or endangered[max(after[j], 0)])):
            continue
        changed[j], slots[j] = _safe_wait(position, tensor_producer, danger_ptr, danger_ops, source_ptr, source_ops,
                                          input_ptr, input_tensor, input_source, control_ptr, control_ops, tensor[j],
                                          trigger[j], after[j], consumers, consumer_ptr[j], consumer_ptr[j + 1],
                                          scratch)
    return changed, slots


@njit(cache=True, nogil=True, inline="always")
def _safe_wait(position, tensor_producer, danger_ptr, danger_ops, source_ptr, source_ops, input_ptr, input_tensor,
               input_source, control_ptr, control_ops, tensor, trigger, after, consumers, lo, hi, scratch):
    """One swap-in of ``safe_wait_slots`` (readers ``consumers[lo:hi]``): whether a wait is in danger,
    and the latest slot it waits for instead. The sets involved are a few ops, kept in the rows of
    ``scratch`` (copied to larger arrays, ``_grown``, when full) and searched linearly."""
    # what it waits for, as the rewriter builds it: its trigger, or (synchronous) its first
    # consumer's other inputs and control predecessors; and ``after`` unless that made the tensor
    first = consumers[lo]
    waits = scratch[0]
    capacity = input_ptr[first + 1] - input_ptr[first] + control_ptr[first + 1] - control_ptr[first] + 2
    if capacity > len(waits):
        waits = np.empty(capacity, np.int64)
    n_waits = 0
    if trigger >= 0:
        waits[0] = trigger
        n_waits = 1
    else:
        for e in range(input_ptr[first], input_ptr[first + 1]):
            if input_tensor[e] != tensor:
                waits[n_waits] = input_source[e]
                n_waits += 1
        for e in range(control_ptr[first], control_ptr[first + 1]):
            waits[n_waits] = control_ops[e]
            n_waits += 1
    if after >= 0 and after != tensor_producer[tensor]:
        waits[n_waits] = after
        n_waits += 1
    danger = scratch[1]
    n_danger = 0
    for k in range(lo, hi):
        for d in range(danger_ptr[consumers[k]], danger_ptr[consumers[k] + 1]):
            if not _holds(danger, n_danger, danger_ops[d]):
                if n_danger == len(danger):
                    danger = _grown(danger)
                danger[n_danger] = danger_ops[d]
                n_danger += 1
    hit = False
    for w in range(n_waits):
        hit |= _holds(danger, n_danger, waits[w])
    if not hit:
        return False, -1
    # each wait in danger replaced by its own sources, repeatedly: the latest of what is left
    pending = scratch[2] if n_waits <= scratch.shape[1] else np.empty(n_waits, np.int64)
    seen = scratch[3]
    for w in range(n_waits):
        pending[w] = waits[w]
    n_pending, n_seen, latest = n_waits, 0, -1
    while n_pending:
        n_pending -= 1
        op = pending[n_pending]
        if _holds(seen, n_seen, op):
            continue
        if n_seen == len(seen):
            seen = _grown(seen)
        seen[n_seen] = op
        n_seen += 1
        if _holds(danger, n_danger, op):
            for e in range(source_ptr[op], source_ptr[op + 1]):
                if n_pending == len(pending):
                    pending = _grown(pending)
                pending[n_pending] = source_ops[e]
                n_pending += 1
        elif position[op] > latest:
            latest = position[op]
    return True, latest


@njit(cache=True, nogil=True)
def _replay_safe_waits(position, tensor_producer, has_danger, endangered, danger_ptr, danger_ops, source_ptr,
                       source_ops, input_ptr, input_tensor, input_source, control_ptr, control_ops, read_safe_hit,
                       read_safe_slot, tensor, trigger, after, consumer_ptr, consumers, read_edge):
    """``safe_wait_slots`` for the replay, with the graph's answers per read (``read_safe_*``: a
    synchronous swap-in of that read alone, waiting for nothing else) and the plan's reads' places
    among them (``read_edge``). A wait's result is the union of what each of its ops leads to, so a
    swap-in whose first reader's fusion neighbourhood holds its other readers' needs a walk only
    when its trigger or ``after`` is itself in danger."""
    n = len(tensor)
    changed = np.zeros(n, np.bool_)
    slots = np.full(n, -1, np.int64)
    scratch = np.empty((4, 32), np.int64)
    for j in range(n):
        lo, hi = consumer_ptr[j], consumer_ptr[j + 1]
        near = False
        for k in range(lo, hi):
            near |= has_danger[consumers[k]]
        if not near or (trigger[j] >= 0 and not (endangered[trigger[j]] or endangered[max(after[j], 0)])):
            continue
        reader = consumers[lo]
        alone = True  # every other reader's neighbourhood inside the first's: the first's alone counts
        for k in range(lo + 1, hi):
            for d in range(danger_ptr[consumers[k]], danger_ptr[consumers[k] + 1]):
                alone &= _holds_in(danger_ops, danger_ptr[reader], danger_ptr[reader + 1], danger_ops[d])
        if alone:
            wait_after = after[j] >= 0 and after[j] != tensor_producer[tensor[j]]
            after_safe = not (wait_after and _holds_in(danger_ops, danger_ptr[reader], danger_ptr[reader + 1],
                                                       after[j]))
            if trigger[j] >= 0 and after_safe and not _holds_in(danger_ops, danger_ptr[reader],
                                                                danger_ptr[reader + 1], trigger[j]):
                continue  # neither of its waits is in danger
            if trigger[j] < 0 and after_safe:
                if read_safe_hit[read_edge[lo]]:
                    changed[j] = True
                    slots[j] = max(read_safe_slot[read_edge[lo]], position[after[j]] if wait_after else -1)
                continue
        changed[j], slots[j] = _safe_wait(position, tensor_producer, danger_ptr, danger_ops, source_ptr, source_ops,
                                          input_ptr, input_tensor, input_source, control_ptr, control_ops, tensor[j],
                                          trigger[j], after[j], consumers, lo, hi, scratch)
    return changed, slots


@njit(cache=True, nogil=True)
def _grown(values):
    """``values`` in an array twice as long."""
    grown = np.empty(2 * len(values), values.dtype)
    grown[:len(values)] = values
    return grown


@njit(cache=True, nogil=True)
def prepare(position, tensor_producer, root, swap_tensor, in_swap, in_trigger, in_after, in_consumer_ptr,
            in_consumers, max1, max1_tensor, max2, fused_wait, safe_slot):
    """A plan in slot terms (see ``replay.replay``): when each copy out may start, which slot each
    swap-in's first consumer runs at, the slot whose end releases each swap-in (its trigger's; a
    synchronous one's after the consumer's other inputs, ``replay._other_input_slots``; a fused
    wait's safe slot) and whose copies out it waits for with ``after_copies_out``; the swapped
    buffers (sorted) and each swap's among them."""
    n_swaps, n_ins = len(swap_tensor), len(in_swap)
    out_ready = np.empty(n_swaps, np.int64)
    for i in range(n_swaps):
        out_ready[i] = position[tensor_producer[swap_tensor[i]]]
    need = np.empty(n_ins, np.int64)
    trigger_slot = np.empty(n_ins, np.int64)
    copies_slot = np.empty(n_ins, np.int64)
    for j in range(n_ins):
        first = in_consumers[in_consumer_ptr[j]]
        tensor = swap_tensor[in_swap[j]]
        need[j] = position[first]
        planned = position[max(in_trigger[j], 0)]
        if in_trigger[j] < 0:  # synchronous: after the first consumer's other inputs
            other = max2[first] if max1_tensor[first] == tensor else max1[first]
            slot = max(other, position[in_after[j]])
        else:
            slot = planned
        if fused_wait[j]:
            slot = safe_slot[j]
        trigger_slot[j] = slot
        copies_slot[j] = slot if in_trigger[j] < 0 else planned
    roots, swap_root = _distinct(root[swap_tensor], len(root))
    return out_ready, need, trigger_slot, copies_slot, roots, swap_root


@njit(cache=True, nogil=True)
def _distinct(values, n_values):
    """The distinct ``values`` (integers in 0 .. n_values - 1), sorted, and each value's place among
    them (``np.unique(values, return_inverse=True)``)."""
    order = _radix_argsort(values, 0, n_values)
    distinct = np.empty(len(values), np.int64)
    place = np.empty(len(values), np.int64)
    n_distinct = 0
    for k in range(len(values)):
        value = values[order[k]]
        if n_distinct == 0 or distinct[n_distinct - 1] != value:
            distinct[n_distinct] = value
            n_distinct += 1
        place[order[k]] = n_distinct - 1
    return distinct[:n_distinct].copy(), place


@njit(cache=True, nogil=True)
def _first_remaining_readers(position, tensor_producer, tensor_read_ptr, tensor_read_consumer, tensor_read_id,
                             rewired, swap_tensor, sync_out):
    """Per swapped tensor with a synchronous copy out: the first slot that still reads it on the
    device (its reads not rewired to a swap-in; they wait for the copy), or when none does, the slot
    after its producer's (so the copy frees the buffer before the step goes on); -1 elsewhere or
    where the producer runs last."""
    n_ops = len(position)
    sync_wait = np.full(len(swap_tensor), -1, np.int64)
    for i in range(len(swap_tensor)):
        if not sync_out[i]:
            continue
        tensor = swap_tensor[i]
        earliest = n_ops
        for e in range(tensor_read_ptr[tensor], tensor_read_ptr[tensor + 1]):
            if not rewired[tensor_read_id[e]]:
                earliest = min(earliest, position[tensor_read_consumer[e]])
        first = earliest if earliest < n_ops else position[tensor_producer[tensor]] + 1
        if first < n_ops:
            sync_wait[i] = first
    return sync_wait

@njit(cache=True, nogil=True)
def replay_plan(order, position, duration, finish_plain, plain_op_end, plain_op_start, baseline_bytes, alloc_bytes,
                levels_of_slot, n_levels, sorted_levels, persistent, tensor_bytes, int_bytes, d2h_seconds, h2d_seconds,
                tensor_producer, root, free_slot, max1, max1_tensor, max2, tensor_read_ptr, tensor_read_consumer,
                tensor_read_id, seg_use_ptr, seg_use_slot, seg_use_id, seg_ptr, seg_link_id, seg_link_key, seg_parent,
                tensor_segment, n_keys, late_slot, late_out, late_root_ptr, late_by_root, late_read_ptr, late_by_read,
                has_danger, endangered, danger_ptr, danger_ops, source_ptr, source_ops, input_ptr, input_tensor,
                input_source, control_ptr, control_ops, read_safe_hit, read_safe_slot, swap_tensor, sync_out, in_swap,
                in_trigger, in_after, in_consumer_ptr, in_consumers, after_copies_out):
    """One replay of a plan, from the plan's arrays to the Replay's (``replay.replay`` names what it
    passes): the fusion-safe waits, the plan in slot terms, the rewired buffers' lifetimes, the event
    pass and the memory accounting, in one call. Per-slot work is two passes (finish times and the
    slots' bytes); the rest visits what the plan moved."""
    n_ops = len(position)
    in_tensor = swap_tensor[in_swap]
    far_tensor = np.empty(len(in_consumers), np.int64)  # the tensor of each far read
    for j in range(len(in_swap)):
        for k in range(in_consumer_ptr[j], in_consumer_ptr[j + 1]):
            far_tensor[k] = in_tensor[j]
    # far reads rewired (their ids and places among the graph's reads)
    rewired, far_ids, far_edge = _rewired_reads(tensor_read_ptr, tensor_read_consumer, tensor_read_id, n_keys,
                                                far_tensor, in_consumers)
    fused_wait, safe_slot = _replay_safe_waits(
        position, tensor_producer, has_danger, endangered, danger_ptr, danger_ops, source_ptr, source_ops, input_ptr,
        input_tensor, input_source, control_ptr, control_ops, read_safe_hit, read_safe_slot, in_tensor, in_trigger,
        in_after, in_consumer_ptr, in_consumers, far_edge)
    out_ready_slot, need_slot, trigger_slot, copies_slot, roots, swap_root = prepare(
        position, tensor_producer, root, swap_tensor, in_swap, in_trigger, in_after, in_consumer_ptr,
        in_consumers, max1, max1_tensor, max2, fused_wait, safe_slot)
    # the swapped buffers' lifetimes; the original buffer's remaining readers
    root_last_slot, _, moved_ids, moved_last, _, home_ids = _lifetimes(
        seg_use_ptr, seg_use_slot, seg_use_id, seg_ptr, seg_link_id, seg_link_key, seg_parent, tensor_segment,
        rewired, roots, swap_tensor, swap_root)
    sync_wait = _first_remaining_readers(position, tensor_producer, tensor_read_ptr, tensor_read_consumer,
                                         tensor_read_id, rewired, swap_tensor, sync_out)
    swap_bytes = tensor_bytes[swap_tensor]
    in_bytes = tensor_bytes[in_tensor]
    out_duration = d2h_seconds[swap_tensor]
    in_duration = h2d_seconds[in_tensor]
    out_start, out_end, in_ready, in_start, in_end, finish_all, op_end, op_start, out_queue, in_processed = schedule(
        finish_plain, plain_op_end, plain_op_start, order, duration, out_ready_slot, out_duration, trigger_slot,
        in_swap, in_duration, need_slot, sync_wait, after_copies_out, copies_slot)
    root_base_free_slot = free_slot[roots]
    (peak_slot, peak, level_peak, new_free, copy_end, in_alloc_slot, in_free_slot, in_place_out, wait_slots,
     wait_moment, host_peak, host_peak_s, overlap_s) = account(
        baseline_bytes, alloc_bytes, tensor_bytes, int_bytes, duration, finish_all, position, levels_of_slot, n_levels,
        sorted_levels, out_start, out_end, out_queue, swap_root, swap_bytes, roots, root_base_free_slot, root_last_slot,
        moved_ids, moved_last, home_ids, in_swap, in_tensor, in_ready, in_start, in_end, in_processed, in_bytes,
        need_slot, trigger_slot, in_consumer_ptr, in_consumers, far_tensor, far_ids, n_keys, late_slot, late_out,
        late_root_ptr, late_by_root, late_read_ptr, late_by_read)
    level_peak += persistent
    d2h_bytes, h2d_bytes = 0.0, 0.0  # whole numbers: exact in any order
    for i in range(len(swap_bytes)):
        d2h_bytes += swap_bytes[i]
    for j in range(len(in_bytes)):
        h2d_bytes += in_bytes[j]
    return (peak_slot, peak, level_peak, op_end, op_start, finish_all[-1], out_start, out_end, in_start, in_end,
            in_ready, roots, new_free, in_alloc_slot, in_free_slot, in_place_out, copy_end, wait_slots, wait_moment,
            host_peak, host_peak_s, d2h_bytes, h2d_bytes, overlap_s)


@njit(cache=True, nogil=True)
def _sorted_level_peaks(slot_bytes, level_starts):
    """The largest figure per level, slots sorted by level (``np.maximum.reduceat``)."""
    level_peak = np.empty(len(level_starts))
    for k in range(len(level_starts)):
        stop = level_starts[k + 1] if k + 1 < len(level_starts) else len(slot_bytes)
        best = slot_bytes[level_starts[k]]
        for slot in range(level_starts[k] + 1, stop):
            if slot_bytes[slot] > best:
                best = slot_bytes[slot]
        level_peak[k] = best
    return level_peak


@njit(cache=True, nogil=True)
def _level_peaks(slot_bytes, levels_of_slot):
    """The largest figure per level, from 0 (``np.maximum.at`` into zeros)."""
    level_peak = np.zeros(levels_of_slot.max() + 1)
    for slot in range(len(slot_bytes)):
        level = levels_of_slot[slot]
        if slot_bytes[slot] > level_peak[level]:
            level_peak[level] = slot_bytes[slot]
    return level_peak


@njit(cache=True, nogil=True)
def summarize(slot_bytes, levels_of_slot, level_starts, persistent, finish_all, position, op_duration):
    """The dense fields of a Replay: the peak slot (the first largest), the peak per level plus the
    resident bytes (``level_starts``: each level's first slot where slots are sorted by level, as in
    the "cto" order; empty otherwise: levels taken from ``levels_of_slot``, from 0 bytes), and each
    op's end and start."""
    peak_slot = np.argmax(slot_bytes)
    # (each branch in a function of its own: a loop writing an array that two branches define ran
    # 15x slower, numba reloading it on every access)
    if len(level_starts):
        level_peak = _sorted_level_peaks(slot_bytes, level_starts)
    else:
        level_peak = _level_peaks(slot_bytes, levels_of_slot)
    level_peak += persistent
    op_end = finish_all[position]
    return peak_slot, level_peak, op_end, op_end - op_duration


@njit(cache=True, nogil=True)
def after_ops(group_tensor, ptr, consumers, position, order, root, tensor_read_ptr, tensor_read_consumer,
              tensor_read_id, seg_use_ptr, seg_use_slot, seg_use_id, seg_ptr, seg_link_id, seg_link_key, seg_parent,
              tensor_segment, n_keys):
    """``planning._after_ops`` (which documents it) on ``buffers.RewireTables``: per swap-in group (a
    tensor's groups consecutive, ``consumers[ptr[k]:ptr[k + 1]]``), the op it must follow."""
    n_groups = len(group_tensor)
    if n_groups == 0:
        return np.zeros(0, np.int64)
    n_tensors = len(root)
    # the swapped tensors (sorted, distinct) and each one's first group; their buffers (sorted, distinct)
    by_tensor = _radix_argsort(group_tensor, 0, n_tensors)
    swapped = np.empty(n_groups, np.int64)
    first_group = np.empty(n_groups, np.int64)
    n_swapped = 0
    for k in range(n_groups):
        tensor = group_tensor[by_tensor[k]]
        if n_swapped == 0 or swapped[n_swapped - 1] != tensor:
            swapped[n_swapped] = tensor
            first_group[n_swapped] = by_tensor[k]
            n_swapped += 1
    swapped = swapped[:n_swapped]
    roots, root_of_swapped = _distinct(root[swapped], n_tensors)
    read_tensor = np.empty(len(consumers), np.int64)
    for k in range(n_groups):
        for m in range(ptr[k], ptr[k + 1]):
            read_tensor[m] = group_tensor[k]
    rewired, _, _ = _rewired_reads(tensor_read_ptr, tensor_read_consumer, tensor_read_id, n_keys, read_tensor,
                                   consumers)
    root_last, _, cut_ids, cut_last, _, home_ids = _lifetimes(
        seg_use_ptr, seg_use_slot, seg_use_id, seg_ptr, seg_link_id, seg_link_key, seg_parent, tensor_segment, rewired,
        roots, swapped, root_of_swapped)
    # a tensor a rewired read carried into a swap-in's buffer (written there in place) is on the device
    # until that buffer's last reader, not the original's (which may be done before it exists)
    n_cut = len(cut_ids)
    cut_of_id = np.empty(n_keys + 1, np.int64)  # valid where cut_ids[cut_of_id[id]] == id: the first cut
    for k in range(n_cut - 1, -1, -1):
        cut_of_id[cut_ids[k]] = k
    after_slot = np.empty(n_groups, np.int64)
    for k in range(1, n_groups):  # each later group follows the last consumer of the group before it
        last = position[consumers[ptr[k - 1]]]
        for m in range(ptr[k - 1] + 1, ptr[k]):
            last = max(last, position[consumers[m]])
        after_slot[k] = last
    for i in range(n_swapped):  # the first follows the last op still reading its buffer
        near = root_last[root_of_swapped[i]]
        if home_ids[i] >= 0:
            near = cut_last[cut_of_id[home_ids[i]]]
        after_slot[first_group[i]] = near
    after = np.empty(n_groups, np.int64)
    for k in range(n_groups):
        after[k] = order[after_slot[k]]
    return after


@njit(cache=True, nogil=True)
def plan_reads(edge_order, edge_tensor, edge_consumer, excluded, candidate, threshold, groupby, lb, ub, triggers,
               producer, levels, position, order, root, tensor_read_ptr, tensor_read_consumer, tensor_read_id,
               seg_use_ptr, seg_use_slot, seg_use_id, seg_ptr, seg_link_id, seg_link_key, seg_parent, tensor_segment,
               n_keys, latest_level, latest_op, ancestor_ptr, ancestor_ops, ancestor_levels, ancestor_key, span):
    """The core of ``planning.plan_swaps`` (which documents the rules): the far reads, grouped per swap-in,
    groups still read on the device at their first consumer dropped, each group's ``after`` op and
    trigger. ``edge_order``: the edges by tensor, then their consumer's slot (the reads of a tensor in
    execution order, so no sort per plan); ``excluded``: reads never far (update-phase readers,
    ``kept_reads``); ``candidate``: per tensor, whether the rules may swap it; ``triggers``: 0 none
    (synchronous swap-ins), 1 by level (``latest_*``: per level the latest level at or below it
    holding a trigger candidate, and that op), 2 among the first consumer's ancestors (the table of
    ``planning._ancestor_triggers``). Returns the swapped tensors, each group's swap, trigger and
    ``after`` op, and the groups' reads (CSR)."""
    n_edges = len(edge_order)
    far_tensor = np.empty(n_edges, np.int64)
    far_consumer = np.empty(n_edges, np.int64)
    n_far = 0
    for e in edge_order:  # one read per (tensor, consumer): its edges are next to each other here
        tensor, consumer = edge_tensor[e], edge_consumer[e]
        if (candidate[tensor] and not excluded[e] and levels[consumer] - levels[producer[tensor]] > threshold
                and not (n_far and far_tensor[n_far - 1] == tensor and far_consumer[n_far - 1] == consumer)):
            far_tensor[n_far], far_consumer[n_far] = tensor, consumer
            n_far += 1
    far_tensor, far_consumer = far_tensor[:n_far], far_consumer[:n_far]
    while True:
        # a new group at each new tensor and (groupby 0) each new level, or once a read lies more than
        # groupby levels past its group's first
        ptr = np.empty(n_far + 1, np.int64)
        n_groups, start_level = 0, 0
        for k in range(n_far):
            level = levels[far_consumer[k]]
            if (k == 0 or far_tensor[k] != far_tensor[k - 1]
                    or (level != levels[far_consumer[k - 1]] if groupby == 0 else level - start_level > groupby)):
                ptr[n_groups] = k
                n_groups += 1
                start_level = level
        ptr[n_groups] = n_far
        ptr = ptr[:n_groups + 1]
        group_tensor = np.empty(n_groups, np.int64)
        for k in range(n_groups):
            group_tensor[k] = far_tensor[ptr[k]]
        after = after_ops(group_tensor, ptr, far_consumer, position, order, root, tensor_read_ptr,
                          tensor_read_consumer, tensor_read_id, seg_use_ptr, seg_use_slot, seg_use_id, seg_ptr,
                          seg_link_id, seg_link_key, seg_parent, tensor_segment, n_keys)
        # a group whose tensor is still read on the device at or after its first consumer (through an
        # alias) would gain nothing from a swap-in: drop it and re-derive the rest
        n_kept = 0
        for k in range(n_groups):
            if position[after[k]] < position[far_consumer[ptr[k]]]:
                for m in range(ptr[k], ptr[k + 1]):
                    far_tensor[n_kept], far_consumer[n_kept] = far_tensor[m], far_consumer[m]
                    n_kept += 1
        if n_kept == n_far:
            break
        n_far = n_kept
        far_tensor, far_consumer = far_tensor[:n_far].copy(), far_consumer[:n_far].copy()
    trigger = np.full(n_groups, -1, np.int64)
    for k in range(n_groups if triggers else 0):
        first = far_consumer[ptr[k]]
        hi = levels[first] - lb
        lo = max(levels[first] - ub, levels[producer[group_tensor[k]]] + 1)
        if hi < 0:
            continue
        if triggers == 1:
            if latest_level[hi] >= lo:
                trigger[k] = latest_op[hi]
        else:  # the last ancestor trigger whose level <= hi
            pick = _right_in(ancestor_key, 0, len(ancestor_key), first * span + hi) - 1
            if ancestor_ptr[first] <= pick < ancestor_ptr[first + 1] and ancestor_levels[pick] >= lo:
                trigger[k] = ancestor_ops[pick]
        # the trigger must run after the previous copy is released and before the consumer
        if trigger[k] >= 0 and (position[trigger[k]] <= position[after[k]]
                                or position[trigger[k]] >= position[first]):
            trigger[k] = -1
    swapped = np.empty(n_groups, np.int64)
    in_swap = np.empty(n_groups, np.int64)
    n_swapped = 0
    for k in range(n_groups):  # groups of a tensor are consecutive, tensors ascending
        if n_swapped == 0 or swapped[n_swapped - 1] != group_tensor[k]:
            swapped[n_swapped] = group_tensor[k]
            n_swapped += 1
        in_swap[k] = n_swapped - 1
    return swapped[:n_swapped].copy(), in_swap, trigger, after, ptr, far_consumer.copy()


# what replay_plan reads of a graph at one batch size on one device: its arguments before the plan's
_REPLAY_ARGUMENTS = tuple(inspect.signature(replay_plan.py_func).parameters)
REPLAY_TABLE_FIELDS = _REPLAY_ARGUMENTS[:_REPLAY_ARGUMENTS.index("swap_tensor")]


def replay_tables(**fields) -> tuple:
    """``replay_plan``'s graph arguments (``REPLAY_TABLE_FIELDS``) from their names, in its order."""
    if fields.keys() != set(REPLAY_TABLE_FIELDS):
        apart = sorted(fields.keys() ^ set(REPLAY_TABLE_FIELDS))
        raise TypeError(f"replay_plan's tables are exactly its fields, got {apart} apart")
    return tuple(fields[name] for name in REPLAY_TABLE_FIELDS)
