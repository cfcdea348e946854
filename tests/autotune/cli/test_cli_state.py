"""The command line on a model whose optimizer state alone is over the budget: the 3x1024 Dense MLP with
AdamW (27.2 MiB resident, 18.1 MiB of it Adam's slots). With the default search the slots of the largest
variables move to the host, the measured run on the testbed confirms the plan, exit 0; with ``--no-state``
(or ``state = false`` in autotune.toml) the state stays and no plan fits, exit 3. Under the floor with every slot
moved, the weights move with their slots (mode ``host-weights``). Where neither a split nor moved state gets under the
floor alone, the split is chosen by its floor with the state moved and the plan does both."""

from __future__ import annotations

import tests.tf_tools as th  # noqa: F401,I001 -- first: configures TF before its runtime starts

import json

import keras
import pytest

import rewriter

from autotune.cli.command import EXIT_NO_FIT, EXIT_OK, main
from autotune.run.options import SearchOptions
from autotune.run.target import resolve_target
from autotune.run.tuning import search_graph
from simulator import get_device
from simulator.state import HostState
from simulator.state.host_update import host_cpu_seconds
from benchmarks.models import example_batch
from tests.cli_tools import quick_args
from tests.rewriter.state.test_state import dense_mlp

pytestmark = pytest.mark.tf
MiB = 2**20
BUDGET = "24MiB"  # under the 27.2 MiB of weights, slots and inputs; over the 17.2 MiB peak with every slot moved


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mlp_adamw")
    dense_mlp("adamw").save(directory / "mlp.keras")
    return directory


def _run(capsys, *args):
    code = main(quick_args(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_state_over_the_budget_moves_to_the_host_and_is_confirmed(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code, text = _run(capsys, model_dir, "--batch-size", "8", "--memory", BUDGET, "--device", "cpu-testbed",
                      "--trials", "20", "--out", out, "--quiet")
    assert code == EXIT_OK, text
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert summary["confirmed_by_measurement"] and summary["host_state"]
    assert [item["variable"] for item in plan["host_state"]] == summary["host_state"]
    assert summary["measured_peak_bytes"] <= 24 * MiB
    assert abs(summary["measured_peak_bytes"] / summary["predicted_peak_bytes_at_measured_batch"] - 1) <= 0.05
    assert summary["host_state_bytes"] < 18.2 * MiB  # the largest variables first, not every slot
    assert "optimizer state on the host" in text and "optimizer slots" in (tmp_path / "out" / "report.md").read_text()
    # checked against what the plan leaves resident: no correction before a measured run, so the same as predicted
    (check,) = summary["measured_rounds"]
    assert check["corrected_bytes"] == check["predicted_bytes"] and check["confirmed"]


def test_a_measured_plan_that_moves_state_is_carried_to_the_target_by_what_it_leaves_resident(model_dir, tmp_path,
                                                                                             capsys):
    """For v100-16gb in 24 MiB, measured on the testbed: the miss measured there is carried to the target's
    prediction by the memory above what the plan leaves resident (its state moved), so the plan the search chose is
    confirmed in its first round (the moved slots are not resident: counted as such, any plan that moves state
    would project to at least their 27.2 MiB)."""
    out = tmp_path / "out"
    code, text = _run(capsys, model_dir, "--batch-size", "8", "--memory", BUDGET, "--device", "v100-16gb",
                      "--trials", "20", "--out", out, "--quiet")
    assert code == EXIT_OK, text
    summary = json.loads((out / "summary.json").read_text())
    (check,) = summary["measured_rounds"]
    assert check["confirmed"] and check["corrected_bytes"] == check["predicted_bytes"]
    assert summary["host_state"] and check["projected_bytes"] <= 24 * MiB
    assert abs(check["projected_bytes"] / check["target_predicted_bytes"] - 1) <= 0.05


def test_no_state_keeps_the_old_verdict(model_dir, tmp_path, capsys):
    code, text = _run(capsys, model_dir, "--batch-size", "8", "--memory", BUDGET, "--device", "cpu-testbed",
                      "--trials", "20", "--out", tmp_path / "out", "--quiet", "--no-state")
    assert code == EXIT_NO_FIT, text
    (model_dir / "autotune.toml").write_text("state = false\n")
    try:
        code, text = _run(capsys, model_dir, "--batch-size", "8", "--memory", BUDGET, "--device", "cpu-testbed",
                          "--trials", "20", "--out", tmp_path / "out2", "--quiet", "--no-measure")
    finally:
        (model_dir / "autotune.toml").unlink()
    assert code == EXIT_NO_FIT, text


def test_under_the_floor_with_every_slot_moved_the_weights_move_too_and_are_confirmed(model_dir, tmp_path, capsys):
    """12 MiB: under the floor with every slot on the host (9 MiB of weights stay), over the one with the weights
    moved with them: the plan keeps the largest weights and their slots on the host (mode host-weights), the
    measured run confirms it within 5 % of the prediction, exit 0."""
    out = tmp_path / "out"
    code, text = _run(capsys, model_dir, "--batch-size", "8", "--memory", "12MiB", "--device", "cpu-testbed",
                      "--trials", "20", "--out", out, "--quiet")
    assert code == EXIT_OK, text
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert summary["confirmed_by_measurement"] and plan["format"] == "swap-plan/6"
    assert plan["host_state"] and all(item["mode"] == "host-weights" for item in plan["host_state"])
    assert summary["measured_peak_bytes"] <= 12 * MiB
    assert abs(summary["measured_peak_bytes"] / summary["predicted_peak_bytes_at_measured_batch"] - 1) <= 0.05


def _simulated_beside_a_gpu(capsys, model_dir, tmp_path, memory: str) -> tuple[dict, dict, str]:
    """summary.json, plan.json and the words of the command simulating the MLP at batch 8 for v100-16gb in
    ``memory`` (exit 0); report.md beside them in ``tmp_path / "out"``."""
    out = tmp_path / "out"
    code, text = _run(capsys, model_dir, "--batch-size", "8", "--memory", memory, "--device", "v100-16gb",
                      "--trials", "20", "--out", out, "--quiet", "--no-measure")
    assert code == EXIT_OK, text
    return json.loads((out / "summary.json").read_text()), json.loads((out / "plan.json").read_text()), text


@pytest.fixture(scope="module")
def captured(model_dir):
    """The saved MLP's step at batch 8, as the command captures it."""
    return rewriter.capture(keras.models.load_model(model_dir / "mlp.keras"), 8)


def _searched_beside_a_gpu(captured, memory_mib: int):
    """The search the command runs for v100-16gb in ``memory_mib`` MiB with --no-measure (quick_args)."""
    return search_graph(captured, resolve_target("v100-16gb", memory_mib * MiB), SearchOptions(trials=20))


def test_beside_a_gpu_the_hosts_update_is_part_of_the_predicted_step(captured):
    """Simulated for v100-16gb in 17 MiB (where no slot of the two largest kernels fits streamed): the plan's update
    runs on the host's CPU at the preset's rate (its ops take no GPU time), and the summary says how much of the
    step that is."""
    result = _searched_beside_a_gpu(captured, 17)
    summary = result.summary()
    assert summary["host_state"] and all(item.mode == "host-update" for item in result.plan.host_state)
    device = get_device("v100-16gb")
    variables = len(summary["host_state"])
    # at least the slots and each weight with its gradient: more than the slots' bytes alone at the preset's rate
    assert summary["predicted_host_update_s"] > device.host_update_s(variables, summary["host_state_bytes"])
    assert summary["predicted_step_s"] > summary["predicted_host_update_s"]


def test_beside_a_gpu_the_slots_are_streamed_where_that_is_faster(captured):
    """Simulated for v100-16gb in 24 MiB: the two largest kernels' slots fit updated on the host (19.27 MiB, a
    step of 11.76 ms, 7.50 of them the host's CPU) and streamed in and out around the update on the GPU (23.16 MiB,
    9.89 ms, 3.77 of them the host's CPU writing the slots): the plan streams them (mode stream-slots) and the
    host's CPU runs their writes alone, the slots' bytes at the preset's rate."""
    result = _searched_beside_a_gpu(captured, 24)
    summary = result.summary()
    assert result.plan.host_state and all(item.mode == "stream-slots" for item in result.plan.host_state)
    assert summary["host_state_bytes"] < 18.2 * MiB and summary["predicted_peak_bytes"] <= 24 * MiB
    device = get_device("v100-16gb")
    assert summary["predicted_host_update_s"] == pytest.approx(
        device.host_update_s(len(result.plan.host_state), summary["host_state_bytes"]))
    assert any("streamed in and out around their update on the device" in note for note in result.notes)


def test_beside_a_gpu_a_group_that_fits_only_partly_streamed_mixes_the_modes(model_dir, captured, tmp_path, capsys):
    """Simulated for v100-16gb in 20 MiB: the two largest kernels' slots do not fit streamed (23.16 MiB) and fit
    updated on the host (a step of 11.76 ms); one kernel's streamed and the other's updated on the host fits too
    (19.16 MiB) and is faster (10.83 ms): the plan mixes the modes, and the host's CPU runs one update and one
    kernel's slot writes."""
    summary, plan, text = _simulated_beside_a_gpu(capsys, model_dir, tmp_path, "20MiB")
    modes = {item["variable"]: item["mode"] for item in plan["host_state"]}
    assert sorted(modes.values()) == ["host-update", "stream-slots"] and summary["predicted_peak_bytes"] <= 20 * MiB
    graph = captured
    state = tuple(HostState(path, mode) for path, mode in modes.items())
    device = get_device("v100-16gb")
    assert summary["predicted_host_update_s"] == pytest.approx(host_cpu_seconds(graph, state, device))
    both_on_host = tuple(HostState(path) for path in modes)
    assert summary["predicted_host_update_s"] < host_cpu_seconds(graph, both_on_host, device)
    assert "1 streamed around an update on the device" in (tmp_path / "out" / "report.md").read_text()
    assert "of the step on the host's CPU" in text


def _conv_and_dense_head() -> keras.Model:
    """Two 32x32 convolutions of 64 channels (their working set grows with the batch) before two 1024-wide Dense
    layers (AdamW's state: 13 MiB resident with the weights)."""
    keras.utils.set_random_seed(0)
    x = keras.Input((32, 32, 3))
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    h = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h))
    h = keras.layers.Dense(1024, activation="relu")(keras.layers.Dense(1024, activation="relu")(h))
    model = keras.Model(x, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_split_is_chosen_by_its_floor_with_the_state_the_search_may_move():
    """Batch 32 in 16 MiB: the floor is 29.9 MiB, 16.5 with every movable state on the host, 21.7 split along the
    batch, 8.4 with both. Chosen by its floor alone no split fits (and the command stopped right after capture);
    by its floor with the state moved (``floor_of``, as the command does when the state may move) the fewest parts
    that fit are found, and the search runs on them with the state."""
    from autotune.run.floor import state_floor_bytes
    from autotune.search.parts import parts_to_search, split_floor, split_to_budget

    budget = 16 * MiB
    graph = rewriter.capture(_conv_and_dense_head(), 32)
    device = get_device("cpu-testbed")

    def floor_of(g):
        return state_floor_bytes(g, device)

    assert floor_of(graph) > budget and split_to_budget(graph, budget).split_floor_bytes > budget
    assert parts_to_search(graph, budget) == []
    found = split_to_budget(graph, budget, floor_of)
    assert found is not None and split_floor(found, floor_of) <= budget < found.split_floor_bytes
    assert [split.parts for split in parts_to_search(graph, budget, floor_of=floor_of)][0] == found.parts


@pytest.mark.long  # a MobileNetV2 at 64 px: a minute of the command
def test_a_split_and_state_on_the_host_together_where_neither_alone_fits(tmp_path, capsys):
    """A frozen MobileNetV2 (64 px) with RandomFlip, a 1280x2048 Dense head, Dropout and AdamW at batch 32 in 32
    MiB: the floor is 67.24 MiB, 62.48 split, 34.88 with every movable state on the host, 30.11 with both. The plan
    splits the backbone in 2 parts and keeps the head's weights and slots on the host (exit 0, measured within 5 %
    of the prediction: 30.33 MiB both); applied from plan.json it trains three steps as Keras does within the
    split's rounding (7.7e-7 relative)."""
    from simulator.plan import load_plan

    def frozen_backbone():
        keras.utils.set_random_seed(0)
        base = keras.applications.MobileNetV2(input_shape=(64, 64, 3), include_top=False, weights=None)
        base.trainable = False
        x = keras.Input((64, 64, 3))
        h = keras.layers.GlobalAveragePooling2D()(base(keras.layers.RandomFlip()(x), training=False))
        h = keras.layers.Dropout(0.3)(keras.layers.Dense(2048, activation="relu")(h))
        model = keras.Model(x, keras.layers.Dense(100)(h))
        model.compile(optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    batch, model_dir, out = 32, tmp_path / "model", tmp_path / "out"
    model_dir.mkdir()
    frozen_backbone().save(model_dir / "model.keras")
    code, text = _run(capsys, model_dir, "--batch-size", str(batch), "--memory", "32MiB", "--trials", "30", "--out",
                      out, "--quiet")
    assert code == EXIT_OK, text
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert plan["splits"] and plan["host_state"] and summary["confirmed_by_measurement"]
    assert abs(summary["measured_peak_bytes"] / summary["predicted_peak_bytes_at_measured_batch"] - 1) <= 0.05
    keras.utils.set_random_seed(0)  # RandomFlip's and Dropout's draws: the same in both
    reference = keras.models.load_model(model_dir / "model.keras")
    keras.utils.clear_session()  # the step's names as the command traced them
    keras.utils.set_random_seed(0)
    model = keras.models.load_model(model_dir / "model.keras")
    x, y = example_batch(model, batch)
    step = rewriter.apply(model, load_plan(out / "plan.json"), batch_size=batch, verify=False)
    for _ in range(3):
        assert float(step(x, y)) == pytest.approx(float(reference.train_on_batch(x, y)), rel=1e-6)
    assert th.max_relative_difference(th.weights_of(model), th.weights_of(reference)) <= 1e-5
