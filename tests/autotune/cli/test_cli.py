"""The command line: bad input ends in one line and exit 2, a report is always complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from autotune.cli.command import main  # noqa: E402
from tests.cli_tools import quick_args  # noqa: E402
from autotune.search.study_copy import optuna_storage  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A small CNN saved compiled, the same saved uncompiled, and a file that is no model."""
    import keras

    from benchmarks.models import build_model

    base = tmp_path_factory.mktemp("models")
    good = base / "good"
    good.mkdir()
    build_model("small_cnn", image_size=32).save(good / "cnn.keras")
    plain = base / "uncompiled"
    plain.mkdir()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.save(plain / "plain.keras")
    fake = base / "fake"
    fake.mkdir()
    (fake / "model.keras").write_text("this is not a model")
    two = base / "two"
    two.mkdir()
    for name in ("a.keras", "b.keras"):
        (two / name).write_bytes((good / "cnn.keras").read_bytes())
    (base / "empty").mkdir()
    bad_toml = base / "bad_toml"
    bad_toml.mkdir()
    (bad_toml / "cnn.keras").write_bytes((good / "cnn.keras").read_bytes())
    (bad_toml / "autotune.toml").write_text("batch_size = [oops\n")
    bad_rewrite = base / "bad_rewrite"
    bad_rewrite.mkdir()
    (bad_rewrite / "cnn.keras").write_bytes((good / "cnn.keras").read_bytes())
    (bad_rewrite / "autotune.toml").write_text('graph_rewrites = ["fold-everything"]\n')
    return base


def _run_main(capsys, *args):
    try:
        code = main(quick_args(args))
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("case,extra,message", [
    ("missing", [], "does not exist"),
    ("empty", [], "no .keras model"),
    ("fake", [], "is not a Keras model archive"),
    ("uncompiled", [], "not compiled"),
    ("two", [], "holds 2 models"),
    ("bad_toml", [], "not valid TOML"),
    ("good", ["--memory", "lots"], "not a size"),
    ("good", ["--memory=-3GiB"], "not a size"),
    ("good", ["--memory"], "expected one argument"),
    ("good", ["--device", "tpu-9000"], "invalid choice"),
    ("good", ["--batch-size", "0"], "batch size must be positive"),
    ("good", ["--rewrite", "fold-everything"], "unknown graph rewrite"),
    ("bad_rewrite", [], "autotune.toml: graph_rewrites: unknown graph rewrite"),
    ("good", ["--out", "/proc/autotune-test/out"], "cannot create --out"),
])
def test_bad_input_is_one_line_and_exit_2(models, capsys, tmp_path, case, extra, message):
    args = [models / case, "--out", tmp_path / "out", "--no-measure", "--trials", "3"]
    if "--batch-size" not in extra:
        args += ["--batch-size", "4"]
    code, _, err = _run_main(capsys, *args, *extra)
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if not line.startswith(("loading", "WARNING", "I0000"))]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err
    assert "Traceback" not in err


def test_a_storage_file_that_is_no_study_is_refused_and_left_alone(models, capsys, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    code, _, err = _run_main(capsys, models / "good", "--batch-size", "4", "--out", tmp_path / "out", "--no-measure",
                             "--quiet", "--storage", notes)
    assert code == 2 and "neither an Optuna journal nor an SQLite database" in err and "Traceback" not in err, err
    assert notes.read_text() == "my notes\n"


def test_missing_batch_size(models, capsys, tmp_path):
    code, _, err = _run_main(capsys, models / "good", "--out", tmp_path / "out", "--no-measure")
    assert code == 2 and "batch size" in err


def test_maximize_batch_needs_no_batch_size_and_keeps_the_plan_it_found(models, capsys, tmp_path):
    """The batch search's plan at the batch it picks is the answer even when --trials is too few
    to find one again (3 trials here: on their own they find none at that batch)."""
    code, out, err = _run_main(capsys, models / "good", "--maximize-batch", "--memory", "2MiB", "--device",
                               "cpu-testbed", "--no-measure", "--out", tmp_path / "out", "--trials", "3", "--quiet")
    assert code == 0, out + err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert f"largest batch that fits: {summary['batch_size']} " in out
    assert summary["batch_size"] > summary["max_batch_without_swap"] >= 1
    assert summary["feasible"] and summary["predicted_peak_bytes"] <= summary["budget_bytes"]
    assert (tmp_path / "out" / "plan.json").exists()


def test_budget_below_the_weights_exits_3(models, capsys, tmp_path):
    out = tmp_path / "out"
    code, stdout, err = _run_main(capsys, models / "good", "--batch-size", "4", "--memory", "10KiB", "--no-measure",
                                  "--trials", "5", "--out", out, "--quiet")
    assert code == 3, err
    assert "weights" in stdout and "verdict: Does not fit" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["feasible"] is False and summary["excess_bytes"] > 0
    assert (out / "report.html").exists() and (out / "report.md").exists()


def test_reordering_alone_can_be_the_plan(models, capsys, tmp_path):
    """A budget the memory order meets without swapping: the plan is that order, and it is written
    (a plan with no swaps is still a plan when it changes the order the step runs in); with --no-plots
    (``quick_args``) the report has no figures."""
    from benchmarks.models import build_model
    from rewriter.trace.tracing import capture

    from simulator import replay

    graph = capture(build_model("small_cnn", image_size=32), 64)
    unswapped = replay(graph, None, "cpu-testbed").peak_bytes
    reordered = replay(graph.with_order("memory"), None, "cpu-testbed").peak_bytes
    assert reordered < unswapped
    out = tmp_path / "out"
    code, stdout, err = _run_main(capsys, models / "good", "--batch-size", "64", "--memory",
                                  str((reordered + unswapped) // 2), "--device", "cpu-testbed", "--no-measure",
                                  "--trials", "40", "--out", out, "--quiet")
    assert code == 0, err + stdout
    plan = json.loads((out / "plan.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["feasible"] and summary["predicted_peak_bytes"] < summary["baseline_peak_bytes"]
    # nothing is faster than not swapping, and ties go to the plan moving the fewest bytes
    assert plan["swaps"] == [] and plan["ordering"] == "memory" and len(plan["order"]) == graph.n_ops
    assert "swaps nothing" in (out / "report.md").read_text()
    assert not list(out.glob("*.png")) and "<img" not in (out / "report.html").read_text()


def test_tuned_report_is_complete(models, capsys, tmp_path):
    """A budget between the lowest swapping peak and the unswapped one, reordered: a plan that swaps is
    needed and found."""
    from benchmarks.models import build_model
    from rewriter.trace.tracing import capture

    from simulator import SwapParams, plan_swaps, replay

    graph = capture(build_model("small_cnn", image_size=32), 64)
    unswapped = replay(graph, None, "cpu-testbed").peak_bytes
    reordered = replay(graph.with_order("memory"), None, "cpu-testbed").peak_bytes  # no swaps, memory order
    lowest = replay(graph, plan_swaps(graph, SwapParams(threshold=1, lb=1, ub=8, sync="both")), "cpu-testbed").peak_bytes
    assert lowest < reordered <= unswapped
    budget = (lowest + reordered) // 2  # reordering alone is not enough: the plan must swap
    out = tmp_path / "out"
    code, stdout, err = _run_main(capsys, models / "good", "--batch-size", "64", "--memory", str(budget),
                                  "--device", "cpu-testbed", "--no-measure", "--trials", "40", "--out", out, "--quiet",
                                  "--plots")
    assert code == 0, err + stdout
    summary = json.loads((out / "summary.json").read_text())
    for key in ("params", "budget_bytes", "baseline_peak_bytes", "predicted_peak_bytes", "predicted_step_s",
                "baseline_step_s", "measured_peak_bytes", "measured_step_s", "measured_on", "batch_size", "feasible"):
        assert key in summary
    assert summary["feasible"] and summary["predicted_peak_bytes"] <= budget < summary["baseline_peak_bytes"]
    for name in ("report.html", "report.md", "trials.csv", "plan.json", "memory_timeline.png", "distance_histogram.png",
                 "optimization_history.png", "pareto_front.png"):
        assert (out / name).stat().st_size > 0, name
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "<img alt='memory_timeline.png'" in html
    plan = json.loads((out / "plan.json").read_text())
    assert plan["format"] == "swap-plan/6" and (plan["swaps"] or plan["recomputes"])


def test_recomputation_is_chosen_applied_and_measured_and_no_recompute_swaps_only(capsys, tmp_path):
    """On the v100-16gb preset's time model (a PCIe link: swapping costs), a budget 26 % under the
    unswapped peak: the default search recomputes (the plan file lists the recomputations), the
    measured run on the testbed builds them and confirms the plan (exit 0); ``--no-recompute`` swaps
    instead, at a larger simulated overhead."""
    from benchmarks.models import build_model
    from rewriter.trace.tracing import capture

    from simulator import replay

    model_dir = tmp_path / "cnn64"
    model_dir.mkdir()
    build_model("small_cnn", image_size=64).save(model_dir / "cnn.keras")
    graph = capture(build_model("small_cnn", image_size=64), 32)
    budget = int(0.74 * replay(graph, None, "v100-16gb").peak_bytes)
    common = [model_dir, "--batch-size", "32", "--memory", str(budget), "--trials", "60", "--quiet"]
    code, stdout, err = _run_main(capsys, *common, "--out", tmp_path / "both")
    assert code == 0, err + stdout
    summary = json.loads((tmp_path / "both" / "summary.json").read_text())
    plan = json.loads((tmp_path / "both" / "plan.json").read_text())
    # the testbed's measurement carried to the v100-16gb's prediction is what the budget holds (docs/design.md 6)
    assert summary["confirmed_by_measurement"] and summary["measured_rounds"][-1]["projected_bytes"] <= budget
    assert plan["recomputes"] and summary["recomputed_bytes"] > 0 and "recomputed" in stdout
    report = (tmp_path / "both" / "report.md").read_text()
    n = len(plan["recomputes"])
    assert f"recomputes {n} tensor{'s' * (n != 1)}" in report and ",," not in report and ", and" not in report
    assert summary["measured_clones_planned"] >= n and summary["measured_recompute_problems"] == []
    assert summary["measured_clones_survived"] == summary["measured_clones_planned"]
    assert f"{summary['measured_clones_survived']} of {summary['measured_clones_planned']} recomputed ops" in report
    code, stdout, err = _run_main(capsys, *common, "--no-recompute", "--no-measure", "--out", tmp_path / "swap")
    assert code == 0, err + stdout
    swap_only = json.loads((tmp_path / "swap" / "summary.json").read_text())
    assert swap_only["recomputes"] == [] and swap_only["swaps"] > 0
    assert swap_only["predicted_overhead"] > summary["predicted_overhead"]


def test_a_recomputation_plan_tensorflow_cannot_run_falls_back_to_the_best_swap_plan(capsys, tmp_path, monkeypatch):
    """The measured run of the chosen plan with recomputation fails in TensorFlow (the oneDNN cycle of docs/design.md 9
    did, at the first call): the tool searches swap plans only, measures the best one, and says why in
    the report's notes; the verdict is the swap plan's, confirmed (exit 0)."""
    import autotune.run.plan_run
    import tensorflow as tf
    from benchmarks.models import build_model
    from rewriter.trace.tracing import capture

    from simulator import replay

    measure_result = autotune.run.plan_run.measure_result
    failed = []

    def fail_with_recomputation(model, result, *args, **kwargs):
        if result.recomputes:
            failed.append(len(result.recomputes))
            raise tf.errors.InvalidArgumentError(None, None, "60 nodes in a cycle")
        return measure_result(model, result, *args, **kwargs)

    monkeypatch.setattr(autotune.run.plan_run, "measure_result", fail_with_recomputation)  # SingleDeviceRuns' own
    model_dir = tmp_path / "cnn64"
    model_dir.mkdir()
    build_model("small_cnn", image_size=64).save(model_dir / "cnn.keras")
    graph = capture(build_model("small_cnn", image_size=64), 32)
    budget = int(0.74 * replay(graph, None, "v100-16gb").peak_bytes)  # where the default search recomputes
    code, stdout, err = _run_main(capsys, model_dir, "--batch-size", "32", "--memory", str(budget), "--trials", "60",
                                  "--quiet", "--out", tmp_path / "out")
    assert failed, "the search chose no recomputation: nothing to fall back from"
    assert code == 0, err + stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["recomputes"] == [] and summary["swaps"] > 0
    # the testbed's measurement carried to the v100-16gb's prediction is what the budget holds (docs/design.md 6)
    assert summary["confirmed_by_measurement"] and summary["measured_rounds"][-1]["projected_bytes"] <= budget
    assert any("could not run" in note and "nodes in a cycle" in note for note in summary["notes"]), summary["notes"]


@pytest.mark.long  # the command line with a rewrite, measured: test_a_step_with_graph_rewrites_splits_under_its_floor
def test_graph_rewrites_end_to_end(capsys, tmp_path):
    """--rewrite split-concat --rewrite elide-broadcasts on a U-Net: the figures are of the
    rewritten step, the plan carries the rewrites, and the measured run of it agrees with the
    prediction."""
    from benchmarks.models import build_model
    from rewriter.trace.tracing import capture

    from simulator import SwapParams, plan_swaps, replay

    rewrites = ["split-concat", "elide-broadcasts"]
    model = build_model("unet3d", size=16, base_filters=4, depth=2)
    graph = capture(model, 2, graph_rewrites=rewrites)
    unswapped = replay(graph, None, "cpu-testbed").peak_bytes
    lowest = replay(graph, plan_swaps(graph, SwapParams(threshold=1, sync="both")), "cpu-testbed").peak_bytes
    assert lowest < unswapped
    model_dir = tmp_path / "unet"
    model_dir.mkdir()
    model.save(model_dir / "unet.keras")
    out = tmp_path / "out"
    code, stdout, err = _run_main(capsys, model_dir, "--batch-size", "2", "--device", "cpu-testbed", "--memory",
                                  str((lowest + unswapped) // 2), "--trials", "30", "--rewrite", "split-concat",
                                  "--rewrite", "elide-broadcasts", "--out", out, "--quiet")
    assert code == 0, err + stdout
    tiles = len(graph.meta["graph_rewrite_changes"]["elide-broadcasts"])
    assert f"graph rewrites: split-concat (2 ops), elide-broadcasts ({tiles} ops)" in stdout and tiles > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["graph_rewrites"] == rewrites and summary["feasible"] and summary["swaps"] > 0
    assert summary["baseline_peak_bytes"] == unswapped
    assert json.loads((out / "plan.json").read_text())["graph_rewrites"] == rewrites
    assert "split-concat: 2 op(s)" in (out / "report.md").read_text()
    assert abs(summary["measured_peak_bytes"] / summary["predicted_peak_bytes_at_measured_batch"] - 1) <= 0.15


def test_resume_keeps_finished_trials(models, capsys, tmp_path):
    import optuna

    out = tmp_path / "out"
    args = [models / "good", "--batch-size", "64", "--memory", "16MiB", "--device", "cpu-testbed", "--no-measure",
            "--out", out, "--quiet", "--study-name", "resume-test"]
    first = _run_main(capsys, *args, "--trials", "6")
    second = _run_main(capsys, *args, "--trials", "5")
    assert first[0] in (0, 3) and second[0] == first[0]
    study = optuna.load_study(study_name="resume-test", storage=optuna_storage(str(out / "study.log")))
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) >= 11


@pytest.mark.long  # an earlier version's study.db; the default journal's resume: test_resume_keeps_finished_trials
def test_a_study_db_in_out_is_resumed(models, capsys, tmp_path):
    """The default study is a journal file in --out (test_resume_keeps_finished_trials reads it); a
    study.db an earlier version wrote there is resumed instead, and a database given as a plain path
    is opened as a database, never appended to."""
    import optuna

    def complete(storage, name):
        return sum(t.state == optuna.trial.TrialState.COMPLETE
                   for t in optuna.load_study(study_name=name, storage=optuna_storage(storage)).trials)

    common = [models / "good", "--batch-size", "64", "--memory", "16MiB", "--device", "cpu-testbed", "--no-measure",
              "--quiet", "--trials", "4"]
    old = tmp_path / "old"
    old.mkdir()
    database = old / "study.db"
    assert _run_main(capsys, *common, "--out", old, "--study-name", "s", "--storage", f"sqlite:///{database}")[0] in (0, 3)
    first = complete(f"sqlite:///{database}", "s")
    assert _run_main(capsys, *common, "--out", old, "--study-name", "s")[0] in (0, 3)
    assert complete(str(database), "s") >= first + 4 and not (old / "study.log").exists()


def test_a_second_run_keeps_the_first_report(models, capsys, tmp_path):
    """Another batch size into the same --out: the first report moves to previous/, whole."""
    out = tmp_path / "out"
    common = [models / "good", "--memory", "300KiB", "--device", "cpu-testbed", "--no-measure", "--out", out,
              "--trials", "3"]
    first = _run_main(capsys, *common, "--batch-size", "64", "--quiet")
    assert first[0] in (0, 3), first[2]
    before = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file() and path.name != "study.log"}
    assert "report.html" in before and json.loads(before["summary.json"])["batch_size"] == 64
    second = _run_main(capsys, *common, "--batch-size", "32")
    assert second[0] in (0, 3), second[2]
    (kept,) = (out / "previous").iterdir()
    model_name = json.loads(before["summary.json"])["model"]  # the model's own name, not the file's
    assert kept.name.endswith(f"-{model_name}-b64") and "is now in" in second[2]
    assert {path.name: path.read_bytes() for path in kept.iterdir()} == before
    assert json.loads((out / "summary.json").read_text())["batch_size"] == 32


# -m long: the default run resumes in test_a_study_db_in_out_is_resumed and keeps the old report in
# test_a_second_run_keeps_the_first_report
@pytest.mark.long
def test_interrupted_run_resumes_and_keeps_the_old_report(models, tmp_path):
    """SIGINT in the middle of a search: exit 130, trials kept, the earlier report untouched."""
    out = tmp_path / "out"
    common = [sys.executable, "-m", "autotune", str(models / "good"), "--batch-size", "64", "--memory", "16MiB",
              "--device", "cpu-testbed", "--no-measure", "--out", str(out), "--study-name", "sigint"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(common + ["--trials", "3", "--quiet"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 3), done.stderr
    before = (out / "report.html").read_bytes()
    process = subprocess.Popen(common + ["--trials", "100000"], env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + 240
    import optuna

    storage = optuna_storage(str(out / "study.log"))
    while time.monotonic() < deadline and process.poll() is None:  # until the second run has added trials
        time.sleep(2)
        try:
            trials = optuna.load_study(study_name="sigint", storage=storage).trials
        except Exception:
            continue
        if len([t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]) > 10:
            break
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "resume" in err, err
    assert (out / "report.html").read_bytes() == before
    kept = [t for t in optuna.load_study(study_name="sigint", storage=storage).trials
            if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(kept) > 10
    again = subprocess.run(common + ["--trials", "2", "--quiet"], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode in (0, 3), again.stderr
    resumed = optuna.load_study(study_name="sigint", storage=storage).trials
    assert len([t for t in resumed if t.state == optuna.trial.TrialState.COMPLETE]) >= len(kept) + 2


def test_a_budget_between_the_split_and_the_unsplit_floor_splits(capsys, tmp_path):
    """A budget 30 % under the floor of every plan that moves whole tensors (a convolution's gradient with its
    inputs and outputs): the ops that set it run in parts along the batch, the plan file holds the region, and
    the measured run confirms the plan (exit 0), and the report names where the region ends and why; ``--no-split`` (or ``split = false`` in autotune.toml) exits 3
    naming the floor and what a split would reach (docs/design.md 12)."""
    from rewriter.trace.tracing import capture
    from simulator.buffers import peak_lower_bound_bytes
    from simulator.split import floor_after_splitting
    from autotune.run.floor import split_lines
    from tests.rewriter.edit.test_split_parts import _cnn, _wide_cnn

    model_dir = tmp_path / "wide"
    model_dir.mkdir()
    _wide_cnn().save(model_dir / "wide.keras")
    graph = capture(_wide_cnn(), 8)
    floor = peak_lower_bound_bytes(graph)
    budget = int(0.7 * floor)
    assert floor_after_splitting(graph, 2).split_floor_bytes < budget
    common = [model_dir, "--batch-size", "8", "--memory", str(budget), "--trials", "60", "--quiet"]
    code, stdout, err = _run_main(capsys, *common, "--out", tmp_path / "split")
    assert code == 0, err + stdout
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    plan = json.loads((tmp_path / "split" / "plan.json").read_text())
    assert summary["confirmed_by_measurement"] and summary["measured_rounds"][-1]["projected_bytes"] <= budget
    assert plan["format"] == "swap-plan/6" and plan["splits"] and plan["splits"][0]["parts"] >= 2
    assert "along the batch" in stdout and "lowers the floor" in stdout
    parts = plan["splits"][0]["parts"]
    assert f"verdict: Fits with the batch split in {parts} parts" in stdout and summary["headline"] in stdout
    # the parts were searched with the plan (autotune.search.parts): 2, 4 and 8, the plan's among them
    searched = next(line for line in stdout.splitlines() if "the number of parts searched with the plan" in line)
    assert "2 parts: " in searched and f"chosen: {plan['splits'][0]['parts']} parts" in searched
    # where a region ends, the report names the op and why: Dropout's random op draws the whole batch's mask
    with_dropout = split_lines(floor_after_splitting(capture(_cnn(), 5), 2))
    assert "cannot run in parts exactly" in with_dropout and "StatelessRandomUniformV2: a Stateless" in with_dropout
    code, stdout, err = _run_main(capsys, *common, "--no-split", "--out", tmp_path / "whole")
    assert code == 3, err + stdout
    assert "Does not fit: no plan can peak under" in stdout and "without --no-split" in stdout
    (model_dir / "autotune.toml").write_text("split = false\n")
    code, stdout, _ = _run_main(capsys, *common, "--out", tmp_path / "toml")
    assert code == 3 and "without --no-split" in stdout


def test_a_step_with_graph_rewrites_splits_under_its_floor(capsys, tmp_path):
    """``--rewrite elide-broadcasts`` lowers the wide CNN's floor, and a budget 30 % under that lower floor splits
    the rewritten step: the plan file holds the rewrite and the regions, and the measured run confirms it."""
    from rewriter.trace.tracing import capture
    from simulator.buffers import peak_lower_bound_bytes
    from tests.rewriter.edit.test_split_parts import _wide_cnn

    model_dir = tmp_path / "wide"
    model_dir.mkdir()
    _wide_cnn().save(model_dir / "wide.keras")
    rewritten = peak_lower_bound_bytes(capture(_wide_cnn(), 8, graph_rewrites=["elide-broadcasts"]))
    assert rewritten < peak_lower_bound_bytes(capture(_wide_cnn(), 8))
    budget = int(0.7 * rewritten)
    code, stdout, err = _run_main(capsys, model_dir, "--batch-size", "8", "--memory", str(budget), "--trials", "60",
                                  "--rewrite", "elide-broadcasts", "--quiet", "--out", tmp_path / "out")
    assert code == 0, err + stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert summary["confirmed_by_measurement"] and summary["measured_rounds"][-1]["projected_bytes"] <= budget
    assert plan["graph_rewrites"] == ["elide-broadcasts"] and plan["splits"] and plan["splits"][0]["parts"] >= 2


def test_where_no_plan_fits_the_step_whole_its_ops_are_split(capsys, tmp_path):
    """The AdamW encoder block at batch 16 under 2.7 MiB, its optimizer state kept on the device (``--no-state``):
    over its floor (2.31 MiB) but under every plan of the step whole (the closest predicted at 3.07 MiB, measured
    higher), the search runs again on the step split along the batch (its parts in turn, ``micro-batch``, are
    among the orders searched), the measured run confirms that plan (exit 0) and the notes say why it was split;
    with ``--no-split`` the answer is "Does not fit" (docs/design.md 12). The state stays on the device because
    with it free to move a plan of the step whole fits in simulation here, and which path the run took would then
    hang on that plan's measured peak; the preset's step times (``--no-calibrate``) keep the search the same in
    every run."""
    from rewriter.trace.tracing import capture
    from simulator.buffers import peak_lower_bound_bytes
    from tests.rewriter.edit.test_split_parts import _adamw_block

    model_dir = tmp_path / "block"
    model_dir.mkdir()
    _adamw_block().save(model_dir / "block.keras")
    budget = int(2.7 * 2**20)
    assert peak_lower_bound_bytes(capture(_adamw_block(), 16)) <= budget
    common = [model_dir, "--batch-size", "16", "--memory", str(budget), "--trials", "30", "--no-state",
              "--no-calibrate", "--quiet"]
    code, stdout, err = _run_main(capsys, *common, "--out", tmp_path / "split")
    assert code == 0, err + stdout
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    plan = json.loads((tmp_path / "split" / "plan.json").read_text())
    assert "no plan fitted with the step whole: its ops are split along the batch" in stdout
    assert summary["confirmed_by_measurement"] and summary["measured_rounds"][-1]["projected_bytes"] <= budget
    assert not plan.get("host_state")
    parts = plan["splits"][0]["parts"]
    assert summary["headline"].startswith(f"Fits with the batch split in {parts} parts")
    code, stdout, err = _run_main(capsys, *common, "--no-split", "--out", tmp_path / "whole")
    assert code == 3, err + stdout
