"""The verdict's arithmetic: a measured run overrules the prediction (no TensorFlow needed). A measurement
on the testbed checks the simulator there, and what it shows is carried to the target's own prediction
(docs/design.md section 6); the target says where its budgets came from."""

from __future__ import annotations

import pytest

from autotune.run.verdict import (DOES_NOT_FIT, FITS, FITS_WITHOUT_SWAPPING, NOT_CONFIRMED, PLAIN_FIT,
                                  PLAIN_FIT_PEAK_RUNS, SERIALIZED_STEP, TOLERANCE, PeakCorrection, actions_phrase,
                                  check_run, confirmed, next_correction, not_confirmed, predicted)

from autotune.run.target import resolve_target

MiB = 2**20


def _check(measured, predicted_bytes, *, budget=100 * MiB, resident=10 * MiB, batch=8, requested=8,
           at_request=None, resident_at_request=None, correction=PeakCorrection(), round_=1):
    return check_run(round=round_, measured_on="cpu-testbed", measured_bytes=measured, predicted_bytes=predicted_bytes,
                     resident_bytes=resident, predicted_at_request_bytes=at_request or predicted_bytes,
                     resident_at_request_bytes=resident_at_request or resident, measured_batch=batch,
                     requested_batch=requested, budget_bytes=budget, correction=correction)


@pytest.mark.parametrize("factor,excess", [(1.0, 0), (1.3, 0), (1.0, 7 * MiB), (1.8, 3 * MiB)])
@pytest.mark.parametrize("budget,resident", [(100 * MiB, 10 * MiB), (7 * MiB, 1 * MiB), (16 << 30, 5 << 30)])
def test_search_budget_is_the_largest_prediction_whose_corrected_peak_fits(factor, excess, budget, resident):
    correction = PeakCorrection(factor, excess)
    limit = correction.search_budget(budget, resident)
    assert correction.corrected(limit, resident) <= budget
    assert correction.corrected(limit + 2, resident) > budget or limit + 2 > budget


def test_a_peak_above_the_prediction_is_not_confirmed_even_within_the_budget():
    check = _check(measured=80 * MiB, predicted_bytes=60 * MiB)
    assert check.within_budget and not check.agrees and not check.confirmed
    assert "above the prediction" in check.describe()


def test_noise_within_the_tolerance_confirms_but_not_over_the_budget():
    assert _check(measured=int(60 * MiB * (1 + TOLERANCE / 2)), predicted_bytes=60 * MiB).confirmed
    over = _check(measured=101 * MiB, predicted_bytes=99 * MiB)
    assert over.agrees and not over.within_budget and not over.confirmed and "over the budget" in over.describe()


def test_out_of_memory_is_never_confirmed():
    check = _check(measured=None, predicted_bytes=60 * MiB)
    assert not check.confirmed and "ran out of memory" in check.describe()
    stricter = next_correction(check, PeakCorrection(), 10 * MiB)
    assert stricter.corrected(60 * MiB, 10 * MiB) > 100 * MiB  # the plan that ran out can no longer be chosen


def test_a_miss_at_a_smaller_batch_is_carried_to_the_requested_one():
    """Measured 20 % above at batch 8: the step's own memory at batch 64 is taken as 20 % above too."""
    check = _check(measured=70 * MiB, predicted_bytes=60 * MiB, batch=8, requested=64, at_request=95 * MiB,
                   resident_at_request=15 * MiB)
    assert check.projected_bytes == pytest.approx(15 * MiB + (60 / 50) * 80 * MiB, rel=1e-6)
    assert not check.within_budget and not check.confirmed
    same_ratio_fits = _check(measured=61 * MiB, predicted_bytes=60 * MiB, batch=8, requested=64,
                             at_request=90 * MiB, resident_at_request=15 * MiB)
    assert same_ratio_fits.confirmed and same_ratio_fits.projected_bytes <= 100 * MiB


def test_corrections_grow_every_round_and_budget_for_what_was_measured():
    correction = PeakCorrection()
    resident = 10 * MiB
    for round_ in range(1, 4):
        check = _check(measured=101 * MiB, predicted_bytes=95 * MiB, resident=resident, correction=correction,
                       round_=round_)
        assert not check.confirmed  # over the budget, whatever the prediction
        stricter = next_correction(check, correction, resident)
        assert stricter.factor > correction.factor and stricter.excess_bytes >= correction.excess_bytes
        # the plan just measured no longer passes the search
        assert stricter.corrected(95 * MiB, resident) > 100 * MiB
        correction = stricter


def test_an_allocation_the_simulator_cannot_see_is_budgeted_for_at_the_same_batch():
    """A constant unseen 12 MiB: after one correction, any plan the search allows fits when measured."""
    unseen, resident, budget = 12 * MiB, 10 * MiB, 100 * MiB
    check = _check(measured=90 * MiB + unseen, predicted_bytes=90 * MiB, resident=resident, budget=budget)
    assert not check.confirmed
    correction = next_correction(check, PeakCorrection(), resident)
    limit = correction.search_budget(budget, resident)
    for plan_peak in (limit, limit - 5 * MiB, 40 * MiB):
        again = _check(measured=plan_peak + unseen, predicted_bytes=plan_peak, resident=resident, budget=budget,
                       correction=correction, round_=2)
        assert again.confirmed, again.describe()


def test_verdicts_say_what_the_tool_can_stand_behind():
    fits = predicted(fits=True, swaps=True, peak_bytes=90 * MiB, budget_bytes=100 * MiB, measured=False)
    assert fits.status == FITS and fits.ok and not fits.confirmed_by_measurement and "predicted only" in fits.headline
    waiting = predicted(fits=True, swaps=True, peak_bytes=90 * MiB, budget_bytes=100 * MiB, measured=True)
    assert not waiting.ok  # a measured run was asked for and has not confirmed it
    miss = predicted(fits=False, swaps=True, peak_bytes=120 * MiB, budget_bytes=100 * MiB, measured=False)
    assert miss.status == DOES_NOT_FIT and not miss.ok
    assert "over the budget of 100.00 MiB." in miss.headline
    host = predicted(fits=False, swaps=True, peak_bytes=90 * MiB, budget_bytes=100 * MiB, measured=False,
                     host_miss_bytes=30 * MiB)  # room on the device, none on the host
    assert "within the budget of 100.00 MiB, but its swapped tensors need 30.00 MiB more host memory" in host.headline
    both = predicted(fits=False, swaps=True, peak_bytes=120 * MiB, budget_bytes=100 * MiB, measured=False,
                     host_miss_bytes=30 * MiB)
    assert "over the budget of 100.00 MiB, and its swapped tensors need 30.00 MiB more" in both.headline
    unsized = predicted(fits=False, swaps=True, peak_bytes=None, budget_bytes=100 * MiB, measured=False,
                        host_miss_bytes=30 * MiB)
    assert unsized.headline == ("Does not fit: the closest plan's swapped tensors need 30.00 MiB more host memory "
                                "than the host has.")
    ok = _check(measured=88 * MiB, predicted_bytes=90 * MiB)
    assert confirmed(waiting, [ok]).ok and confirmed(waiting, [ok]).confirmed_by_measurement
    failed = not_confirmed([_check(measured=120 * MiB, predicted_bytes=90 * MiB)], reason="none confirmed")
    assert failed.status == NOT_CONFIRMED and not failed.ok and failed.to_dict()["confirmed_by_measurement"] is False


def test_a_plan_that_only_recomputes_is_not_said_to_swap():
    only = predicted(fits=True, swaps=True, peak_bytes=90 * MiB, budget_bytes=100 * MiB, measured=True,
                     action=actions_phrase(n_swaps=0, n_recomputes=3))
    assert only.headline.startswith("Fits with recomputation:") and "swapping" not in only.headline
    done = confirmed(only, [_check(measured=88 * MiB, predicted_bytes=90 * MiB)])
    assert done.headline.startswith("Fits with recomputation, confirmed by measurement")
    assert actions_phrase(2, 1) == "swapping and recomputation" and actions_phrase(2, 0) == "swapping"


def test_a_split_plan_says_so_first():
    """A plan under the captured step's floor gets there by its parts: the headline names them before the swaps."""
    split = predicted(fits=True, swaps=True, peak_bytes=90 * MiB, budget_bytes=100 * MiB, measured=True,
                      action=actions_phrase(n_swaps=7, n_recomputes=0, split_parts=4))
    done = confirmed(split, [_check(measured=88 * MiB, predicted_bytes=90 * MiB)])
    assert done.headline.startswith("Fits with the batch split in 4 parts and swapping, confirmed by measurement")
    assert actions_phrase(0, 0, split_parts=2) == "the batch split in 2 parts"


def test_fits_without_swapping_must_hold_for_model_fit_too():
    base = predicted(fits=True, swaps=False, peak_bytes=60 * MiB, budget_bytes=100 * MiB, measured=True)
    serialized = _check(measured=61 * MiB, predicted_bytes=60 * MiB)
    plain_over = _check(measured=130 * MiB, predicted_bytes=60 * MiB, correction=PeakCorrection())
    verdict = confirmed(base, [serialized], plain=plain_over)
    assert verdict.status == FITS_WITHOUT_SWAPPING and verdict.train_with == SERIALIZED_STEP and verdict.ok
    assert "only with the tool's serialized step" in verdict.headline and "plain model.fit" in verdict.headline
    plain_ok = _check(measured=75 * MiB, predicted_bytes=60 * MiB)
    assert confirmed(base, [serialized], plain=plain_ok).train_with == PLAIN_FIT


def _u_net_check(measured_bytes: int, correction: PeakCorrection = PeakCorrection()):
    """The U-Net case's first round: a plan predicted 12.37 MiB on the v100-16gb (its target), 14.36 MiB
    on the testbed, measured 14.11 MiB there at the same batch, budget 13.50 MiB."""
    return check_run(round=1, measured_on="cpu-testbed", measured_bytes=measured_bytes,
                     predicted_bytes=int(14.36 * MiB), resident_bytes=2 * MiB,
                     predicted_at_request_bytes=int(12.37 * MiB), resident_at_request_bytes=2 * MiB,
                     measured_batch=8, requested_batch=8, budget_bytes=int(13.50 * MiB), correction=correction,
                     target_on="v100-16gb")


def test_the_testbed_s_bytes_are_not_held_to_the_target_s_budget():
    """14.11 MiB on the testbed is over the v100's 13.50 MiB budget, but it is 1.7 % under the testbed's
    own prediction: carried to the v100's 12.37 MiB prediction the peak is 12.2 MiB, within the budget."""
    check = _u_net_check(int(14.11 * MiB))
    assert check.measured_bytes > check.budget_bytes  # what the verdict used to compare
    assert check.agrees and check.within_budget and check.confirmed, check.describe()
    assert check.projected_bytes == pytest.approx(2 * MiB + (12.11 / 12.36) * 10.37 * MiB, rel=1e-6)
    assert "carried to the v100-16gb prediction at batch 8" in check.describe()


def test_the_simulator_s_miss_is_carried_to_the_target_at_the_same_batch():
    """Measured 15 % over the testbed's prediction: the target's prediction is taken as 15 % short too
    (on the step's own memory), which is over the budget; the correction budgets for the factor."""
    check = _u_net_check(2 * MiB + int(1.15 * 12.36 * MiB))
    assert not check.agrees and not check.within_budget
    assert check.projected_bytes == pytest.approx(2 * MiB + 1.15 * 10.37 * MiB, rel=1e-3)
    correction = next_correction(check, PeakCorrection(), 2 * MiB)
    assert correction.factor == pytest.approx(1.15, rel=1e-3)
    assert correction.corrected(int(12.37 * MiB), 2 * MiB) > 13.50 * MiB  # the plan no longer passes the search


def test_the_target_says_where_its_budgets_came_from():
    target = resolve_target("v100-16gb", 12 * 2**30, memory_from="autotune.toml: memory")
    assert target.device_budget_bytes == 12 * 2**30 and target.device.name == "v100-16gb"
    assert target.device_budget_source == "autotune.toml: memory 12.00 GiB"
    assert target.host_budget_bytes == target.device.host_memory_bytes
    preset = resolve_target("v100-16gb")
    assert preset.device_budget_bytes == preset.device.budget_bytes
    assert preset.device_budget_source.startswith("--device v100-16gb: the v100-16gb preset, 88% of its 16.00 GiB")
    assert target.to_dict()["device_budget_source"] in target.budget_source


@pytest.mark.tf
def test_plain_fit_stands_on_the_highest_of_its_measured_peaks(monkeypatch):
    """model.fit's own order varies between runs: the verdict's "plain model.fit fits" is checked against the
    highest of several measured steps, and a step that runs out of memory gives no reading."""
    from types import SimpleNamespace

    import rewriter
    import tensorflow as tf

    from autotune.run.plan_run import plain_fit_reading

    peaks = iter([5 * MiB, 9 * MiB, 7 * MiB, 6 * MiB, 8 * MiB])
    monkeypatch.setattr(rewriter, "measure", lambda step, x, y, **_: SimpleNamespace(peak_bytes=next(peaks)))
    assert PLAIN_FIT_PEAK_RUNS == 5 and plain_fit_reading(object(), (None, None)).peak_bytes == 9 * MiB

    def exhausted(step, x, y, **_):
        raise tf.errors.ResourceExhaustedError(None, None, "out of memory")

    monkeypatch.setattr(rewriter, "measure", exhausted)
    assert plain_fit_reading(object(), (None, None)) is None


@pytest.mark.tf
def test_a_plan_out_of_memory_in_its_verifying_first_call_is_a_measured_does_not_fit(monkeypatch):
    """On a GPU held to the budget the apply's verification is the step's first call, where a plan over the budget
    runs out of memory: a run without readings (one device) or a worker's readings marked out of memory
    (replicas), never an error that stops the tuning."""
    import keras
    import rewriter
    import tensorflow as tf

    from autotune.run.plan_run import WorkerOrder, run_plan, worker_readings
    from rewriter.trace.step_inputs import NO_STEP_INPUTS
    from simulator import SwapPlan
    from simulator.synthetic import training_graph

    def exhausted(*args, **kwargs):
        raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")

    monkeypatch.setattr(rewriter, "apply", exhausted)
    monkeypatch.setattr(rewriter, "apply_replicated", exhausted)
    graph = training_graph(4, batch_size=2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    run = run_plan(model, graph, SwapPlan.empty(graph), "v100-16gb", (None, None))
    assert run.out_of_memory and run.step is None and run.measured is None
    order = WorkerOrder(SwapPlan.empty(graph).to_named(graph), graph, graph, 2, True)
    readings = worker_readings(model, NO_STEP_INPUTS, order, timed_steps=1)
    assert readings.out_of_memory and readings.replicas == () and readings.error is None
