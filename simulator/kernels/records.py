"""The named records the compiled kernels take (``plan_loops``, ``memory``, ``events``) instead
of long argument lists.

Tables built once per graph, batch size or device are numba StructRefs (``_Record``): a call passes
one as a single pointer (50 arrays: 0.5 us a call as a StructRef, 2.9 us as 50 arguments, 5.8 us as a
namedtuple, which numba types field by field in Python), and a kernel taking one still loads from
numba's on-disk cache (the record types live in this importable module). Records made per call or
inside the kernels are namedtuples (free in compiled code; a plan's arrays as a namedtuple cost about
a microsecond a call to type, a StructRef about two to build).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit, types
from numba.experimental import structref


class _Record(structref.StructRefProxy):
    """A record of named arrays and numbers for the kernels, built in Python by name
    (``Record(**fields)``, exactly its ``FIELDS``) through a cached compiled constructor. Its fields
    are read in compiled code only: reading one from Python compiles a getter."""

    FIELDS: tuple[str, ...] = ()

    def __new__(cls, **fields):
        if fields.keys() != set(cls.FIELDS):
            apart = sorted(fields.keys() ^ set(cls.FIELDS))
            raise TypeError(f"{cls.__name__} takes exactly its fields, got {apart} apart")
        # contiguous arrays: one compiled type per record, whatever view of an array a table is
        return cls._build(*(np.ascontiguousarray(value) if isinstance(value, np.ndarray) else value
                            for value in (fields[name] for name in cls.FIELDS)))

    @staticmethod
    def _build(*values):
        raise NotImplementedError


class _RecordType(types.StructRef):
    """A record's numba type: its fields' types as given (literals widened)."""

    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(typ)) for name, typ in fields)


# ----------------------------------------------------------------------------------------- buffers


@structref.register
class BufferRecordType(_RecordType):
    pass


class BufferRecord(_Record):
    """A graph's buffers in one execution order, as the compiled lifetimes read them: each op's slot
    (``position``) and the op at each slot (``order``), each tensor's producer and root buffer, and
    ``buffers.RewireTables`` (without ``read_keys``; ``n_keys`` of them)."""

    FIELDS = ("position", "order", "tensor_producer", "root", "tensor_read_ptr", "tensor_read_consumer",
              "tensor_read_id", "seg_use_ptr", "seg_use_slot", "seg_use_id", "seg_ptr", "seg_link_id",
              "seg_link_key", "seg_parent", "tensor_segment", "n_keys")


structref.define_proxy(BufferRecord, BufferRecordType, BufferRecord.FIELDS)


@njit(cache=True, nogil=True)
def _new_buffer_record(*values):
    return BufferRecord(*values)


BufferRecord._build = staticmethod(_new_buffer_record)


# ------------------------------------------------------------------------------------------ fusion


@structref.register
class FusionRecordType(_RecordType):
    pass


class FusionRecord(_Record):
    """``fusion.FusionTables`` (which documents the fields) for the compiled fusion-safe waits, with each
    op's slot and each tensor's producer."""

    FIELDS = ("position", "tensor_producer", "has_danger", "endangered", "danger_ptr", "danger_ops", "source_ptr",
              "source_ops", "input_ptr", "input_tensor", "input_source", "control_ptr", "control_ops", "wait_operand")


structref.define_proxy(FusionRecord, FusionRecordType, FusionRecord.FIELDS)


@njit(cache=True, nogil=True)
def _new_fusion_record(*values):
    return FusionRecord(*values)


FusionRecord._build = staticmethod(_new_fusion_record)


# ---------------------------------------------------------------------------------------- planning


@structref.register
class PlanningRecordType(_RecordType):
    pass


class PlanningRecord(_Record):
    """What the swap rules read of a graph view (``planning.plan_swaps``): its edges by tensor, then
    their consumer's slot (``edge_order``), each edge's tensor and consumer, each op's level as the
    rules measure distance (``levels``), its ``buffers``, its categorized level (``op_level``), and the lowest
    categorized level and earliest slot of its sibling partners (``merge_level``, ``merge_position``:
    ``planning.sibling_bounds``), and the latest slot of the node it may be merged into (``merge_end``:
    ``planning.merge_end_positions``)."""

    FIELDS = ("edge_order", "edge_tensor", "edge_consumer", "levels", "buffers", "op_level", "merge_level",
              "merge_position", "merge_end")


structref.define_proxy(PlanningRecord, PlanningRecordType, PlanningRecord.FIELDS)


@njit(cache=True, nogil=True)
def _new_planning_record(*values):
    return PlanningRecord(*values)


PlanningRecord._build = staticmethod(_new_planning_record)


@structref.register
class TriggerRecordType(_RecordType):
    pass


class TriggerRecord(_Record):
    """How the swap rules pick triggers: ``mode`` 0 none (synchronous swap-ins), 1 by level
    (``latest_*``: per level the latest level at or below it holding a trigger candidate, and that
    op), 2 among the first consumer's ancestors (``ancestor_*`` and ``span``: the table of
    ``planning._ancestor_triggers``); the tables a mode does not read are placeholders."""

    FIELDS = ("mode", "latest_level", "latest_op", "ancestor_ptr", "ancestor_ops", "ancestor_levels",
              "ancestor_key", "span")


structref.define_proxy(TriggerRecord, TriggerRecordType, TriggerRecord.FIELDS)


@njit(cache=True, nogil=True)
def _new_trigger_record(*values):
    return TriggerRecord(*values)


TriggerRecord._build = staticmethod(_new_trigger_record)


# ------------------------------------------------------------------------------------------ replay


@structref.register
class ReplayGraphRecordType(_RecordType):
    pass


class ReplayGraphRecord(_Record):
    """What the replay reads of a graph's structure in one order (``replay._plan_tables``): each root
    buffer's free slot, each op's latest input slots (``replay._other_input_slots``), the forwards a
    plan makes possible (``buffers.Buffers.late_*``, grouped by root and by read id), each read's
    fusion-safe wait as a synchronous swap-in of it alone, and the ``buffers`` and ``fusion``
    records."""

    FIELDS = ("free_slot", "max1", "max1_tensor", "max2", "late_slot", "late_out", "late_root_ptr", "late_by_root",
              "late_read_ptr", "late_by_read", "read_safe_hit", "read_safe_slot", "buffers", "fusion")


structref.define_proxy(ReplayGraphRecord, ReplayGraphRecordType, ReplayGraphRecord.FIELDS)


@njit(cache=True, nogil=True)
def _new_replay_graph_record(*values):
    return ReplayGraphRecord(*values)


ReplayGraphRecord._build = staticmethod(_new_replay_graph_record)


@structref.register
class StepRecordType(_RecordType):
    pass


class StepRecord(_Record):
    """A graph at one batch size on one device, as the replay reads it (``replay._context``): each slot's
    time, finish without stalls, unswapped bytes and allocations, and level (``n_levels``;
    ``sorted_levels``: slots sorted by level, the "cto" order); the resident bytes; each tensor's
    bytes (float64 and int64) and copy times each way; and the structure (``graph``)."""

    FIELDS = ("duration", "finish_plain", "baseline_bytes", "alloc_bytes", "levels_of_slot", "n_levels",
              "sorted_levels", "persistent", "tensor_bytes", "int_bytes", "d2h_seconds", "h2d_seconds", "graph")


structref.define_proxy(StepRecord, StepRecordType, StepRecord.FIELDS)


@njit(cache=True, nogil=True)
def _new_step_record(*values):
    return StepRecord(*values)


StepRecord._build = staticmethod(_new_step_record)


# ------------------------------------------------------------------- per call and inside the kernels

# a plan's arrays as the replay reads them (``planning.SwapPlan``'s, ``sync_out`` as the device waits)
PlanArrays = namedtuple("PlanArrays", ["swap_tensor", "sync_out", "in_swap", "in_trigger", "in_after",
                                       "in_consumer_ptr", "in_consumers", "after_copies_out"])

# the plan's far reads (each swap-in's consumers in turn): each one's tensor, read id and place among
# the graph's reads (-1: none), which read ids they rewire, and each swap-in's tensor
FarReads = namedtuple("FarReads", ["tensor", "ids", "edge", "rewired", "in_tensor"])

# a plan in slot terms (``plan_loops.prepare``)
SlotPlan = namedtuple("SlotPlan", ["out_ready", "need", "trigger", "copies", "roots", "swap_root"])

# the swapped buffers' lifetimes once reads are rewired (``plan_loops._lifetimes``)
Lifetimes = namedtuple("Lifetimes", ["root_last", "cut_links", "cut_ids", "cut_last", "home_link", "home_ids"])

# the copies out ``events.schedule`` times as it goes (those ready after the first waiting slot), in
# queue order: each one's swap, ready slot, duration and start; the next one and its slot's stall
# segment (``cursor``), and when the d2h engine is free (``d2h_free[0]``)
LateCopies = namedtuple("LateCopies", ["queue", "slot", "duration", "start", "cursor", "d2h_free"])

# the timed transfers (``events.schedule``)
Transfers = namedtuple("Transfers", ["out_start", "out_end", "in_ready", "in_start", "in_end", "finish_all",
                                     "out_queue", "in_processed"])

# device memory once transfers are timed (``memory.account``)
Memory = namedtuple("Memory", ["peak_slot", "peak", "level_peak", "new_free", "copy_end", "in_alloc_slot",
                               "in_free_slot", "in_place_out", "wait_slots", "wait_moment", "host_peak",
                               "host_peak_s"])

# when each swapped root buffer is freed (``last_slot``: the later of its last reader's slot and its
# copies out's), the slot its copies out end in and when (``memory.account``)
RootFrees = namedtuple("RootFrees", ["last_slot", "copy_slot", "copy_end"])

# one replay's arrays and figures (``plan_loops.replay_plan``), the fields of a Replay
ReplayArrays = namedtuple("ReplayArrays", ["peak_slot", "peak", "level_peak", "finish_all", "out_start", "out_end",
                                           "in_start", "in_end", "in_ready", "roots", "root_free_slot",
                                           "in_alloc_slot", "in_free_slot", "in_place_out", "copy_end",
                                           "wait_slots", "wait_moment", "host_peak", "host_peak_s", "d2h_bytes",
                                           "h2d_bytes", "overlap_s"])
