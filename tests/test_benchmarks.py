"""The benchmark harness's plumbing (the benchmarks themselves run in minutes: `python -m benchmarks NAME`)."""

from __future__ import annotations

import pandas as pd

from benchmarks.__main__ import main as benchmarks_main
from benchmarks.common import per_second, write_results


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
