"""What holds device memory at a given moment of a replay: for reports and for debugging plans."""

from __future__ import annotations

import numpy as np
import pandas as pd

from simulator.buffers import buffers
from simulator.graph import PHASE_NAMES, OpGraph
from simulator.ordering import execution_order
from simulator.plan import SwapPlan
from simulator.replay import Replay


def live_buffers(g: OpGraph, plan: SwapPlan | None, result: Replay, slot: int | None = None) -> pd.DataFrame:
    """Buffers live during execution ``slot`` (default: the peak), largest first.

    Columns: tensor, op_type, phase, bytes, kind ("activation", "swapped", "swap-in", "in place":
    written into the swapped buffer its op read last, no bytes of its own in that slot;
    "copying out": a swapped buffer its copy out still holds), alloc_slot, free_slot. Resident
    memory (weights, optimizer state, inputs) is one row; the bytes sum to the replay's memory at
    ``slot``. Where that is the memory during the op's wait for its swap-ins
    (``Replay.wait_slots``), the rows are what lives at that moment (``attrs["moment_s"]``): not the
    op's outputs, the swap-ins allocated by then, the copies out not yet done.
    """
    slot = result.peak_slot if slot is None else slot
    waits = np.flatnonzero(result.wait_slots == slot)
    moment = float(result.wait_moment_s[waits[0]]) if len(waits) else None
    if plan is not None:
        g = g.with_order(plan.order_name)
    info = buffers(g)
    owners = np.flatnonzero(info.alloc_slot >= 0)
    free = info.free_slot.copy()
    kind = np.full(g.n_tensors, "activation", dtype=object)
    if plan is not None and plan.n_swaps:
        free[result.swapped_roots] = result.swapped_root_free_slot
        kind[result.swapped_roots] = "swapped"
    sizes = g.tensor_bytes.copy()
    in_place = result.in_place_outputs[info.alloc_slot[result.in_place_outputs] == slot]
    sizes[in_place], kind[in_place] = 0, "in place"
    live = owners[(info.alloc_slot[owners] <= slot) & (free[owners] >= slot)]
    if moment is not None:
        live = live[info.alloc_slot[live] < slot]
        held = result.swapped_roots[(result.swapped_root_free_slot == slot - 1)
                                    & (result.swapped_root_copy_end_s - 1e-9 > moment)]
        kind[held] = "copying out"
        live = np.concatenate([live, held])
    rows = [{"tensor": g.tensor_name(t), "op_type": str(g.op_type[g.tensor_producer[t]]),
             "phase": PHASE_NAMES[g.op_phase[g.tensor_producer[t]]], "bytes": int(sizes[t]), "kind": kind[t],
             "alloc_slot": int(info.alloc_slot[t]), "free_slot": int(free[t])} for t in live]
    if plan is not None and plan.n_swap_ins:
        alive = np.flatnonzero((result.swap_in_alloc_slot <= slot) & (result.swap_in_free_slot >= slot))
        if moment is not None:
            alive = alive[(result.swap_in_alloc_slot[alive] < slot) | (result.swap_in_alloc_s[alive] <= moment)]
        for j in alive:
            t = int(plan.tensor[plan.in_swap[j]])
            rows.append({"tensor": g.tensor_name(t), "op_type": str(g.op_type[g.tensor_producer[t]]),
                         "phase": PHASE_NAMES[g.op_phase[g.tensor_producer[t]]], "bytes": int(sizes[t]),
                         "kind": "swap-in", "alloc_slot": int(result.swap_in_alloc_slot[j]),
                         "free_slot": int(result.swap_in_free_slot[j])})
    rows.append({"tensor": "(weights, optimizer state, inputs)", "op_type": "", "phase": "", "kind": "resident",
                 "bytes": g.persistent_bytes, "alloc_slot": 0, "free_slot": g.n_ops - 1})
    table = pd.DataFrame(rows).sort_values("bytes", ascending=False, ignore_index=True)
    table.attrs["slot"] = slot
    table.attrs["moment_s"] = moment
    table.attrs["op"] = str(g.op_name[execution_order(g)[slot]]) if g.n_ops else ""
    return table
