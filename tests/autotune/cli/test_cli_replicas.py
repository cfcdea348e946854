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
from tests.cli_helpers import uncalibrated

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("flags,message", [
    (["--batch-size", "15", "--replicas", "2"], "--batch-size 15 does not split evenly over 2 replicas"),
    (["--batch-size", "16", "--replicas", "0"], "--replicas must be at least 1, got 0"),
    (["--batch-size", "16", "--replicas", "2", "--maximize-batch"], "--replicas does not take --maximize-batch"),
    (["--batch-size", "16", "--replicas", "2", "--rewrite", "split-concat"], "--replicas does not take"),
])
def test_what_replicas_cannot_do_is_refused_in_one_line(model_dir, capsys, flags, message):
    code = main([str(model_dir), *flags])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


SAVE = """
import keras
keras.utils.set_random_seed(1)
convs = [keras.layers.Conv2D(8, 3, padding="same", activation="relu") for _ in range(4)]
model = keras.Sequential([keras.Input((24, 24, 3)), *convs, keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
model.compile(optimizer="adam", loss="mse")
model.save({path!r})
"""


@pytest.mark.tf
def test_two_replicas_on_the_testbed_are_each_measured_and_confirmed(tmp_path):
    """A budget under the unswapped step's (820 KiB predicted per replica at batch 8): a plan that swaps, each
    replica's peak measured within 5 % of the testbed's prediction, the verdict per device."""
    saved = tmp_path / "model"
    saved.mkdir()
    env = environment.testbed_environment(PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", SAVE.format(path=str(saved / "model.keras"))], env=env, check=True,
                   capture_output=True, timeout=300)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "autotune", *uncalibrated([saved, "--batch-size", 16,
                           "--replicas", 2, "--memory", "700KiB", "--trials", 30, "--out", out, "--quiet"])],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["confirmed"] and summary["replicas"]["per_replica_batch_size"] == 8
    assert [d["host"] for d in summary["devices"]] == ["/device:CPU:1", "/device:CPU:3"]
    for device in summary["devices"]:
        assert abs(device["measured_bytes"] / device["predicted_testbed_bytes"] - 1) <= 0.05
        assert device["projected_bytes"] <= 700 * 1024 and device["verified"]
    assert summary["plan"]["swaps"] or summary["plan"]["recomputes"]
    assert "verdict: fits on each of 2 devices" in done.stdout
    assert summary["target"]["host_budget_source"].endswith("shared by 2 replicas: 32.00 GiB each")
