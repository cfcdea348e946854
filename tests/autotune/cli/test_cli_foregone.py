"""A budget under the floor every plan needs ends right after capture: exit 3 in seconds, no calibration,
search or measured run, with what holds the floor and only the changes computed to get under the budget
(``autotune.run.floor``). The runs keep the optimizer state on the device (``--no-state``): moved, it brings
the U-Net's floor under the budget between the two floors (moving it: ``tests/autotune/cli/test_cli_state.py``)."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("tensorflow")

from autotune.cli.command import main  # noqa: E402

pytestmark = pytest.mark.tf
BATCH = 2


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    """The suite's small U-Net saved compiled, with its floor at BATCH with and without split-concat."""
    from benchmarks.zoo import SMALL
    from rewriter.trace.tracing import capture
    from simulator.buffers import peak_lower_bound_bytes

    model = SMALL["unet"].build()
    path = tmp_path_factory.mktemp("foregone") / "unet.keras"
    model.save(path)
    graph = capture(model, BATCH)
    split = capture(model, BATCH, graph_rewrites=["split-concat"])
    return path, graph.persistent_bytes, peak_lower_bound_bytes(graph), peak_lower_bound_bytes(split)


@pytest.fixture
def nothing_after_capture(monkeypatch):
    """Calibration, search and measured runs fail the test if they start."""
    import autotune.run.confirm as confirm

    def forbidden(*args, **kwargs):
        raise AssertionError("ran past the capture although the budget is under the floor")

    for name in ("calibrate_for", "confirm", "search_graph"):
        monkeypatch.setattr(confirm, name, forbidden)


def _run(capsys, path, budget_bytes: int, out, *extra: str):
    started = time.process_time()  # this process's CPU seconds: other work on the machine does not count
    code = main([str(path), "--batch-size", str(BATCH), "--memory", str(budget_bytes), "--device", "cpu-testbed",
                 "--no-plots", "--calibrate", "--no-state", "--out", str(out), *extra])
    captured = capsys.readouterr()
    return code, captured.out + captured.err, time.process_time() - started


def test_a_budget_between_the_rewritten_floor_and_the_floor_points_to_the_rewrite(unet, nothing_after_capture,
                                                                                    capsys, tmp_path):
    path, resident, floor, split_floor = unet
    assert resident < split_floor < floor  # the model is the case: its concatenation holds the floor
    budget = (split_floor + floor) // 2
    # --no-split: run in parts along the batch (docs/design.md 12), the ops that set the floor get under it too
    code, text, seconds = _run(capsys, path, budget, tmp_path / "out", "--no-split")
    assert code == 3, text
    assert seconds < 20, seconds
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["verdict"] == "does-not-fit" and summary["trials"] == 1  # the unswapped step only
    assert "(ConcatV2) needs its inputs and outputs" in summary["headline"]
    assert "optimizer slots" in summary["headline"] and "weights" in summary["headline"]
    assert "--rewrite split-concat lowers the floor to" in text and "within the budget" in text
    assert "along the batch in" in text  # what a split would reach is said too
    assert "no calibration, search or measured run" in text
    assert "elide-broadcasts" not in text  # it does not touch the concatenation: not computed, not suggested


def test_a_budget_under_every_floor_suggests_nothing_that_cannot_reach_it(unet, nothing_after_capture, capsys,
                                                                          tmp_path):
    path, resident, floor, split_floor = unet
    code, text, seconds = _run(capsys, path, resident // 2, tmp_path / "out")
    assert code == 3, text
    assert seconds < 20, seconds
    assert "--rewrite split-concat lowers the floor only to" in text and "still over the budget" in text
    assert "lowers the floor to" not in text
    assert "no batch size gets under the budget" in text


def test_a_mixed_precision_models_state_that_cannot_move_is_said_with_why(nothing_after_capture, capsys, tmp_path):
    """Under the floor with Keras' LossScaleOptimizer (mixed precision; its update runs in a branch taken after
    every gradient is checked), whose state the tool does not move: the command says so and why beside the floor
    (exit 3 right after capture)."""
    import keras

    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x = keras.Input((256,))
        model = keras.Model(x, keras.layers.Dense(10, dtype="float32")(keras.layers.Dense(1024, activation="relu")(x)))
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),  # kept by the file
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    path = tmp_path / "mixed.keras"
    model.save(path)
    code = main([str(path), "--batch-size", str(BATCH), "--memory", "1MiB", "--device", "cpu-testbed", "--calibrate",
                 "--no-plots", "--out", str(tmp_path / "out")])  # the state may move: it is the optimizer that keeps it
    text = "".join(capsys.readouterr())
    assert code == 3, text
    assert ("the optimizer state cannot move to the host: LossScaleOptimizer (mixed precision's loss scaling "
            "around Adam) applies the update inside a branch") in text
