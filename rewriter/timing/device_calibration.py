"""Step time you can trust: a device model calibrated from the user's own hardware (docs/design.md 4).

``calibrate(model, batch_sizes=(2, 4))`` runs the model's unswapped training step (the step
``rewriter.step.apply_plan`` builds for an empty plan, serialized as every plan is: one compute stream) at
each batch size and

* profiles it and takes each op's time from the kernel events (``memtrace.op_events``), the
  minimum over the profiled steps; the profiler adds 6-16 % and cheap or fused ops emit no event,
  so only each op's *share* of the profiled step is kept;
* times it unprofiled (``timed_passes``: interleaved passes, the machine's slowdowns left out) and
  scales the shares to that time; each op's time is then fitted as ``a + b * batch``, as tensor
  sizes are;
* times chains of copies between the placement's accelerator and host (CPU:0 <-> CPU:1 on the
  testbed, GPU <-> CPU on a GPU) for the link's bandwidth and per-copy latency;
* times two swapped steps at the largest calibration batch in the same passes, one whose copies
  mostly run beside compute and one that mostly waits for them, and fits what copies cost a real
  step beyond the replay (``fit_copies``): their contention with compute
  (``DeviceModel.copy_contention``: seconds lost per second of compute beside a copy, as copies
  share the testbed's two cores; a copy the step waits for runs alone) and a fixed cost per copy
  (``copy_overhead_s``: the executor's cross-device hand-off; the swapped steps of mobilenetv2 and
  unet2d ran 12-26 us per copy longer than replayed, with 2 us per chained copy). The link's speed
  itself stays the chained copies' (fitted too, it followed the timing noise: 0.3x-1.4x of it).
  Where copies wait for a compute thread (the testbed, ``Placement.copies_wait_for_compute``) the op
  after a swapped tensor's producer waits for its copy out (``rewriter.edit.graph_edit``): the result's
  ``copies_out_wait`` makes the replay wait there too, and the fit sees steps replayed so. In the
  quiet run of 10:05 without it, the plans without sync and with the most swaps (T1, T2) were
  replayed 3-6 % of their step further below their measurement than the same model's sync-out plan
  in 7 of 8 cases (re-anchored errors, benchmarks/results/step_time.md of that run).

The result, a ``simulator.CalibratedDevice``, serves every batch size of a graph captured from
the same model: ``simulator.replay(g, plan, calibrated)`` and ``autotune`` take it as their device.
``CalibrationError`` (bad input, exit 2 in the CLI): the model does not run at a calibration batch
size, or a calibration is used on another model's graph (``CalibrationMismatchError``).

``timed_passes`` is the timing routine both the calibration and ``benchmarks/step_time.py`` use, so
that predictions and measurements are taken the same way.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import tensorflow as tf

from rewriter.placement import memtrace
from rewriter.timing.built_steps import block, build_step, first_line, unswapped_step, warm_up
from rewriter.trace.tracing import NO_STEP_INPUTS, CaptureError, StepInputs, capture
from rewriter.placement.placements import GpuPlacement, Placement, resolve as resolve_placement
from simulator.device.calibrated import CalibratedDevice, CalibrationError
from simulator.device.presets import DeviceModel, get_device
from simulator.graph import OpGraph
from simulator.planning import SwapParams, SwapPlan, plan_swaps
from simulator.replay import Replay, replay

log = logging.getLogger(__name__)

__all__ = ["CalibrationError", "LinkFit", "PassTimes", "PresetFigures", "calibrate", "fit_copies", "measure_link",
           "measure_preset", "pass_times", "profiled_op_seconds", "timed_passes"]

# the preset a GPU without one of its own is modelled on (autotune.run.tuning.DEFAULT_DEVICE)
FALLBACK_PRESET = "v100-16gb"
# the swapped steps the copies' contention with compute is fitted on (at the largest calibration batch):
# one whose copies mostly run beside compute, one that mostly waits for them
OVERLAP_PARAMS = SwapParams(threshold=2)
STALL_PARAMS = SwapParams(threshold=1, ub=1, trigger="level", tensors="all", distance="slot")
# a fitted contention above this is the timing's noise, not the copies': on two cores a copy can at
# most take the cores a compute kernel had for its own duration, and a little more where copies and
# kernels compete for memory bandwidth
MAX_CONTENTION = 1.5
# copy sizes the link is timed at (bytes): the range of a small model's activations
LINK_SIZES_BYTES = (4, 2**16, 2**20, 2**22, 2**24)


# ---------------------------------------------------------------------- timing with rejection


@dataclass(frozen=True)
class PassTimes:
    """Step times of several callables, measured in interleaved passes.

    ``pass_medians[key]``: each pass's median step time; ``accepted[key]``: per pass, whether its
    median is within the tolerance of the key's fastest (slower passes are the machine's slowdowns,
    not the step's); ``step_s[key]``: the median of the accepted pass medians; ``all_s[key]``: every
    step of the accepted passes; ``consistent``: whether every key had ``min_passes`` accepted
    passes; ``pass_speed``: per pass, the median over keys of its median over the key's fastest
    (1.0: the machine as fast as it gets), to say how disturbed the timing was; ``cpu_s[key]``: the
    process's CPU time per step (all its threads), the median of the accepted passes' medians: other
    processes that take the cores away do not count in it, so it tells the step's own cost from the
    machine's load (with several busy processes per core the interquartile range of one step's CPU times was 2-4x narrower than
    that of its wall times)."""

    step_s: dict[Any, float]
    all_s: dict[Any, list[float]]
    pass_medians: dict[Any, list[float]]
    accepted: dict[Any, list[bool]]
    pass_speed: list[float]
    consistent: bool
    seconds: float = 0.0
    cpu_s: dict[Any, float] = field(default_factory=dict)

    def spread(self, key) -> float:
        """Range over median of ``key``'s accepted pass medians (0 with one pass)."""
        kept = [m for m, ok in zip(self.pass_medians[key], self.accepted[key]) if ok]
        return (max(kept) - min(kept)) / statistics.median(kept) if len(kept) > 1 else 0.0

    def slowdown(self) -> float:
        """How disturbed the machine was: the median pass's slowdown, less 1."""
        return statistics.median(self.pass_speed) - 1.0

    @property
    def n_passes(self) -> int:
        return len(self.pass_speed)

    @property
    def n_accepted(self) -> int:
        """The fewest accepted passes of any key."""
        return min((sum(ok) for ok in self.accepted.values()), default=0)


def timed_passes(calls: dict[Any, Callable[[], Any]], *, steps_per_pass: int = 1, min_pass_s: float = 0.05,
                 min_passes: int = 6, max_passes: int = 40, tolerance: float = 0.05, min_total_s: float = 0.0,
                 max_total_s: float | None = None, between: Callable[[], None] | None = None) -> PassTimes:
    """Time every callable of ``calls`` (key -> call of one step; warmed up) in interleaved passes,
    each running every key for ``steps_per_pass`` steps or ``min_pass_s`` seconds, whichever is more.

    This machine has slowdown episodes of 1.3-2.2x lasting seconds, other processes only ever slow
    a step down, and not every step alike (a larger working set suffers more): a key's time is the
    median of its pass medians within ``tolerance`` of its fastest (its undisturbed time), and passes
    go on until every key has ``min_passes`` of them and ``min_total_s`` have passed, ``max_passes``
    at most, none starting after ``max_total_s`` (``consistent`` is False when that was not enough: each
    key's ``min_passes`` fastest passes, or all it has, are then used). ``between`` runs after each pass."""
    if steps_per_pass < 1 or min_passes < 1 or max_passes < min_passes:
        raise ValueError("steps_per_pass and min_passes must be >= 1, max_passes >= min_passes")
    steps: dict[Any, list[list[float]]] = {key: [] for key in calls}
    cpu: dict[Any, list[list[float]]] = {key: [] for key in calls}
    count = dict.fromkeys(calls, steps_per_pass)
    started = time.perf_counter()
    for p in range(max_passes):
        for key, call in calls.items():
            times, cpu_times = [], []
            for _ in range(count[key]):
                cpu_start, start = time.process_time(), time.perf_counter()
                block(call())
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - cpu_start)
            steps[key].append(times)
            cpu[key].append(cpu_times)
            if p == 0:  # short steps: more of them per pass, so a pass is not one scheduler tick
                count[key] = max(steps_per_pass, int(np.ceil(min_pass_s / max(min(times), 1e-6))))
        if between is not None:
            between()
        elapsed_s = time.perf_counter() - started
        if (min(sum(ok) for ok in _accepted(steps, tolerance).values()) >= min_passes and elapsed_s >= min_total_s
                or max_total_s is not None and elapsed_s >= max_total_s):
            break
    times = pass_times(steps, tolerance=tolerance, min_passes=min_passes, cpu=cpu)
    if not times.consistent:
        log.warning("timing: fewer than %d passes within %.0f %% of the fastest (the machine was busy): using the "
                    "%d fastest", min_passes, 100 * tolerance, min_passes)
    return replace(times, seconds=time.perf_counter() - started)


def pass_times(steps: dict[Any, list[list[float]]], *, tolerance: float = 0.05, min_passes: int = 6,
               cpu: dict[Any, list[list[float]]] | None = None) -> PassTimes:
    """``timed_passes``' estimate from the step times it measured (``steps[key][pass]``: seconds; ``cpu``:
    the same steps' CPU times)."""
    accepted = _accepted(steps, tolerance)
    consistent = min(sum(ok) for ok in accepted.values()) >= min_passes
    pass_medians = {key: [statistics.median(t) for t in runs] for key, runs in steps.items()}
    if not consistent:
        for key, medians in pass_medians.items():
            cut = sorted(medians)[min(min_passes, len(medians)) - 1]
            accepted[key] = [m <= cut for m in medians]

    def accepted_median(times: dict[Any, list[list[float]]]) -> dict[Any, float]:
        """Per key, the median of the accepted passes' medians (wall or CPU times alike)."""
        return {key: float(statistics.median([statistics.median(t) for t, ok in zip(runs, accepted[key]) if ok]))
                for key, runs in times.items()}

    step_s = accepted_median(steps)
    kept = {key: [s for runs, ok in zip(steps[key], accepted[key]) if ok for s in runs] for key in steps}
    cpu_s = accepted_median(cpu or {})
    return PassTimes(step_s=step_s, all_s=kept, pass_medians=pass_medians, accepted=accepted,
                     pass_speed=_pass_speed(steps), consistent=consistent, cpu_s=cpu_s)


def _accepted(steps: dict[Any, list[list[float]]], tolerance: float) -> dict[Any, list[bool]]:
    """Per key and pass: whether the pass median is within ``tolerance`` of the key's fastest."""
    accepted = {}
    for key, runs in steps.items():
        medians = [statistics.median(t) for t in runs]
        best = min(medians)
        accepted[key] = [m <= best * (1 + tolerance) for m in medians]
    return accepted


def _pass_speed(steps: dict[Any, list[list[float]]]) -> list[float]:
    """Per pass: the median over keys of its median step over the key's fastest pass median."""
    ratios = []
    for runs in steps.values():
        medians = np.array([statistics.median(t) for t in runs])
        ratios.append(medians / medians.min())
    return [float(f) for f in np.median(np.array(ratios), axis=0)]


# ---------------------------------------------------------------------- per-op times


def profiled_op_seconds(call: Callable[[], Any], *, steps: int = 3, sessions: int = 2,
                        placement: Placement | None = None) -> pd.Series:
    """Each op's time (seconds, by op name) in the profiled step: the minimum over ``steps`` calls
    in each of ``sessions`` profiler sessions (a disturbed step only raises what the minimum drops).
    On a GPU, the kernels' times on ``/device:GPU:0`` summed per op and step (``_gpu_op_seconds``)."""
    best: pd.Series | None = None
    for _ in range(sessions):
        space = memtrace.profile_call(call, calls=steps)
        if isinstance(placement, GpuPlacement):
            per_op = _gpu_op_seconds(space, steps)
        else:
            events = memtrace.op_events(space)
            per_op = events.groupby("op")["duration_ps"].min() * 1e-12
        best = per_op if best is None else pd.concat([best, per_op], axis=1).min(axis=1)
    return best if best is not None else pd.Series(dtype=float)


def _gpu_op_seconds(space, steps: int) -> pd.Series:
    """Kernel time per op on a GPU: kernel events on the ``/device:GPU:0`` plane name their op in the
    ``tf_op`` stat or in the launch's ``kernel_annotation`` (``...::node:type``); an op's kernels are
    summed and divided by the steps profiled. Kept thin and untested here (no GPU on this machine)."""
    rows = []
    for plane in space.planes:
        if not plane.name.startswith("/device:GPU:0"):
            continue
        wanted = {mid for mid, m in plane.stat_metadata.items() if m.name in ("tf_op", "kernel_annotation")}
        for line in plane.lines:
            for ev in line.events:
                for stat in ev.stats:
                    if stat.metadata_id in wanted:
                        value = (plane.stat_metadata[stat.ref_value].name if stat.WhichOneof("value") == "ref_value"
                                 else stat.str_value)
                        rows.append((value.rsplit("::", 1)[-1].rsplit(":", 1)[0], ev.duration_ps))
                        break
    table = pd.DataFrame(rows, columns=["op", "duration_ps"])
    return table.groupby("op")["duration_ps"].sum() * 1e-12 / max(steps, 1)


def _fit_lines(batch_sizes: Sequence[int], values: np.ndarray) -> np.ndarray:
    """Least-squares (a, b) of ``values[:, k] = a + b * batch_sizes[k]`` per row."""
    x = np.asarray(batch_sizes, dtype=np.float64)
    design = np.stack([np.ones_like(x), x], axis=1)
    coefficients, *_ = np.linalg.lstsq(design, values.T, rcond=None)
    return coefficients.T


# ---------------------------------------------------------------------- the link


@dataclass(frozen=True)
class LinkFit:
    """Copy time ``latency_s + bytes / bytes_per_s`` between the accelerator and the host, from the
    marginal time per copy in chains of copies (``per_copy_s`` per size in ``sizes_bytes``)."""

    bytes_per_s: float
    latency_s: float
    sizes_bytes: tuple[int, ...]
    per_copy_s: tuple[float, ...]


def measure_link(placement: Placement, *, sizes_bytes: Sequence[int] = LINK_SIZES_BYTES, chain: int = 32,
                 repeats: int = 7) -> LinkFit:
    """Time chains of copies ping-ponged between ``placement.accelerator`` and ``placement.host`` with
    the placement's swap op (DeepCopy on the testbed, Identity across a GPU's link): the time of a
    chain of ``chain`` copies minus one of ``chain // 4``, per extra copy, is one copy's cost (the
    call's own overhead cancels). Minimum over ``repeats``; bandwidth and latency by a least-squares
    fit in relative terms, so small and large copies count alike."""
    copy = tf.raw_ops.DeepCopy if placement.swap_op == "DeepCopy" else tf.identity
    short = max(1, chain // 4)

    def chain_of(n: int):
        @tf.function(autograph=False)
        def run(x):
            for k in range(n):
                with tf.device(placement.host if k % 2 == 0 else placement.accelerator):
                    x = copy(x=x) if copy is tf.raw_ops.DeepCopy else copy(x)
            with tf.device(placement.accelerator):
                return x[:1] + 0.0
        return run

    long_run, short_run = chain_of(chain), chain_of(short)
    per_copy = []
    for size in sizes_bytes:
        with tf.device(placement.accelerator):
            x = tf.ones([max(1, int(size) // 4)], tf.float32)
        for run in (long_run, short_run):
            block(run(x))
        best_long = best_short = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            block(long_run(x))
            best_long = min(best_long, time.perf_counter() - start)
            start = time.perf_counter()
            block(short_run(x))
            best_short = min(best_short, time.perf_counter() - start)
        per_copy.append(max(best_long - best_short, 0.0) / (chain - short))
    sizes = np.asarray([max(4, int(s) // 4 * 4) for s in sizes_bytes], dtype=np.float64)
    seconds = np.asarray(per_copy)
    # minimise the relative error of latency + bytes / bandwidth: rows scaled by 1 / measured time
    weight = 1.0 / np.maximum(seconds, 1e-9)
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weight[:, None]
    (latency, inverse_bandwidth), *_ = np.linalg.lstsq(design, seconds * weight, rcond=None)
    if inverse_bandwidth <= 0:  # noise beat the signal: bandwidth from the largest copy alone
        inverse_bandwidth = seconds[-1] / sizes[-1]
    return LinkFit(bytes_per_s=float(1.0 / inverse_bandwidth), latency_s=float(max(latency, 0.0)),
                   sizes_bytes=tuple(int(s) for s in sizes), per_copy_s=tuple(float(s) for s in per_copy))


# ---------------------------------------------------------------------- a preset's roofline figures


@dataclass(frozen=True)
class PresetFigures:
    """The measurable figures of a ``DeviceModel`` preset on this machine (``measure_preset``)."""

    peak_flops: float
    mem_bandwidth_bytes_per_s: float
    op_overhead_s: float
    transfer_bytes_per_s: float  # copies of 64-256 MiB
    transfer_latency_s: float  # copies of 4 B to 16 MiB

    def describe(self) -> str:
        return (f"matmul {self.peak_flops / 1e9:.0f} GFLOP/s, elementwise {self.mem_bandwidth_bytes_per_s / 1e9:.1f} "
                f"GB/s, {self.op_overhead_s * 1e6:.2f} us per tiny op, copies {self.transfer_bytes_per_s / 1e9:.1f} GB/s "
                f"and {self.transfer_latency_s * 1e6:.1f} us each")


def measure_preset(placement: Placement | str | None = None, *, matmul_n: int = 2048, add_bytes: int = 256 * 2**20,
                   chain_ops: int = 10000, min_total_s: float = 3.0) -> PresetFigures:
    """The roofline figures the ``cpu-testbed`` preset is made of, measured on ``placement``'s
    accelerator: a ``matmul_n``^3 fp32 matmul (peak FLOP/s), an add of two ``add_bytes`` tensors
    (2 reads + 1 write per element: memory bandwidth), the marginal cost of a tiny op in a
    ``chain_ops``-op chain against a quarter of it (per-op overhead), and the link (``measure_link``:
    bandwidth from copies of 64-256 MiB, latency from its default sizes). Timed with ``timed_passes``
    (the machine's slowdowns left out)."""
    place = resolve_placement(placement)
    with tf.device(place.accelerator):
        a = tf.random.normal([matmul_n, matmul_n])
        x = tf.ones([add_bytes // 4])
        y = tf.ones([add_bytes // 4])
        tiny = tf.ones([1])

    def chain(n: int):
        @tf.function(autograph=False)
        def run(t):
            with tf.device(place.accelerator):
                for k in range(n):
                    t = tf.sin(t) if k % 2 == 0 else tf.maximum(t, 0.0)
                return t
        return run

    matmul = tf.function(lambda m: tf.linalg.matmul(m, m))
    add = tf.function(lambda u, v: u + v)
    long_chain, short_chain = chain(chain_ops), chain(chain_ops // 4)
    calls = {"matmul": lambda: matmul(a), "add": lambda: add(x, y), "long": lambda: long_chain(tiny),
             "short": lambda: short_chain(tiny)}
    for call in calls.values():
        block(call())
    times = timed_passes(calls, min_total_s=min_total_s).step_s
    large = measure_link(place, sizes_bytes=(2**26, 2**27, 2**28), chain=8, repeats=3)
    return PresetFigures(peak_flops=2 * matmul_n**3 / times["matmul"],
                         mem_bandwidth_bytes_per_s=3 * add_bytes / times["add"],
                         op_overhead_s=max(times["long"] - times["short"], 0.0) / (chain_ops - chain_ops // 4),
                         transfer_bytes_per_s=large.bytes_per_s, transfer_latency_s=measure_link(place).latency_s)


# ---------------------------------------------------------------------- calibrate


def _batch_sizes(batch_sizes) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(b) for b in batch_sizes}))
    except (TypeError, ValueError):
        raise CalibrationError(f"batch sizes must be integers, got {batch_sizes!r}") from None
    if len(sizes) < 2 or sizes[0] < 1:
        raise CalibrationError(f"calibration needs at least two distinct positive batch sizes, got {batch_sizes!r}")
    return sizes


def calibrate(model, batch_sizes: Sequence[int] = (2, 4), placement: Placement | str | None = None, *,
              preset: DeviceModel | str | None = None, inputs: StepInputs = NO_STEP_INPUTS,
              name: str | None = None, graph_rewrites: Sequence[str] = (), steps_per_pass: int = 1, min_passes: int = 6,
              max_passes: int = 40, tolerance: float = 0.05, min_timing_s: float = 8.0, max_timing_s: float | None = 20.0,
              profiled_steps: int = 3, profile_sessions: int = 2, contention: bool = True,
              graph: OpGraph | None = None) -> CalibratedDevice:
    """Measure ``model``'s step on this machine and return a ``CalibratedDevice`` for its graphs.

    ``model``: a compiled Keras model (as for ``rewriter.trace.tracing``). ``batch_sizes``: at least two
    the machine can run (small ones are cheap; a batch far above them is extrapolated linearly per
    op). ``placement``: as for ``rewriter.step.apply_plan`` (default: a visible GPU, else the CPU testbed).
    ``preset``: the device model whose memory figures and roofline the result keeps (default: the
    placement's, ``cpu-testbed`` on the testbed). ``inputs`` ... ``graph_rewrites``: as for
    ``rewriter.trace.tracing`` (capture the graphs to simulate with the same ones: the result refuses graphs
    of other shapes or structure as another model's). The step times are timed in passes for
    ``min_timing_s`` at least and ``max_timing_s`` at most (a large model's passes are long: then fewer of
    them). ``graph``: the model's step captured with these ``inputs`` and ``graph_rewrites`` at any batch
    size, when the caller has it (not captured again: on DenseNet-121 a capture is 10-15 s). The model's
    variables are restored afterwards. Raises ``CalibrationError`` for a model that cannot run."""
    sizes = _batch_sizes(batch_sizes)
    place = resolve_placement(placement)
    base = get_device(preset or place.simulator_device or FALLBACK_PRESET) if not isinstance(preset, DeviceModel) \
        else preset
    started = time.perf_counter()
    try:
        graph = graph.with_batch(sizes[0]) if graph is not None else capture(
            model, sizes[0], inputs, name=name, graph_rewrites=graph_rewrites)
    except (CaptureError, tf.errors.OpError, ValueError, TypeError, MemoryError) as error:
        raise CalibrationError(f"model {getattr(model, 'name', 'model')!r} cannot be captured at batch sizes "
                               f"{sizes[0]} and {2 * sizes[0]} ({type(error).__name__}: {first_line(error)})") from None
    # kept for the measured run: its anchors, and on the testbed its baseline (at the largest batch, whose
    # first call measures its constants)
    steps = {b: unswapped_step(model, graph, b, place, inputs, warm=False, constants=b == sizes[-1]) for b in sizes}
    snapshot = steps[sizes[0]].step.snapshot()  # the model's variables, before any step ran
    try:
        for b, built in steps.items():
            warm_up(model, built, place if b == sizes[-1] else None)
        return _calibrate(model, graph, steps, sizes, place, base, inputs, snapshot, started,
                          steps_per_pass=steps_per_pass, min_passes=min_passes, max_passes=max_passes,
                          tolerance=tolerance, min_timing_s=min_timing_s, max_timing_s=max_timing_s,
                          profiled_steps=profiled_steps, profile_sessions=profile_sessions, contention=contention)
    finally:
        snapshot.restore()


def _calibrate(model, graph, steps, sizes, place, base, inputs, snapshot, started, *, steps_per_pass, min_passes,
               max_passes, tolerance, min_timing_s, max_timing_s, profiled_steps, profile_sessions,
               contention) -> CalibratedDevice:
    notes = []
    # ---- per-op shares of the profiled step, at each batch size
    names = graph.op_name.tolist()
    shares = np.zeros((graph.n_ops, len(sizes)))
    coverage, profiled_s = [], []
    for k, b in enumerate(sizes):
        per_op = profiled_op_seconds(steps[b].call, steps=profiled_steps, sessions=profile_sessions, placement=place)
        snapshot.restore()
        seen = per_op.reindex(names).fillna(0.0).to_numpy()
        if not seen.sum() > 0:
            raise CalibrationError(f"the profiler recorded no op of the step at batch size {b} "
                                   f"(is another profiler session running?)")
        shares[:, k] = seen / seen.sum()
        coverage.append(float((seen > 0).mean()))
        profiled_s.append(float(seen.sum()))
    # ---- unprofiled step times, interleaved, the machine's slowdowns left out; the swapped steps beside them
    calls = {b: steps[b].call for b in sizes}
    top = sizes[-1]
    at_top = graph.with_batch(top)
    swapped: dict[str, SwapPlan] = {}
    for what, params in (("overlap", OVERLAP_PARAMS), ("stall", STALL_PARAMS)) if contention else ():
        plan = plan_swaps(at_top, params, kept_reads=base.kept_reads)
        if plan.n_swaps:
            swapped[what] = plan
            calls[what] = build_step(model, plan, at_top, top, place, inputs).call
    timing = timed_passes(calls, steps_per_pass=steps_per_pass, min_passes=min_passes, max_passes=max_passes,
                          tolerance=tolerance, min_total_s=min_timing_s, max_total_s=max_timing_s,
                          between=snapshot.restore)
    notes.append(f"step times: {timing.n_passes} interleaved passes in {timing.seconds:.0f} s, at least "
                 f"{timing.n_accepted} per step within {100 * tolerance:.0f} % of its fastest (the median pass "
                 f"{100 * timing.slowdown():.0f} % slower: other processes)")
    if not timing.consistent:
        notes.append(f"fewer than {min_passes} timing passes agreed within {100 * tolerance:.0f} %: the machine was "
                     "busy, the figures are less certain")
    step_s = np.array([timing.step_s[b] for b in sizes])
    seconds = shares * step_s[None, :]  # each op's share of the unprofiled step
    ab = _fit_lines(sizes, seconds)
    # ---- the link
    link = measure_link(place)
    roofline = float(np.sum(base.op_seconds(at_top.op_flops, at_top.op_touched_bytes)))

    def device(alpha: float, overhead_s: float, notes_now: Sequence[str]) -> CalibratedDevice:
        return CalibratedDevice.from_preset(
            base, graph, op_seconds_ab=ab, batch_sizes=sizes, measured_step_s=step_s,
            h2d_bytes_per_s=link.bytes_per_s, d2h_bytes_per_s=link.bytes_per_s,
            transfer_latency_s=link.latency_s, copy_contention=alpha, copy_overhead_s=overhead_s,
            copies_out_wait=place.copies_wait_for_compute,
            roofline_scale=float(step_s[-1] / roofline) if roofline > 0 else 1.0, notes=notes_now,
            source=(f"calibrated on this machine by rewriter.timing.device_calibration ({place.describe()}); memory figures and "
                    f"the roofline for ops it did not see from {base.name}"))

    # ---- copies in a real step: their contention with compute and their overhead, fitted to the swapped
    # steps (what the replay with the chained copies' link does not explain)
    alpha = overhead_s = 0.0
    if swapped:
        alpha, overhead_s, text = fit_copies(at_top, swapped, {w: timing.step_s[w] for w in swapped},
                                             device(0.0, 0.0, ()))
        notes.append(text)
    elif contention:
        notes.append("no activation to swap: copy contention and overhead not measured (0)")
    notes.append(f"profiled ops: {', '.join(f'{100 * c:.0f} %' for c in coverage)} of the graph's ops emitted an "
                 "event (fused and cheap ops emit none; their time is in the shares' anchor); the events' fastest "
                 "times sum to " + ", ".join(f"{100 * p / t:.0f} %" for p, t in zip(profiled_s, step_s))
                 + " of the unprofiled step")
    notes.append(f"chained copies: {link.bytes_per_s / 1e9:.1f} GB/s, {link.latency_s * 1e6:.1f} us per copy (copies "
                 "of " + ", ".join(f"{s} B: {t * 1e6:.1f} us" for s, t in zip(link.sizes_bytes, link.per_copy_s))
                 + ")")
    notes.append(f"calibration took {time.perf_counter() - started:.0f} s")
    calibrated = device(alpha, overhead_s, notes)
    log.info("calibrated %s", calibrated.describe())
    return calibrated


def fit_copies(g: OpGraph, plans: dict[str, SwapPlan], measured_s: dict[str, float],
               device: CalibratedDevice) -> tuple[float, float, str]:
    """(contention, overhead per copy, note): the ``copy_contention`` and ``copy_overhead_s`` whose
    replays of ``plans`` on ``device`` (both left out) are closest in relative terms (non-negative
    least squares) to their measured steps ``measured_s``: the step's time beyond the replay, per
    second of compute beside copies and per copy. The link is the chained copies' (``measure_link``)."""
    replays = {w: replay(g, plan, replace(device, copy_contention=0.0, copy_overhead_s=0.0))
               for w, plan in plans.items()}
    rows = [(r.copy_overlap_s / measured_s[w], (plans[w].n_swaps + plans[w].n_swap_ins) / measured_s[w],
             1.0 - r.step_s / measured_s[w]) for w, r in replays.items()]
    design, target = np.array([row[:2] for row in rows]), np.array([row[2] for row in rows])
    alpha, overhead = nonnegative_least_squares(design, target)
    alpha = min(alpha, MAX_CONTENTION)
    parts = [f"{w} ({plans[w].n_swaps} swaps, {plans[w].n_swap_ins} swap-ins): measured {1e3 * measured_s[w]:.2f} ms, "
             f"replayed {1e3 * r.step_s:.2f} ms without contention and overhead ({1e3 * r.stall_s:.2f} ms stalls, "
             f"{1e3 * r.copy_overlap_s:.2f} ms of compute beside copies)" for w, r in replays.items()]
    text = (f"copies in a step, fitted on swapped steps at batch size {g.batch_size}: contention {alpha:.2f}, "
            f"{overhead * 1e6:.1f} us of step per copy; " + "; ".join(parts))
    return alpha, overhead, text


def nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> tuple[float, float]:
    """min |design @ x - target| over x >= 0, two unknowns: the unconstrained solution if it is
    non-negative, else the better of the two one-unknown fits."""
    x, *_ = np.linalg.lstsq(design, target, rcond=None)
    if (x >= 0).all():
        return float(x[0]), float(x[1])
    best, best_error = (0.0, 0.0), float(target @ target)
    for k in range(2):
        column = design[:, k]
        value = max(float(column @ target / (column @ column)), 0.0) if column @ column > 0 else 0.0
        error = float(np.sum((column * value - target) ** 2))
        if error < best_error:
            best, best_error = ((value, 0.0) if k == 0 else (0.0, value)), error
    return best
