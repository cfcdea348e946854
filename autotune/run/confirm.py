"""Tune a Keras model, then measure the chosen plan until a measured run confirms it.

The search runs on the simulator; the measured run decides (``autotune.run.verdict``). A run whose peak
is above the prediction, or over the budget, turns into a correction the next search budgets for,
and the new plan is measured again, ``MAX_ROUNDS`` times at most. The result's ``verdict`` says
whether a measured run confirmed the plan; the CLI and ``tune()`` both come through here.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable

from autotune.run.calibrated_timing import calibrate_for, search_device
from autotune.run.floor import foregone
from autotune.run.training import fit_weights_note
from autotune.inputs import format_bytes
from autotune.run.plan_run import measure_result
from autotune.run.tuning import TuneResult, tune_graph
from autotune.run.verdict import (MAX_ROUNDS, Check, PeakCorrection, check_run, confirmed, next_correction, not_confirmed,
                              predicted)
from simulator import CalibratedDevice

log = logging.getLogger(__name__)


def _check(result: TuneResult, round_: int, measured_bytes: int | None, correction: PeakCorrection) -> Check:
    m = result.measurement
    return check_run(round=round_, measured_on=m.measured_on, measured_bytes=measured_bytes,
                     predicted_bytes=m.predicted_peak_bytes,
                     resident_bytes=result.graph.with_batch(m.batch_size).persistent_bytes,
                     predicted_at_request_bytes=result.shown.peak_bytes,
                     resident_at_request_bytes=result.graph.persistent_bytes, measured_batch=m.batch_size,
                     requested_batch=result.batch_size, budget_bytes=result.budget_bytes, correction=correction)


def _promote_closest(result: TuneResult, check: Check) -> None:
    """The measured run overrules the correction too: a closest miss whose measured peak is within
    the budget (and agrees with its corrected prediction) is the plan."""
    measured_excess = check.projected_bytes - check.budget_bytes  # <= 0: the check is within the budget
    result.chosen, result.closest = replace(result.closest, feasible=True, excess_bytes=measured_excess), None
    result.notes.append("the corrected search found no plan under its stricter limit, but the closest plan's "
                        "measured peak is within the budget: the measurement decides")
    result.verdict = predicted(fits=True, swaps=result.has_actions,
                               peak_bytes=result.correction.corrected(result.chosen.peak_bytes,
                                                                      result.graph.persistent_bytes),
                               budget_bytes=result.budget_bytes, measured=True, action=result.action_phrase)


def confirm(model, graph, *, rounds: int = MAX_ROUNDS, say: Callable[[str], None] = log.info,
            input_shapes=None, label_shapes=None, label_dtype=None, study_name: str | None = None,
            calibration: CalibratedDevice | None = None, **search: Any) -> TuneResult:
    """Search plans for ``graph`` (captured from ``model``), measure the winner, and repeat with a
    correction from the measurement until one is confirmed or ``rounds`` measured runs are spent.
    ``calibration``: step times measured on this machine (``autotune.run.calibrated_timing``): the search runs
    on it where it models the device searched for, and it predicts the measured run's step time.
    ``search`` takes ``tune_graph``'s keyword arguments."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    search["device"], search["memory"] = search_device(search.get("device"), search.get("memory"), calibration)
    correction = PeakCorrection()
    checks: list[Check] = []
    measured_plans: dict = {}  # (params, batch) -> MeasuredRun: a plan chosen again is not run again
    inputs = dict(input_shapes=input_shapes, label_shapes=label_shapes, label_dtype=label_dtype)
    swap_only_note = ""  # set when a plan with recomputation could not run: the search then swaps only
    for round_ in range(1, rounds + 1):
        # a corrected search is another search: its own study, so stored trials keep the budget they were made for
        name = study_name if round_ == 1 or study_name is None else f"{study_name}-corrected-{round_ - 1}"
        if swap_only_note and name is not None:
            name = f"{name}-swap-only"
        result = tune_graph(graph, correction=correction, measured=True, study_name=name, **search)
        result.calibration = calibration
        if swap_only_note:
            result.notes.append(swap_only_note)
        if result.plan is None:  # not even a closest plan (e.g. the resident memory alone is over the budget)
            result.verdict = result.verdict.with_checks(checks, [c.describe() for c in checks])
            return result
        key = (result.shown.params, result.batch_size)
        try:
            if key not in measured_plans:
                measured_plans[key] = measure_result(model, result, **inputs)
            result.measurement = measured_plans[key]
        except Exception as error:  # never a success without a measurement; the report says what failed
            log.debug("measured run failed", exc_info=True)
            reason = f"the measured run failed ({type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''})"
            if result.recomputes and search.get("recompute", True) and round_ < rounds:
                # a plan TensorFlow cannot run is no answer; swapping alone builds no clones
                swap_only_note = (f"the plan with recomputation ({result.action_phrase}) could not run: {reason}; "
                                  "the plan shown is the best swap-only plan, searched and measured instead")
                say(f"{reason}: searching and measuring swap plans only instead")
                search["recompute"] = False
                continue
            result.verdict = not_confirmed(checks, reason=reason)
            return result
        m = result.measurement
        check = _check(result, round_, None if m.out_of_memory else m.peak_bytes, correction)
        checks.append(check)
        say(check.describe())
        if check.confirmed:
            if not result.feasible:  # the corrected search found none, but the closest plan measured within the budget
                _promote_closest(result, check)
            plain = None
            if not result.has_actions:
                plain = _check(result, round_, m.plain_peak_bytes, PeakCorrection())
            result.verdict = confirmed(result.verdict, checks, plain=plain)
            return result
        if not result.feasible:  # the closest miss, measured for the report, did not fit either
            result.verdict = result.verdict.with_checks(checks, [c.describe() for c in checks])
            return result
        correction = next_correction(check, correction, result.graph.with_batch(m.batch_size).persistent_bytes)
        if round_ < rounds:
            what = (f"the measured run agrees with the prediction, but its peak is "
                    f"{format_bytes(check.projected_bytes - check.budget_bytes)} over the budget" if check.agrees
                    else "the measured run is above the prediction")
            say(f"{what}: re-tuning with a correction ({correction.describe()})")
    result.verdict = not_confirmed(checks, reason=f"{len(checks)} measured runs and none confirmed a plan; the last, "
                                                  f"{checks[-1].describe()}")
    return result


def tune(model, *, batch_size: int | None = None, device=None, memory: int | None = None, measure: bool = True,
         calibrate: bool | None = None, input_shapes=None, label_shapes=None, label_dtype=None, graph_rewrites=(),
         rounds: int = MAX_ROUNDS, name: str | None = None, say: Callable[[str], None] = log.info,
         **search: Any) -> TuneResult:
    """Capture ``model``'s training step, search swap parameters, and measure the winner until a
    measured run confirms it (``result.verdict``). ``python -m autotune`` comes through here.

    ``batch_size`` may be left out with ``maximize_batch=True`` (the search picks it).
    ``graph_rewrites``: exact rewrites of the step to make first (``rewriter.trace.graph_rewrites.REWRITES``).
    ``search`` takes the keyword arguments of ``tune_graph`` (policy, sampler, trials, ...).
    ``measure=False``: the simulator's answer alone (the verdict says it is a prediction only).
    ``calibrate`` (default: when measuring): step times measured on this machine
    (``autotune.run.calibrated_timing``) instead of the preset's datasheet estimate.
    ``name``: the model's name in the results (default ``model.name``); ``say``: where progress goes.
    A model that cannot be captured raises ``CaptureError`` before anything is searched.
    """
    from rewriter.trace.tracing import capture  # TensorFlow only when a model is tuned

    if batch_size is None:
        if not search.get("maximize_batch"):
            raise ValueError("batch_size is required unless maximize_batch=True")
        batch_size = 1  # only where the capture starts: sizes are linear in the batch
    say(f"capturing the training step at batch {batch_size} ...")
    graph = capture(model, batch_size, input_shapes=input_shapes, label_shapes=label_shapes,
                    label_dtype=label_dtype, name=name or getattr(model, "name", None), graph_rewrites=graph_rewrites)
    say(f"captured {graph.n_ops} ops; resident memory {format_bytes(graph.persistent_bytes)}")
    for rewrite in graph_rewrites:
        changed = graph.meta.get("graph_rewrite_changes", {}).get(rewrite, [])
        say(f"{rewrite}: {len(changed)} op(s) rewritten" if changed else f"{rewrite}: nothing in this model to rewrite")
    inputs = dict(input_shapes=input_shapes, label_shapes=label_shapes, label_dtype=label_dtype)
    known = foregone(graph, device=device, memory=memory, policy=search.get("policy", "optuna"),
                     recompute=search.get("recompute", True),
                     recaptured=lambda more: capture(model, batch_size, **inputs, name=graph.meta.get("model"),
                                                     graph_rewrites=[*graph_rewrites, *more]))
    if known is not None:  # under the floor: no calibration, search or measured run can change the answer
        return known
    calibration = calibrate_for(model, graph, batch_size, **inputs, say=say) \
        if (measure if calibrate is None else calibrate) else None
    if not measure:
        device, memory = search_device(device, memory, calibration)
        result = tune_graph(graph, batch_size=batch_size, device=device, memory=memory, **search)
        result.calibration = calibration
    else:
        say("searching, then measuring the chosen plan on the real training step ...")
        result = confirm(model, graph, rounds=rounds, say=lambda text: say(f"measured: {text}"), batch_size=batch_size,
                         device=device, memory=memory, calibration=calibration, **inputs, **search)
    weights = fit_weights_note(model, result.named_plan(), result.batch_size, **inputs) if result.applies_plan else None
    result.notes += [weights] if weights else []  # said at tuning time, not at the first weighted batch
    return result
