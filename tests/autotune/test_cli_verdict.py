"""The measured run decides the verdict: never "fits" when a measurement says otherwise.

An allocation the simulator cannot see is injected into the testbed's measurement (every measured
peak of the step grows by a fixed number of bytes): the tool must notice, correct, re-tune and
measure again, and say "fits" only when a measured run confirms it.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tensorflow")

from autotune.cli.command import main  # noqa: E402
from tests.cli_helpers import uncalibrated  # noqa: E402
from rewriter.placement.placements import CpuTestbedPlacement, PeakReading  # noqa: E402

pytestmark = pytest.mark.tf
BATCH = 64


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """A small CNN saved compiled, with the peaks the simulator predicts for it at BATCH."""
    from benchmarks.models import build_model
    from rewriter.trace.tracing import capture
    from simulator import SwapParams, plan_swaps, replay

    model = build_model("small_cnn", image_size=32)
    directory = tmp_path_factory.mktemp("verdict") / "cnn"
    directory.mkdir()
    model.save(directory / "cnn.keras")
    graph = capture(model, BATCH)
    unswapped = replay(graph, None, "cpu-testbed").peak_bytes
    lowest = replay(graph, plan_swaps(graph, SwapParams(threshold=1, lb=1, ub=8, sync="both")), "cpu-testbed").peak_bytes
    return directory, unswapped, lowest


def _inject(monkeypatch, extra_bytes: int) -> None:
    """Every measured peak on the testbed is ``extra_bytes`` higher: memory the simulator never sees."""
    original = CpuTestbedPlacement.measure_peak

    def measure_peak(self, fn, *args, resident_bytes=None):
        reading = original(self, fn, *args, resident_bytes=resident_bytes)
        return PeakReading(peak_bytes=reading.peak_bytes + extra_bytes,
                           allocator_peak_bytes=reading.allocator_peak_bytes + extra_bytes,
                           host_peak_bytes=reading.host_peak_bytes, resident_bytes=reading.resident_bytes)

    monkeypatch.setattr(CpuTestbedPlacement, "measure_peak", measure_peak)


def _run(capsys, *args):
    code = main(uncalibrated(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _outputs_agree(out, stdout: str) -> dict:
    """The CLI's verdict line, the report's headline and summary.json say the same."""
    summary = json.loads((out / "summary.json").read_text())
    assert f"verdict: {summary['headline']}" in stdout
    assert f"**{summary['headline']}**" in (out / "report.md").read_text()
    return summary


def test_a_confirmed_plan_fits_and_says_so(cnn, capsys, tmp_path):
    directory, unswapped, lowest = cnn
    budget = (unswapped + lowest) // 2
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, directory, "--batch-size", BATCH, "--memory", budget, "--device", "cpu-testbed",
                             "--trials", 30, "--out", out, "--quiet")
    summary = _outputs_agree(out, stdout)
    assert code == 0, stdout + err
    # the plan may swap or only reorder (the memory order alone can meet this budget): confirmed either way
    assert summary["verdict"] in ("fits", "fits-without-swapping") and summary["confirmed_by_measurement"] is True
    assert summary["measured_peak_bytes"] <= budget and summary["measured_batch_size"] == BATCH
    assert summary["measured_rounds"][-1]["confirmed"]


def test_an_unseen_allocation_is_measured_corrected_and_confirmed(cnn, capsys, tmp_path, monkeypatch):
    """The first plan, measured with the unseen bytes, misses; the tool re-tunes with the miss
    budgeted for and confirms a plan that leaves room for it."""
    directory, unswapped, lowest = cnn
    budget = (unswapped + lowest) // 2
    extra = (budget - lowest) // 3
    _inject(monkeypatch, extra)
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, directory, "--batch-size", BATCH, "--memory", budget, "--device", "cpu-testbed",
                             "--trials", 40, "--out", out, "--quiet")
    summary = _outputs_agree(out, stdout)
    rounds = summary["measured_rounds"]
    assert len(rounds) >= 2 and not rounds[0]["confirmed"], rounds
    assert code == 0 and summary["confirmed_by_measurement"], stdout + err
    assert summary["measured_peak_bytes"] <= budget  # the injected bytes included
    assert summary["search_budget_bytes"] < budget and summary["peak_correction"]["excess_bytes"] > 0


def test_a_measurement_the_budget_cannot_absorb_is_never_a_fit(cnn, capsys, tmp_path, monkeypatch):
    """So much unseen memory that no plan can leave room for it: exit 3, and no output says it fits."""
    directory, unswapped, lowest = cnn
    budget = (unswapped + lowest) // 2
    _inject(monkeypatch, budget)  # the step needs twice the budget whatever is swapped
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, directory, "--batch-size", BATCH, "--memory", budget, "--device", "cpu-testbed",
                             "--trials", 20, "--out", out, "--quiet")
    summary = _outputs_agree(out, stdout)
    assert code == 3, stdout + err
    assert summary["verdict"] in ("not-confirmed", "does-not-fit") and not summary["confirmed_by_measurement"]
    assert not summary["headline"].startswith("Fits")
    assert summary["measured_rounds"] and not any(r["confirmed"] for r in summary["measured_rounds"])
    assert "Fits" not in (out / "report.md").read_text().split("## Prediction")[0]


def test_fits_without_swapping_is_checked_on_model_fit_s_own_step(cnn, capsys, tmp_path):
    """A budget the unswapped step fits: model.fit's own step is measured too, and the verdict says
    which step to train with."""
    directory, unswapped, _ = cnn
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, directory, "--batch-size", BATCH, "--memory", 4 * unswapped, "--device",
                             "cpu-testbed", "--trials", 5, "--out", out, "--quiet")
    summary = _outputs_agree(out, stdout)
    assert code == 0, stdout + err
    assert summary["verdict"] == "fits-without-swapping" and summary["confirmed_by_measurement"]
    assert summary["measured_plain_fit_peak_bytes"] > 0
    expected = "plain-fit" if summary["measured_plain_fit_peak_bytes"] <= 4 * unswapped else "serialized-step"
    assert summary["train_with"] == expected


def test_no_measure_says_it_is_a_prediction(cnn, capsys, tmp_path):
    directory, unswapped, lowest = cnn
    out = tmp_path / "out"
    code, stdout, _ = _run(capsys, directory, "--batch-size", BATCH, "--memory", (unswapped + lowest) // 2,
                           "--device", "cpu-testbed", "--trials", 20, "--out", out, "--quiet", "--no-measure")
    summary = _outputs_agree(out, stdout)
    assert code == 0 and summary["prediction_only"] and not summary["confirmed_by_measurement"]
    assert "predicted only" in summary["headline"]
