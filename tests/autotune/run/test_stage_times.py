"""The run's stage clock (autotune.run.stage_times): nested stages count each second once."""

import time

import pytest

from autotune.run.stage_times import STAGES, StageClock, StageTimes


def test_nested_stages_count_each_second_once():
    clock = StageClock()
    with clock.stage("measured_run"):
        time.sleep(0.02)
        with clock.stage("apply"):
            time.sleep(0.05)
    times = clock.times()
    assert 0.05 <= times.apply_s < 0.2
    assert 0.02 <= times.measured_run_s < 0.05 + 0.02  # the apply's seconds are not in it again
    assert times.total_s >= times.apply_s + times.measured_run_s
    assert times.capture_s == 0.0
    assert set(times.to_dict()) == {f"{stage}_s" for stage in STAGES} | {"total_s", "other_s"}


def test_repeated_stage_adds_up_and_unknown_stage_is_refused():
    clock = StageClock()
    for _ in range(2):
        with clock.stage("search"):
            time.sleep(0.01)
    assert clock.times().search_s >= 0.02
    with pytest.raises(ValueError):
        with clock.stage("warp"):
            pass


def test_describe_lists_largest_first():
    text = StageTimes(capture_s=2.0, search_s=5.0, total_s=8.0).describe()
    assert text.index("search 5.0 s") < text.index("capture 2.0 s")
    assert "other 1.0 s" in text
