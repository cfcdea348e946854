"""Replay a training step with a swap plan: peak device memory, host memory, step time, transfers.

Time model (docs/design.md 1.5): ops run one after another on one compute stream in the plan's execution
order; one copy engine per direction, transfers queue in the order they become ready; a
swapped-out buffer is freed when its device-to-host copy is done and its remaining readers have
run; a swap-in allocates when it becomes ready (trigger done, data on the host), even if the
engine starts its copy later, and its consumers wait for the copy to finish. A swap-in whose trigger
(or, synchronous, whose consumer's other input) may be fused into its consumer starts after that
op's own inputs instead, as the rewriter builds it (``simulator.fusion``). Rewiring reads can let an
op write its output in place (``kernel_memory.account``).

Memory is accounted per execution slot: a buffer is live from the slot that allocates it to the
slot of its last reader; a transfer event at time t counts in the slot running at t. One moment
is not inside any op: while an op waits for its swap-ins, their buffers are allocated as each
becomes ready, and a copy out that ends during the wait still holds its buffer until then; a
slot's figure is the larger of its op's and its wait's (``wait_slots``). Only swapped tensors are
re-accounted per plan, on top of a cached baseline.

A replay is one compiled call (``kernels.replay_plan``, numba) from the plan's arrays to the
Replay's, on records built once per graph, batch size and device (``_context``); fields a search
does not read are computed at their first read (``_OnDemand``): about a tenth of a millisecond for
ResNet-50 at batch 32 with 474 swaps (README.md), results bit-identical to the numpy replay it
replaced (tests/simulator/test_golden.py). ``live_buffers`` tells what holds device memory at one moment
of a replay, for reports and for debugging plans.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

import numpy as np
import pandas as pd

from simulator import kernels
from simulator.buffers import (alloc_slot_bytes, baseline_slot_bytes, buffer_record, buffers, rewire_tables,
                               slot_levels)
from simulator.device.calibrated import CalibratedDevice
from simulator.device.presets import DeviceModel, get_device
from simulator.fusion import fusion_record, safe_wait_slots
from simulator.graph import PHASE_NAMES, GraphError, OpGraph
from simulator.kernels.records import PlanArrays, ReplayGraphRecord, StepRecord, Transfers
from simulator.ordering import execution_order, position_of
from simulator.planning import SwapPlan
from simulator.state.host_update import (WEIGHT_READS, host_copy_seconds, host_cpu_seconds, host_transfers,
                                         host_update_ops, triggered_reads, with_host_state)


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
    # where the plan moved buffers, in execution slots (see live_buffers)
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
    host_update_s: float = 0.0  # of step_s, the host's CPU updating the state the plan moved there
    # compute time that runs while copies do (summed over copies): what copies sharing the compute's
    # cores slow down (DeviceModel.copy_contention seconds per second of it; stalls cost nothing more)
    copy_overlap_s: float = 0.0

    @property
    def overhead(self) -> float:
        """Slow-down against running the same ops without waiting for transfers."""
        return self.step_s / self.compute_s - 1.0 if self.compute_s > 0 else 0.0

    def fits(self, budget_bytes: int) -> bool:
        return self.peak_bytes <= budget_bytes

    def __getstate__(self) -> dict:
        """Pickled with every field computed, without what the fields read on demand are computed from
        (``_OnDemand``: the graph's context, shared and large)."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def as_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes, "host_peak_bytes": self.host_peak_bytes, "step_s": self.step_s,
            "compute_s": self.compute_s, "stall_s": self.stall_s, "overhead": self.overhead,
            "d2h_bytes": self.d2h_bytes, "h2d_bytes": self.h2d_bytes, "n_swap_outs": self.n_swap_outs,
            "n_swap_ins": self.n_swap_ins, "persistent_bytes": self.persistent_bytes, "peak_level": self.peak_level,
        }


class _OnDemand:
    """A Replay field the compiled replay leaves out, computed at its first read (then kept) from what
    it kept in ``_on_demand``: the slots' finish times and the graph's ``_Context``. A search reads
    the scalars; these took a pass over the slots each (op_end_s, op_start_s: writes scattered over
    the ops) or one and a search per copy (copy_overlap_s): a quarter of a ResNet-50 replay together.
    A Replay built by ``__init__`` has them all."""

    def __init__(self, name: str, compute, default=None):
        self.name, self.compute, self.default = name, compute, default

    def __get__(self, result, owner=None):
        if result is None:
            return self.default
        try:
            finish_all, context = result.__dict__["_on_demand"]
        except KeyError:
            raise AttributeError(self.name) from None
        value = self.compute(result, finish_all, context)
        result.__dict__[self.name] = value
        return value


def _op_end_s(result: Replay, finish_all: np.ndarray, context: _Context) -> np.ndarray:
    return finish_all[context.position]


def _op_start_s(result: Replay, finish_all: np.ndarray, context: _Context) -> np.ndarray:
    return result.op_end_s - context.op_seconds  # as the slot's finish less its time (kernels' rounding)


def _transfers(result: Replay, finish_all: np.ndarray) -> Transfers:
    """A replay's timed copies as the kernels read them."""
    return Transfers(out_start=result.swap_out_start_s, out_end=result.swap_out_end_s,
                     in_ready=result.swap_in_alloc_s, in_start=result.swap_in_start_s,
                     in_end=result.swap_in_end_s, finish_all=finish_all,
                     out_queue=np.argsort(result.swap_out_start_s, kind="stable"),
                     in_processed=np.argsort(result.swap_in_start_s, kind="stable"))


def _copy_overlap_s(result: Replay, finish_all: np.ndarray, context: _Context) -> float:
    return float(kernels.copy_overlap(_transfers(result, finish_all), context.duration))


ON_DEMAND_FIELDS = {"op_end_s": _op_end_s, "op_start_s": _op_start_s, "copy_overlap_s": _copy_overlap_s}
# set after the dataclass took its fields (and copy_overlap_s's default) from the class body
for _name, _compute in ON_DEMAND_FIELDS.items():
    setattr(Replay, _name, _OnDemand(_name, _compute, getattr(Replay, _name, None)))


def op_seconds(g: OpGraph, device: DeviceModel) -> np.ndarray:
    """Per-op compute time on ``device``, indexed like g's ops: measured on a ``CalibratedDevice`` (which
    refuses another model's graph), else the roofline of FLOPs and bytes touched. The ops of an update moved to
    a host that has its own rate (``DeviceModel.host_update_bytes_per_s``) take none: the host's CPU runs
    them (``simulator.state.host_update.host_cpu_seconds``)."""
    def compute(graph: OpGraph) -> np.ndarray:
        if isinstance(device, CalibratedDevice):
            seconds = np.array(device.graph_op_seconds(graph), dtype=np.float64)
        else:
            seconds = np.asarray(device.op_seconds(graph.op_flops, graph.op_touched_bytes), dtype=np.float64)
        if device.host_update_bytes_per_s > 0:
            seconds[host_update_ops(graph)] = 0.0
        return seconds

    return g.cached(("op_seconds", device), compute, structural=False)


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


def _csr(keys: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of ``keys`` grouped by key (each group in index order), and each key's start: row k
    holds ``by_key[ptr[k]:ptr[k + 1]]``."""
    by_key = np.argsort(keys, kind="stable")
    ptr = np.zeros(n_rows + 1, np.int64)
    np.cumsum(np.bincount(keys, minlength=n_rows), out=ptr[1:])
    return ptr, by_key.astype(np.int64)


def _plan_tables(g: OpGraph) -> ReplayGraphRecord:
    """What ``kernels.replay_plan`` reads of the structure: the buffer analysis with the reads a plan can
    rewire (``buffers.buffer_record``), the forwards a plan makes possible (grouped by root and by read
    id), the fusion tables and each read's fusion-safe wait."""
    def compute(graph: OpGraph) -> ReplayGraphRecord:
        info = buffers(graph)
        tables = rewire_tables(graph)
        max1, max1_tensor, max2 = _other_input_slots(graph)
        late_root_ptr, late_by_root = _csr(info.late_root, graph.n_tensors)
        late_read_ptr, late_by_read = _csr(np.searchsorted(tables.read_keys, info.late_key), len(tables.read_keys))
        # each read's fusion-safe answer as a synchronous swap-in of that read alone (see
        # kernels._replay_safe_waits), in the per-tensor order of the reads
        read_tensor = np.repeat(np.arange(graph.n_tensors), np.diff(tables.tensor_read_ptr))
        nothing = np.full(len(read_tensor), -1, np.int64)
        read_safe_hit, read_safe_slot = safe_wait_slots(graph, read_tensor, nothing, nothing,
                                                        np.arange(len(read_tensor) + 1), tables.tensor_read_consumer)
        return ReplayGraphRecord(
            free_slot=info.free_slot, max1=max1, max1_tensor=max1_tensor, max2=max2, late_slot=info.late_slot,
            late_out=info.late_out, late_root_ptr=late_root_ptr, late_by_root=late_by_root,
            late_read_ptr=late_read_ptr, late_by_read=late_by_read, read_safe_hit=read_safe_hit,
            read_safe_slot=read_safe_slot, buffers=buffer_record(graph), fusion=fusion_record(graph))
    return g.cached("replay_plan_tables", compute, structural=True)


@dataclass(frozen=True)
class _Context:
    """A graph at one batch size on one device, as the replay reads it: ``step`` is what
    ``kernels.replay_plan`` takes beside the plan's arrays."""

    step: StepRecord
    levels_of_slot: np.ndarray
    persistent_bytes: int
    compute_s: float
    position: np.ndarray  # each op's slot
    op_seconds: np.ndarray  # each op's time
    duration: np.ndarray  # each slot's time


def _context(g: OpGraph, device: DeviceModel) -> _Context:
    """The replay's view of ``g`` on ``device``, found by the device object first (a lookup by its value
    hashes its ~20 fields, twice: a microsecond a replay), then by its value."""
    by_object = g.cached("replay_context_by_device_object", lambda graph: {}, structural=False)
    known = by_object.get(id(device))  # (the device, its context): the entry keeps the object, whose id stays its own
    if known is not None and known[0] is device:
        return known[1]

    def compute(graph: OpGraph) -> _Context:
        duration, finish_plain = graph.cached(("slot_times", device), lambda view: _slot_times(view, device),
                                              structural=False)
        levels_of_slot = slot_levels(graph)
        float_bytes = _float_bytes(graph)
        persistent = graph.persistent_bytes
        d2h_seconds = _per_transfer(device.transfer_seconds(float_bytes, "d2h"), graph.n_tensors)
        if graph.meta.get(WEIGHT_READS):  # a weight on the host is there already: its copy out is none
            d2h_seconds = d2h_seconds.copy()
            d2h_seconds[np.asarray(graph.meta[WEIGHT_READS], np.int64)] = 0.0
        h2d_seconds = _per_transfer(device.transfer_seconds(float_bytes, "h2d"), graph.n_tensors)
        step = StepRecord(
            duration=duration, finish_plain=finish_plain,
            # byte figures are whole numbers: the slots' running sums are taken in int64 (exact, as in float64)
            baseline_bytes=baseline_slot_bytes(graph).astype(np.int64), alloc_bytes=alloc_slot_bytes(graph),
            levels_of_slot=levels_of_slot, n_levels=int(levels_of_slot.max(initial=-1)) + 1,
            sorted_levels=graph.order == "cto", persistent=persistent, tensor_bytes=float_bytes,
            int_bytes=np.ascontiguousarray(graph.tensor_bytes, dtype=np.int64),
            d2h_seconds=d2h_seconds, h2d_seconds=h2d_seconds, graph=_plan_tables(graph))
        return _Context(step, levels_of_slot, persistent, float(finish_plain[-1]) if len(finish_plain) else 0.0,
                        position_of(graph), op_seconds(graph, device), duration)
    context = g.cached(("replay_context", device), compute, structural=False)
    by_object[id(device)] = (device, context)
    return context


def replay(g: OpGraph, plan: SwapPlan | None = None, device: DeviceModel | str = "v100-16gb") -> Replay:
    """Simulate one step of ``g`` at its batch size under ``plan`` (None or empty: no swapping); a plan's
    ``host_state`` replays the step with those optimizer slots (and weights) on the host
    (``simulator.state.with_host_state``); a swap of a weight's copy in needs no copy out."""
    if isinstance(device, str):
        device = get_device(device)
    if plan is not None and plan.host_state:  # optimizer slots on the host (simulator.state), their copies after
        moved = with_host_state(g, plan.host_state, copies_in=not device.host_buffers_shared)
        result = replay(moved, dataclasses.replace(plan, host_state=()), device)
        planned = np.intersect1d(triggered_reads(moved), plan.tensor)  # copies in the plan's swap-ins make
        out_bytes, in_bytes = host_transfers(moved, plan.host_state, planned)
        cpu_s = host_cpu_seconds(moved, plan.host_state, device)
        copies_s = host_copy_seconds(moved, plan.host_state, device, planned)
        object.__setattr__(result, "step_s", result.step_s + copies_s + cpu_s)
        object.__setattr__(result, "host_update_s", cpu_s)
        object.__setattr__(result, "stall_s", max(0.0, result.step_s - result.compute_s))
        on_host = np.isin(plan.tensor, np.asarray(moved.meta.get(WEIGHT_READS, ()), np.int64))
        object.__setattr__(result, "d2h_bytes", int(result.d2h_bytes + out_bytes.sum()
                                                    - moved.tensor_bytes[plan.tensor[on_host]].sum()))
        if on_host.any():  # a swapped weight's host copy is the weight itself: no host bytes of its own
            swap_bytes = moved.tensor_bytes[plan.tensor].astype(np.float64)
            swap_bytes[on_host] = 0.0
            transfers = _transfers(result, result.__dict__["_on_demand"][0])
            peak, when = kernels.host_peak(swap_bytes, plan.in_swap, transfers)
            object.__setattr__(result, "host_peak_bytes", int(peak))
            object.__setattr__(result, "host_peak_s", float(when))
        object.__setattr__(result, "h2d_bytes", int(result.h2d_bytes + in_bytes.sum()))
        return result
    if plan is not None and plan.order_name != g.order:
        g = g.with_order(plan.order_name)
    if plan is None or plan.n_swaps == 0:
        return _unswapped(g, device)
    fingerprint = g.cached("fingerprint", OpGraph.fingerprint, structural=True)
    if plan.graph_fingerprint and plan.graph_fingerprint != fingerprint:
        raise GraphError("this plan was made for another graph")
    context = _context(g, device)
    # one compiled call from the plan's arrays to the Replay's (its docstring and kernel_memory.account give the
    # rules); the compute during copies only where the step time depends on it (else read on demand)
    contended = device.copy_contention != 0.0
    out = kernels.replay_plan(context.step, PlanArrays(
        swap_tensor=plan.tensor, sync_out=_waited_copies_out(plan, device), in_swap=plan.in_swap,
        in_trigger=plan.in_trigger, in_after=plan.in_after, in_consumer_ptr=plan.in_consumer_ptr,
        in_consumers=plan.in_consumers, after_copies_out=plan.after_copies_out or device.copies_out_wait), contended)
    # what copies sharing the compute's cores add to the step: DeviceModel.copy_contention x the compute
    # time that overlaps copies (0.0 x it without contention), and copy_overhead_s per copy
    contention_s = (device.copy_contention * out.overlap_s if contended else 0.0) + device.copy_overhead_s * (
        plan.n_swaps + plan.n_swap_ins)
    step_s = float(out.finish_all[-1]) + contention_s
    on_demand = {"copy_overlap_s": out.overlap_s} if contended else {}
    return _filled_replay(
        _on_demand=(out.finish_all, context), **on_demand,
        peak_bytes=int(round(out.peak)) + context.persistent_bytes, host_peak_bytes=int(out.host_peak),
        step_s=step_s, compute_s=context.compute_s, stall_s=max(0.0, step_s - context.compute_s),
        d2h_bytes=int(out.d2h_bytes), h2d_bytes=int(out.h2d_bytes), n_swap_outs=plan.n_swaps,
        n_swap_ins=plan.n_swap_ins, persistent_bytes=context.persistent_bytes,
        peak_level=int(context.levels_of_slot[out.peak_slot]), level_peak_bytes=out.level_peak,
        swap_out_start_s=out.out_start, swap_out_end_s=out.out_end, swap_in_start_s=out.in_start,
        swap_in_end_s=out.in_end, peak_slot=out.peak_slot, swapped_roots=out.roots,
        swapped_root_free_slot=out.root_free_slot, swap_in_alloc_slot=out.in_alloc_slot,
        swap_in_free_slot=out.in_free_slot, in_place_outputs=out.in_place_out, swapped_root_copy_end_s=out.copy_end,
        swap_in_alloc_s=out.in_ready, wait_slots=out.wait_slots, wait_moment_s=out.wait_moment,
        host_peak_s=out.host_peak_s, host_update_s=0.0)


def _waited_copies_out(plan: SwapPlan, device: DeviceModel) -> np.ndarray:
    """Per swap, whether the step waits for its copy out: 1 for the plan's synchronous ones, 2 for every
    other one on a device whose op after the producer waits for the copy (``DeviceModel.copies_out_wait``:
    that wait lands past a fused chain, ``simulator.fusion.in_fused_chain``), 0 for none."""
    waited = plan.sync_out.astype(np.int8)
    return np.where(waited > 0, waited, np.int8(2)) if device.copies_out_wait else waited


def _filled_replay(**fields) -> Replay:
    """``Replay(**fields)`` given every field but those computed on demand (``_OnDemand``, from
    ``_on_demand``), without the frozen dataclass's ``__init__`` (which sets each of 30 fields
    through ``object.__setattr__``: a tenth of a fast replay). Any other field left out is missing,
    not defaulted (tests/simulator/test_golden.py reads every one)."""
    result = object.__new__(Replay)
    object.__setattr__(result, "__dict__", fields)  # (the call's own dict: not copied)
    return result


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


def _level_starts(g: OpGraph) -> np.ndarray:
    """First slot of each level, in the "cto" order (where slots are sorted by level)."""
    def compute(graph: OpGraph) -> np.ndarray:
        levels_of_slot = slot_levels(graph)
        return np.flatnonzero(np.concatenate(([True], levels_of_slot[1:] != levels_of_slot[:-1])))
    return g.cached("level_starts", compute, structural=True)


def _unswapped(g: OpGraph, device: DeviceModel) -> Replay:
    """The Replay of the step without swapping."""
    duration, finish_plain = g.cached(("slot_times", device), lambda graph: _slot_times(graph, device),
                                      structural=False)
    slot_bytes = baseline_slot_bytes(g)
    levels_of_slot = slot_levels(g)
    persistent = g.persistent_bytes
    compute_s = float(finish_plain[-1]) if len(finish_plain) else 0.0
    nothing = np.zeros(0)
    if len(slot_bytes):
        level_starts = _level_starts(g) if g.order == "cto" else np.zeros(0, np.int64)  # cto: slots by level
        peak_slot, level_peak, op_end, op_start = kernels.summarize(
            slot_bytes, levels_of_slot, level_starts, persistent, finish_plain, position_of(g), op_seconds(g, device))
        peak_slot = int(peak_slot)
        peak = int(round(slot_bytes[peak_slot])) + persistent
        peak_level = int(levels_of_slot[peak_slot])
    else:
        level_peak, peak, peak_level, peak_slot = np.zeros(0), persistent, 0, 0
        op_end = op_start = np.empty(0)
    return Replay(
        peak_bytes=peak, host_peak_bytes=0, step_s=compute_s, compute_s=compute_s, stall_s=0.0, d2h_bytes=0,
        h2d_bytes=0, n_swap_outs=0, n_swap_ins=0, persistent_bytes=persistent, peak_level=peak_level,
        level_peak_bytes=level_peak, op_start_s=op_start, op_end_s=op_end, swap_out_start_s=nothing,
        swap_out_end_s=nothing, swap_in_start_s=nothing, swap_in_end_s=nothing, peak_slot=peak_slot)


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
