"""The benchmark harness's plumbing (the benchmarks themselves run in minutes: `python -m benchmarks NAME`)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pandas as pd
import pytest

from benchmarks.__main__ import main as benchmarks_main
from benchmarks.common import interleaved_seconds, per_second, write_results
from benchmarks.floor_split import main as floor_split_main, row_of
from benchmarks.max_batch import _parts_outcome
from benchmarks.split.measured import main as split_measured_main
from benchmarks.reference import (REFERENCES, ReferenceUnavailable, reference_simulator, reference_simulators,
                                  speed_row)
from benchmarks.simulator_speed import search_row
from autotune.search.parts import parts_to_search, search_parts
from autotune.search.policies import Budget, Outcome, make_policy
from autotune.search.space import Evaluation, SearchSpace, TuningProblem
from simulator import OpGraph, SwapParams, get_device
from simulator.split.overhead_bound import least_overhead
from simulator.synthetic import training_graph


def test_results_record_machine_settings_and_table(tmp_path):
    table = pd.DataFrame([{"model": "m", "ratio": 1.23456}])
    page = write_results("demo", table, settings={"command": "python -m benchmarks demo"}, notes=["a note"],
                         directory=tmp_path)
    text = page.read_text()
    for expected in ("# demo", "- cores:", "- python:", "- command: python -m benchmarks demo", "| m | 1.235 |",
                     "a note"):
        assert expected in text
    assert pd.read_csv(tmp_path / "demo.csv").ratio.tolist() == [1.23456]


def test_unknown_benchmark_is_refused(capsys):
    assert benchmarks_main(["no-such-benchmark"]) == 2
    assert "max-batch" in capsys.readouterr().err
    assert benchmarks_main(["--help"]) == 0


def test_per_second_times_the_fastest_round():
    calls = []
    rate, timed = per_second(lambda: calls.append(1), min_seconds=0.05, repeats=3)
    assert rate > 1000 and timed % 3 == 0 and len(calls) > timed  # autorange calls come on top


def test_interleaved_rounds_time_every_function():
    calls = {"a": 0, "b": 0}

    def count(name):
        calls[name] += 1

    rounds = interleaved_seconds({"a": lambda: count("a"), "b": lambda: count("b")}, min_seconds=0.02, repeats=3)
    assert set(rounds) == {"a", "b"} and all(len(r) == 3 and min(r) > 0 for r in rounds.values())
    assert calls["a"] > 3 and calls["b"] > 3


def test_speed_row_times_the_reference_beside_today():
    """The numpy replay (REFERENCES["numpy"]) loads beside today's and gives the same replay. (The
    compiled reference would compile its kernels on a machine's first run: minutes, not for CI.)"""
    try:
        references = reference_simulators(["numpy"])
    except ReferenceUnavailable as error:  # no git history here (an sdist, a shallow clone)
        pytest.skip(str(error))
    assert reference_simulator(REFERENCES["numpy"][0]) is references["numpy"]  # imported once
    row = speed_row(training_graph(40, batch_size=8), SwapParams(threshold=4, lb=1, ub=4), "v100-16gb", references,
                    0.05, repeats=3)
    assert row["identical_numpy"] and row["swaps"] > 0
    assert row["ms_per_replay"] <= row["ms_per_replay_median"] <= row["ms_per_replay_max"]
    assert row["ms_per_replay_numpy"] > 0 and row["replay_speedup_numpy"] > 0 and row["trial_speedup_numpy"] > 0


def test_search_row_times_the_same_trials_beside_the_reference():
    """``simulator_speed --searches``: the same grid points planned and replayed by today's simulator
    and the numpy reference, with how many give the same Replay (a synthetic graph: all of them)."""
    try:
        references = reference_simulators(["numpy"])
    except ReferenceUnavailable as error:
        pytest.skip(str(error))
    row = search_row(training_graph(40, batch_size=8), "v100-16gb", references, 0.05, n_trials=6)
    assert row["trials"] == 6 and row["identical_numpy"] == 6
    assert 0 < row["ms_per_trial"] <= row["ms_per_trial_median"] <= row["ms_per_trial_max"]
    assert row["trial_speedup_numpy"] == row["ms_per_trial_numpy"] / row["ms_per_trial"]
    assert row["grid_walk_s_numpy"] == pytest.approx(row["ms_per_trial_numpy"] * row["grid_points"] / 1e3)


def test_floor_split_row_lowers_the_floor_and_says_where_no_split_exists():
    graph = training_graph(6, seed=3)
    row = row_of("synthetic", graph, 8, "fixed", [2, 4])
    assert row["floor_pct"] > row["k2_pct"] > row["k4_pct"] > 0
    assert row["split_peak_pct"] >= row["k4_pct"] and row["region_ops"] > 0
    single = row_of("synthetic", graph, 1, "fixed", [2])
    assert single["k2_pct"] == single["floor_pct"] and single["parts_note"] == "batch 1: no split"
    few = row_of("synthetic", graph, 3, "fixed", [2, 4])  # four parts of three samples: three
    assert few["k4_pct"] < few["k2_pct"] and few["parts_note"] == "batch 3: 3 parts at most"
    assert floor_split_main(["--parts", "1"]) == 2
    assert floor_split_main(["--models", "no-such-model"]) == 2
    assert split_measured_main(["--parts", "1"]) == 2 and split_measured_main(["--runs", "0"]) == 2


def test_a_parts_probe_says_which_limit_its_closest_plan_misses():
    """A split probe whose plans fit the device but not the host says so, by how much it misses the host,
    not as a negative miss of the device budget."""
    def evaluation(excess_gib: float, host_gib: float) -> Evaluation:
        return Evaluation(None, {"host_peak_bytes": host_gib * 2**30, "overhead": 1.0, "step_s": 1.0}, False,
                          int(excess_gib * 2**30))

    class Found:
        outcomes = {8: Outcome([evaluation(-3.0, 70.0), evaluation(-1.0, 66.5)], None),
                    16: Outcome([evaluation(0.5, 10.0), evaluation(0.25, 10.0)], None),
                    32: Outcome([evaluation(-1.0, 60.0)], evaluation(-1.0, 60.0)),
                    64: Outcome([evaluation(-1.0, 60.0)], None)}

    assert _parts_outcome(Found, 8, 64 * 2**30) == "8p misses the host limit by 2.50 GiB"
    assert _parts_outcome(Found, 16, 64 * 2**30) == "16p misses by 0.25 GiB"
    assert _parts_outcome(Found, 32, 64 * 2**30) == "32p 100%"
    assert _parts_outcome(Found, 64, 64 * 2**30) == "64p fits both, none chosen"


# twice the batch that fits, and five times it (-m long)
@pytest.mark.parametrize("batch", [346, pytest.param(865, marks=pytest.mark.long)])
def test_no_plan_the_search_finds_is_faster_than_the_any_plan_bound(batch):
    """``simulator.split.overhead_bound`` is a lower bound: on ResNet-50 past the batch that fits, no plan the
    search tries that fits the device and the host (swaps and recomputations, on the step whole and split in 2
    parts) is faster than it."""
    device = get_device("v100-16gb")
    resnet = OpGraph.load(Path(__file__).resolve().parents[1] / "data" / "golden" / "resnet50.npz")
    graph = resnet.with_batch(batch)
    problem = TuningProblem(graph, device, device.budget_bytes,
                            space=SearchSpace.for_graph(graph, recompute=True))
    found = make_policy("optuna", seed=0).search(problem, optuna.create_study(), Budget(trials=40))
    fitting = [e.metrics["overhead"] for e in found.evaluations
               if e.excess_bytes <= 0 and e.metrics["host_peak_bytes"] <= device.host_memory_bytes]
    split = search_parts(parts_to_search(graph, device.budget_bytes, 0), lambda g: TuningProblem(
        g, device, device.budget_bytes, space=SearchSpace.for_graph(g, recompute=True), captured=graph),
        make_policy("optuna", seed=0), Budget(trials=20))
    fitting += [e.metrics["overhead"] for outcome in split.outcomes.values() for e in outcome.evaluations
                if e.excess_bytes <= 0 and e.metrics["host_peak_bytes"] <= device.host_memory_bytes]
    bound = least_overhead(graph, device)
    assert len(fitting) >= 5 and split.parts == 2 and bound.overhead > 0.01
    assert min(fitting) >= bound.overhead
