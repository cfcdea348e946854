"""Every kind of Keras model a user has, through the CLI (measured on the testbed) and model.fit with the plan:
custom objects (--import), a Keras-guide custom train_step, pure subclassed models, dict inputs and outputs,
multi-output losses with loss_weights, open dimensions, jit_compile."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap

import tests.tf_tools as th  # noqa: I001 -- first: configures TF before its runtime starts

import keras
import numpy as np
import pytest

import rewriter
from autotune.cli.command import main
from tests.cli_tools import quick_args
from rewriter.trace.tracing import capture, synthetic_batch
from rewriter.trace.step_inputs import NO_STEP_INPUTS, StepInputs
from simulator import SwapParams, plan_swaps, replay

pytestmark = pytest.mark.tf

BATCH = 32

# the user's code the models need: a custom layer and loss (module custom_objects.py, next to the model)
CUSTOM_OBJECTS = '''
import keras

@keras.saving.register_keras_serializable(package="every_model")
class Scale(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")

    def call(self, x):
        return x * self.w

@keras.saving.register_keras_serializable(package="every_model")
def half_mse(y_true, y_pred):
    return 0.5 * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)
'''

# subclassed models: the Keras guide's custom train_step, and a model with only call()
SUBCLASSED = '''
import keras
import tensorflow as tf

@keras.saving.register_keras_serializable(package="every_model")
class GuideStep(keras.Model):
    def train_step(self, data):  # as https://keras.io/guides/custom_train_step_in_tensorflow/ writes it
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

@keras.saving.register_keras_serializable(package="every_model")
class Pure(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = [keras.layers.Dense(32, activation="relu", name=f"hidden{i}") for i in range(6)]
        self.head = keras.layers.Dense(2, name="head")

    def call(self, inputs):
        for layer in self.hidden:
            inputs = layer(inputs)
        return self.head(inputs)
'''


def _module(path, text: str):
    path.write_text(textwrap.dedent(text))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def _stack(h, depth: int, width: int):
    for i in range(depth):
        h = keras.layers.Dense(width, activation="relu", name=f"hidden{i}")(h)
    return h


def _multi_output():
    """Dict inputs not in alphabetical order, dict outputs, a loss per output by name, loss_weights."""
    keras.utils.set_random_seed(3)
    image, meta = keras.Input((12,), name="z_image"), keras.Input((3,), name="a_meta")
    h = keras.layers.Concatenate(name="join")([keras.layers.Dense(128, activation="relu", name="embed")(image), meta])
    h = _stack(h, 6, 32)
    outputs = {"reg": keras.layers.Dense(2, name="reg")(h),
               "cls": keras.layers.Dense(3, activation="softmax", name="cls")(h)}
    model = keras.Model({"z_image": image, "a_meta": meta}, outputs, name="multi")
    model.compile("sgd", loss={"reg": "mse", "cls": "sparse_categorical_crossentropy"},
                  loss_weights={"cls": 0.5, "reg": 2.0})
    return model


def _list_outputs():
    """List outputs, losses as a list (by position), data as lists."""
    keras.utils.set_random_seed(4)
    x = keras.Input((8,), name="x")
    h = _stack(x, 6, 32)
    model = keras.Model(x, [keras.layers.Dense(4, activation="softmax", name="cls")(h),
                            keras.layers.Dense(1, name="reg")(h)], name="listed")
    model.compile("sgd", loss=["sparse_categorical_crossentropy", "mse"], loss_weights=[1.0, 3.0])
    return model


def _guide(code):
    keras.utils.set_random_seed(5)
    x = keras.Input((8,), name="x")
    h = _stack(x, 6, 32)
    model = code.GuideStep(x, keras.layers.Dense(2, name="head")(h), name="guide")
    model.compile("sgd", "mse", metrics=["mae"])
    return model


def _pure(code, built: bool):
    keras.utils.set_random_seed(6)
    model = code.Pure(name="pure")
    model.compile("sgd", "mse")
    if built:  # built and fitted before saving, as a user does
        model.fit(np.zeros((BATCH, 8), "float32"), np.zeros((BATCH, 2), "float32"), verbose=0)
    return model


def _custom(objects):
    keras.utils.set_random_seed(7)
    x = keras.Input((8,), name="x")
    out = keras.layers.Dense(2, name="head")(objects.Scale(name="scale")(keras.layers.Dense(128, name="hidden")(x)))
    model = keras.Model(x, out, name="custom")
    model.compile("sgd", objects.half_mse)
    return model


def _open_dims(jit: bool = False):
    keras.utils.set_random_seed(8)
    image = keras.Input((None, None, 3), name="image")
    h = image
    for i in range(4):
        h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name=f"conv{i}")(h)
    model = keras.Model(image, keras.layers.Conv2D(1, 1, name="head")(h), name="fcn")
    model.compile("sgd", "mse", jit_compile=jit)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("every_model")
    dirs = {name: base / name for name in ("custom", "guide", "pure_built", "pure_unbuilt", "multi", "open", "jit")}
    for directory in dirs.values():
        directory.mkdir()
    objects = _module(dirs["custom"] / "custom_objects.py", CUSTOM_OBJECTS)
    code = _module(base / "subclassed.py", SUBCLASSED)
    _custom(objects).save(dirs["custom"] / "model.keras")
    _guide(code).save(dirs["guide"] / "model.keras")
    _pure(code, built=True).save(dirs["pure_built"] / "model.keras")
    _pure(code, built=False).save(dirs["pure_unbuilt"] / "model.keras")
    _multi_output().save(dirs["multi"] / "model.keras")
    _open_dims().save(dirs["open"] / "model.keras")
    _open_dims(jit=True).save(dirs["jit"] / "model.keras")
    # as in a fresh process: the custom objects are known only once the user's module is imported again
    from keras.src.saving import object_registration

    for name in ("every_model>Scale", "every_model>half_mse"):
        registered = object_registration.GLOBAL_CUSTOM_OBJECTS.pop(name)
        object_registration.GLOBAL_CUSTOM_NAMES.pop(registered, None)
    del sys.modules["custom_objects"]
    return base, dirs, code


def _run(capsys, *args):
    try:
        code = main(quick_args(args))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _swapping_budget(model, batch: int, inputs: StepInputs = NO_STEP_INPUTS) -> int:
    """A budget between the lowest swapping peak and the unswapped one on the testbed: the plan must swap."""
    graph = capture(model, batch, inputs)
    unswapped = min(replay(graph, None, "cpu-testbed").peak_bytes,
                    replay(graph.with_order("memory"), None, "cpu-testbed").peak_bytes)  # reordering is not enough
    lowest = replay(graph, plan_swaps(graph, SwapParams(threshold=1, lb=1, ub=8, sync="both", order="memory",
                                                      tensors="all")),
                    "cpu-testbed").peak_bytes
    assert lowest < unswapped
    return lowest + 3 * (unswapped - lowest) // 4


def _measured(capsys, tmp_path, model_dir, *flags, memory: int | None = None):
    out = tmp_path / "out"
    budget = [] if memory is None else ["--memory", memory, "--device", "cpu-testbed"]
    code, stdout, err = _run(capsys, model_dir, "--batch-size", BATCH, "--trials", 20, "--quiet", "--out", out,
                             *budget, *flags)
    assert code == 0, err + stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["measured_on"] and summary["measured_peak_bytes"] > 0, summary
    return out, stdout, summary


def _fit_equals_plain_fit(build, plan, x, y, *, batch: int = BATCH):
    """model.fit with the plan (Identity swaps) against a plain fit of the same model: bitwise (copying swaps,
    within 1e-5: tests/rewriter/test_apply.py)."""
    th.deterministic()
    plain, swapped = build(), build()
    step = rewriter.use_swap_step(swapped, plan, batch_size=batch, swap_op="Identity")
    assert step.n_swap_outs > 0
    swapped.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    before = [np.array(w) for w in build().get_weights()]
    after = th.weights_of(plain)
    assert th.max_relative_difference(before, [np.array(w) for w in plain.get_weights()]) > 1e-3  # it trained
    assert th.bitwise_equal(after, th.weights_of(swapped))
    assert th.bitwise_equal(th.optimizer_state(plain), th.optimizer_state(swapped))
    return step


def test_custom_objects_need_import_and_load_with_it(saved, capsys, tmp_path):
    _, dirs, _ = saved
    code, _, err = _run(capsys, dirs["custom"], "--batch-size", BATCH, "--no-measure", "--out", tmp_path / "a")
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "Could not locate class 'Scale'" in lines[0] and "--import custom_objects" in lines[0], err
    _measured(capsys, tmp_path, dirs["custom"], "--import", "custom_objects")  # found in the model's directory


def test_keras_guide_train_step_is_captured_and_trains_with_the_plan(saved, capsys, tmp_path):
    base, dirs, code = saved
    graph = capture(_guide(code), BATCH)
    assert graph.meta["loss_op"] and graph.n_ops > 20
    out, _, summary = _measured(capsys, tmp_path, dirs["guide"], "--import", base / "subclassed.py",
                                memory=_swapping_budget(_guide(code), BATCH))
    plan = json.loads((out / "plan.json").read_text())
    assert plan["swaps"], plan
    rng = np.random.default_rng(0)
    x, y = rng.random((3 * BATCH, 8), dtype=np.float32), rng.random((3 * BATCH, 2), dtype=np.float32)
    _fit_equals_plain_fit(lambda: _guide(code), out / "plan.json", x, y)


def test_pure_subclassed_model_from_its_built_state_and_from_input_shape(saved, capsys, tmp_path):
    base, dirs, code = saved
    out, _, _ = _measured(capsys, tmp_path, dirs["pure_built"], "--import", base / "subclassed.py",
                          memory=_swapping_budget(_pure(code, built=True), BATCH))
    rng = np.random.default_rng(1)
    x, y = rng.random((2 * BATCH, 8), dtype=np.float32), rng.random((2 * BATCH, 2), dtype=np.float32)
    _fit_equals_plain_fit(lambda: _pure(code, built=True), out / "plan.json", x, y)
    # never built: refused with what to give, then captured with it
    code_, _, err = _run(capsys, dirs["pure_unbuilt"], "--batch-size", BATCH, "--no-measure", "--import",
                         base / "subclassed.py", "--out", tmp_path / "b")
    assert code_ == 2 and "Traceback" not in err and "--input-shape inputs=" in err, err
    code_, stdout, err = _run(capsys, dirs["pure_unbuilt"], "--batch-size", BATCH, "--no-measure", "--quiet",
                              "--import", base / "subclassed.py", "--input-shape", "inputs=8", "--out", tmp_path / "c")
    assert code_ == 0 and "without swapping: peak" in stdout, err


def test_dict_inputs_and_outputs_with_losses_by_name(saved, capsys, tmp_path):
    _, dirs, _ = saved
    model = _multi_output()
    graph = capture(model, BATCH)
    assert graph.meta["inputs"] == ["a_meta", "z_image", "y0", "y1"]  # flat order: dict keys sorted
    step = rewriter.trace_keras_step(model, BATCH)
    assert step.inputs.y_names == ("cls", "reg") and step.inputs.x_names == ("a_meta", "z_image")
    specs = {s.name: (tuple(s.shape), s.dtype.name) for s in step.inputs.y_specs}
    assert specs == {"y0": ((BATCH,), "int32"), "y1": ((BATCH, 2), "float32")}  # each its own loss's label
    out, _, _ = _measured(capsys, tmp_path, dirs["multi"], memory=_swapping_budget(model, BATCH))
    x, y = synthetic_batch(model, 3 * BATCH, seed=2)
    x = {"z_image": x["z_image"], "a_meta": x["a_meta"]}  # the user's key order
    y = {"reg": y["reg"], "cls": y["cls"]}
    _fit_equals_plain_fit(_multi_output, out / "plan.json", x, y)


def test_list_outputs_with_list_losses_train_like_plain_fit():
    model = _list_outputs()
    graph = capture(model, BATCH)
    plan = plan_swaps(graph, SwapParams(threshold=1, lb=1, ub=8, tensors="all"))
    x, y = synthetic_batch(model, 3 * BATCH, seed=3)
    assert isinstance(y, list) and y[0].dtype.kind == "i" and y[1].shape == (3 * BATCH, 1)
    _fit_equals_plain_fit(_list_outputs, plan.to_json(graph), x, y)


def test_open_dimensions_measured_and_trained_at_the_captured_shapes(saved, capsys, tmp_path):
    _, dirs, _ = saved
    (dirs["open"] / "autotune.toml").write_text("input_shapes = {imgae = [8, 8, 3]}\n")
    code, _, err = _run(capsys, dirs["open"], "--batch-size", BATCH, "--no-measure", "--out", tmp_path / "a")
    assert code == 2 and "Traceback" not in err, err
    assert "autotune.toml: input_shapes: 'imgae' is not an input of the model; its inputs: image" in err, err
    (dirs["open"] / "autotune.toml").write_text("input_shapes = {image = [8, 8, 3]}\n")
    out, _, summary = _measured(capsys, tmp_path, dirs["open"],
                                memory=_swapping_budget(_open_dims(), BATCH, StepInputs(input_shapes={"image": [8, 8, 3]})))
    plan = json.loads((out / "plan.json").read_text())
    assert plan["step_inputs"] == {"input_shapes": {"image": [8, 8, 3]}}
    # the plan brings its shapes to the training step: no input_shapes given here
    model = _open_dims()
    step = rewriter.apply(model, out / "plan.json", verify=False)
    assert [tuple(s.shape) for s in step.input_specs] == [(BATCH, 8, 8, 3), (BATCH, 8, 8, 1)]
    _measured(capsys, tmp_path, dirs["open"], "--input-shape", "image=6,10,3")  # the flag over the file


def test_jit_compile_is_said_to_run_without_xla(saved, capsys, tmp_path):
    _, dirs, _ = saved
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, dirs["jit"], "--batch-size", BATCH, "--input-shape", "image=8,8,3",
                             "--no-measure", "--quiet", "--out", out)
    assert code == 0, err
    assert "note: the model is compiled with jit_compile=True, but the swapping step runs without XLA" in stdout
    assert "runs without XLA" in (out / "report.md").read_text()


def test_a_train_step_that_cannot_be_traced_is_refused_with_why():
    class Eager(keras.Model):
        def train_step(self, data):
            x, y = data
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            return {"loss": float(loss.numpy())}  # eager-only: no graph can hold it

    x = keras.Input((8,), name="x")
    model = Eager(x, keras.layers.Dense(2, name="head")(x), name="eager")
    model.compile("sgd", "mse")
    with pytest.raises(rewriter.CaptureError, match="tracing the training step failed: .*eager-only code"):
        capture(model, BATCH)


def test_a_train_step_without_a_loss_is_refused():
    class NoLoss(keras.Model):
        def train_step(self, data):
            x, _ = data
            return {"mean": keras.ops.mean(self(x, training=True))}

    x = keras.Input((8,), name="x")
    model = NoLoss(x, keras.layers.Dense(2, name="head")(x), name="noloss")
    model.compile("sgd", "mse")
    with pytest.raises(rewriter.CaptureError, match="computed no loss: its train_step neither called self.compute_"):
        capture(model, BATCH)


def test_a_user_module_that_raises_is_one_line(saved, capsys, tmp_path):
    _, dirs, _ = saved
    (dirs["custom"] / "broken_layers.py").write_text("raise RuntimeError('the layers need a licence key')\n")
    code, _, err = _run(capsys, dirs["custom"], "--batch-size", BATCH, "--no-measure", "--import", "broken_layers.py",
                        "--out", tmp_path / "out")
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "--import broken_layers.py: importing it failed: RuntimeError: the layers need a licence key" in lines[0]
