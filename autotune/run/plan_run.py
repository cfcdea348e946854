"""Predict, apply, measure: one plan simulated, applied to the real training step and run.

``run_plan`` is the one place where a plan's prediction meets a measurement; the tuning's measured run
(``measure_result``: on a GPU at the requested batch, else on the CPU testbed at a batch this machine
can run, with the prediction for that same batch beside it) and the benchmarks (fidelity, max-batch,
gpu-check) come through it. TensorFlow is imported only when something is measured.
"""

from __future__ import annotations

import json
import logging
import pickle
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autotune.inputs import format_bytes
from autotune.run.stage_times import StageClock
from autotune.run.tuning import MeasuredRun, TuneResult
from autotune.run.verdict import PLAIN_FIT_PEAK_RUNS
from simulator import (CalibratedDevice, CalibrationError, DeviceModel, NamedPlan, OpGraph, SwapPlan, get_device,
                       plan_swaps, replay)
from simulator.replay import Replay

if TYPE_CHECKING:  # TensorFlow only when a plan is measured
    from rewriter.trace.step_inputs import StepInputs

log = logging.getLogger(__name__)

# what a measured run on the CPU testbed may cost this machine
TESTBED_MAX_PEAK_BYTES = 3 * 2**30
TESTBED_MAX_STEP_S = 4.0
# the re-anchoring's passes start within this time (as the calibration's, ``calibrate(max_timing_s)``): a pass
# of the demo's ResNet-50 (b16: the plan's step and two anchors) takes 7 s, and at load 3-4, 20 passes
# without 6 agreeing within 5 % took the measured run to 338 s (benchmarks/results/cli_time_resnet50.md);
# short steps still run their 6 passes well within it
ANCHOR_TIMING_MAX_S = 30.0


@dataclass
class PlanRun:
    """One plan predicted, applied and measured: ``readings`` holds one ``rewriter.Measurement`` per
    measured call (the first times ``repeats`` steps, each one profiles a step's memory); none when
    the step ran out of memory (on a GPU whose memory limit is the budget: a measured "does not fit",
    not a crash), ``step`` None too when that happened in the apply's verifying first call."""

    plan: SwapPlan
    predicted: Replay
    step: Any  # rewriter.SwapStep
    readings: list[Any]

    @property
    def out_of_memory(self) -> bool:
        return not self.readings

    @property
    def measured(self):
        """The first reading (its step times are the timed ones), None when out of memory."""
        return self.readings[0] if self.readings else None


def run_plan(model, graph: OpGraph, plan: SwapPlan, device: DeviceModel | str, batch: tuple[Any, Any], *,
             placement=None, verify: bool = True, warmup: int = 1, repeats: int = 3, peak_repeats: int = 1,
             inputs: StepInputs | None = None, clock: StageClock | None = None) -> PlanRun:
    """Predict ``plan`` on ``device`` (``graph`` at the batch it runs), apply it to ``model``'s step at
    that batch (``rewriter.apply``; ``inputs``: the shapes the step was captured with) and measure
    it on ``batch`` = (x, y): ``warmup`` steps, then ``repeats`` timed ones, then ``peak_repeats - 1``
    more profiled steps (a measured peak moves by a few % from step to step). ``clock``: the apply is
    timed as its own stage."""
    import rewriter  # TensorFlow only when a plan is measured
    import tensorflow as tf

    predicted = replay(graph, plan, device)
    with (clock or StageClock()).stage("apply"):
        try:  # the verification runs the step's first call
            step = rewriter.apply(model, plan, graph=graph, batch_size=graph.batch_size, placement=placement,
                                  verify=verify, verify_with=batch if verify else None,
                                  **({} if inputs is None else {"inputs": inputs}))
        except tf.errors.ResourceExhaustedError as error:
            _say_out_of_memory(error)
            return PlanRun(plan, predicted, None, [])
    return PlanRun(plan, predicted, step, _readings(step, *batch, warmup=warmup, repeats=repeats,
                                                    peak_repeats=peak_repeats))


def _say_out_of_memory(error) -> None:
    """Log a measured run's ``ResourceExhaustedError`` (on a GPU held to the budget: a measured "does not fit")."""
    log.warning("the measured run ran out of memory: %s", str(error).splitlines()[0][:200])


def _readings(step, x, y, *, warmup: int = 1, repeats: int = 3, peak_repeats: int = 1) -> list[Any]:
    """``rewriter.timing.measurement`` of ``step`` (``run_plan``), none when it runs out of memory."""
    import rewriter  # TensorFlow only when a plan is measured
    import tensorflow as tf

    try:
        readings = [rewriter.measure(step, x, y, warmup=warmup, repeats=repeats)]
        return readings + [rewriter.measure(step, x, y, warmup=0, repeats=1) for _ in range(peak_repeats - 1)]
    except tf.errors.ResourceExhaustedError as error:
        _say_out_of_memory(error)
        return []


def plain_fit_reading(step, data) -> Any:
    """The measurement of model.fit's own ``step`` with the highest of ``PLAIN_FIT_PEAK_RUNS`` peaks (None: it ran
    out of memory)."""
    readings = _readings(step, *data, peak_repeats=PLAIN_FIT_PEAK_RUNS)
    return max(readings, key=lambda reading: reading.peak_bytes) if readings else None


def testbed_batch(result: TuneResult) -> int:
    """The largest batch, up to the tuned one, whose unswapped step the CPU testbed runs quickly."""
    return testbed_batch_for(result.graph, result.batch_size)


def testbed_batch_for(graph, batch_size: int) -> int:
    """The largest batch up to ``batch_size`` whose unswapped step of ``graph`` the CPU testbed runs quickly."""
    testbed = get_device("cpu-testbed")
    batch = batch_size
    while batch > 1:
        base = replay(graph.with_batch(batch), None, testbed)
        if base.peak_bytes <= TESTBED_MAX_PEAK_BYTES and base.step_s <= TESTBED_MAX_STEP_S:
            break
        batch = max(1, batch // 2)
    return batch


def _reanchored(model, graph: OpGraph, run_graph: OpGraph, run: PlanRun, device: CalibratedDevice, data, placement,
                inputs: StepInputs) -> tuple[float, float, str] | None:
    """The plan's step timed in passes beside the calibration's own unswapped steps, and predicted by the
    calibration re-anchored to them (``rewriter.timing.anchored``: the machine's speed drifts between the
    calibration and this run; ``graph``: the model's step, ``run_graph``: the plan's, with its
    recomputations): (measured step s, predicted step s, what it was anchored to); None when
    those steps cannot run here (out of memory, say), the calibration's own prediction then stands."""
    import tensorflow as tf  # TensorFlow only when a plan is measured
    from rewriter.timing.anchored import ANCHOR, timed_beside_anchors

    flat = run.step._flat_inputs(*data)
    snapshot = run.step.snapshot()  # the timed steps update the model's variables
    try:
        anchored, timing = timed_beside_anchors(device, model, graph, {"plan": lambda: run.step.run_flat(*flat)},
                                                placement=placement, inputs=inputs, max_total_s=ANCHOR_TIMING_MAX_S,
                                                between=snapshot.restore)
    except (tf.errors.OpError, CalibrationError) as error:  # the plan's measurement stands; only the re-anchoring is lost
        log.warning("the step times were not re-anchored (%s: %s)", type(error).__name__,
                    str(error).splitlines()[0][:200] if str(error) else "")
        return None
    finally:
        snapshot.restore()
    anchors = ", ".join(f"{b} ({timing.step_s[(ANCHOR, b)]:.4g} s)" for b in device.batch_sizes)
    predicted_s = replay(run_graph, run.plan, anchored).step_s
    return timing.step_s["plan"], predicted_s, f"unswapped steps at batch sizes {anchors}"


def _clones(check: Any) -> dict:
    """What of the plan's recomputations ran (``check``: a ``rewriter.check.recompute_check.RecomputeVerification``, None when
    the plan recomputes nothing), as ``MeasuredRun`` keeps it."""
    if check is None:
        return {}
    return {"clones_survived": check.clones + len(check.clones_gone_with_original),
            "clones_planned": check.planned_clones, "recompute_problems": check.problems()}


@dataclass(frozen=True)
class PlannedRun:
    """What the measured run of a result runs here: the shown plan made for this machine's device model
    (``device``: a calibration of it, else its preset) on ``plan_graph`` at ``batch`` (the requested one
    on a GPU, else one the CPU testbed runs quickly)."""

    placement: Any  # rewriter.Placement
    batch: int
    device: DeviceModel
    graph: OpGraph  # the model's step at ``batch``
    plan_graph: OpGraph  # the same with the plan's recomputations
    plan: SwapPlan
    note: str

    @property
    def on_gpu(self) -> bool:
        return self.placement.measured_on == "gpu"

    @property
    def key(self) -> str:
        """The plan's identity: where and at which batch it runs, and what it does (whatever parameters made it)."""
        named = {**self.plan.to_named(self.plan_graph).to_dict(), "params": None}
        return json.dumps([self.placement.measured_on, self.batch, self.device.name, named], sort_keys=True)


def planned_run(result: TuneResult, placement=None, note: str = "", batch: int | None = None) -> PlannedRun:
    """The run that measures ``result``'s shown plan on this machine (``measure_result``); ``placement``: where
    it runs when not this machine's own (one replica's device and host; at the requested batch, ``note`` says
    where), ``batch`` the batch it runs at there (default: the requested one)."""
    import rewriter  # TensorFlow only when a plan is measured

    given = placement is not None
    placement = placement or rewriter.detect(configure=False)
    shown = result.shown
    params = None if shown is None else shown.params
    if placement.measured_on == "gpu":
        batch, device, note = result.batch_size, result.device, note
    else:
        batch = batch or (result.batch_size if given else testbed_batch(result))
        calibration = result.calibration
        device = calibration if calibration is not None and calibration.preset == "cpu-testbed" else get_device("cpu-testbed")
        note = note or (f"No GPU here: the plan's parameters were applied on the CPU testbed (CPU:0 as the "
                        f"accelerator, CPU:1 as the host) at batch {batch}"
                        + ("" if batch == result.batch_size else f" instead of {result.batch_size}") + ".")
    graph = result.graph.with_batch(batch)
    # the plan's recomputations (names, whatever the batch) are in its graph; the swaps are made there, and its
    # order (weights on the host run their reads just before their readers, simulator.state.with_host_state)
    plan_graph = graph if result.plan_graph is None else result.plan_graph.with_batch(batch)
    plan = SwapPlan.empty(plan_graph) if params is None else plan_swaps(plan_graph, params, kept_reads=device.kept_reads)
    if result.plan is not None and result.plan.host_state:  # the optimizer slots the plan keeps on the host
        plan = replace(plan, host_state=result.plan.host_state)
    return PlannedRun(placement, batch, device, graph, plan_graph, plan, note)


@dataclass(frozen=True)
class SingleDeviceRuns:
    """How ``autotune.run.confirm`` measures a plan: on this machine's one device (``measure_result``)."""

    model: Any
    inputs: Any  # rewriter.StepInputs
    apply_with = "rewriter.step.apply_plan + rewriter.use_swap_step"  # what trains with the plan, as the verdict says

    def planned(self, result: TuneResult) -> PlannedRun:
        return planned_run(result)

    def measure(self, result: TuneResult, planned: PlannedRun, clock: StageClock) -> MeasuredRun:
        return measure_result(self.model, result, self.inputs, planned, clock=clock)


@dataclass(frozen=True)
class WorkerOrder:
    """What the chief of several ``MultiWorkerMirroredStrategy`` workers has every worker run: ``plan`` (made on
    ``plan_graph``) applied to its replicas at the global ``batch`` and measured; with no actions, ``graph``'s step
    as ``model.fit`` runs it beside."""

    plan: NamedPlan
    plan_graph: OpGraph
    graph: OpGraph
    batch: int
    has_actions: bool


@dataclass(frozen=True)
class WorkerReadings:
    """One worker's measurement of a ``WorkerOrder``: its replicas' rows (``MeasuredRun.replicas``), its timed step,
    the plain step's peak (with no actions), its swaps' checks; ``error``: why it could not run the order."""

    replicas: tuple[dict, ...] = ()
    step_s: float = float("nan")
    plain_peak_bytes: int | None = None
    swaps_survived: int | None = None
    problems: tuple[str, ...] = ()
    error: str | None = None
    out_of_memory: bool = False  # on GPUs held to the budget: the plan's step ran out of memory (no rows)


@dataclass(frozen=True)
class TuneFinished:
    """The chief's last word to the other workers: its result (without the study), or why it stopped."""

    result: TuneResult | None
    error: str | None = None


def worker_readings(model, inputs, order: WorkerOrder, timed_steps: int,
                    clock: StageClock | None = None) -> WorkerReadings:
    """``order`` applied to this process's replicas (``rewriter.apply_replicated``) and each one's peak measured
    (``rewriter.measure_replicas``); every worker of a cluster runs it together (the steps' all-reduces)."""
    import rewriter  # TensorFlow only when a plan is measured
    import tensorflow as tf
    from rewriter.trace.step_inputs import synthetic_batch

    clock = clock or StageClock()
    x, y = synthetic_batch(model, order.batch, inputs)
    try:  # GPUs held to the budget: out of memory (the apply's verifying first call included) is a measured
        with clock.stage("apply"):  # "does not fit"
            step = rewriter.apply_replicated(model, order.plan, graph=order.plan_graph, batch_size=order.batch,
                                             inputs=inputs, verify_with=(x, y))
        peaks = rewriter.measure_replicas(step, x, y)
        step_s = rewriter.time_replicas(step, x, y, timed_steps)
    except tf.errors.ResourceExhaustedError as error:
        _say_out_of_memory(error)
        return WorkerReadings(out_of_memory=True)
    plain = None
    if not order.has_actions:  # "fits without swapping" must hold for the step model.fit runs, TF's op order
        with clock.stage("apply"):
            own = rewriter.apply_replicated(model, SwapPlan.empty(order.graph).to_named(order.graph),
                                            graph=order.graph, batch_size=order.batch, inputs=inputs,
                                            serialize=False, verify=False)
        try:
            plain = max(peak.peak_bytes for _ in range(PLAIN_FIT_PEAK_RUNS)
                        for peak in rewriter.measure_replicas(own, x, y))
        except tf.errors.ResourceExhaustedError:  # model.fit's own order does not fit: the serialized step does
            log.info("model.fit's own step ran out of memory at global batch %d", order.batch)
    checks = step.verification or ()
    task = step.replicas.task
    rows = tuple({"replica": step.replicas.first_replica + p.replica, "worker": task, "device": p.device,
                  "host": step.placements[p.replica].host, "measured_bytes": p.peak_bytes,
                  "host_peak_bytes": p.host_peak_bytes, "host_state_bytes": p.host_state_bytes,
                  "resident_bytes": p.resident_bytes,
                  "unowned_bytes": p.unowned_bytes, "host_shared": p.host_shared,
                  "swaps_verified": not checks or checks[p.replica].ok,
                  "swaps_survived": None if not checks else checks[p.replica].swap_outs} for p in peaks)
    return WorkerReadings(rows, step_s, plain, None if not checks else min(c.swap_outs for c in checks),
                          tuple(f"replica {step.replicas.first_replica + k}: {problem}" for k, c in enumerate(checks)
                                for problem in c.problems()))


class WorkerStopped(RuntimeError):
    """A worker of a cluster stopped tuning: the chief (its error, or its connection lost), or another worker that
    could not run the chief's plan (its error, said to the chief)."""


def follow_chief(model, inputs, replicas, timed_steps: int = 3) -> TuneResult:
    """A worker other than the chief while the chief tunes: each plan it orders measured on this worker's replicas
    and the readings sent back, until it finishes; its result is returned (``WorkerStopped`` if it stopped)."""
    message = _from_chief(replicas, b"")
    while not isinstance(message, TuneFinished):
        try:
            readings = worker_readings(model, inputs, message, timed_steps)
        except Exception as error:  # noqa: BLE001 -- said to the chief, whose run reports it
            readings = WorkerReadings(error=f"worker {replicas.task}: {type(error).__name__}: {error}")
        message = _from_chief(replicas, pickle.dumps(readings))
        if isinstance(message, WorkerReadings):  # the chief's own, sent with the others': its next word
            message = _from_chief(replicas, b"")
    if message.error is not None:
        raise WorkerStopped(f"worker 0 stopped tuning: {message.error}")
    return message.result


def _from_chief(replicas, payload: bytes):
    """The chief's word in one exchange between the workers (pickled by this same tool: the workers trust their
    cluster as their collectives do)."""
    import tensorflow as tf  # TensorFlow only when a plan is measured

    try:
        return pickle.loads(replicas.exchange(payload)[0])  # noqa: S301
    except tf.errors.OpError as error:  # the chief's process ended: its collectives aborted
        raise WorkerStopped(f"lost worker 0 ({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None


def tell_workers(replicas, finished: TuneFinished) -> None:
    """The chief's last word to the other workers (a no-op for one)."""
    if replicas.workers > 1:
        replicas.exchange(pickle.dumps(finished))


@dataclass(frozen=True)
class ReplicatedRuns:
    """How ``autotune.run.confirm`` measures a plan for every replica of a ``MirroredStrategy`` model, on its GPUs
    or the CPU testbed (docs/design.md 14): the plan applied on each replica (``rewriter.apply_replicated``) at the
    global batch, each replica's peak measured (``rewriter.measure_replicas``). The run's peak is the highest replica's
    (the check that confirms it confirms every replica); ``MeasuredRun.replicas`` holds each one's. Under
    ``MultiWorkerMirroredStrategy`` this is the chief's: every other worker runs the same plan
    (``follow_chief``) and sends its replicas' readings."""

    model: Any
    inputs: Any  # rewriter.StepInputs
    replicas: Any  # rewriter.Replicas: the strategy the model was built under, resolved once
    timed_steps: int = 3
    apply_with = "rewriter.apply_replicated + rewriter.use_replicated_step"

    def planned(self, result: TuneResult) -> PlannedRun:
        from rewriter.step.replicated import replica_placement

        replicas = self.replicas
        placement = replica_placement(replicas, 0)
        workers = "" if replicas.workers == 1 else f" of each of {replicas.workers} workers"
        if placement.measured_on == "gpu":  # the target itself, at the requested batch
            return planned_run(result, placement=placement, note=(
                f"Measured on each of the {replicas.count} GPUs{workers} (each replica on its own GPU, every "
                f"replica's swaps to its machine's CPU:0) at global batch {replicas.in_sync * result.batch_size}, "
                f"{result.batch_size} per replica."))
        batch = testbed_batch(result)  # per replica: the tuned one, or less where the testbed would be slow
        return planned_run(result, placement=placement, batch=batch, note=(
            f"Measured on each of the CPU testbed's {replicas.count} replicas{workers} (replica k on CPU:2k, its "
            f"host CPU:2k+1) at global batch {replicas.in_sync * batch}, {batch} per replica"
            + ("" if batch == result.batch_size else f" instead of {result.batch_size}") + "."))

    def measure(self, result: TuneResult, planned: PlannedRun, clock: StageClock) -> MeasuredRun:
        with clock.stage("measured_run"):
            return self._measure(result, planned, clock)

    def _measure(self, result: TuneResult, planned: PlannedRun, clock: StageClock) -> MeasuredRun:
        replicas = self.replicas
        order = WorkerOrder(planned.plan.to_named(planned.plan_graph), planned.plan_graph, planned.graph,
                            planned.batch * replicas.in_sync, result.has_actions)
        if replicas.workers > 1:
            replicas.exchange(pickle.dumps(order))
        every = [worker_readings(self.model, self.inputs, order, self.timed_steps, clock)]
        if replicas.workers > 1:
            every += [pickle.loads(payload) for payload in replicas.exchange(pickle.dumps(every[0]))[1:]]  # noqa: S301
        failed = [r.error for r in every if r.error is not None]
        if failed:
            raise WorkerStopped("; ".join(failed))
        predicted = replay(planned.plan_graph, planned.plan, planned.device)
        survived = [r.swaps_survived for r in every if r.swaps_survived is not None]
        plain = [r.plain_peak_bytes for r in every if r.plain_peak_bytes is not None]
        out_of_memory = any(r.out_of_memory for r in every)
        rows = () if out_of_memory else tuple(row for r in every for row in r.replicas)
        return MeasuredRun(
            measured_on=planned.placement.measured_on, batch_size=planned.batch,
            peak_bytes=max((row["measured_bytes"] for row in rows), default=0), out_of_memory=out_of_memory,
            step_s=float("nan") if out_of_memory else max(r.step_s for r in every),
            baseline_peak_bytes=None, baseline_step_s=None,
            predicted_peak_bytes=predicted.peak_bytes, predicted_step_s=predicted.step_s,
            predicted_baseline_peak_bytes=replay(planned.graph, None, planned.device).peak_bytes,
            note=planned.note, swaps_planned=planned.plan.n_swaps, swaps_survived=min(survived) if survived else None,
            verification_problems=[problem for r in every for problem in r.problems],
            time_model=planned.device.name, time_calibrated=isinstance(planned.device, CalibratedDevice),
            plain_peak_bytes=max(plain) if plain else None, replicas=rows)


def measure_result(model, result: TuneResult, inputs: StepInputs, planned: PlannedRun | None = None, *,
                   clock: StageClock | None = None) -> MeasuredRun:
    """Apply the chosen plan to ``model``'s real step (captured with ``inputs``), run it, and measure
    peak memory and time (``planned``: what ``planned_run(result)`` gives, when already known; ``clock``:
    timed as the measured-run stage, its applies as their own)."""
    clock = clock or StageClock()
    with clock.stage("measured_run"):
        return _measure_result(model, result, inputs, planned or planned_run(result), clock)


def _measure_result(model, result: TuneResult, inputs: StepInputs, planned: PlannedRun,
                    clock: StageClock) -> MeasuredRun:
    import rewriter  # TensorFlow only when a plan is measured
    from rewriter.timing.built_steps import unswapped_step
    from rewriter.trace.step_inputs import synthetic_batch

    placement, batch, device, graph, plan, note = (planned.placement, planned.batch, planned.device, planned.graph,
                                                   planned.plan, planned.note)
    on_gpu = planned.on_gpu
    plan_graph = planned.plan_graph
    predicted_base = replay(graph, None, device)
    data = synthetic_batch(model, batch, inputs)  # as captured
    run_graph = plan_graph  # the graph the plan was made on (the captured step's but where the plan moves weights)
    run = run_plan(model, run_graph, plan, device, data, placement=placement, inputs=inputs, clock=clock)
    measured, predicted = run.measured, run.predicted
    step_s = float("nan") if measured is None else measured.step_s
    predicted_step_s, anchored_to = predicted.step_s, None
    if isinstance(device, CalibratedDevice) and measured is not None:
        reanchored = _reanchored(model, graph, run_graph, run, device, data, placement, inputs)
        if reanchored is not None:
            step_s, predicted_step_s, anchored_to = reanchored
    baseline = plain = None
    if result.has_actions and not on_gpu:  # the calibration's (or anchors') unswapped step when it is at this batch
        with clock.stage("apply"):
            unswapped = unswapped_step(model, graph, batch, placement, inputs, constants=True).step
        baseline = (_readings(unswapped, *data) or [None])[0]
    elif result.has_actions:
        if predicted_base.peak_bytes <= result.budget_bytes:  # on a GPU it may not fit
            baseline = run_plan(model, graph, SwapPlan.empty(graph), device, data, placement=placement, verify=False,
                                inputs=inputs, clock=clock).measured
    else:  # "fits without swapping" must hold for the step a plain model.fit runs, too
        plain = plain_fit_reading(rewriter.KerasStep(model), data)
        if plain is None:
            log.info("model.fit's own step ran out of memory at batch %d", batch)
    verification = None if run.step is None else run.step.verification
    if measured is not None:
        log.info("measured at batch %d: peak %s (predicted %s)", batch, format_bytes(measured.peak_bytes),
                 format_bytes(predicted.peak_bytes))
    return MeasuredRun(
        measured_on=placement.measured_on if measured is None else measured.measured_on, batch_size=batch,
        peak_bytes=0 if measured is None else measured.peak_bytes,
        step_s=step_s,
        baseline_peak_bytes=None if baseline is None else baseline.peak_bytes,
        baseline_step_s=None if baseline is None else baseline.step_s,
        predicted_peak_bytes=predicted.peak_bytes, predicted_step_s=predicted_step_s, time_model=device.name,
        predicted_step_s_unanchored=predicted.step_s if anchored_to is not None else None, time_anchored_to=anchored_to,
        time_calibrated=isinstance(device, CalibratedDevice),
        predicted_baseline_peak_bytes=predicted_base.peak_bytes,
        allocator_peak_bytes=None if measured is None else measured.allocator_peak_bytes,
        note=note, swaps_survived=None if verification is None else verification.swap_outs,
        verification_problems=_swap_problems(verification),
        swaps_planned=plan.n_swaps, plain_peak_bytes=None if plain is None else plain.peak_bytes,
        **_clones(None if verification is None else verification.recompute),
        out_of_memory=run.out_of_memory,
    )


def _swap_problems(verification) -> list[str]:
    """What of the plan's swaps did not survive Grappler, names included (the recomputations' are
    ``recompute_problems``)."""
    if verification is None:
        return []
    cloned = [] if verification.recompute is None else verification.recompute.problems()
    return [problem for problem in verification.problems() if problem not in cloned]
