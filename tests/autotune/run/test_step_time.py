"""The step-time benchmark's ranking rule and summary (no TensorFlow: tables only)."""

import math

import pandas as pd

from benchmarks.step_time import anchors_note, kendall_tau, linearity_note, mark_ranked, ranked_plans, summary


def test_ranked_plans_keep_measurements_at_least_the_gap_apart_from_the_fastest_up():
    # 60.8 and 61.0 are one tie within the noise; 65.2-68.3 another; 84.1 stands apart
    measured = [60.8, 68.3, 65.2, 66.6, 61.0, 65.9, 84.1]
    assert ranked_plans(measured, gap=0.05) == [True, False, True, False, False, False, True]
    assert ranked_plans([1.0, float("nan"), 2.0]) == [True, False, True]
    assert ranked_plans([]) == []


def test_the_summary_takes_tau_over_the_ranked_plans_and_errors_over_every_plan():
    measured = [10.0, 10.1, 12.0, 15.0]
    predicted = [9.0, 9.5, 9.2, 14.0]  # the tie (10.0, 10.1) predicted in order, 12.0 predicted below 10.1
    table = pd.DataFrame({
        "model": ["m"] * 4, "measured_ms": measured, "predicted_ms": predicted, "anchored_ms": predicted,
        "preset_ms": predicted,
        **{c: [100 * (p / m - 1) for p, m in zip(predicted, measured)]
           for c in ("error_pct", "anchored_error_pct", "preset_error_pct")}})
    stats = summary(mark_ranked(table))
    row = stats.iloc[0]
    assert list(mark_ranked(table)["ranked"]) == [True, False, True, True]
    assert row["ranked"] == 3 and row["plans"] == 4
    assert row["calibrated_tau"] == kendall_tau([9.0, 9.2, 14.0], [10.0, 12.0, 15.0]) == 1.0
    assert row["calibrated_tau_all"] < 1.0
    assert math.isclose(row["calibrated_worst_abs_pct"], 100 * (1 - 9.2 / 12.0))
    assert stats.iloc[-1]["model"] == "all" and stats.iloc[-1]["calibrated_tau"] == 1.0


def test_the_unswapped_step_is_compared_with_the_line_through_the_calibrations_steps_in_wall_and_cpu_time():
    timing = {"anchor_batches": [4, 6], "anchor_step_s": [0.040, 0.050], "anchor_cpu_s": [0.070, 0.100]}
    none = {"measured_step_s": 0.066, "measured_cpu_s": 0.130}  # the wall line says 60 ms, the CPU line 130 ms
    note = linearity_note(8, timing, none)
    assert "wall 60.00 ms for 66.00 ms measured (-9.1 %)" in note and "CPU 130.00 ms for 130.00 ms measured (+0.0 %)" in note
    assert linearity_note(8, {}, none) == "" and linearity_note(8, timing, None) == ""


def test_the_calibrations_steps_timed_beside_the_plans_are_set_against_its_own_timing_of_them():
    calibration = {"calibration_batches": [4, 6], "calibration_step_s": [0.040, 0.050]}
    note = anchors_note(calibration, {"anchor_step_s": [0.030, 0.050]})
    assert "b4 30.00 ms (0.75x the calibration's)" in note and "b6 50.00 ms (1.00x the calibration's)" in note
    assert anchors_note(None, {"anchor_step_s": [0.03]}) == "" and anchors_note(calibration, {}) == ""
