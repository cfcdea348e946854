"""Small compiled routines of the kernels (``plan_loops``, ``events``, ``memory``):
binary searches without slices, a binary heap, sorts, membership in a few values.

Routines that take arrays and allocate nothing are compiled without numba's reference counting
(``array_routine``): inlined or not, numba counted a reference to each array they take, in and out,
with an atomic instruction each (about 5,900 a ResNet-50 replay, a quarter of its time); ones that
take only numbers are inlined (``inline="always"``).
"""

from __future__ import annotations

import numpy as np
from numba import njit


# Routines called per swap, swap-in or wait that take arrays and allocate none: numba's reference
# counting off (its ``_nrt`` option). Inlined at numba's level (``inline="always"``) such a routine
# still took a reference to each array argument and dropped it after its loop, two atomic
# instructions per array and call that LLVM cannot prune across a loop: 647 heap pushes cost 14 us
# that way, 1.2 us without. Such a routine must not create or return an array.
array_routine = njit(cache=True, nogil=True, _nrt=False)


@njit(cache=True, nogil=True, inline="always")
def heap_less(time_a, index_a, time_b, index_b):
    return time_a < time_b or (time_a == time_b and index_a < index_b)


@array_routine
def heap_push(times, items, size, time, item):
    """Push (time, item) onto the binary min-heap in ``times``/``items[:size]``; returns the new size."""
    position = size
    times[position], items[position] = time, item
    while position > 0:
        parent = (position - 1) // 2
        if heap_less(times[position], items[position], times[parent], items[parent]):
            times[position], times[parent] = times[parent], times[position]
            items[position], items[parent] = items[parent], items[position]
            position = parent
        else:
            break
    return size + 1


@array_routine
def heap_pop(times, items, size):
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
        if right < size and heap_less(times[right], items[right], times[left], items[left]):
            least = right
        if heap_less(times[least], items[least], times[position], items[position]):
            times[position], times[least] = times[least], times[position]
            items[position], items[least] = items[least], items[position]
            position = least
        else:
            break
    return time, item, size


@array_routine
def search_left_in(values, lo, hi, x):
    """``np.searchsorted(values[lo:hi], x, "left") + lo`` for a scalar, without a slice (numba's
    own searchsorted allocates per call; a slice costs a reference count in a hot loop)."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if values[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@array_routine
def search_right_in(values, lo, hi, x):
    """``np.searchsorted(values[lo:hi], x, "right") + lo`` for a scalar."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if x < values[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


@array_routine
def search_left(values, x):
    """``np.searchsorted(values, x, "left")`` for a scalar."""
    return search_left_in(values, 0, len(values), x)


@array_routine
def search_right(values, x):
    """``np.searchsorted(values, x, "right")`` for a scalar."""
    return search_right_in(values, 0, len(values), x)


@array_routine
def search_left_near(values, x, hint):
    """``search_left(values, x)`` searched from ``hint`` (a previous answer) upward, doubling the step, so a
    run of ascending look-ups costs about one pass; a look-up below the hint is a plain search."""
    n = len(values)
    where = min(hint, n)
    if where > 0 and values[where - 1] >= x:
        return search_left_in(values, 0, where, x)
    step = 1
    while where + step < n and values[where + step] < x:
        where += step
        step *= 2
    return search_left_in(values, where, min(where + step + 1, n), x)


@array_routine
def search_right_near(values, x, hint):
    """``search_right(values, x)`` searched from ``hint`` upward (see ``search_left_near``)."""
    n = len(values)
    where = min(hint, n)
    if where > 0 and values[where - 1] > x:
        return search_right_in(values, 0, where, x)
    step = 1
    while where + step < n and values[where + step] <= x:
        where += step
        step *= 2
    return search_right_in(values, where, min(where + step + 1, n), x)


@njit(cache=True, nogil=True, inline="always")
def precedes(p, s, i, q, t, j):
    """(p, s, i) < (q, t, j): by primary key, then secondary, then index."""
    return p < q or (p == q and (s < t or (s == t and i < j)))


@njit(cache=True, nogil=True)
def lexsort(primary, secondary, start):
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
            while m > lo and precedes(pk, sk, ok, p[m - 1], s[m - 1], order[m - 1]):
                p[m], s[m], order[m] = p[m - 1], s[m - 1], order[m - 1]
                m -= 1
            p[m], s[m], order[m] = pk, sk, ok
    p2, s2, order2 = np.empty_like(p), np.empty_like(s), np.empty_like(order)
    width = 16
    while width < n:
        for lo in range(0, n - width, 2 * width):
            mid, hi = lo + width, min(lo + 2 * width, n)
            if not precedes(p[mid], s[mid], order[mid], p[mid - 1], s[mid - 1], order[mid - 1]):
                continue  # already in order
            a, b, k = lo, mid, lo
            while a < mid and b < hi:
                if precedes(p[b], s[b], order[b], p[a], s[a], order[a]):
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
def radix_argsort(keys, offset, n_values):
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
def slot_argsort(slots, n_slots):
    """``np.argsort(slots, kind="stable")`` for slots in -1 .. n_slots - 1."""
    return radix_argsort(slots, 1, n_slots + 1)


@array_routine
def contains_value(values, count, value):
    return contains_value_in(values, 0, count, value)


@array_routine
def contains_value_in(values, lo, hi, value):
    """Whether ``value`` is among ``values[lo:hi]`` (a few: searched linearly)."""
    for k in range(lo, hi):
        if values[k] == value:
            return True
    return False


@njit(cache=True, nogil=True)
def doubled(values):
    """``values`` in an array twice as long."""
    grown = np.empty(2 * len(values), values.dtype)
    grown[:len(values)] = values
    return grown


@njit(cache=True, nogil=True)
def distinct_sorted(values, n_values):
    """The distinct ``values`` (integers in 0 .. n_values - 1), sorted, and each value's place among
    them (``np.unique(values, return_inverse=True)``)."""
    order = radix_argsort(values, 0, n_values)
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
