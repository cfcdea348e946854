"""Accelerator-side peak memory of one tf.function call, from the profiler's memory trace.

Why: on the CPU testbed (``/CPU:0`` = accelerator, ``/CPU:1`` = host) both logical
devices share ONE allocator (``bfc_cpu_allocator_for_gpu``), so
``tf.config.experimental.get_memory_info`` cannot tell accelerator from host bytes.
The profiler's ``MemoryAllocation``/``MemoryDeallocation`` events carry the op name
(``tf_op``), so replaying them while leaving out allocations of host ops (swap-outs)
gives the accelerator-side footprint a swapping plan must fit in.

Set ``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow is imported: only then does the
CPU allocator emit an event for every allocation (otherwise only for >= 256 KiB).

The same trace holds the ops' own events (``op_events``): the step-time calibration
(``rewriter.timing.device_calibration``) reads per-op durations from it, so both readers share one profiling
and parsing path (``profile_call``, ``read_xspace``).
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pandas as pd
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

__all__ = ["MemoryPeak", "record_memory_events", "accelerator_peak", "measure_call_peak", "profile_call",
           "read_xspace", "memory_events", "op_events", "kept_allocations", "constant_bytes"]

_EVENT_KIND = {"MemoryAllocation": "alloc", "MemoryDeallocation": "free"}
COLUMNS = ["time_ps", "kind", "addr", "requested_bytes", "allocation_bytes", "tf_op",
           "region_type", "data_type", "shape", "allocator_name", "bytes_in_use",
           "step_id", "thread"]
# profiler stat name -> DataFrame column
_STAT_COLUMNS = {"addr": "addr", "requested_bytes": "requested_bytes",
                 "allocation_bytes": "allocation_bytes", "tf_op": "tf_op",
                 "region_type": "region_type", "data_type": "data_type", "shape": "shape",
                 "allocator_name": "allocator_name", "bytes_allocated": "bytes_in_use",
                 "id": "step_id"}


def _dtype_name(enum: int) -> str:
    try:
        return tf.dtypes.as_dtype(int(enum)).name if enum else ""
    except (TypeError, ValueError):
        return str(enum)


def read_xspace(path: str):
    """One ``*.xplane.pb`` file as an ``XSpace`` message."""
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def parse_xspace(path: str) -> pd.DataFrame:
    """Memory events of one ``*.xplane.pb`` file as a time-ordered DataFrame."""
    return memory_events(read_xspace(path))


CALL_EVENT = "memtrace_call"  # the profiler event ``profile_call`` wraps each call in


def call_starts_ps(space) -> list[int]:
    """Start times of the calls ``profile_call`` ran (its ``CALL_EVENT`` events), in order."""
    starts = []
    for plane in space.planes:
        ids = {mid for mid, m in plane.event_metadata.items() if m.name == CALL_EVENT}
        for line in plane.lines:
            starts.extend(line.timestamp_ns * 1000 + ev.offset_ps for ev in line.events if ev.metadata_id in ids)
    return sorted(starts)


def memory_events(space) -> pd.DataFrame:
    """Memory events of an ``XSpace`` as a time-ordered DataFrame (columns ``COLUMNS``, and ``call``: the
    index of the ``profile_call`` call running when the event happened, 0 where the trace marks none).
    Read column by column, with each plane's stat names looked up once: a step's trace has hundreds of
    thousands of stats, and every measured run reads one."""
    columns: dict[str, list] = {col: [] for col in COLUMNS}
    time_ps, kinds_read, threads = columns["time_ps"], columns["kind"], columns["thread"]
    stat_columns = [col for col in COLUMNS if col in _STAT_COLUMNS.values()]
    for plane in space.planes:
        kinds = {mid: _EVENT_KIND[m.name] for mid, m in plane.event_metadata.items()
                 if m.name in _EVENT_KIND}
        if not kinds:
            continue
        stat_of = {mid: _STAT_COLUMNS[m.name] for mid, m in plane.stat_metadata.items() if m.name in _STAT_COLUMNS}
        interned = {mid: m.name for mid, m in plane.stat_metadata.items()}
        for line in plane.lines:
            base_ps = line.timestamp_ns * 1000
            thread = line.display_name or line.name
            for ev in line.events:
                kind = kinds.get(ev.metadata_id)
                if kind is None:
                    continue
                time_ps.append(base_ps + ev.offset_ps)
                kinds_read.append(kind)
                threads.append(thread)
                row = dict.fromkeys(stat_columns)
                for st in ev.stats:
                    col = stat_of.get(st.metadata_id)
                    if col:
                        value = st.WhichOneof("value")
                        # ``ref_value`` points at a string interned in stat_metadata
                        row[col] = interned[st.ref_value] if value == "ref_value" else (
                            getattr(st, value) if value else None)
                for col in stat_columns:
                    columns[col].append(row[col])
    df = pd.DataFrame(columns, columns=COLUMNS)
    for col in ("addr", "requested_bytes", "allocation_bytes", "bytes_in_use", "step_id",
                "data_type"):
        df[col] = df[col].fillna(0).astype("int64")
    for col in ("tf_op", "region_type", "shape", "allocator_name", "thread"):
        df[col] = df[col].fillna("").astype(str)
    df["data_type"] = df["data_type"].map(_dtype_name)
    starts = call_starts_ps(space)
    df["call"] = (np.searchsorted(np.asarray(starts, np.int64), df["time_ps"].to_numpy(np.int64), side="right") - 1
                  ).clip(min=0) if starts else 0
    # Allocator events are emitted under the allocator's lock, so timestamps order them;
    # the stable sort keeps per-thread order for (rare) equal timestamps.
    return df.sort_values("time_ps", kind="stable").reset_index(drop=True)


def profile_call(fn: Callable[..., Any], *args: Any, calls: int = 1, logdir: str | None = None):
    """Run ``fn(*args)`` ``calls`` times under the profiler; return the ``XSpace`` it wrote.

    ``fn`` must already be traced and warmed up, otherwise tracing/compilation
    allocations end up in the trace. The results of ``fn`` are kept alive until the
    profiler stops so that freeing them is not part of the trace.
    """
    tmp = logdir is None
    logdir = tempfile.mkdtemp(prefix="memtrace_") if tmp else logdir
    try:
        before = set(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))
        # host_tracer_level 2 (kInfo) is what the allocator's TraceMe needs; no Python tracer.
        opts = tf.profiler.experimental.ProfilerOptions(host_tracer_level=2,
                                                        python_tracer_level=0,
                                                        device_tracer_level=1)
        tf.profiler.experimental.start(logdir, options=opts)
        results = []
        try:
            for _ in range(calls):
                with tf.profiler.experimental.Trace(CALL_EVENT):
                    results.append(fn(*args))
        finally:
            tf.profiler.experimental.stop()
        del results
        new = set(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))
        files = sorted(new - before, key=os.path.getmtime)
        if not files:
            raise RuntimeError(f"profiler wrote no new *.xplane.pb under {logdir}")
        return read_xspace(files[-1])
    finally:
        if tmp:
            shutil.rmtree(logdir, ignore_errors=True)


def record_memory_events(fn: Callable[..., Any], *args: Any, calls: int = 1,
                         logdir: str | None = None) -> pd.DataFrame:
    """Run ``fn(*args)`` ``calls`` times under the profiler and return its allocator events (see
    ``profile_call``; column ``call`` tells the calls apart)."""
    return memory_events(profile_call(fn, *args, calls=calls, logdir=logdir))


CONSTANT_FOLDED = "__cf__"  # in the names of the constants TensorFlow's runtime constant folding makes


def kept_allocations(events: pd.DataFrame) -> pd.DataFrame:
    """The allocations a traced call did not free (columns ``tf_op``, ``requested_bytes``,
    ``allocator_name``); an address is one allocation per allocator (a GPU's and the pinned host's
    allocators can hand out equal addresses)."""
    allocators = events["allocator_name"] if "allocator_name" in events else pd.Series("", index=events.index)
    live: dict[tuple[str, int], tuple[str, int, str]] = {}
    for kind, addr, op, requested, allocator in zip(events["kind"], events["addr"], events["tf_op"],
                                                    events["requested_bytes"], allocators):
        if kind == "alloc":
            live[(allocator, addr)] = (op, requested, allocator)
        else:
            live.pop((allocator, addr), None)
    return pd.DataFrame(list(live.values()), columns=["tf_op", "requested_bytes", "allocator_name"])


def constant_bytes(events: pd.DataFrame, constant_ops: set[str], allocator_prefix: str | None = None) -> int:
    """Bytes of the constants a function's first call materialised and keeps: the allocations it did
    not free made by a ``Const`` node of the graph that ran (``constant_ops``: Grappler's folded
    constants keep the folded op's name) or by TensorFlow's runtime constant folding (``__cf__`` in the
    name, made after the graph is partitioned). Its kernels hold them from then on, outside any later
    call's trace and outside the step's variables, though they take device memory (a 48x48 image
    loss's mean-gradient tile: 108 KiB). Not every kept allocation is one: a variable whose update
    replaced its buffer while something still held the old one keeps the new one too.
    ``allocator_prefix`` (``Placement.allocator_prefix``): only the accelerator's allocator counts (a
    GPU's host-side constants take no device memory)."""
    kept = kept_allocations(events)
    if allocator_prefix is not None:
        kept = kept[kept["allocator_name"].str.upper().str.startswith(allocator_prefix)]
    is_constant = kept["tf_op"].isin(constant_ops) | kept["tf_op"].str.contains(CONSTANT_FOLDED, regex=False)
    return int(kept.loc[is_constant, "requested_bytes"].sum())


def event_owners(events: pd.DataFrame, owner_of: Callable[[str], int]) -> pd.Series:
    """Each event's owner (a replica of a replicated step, ``rewriter.step.replicated``): an allocation's by its
    op, a free's by the allocation it frees (a free's own op is whichever released the last reference, often the
    runtime's or another device's), by its op when the allocation came before the trace."""
    found, by_address = [], {}
    for kind, addr, name in zip(events["kind"], events["addr"], events["tf_op"]):
        mine = owner_of(str(name))
        if kind == "alloc":
            by_address[addr] = mine
        else:
            mine = by_address.pop(addr, mine)
        found.append(mine)
    return pd.Series(found, index=events.index, dtype="int64")


OP_EVENT_COLUMNS = ["op", "type", "start_ps", "duration_ps", "thread"]
# events on the compute threads that are not ops: the executor's wrappers span many ops
_WRAPPER_PREFIXES = ("ExecutorState::", "ThreadpoolListener::")


def op_events(space, *, plane_name: str = "/host:CPU", line_prefix: str = "tf_Compute") -> pd.DataFrame:
    """Kernel events of an ``XSpace``: one row per op execution (op name, op type, start, duration).

    TF 2.21 on CPU names each kernel's event ``node:type`` on the ``/host:CPU`` plane's
    ``tf_Compute/*`` lines; the executor's ``ExecutorState::Process``/``ProcessAsync`` wrappers
    (which span the step) and the thread pool's markers are left out. Fused kernels report under
    the fusion's last op; cheap ops (Reshape, Squeeze) emit none.
    """
    rows = []
    for plane in space.planes:
        if plane.name != plane_name:
            continue
        names = {}
        for mid, meta in plane.event_metadata.items():
            name = meta.name
            if name.startswith(_WRAPPER_PREFIXES) or ":" not in name:
                continue
            op, kind = name.rsplit(":", 1)
            if op and kind and not kind.startswith(":"):
                names[mid] = (op, kind)
        for line in plane.lines:
            if not line.name.startswith(line_prefix):
                continue
            base_ps = line.timestamp_ns * 1000
            thread = line.display_name or line.name
            for ev in line.events:
                found = names.get(ev.metadata_id)
                if found is not None:
                    rows.append((found[0], found[1], base_ps + ev.offset_ps, ev.duration_ps, thread))
    return pd.DataFrame(rows, columns=OP_EVENT_COLUMNS).sort_values("start_ps", kind="stable").reset_index(drop=True)


@dataclass(frozen=True)
class MemoryPeak:
    """Peak footprint of one call. Accelerator peaks INCLUDE ``resident_bytes``.

    Both peaks count the resident part in the unit ``resident_bytes`` was given in (allocator
    chunk bytes from ``get_memory_info``, or requested bytes of the step's own state): only the
    trace's own allocations are known in both units, so ``peak_allocated_bytes >= peak_requested_bytes``.
    """

    peak_requested_bytes: int       # resident + max live accelerator bytes (requested sizes)
    peak_allocated_bytes: int       # resident + max live accelerator bytes (BFC chunk sizes)
    host_peak_requested_bytes: int  # max live bytes allocated by host ops (trace only)
    resident_bytes: int             # in use before the call (weights, slots, inputs)
    untracked_free_bytes: int = 0   # chunk bytes freed in the trace but allocated before it
    peak_time_ps: int = 0           # time of the (chunk-size) accelerator peak, 0 = at start
    peak_op: str = ""               # tf_op of the allocation that reached that peak


def accelerator_peak(events: pd.DataFrame, *, is_host_op: Callable[[str], bool],
                     resident_bytes: int = 0, resident_unit: str = "chunks", untracked_frees: str = "subtract",
                     allocator: str | None = None, previous: pd.DataFrame | None = None) -> MemoryPeak:
    """Replay ``events`` in time order, leaving out host-op allocations and their frees.

    A free of an address not allocated inside the trace releases memory that existed
    before the call: on a warmed-up Keras step these are variable buffers replaced by
    copy-on-write ``assign_sub`` or by ``AssignVariableOp`` (BatchNorm moving stats),
    i.e. part of ``resident_bytes``. With ``untracked_frees="subtract"`` (default) they
    reduce the resident part, clamped at zero, by their size in ``resident_unit`` ("chunks":
    allocator chunk bytes, as ``get_memory_info`` counts; "requested": tensor bytes). That reproduces the allocator's own
    ``bytes_in_use`` exactly when ``resident_bytes`` is the allocator's ``current`` and
    there are no host ops, and it stays an upper bound with host ops: resident counts
    every pre-existing byte as accelerator-side, so subtracting a pre-existing host
    buffer only removes an over-count. ``"ignore"`` (the naive rule) never subtracts
    and over-estimates the peak by the pre-existing memory freed before it (20-37 MiB,
    2-4 % on ResNet-50 batch 8). ``allocator`` restricts the replay to one allocator
    (useful on a real GPU; on the CPU testbed both devices share one). ``previous``: the events of the call
    before, of the same step: the buffers its host ops kept past it (a weight on the host replaced by its
    update's copy-on-write) are the host's, so their frees here leave the accelerator's resident part alone;
    freed before the peak they would otherwise lower it by a whole weight (the MLP's 4 MiB kernels,
    tests/rewriter/state/test_host_weights.py).
    """
    if untracked_frees not in ("subtract", "ignore"):
        raise ValueError(f"untracked_frees must be 'subtract' or 'ignore', not {untracked_frees!r}")
    if resident_unit not in ("chunks", "requested"):
        raise ValueError(f"resident_unit must be 'chunks' or 'requested', not {resident_unit!r}")
    if allocator is not None:
        events = events[events["allocator_name"] == allocator]
    hosts_kept = _kept_host_addresses(previous, is_host_op) if previous is not None else set()
    live: dict[int, tuple[int, int, bool]] = {}  # addr -> (requested, allocated, host)
    base = resident_bytes  # resident bytes not yet freed inside the trace, in resident_unit
    req = alloc = host = untracked = 0
    peak_req = peak_alloc = base
    peak_host, peak_time, peak_op = 0, 0, ""
    cols = events[["kind", "addr", "requested_bytes", "allocation_bytes", "tf_op", "time_ps"]]
    for kind, addr, r, a, op, t in cols.itertuples(index=False, name=None):
        if kind == "alloc":
            old = live.pop(addr, None)  # a lost free (not seen on TF 2.21): drop stale entry
            if old is not None:
                req, alloc, host = _sub(req, alloc, host, old)
            on_host = bool(is_host_op(op))
            live[addr] = (r, a, on_host)
            if on_host:
                host += r
                peak_host = max(peak_host, host)
            else:
                req += r
                alloc += a
                peak_req = max(peak_req, base + req)
                if base + alloc > peak_alloc:
                    peak_alloc, peak_time, peak_op = base + alloc, int(t), op
        else:
            old = live.pop(addr, None)
            if old is not None:
                req, alloc, host = _sub(req, alloc, host, old)
            elif addr in hosts_kept:
                hosts_kept.discard(addr)
            else:
                untracked += a
                if untracked_frees == "subtract":
                    base = max(0, base - (a if resident_unit == "chunks" else r))
    return MemoryPeak(peak_requested_bytes=peak_req, peak_allocated_bytes=peak_alloc,
                      host_peak_requested_bytes=peak_host, resident_bytes=resident_bytes,
                      untracked_free_bytes=untracked, peak_time_ps=peak_time, peak_op=peak_op)


def _kept_host_addresses(events: pd.DataFrame, is_host_op: Callable[[str], bool]) -> set[int]:
    """Addresses of the allocations host ops made in ``events`` and did not free there."""
    kept: dict[int, bool] = {}
    for kind, addr, op in zip(events["kind"], events["addr"], events["tf_op"]):
        if kind == "alloc":
            kept[addr] = bool(is_host_op(op))
        else:
            kept.pop(addr, None)
    return {addr for addr, on_host in kept.items() if on_host}


def _sub(req: int, alloc: int, host: int, entry: tuple[int, int, bool]) -> tuple[int, int, int]:
    r, a, on_host = entry
    return (req, alloc, host - r) if on_host else (req - r, alloc - a, host)


def measure_call_peak(fn: Callable[..., Any], *args: Any,
                      is_host_op: Callable[[str], bool] = lambda name: False,
                      device: str = "CPU:0") -> MemoryPeak:
    """Profile one call of a warmed-up ``fn`` and return its accelerator-side peak.

    ``resident_bytes`` is the allocator's ``current`` (chunk bytes) just before the call;
    on the CPU testbed it covers both logical devices, so anything left on the host
    between steps is counted as accelerator-resident (conservative).
    """
    resident = int(tf.config.experimental.get_memory_info(device)["current"])
    events = record_memory_events(fn, *args)
    return accelerator_peak(events, is_host_op=is_host_op, resident_bytes=resident)
