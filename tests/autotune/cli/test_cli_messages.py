"""Messages that say what happened: a verification's output line without the node names (they go to
the report), parameters with units, the step-time note of a calibrated run, Keras' warning about a
saved optimizer's variables explained instead of printed, and a function saved from the script that
built the model (module ``builtins``, which ``--import builtins`` cannot provide) answered with what
loads it (``autotune.cli.imports.describe_load_error``)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
import warnings
from dataclasses import fields

import pytest

pytest.importorskip("tensorflow")

from autotune.cli.command import main  # noqa: E402
from autotune.run.calibrated_timing import time_model_note  # noqa: E402
from autotune.report.writer import param_text  # noqa: E402
from rewriter.check.verification import Verification, _report  # noqa: E402
from simulator import CalibratedDevice, get_device  # noqa: E402

pytestmark = pytest.mark.tf


def test_a_verification_warning_is_one_short_line_and_the_report_keeps_the_names(caplog):
    names = [f"swap_in/model/block_{k}/very_long_scope_name/conv/Conv2D_{k}:0" for k in range(300)]
    result = Verification(planned_swap_outs=300, planned_swap_ins=300, planned_triggers=300, planned_rewired_inputs=300,
                          removed=names[:120], triggers_dropped=names)
    with caplog.at_level(logging.WARNING, logger="rewriter.check.verification"):
        _report(result)
    (record,) = caplog.records
    line = record.getMessage()
    assert "\n" not in line and len(line) < 300, line
    assert "120 swap node(s) removed" in line and "300 trigger edge(s) dropped" in line and names[0] not in line
    assert any(names[0] in problem for problem in result.problems())  # the report's, with names


def test_parameters_have_units():
    assert param_text("recompute_cost", 1.1327125098774029e-11) == "11.9 µs of compute per MiB freed"
    assert param_text("recompute_cost", None) == "no limit"
    assert param_text("min_bytes", 4096) == "4.00 KiB"
    assert param_text("threshold", 3) == "3"


def test_a_calibrated_run_searched_on_a_preset_says_so():
    testbed = get_device("cpu-testbed")
    calibration = CalibratedDevice(**{f.name: getattr(testbed, f.name) for f in fields(testbed)}, preset="cpu-testbed")
    preset = get_device("v100-16gb")
    note = time_model_note(preset, calibration)
    assert "calibration of this run measured this machine (cpu-testbed)" in note
    assert "a calibrated run (--calibrate" not in note  # no advice to do what was done
    assert "a calibrated run (--calibrate" in time_model_note(preset)


def test_keras_optimizer_warning_is_explained_not_printed(tmp_path):
    import keras

    from autotune.inputs import load_model

    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="adam", loss="mse")
    model.save(tmp_path / "untrained.keras")  # saved before it trained: the file's optimizer has no state
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_model(tmp_path / "untrained.keras", notes=notes)
    assert loaded.optimizer is not None
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    assert len(notes) == 1 and "was not loaded" in notes[0] and "the result is the same" in notes[0], notes
    # a LossScaleOptimizer saved untrained: Keras skips it and the optimizer inside it, one note names both
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse")
    model.save(tmp_path / "scaled.keras")
    notes = []
    load_model(tmp_path / "scaled.keras", notes=notes)
    assert len(notes) == 1 and notes[0].count("built for ") == 2, notes


SCRIPT = textwrap.dedent('''
    import keras

    def scale(x):
        return x * 2.0

    scale.__module__ = "builtins"  # what Keras records for a function of the script in some setups
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Lambda(scale)(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    model.save(OUT)
''')


def test_a_script_function_is_answered_with_a_module_that_works(tmp_path, capsys):
    script = SCRIPT.replace("OUT", repr(str(tmp_path / "model.keras")))
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
    args = [str(tmp_path / "model.keras"), "--batch-size", "2", "--no-measure", "--quiet", "--trials", "2",
            "--no-plots", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--import builtins" not in err and "Could not locate function 'scale'" in err, err
    module = re.search(r"--import (\w+)", err).group(1)
    line = re.search(r"the line (keras\.saving\.get_custom_objects\(\)\['scale'\] = scale)", err).group(1)
    (tmp_path / f"{module}.py").write_text(f"import keras\n\n\ndef scale(x):\n    return x * 2.0\n\n\n{line}\n")
    assert main(args + ["--import", module]) == 0, capsys.readouterr().err
