"""The per-plan loops of the replay and the planner, compiled with numba: one call from a
plan to a Replay's fields (``replay_plan``: fusion-safe waits, the plan in slot terms, buffer
lifetimes once reads are rewired, then ``kernel_events.schedule`` and ``kernel_memory.account``),
and the swap rules (``plan_reads``, ``after_ops``).

Each kernel does, operation for operation, what the numpy code it replaced did (the same float
additions in the same order, the same tie-breaking), so results are bit-identical to it: the golden
set (tests/simulator/test_golden.py) holds them to that. ``cache=True`` keeps the machine code under
``__pycache__``, so a new process loads it instead of compiling again (``kernel_tools`` says how the
small routines are compiled).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from simulator.kernels.events import schedule
from simulator.kernels.memory import account, copy_overlap
from simulator.kernels.records import FarReads, Lifetimes, ReplayArrays, SlotPlan
from simulator.kernels.tools import (contains_value, contains_value_in, distinct_sorted, doubled, radix_argsort,
                                    search_left, search_right_in)


@njit(cache=True, nogil=True)
def _rewired_reads(buffers, read_tensor, read_consumer):
    """Which read ids (``buffers.RewireTables``, in the ``BufferRecord``) the reads (``read_tensor``,
    ``read_consumer``) rewire (the last entry: id -1, no read), each read's id and its place in the
    per-tensor reads (-1: not a read of the graph)."""
    tensor_read_ptr, tensor_read_consumer = buffers.tensor_read_ptr, buffers.tensor_read_consumer
    tensor_read_id, n_keys = buffers.tensor_read_id, buffers.n_keys
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
def _lifetimes(buffers, rewired, roots, tensors, tensor_root):
    """Last slots once the reads ``rewired`` (by read id, ``buffers.RewireTables`` in the
    ``BufferRecord``) go to swap-ins, a ``Lifetimes``.

    Holds, for each of ``roots`` (unique root buffers, sorted), the last slot that still reads the
    original buffer (its producer at least); the rewired links that carried a segment away (their
    keys ``tensor * n_ops + op`` and read ids) with the last slot of what now lives in the swap-in
    buffer; and for each of ``tensors`` (``tensor_root``: the index in ``roots`` of each one's root)
    the link that carried it into a swap-in's buffer, key and id, -1 where it stays in the original
    buffer. A segment lives in the buffer of its nearest ancestor (itself included) whose link was
    cut, or the root's. Segments are numbered locally, the roots' one after the other (a root's
    segment numbers are consecutive in the tables); a segment's last use is its latest not
    rewired, found from the latest down (the rewired reads are the late ones)."""
    seg_use_ptr, seg_use_slot, seg_use_id = buffers.seg_use_ptr, buffers.seg_use_slot, buffers.seg_use_id
    seg_ptr, seg_link_id, seg_link_key = buffers.seg_ptr, buffers.seg_link_id, buffers.seg_link_key
    seg_parent, tensor_segment = buffers.seg_parent, buffers.tensor_segment
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
    return Lifetimes(root_last, cut_links[:n_cut], cut_ids[:n_cut], cut_last[:n_cut], home_link, home_ids)


@njit(cache=True, nogil=True)
def safe_wait_slots(fusion, tensor, trigger, after, consumer_ptr, consumers):
    """``fusion.safe_wait_slots`` (which documents it) on a graph's ``FusionRecord``: per swap-in, whether
    an op it waits for may be fused with one of its consumers, and if so the latest slot among the ops
    it waits for instead (-1: none). Only swap-ins with a reader in some fusion neighbourhood and
    (synchronous, or a trigger or ``after`` inside one) are looked at."""
    has_danger, endangered = fusion.has_danger, fusion.endangered
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
        changed[j], slots[j] = _safe_wait(fusion, tensor[j], trigger[j], after[j], consumers, consumer_ptr[j],
                                          consumer_ptr[j + 1], scratch)
    return changed, slots


@njit(cache=True, nogil=True, inline="always")
def _safe_wait(fusion, tensor, trigger, after, consumers, lo, hi, scratch):
    """One swap-in of ``safe_wait_slots`` (readers ``consumers[lo:hi]``): whether a wait is in danger,
    and the latest slot it waits for instead. The sets involved are a few ops, kept in the rows of
    ``scratch`` (copied to larger arrays, ``doubled``, when full) and searched linearly."""
    position, tensor_producer = fusion.position, fusion.tensor_producer
    danger_ptr, danger_ops = fusion.danger_ptr, fusion.danger_ops
    source_ptr, source_ops = fusion.source_ptr, fusion.source_ops
    input_ptr, input_tensor, input_source = fusion.input_ptr, fusion.input_tensor, fusion.input_source
    control_ptr, control_ops = fusion.control_ptr, fusion.control_ops
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
            if not contains_value(danger, n_danger, danger_ops[d]):
                if n_danger == len(danger):
                    danger = doubled(danger)
                danger[n_danger] = danger_ops[d]
                n_danger += 1
    hit = False
    for w in range(n_waits):
        hit |= contains_value(danger, n_danger, waits[w])
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
        if contains_value(seen, n_seen, op):
            continue
        if n_seen == len(seen):
            seen = doubled(seen)
        seen[n_seen] = op
        n_seen += 1
        if contains_value(danger, n_danger, op):
            for e in range(source_ptr[op], source_ptr[op + 1]):
                if n_pending == len(pending):
                    pending = doubled(pending)
                pending[n_pending] = source_ops[e]
                n_pending += 1
        elif position[op] > latest:
            latest = position[op]
    return True, latest


@njit(cache=True, nogil=True)
def _replay_safe_waits(graph, plan, far):
    """``safe_wait_slots`` for the replay of ``plan`` (``PlanArrays``; ``far``: its ``FarReads``), with
    the graph's answers per read (``ReplayGraphRecord.read_safe_*``: a synchronous swap-in of that
    read alone, waiting for nothing else) and the plan's reads' places among them (``far.edge``). A
    wait's result is the union of what each of its ops leads to, so a swap-in whose first reader's
    fusion neighbourhood holds its other readers' needs a walk only when its trigger or ``after`` is
    itself in danger."""
    fusion = graph.fusion
    position, tensor_producer = fusion.position, fusion.tensor_producer
    has_danger, endangered = fusion.has_danger, fusion.endangered
    danger_ptr, danger_ops = fusion.danger_ptr, fusion.danger_ops
    read_safe_hit, read_safe_slot = graph.read_safe_hit, graph.read_safe_slot
    tensor, trigger, after, read_edge = far.in_tensor, plan.in_trigger, plan.in_after, far.edge
    consumer_ptr, consumers = plan.in_consumer_ptr, plan.in_consumers
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
                alone &= contains_value_in(danger_ops, danger_ptr[reader], danger_ptr[reader + 1], danger_ops[d])
        if alone:
            wait_after = after[j] >= 0 and after[j] != tensor_producer[tensor[j]]
            after_safe = not (wait_after and contains_value_in(danger_ops, danger_ptr[reader], danger_ptr[reader + 1],
                                                       after[j]))
            if trigger[j] >= 0 and after_safe and not contains_value_in(danger_ops, danger_ptr[reader],
                                                                danger_ptr[reader + 1], trigger[j]):
                continue  # neither of its waits is in danger
            if trigger[j] < 0 and after_safe:
                if read_safe_hit[read_edge[lo]]:
                    changed[j] = True
                    slots[j] = max(read_safe_slot[read_edge[lo]], position[after[j]] if wait_after else -1)
                continue
        changed[j], slots[j] = _safe_wait(fusion, tensor[j], trigger[j], after[j], consumers, lo, hi, scratch)
    return changed, slots


@njit(cache=True, nogil=True)
def prepare(graph, plan, fused_wait, safe_slot):
    """``plan`` (``PlanArrays``) in slot terms (see ``replay.replay``), a ``SlotPlan``: when each copy
    out may start, which slot each swap-in's first consumer runs at, the slot whose end releases each
    swap-in (its trigger's; a synchronous one's after the consumer's other inputs,
    ``replay._other_input_slots``; a fused wait's safe slot) and whose copies out it waits for with
    ``after_copies_out``; the swapped buffers (sorted) and each swap's among them."""
    position, tensor_producer, root = graph.buffers.position, graph.buffers.tensor_producer, graph.buffers.root
    max1, max1_tensor, max2 = graph.max1, graph.max1_tensor, graph.max2
    swap_tensor, in_swap, in_trigger, in_after = plan.swap_tensor, plan.in_swap, plan.in_trigger, plan.in_after
    in_consumer_ptr, in_consumers = plan.in_consumer_ptr, plan.in_consumers
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
        # the copies out of what the op it starts after made: its trigger's; none where the trigger, fused with a
        # reader, is replaced by its sources (a copy out of a filter gradient's sibling would close a cycle)
        copies_slot[j] = slot if in_trigger[j] < 0 else (-1 if fused_wait[j] and slot < planned else planned)
    roots, swap_root = distinct_sorted(root[swap_tensor], len(root))
    return SlotPlan(out_ready, need, trigger_slot, copies_slot, roots, swap_root)


@njit(cache=True, nogil=True)
def _sync_copy_waiters(buffers, fusion, rewired, swap_tensor, sync_out):
    """Per swapped tensor with a synchronous copy out, the slot that waits for that copy: the first slot
    that still reads it on the device (its reads not rewired to a swap-in; they wait for the copy), or
    when none does, the slot after its producer's (so the copy frees the buffer before the step goes on);
    -1 elsewhere or where the producer runs last. ``sync_out`` 2 (a copy the step waits for only because
    the device's copies wait for compute, ``replay._waited_copies_out``): the slot after its producer's
    whatever reads it, as the rewriter places that wait, but past ops of a fused chain, which a control
    edge would keep unfused (``simulator.fusion.in_fused_chain``), unless the op takes the wait through an
    operand (``simulator.fusion.WAIT_OPERANDS``)."""
    position, tensor_producer = buffers.position, buffers.tensor_producer
    tensor_read_ptr, tensor_read_consumer = buffers.tensor_read_ptr, buffers.tensor_read_consumer
    tensor_read_id = buffers.tensor_read_id
    has_danger, endangered, wait_operand = fusion.has_danger, fusion.endangered, fusion.wait_operand
    n_ops = len(position)
    sync_wait = np.full(len(swap_tensor), -1, np.int64)
    op_at = np.empty(n_ops, np.int64)
    op_at[position] = np.arange(n_ops)
    for i in range(len(swap_tensor)):
        if not sync_out[i]:
            continue
        tensor = swap_tensor[i]
        earliest = n_ops
        if sync_out[i] == 1:  # the plan's own: its remaining readers wait
            for e in range(tensor_read_ptr[tensor], tensor_read_ptr[tensor + 1]):
                if not rewired[tensor_read_id[e]]:
                    earliest = min(earliest, position[tensor_read_consumer[e]])
        first = earliest if earliest < n_ops else position[tensor_producer[tensor]] + 1
        while sync_out[i] == 2 and first < n_ops and (has_danger[op_at[first]] or endangered[op_at[first]]) \
                and not wait_operand[op_at[first]]:
            first += 1
        if first < n_ops:
            sync_wait[i] = first
    return sync_wait


@njit(cache=True, nogil=True)
def _copies_before_their_waits(slots, sync_out, sync_wait, after_copies_out):
    """``slots`` with each copy out the step waits for only because the device's copies wait for compute
    (``sync_out`` 2) ready just before the op that waits for it, where that op is not the one after its
    producer (a fused chain between them): such a device runs the copy when that op is due, not before, and its
    buffer is held until then. But for a copy a swap-in waits for (``after_copies_out``: one its producer
    starts), which runs before that swap-in (``small_cnn`` in 4 parts, a split batch norm's part copies moved
    past the chain after them, all four swap-ins they make room for were counted together: 0.875 MiB predicted,
    0.746 measured)."""
    out_ready = slots.out_ready.copy()
    starts = np.sort(slots.copies) if after_copies_out else np.empty(0, np.int64)  # slots a swap-in starts after
    for i in range(len(out_ready)):
        if sync_out[i] == 2 and sync_wait[i] > out_ready[i] + 1:
            at = search_left(starts, out_ready[i])
            if at == len(starts) or starts[at] != out_ready[i]:
                out_ready[i] = sync_wait[i] - 1
    return SlotPlan(out_ready, slots.need, slots.trigger, slots.copies, slots.roots, slots.swap_root)


@njit(cache=True, nogil=True)
def replay_plan(step, plan, overlap):
    """One replay of ``plan`` (``PlanArrays``) on ``step`` (the ``StepRecord`` ``replay._context`` builds),
    from the plan's arrays to the Replay's (a ``ReplayArrays``): the fusion-safe waits, the plan in
    slot terms, the rewired buffers' lifetimes, the event pass and the memory accounting, in one call;
    with ``overlap`` the compute during copies too (else 0.0: ``Replay.copy_overlap_s`` computes it on
    demand). Per-slot work is two passes (finish times from the first stall and the slots' bytes),
    three with ``overlap``; the rest visits what the plan moved."""
    graph, tensor_bytes = step.graph, step.tensor_bytes
    swap_tensor, in_swap = plan.swap_tensor, plan.in_swap
    in_consumer_ptr, in_consumers = plan.in_consumer_ptr, plan.in_consumers
    in_tensor = swap_tensor[in_swap]
    far_tensor = np.empty(len(in_consumers), np.int64)  # the tensor of each far read
    for j in range(len(in_swap)):
        for k in range(in_consumer_ptr[j], in_consumer_ptr[j + 1]):
            far_tensor[k] = in_tensor[j]
    # far reads rewired (their ids and places among the graph's reads)
    rewired, far_ids, far_edge = _rewired_reads(graph.buffers, far_tensor, in_consumers)
    far = FarReads(far_tensor, far_ids, far_edge, rewired, in_tensor)
    fused_wait, safe_slot = _replay_safe_waits(graph, plan, far)
    slots = prepare(graph, plan, fused_wait, safe_slot)
    # the swapped buffers' lifetimes; the original buffer's remaining readers
    lifetimes = _lifetimes(graph.buffers, rewired, slots.roots, swap_tensor, slots.swap_root)
    sync_wait = _sync_copy_waiters(graph.buffers, graph.fusion, rewired, swap_tensor, plan.sync_out)
    slots = _copies_before_their_waits(slots, plan.sync_out, sync_wait, plan.after_copies_out)
    transfers = schedule(step, plan, slots, in_tensor, sync_wait)
    memory = account(step, plan, far, slots, lifetimes, transfers)
    level_peak = memory.level_peak
    level_peak += step.persistent
    overlap_s = copy_overlap(transfers, step.duration) if overlap else 0.0
    d2h_bytes, h2d_bytes = 0.0, 0.0  # whole numbers: exact in any order
    for i in range(len(swap_tensor)):
        d2h_bytes += tensor_bytes[swap_tensor[i]]
    for j in range(len(in_tensor)):
        h2d_bytes += tensor_bytes[in_tensor[j]]
    return ReplayArrays(
        memory.peak_slot, memory.peak, level_peak, transfers.finish_all, transfers.out_start, transfers.out_end,
        transfers.in_start, transfers.in_end, transfers.in_ready, slots.roots, memory.new_free, memory.in_alloc_slot,
        memory.in_free_slot, memory.in_place_out, memory.copy_end, memory.wait_slots, memory.wait_moment,
        memory.host_peak, memory.host_peak_s, d2h_bytes, h2d_bytes, overlap_s)


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
def after_ops(group_tensor, ptr, consumers, buffers):
    """``plan.after_ops`` (which documents it) on a graph's ``BufferRecord``: per swap-in group (a
    tensor's groups consecutive, ``consumers[ptr[k]:ptr[k + 1]]``), the op it must follow."""
    position, order, root, n_keys = buffers.position, buffers.order, buffers.root, buffers.n_keys
    n_groups = len(group_tensor)
    if n_groups == 0:
        return np.zeros(0, np.int64)
    n_tensors = len(root)
    # the swapped tensors (sorted, distinct) and each one's first group; their buffers (sorted, distinct)
    by_tensor = radix_argsort(group_tensor, 0, n_tensors)
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
    roots, root_of_swapped = distinct_sorted(root[swapped], n_tensors)
    read_tensor = np.empty(len(consumers), np.int64)
    for k in range(n_groups):
        for m in range(ptr[k], ptr[k + 1]):
            read_tensor[m] = group_tensor[k]
    rewired, _, _ = _rewired_reads(buffers, read_tensor, consumers)
    lifetimes = _lifetimes(buffers, rewired, roots, swapped, root_of_swapped)
    root_last, home_ids = lifetimes.root_last, lifetimes.home_ids
    cut_ids, cut_last = lifetimes.cut_ids, lifetimes.cut_last
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


@njit(cache=True, nogil=True, inline="always")
def after_partners(trigger, readers, op_level, position, merge_level, merge_position, merge_end):
    """Whether ``trigger`` may depend on an op one of ``readers`` may be merged with as siblings: it runs later
    than and lies above the earliest and the lowest of their partners (``planning.sibling_bounds``); or whether
    the node ``trigger`` may be merged into runs after a reader (``planning.merge_end_positions``; a reader that
    is the partner itself waits for the trigger's sources, ``fusion.safe_wait_slots``). Merged, either would close
    a cycle through the swap-in."""
    for reader in readers:
        if op_level[trigger] > merge_level[reader] and position[trigger] > merge_position[reader]:
            return True
        if merge_end[trigger] > position[reader]:
            return True
    return False


@njit(cache=True, nogil=True)
def plan_reads(planning, triggers, excluded, forced, candidate, threshold, groupby, lb, ub):
    """The core of ``planning.plan_swaps`` (which documents the rules): the far reads, grouped per swap-in,
    groups still read on the device at their first consumer dropped, each group's ``after`` op and
    trigger. ``planning``: the graph view's ``PlanningRecord`` (its edges by tensor, then their
    consumer's slot: the reads of a tensor in execution order, so no sort per plan); ``triggers``: a
    ``TriggerRecord``; ``excluded``: reads never far (update-phase readers, ``kept_reads``); ``forced``: reads
    always far (of a copy in the plan makes, ``state.triggered_reads``); ``candidate``: per tensor, whether the
    rules may swap it. Returns the swapped tensors, each
    group's swap, trigger and ``after`` op, and the groups' reads (CSR)."""
    edge_order, edge_tensor, edge_consumer = planning.edge_order, planning.edge_tensor, planning.edge_consumer
    levels, buffers = planning.levels, planning.buffers
    op_level, merge_level, merge_position = planning.op_level, planning.merge_level, planning.merge_position
    merge_end = planning.merge_end
    producer, position = buffers.tensor_producer, buffers.position
    mode, latest_level, latest_op, span = triggers.mode, triggers.latest_level, triggers.latest_op, triggers.span
    ancestor_ptr, ancestor_ops = triggers.ancestor_ptr, triggers.ancestor_ops
    ancestor_levels, ancestor_key = triggers.ancestor_levels, triggers.ancestor_key
    n_edges = len(edge_order)
    far_tensor = np.empty(n_edges, np.int64)
    far_consumer = np.empty(n_edges, np.int64)
    n_far = 0
    for e in edge_order:  # one read per (tensor, consumer): its edges are next to each other here
        tensor, consumer = edge_tensor[e], edge_consumer[e]
        if (candidate[tensor] and (forced[e] or not excluded[e] and levels[consumer] - levels[producer[tensor]]
                                   > threshold)
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
        after = after_ops(group_tensor, ptr, far_consumer, buffers)
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
    for k in range(n_groups if mode else 0):
        first = far_consumer[ptr[k]]
        hi = levels[first] - lb
        lo = max(levels[first] - ub, levels[producer[group_tensor[k]]] + 1)
        while hi >= 0 and hi >= lo:
            if mode == 1:
                if latest_level[hi] >= lo:
                    trigger[k] = latest_op[hi]
            else:  # the last ancestor trigger whose level <= hi
                pick = search_right_in(ancestor_key, 0, len(ancestor_key), first * span + hi) - 1
                if ancestor_ptr[first] <= pick < ancestor_ptr[first + 1] and ancestor_levels[pick] >= lo:
                    trigger[k] = ancestor_ops[pick]
            if trigger[k] < 0 or not after_partners(trigger[k], far_consumer[ptr[k]:ptr[k + 1]], op_level, position,
                                                    merge_level, merge_position, merge_end):
                break
            hi = levels[trigger[k]] - 1  # the latest candidate below it
            trigger[k] = -1
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
