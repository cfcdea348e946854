"""``python -m autotune MODEL --replicas N`` (docs/design.md 14): refused in one line where it cannot run (exit 2,
before anything slow), and on the testbed of two replicas a verdict per device that each replica's measured peak
decides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.cli.command import main
from rewriter import environment
from tests.autotune.cli.test_cli_inputs import model_dir  # noqa: F401 -- a .keras archive never loaded
from tests.cli_tools import quick_args

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("flags,message", [
    (["--batch-size", "15", "--replicas", "2"], "--batch-size 15 does not split evenly over 2 replicas"),
    (["--batch-size", "16", "--replicas", "0"], "--replicas must be at least 1, got 0"),
])
def test_what_replicas_cannot_do_is_refused_in_one_line(model_dir, capsys, flags, message):
    code = main([str(model_dir), *flags])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


TWO_WORKERS = {"worker": ["127.0.0.1:20001", "127.0.0.1:20002"]}


@pytest.mark.parametrize("tf_config,flags,message", [
    ({"cluster": TWO_WORKERS, "task": {"type": "worker", "index": 0}}, ["--replicas", "2"],
     "TF_CONFIG names 2 workers: each runs a replica on each of its visible GPUs (one on its CPU testbed), so "
     "leave out --replicas"),
    ({"cluster": TWO_WORKERS, "task": {"type": "worker", "index": 0}}, ["--batch-size", "15"],
     "--batch-size 15 does not split evenly over the 2 workers' replicas"),
    ({"cluster": TWO_WORKERS, "task": {"type": "worker", "index": 2}}, [],
     "TF_CONFIG names 2 workers but its task {'type': 'worker', 'index': 2} is not one of them"),
    ({"cluster": {"worker": ["127.0.0.1:20001"], "ps": ["127.0.0.1:20003"]}}, [],
     "ParameterServerStrategy detected, which the tool does not support"),
    ("{not json", [], "TF_CONFIG is not a JSON object with a cluster"),
])
def test_what_a_tf_config_cannot_run_is_refused_in_one_line(model_dir, capsys, monkeypatch, tf_config, flags,
                                                             message):
    monkeypatch.setenv("TF_CONFIG", tf_config if isinstance(tf_config, str) else json.dumps(tf_config))
    code = main([str(model_dir), "--batch-size", "16", *flags])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_a_tf_config_of_one_worker_is_one_machine_and_several_gpus_are_said():
    from autotune.cli.replicas import check_tf_config, several_gpus_note

    assert several_gpus_note(1) is None and "tune with --replicas 4" in several_gpus_note(4)

    assert check_tf_config({"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:20001"]}})}) == 1
    assert check_tf_config({}) == 1
    chief = {"cluster": {"chief": ["127.0.0.1:20000"], **TWO_WORKERS}, "task": {"type": "chief", "index": 0}}
    assert check_tf_config({"TF_CONFIG": json.dumps(chief)}) == 3


@pytest.mark.tf
def test_beside_gpus_replicas_are_the_first_n_gpus_each_held_to_the_budget(monkeypatch):
    """``--replicas N`` beside visible GPUs (none here: TensorFlow's device list and strategies stood in for):
    ``MirroredStrategy`` over GPU:0..N-1, each GPU's memory limit the budget per device; more replicas than GPUs
    refused in one line; a TF_CONFIG's worker takes every GPU it sees, each held to the budget."""
    import contextlib

    import tensorflow as tf

    from autotune.cli.replicas import gpu_replicas, load_multi_worker, load_replicated
    from autotune.inputs import InputError

    gpus = [tf.config.PhysicalDevice(name=f"/physical_device:GPU:{k}", device_type="GPU") for k in range(3)]
    limits, strategies = {}, []

    class Strategy:
        def __init__(self, devices=None):
            strategies.append(devices)

        def scope(self):
            return contextlib.nullcontext()

    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: gpus if kind == "GPU" else [])
    monkeypatch.setattr(tf.config, "get_logical_device_configuration", lambda gpu: None)
    monkeypatch.setattr(tf.config, "set_logical_device_configuration",
                        lambda gpu, configs: limits.__setitem__(gpu.name, configs[0].memory_limit))
    monkeypatch.setattr(tf.distribute, "MirroredStrategy", Strategy)
    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy", Strategy)

    assert load_replicated(2, lambda: "loaded", 6 * 2**30) == "loaded"
    assert strategies == [["/device:GPU:0", "/device:GPU:1"]]
    assert limits == {"/physical_device:GPU:0": 6144, "/physical_device:GPU:1": 6144}
    limits.clear()
    assert load_replicated(3, lambda: "loaded") == "loaded" and strategies[-1] == gpu_replicas(3, 3) and not limits
    with pytest.raises(InputError, match="--replicas 4 needs 4 GPUs and 3 are visible: give --replicas 3 or less"):
        load_replicated(4, lambda: "loaded")
    assert load_multi_worker(lambda: "loaded", 2**30) == "loaded" and strategies[-1] is None
    assert sorted(limits.values()) == [1024] * 3


@pytest.mark.tf
def test_a_replicated_run_on_gpus_is_measured_there_at_the_requested_batch():
    """The measured run of a replicated plan on GPUs (built here without one: a ``Replicas`` on GPU:0 and GPU:1):
    at the requested batch on the GPUs themselves, said so; the machine's host memory is the one pinned
    allocator's peak every GPU row holds, not their sum (on the testbed each replica's host is its own)."""
    from dataclasses import replace

    from autotune.run.plan_run import ReplicatedRuns
    from autotune.run.tuning import MeasuredRun, tune_graph
    from rewriter.trace.replicas import Replicas
    from simulator.synthetic import training_graph

    graph = training_graph(12, batch_size=8)
    result = tune_graph(graph, device="v100-16gb", memory=int(0.7 * graph.persistent_bytes
                                                               + 0.3 * 12 * 4 * 2**20), trials=20, seed=0)
    gpus = tuple(f"/job:localhost/replica:0/task:0/device:GPU:{k}" for k in range(2))
    replicas = Replicas(None, gpus, ("/device:CPU:0",) * 2, 2, 0)
    planned = ReplicatedRuns(None, None, replicas).planned(result)
    assert planned.on_gpu and planned.batch == result.batch_size == 8 and planned.device is result.device
    assert planned.placement.accelerator == "/device:GPU:0" and "each of the 2 GPUs" in planned.note
    assert "global batch 16, 8 per replica" in planned.note

    meta = {"devices": list(gpus), "hosts": ["/device:CPU:0"] * 2, "in_sync": 2, "workers": 1,
            "per_replica_batch_size": 8, "all_reduce_bytes": 4096, "all_reduce_ops": 1}
    rows = tuple({"replica": k, "worker": 0, "device": device, "host": "/device:CPU:0", "measured_bytes": 1000 + k,
                  "host_peak_bytes": 5000, "resident_bytes": 100, "unowned_bytes": 0, "host_shared": True,
                  "swaps_verified": True, "swaps_survived": None} for k, device in enumerate(gpus))
    run = MeasuredRun(measured_on="gpu", batch_size=8, peak_bytes=1001, step_s=0.1, baseline_peak_bytes=None,
                      baseline_step_s=None, predicted_peak_bytes=1000, predicted_step_s=0.1,
                      predicted_baseline_peak_bytes=2000, replicas=rows)
    on_gpus = replace(result, graph=replace(result.graph, meta={**result.graph.meta, "replicas": meta}),
                      measurement=run)
    memory = on_gpus.replica_memory()
    assert memory["machine"]["measured_host_bytes"] == 5000
    assert memory["measured_on"] == "gpu" and len(memory["devices"]) == 2 and not memory["out_of_memory"]
    testbed = replace(run, measured_on="cpu-testbed", replicas=tuple({**row, "host_shared": False} for row in rows))
    assert replace(on_gpus, measurement=testbed).replica_memory()["machine"]["measured_host_bytes"] == 10000


@pytest.mark.tf
def test_tune_takes_the_strategy_the_model_was_built_under_and_refuses_others():
    """``autotune.tune(model, strategy=...)``: a strategy the model was not built in is a ValueError; a model built
    under a strategy the tool does not capture replicated is refused by the capture in one line."""
    import keras
    import tensorflow as tf

    from autotune.run.confirm import tune
    from rewriter.errors import CaptureError

    def small():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    with pytest.raises(ValueError, match="not built in this MirroredStrategy's scope"):
        tune(small(), batch_size=4, memory=2**20, strategy=tf.distribute.MirroredStrategy(["/cpu:0"]))
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        under_one_device = small()
    with pytest.raises(CaptureError, match="tf.distribute.OneDeviceStrategy is not supported") as refused:
        tune(under_one_device, batch_size=4, memory=2**20)
    assert len(str(refused.value).splitlines()) == 1


def test_under_the_floor_a_smaller_batch_is_said_as_the_replicas_global_batch():
    """One replica's step under its floor: the batch that would fit is per replica, the flag the global batch."""
    import re

    from autotune.run.floor import foregone
    from autotune.run.target import resolve_target
    from simulator.buffers import peak_lower_bound_bytes
    from simulator.synthetic import training_graph

    graph = training_graph(12, batch_size=8)
    target = resolve_target("cpu-testbed", peak_lower_bound_bytes(graph.with_batch(5))).per_replica(2)
    result = foregone(graph, target, state=False, split_allowed=False)
    found = re.search(r"at batch (\d+) per replica or less .* \(--batch-size (\d+) over 2 replicas\)", result.notes[-1])
    assert found and int(found[2]) == 2 * int(found[1]) and 5 <= int(found[1]) < 8, result.notes[-1]
    assert "--maximize-batch" not in result.notes[-1]


SAVE = """
import keras
keras.utils.set_random_seed(1)
convs = [keras.layers.Conv2D(8, 3, padding="same", activation="relu") for _ in range(4)]
model = keras.Sequential([keras.Input((24, 24, 3)), *convs, keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
model.compile(optimizer="adam", loss="mse")
model.save({path!r})
"""
# the command line, with every replica's measured peak ``extra`` bytes higher: memory the simulator never sees
INFLATED = """
import dataclasses, sys
import rewriter, rewriter.timing
measured = rewriter.timing.measure_replicas
rewriter.measure_replicas = lambda *args, **kwargs: tuple(
    dataclasses.replace(peak, peak_bytes=peak.peak_bytes + {extra}) for peak in measured(*args, **kwargs))
from autotune.cli.command import main
sys.exit(main(sys.argv[1:]))
"""
BUDGET = 700 * 1024  # under one replica's unswapped step: 801 KiB predicted at batch 8


def _saved(tmp_path_factory, name: str, code: str) -> Path:
    """A model directory holding the ``model.keras`` that ``code`` (a program with a ``{path}`` field) saves."""
    directory = tmp_path_factory.mktemp(name) / "model"
    directory.mkdir()
    subprocess.run([sys.executable, "-c", code.format(path=str(directory / "model.keras"))], check=True,
                   env=environment.testbed_environment(PYTHONPATH=str(ROOT)), capture_output=True, timeout=300)
    return directory


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The 4-conv stack saved compiled."""
    return _saved(tmp_path_factory, "replicas", SAVE)


def _autotune(saved, out: Path, *, extra_bytes: int = 0, memory: str = "700KiB", flags=("--replicas", 2),
              batch: int = 16):
    """The command line on the testbed (in a fresh process: N replicas need 2N logical CPUs before TensorFlow
    starts; this test's calibration cache)."""
    start = ["-m", "autotune"] if not extra_bytes else ["-c", INFLATED.format(extra=extra_bytes)]
    args = [saved, "--batch-size", batch, *flags, "--memory", memory, "--trials", 30, "--out", out, "--quiet"]
    return subprocess.run([sys.executable, *start, *(map(str, args) if "--calibrate" in flags else quick_args(args))],
                          env=environment.testbed_environment(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def _devices_confirmed(summary: dict, budget: int = BUDGET) -> list[dict]:
    memory = summary["replicas"]
    assert memory["per_replica_batch_size"] == 8 and memory["global_batch_size"] == 16
    assert [d["host"] for d in memory["devices"]] == ["/device:CPU:1", "/device:CPU:3"]
    for device in memory["devices"]:
        assert device["confirmed"] and device["swaps_verified"], device
        assert device["projected_bytes"] <= budget and device["budget_bytes"] == budget
    return memory["devices"]


@pytest.mark.tf
def test_two_replicas_on_the_testbed_are_each_measured_and_confirmed(saved, tmp_path):
    """A budget under the unswapped step's: a plan that swaps, each replica's peak measured within 5 % of the
    testbed's prediction, the verdict per device, and the report's memory per device and per machine (the host
    memory every replica's swaps share against the machine's host budget; the all-reduce pack)."""
    out = tmp_path / "out"
    done = _autotune(saved, out, flags=("--replicas", 2, "--plots"))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "fits" and summary["confirmed_by_measurement"]
    for device in _devices_confirmed(summary):
        assert abs(device["measured_bytes"] / device["predicted_where_measured_bytes"] - 1) <= 0.05
    assert summary["swaps"] or summary["recomputes"]
    assert summary["target"]["host_budget_source"].endswith("shared by 2 replicas: 32.00 GiB each")
    machine = summary["replicas"]["machine"]
    assert machine["host_budget_bytes"] == 64 * 2**30 and machine["within_budget"]
    assert machine["measured_host_bytes"] == sum(d["measured_host_bytes"] for d in summary["replicas"]["devices"]) > 0
    assert summary["replicas"]["all_reduce_bytes"] > 0
    assert summary["optimizer"]["class"] and summary["loss"]  # what was tuned, as for one device
    assert "not recorded" not in (out / "report.html").read_text()
    assert "on each of 2 devices" in summary["headline"] and f"verdict: {summary['headline']}" in done.stdout
    assert done.stdout.count(": confirmed\n") == 2, done.stdout
    report = (out / "report.html").read_text()
    assert "Devices and machine" in report and "budget per device" in report
    assert "host memory of the machine" in report and "all-reduce pack" in report
    assert (out / "replica_memory.png").is_file() and (out / "plan.json").is_file()


@pytest.mark.tf
@pytest.mark.long  # split regions on every replica: tests/rewriter/test_replicas.py in the default run
def test_a_budget_under_one_replicas_floor_splits_its_batch_on_every_replica(saved, tmp_path):
    """350 KiB per device: under one replica's floor at batch 8 (its last convolution's weight gradient beside the
    resident state, 369 KiB), over the floor of its batch in parts. With ``--no-split``: exit 3 (no plan fits with
    the optimizer state on the host either, though that bound is under the budget), naming the floor and what a split
    would reach (searched only: no plan of it is measured). Without it (and with ``--no-state``: the search after the
    state's is test_where_the_bound_with_state_moved_fits_but_no_state_plan_does_the_split_is_searched's): each
    replica's batch of 8 runs in parts on its own device, both replicas measured within 5 % of the prediction, under
    the unsplit floor, and confirmed."""
    budget = 350 * 1024
    refused = _autotune(saved, tmp_path / "unsplit", memory="350KiB",
                        flags=("--replicas", 2, "--no-split", "--no-measure"))
    assert refused.returncode == 3, refused.stdout + refused.stderr[-3000:]
    floor = json.loads((tmp_path / "unsplit" / "summary.json").read_text())["peak_lower_bound_bytes"]
    assert floor > budget and "splitting the ops that set the floor along the batch in 2 parts would lower it" \
        in refused.stdout and "(without --no-split)" in refused.stdout
    out = tmp_path / "split"
    done = _autotune(saved, out, memory="350KiB", flags=("--replicas", 2, "--no-state"))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    parts = plan["splits"][0]["parts"]
    assert summary["headline"].startswith(f"Fits with the batch split in {parts} parts") and parts >= 2, done.stdout
    assert summary["confirmed_by_measurement"], done.stdout
    for device in _devices_confirmed(summary, budget=budget):
        assert abs(device["measured_bytes"] / device["predicted_where_measured_bytes"] - 1) <= 0.05, done.stdout
        assert device["measured_bytes"] < floor


@pytest.mark.tf
def test_under_a_tf_config_of_two_workers_worker_0_tunes_and_every_worker_measures(saved, tmp_path):
    """The command run on both workers of a ``TF_CONFIG`` on 127.0.0.1 (``MultiWorkerMirroredStrategy``, one
    replica each): worker 0 searches, writes the report and decides; worker 1 measures each plan on its replica and
    prints worker 0's verdict. Both exit 0; each replica is measured within 5 % of the prediction and confirmed.
    Worker 1 writes worker 0's report and plan too (to train with on its machine), into a folder of the shared
    --out of its own, so neither moves the other's report away."""
    from tests.tf_tools import run_workers

    out = tmp_path / "out"
    args = [saved, "--batch-size", 16, "--memory", "700KiB", "--trials", 30, "--out", out, "--quiet"]
    chief, other = run_workers(["-m", "autotune", *quick_args(args)], 2, timeout=400)
    assert chief.returncode == 0 and other.returncode == 0, chief.stdout + chief.stderr[-3000:] + other.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    memory = summary["replicas"]
    assert memory["workers"] == 2 and memory["global_batch_size"] == 16 and memory["per_replica_batch_size"] == 8
    assert [(d["device"], d["host"], d["worker"]) for d in memory["devices"]] == [
        (f"/job:worker/replica:0/task:{k}/device:CPU:0", f"/job:worker/replica:0/task:{k}/device:CPU:1", k)
        for k in range(2)]
    for device in memory["devices"]:
        assert device["confirmed"] and device["projected_bytes"] <= BUDGET, device
        assert abs(device["measured_bytes"] / device["predicted_where_measured_bytes"] - 1) <= 0.05, device
    assert summary["verdict"] == "fits" and (summary["swaps"] or summary["recomputes"])
    assert "MultiWorkerMirroredStrategy (2 workers" in (out / "report.html").read_text()
    verdict = f"verdict: {summary['headline']}"
    assert verdict in chief.stdout and verdict in other.stdout and "on each of 2 devices" in verdict
    follower = out / "worker-1"
    assert f"report: {out / 'report.html'}" in chief.stdout and f"report: {follower / 'report.html'}" in other.stdout
    assert (follower / "plan.json").read_text() == (out / "plan.json").read_text()
    assert json.loads((follower / "summary.json").read_text())["headline"] == summary["headline"]
    assert not (out / "previous").exists() and not (follower / "previous").exists()


SAVE_MLP = """
import keras
keras.utils.set_random_seed(1)
layers = [keras.layers.Dense(512, activation="relu") for _ in range(3)]
model = keras.Sequential([keras.Input((256,)), *layers, keras.layers.Dense(4)])
model.compile(optimizer="adam", loss="mse")
model.save({path!r})
"""


@pytest.fixture(scope="module")
def saved_mlp(tmp_path_factory):
    """A 3x512 Dense stack with Adam, saved compiled: its slots (5.03 MiB) outweigh its activations."""
    return _saved(tmp_path_factory, "replicas_mlp", SAVE_MLP)


@pytest.mark.tf
@pytest.mark.long  # each replica's moved state, trained: tests/rewriter/test_replicas.py in the default run
def test_optimizer_slots_move_to_each_replicas_host_when_its_state_is_over_the_budget(saved_mlp, tmp_path):
    """10 MiB per device, under one replica's unswapped step (12.58 MiB, resident 7.55 MiB of which 5.03 MiB Adam's
    slots; its activations are a few KiB): with ``--no-state`` exit 3; without it the slots of the largest
    variables live on each replica's host, both replicas measured within 5 % of the prediction and confirmed; each
    host holds the slots moved there, and the machine's host memory measured lies between both replicas' moved slots
    and the prediction (an upper bound: which of the updates' copies and temporaries live together is the
    executor's choice)."""
    refused = _autotune(saved_mlp, tmp_path / "kept", memory="10MiB", flags=("--replicas", 2, "--no-state"))
    assert refused.returncode == 3, refused.stdout + refused.stderr[-3000:]
    assert "on the host (without --no-state) lower the floor" in refused.stdout
    out = tmp_path / "moved"
    done = _autotune(saved_mlp, out, memory="10MiB")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert summary["headline"].startswith("Fits with optimizer state on the host") and summary["host_state"]
    assert [item["variable"] for item in plan["host_state"]] == summary["host_state"]
    for device in _devices_confirmed(summary, budget=10 * 2**20):
        assert abs(device["measured_bytes"] / device["predicted_where_measured_bytes"] - 1) <= 0.05, done.stdout
        assert device["measured_host_state_bytes"] == summary["host_state_bytes"] > 0, device
        assert summary["host_state_bytes"] < device["measured_host_bytes"] <= device["predicted_host_bytes"], device
    machine = summary["replicas"]["machine"]
    assert machine["predicted_host_bytes"] == 2 * device["predicted_host_bytes"] and machine["within_budget"]
    assert 2 * summary["host_state_bytes"] < machine["measured_host_bytes"] <= machine["predicted_host_bytes"], machine


@pytest.mark.tf
def test_where_the_bound_with_state_moved_fits_but_no_state_plan_does_the_split_is_searched(saved, tmp_path):
    """One device, the same stack at batch 8 under 350 KiB: its floor with every weight and slot on the host is under
    the budget, so the search moves state first, but no such plan fits (the weights' copies in stay on the device:
    closest 1.95 KiB over); the split of the ops that set the floor is searched after (before, the answer was "Does
    not fit"). The search's order is what is checked, so nothing is measured: a split plan's measured run on one
    device is test_cli.py's ``test_a_budget_between_the_split_and_the_unsplit_floor_splits``."""
    out = tmp_path / "out"
    done = _autotune(saved, out, memory="350KiB", flags=("--no-measure",), batch=8)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["headline"].startswith("Fits with the batch split in") and summary["prediction_only"]
    assert "no plan fitted with the optimizer state on the host and the step whole" in done.stdout


@pytest.mark.tf
@pytest.mark.long  # --maximize-batch on one device: test_cli in the default run
def test_maximize_batch_finds_the_largest_batch_per_replica_and_measures_it_on_every_replica(saved, tmp_path):
    """--maximize-batch with --replicas 2 and no batch size: the capture starts at one sample a replica, the search
    picks the largest batch a replica's budget holds with a plan, and both replicas are measured at it (the global
    batch twice that) and confirmed."""
    out = tmp_path / "out"
    args = [saved, "--replicas", 2, "--maximize-batch", "--memory", "700KiB", "--trials", 30, "--out", out, "--quiet"]
    done = subprocess.run([sys.executable, "-m", "autotune", *quick_args(args)], capture_output=True, text=True,
                          env=environment.testbed_environment(PYTHONPATH=str(ROOT)), timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    per_replica = summary["batch_size"]
    assert per_replica > summary["max_batch_without_swap"] >= 1 and summary["confirmed_by_measurement"], summary
    memory = summary["replicas"]
    assert memory["per_replica_batch_size"] == per_replica and memory["global_batch_size"] == 2 * per_replica
    for device in memory["devices"]:
        assert device["confirmed"] and device["projected_bytes"] <= BUDGET
    assert f"largest batch that fits: {per_replica}" in done.stdout
    assert f"global batch {2 * per_replica}" in done.stdout


@pytest.mark.tf
@pytest.mark.long  # the correction on one device: test_cli_verdict in the default run
def test_a_replica_measured_above_its_prediction_corrects_the_search(saved, tmp_path):
    """Every replica's peak 60 KiB above what the simulator sees: the first plan measures over the budget, the
    miss corrects the search as on one device, and the plan of the next round is measured and confirmed on
    both replicas."""
    out = tmp_path / "out"
    done = _autotune(saved, out, extra_bytes=60 * 1024)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rounds = summary["measured_rounds"]
    assert len(rounds) >= 2 and not rounds[0]["confirmed"] and rounds[-1]["confirmed"], rounds
    assert summary["peak_correction"]["excess_bytes"] >= 60 * 1024 * 0.9
    for device in _devices_confirmed(summary):
        assert device["measured_bytes"] > device["predicted_where_measured_bytes"]


@pytest.mark.tf
@pytest.mark.long  # on one device: test_cli_verdict in the default run
def test_a_replicated_step_that_fits_unswapped_is_checked_on_tf_s_own_order(saved, tmp_path):
    """A budget over one replica's unswapped step: no plan, and "fits without swapping" is said of plain training
    only when the replicated step in TensorFlow's own op order is measured within the budget too (its peak moves
    from run to run: 800 KiB and 1.06 MiB measured); otherwise the tool's serialized step is what trains, and the
    verdict says how, with the replicated calls."""
    out = tmp_path / "out"
    done = _autotune(saved, out, memory="1MiB")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "fits-without-swapping" and not summary["swaps"]
    own_order_fits = summary["measured_plain_fit_peak_bytes"] <= 2**20
    assert summary["train_with"] == ("plain-fit" if own_order_fits else "serialized-step"), summary["headline"]
    assert own_order_fits or "rewriter.apply_replicated + rewriter.use_replicated_step" in summary["headline"]
    _devices_confirmed(summary, budget=2**20)


@pytest.mark.tf
@pytest.mark.long
def test_the_replicas_step_times_are_calibrated_and_the_calibration_serves_one_device_too(saved, tmp_path):
    """The calibration of the model's single-device step at the per-replica batch times one replica's step (the
    ops it saw by name and type) and predicts the measured run's step; a single-device run at that batch reuses it
    from the cache (about 45 s: two calibrated runs)."""
    done = _autotune(saved, tmp_path / "replicas", flags=("--replicas", 2, "--calibrate"))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads((tmp_path / "replicas" / "summary.json").read_text())
    assert summary["step_time_calibrated"] and summary["calibration"]["batch_sizes"] == [4, 8]
    served = summary["calibration"]["notes"][-1]
    assert served.startswith("one replica's step timed by the single-device step's calibration at batch 8: ")
    assert int(served.split(": ")[1].split(" of ")[0]) >= 0.9 * 384  # Adam's ops numbered apart are paired too
    single = subprocess.run([sys.executable, "-m", "autotune", saved, "--batch-size", "8", "--memory", "700KiB",
                             "--trials", "30", "--out", tmp_path / "single"], capture_output=True, text=True,
                            env=environment.testbed_environment(PYTHONPATH=str(ROOT)), timeout=600, cwd=ROOT)
    assert single.returncode == 0, single.stdout + single.stderr[-3000:]
    assert "step times calibrated on this machine by an earlier run of this model" in single.stderr
