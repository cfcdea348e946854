"""Every bad autotune.toml value, flag and model file: one line naming it, exit 2, no traceback (no TensorFlow:
all of these are refused before anything slow happens)."""

from __future__ import annotations

import json
import time
import zipfile

import pytest

from autotune.cli import command as cli
from autotune.cli.command import _settings, build_parser, main
from simulator.warmup import warm_up


@pytest.fixture
def model_dir(tmp_path):
    """A directory with a .keras archive (never loaded: every case here is refused first)."""
    directory = tmp_path / "model"
    directory.mkdir()
    with zipfile.ZipFile(directory / "model.keras", "w") as archive:
        archive.writestr("config.json", json.dumps({"class_name": "Sequential"}))
        archive.writestr("metadata.json", "{}")
    return directory


def _one_error_line(capsys, *args) -> str:
    try:
        code = main([str(a) for a in args])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


@pytest.mark.parametrize("toml,message", [
    ('input_shapes = {image = ["a", 64, 3]}', "input_shapes.image = ['a', 64, 3]: expected a list of positive"),
    ("input_shapes = {image = 5}", "input_shapes.image = 5: expected a list"),
    ("input_shapes = [[0, 3]]", "input_shapes = [0, 3]: expected a list of positive"),
    ('label_shapes = [["x"]]', "label_shapes = ['x']: expected"),
    ('label_dtype = "float99"', "label_dtype = 'float99' is not a dtype"),
    ('label_dtype = {cls = "int99"}', "label_dtype.cls = 'int99' is not a dtype"),
    ("trials = -3", "autotune.toml: trials must be positive, got -3"),
    ("trials = 0", "autotune.toml: trials must be positive, got 0"),
    ("batch_size = -1", "autotune.toml: batch_size must be positive, got -1"),
    ("seed = -1", "autotune.toml: seed must be non-negative"),
    ("timeout = 0", "autotune.toml: timeout must be positive"),
    ("max_overhead = -0.5", "autotune.toml: max_overhead must not be negative"),
    ('memory = "-3GiB"', "autotune.toml: memory: '-3GiB' is not a size"),
    ('device = "tpu-9000"', "autotune.toml: device: unknown device 'tpu-9000'"),
    ("imports = [3]", "autotune.toml: imports = [3]: expected a list of names"),
    ('imports = ["no_such_module_anywhere"]', "imports no_such_module_anywhere: no module 'no_such_module_anywhere'"),
    ('imports = ["missing.py"]', "imports missing.py: no such .py file"),
    ('recompute = "no"', "autotune.toml: recompute = 'no' has the wrong type"),
    ("recompute = 0", "autotune.toml: recompute = 0 has the wrong type"),
    ('plots = "no"', "autotune.toml: plots = 'no' has the wrong type"),
    ("max_overhead = true", "autotune.toml: max_overhead = True has the wrong type"),
])
def test_bad_toml_value_names_its_key_in_the_file(model_dir, capsys, tmp_path, toml, message):
    (model_dir / "autotune.toml").write_text(toml + "\n")
    line = _one_error_line(capsys, model_dir, "--batch-size", "4", "--no-measure", "--out", tmp_path / "out")
    assert message in line and "autotune.toml" in line, line
    assert "--" not in line.split("autotune.toml")[0], line  # blamed on the file, not on a flag


# the switches on by default, each with its --no- flag and its autotune.toml key, and where the settings keep it
SWITCHES = {"recompute": lambda settings: settings["search"].recompute, "plots": lambda settings: settings["plots"]}


@pytest.mark.parametrize("switch", list(SWITCHES))
@pytest.mark.parametrize("toml,flags,expected", [
    ("", [], True),
    ("{0} = false", [], False),
    ("{0} = true", ["--no-{0}"], False),
    ("{0} = false", ["--{0}"], True),
])
def test_a_switch_comes_from_the_flag_over_the_file_over_the_default(model_dir, switch, toml, flags, expected):
    (model_dir / "autotune.toml").write_text(toml.format(switch) + "\n")
    args = build_parser().parse_args([str(model_dir), "--batch-size", "4", *(f.format(switch) for f in flags)])
    assert SWITCHES[switch](_settings(args)) is expected


@pytest.mark.parametrize("flags,message", [
    (["--trials", "0"], "--trials must be at least 1, got 0"),
    (["--seed", "-2"], "--seed must not be negative"),
    (["--import", "no_such_module_anywhere"], "--import no_such_module_anywhere: no module"),
    (["--import", "nowhere/layers.py"], "--import nowhere/layers.py: no such .py file"),
    (["--import", "not a module"], "not a module name"),
    (["--input-shape", "image=a,3"], "--input-shape 'image=a,3'"),
])
def test_bad_flag_is_one_line(model_dir, capsys, tmp_path, flags, message):
    line = _one_error_line(capsys, model_dir, "--batch-size", "4", "--no-measure", "--out", tmp_path / "out", *flags)
    assert message in line, line


def test_a_bad_flag_value_is_blamed_on_the_flag_even_with_a_file(model_dir, capsys, tmp_path):
    (model_dir / "autotune.toml").write_text("trials = 50\n")
    line = _one_error_line(capsys, model_dir, "--batch-size", "4", "--trials", "0", "--out", tmp_path / "out")
    assert "--trials" in line and "autotune.toml" not in line, line


@pytest.mark.parametrize("content,message", [
    ("truncated", "is not a Keras model archive"),
    ("text", "is not a Keras model archive"),
    ("hdf5", "is an HDF5 (.h5) model renamed to .keras"),
    ("zip", "is a zip archive but not a Keras model (no config.json"),
])
def test_corrupt_model_files_are_named_as_such(model_dir, capsys, tmp_path, content, message):
    path = model_dir / "model.keras"
    if content == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif content == "text":
        path.write_text("my notes, renamed by mistake\n")
    elif content == "hdf5":
        path.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(64))
    else:
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("notes.txt", "no model here")
    line = _one_error_line(capsys, model_dir, "--batch-size", "4", "--out", tmp_path / "out")
    assert message in line and "File not found" not in line, line


def test_a_slow_first_compile_is_said_and_a_fast_one_is_not(capsys):
    """The kernels' first compile (``simulator.warmup``) takes a minute in silence unless the CLI says why."""
    with cli._said_if_slow(False, "compiling ...", after_s=0.05):
        time.sleep(0.3)
    warm_up()  # compiles the kernels on a machine's first run (or loads them from numba's cache)
    with cli._said_if_slow(False, "never said", after_s=5.0):
        warm_up()  # compiled: milliseconds
    time.sleep(0.1)
    err = capsys.readouterr().err
    assert "compiling ..." in err and "never said" not in err
