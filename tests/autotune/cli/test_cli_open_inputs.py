"""Every input of open length in one message, with the --input-shape flags to copy
(``rewriter.trace.step_inputs.open_inputs_message``)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("tensorflow")

import keras  # noqa: E402

from autotune.cli.command import _input_shapes, main  # noqa: E402
from rewriter.trace.tracing import StepInputs, capture  # noqa: E402

pytestmark = pytest.mark.tf


def _three_inputs() -> keras.Model:
    """Two inputs of open length (one with a fixed feature size) and one fully known."""
    words = keras.Input((None, 4), name="words")
    frames = keras.Input((None, 8), name="frames")
    extra = keras.Input((6,), name="extra")
    pooled = [keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(5)(x)) for x in (words, frames)]
    outputs = keras.layers.Dense(2)(keras.layers.Concatenate()([*pooled, extra]))
    model = keras.Model([words, frames, extra], outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_every_open_input_in_one_message_whose_flags_capture_the_model(tmp_path, capsys):
    model = _three_inputs()
    model.save(tmp_path / "model.keras")
    code = main([str(tmp_path / "model.keras"), "--no-plots", "--batch-size", "4", "--no-measure", "--quiet",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.count("error:") == 1 and "2 input(s) with open dimensions" in err, err
    assert "words (batch, None, 4)" in err and "frames (batch, None, 8)" in err and "extra (" not in err
    flags = re.search(r"(--input-shape \S+(?: --input-shape \S+)*)", err).group(1)
    assert flags == "--input-shape words=D1,4 --input-shape frames=D2,8", flags
    assert "input_shapes = {words = [D1, 4], frames = [D2, 8]}" in err
    # the line as the user fills it in captures the model
    entries = flags.replace("D1", "12").replace("D2", "7").replace("--input-shape ", "").split()
    graph = capture(model, 4, StepInputs(input_shapes=_input_shapes(entries)))
    assert graph.n_ops > 0 and graph.meta["inputs"][:2] == ["words", "frames"]


def test_one_given_shape_leaves_the_other_listed_with_the_given_one_filled_in():
    model = _three_inputs()
    from rewriter.trace.step_inputs import CaptureError

    with pytest.raises(CaptureError) as raised:
        capture(model, 4, StepInputs(input_shapes={"words": [12, 4]}))
    assert "1 input(s) with open dimensions" in str(raised.value)
    assert "--input-shape frames=D1,8" in str(raised.value) and "words=" not in str(raised.value)
