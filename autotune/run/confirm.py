"""Tune a Keras model, then measure the chosen plan until a measured run confirms it.

The search runs on the simulator for the target; the measured run (on the target's GPU, or on the CPU
testbed) checks the simulator on the machine it ran on, and the verdict carries that check to the
target's prediction (``autotune.run.verdict``, docs/design.md section 6). A run that does not confirm the
plan turns into a correction the next search budgets for, ``MAX_ROUNDS`` measured runs at most; a plan
already measured is never run again. Each round's result is built anew (``dataclasses.replace``),
never changed after the fact; the CLI and ``tune()`` both come through here.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from autotune.run.calibrated_timing import calibrate_for, search_target
from autotune.run.floor import (choose_parts, foregone, split_lines, split_to_budget, split_way,
                                state_floor_bytes)
from autotune.search.parts import SPLIT_WHEN_OVERHEAD_OVER, parts_to_search, split_floor
from autotune.run.training import fit_weights_note
from autotune.inputs import format_bytes
from autotune.run.plan_run import ReplicatedRuns, SingleDeviceRuns, TuneFinished, follow_chief, tell_workers
from autotune.run.options import MeasureOptions, SearchOptions
from autotune.run.stage_times import StageClock
from autotune.run.target import Target, resolve_target
from autotune.run.tuning import MeasuredRun, TuneResult, search_graph
from autotune.run.verdict import (MAX_ROUNDS, Check, PeakCorrection, confirmed, next_correction, not_confirmed,
                              predicted)
from simulator import CalibratedDevice
from simulator.buffers import peak_lower_bound_bytes
from simulator.graph import OpGraph

if TYPE_CHECKING:  # TensorFlow only when a model is tuned
    from rewriter.trace.step_inputs import StepInputs

log = logging.getLogger(__name__)


def _promoted_closest(result: TuneResult, check: Check) -> TuneResult:
    """The measured run overrules the correction too: a closest miss whose measured peak, carried to
    the target, is within the budget (and agrees with its corrected prediction) is the plan."""
    chosen = replace(result.closest, feasible=True, excess_bytes=check.projected_bytes - check.budget_bytes)
    verdict = predicted(fits=True, swaps=result.has_actions,
                        peak_bytes=result.correction.corrected(chosen.peak_bytes, result.resident_bytes()),
                        budget_bytes=result.budget_bytes, measured=True, action=result.action_phrase)
    note = ("the corrected search found no plan under its stricter limit, but the closest plan's measured peak "
            "is within the budget: the measurement decides")
    return replace(result, chosen=chosen, closest=None, notes=[*result.notes, note], verdict=verdict)


def _confirmed(result: TuneResult, checks: list[Check], apply_with: str) -> TuneResult:
    """``result`` with the verdict its last check confirms (without swapping, model.fit's own step too, unless it
    was not measured: it ran out of memory; ``apply_with``: the calls that train with the plan)."""
    if not result.feasible:  # the corrected search found none, but the closest plan measured within the budget
        result = _promoted_closest(result, checks[-1])
    run = result.measurement
    plain = None if result.has_actions or run.plain_peak_bytes is None else result.check_of(
        run, run.plain_peak_bytes, checks[-1].round, PeakCorrection())
    return replace(result, verdict=confirmed(result.verdict, checks, plain=plain, apply_with=apply_with))


def _study_name(search: SearchOptions, round_: int, swap_only: bool) -> str | None:
    """A corrected search is another search: its own study, so stored trials keep the budget they were made for."""
    name = search.study_name
    if name is None:
        return None
    name = name if round_ == 1 else f"{name}-corrected-{round_ - 1}"
    return f"{name}-swap-only" if swap_only else name


def confirm(model, graph, target: Target, inputs: StepInputs, *, batch_size: int | None = None,
            search: SearchOptions = SearchOptions(), rounds: int = MAX_ROUNDS,
            calibration: CalibratedDevice | None = None, clock: StageClock | None = None,
            say: Callable[[str], None] = log.info, runs=None) -> TuneResult:
    """Search plans for ``graph`` (captured from ``model`` with ``inputs``) on ``target``, measure the
    winner, and repeat with a correction from the measurement until one is confirmed, ``rounds`` measured
    runs are spent, or another round cannot change the answer (the verdict says which).
    ``calibration``: step times measured on this machine (``autotune.run.calibrated_timing``): the search runs
    on it where it models the target's device, and it predicts the measured run's step time; ``clock`` times
    the stages (``autotune.run.stage_times``); ``runs``: how a plan is measured (``SingleDeviceRuns``, the
    default, or ``ReplicatedRuns`` on every replica of a strategy)."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    target = search_target(target, calibration)
    clock = clock or StageClock()
    runs = runs or SingleDeviceRuns(model, inputs)
    correction = PeakCorrection()
    checks: list[Check] = []
    measured: dict[str, tuple[int, MeasuredRun]] = {}  # plan identity -> (round, run): a plan is measured once
    notes: list[str] = []  # what the rounds learnt that every later result says
    swap_only = False  # set when a plan with recomputation could not run: the search then swaps only
    result = None
    for round_ in range(1, rounds + 1):
        options = replace(search, study_name=_study_name(search, round_, swap_only))
        with clock.stage("search"):
            searched = search_graph(graph, target, options, batch_size=batch_size, correction=correction,
                                    measured=True)
        result = replace(searched, calibration=calibration, notes=[*searched.notes, *notes])
        if result.plan is None:  # not even a closest plan (e.g. the resident memory alone is over the budget)
            return replace(result, verdict=result.verdict.with_checks(checks, [c.describe() for c in checks]))
        planned = runs.planned(result)
        earlier = measured.get(planned.key)
        if earlier is None:
            try:
                measured[planned.key] = (round_, runs.measure(result, planned, clock))
            except Exception as error:  # never a success without a measurement; the report says what failed
                log.debug("measured run failed", exc_info=True)
                first = str(error).splitlines()[0][:300] if str(error) else ""
                reason = f"the measured run failed ({type(error).__name__}: {first})"
                if result.recomputes and search.recompute and round_ < rounds:
                    # a plan TensorFlow cannot run is no answer; swapping alone builds no clones
                    notes.append(f"the plan with recomputation ({result.action_phrase}) could not run: {reason}; "
                                 "the plan shown is the best swap-only plan, searched and measured instead")
                    say(f"{reason}: searching and measuring swap plans only instead")
                    search, swap_only = replace(search, recompute=False), True
                    continue
                return replace(result, verdict=not_confirmed(checks, reason=reason))
        measured_round, run = measured[planned.key]
        result = replace(result, measurement=run)
        check = result.check_of(run, None if run.out_of_memory else run.peak_bytes, round_, correction,
                                None if earlier is None else measured_round)
        checks.append(check)
        say(check.describe())
        if check.confirmed:
            return _confirmed(result, checks, runs.apply_with)
        if not result.feasible:  # the closest miss, measured for the report, did not fit either
            return replace(result, verdict=result.verdict.with_checks(checks, [c.describe() for c in checks]))
        if earlier is not None:  # the stricter search chose a plan already measured: no round can change that
            return replace(result, verdict=not_confirmed(
                checks, reason=f"the corrected search chose the plan measured in round {measured_round} again and "
                               f"its measurement does not confirm it, so more rounds would measure nothing new; "
                               f"{check.describe()}"))
        correction = next_correction(check, correction, result.resident_bytes(run.batch_size))
        if round_ < rounds:
            what = (f"the measured run agrees with the prediction, but its peak, carried to the target's "
                    f"prediction, is {format_bytes(check.projected_bytes - check.budget_bytes)} over the budget"
                    if check.agrees
                    else "the measured run is above the prediction")
            say(f"{what}: re-tuning with a correction ({correction.describe()})")
    return replace(result, verdict=not_confirmed(
        checks, reason=f"{len(checks)} measured runs and none confirmed a plan; the last, {checks[-1].describe()}"))


def tune(model, *, batch_size: int | None = None, device=None, memory: int | None = None, trials: int | None = None,
         maximize_batch: bool | None = None, measure: bool | None = None, target: Target | None = None,
         inputs: StepInputs | None = None, graph_rewrites=(), search: SearchOptions | None = None,
         measurement: MeasureOptions | None = None, name: str | None = None,
         say: Callable[[str], None] = log.info, clock: StageClock | None = None, strategy=None) -> TuneResult:
    """Capture ``model``'s training step, search swap parameters, and measure the winner until a
    measured run confirms it (``result.verdict``). ``python -m autotune`` comes through here.

    The common keywords: ``batch_size`` (may be left out with ``maximize_batch=True``: the search
    picks it); ``device`` (a preset name: timings, and the budget unless ``memory`` is given) and
    ``memory`` (the budget in bytes), or an already resolved ``target``; ``trials``; ``measure=False``
    for the simulator's answer alone (the verdict says it is a prediction only).
    ``inputs``: ``rewriter.StepInputs(input_shapes=...)`` where the model leaves dimensions open.
    ``graph_rewrites``: exact rewrites of the step to make first (``rewriter.graph_rewrites.REWRITES``).
    ``search``: every other search setting (``SearchOptions``: policy, sampler, seed, storage, ...);
    ``measurement``: ``MeasureOptions`` (calibrate, recalibrate, rounds); the common keywords override both. A
    calibration is reused from an earlier run of the same graph on this machine unless ``recalibrate``.
    ``name``: the model's name in the results (default ``model.name``); ``say``: where progress goes;
    ``clock``: times the run's stages (``autotune.run.stage_times``).
    ``strategy``: the ``tf.distribute.MirroredStrategy`` the model was built under (found by itself when left
    out): one replica's step is tuned, the budget per device, the host budget shared by the replicas, and every
    replica measured (``tune_replicated``, docs/design.md 14). Under ``MultiWorkerMirroredStrategy`` every worker
    calls it: worker 0 tunes, the others measure its plans on their replicas, and all return its result
    (``tune_workers``).
    A model that cannot be captured raises ``CaptureError`` before anything is searched (another strategy too).
    """
    from rewriter.tf_effects.collectives import strategy_of  # TensorFlow only when a model is tuned
    from rewriter.trace.tracing import capture
    from rewriter.trace.step_inputs import NO_STEP_INPUTS

    if target is not None and (device is not None or memory is not None):
        raise ValueError("give either target or device/memory, not both")
    search = replace(search or SearchOptions(), **{key: value for key, value in
                                                   (("trials", trials), ("maximize_batch", maximize_batch))
                                                   if value is not None})
    measurement = replace(measurement or MeasureOptions(), **({} if measure is None else {"measure": measure}))
    target = target or resolve_target(device, memory)
    inputs = inputs or NO_STEP_INPUTS
    given_batch = batch_size
    if batch_size is None:
        if not search.maximize_batch:
            raise ValueError("batch_size is required unless maximize_batch=True")
        batch_size = 1  # only where the capture starts: sizes are linear in the batch
    clock = clock or StageClock()
    built_under = strategy_of(model)
    if strategy is not None and strategy is not built_under:
        raise ValueError(f"the model was not built in this {type(strategy).__name__}'s scope: build it (and "
                         "compile it) in strategy.scope(), then tune it")
    if built_under is not None:
        if given_batch is None:  # one sample a replica where the capture starts (the search picks the batch)
            batch_size = built_under.num_replicas_in_sync
        return tune_workers(model, batch_size, target, inputs, search=search, measurement=measurement,
                            name=name, say=say, clock=clock, graph_rewrites=graph_rewrites)
    say(f"capturing the training step at batch {batch_size} ...")
    with clock.stage("capture"):
        graph = capture(model, batch_size, inputs, name=name or getattr(model, "name", None),
                        graph_rewrites=graph_rewrites)
    say(f"captured {graph.n_ops} ops; resident memory {format_bytes(graph.persistent_bytes)}")
    for rewrite in graph_rewrites:
        changed = graph.meta.get("graph_rewrite_changes", {}).get(rewrite, [])
        say(f"{rewrite}: {len(changed)} op(s) rewritten" if changed else f"{rewrite}: nothing in this model to rewrite")
    captured = graph
    split, splits, graph = _splits_to_search(graph, target, search)
    known = foregone(graph, target, policy=search.policy, recompute=search.recompute, state=search.state,
                     recaptured=lambda more: capture(model, batch_size, inputs, name=graph.meta.get("model"),
                                                     graph_rewrites=[*graph_rewrites, *more]),
                     split=split, split_allowed=search.split)
    if known is not None:  # under the floor: no calibration, search or measured run can change the answer
        return known
    with clock.stage("calibration"):  # of the captured step: a split step's parts take the preset's estimates
        calibration = calibrate_for(model, captured, batch_size, inputs, say=say,
                                    recalibrate=measurement.recalibrate) if measurement.calibrates else None
    timed = search_target(target, calibration)

    def tuned(graph: OpGraph) -> TuneResult:
        if not measurement.measure:
            with clock.stage("search"):
                return replace(search_graph(graph, timed, search, batch_size=batch_size), calibration=calibration)
        say("searching, then measuring the chosen plan on the real training step ...")
        return confirm(model, graph, target, inputs, batch_size=batch_size, search=search, rounds=measurement.rounds,
                       calibration=calibration, clock=clock, say=lambda text: say(f"measured: {text}"))

    result = _split_when_whole_missed(captured, graph, splits, target, timed, search, clock, say, tuned)
    # a weighted step is traced and the plan applied to it: no TensorFlow work under --no-measure
    weights = fit_weights_note(model, result.named_plan(), result.batch_size, inputs) \
        if result.applies_plan and measurement.measure else None
    return replace(result, notes=[*result.notes, weights]) if weights else result  # said at tuning time


def _splits_to_search(graph, target: Target, search: SearchOptions, *, state_first: bool = True,
                      whole_missed: bool = False):
    """Where the captured step's floor is over the device budget: the split of the ops that set it
    (``split_to_budget``, kept for the report even where splitting is off) and, where splitting may run and
    brings the floor within the budget, the numbers of parts to search (the fewest that fit, and more) and the
    graph of the fewest; else ``graph`` itself. ``state_first``: none where the floor with every movable state on
    the host fits (the search tries that first, ``_split_when_whole_missed`` the split after). ``whole_missed``: the
    search found no plan for the step whole, so a floor within the budget is split too (its parts, run one after
    the other, keep fewer activations than any plan of the whole step)."""
    # a split's floor with the optimizer state the search may move on the host as well: the two together
    floor_of = (lambda g: state_floor_bytes(g, target.device)) if search.state else None
    if (peak_lower_bound_bytes(graph) <= target.device_budget_bytes and not whole_missed) or search.maximize_batch or (
            state_first and search.state and state_floor_bytes(graph, target.device) <= target.device_budget_bytes):
        return None, [], graph
    split = split_to_budget(graph, target.device_budget_bytes, floor_of)  # the ops that set the floor, in parts
    if split is None or not search.split or split_floor(split, floor_of) > target.device_budget_bytes:
        return split, [], graph
    return split, parts_to_search(graph, target.device_budget_bytes, first=split, floor_of=floor_of), \
        split.split_graph


def _split_when_whole_missed(captured, graph, splits, target: Target, timed: Target, search: SearchOptions,
                             clock: StageClock, say: Callable[[str], None],
                             tuned: Callable[[OpGraph], TuneResult]) -> TuneResult:
    """``tuned`` (search, or search and measure) on ``graph`` or the graph ``splits`` chooses (``_splits_to_search``'s
    graph and numbers of parts), its split's lines first. Where nothing was split, because the step's floor fits or
    the floor with every movable state on the host does (a bound, not a plan: the weights' copies in stay), yet no
    plan did, the split is searched after: its parts, one after the other, keep fewer activations at once
    (``simulator.ordering.micro_batch_order``). Where a plan of the step whole fits but costs more than
    ``SPLIT_WHEN_OVERHEAD_OVER``, the split is searched too, and tuned where its plan is predicted faster: the
    faster that fits is kept (parts leave room for plans that move less)."""
    graph, split_notes = _chosen_split(captured, graph, splits, timed, search, clock, say)
    result = tuned(graph)
    slow = (search.split and result.feasible and (result.verdict is None or result.verdict.ok)
            and result.chosen.metrics["overhead"] > SPLIT_WHEN_OVERHEAD_OVER)
    if (result.feasible and not slow) or splits or not (search.state or search.split):
        return replace(result, notes=[*split_notes, *result.notes])
    split, later, graph = _splits_to_search(captured, target, search, state_first=False, whole_missed=search.split)
    if split is not None and not search.split:
        return replace(result, notes=[*result.notes, split_way(split, target.device_budget_bytes, False)])
    if not later:
        return result
    if slow:
        return _faster_split(captured, result, later, timed, search, clock, say, tuned)
    # over its floor the step was searched whole because the floor with the state moved fits (``state_first``)
    moved_first = search.state and peak_lower_bound_bytes(captured) > target.device_budget_bytes
    whole = "with the optimizer state on the host and the step whole" if moved_first else "with the step whole"
    say(f"no plan fits {whole}; splitting its ops along the batch ...")
    graph, split_notes = _chosen_split(captured, graph, later, timed, search, clock, say)
    split = tuned(graph)
    return replace(split, notes=[*split_notes, f"no plan fitted {whole}: its ops are split along the batch",
                                 *split.notes]) if split.feasible else result


def _faster_split(captured, whole: TuneResult, splits, timed: Target, search: SearchOptions, clock: StageClock,
                  say: Callable[[str], None], tuned: Callable[[OpGraph], TuneResult]) -> TuneResult:
    """The step whole fits at a cost: the numbers of parts ``splits`` searched with an equal share of the trials
    (``choose_parts``); where the fastest's plan is predicted faster than ``whole``'s, the split is tuned (and
    measured) and the faster of the two that fit is kept, with a line saying what each cost."""
    whole_s, whole_overhead = whole.chosen.step_s, whole.chosen.metrics["overhead"]
    say(f"the plan of the step whole costs {whole_overhead:.1%}; searching its ops split along the batch too ...")
    with clock.stage("search"):
        parts = choose_parts(captured, splits, timed, search)
    cost = f"the step whole fits at {whole_overhead:.1%} overhead"
    if parts.chosen is None or parts.chosen.step_s >= whole_s:
        found = "no plan fits" if parts.chosen is None else f"{parts.chosen.metrics['overhead']:.1%}"
        note = f"{cost}; split along the batch ({parts.line()}): {found}, so it stays whole"
        return replace(whole, notes=[*whole.notes, note])
    notes = [split_lines(parts.split), parts.line()]
    for line in notes:
        say(line)
    split = tuned(parts.split.split_graph)
    if not split.feasible or (split.verdict is not None and not split.verdict.ok) or split.chosen.step_s >= whole_s:
        note = f"{cost}; split in {parts.parts} parts the plan tuned was not faster, so it stays whole"
        return replace(whole, notes=[*whole.notes, note])
    note = (f"{cost}; split in {parts.parts} parts along the batch "
            f"{split.chosen.metrics['overhead']:.1%}: the split is kept")
    return replace(split, notes=[*notes, note, *split.notes])


def _chosen_split(captured, graph, splits, target: Target, search: SearchOptions, clock: StageClock,
                  say: Callable[[str], None]):
    """The graph the search proper runs on and the report's lines on the split: with several numbers of parts to
    search, the fastest's split graph (``choose_parts``, on ``target`` with its calibration); ``graph`` as it is
    and no lines where nothing is split."""
    if not splits:
        return graph, []
    split, notes = splits[0], []
    if len(splits) > 1:  # the number of parts searched with the plan: the search proper runs on the fastest's
        with clock.stage("search"):
            parts = choose_parts(captured, splits, target, search)
        split, graph = parts.split, parts.split.split_graph
        notes = [parts.line()]
    notes.insert(0, split_lines(split))
    for note in notes:
        say(note)
    return graph, notes


def tune_workers(model, batch_size: int, target: Target, inputs: StepInputs, *, search: SearchOptions,
                 measurement: MeasureOptions, name: str | None, say: Callable[[str], None],
                 clock: StageClock, graph_rewrites=()) -> TuneResult:
    """``tune_replicated`` on every worker of a cluster (one worker under ``MirroredStrategy``): each captures the
    step (tracing it builds the optimizer's variables, which the workers make together); the chief (worker 0)
    searches and decides, every other worker measures each plan it orders on its own replicas
    (``follow_chief``) and returns the chief's result, which the chief sends last, or why it stopped."""
    import rewriter  # TensorFlow only when a model is tuned
    from rewriter.trace.replicas import resolve_replicas

    replicas = resolve_replicas(model)
    say(f"capturing one replica's training step at global batch {batch_size} ...")
    with clock.stage("capture"):
        graph = rewriter.capture_replicated(model, batch_size, inputs, name=name or getattr(model, "name", None),
                                            graph_rewrites=graph_rewrites)
    for rewrite in graph_rewrites:
        changed = graph.meta.get("graph_rewrite_changes", {}).get(rewrite, [])
        say(f"{rewrite}: {len(changed)} op(s) of each replica rewritten" if changed
            else f"{rewrite}: nothing in this model to rewrite")
    if replicas.task:
        say(f"worker {replicas.task} of {replicas.workers}: measuring the plans worker 0 chooses on this worker's "
            f"{replicas.count} replica(s) ...")
        with clock.stage("measured_run"):
            return follow_chief(model, inputs, replicas)
    try:
        result = tune_replicated(model, replicas, graph, target, inputs, search=search, measurement=measurement,
                                 say=say, clock=clock)
    except BaseException as error:
        with contextlib.suppress(Exception):  # a worker gone takes its collectives along: the error is this one
            tell_workers(replicas, TuneFinished(None, f"{type(error).__name__}: {error}"))
        raise
    tell_workers(replicas, TuneFinished(replace(result, study=None)))
    return result


def tune_replicated(model, replicas, graph: OpGraph, target: Target, inputs: StepInputs, *,
                    search: SearchOptions, measurement: MeasureOptions, say: Callable[[str], None],
                    clock: StageClock) -> TuneResult:
    """``tune`` for a model built in ``MirroredStrategy.scope()``: one replica's step at the per-replica batch,
    searched with ``target``'s device budget per device and 1/N of its host budget each (the replicas' swaps share
    the machine's host memory), timed by the calibration of the same step on one device (``replica_calibration``),
    and measured on every replica until the highest replica's peak confirms the plan (``ReplicatedRuns``). Under one
    replica's floor its batch is split as a single device's is, on every replica, and the optimizer state may move
    to each replica's host. ``replicas``: the strategy resolved (``rewriter.Replicas``); ``graph``: one replica's
    captured step (``rewriter.capture_replicated``)."""
    meta = graph.meta["replicas"]
    count = len(meta["devices"])  # this machine's: they share its host memory
    each = target.per_replica(count)
    say(f"captured {graph.n_ops} ops of one replica of {meta['in_sync']} at batch {graph.batch_size}; resident memory "
        f"{format_bytes(graph.persistent_bytes)}, the gradients' all-reduce pack {format_bytes(meta['all_reduce_bytes'])}")
    captured = graph
    split, splits, graph = _splits_to_search(graph, each, search)  # one replica's batch in parts, on every replica
    known = foregone(graph, each, policy=search.policy, recompute=search.recompute, state=search.state, split=split,
                     split_allowed=search.split)
    if known is not None:
        return known
    with clock.stage("calibration"):
        calibration = replica_calibration(model, captured, inputs, recalibrate=measurement.recalibrate, say=say) \
            if measurement.calibrates else None
    timed = search_target(each, calibration)

    def tuned(graph: OpGraph) -> TuneResult:
        if not measurement.measure:
            with clock.stage("search"):
                return replace(search_graph(graph, timed, search, batch_size=graph.batch_size), calibration=calibration)
        say(f"searching, then measuring the chosen plan on each of the {count} replicas ...")
        return per_device_verdict(confirm(model, graph, each, inputs, batch_size=graph.batch_size, search=search,
                                          rounds=measurement.rounds, calibration=calibration, clock=clock,
                                          say=lambda text: say(f"measured: {text}"),
                                          runs=ReplicatedRuns(model, inputs, replicas)))

    return _split_when_whole_missed(captured, graph, splits, each, timed, search, clock, say, tuned)


def per_device_verdict(result: TuneResult) -> TuneResult:
    """The verdict of a replicated run said per device: confirmed when every replica is (its own check within the
    budget, its swaps verified on its partition graphs), else not confirmed, naming the replica."""
    memory = result.replica_memory()
    if memory is None or not result.verdict.confirmed_by_measurement:
        return result
    devices = memory["devices"]
    failed = [f"replica {k} on {d['device']}: " + ("its swaps did not all survive TensorFlow's graph optimizer"
                                                   if d.get("swaps_verified") is False else d.get("check", "not measured"))
              for k, d in enumerate(devices) if not d.get("confirmed", False)]
    if failed:
        return replace(result, verdict=not_confirmed(list(result.verdict.checks), reason="; ".join(failed)))
    headline = result.verdict.headline.rstrip(".") + f"; on each of {len(devices)} devices (" + "; ".join(
        f"replica {k} measured {format_bytes(d['measured_bytes'])}" for k, d in enumerate(devices)) + ")."
    return replace(result, verdict=replace(result.verdict, headline=headline))


def replica_calibration(model, graph, inputs: StepInputs, *, recalibrate: bool,
                        say: Callable[[str], None]) -> CalibratedDevice | None:
    """Op times for one replica's step (``graph``): the calibration of the same model's single-device step at the
    per-replica batch (made on a copy of the model built off the strategy; reused from the calibration cache as
    a single-device run of that batch reuses it), serving the replica's ops it saw by name and type
    (``CalibratedDevice.for_graph``; the all-reduce's and the optimizer's, named apart, take the roofline). None,
    said, when the model cannot be copied off the strategy (a subclassed model without ``get_config``)."""
    import keras  # TensorFlow only when a model is tuned
    from rewriter.timing.built_steps import forget_unswapped
    from rewriter.trace.tracing import capture

    per_replica = int(graph.meta["replicas"]["per_replica_batch_size"])
    try:
        plain = keras.models.clone_model(model)
        plain.compile_from_config(model.get_compile_config())
        plain.set_weights(model.get_weights())
    except Exception as error:  # noqa: BLE001 -- any model Keras cannot rebuild: the preset's times, said
        say(f"step times are the preset's estimates: the model could not be copied off the strategy to calibrate "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''})")
        return None
    single = capture(plain, per_replica, inputs, name=graph.meta.get("model"))
    calibrated = calibrate_for(plain, single, per_replica, inputs, say=say, recalibrate=recalibrate)
    forget_unswapped(plain)  # the copy's steps and variables leave the device replica 0 is measured on
    del plain
    gc.collect()
    served = calibrated.for_graph(graph, single, f"one replica's step timed by the single-device step's "
                                                 f"calibration at batch {per_replica}")
    say(served.notes[-1])
    return served
