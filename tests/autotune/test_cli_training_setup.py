"""The report and summary.json say what was tuned: optimizer (class, learning rate, the settings that
shape its state), loss and dtype policy (``rewriter.trace.training_setup``, ``autotune.run.training``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tensorflow")

import keras  # noqa: E402

from autotune.cli.command import main  # noqa: E402

pytestmark = pytest.mark.tf


def _model(policy: str) -> keras.Model:
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu", dtype=policy)(inputs)
    outputs = keras.layers.Dense(4, dtype="float32")(hidden)
    model = keras.Model(inputs, outputs, name="tiny", dtype=policy)
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=3e-4, weight_decay=0.01, use_ema=True,
                                                   gradient_accumulation_steps=4),
                  loss=keras.losses.Huber())
    return model


def test_summary_and_report_name_the_optimizer_loss_and_dtype_policy(tmp_path, capsys):
    _model("mixed_float16").save(tmp_path / "tiny.keras")
    code = main([str(tmp_path / "tiny.keras"), "--batch-size", "8", "--no-measure", "--quiet", "--trials", "2",
                 "--out", str(tmp_path / "out")])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    optimizer = summary["optimizer"]
    assert optimizer["class"] == "AdamW" and optimizer["learning_rate"] == pytest.approx(3e-4)
    settings = optimizer["settings"]
    assert settings["weight_decay"] == pytest.approx(0.01) and settings["use_ema"] is True
    assert settings["gradient_accumulation_steps"] == 4 and settings["beta_1"] == pytest.approx(0.9)
    assert summary["loss"] == "Huber" and summary["dtype_policy"] == "mixed_float16 (1 layer), float32 (1 layer)"
    line = "optimizer AdamW (learning rate 0.0003; beta_1 0.9"
    assert line in stdout and "use_ema True" in stdout and "gradient_accumulation_steps 4" in stdout
    assert "loss Huber, dtype policy mixed_float16 (1 layer), float32 (1 layer)" in stdout
    assert line in (tmp_path / "out" / "report.md").read_text()
