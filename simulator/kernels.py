"""The per-plan loops of the replay and the planner, compiled with numba (issue 23): the event pass
over waits and stalls, the memory accounting around it, and buffer lifetimes once reads are rewired.

Each kernel does, operation for operation, what the numpy code it replaced did (the same float
additions in the same order, the same tie-breaking), so results are bit-identical to it: the golden
set (tests/test_simulator_golden.py) holds them to that. ``cache=True`` keeps the machine code under
``__pycache__``, so a new process loads it instead of compiling again.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _heap_less(time_a, index_a, time_b, index_b):
    return time_a < time_b or (time_a == time_b and index_a < index_b)


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
def _left(values, x):
    """``_left(values, x)`` for a scalar (numba's own allocates per call)."""
    lo, hi = 0, len(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True)
def _left_near(values, x, hint):
    """``_left(values, x)`` searched from ``hint`` (a previous answer) upward, doubling the step, so a
    run of ascending look-ups costs about one pass; a look-up below the hint is a plain search."""
    n = len(values)
    where = min(hint, n)
    if where > 0 and values[where - 1] >= x:
        return _left(values[:where], x)
    step = 1
    while where + step < n and values[where + step] < x:
        where += step
        step *= 2
    return where + _left(values[where:min(where + step + 1, n)], x)


@njit(cache=True, nogil=True)
def _right_near(values, x, hint):
    """``_right(values, x)`` searched from ``hint`` upward (see ``_left_near``)."""
    n = len(values)
    where = min(hint, n)
    if where > 0 and values[where - 1] > x:
        return _right(values[:where], x)
    step = 1
    while where + step < n and values[where + step] <= x:
        where += step
        step *= 2
    return where + _right(values[where:min(where + step + 1, n)], x)


@njit(cache=True, nogil=True)
def _right(values, x):
    """``_right(values, x)`` for a scalar."""
    return _bisect_right(values, len(values), x)


@njit(cache=True, nogil=True)
def _bisect_right(values, count, x):
    """``bisect.bisect_right(values[:count], x)``."""
    lo, hi = 0, count
    while lo < hi:
        mid = (lo + hi) // 2
        if x < values[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


@njit(cache=True, nogil=True)
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
def stable_argsort(keys):
    """``np.argsort(keys, kind="stable")``."""
    return _lexsort(keys, keys, np.arange(len(keys)))


@njit(cache=True, nogil=True)
def _slot_argsort(slots, n_slots):
    """``np.argsort(slots, kind="stable")`` for slots in -1 .. n_slots - 1 (a counting sort)."""
    count = np.zeros(n_slots + 2, np.int64)
    for slot in slots:
        count[slot + 2] += 1
    for k in range(1, n_slots + 2):
        count[k] += count[k - 1]
    order = np.empty(len(slots), np.int64)
    for i in range(len(slots)):
        order[count[slots[i] + 1]] = i
        count[slots[i] + 1] += 1
    return order


@njit(cache=True, nogil=True)
def _swap_out_end(i, out_end, cursor, d2h_free, late_queue, late_slot, late_duration, late_start, finish_plain,
                  seg_slot, seg_shift, seg_count, shift):
    """The end of copy out ``i``, scheduling the late copies out in queue order up to it
    (``cursor[0]``: the next late copy out; ``d2h_free[0]``: when the d2h engine is free)."""
    while out_end[i] < 0.0:
        k = cursor[0]
        slot = late_slot[k]  # before the waiting slot at hand: its finish is settled
        if slot >= seg_slot[seg_count - 1]:
            start = finish_plain[slot] + shift
        else:
            start = finish_plain[slot] + seg_shift[_bisect_right(seg_slot, seg_count, slot) - 1]
        if d2h_free[0] > start:
            start = d2h_free[0]
        late_start[k] = start
        d2h_free[0] = start + late_duration[k]
        out_end[late_queue[k]] = d2h_free[0]
        cursor[0] = k + 1
    return out_end[i]


@njit(cache=True, nogil=True)
def schedule(finish_plain, out_ready, out_duration, trigger, in_swap, in_duration, need, sync_wait,
             after_copies_out, copies_slot):
    """The event pass: walk the slots that wait for a transfer in order, shifting later ops by the stall.

    Queues are FIFO by ready time; a transfer's ready time depends only on slots before the one
    waiting for it, so one pass suffices. Finish times are plain finish + a piecewise-constant shift
    (``seg_slot``/``seg_shift``). Copies out that become ready before the first waiting slot are
    scheduled in bulk; swap-ins are released in trigger order at the first waiting slot after their
    trigger, after the stalls of the slots before. With ``after_copies_out`` swap-in j also waits for
    the copies out of what the op at ``copies_slot[j]`` made. Transfer ends not known yet are -1.0.
    Returns the copies' start and
    end times, each swap-in's ready time, every slot's finish time with the stalls, and the copies
    out in queue order."""
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
    cursor = np.zeros(1, np.int64)
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
    finish_all = np.empty(n_slots)
    for s in range(seg_count):
        stop = seg_slot[s + 1] if s + 1 < seg_count else n_slots
        for slot in range(seg_slot[s], stop):
            finish_all[slot] = finish_plain[slot] + seg_shift[s]
    return out_start, out_end, in_ready, in_start, in_end, finish_all, out_queue


@njit(cache=True, nogil=True)
def account(baseline_bytes, alloc_bytes, tensor_bytes, duration, finish_all, position, n_ops,
            out_start, out_end, out_queue, swap_root, home_link, swap_bytes,
            roots, root_base_free_slot, root_last_slot, moved_links, moved_last,
            in_swap, in_ready, in_end, in_bytes, need_slot, in_consumer_ptr, in_consumers, far_keys,
            late_slot, late_key, late_root, late_out):
    """Device memory per slot once the transfers are timed, on top of the unswapped baseline:
    swapped buffers freed earlier, swap-in buffers, outputs written in place, the waits' peaks; and
    the host's peak. All byte figures are whole numbers in float64, so sums are
    exact in any order; times are compared as the numpy code compared them."""
    n_slots, n_swaps, n_ins, n_roots = len(duration), len(out_end), len(in_ready), len(roots)
    start_all = finish_all - duration
    # a copy out frees its buffer in the slot running when it ends; one that ends while the slot's
    # op still waits (a stall) frees it before the op allocates anything: it does not count in that
    # slot (to a nanosecond: the op's start is finish - duration, which rounds differently from the
    # copy's end it waited for), only in the wait (_wait_peaks)
    out_free_slot = np.empty(n_swaps, np.int64)
    found = 0
    for i in out_queue:  # copies end in queue order: each search starts from the last find
        found = _left_near(finish_all, out_end[i], found)
        slot = min(found, n_slots - 1)
        if out_end[i] <= start_all[slot] + 1e-9:
            slot -= 1
        out_free_slot[i] = slot
    # a copy out holds the buffer its tensor lives in: the original, or a swap-in's that a rewired
    # read carried it into (see buffers.rewired_lifetimes)
    copy_free_slot = np.full(n_roots, -1, np.int64)
    copy_end = np.zeros(n_roots)
    for i in range(n_swaps):
        if home_link[i] < 0:
            r = swap_root[i]
            copy_free_slot[r] = max(copy_free_slot[r], out_free_slot[i])
            copy_end[r] = max(copy_end[r], out_end[i])
    new_free = np.maximum(root_last_slot, copy_free_slot)
    # a swap-in's buffer exists from when the copy op may run (its trigger done, the host copy
    # there), not from when the copy engine gets to it: TF allocates the output as the op runs and
    # queues the copy on the stream (GPU), or copies at once (CPU testbed)
    in_alloc_slot = np.empty(n_ins, np.int64)
    in_free_slot = np.empty(n_ins, np.int64)
    found = 0
    for j in range(n_ins):
        found = _right_near(finish_all, in_ready[j], found)
        in_alloc_slot[j] = min(found, need_slot[j])
        in_free_slot[j] = max(position[in_consumers[in_consumer_ptr[j + 1] - 1]], in_alloc_slot[j])
    n_reads = len(far_keys)
    by_key = stable_argsort(far_keys)
    sorted_far_keys = far_keys[by_key]
    swap_in_of_read = np.empty(n_reads, np.int64)
    for j in range(n_ins):
        for k in range(in_consumer_ptr[j], in_consumer_ptr[j + 1]):
            swap_in_of_read[k] = j
    group_of_read = swap_in_of_read[by_key]  # the swap-in of each read, in key order
    if len(moved_links):  # ops that wrote into a rewired read's buffer keep the swap-in alive
        for k in range(len(moved_links)):
            group = group_of_read[_left(sorted_far_keys, moved_links[k])]
            in_free_slot[group] = max(in_free_slot[group], moved_last[k])
        for i in range(n_swaps):
            if home_link[i] >= 0:
                group = group_of_read[_left(sorted_far_keys, home_link[i])]
                in_free_slot[group] = max(in_free_slot[group], out_free_slot[i])

    # Forwards a plan makes possible (``buffers.Buffers.late_*``). An op that could not write into an
    # input's buffer because a later op still read it can once that read goes to a swap-in, as TF's
    # forward_input_or_allocate_output does: into the original buffer when it is now its last reader
    # and the copy out is done within its slot (a BatchNorm's SquaredDifference on a swapped
    # convolution output), or into the swap-in's buffer when its own read was rewired and it is that
    # swap-in's last reader. "Within the slot" rather than "before the op starts": on the CPU testbed
    # the first matches ResNet-50's measured peaks under the fidelity plans (within 0.6 %), the second
    # over-predicted two of them by 4.7 %; the two differ only for a copy that ends while the op runs.
    n_late = len(late_slot) if n_roots else 0
    in_place = np.zeros(n_late, np.bool_)
    placed_out = -1  # an output's candidate inputs are consecutive, in input order: the first possible wins
    for k in range(n_late):
        if late_out[k] == placed_out:
            continue
        where = min(_left(roots, late_root[k]), n_roots - 1)
        if (roots[where] == late_root[k] and root_last_slot[where] == late_slot[k]
                and copy_free_slot[where] <= late_slot[k]):
            in_place[k] = True
            placed_out = late_out[k]
        elif n_reads:
            where = min(_left(sorted_far_keys, late_key[k]), n_reads - 1)
            source = late_key[k] // n_ops
            if (sorted_far_keys[where] == late_key[k] and in_free_slot[group_of_read[where]] == late_slot[k]
                    and tensor_bytes[source] == tensor_bytes[late_out[k]]):
                in_place[k] = True
                placed_out = late_out[k]
    in_place_slot = late_slot[:n_late][in_place]
    in_place_out = late_out[:n_late][in_place]

    # the changes to the baseline, counted in one go
    delta = np.zeros(n_slots + 1)
    for r in range(n_roots):
        size = tensor_bytes[roots[r]]
        delta[root_base_free_slot[r] + 1] += size
        delta[new_free[r] + 1] -= size
    for j in range(n_ins):
        delta[in_alloc_slot[j]] += in_bytes[j]
        delta[in_free_slot[j] + 1] -= in_bytes[j]
    for k in range(len(in_place_slot)):
        delta[in_place_slot[k]] -= tensor_bytes[in_place_out[k]]
        delta[in_place_slot[k] + 1] += tensor_bytes[in_place_out[k]]
    slot_bytes = baseline_bytes + np.cumsum(delta[:n_slots])
    wait_slots, wait_moment = _wait_peaks(slot_bytes, alloc_bytes, tensor_bytes, start_all, finish_all, roots,
                                          new_free, copy_free_slot, copy_end, in_alloc_slot, in_ready, in_bytes,
                                          in_place_slot, in_place_out)
    host_peak, host_peak_s = _host_peak(swap_bytes, out_start, out_queue, in_swap, in_end)
    return (slot_bytes, new_free, copy_end, in_alloc_slot, in_free_slot, in_place_out, wait_slots, wait_moment,
            host_peak, host_peak_s)


@njit(cache=True, nogil=True)
def _wait_peaks(slot_bytes, alloc_bytes, tensor_bytes, start_all, finish_all, roots, root_free_slot,
                copy_free_slot, copy_end, in_alloc_slot, in_ready, in_bytes, in_place_slot, in_place_out):
    """Memory during the waits in which a copy out ends after a swap-in was allocated (before the op
    at slot s starts, its wait holds what lives on from slot s-1, the swap-ins allocated so far and the
    swapped buffers whose copy out has not ended, not the op's own outputs). Raises ``slot_bytes`` in
    place where a wait's peak is larger; returns those slots and the moments of their peaks."""
    n_slots, n_roots, n_ins = len(slot_bytes), len(roots), len(in_ready)
    # roots whose copy out frees them after their last slot ended: in the next slot's wait
    root_slot = np.full(n_roots, -1, np.int64)
    n_waiting = 0
    for r in range(n_roots):
        if (copy_free_slot[r] >= root_free_slot[r] and root_free_slot[r] + 1 < n_slots
                and copy_end[r] > finish_all[min(root_free_slot[r], n_slots - 1)] + 1e-9):
            root_slot[r] = root_free_slot[r] + 1
            n_waiting += 1
    if n_waiting == 0 or n_ins == 0:
        return np.zeros(0, np.int64), np.zeros(0)
    in_wait = np.zeros(n_ins, np.bool_)
    first_in = np.full(n_slots, np.inf)
    for j in range(n_ins):
        if in_ready[j] < start_all[in_alloc_slot[j]] - 1e-9:  # allocated before its slot's op starts
            in_wait[j] = True
            first_in[in_alloc_slot[j]] = min(first_in[in_alloc_slot[j]], in_ready[j])
    last_end = np.zeros(n_slots)
    for r in range(n_roots):
        if root_slot[r] >= 0:
            last_end[root_slot[r]] = max(last_end[root_slot[r]], copy_end[r])
    is_wait = last_end > first_in + 1e-9
    n_waits = 0
    for s in range(n_slots):
        n_waits += is_wait[s]
    if n_waits == 0:
        return np.zeros(0, np.int64), np.zeros(0)
    # each wait starts with what lives on from the slot before, and the buffers copied out in it
    start_bytes = slot_bytes - alloc_bytes[:n_slots]
    for k in range(len(in_place_slot)):
        start_bytes[in_place_slot[k]] += tensor_bytes[in_place_out[k]]
    for j in range(n_ins):
        start_bytes[in_alloc_slot[j]] -= in_bytes[j]
    # then its events: copies out ending (frees first at the same instant, to a ns), swap-ins allocated
    n_events = 0
    for r in range(n_roots):
        if root_slot[r] >= 0:
            start_bytes[root_slot[r]] += tensor_bytes[roots[r]]
            n_events += is_wait[root_slot[r]]
    for j in range(n_ins):
        n_events += in_wait[j] and is_wait[in_alloc_slot[j]]
    event_slot = np.empty(n_events, np.int64)
    event_time = np.empty(n_events)
    event_bytes = np.empty(n_events)
    k = 0
    for r in range(n_roots):
        if root_slot[r] >= 0 and is_wait[root_slot[r]]:
            event_slot[k], event_time[k], event_bytes[k] = root_slot[r], copy_end[r] - 1e-9, -tensor_bytes[roots[r]]
            k += 1
    for j in range(n_ins):
        if in_wait[j] and is_wait[in_alloc_slot[j]]:
            event_slot[k], event_time[k], event_bytes[k] = in_alloc_slot[j], in_ready[j], in_bytes[j]
            k += 1
    by_time = _lexsort(event_time, event_bytes, np.arange(n_events))
    by_slot = by_time[_slot_argsort(event_slot[by_time], n_slots)]  # by slot, time, bytes, index
    wait_slots = np.empty(n_waits, np.int64)
    wait_moment = np.empty(n_waits)
    n_higher = 0
    k = 0
    while k < n_events:  # one wait (slot) at a time, its events in time order: its largest moment
        slot = event_slot[by_slot[k]]
        running = start_bytes[slot]
        best, best_time = -np.inf, 0.0
        while k < n_events and event_slot[by_slot[k]] == slot:
            running += event_bytes[by_slot[k]]
            if running > best:
                best, best_time = running, event_time[by_slot[k]]
            k += 1
        if best > slot_bytes[slot]:
            slot_bytes[slot] = best
            wait_slots[n_higher], wait_moment[n_higher] = slot, best_time
            n_higher += 1
    return wait_slots[:n_higher], wait_moment[:n_higher]


@njit(cache=True, nogil=True)
def _host_peak(swap_bytes, out_start, out_queue, in_swap, in_end):
    """Host memory over time, its peak and when: a copy lives from its swap-out to its last swap-in
    (frees before allocations at the same instant). The copies out start in queue order
    (``out_queue``) and are mostly back in the reverse order: the sort starts from that guess."""
    n_swaps = len(swap_bytes)
    if n_swaps == 0:
        return 0.0, 0.0
    host_free = np.zeros(n_swaps)
    for j in range(len(in_swap)):
        host_free[in_swap[j]] = max(host_free[in_swap[j]], in_end[j])
    times = np.concatenate((out_start, host_free))
    sizes = np.concatenate((swap_bytes, -swap_bytes))
    guess = np.concatenate((out_queue, n_swaps + out_queue[::-1]))
    by_time = _lexsort(times, sizes, guess)
    running = np.cumsum(sizes[by_time])
    top = np.argmax(running)
    return max(0.0, running[top]), times[by_time[top]]


@njit(cache=True, nogil=True)
def rewired_lifetimes(use_ptr, use_slot, use_id, use_segment, seg_ptr, seg_head, link_key, link_id, seg_parent,
                      segment, read_keys, n_tensors, roots, far_keys, tensors):
    """``buffers.rewired_lifetimes`` (which documents it) on the arrays of ``buffers.Buffers`` and
    ``buffers._read_ids``: per root the last slot still reading the original buffer, the cut links
    with the last slot of what lives past them, and per tensor the link that carried it away."""
    # which read ids the plan rewires (the last entry: id -1, no read)
    n_keys = len(read_keys)
    rewired = np.zeros(n_keys + 1, np.bool_)
    where = 0
    for key in far_keys:  # usually in order: each search starts from the last find
        where = _left_near(read_keys, key, where)
        if where < n_keys and read_keys[where] == key:
            rewired[where] = True
    n_roots = len(roots)
    # segments of the roots, grouped by root, parents before children; their local numbers
    n_segments = 0
    for r in range(n_roots):
        n_segments += seg_ptr[roots[r] + 1] - seg_ptr[roots[r]]
    local = np.full(n_tensors, -1, np.int64)
    heads = np.empty(n_segments, np.int64)
    k = 0
    for r in range(n_roots):
        for m in range(seg_ptr[roots[r]], seg_ptr[roots[r] + 1]):
            heads[k] = seg_head[m]
            local[seg_head[m]] = k
            k += 1
    segment_last = np.full(n_segments, -1, np.int64)
    for r in range(n_roots):
        for u in range(use_ptr[roots[r]], use_ptr[roots[r] + 1]):
            slot = -1 if rewired[use_id[u]] else use_slot[u]
            s = local[use_segment[u]]
            if slot > segment_last[s]:
                segment_last[s] = slot
    # a segment lives in the buffer of its nearest ancestor (itself included) whose link was cut, or
    # the root's: parents come first, so one pass settles each
    cut = np.empty(n_segments, np.bool_)
    owner = np.empty(n_segments, np.int64)
    n_cut = 0
    for s in range(n_segments):
        cut[s] = rewired[link_id[heads[s]]]
        n_cut += cut[s]
        parent = seg_parent[heads[s]]
        owner[s] = owner[local[parent]] if parent >= 0 and not cut[s] else s
    owner_last = np.full(n_segments, -1, np.int64)
    for s in range(n_segments):
        owner_last[owner[s]] = max(owner_last[owner[s]], segment_last[s])
    root_last = np.empty(n_roots, np.int64)
    for r in range(n_roots):
        root_last[r] = owner_last[local[roots[r]]]
    cut_links = np.empty(n_cut, np.int64)
    cut_last = np.empty(n_cut, np.int64)
    k = 0
    for s in range(n_segments):
        if cut[s]:
            cut_links[k], cut_last[k] = link_key[heads[s]], owner_last[s]
            k += 1
    home_link = np.empty(len(tensors), np.int64)
    for i in range(len(tensors)):
        home = owner[local[segment[tensors[i]]]]
        home_link[i] = link_key[heads[home]] if cut[home] else -1
    return root_last, cut_links, cut_last, home_link


@njit(cache=True, nogil=True)
def prepare(position, tensor_producer, root, n_ops, swap_tensor, in_swap, in_trigger, in_after, in_consumer_ptr,
            in_consumers, max1, max1_tensor, max2, fused_wait, safe_slot):
    """A plan in slot terms (see ``replay.replay``): when each copy out may start, which slot each
    swap-in's first consumer runs at, the slot whose end releases each swap-in (its trigger's; a
    synchronous one's after the consumer's other inputs, ``replay._other_input_slots``; a fused
    wait's safe slot) and whose copies out it waits for with ``after_copies_out``; the rewired reads
    (``tensor * n_ops + consumer``); the swapped buffers (sorted) and each swap's among them."""
    n_swaps, n_ins = len(swap_tensor), len(in_swap)
    out_ready = np.empty(n_swaps, np.int64)
    for i in range(n_swaps):
        out_ready[i] = position[tensor_producer[swap_tensor[i]]]
    need = np.empty(n_ins, np.int64)
    trigger_slot = np.empty(n_ins, np.int64)
    copies_slot = np.empty(n_ins, np.int64)
    far_keys = np.empty(len(in_consumers), np.int64)
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
        for k in range(in_consumer_ptr[j], in_consumer_ptr[j + 1]):
            far_keys[k] = tensor * n_ops + in_consumers[k]
    swap_roots = root[swap_tensor]
    order = stable_argsort(swap_roots)
    swap_root = np.empty(n_swaps, np.int64)
    roots = np.empty(n_swaps, np.int64)
    n_roots = 0
    for k in range(n_swaps):
        value = swap_roots[order[k]]
        if n_roots == 0 or roots[n_roots - 1] != value:
            roots[n_roots] = value
            n_roots += 1
        swap_root[order[k]] = n_roots - 1
    return out_ready, need, trigger_slot, copies_slot, far_keys, roots[:n_roots].copy(), swap_root


MEMO_READS = 4  # readers kept in a swap-in's memo row (rows with more are looked up in Python)
MEMO_MISSING = -3  # memo_lookup: not in the memo


@njit(cache=True, nogil=True)
def memo_rows(candidates, tensor, trigger, after, consumer_ptr, consumers):
    """Per swap-in of ``candidates``: its ``fusion.safe_wait_slots`` memo key as a row (tensor,
    trigger, after, number of readers, the first MEMO_READS readers, -2 after the last)."""
    rows = np.full((len(candidates), 4 + MEMO_READS), -2, np.int64)
    for c in range(len(candidates)):
        j = candidates[c]
        n_reads = consumer_ptr[j + 1] - consumer_ptr[j]
        rows[c, 0], rows[c, 1], rows[c, 2], rows[c, 3] = tensor[j], trigger[j], after[j], n_reads
        for k in range(min(n_reads, MEMO_READS)):
            rows[c, 4 + k] = consumers[consumer_ptr[j] + k]
    return rows


@njit(cache=True, nogil=True)
def _row_less(a, b):
    for k in range(len(a)):
        if a[k] != b[k]:
            return a[k] < b[k]
    return False


@njit(cache=True, nogil=True)
def memo_lookup(rows, memo, answers):
    """Each row's answer in the memo (``memo``: rows sorted lexicographically, ``answers`` beside
    them), MEMO_MISSING where it has none or has more readers than a row holds."""
    found = np.full(len(rows), MEMO_MISSING, np.int64)
    for c in range(len(rows)):
        if rows[c, 3] > MEMO_READS:
            continue
        lo, hi = 0, len(memo)
        while lo < hi:
            mid = (lo + hi) // 2
            if _row_less(memo[mid], rows[c]):
                lo = mid + 1
            else:
                hi = mid
        if lo < len(memo) and not _row_less(rows[c], memo[lo]):
            found[c] = answers[lo]
    return found


@njit(cache=True, nogil=True)
def group_far_edges(tensor, level, groupby):
    """``planning._group_far_edges`` for ``groupby`` > 0: a new group at each new tensor and once a
    read lies more than ``groupby`` levels past its group's first."""
    group = np.empty(len(tensor), np.int64)
    current, start_level = -1, 0
    for i in range(len(tensor)):
        if i == 0 or tensor[i] != tensor[i - 1] or level[i] - start_level > groupby:
            current += 1
            start_level = level[i]
        group[i] = current
    return group


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
