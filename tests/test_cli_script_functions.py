"""A Lambda's function defined in the script that saved the model is recorded as module ``builtins``:
``--import builtins`` cannot provide it, so the error names what does, and doing that loads the model
(``autotune.imports.describe_load_error``)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("tensorflow")

from autotune.cli import main  # noqa: E402

pytestmark = pytest.mark.tf

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
            "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--import builtins" not in err and "Could not locate function 'scale'" in err, err
    module = re.search(r"--import (\w+)", err).group(1)
    line = re.search(r"the line (keras\.saving\.get_custom_objects\(\)\['scale'\] = scale)", err).group(1)
    (tmp_path / f"{module}.py").write_text(f"import keras\n\n\ndef scale(x):\n    return x * 2.0\n\n\n{line}\n")
    assert main(args + ["--import", module]) == 0, capsys.readouterr().err
