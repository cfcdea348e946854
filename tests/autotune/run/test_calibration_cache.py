"""Calibrate once (autotune.run.calibration_cache): a calibration is reused by a later run of the same graph
on the same machine, and never by another graph or machine."""

from __future__ import annotations

import tests.tf_tools as th  # noqa: F401, I001 -- first: configures TF before its runtime starts

import dataclasses
import json
import time

import numpy as np
import pytest

import rewriter
from autotune.cli.command import main
from autotune.run import calibration_cache
from autotune.run.calibration_cache import MachineKey, calibration_key
from benchmarks.models import build_model
from rewriter.timing.device_calibration import timed_passes
from simulator import CalibratedDevice
from simulator.device.presets import get_device
from simulator.synthetic import training_graph

MACHINE = MachineKey(cpu_model="Some CPU @ 2.0GHz", cores=2, device="cpu-testbed: accelerator CPU:0", tensorflow="2.21.0")


def _calibrated(g) -> CalibratedDevice:
    rng = np.random.default_rng(0)
    ab = np.stack([rng.uniform(1e-5, 1e-4, g.n_ops), rng.uniform(1e-5, 1e-3, g.n_ops)], axis=1)
    return CalibratedDevice.from_preset(
        get_device("cpu-testbed"), g, op_seconds_ab=ab, batch_sizes=(4, 8), measured_step_s=(0.1, 0.2),
        h2d_bytes_per_s=2e10, d2h_bytes_per_s=2e10, transfer_latency_s=2e-6, copy_contention=0.3,
        roofline_scale=3.0, notes=("timed",))


def test_a_stored_calibration_is_found_again_for_the_same_graph_and_machine():
    g = training_graph(12, batch_size=8)
    device = _calibrated(g)
    key = calibration_key(g, (4, 8), "cpu-testbed", MACHINE)
    assert calibration_cache.load(key, g) is None
    path = calibration_cache.store(key, device, MACHINE)
    assert path is not None and path.parent.parent == calibration_cache.cache_dir()
    found = calibration_cache.load(key, g.with_batch(32))
    assert found == device and found.name == device.name  # every field, the per-op table included
    assert found.op_seconds_ab == device.op_seconds_ab and found.notes == ("timed",)
    assert calibration_key(g.with_batch(32), (4, 8), "cpu-testbed", MACHINE) == key  # the batch is not the graph


def test_another_graph_or_machine_has_another_key():
    g = training_graph(12, batch_size=8)
    key = calibration_key(g, (4, 8), "cpu-testbed", MACHINE)
    calibration_cache.store(key, _calibrated(g), MACHINE)
    wider = training_graph(12, batch_size=8, activation_bytes=2 << 20)  # the same structure, other sizes
    assert wider.fingerprint() == g.fingerprint()
    others = [calibration_key(wider, (4, 8), "cpu-testbed", MACHINE),
              calibration_key(training_graph(13, batch_size=8), (4, 8), "cpu-testbed", MACHINE),
              calibration_key(g, (2, 4), "cpu-testbed", MACHINE),
              calibration_key(g, (4, 8), "v100-16gb", MACHINE)]
    others += [calibration_key(g, (4, 8), "cpu-testbed", dataclasses.replace(MACHINE, **change))
               for change in ({"cpu_model": "Other CPU"}, {"cores": 8}, {"device": "gpu: accelerator GPU:0, A100"},
                              {"tensorflow": "2.20.0"})]
    assert key not in others and len(set(others)) == len(others)
    assert all(calibration_cache.load(other, g) is None for other in others)


def test_a_stored_calibration_is_never_applied_to_another_graph():
    """Even a file found under a graph's key (copied by hand, say) serves only the graph it was made for."""
    g, other = training_graph(12, batch_size=8), training_graph(13, batch_size=8)
    key = calibration_key(other, (4, 8), "cpu-testbed", MACHINE)
    calibration_cache.store(key, _calibrated(g), MACHINE)
    assert calibration_cache.load(key, other) is None


def test_timed_passes_stop_at_their_time_budget():
    """A pass of slow steps: the passes stop at the time budget, not at the count."""
    started = time.perf_counter()
    times = timed_passes({"slow": lambda: time.sleep(0.05)}, min_passes=6, max_passes=40, tolerance=0.0,
                         max_total_s=0.3)
    assert time.perf_counter() - started < 1.0
    assert 3 <= times.n_passes < 40 and times.step_s["slow"] >= 0.05


@pytest.mark.tf
def test_a_second_run_of_the_same_model_reuses_its_calibration(tmp_path, capsys, monkeypatch):
    """The first run calibrates and keeps it; the second run of the same model reuses it (no calibration
    measured: its stage takes no time to speak of); --recalibrate measures again."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    build_model("small_cnn", image_size=32, seed=0).save(model_dir / "cnn.keras")
    made = []
    real = rewriter.calibrate

    def counted(*args, **kwargs):
        made.append(real(*args, **kwargs) if not made else made[0])  # a third calibration: the first again
        return made[-1]

    monkeypatch.setattr(rewriter, "calibrate", counted)
    args = [str(model_dir), "--batch-size", "8", "--device", "cpu-testbed", "--trials", "4", "--quiet", "--no-measure",
            "--no-plots", "--calibrate"]  # a measured run adds nothing here but time
    summaries = []
    for run, extra in enumerate(([], [], ["--recalibrate"])):
        out = tmp_path / f"out{run}"
        assert main(args + extra + ["--out", str(out)]) in (0, 3), capsys.readouterr()
        summaries.append(json.loads((out / "summary.json").read_text()))
    assert len(made) == 2  # the first run and --recalibrate; not the second run
    first, second, _ = summaries
    assert second["device"] == first["device"] and second["calibration"] == first["calibration"]
    assert first["stage_seconds"]["calibration_s"] > 1.0 > second["stage_seconds"]["calibration_s"]
    assert len(list((calibration_cache.cache_dir() / "calibrations").glob("*.json"))) == 1
