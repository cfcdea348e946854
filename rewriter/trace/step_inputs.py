"""The training step's inputs and labels, by name: specs, Keras' structures, and data in any form.

Keras hands ``train_step`` its data in the model's own structure (a dict for dict inputs, a list or a
tensor otherwise). The traced step takes them flat, in ``keras.tree.flatten`` order (dict keys
sorted), which is also the order of ``model.inputs`` and of a list of data; ``StepSpecs.pack``
rebuilds the model's structure inside the trace, ``StepSpecs.flatten`` takes a batch given as a dict
(by name, any key order), a list or a tensor. Each output gets its own label: the shape and dtype
its loss expects, the loss found by the output's name (``loss`` as a dict) or position (a list).
Subclassed models have no ``model.inputs``: their input comes from ``input_shapes`` or from the
shape Keras recorded when the model was built (saved with the model). What the user gave (shapes where
the model leaves dimensions open, labels other than the loss's defaults) is one ``StepInputs``, resolved
once by the CLI or ``autotune.tune`` and handed down to every trace of the step.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, replace
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from rewriter.errors import CaptureError
from simulator.plan import NamedPlan


def spec_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", name) or "x"


def is_sparse_loss(loss) -> bool:
    """Whether a loss takes class ids (its labels lose the output's class axis and are integers)."""
    text = loss if isinstance(loss, str) else type(loss).__name__ + " " + str(getattr(loss, "name", ""))
    text = getattr(loss, "__name__", text) if callable(loss) and not hasattr(loss, "name") else text
    return "sparse" in str(text).lower()


_LOSS_ALIASES = {"categoricalcrossentropy": "categorical_crossentropy", "binarycrossentropy": "binary_crossentropy"}
_LOSS_KINDS = {"categorical_crossentropy": "categorical", "binary_crossentropy": "binary"}


def loss_kind(loss) -> str:
    """The labels a compiled loss (string, function or Loss object) takes: "sparse" (class ids,
    ``is_sparse_loss``), "categorical" (one-hot), "binary" (values in [0, 1)) or "other" (floats)."""
    if loss is None:
        return "other"
    if is_sparse_loss(loss):
        return "sparse"
    if isinstance(loss, str):
        name = loss
    elif isinstance(loss, keras.losses.Loss):  # LossFunctionWrapper subclasses carry the wrapped function's name
        name = getattr(loss, "name", None) or type(loss).__name__
        function = getattr(loss, "fn", None)
        if function is not None and getattr(function, "__name__", None):
            name = function.__name__
    else:
        name = getattr(loss, "__name__", type(loss).__name__)
    name = name.lower()
    return _LOSS_KINDS.get(_LOSS_ALIASES.get(name, name), "other")


STEP_INPUT_SETTINGS = ("input_shapes", "label_shapes", "label_dtype")


@dataclass(frozen=True)
class StepInputs:
    """The input and label shapes and dtypes a user gave for the step, by name (a dict) or by position
    (a list): ``input_shapes`` without the batch where the model leaves dimensions open,
    ``label_shapes``/``label_dtype`` where the labels are not what the outputs and the loss imply.
    None: the model's own. Its dict form (``to_dict``) is a plan file's ``step_inputs`` field."""

    input_shapes: Any = None
    label_shapes: Any = None
    label_dtype: Any = None

    def to_dict(self) -> dict:
        """The settings given (a plan file's ``step_inputs``: the graph's meta, and so the plans made on it)."""
        return {key: getattr(self, key) for key in STEP_INPUT_SETTINGS if getattr(self, key) is not None}

    @classmethod
    def from_dict(cls, data: dict | None) -> StepInputs:
        return cls(**{key: (data or {}).get(key) for key in STEP_INPUT_SETTINGS})

    def or_planned(self, plan: NamedPlan) -> StepInputs:
        """These settings, each one not given taken from those ``plan`` was captured with (open
        dimensions: the step runs at the shapes the plan was made for)."""
        planned = StepInputs.from_dict(plan.step_inputs)
        return replace(self, **{key: getattr(planned, key) for key in STEP_INPUT_SETTINGS if getattr(self, key) is None})


NO_STEP_INPUTS = StepInputs()


@dataclass(frozen=True)
class StepSpecs:
    """The step's inputs (``x_*``) and labels (``y_*``) in flat order at one batch size, with the
    model's structures."""

    x_names: tuple[str, ...]
    y_names: tuple[str, ...]
    x_specs: tuple[tf.TensorSpec, ...]
    y_specs: tuple[tf.TensorSpec, ...]
    x_structure: Any  # the model's input structure, leaves replaced by their flat index
    y_structure: Any
    # a per-sample weight of the loss (what model.fit makes of sample_weight and class_weight), the
    # step's last label when it is traced with one (rewriter.step.keras_fit)
    weight_spec: tf.TensorSpec | None = None

    @property
    def label_specs(self) -> tuple[tf.TensorSpec, ...]:
        """The step's label inputs: the labels, and the sample weight when it takes one."""
        return self.y_specs + (() if self.weight_spec is None else (self.weight_spec,))

    def pack(self, xs, ys):
        """Flat tensors -> (x, y) or (x, y, sample_weight) in the structures Keras' ``train_step`` expects
        (y None for a model that trains on its inputs alone, ``trains_itself``)."""
        ys = list(ys)
        labels = ys[:-1] if self.weight_spec is not None else ys
        y = None if self.y_structure is None else keras.tree.pack_sequence_as(self.y_structure, labels)
        x = keras.tree.pack_sequence_as(self.x_structure, list(xs))
        return (x, y, ys[-1]) if self.weight_spec is not None else (x, y)

    def train_data(self, xs, ys):
        """What ``train_step`` is given: as ``pack``, but x alone for a model fit with x only (``fit(x)``)."""
        packed = self.pack(xs, ys)
        return packed[0] if self.y_structure is None and self.weight_spec is None else packed

    def flatten(self, x, y) -> tuple[list, list]:
        """A batch given as dicts (by name), lists (flat order) or single arrays -> flat lists."""
        return _flat(x, self.x_names, "input"), _flat(y, self.y_names, "label")


def _flat(data, names: tuple[str, ...], what: str) -> list:
    if data is None and not names:  # a model trained on its inputs alone has no labels
        return []
    if isinstance(data, dict):
        missing = [n for n in names if n not in data]
        extra = [k for k in data if k not in names]
        if missing or extra:
            raise ValueError(f"the step's {what}s are {', '.join(names)}; got {', '.join(map(str, data))}")
        return [data[n] for n in names]
    values = list(data) if isinstance(data, (list, tuple)) else [data]
    if len(values) != len(names):
        raise ValueError(f"the step takes {len(names)} {what}(s) ({', '.join(names)}), got {len(values)}")
    return values


def _indexed(structure) -> Any:
    if structure is None:
        return None
    leaves = keras.tree.flatten(structure)
    return keras.tree.pack_sequence_as(structure, list(range(len(leaves))))


def _leaf_names(structure, leaves) -> list[str]:
    """Dict entries by their key, the rest by their tensor's name."""
    if isinstance(structure, dict):
        return [str(k) for k in sorted(structure)] if len(structure) == len(leaves) else \
            [str(getattr(t, "name", i)) for i, t in enumerate(leaves)]
    return [str(getattr(t, "name", i)) for i, t in enumerate(leaves)]


def subclassed_input_name(model) -> str:
    """The one input of a subclassed model is named after its ``call``'s first argument."""
    try:
        parameters = [p for p in inspect.signature(model.call).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        parameters = []
    return parameters[0].name if parameters else "inputs"


def model_inputs(model) -> tuple[Any, list[str], list[tuple], list[str]]:
    """(structure, flat names, flat declared shapes without the batch, flat dtypes) of the inputs;
    declared dimensions may be None (open). Subclassed models: from the built state."""
    structure = getattr(model, "_inputs_struct", None)
    if structure is not None and getattr(model, "inputs", None):
        leaves = keras.tree.flatten(structure)
        return (structure, _leaf_names(structure, leaves), [tuple(t.shape)[1:] for t in leaves],
                [str(t.dtype) for t in leaves])
    config = model.get_build_config() if hasattr(model, "get_build_config") else None
    shape = (config or {}).get("input_shape")
    dtype = str(getattr(model, "input_dtype", None) or "float32")
    if isinstance(shape, dict):
        names = sorted(shape)
        return ({n: n for n in shape}, names, [tuple(shape[n])[1:] for n in names], [dtype] * len(names))
    if isinstance(shape, (list, tuple)) and shape and all(isinstance(s, (list, tuple)) for s in shape):
        names = [str(i) for i in range(len(shape))]
        return list(names), names, [tuple(s)[1:] for s in shape], [dtype] * len(names)
    name = subclassed_input_name(model)
    if isinstance(shape, (list, tuple)):
        return name, [name], [tuple(shape)[1:]], [dtype]
    return name, [name], [], [dtype]  # never built: the shape must be given


def _given_shapes(names: list[str], input_shapes) -> list:
    if input_shapes is None:
        return [None] * len(names)
    if isinstance(input_shapes, dict):
        unknown = [k for k in input_shapes if k not in names and not (str(k).isdigit() and int(k) < len(names))]
        if unknown:
            raise CaptureError(f"input_shapes: {unknown[0]!r} is not an input of the model; "
                               f"its inputs: {', '.join(names)}")
        return [input_shapes.get(n, input_shapes.get(str(i))) for i, n in enumerate(names)]
    if len(names) == 1 and input_shapes and not isinstance(input_shapes[0], (list, tuple)):
        return [input_shapes]
    if len(input_shapes) != len(names):
        raise CaptureError(f"input_shapes gives {len(input_shapes)} shapes; the model has {len(names)} "
                           f"input(s): {', '.join(names)}")
    return list(input_shapes)


def check_input_shape_names(model, input_shapes) -> None:
    """A name in ``input_shapes`` that is no input of the model is a mistake, not a default."""
    _, names, _, _ = model_inputs(model)
    _given_shapes(names, input_shapes)


def input_specs(model, batch_size: int, input_shapes=None) -> tuple[Any, list[str], list[tf.TensorSpec]]:
    structure, names, declared_shapes, dtypes = model_inputs(model)
    given = _given_shapes(names, input_shapes)
    specs, open_inputs = [], []
    for name, declared, dtype, shape in zip(names, declared_shapes or [None] * len(names), dtypes, given):
        if shape is not None:
            shape = tuple(int(d) for d in shape)
            if declared is not None and (len(shape) != len(declared)
                                         or any(d is not None and d != s for d, s in zip(declared, shape))):
                raise CaptureError(f"input {name!r}: shape {shape} does not match the model's {tuple(declared)}")
            declared = shape
        if declared is None or any(d is None for d in declared):
            open_inputs.append((name, declared))
            continue
        specs.append(tf.TensorSpec((batch_size,) + tuple(declared), tf.as_dtype(dtype), name=spec_name(name)))
    if open_inputs:
        raise CaptureError(open_inputs_message(open_inputs))
    return structure, names, specs


def open_inputs_message(open_inputs: list[tuple[str, tuple | None]]) -> str:
    """One message for every input whose shape is not known (None: the model was never built), with the
    --input-shape flags and the autotune.toml line to copy, open dimensions to fill in as D1, D2, ..."""
    count = iter(range(1, 1 << 30))
    filled = {name: None if declared is None else [str(d) if d is not None else f"D{next(count)}" for d in declared]
              for name, declared in open_inputs}
    for name, dims in filled.items():
        if dims is None:  # never built: the rank is not known either
            filled[name] = [f"D{next(count)}", f"D{next(count)}", "..."]
    described = ", ".join(f"{name} {('batch', *declared) if declared is not None else '(shape unknown)'}".replace("'", "")
                          for name, declared in open_inputs)
    flags = " ".join(f"--input-shape {name}={','.join(dims)}" for name, dims in filled.items())
    toml = "input_shapes = {" + ", ".join(f"{name} = [{', '.join(dims)}]" for name, dims in filled.items()) + "}"
    never_built = [name for name, declared in open_inputs if declared is None]
    why = (" (the model has no defined inputs: never built, a subclassed model or a Sequential without an Input; "
           "or call the model once before saving it)" if never_built else "")
    return (f"{len(open_inputs)} input(s) with open dimensions (None){why}: {described}; give each its shape without "
            f"the batch, D1, D2, ... replaced by the lengths to tune for: {flags}  (or in autotune.toml: {toml})")


def _outputs(model, x_structure, x_specs) -> tuple[Any, list[str], list[tuple]]:
    """(structure, names, shapes without the batch) of the outputs at the given input shapes: the
    declared ones when they are fully known, else what the model computes for those inputs."""
    structure = getattr(model, "_outputs_struct", None)
    if structure is not None and getattr(model, "outputs", None):
        leaves = keras.tree.flatten(structure)
        names = _leaf_names(structure, leaves) if isinstance(structure, dict) else \
            list(getattr(model, "output_names", None) or _leaf_names(structure, leaves))
        shapes = [tuple(t.shape)[1:] for t in leaves]
        if all(d is not None for s in shapes for d in s):
            return structure, names, shapes
    else:
        names = None
    symbolic = [keras.KerasTensor(tuple(s.shape), dtype=s.dtype.name) for s in x_specs]
    try:
        spec = model.compute_output_spec(keras.tree.pack_sequence_as(_indexed(x_structure), symbolic))
    except Exception as error:  # the model's own code failed on these shapes
        raise CaptureError(f"cannot compute the model's output shapes for inputs "
                           f"{[tuple(s.shape) for s in x_specs]}: {type(error).__name__}: {error}") from error
    leaves = keras.tree.flatten(spec)
    if structure is None:
        structure = spec
    if names is None:
        names = [str(k) for k in sorted(spec)] if isinstance(spec, dict) else \
            (["output"] if len(leaves) == 1 else [f"output_{i}" for i in range(len(leaves))])
    return structure, names, [tuple(t.shape)[1:] for t in leaves]


def _per_output(value, names: list[str], i: int, what: str):
    """One output's entry of a setting given once, as a list (by position) or a dict (by name)."""
    if isinstance(value, dict):
        unknown = [k for k in value if k not in names]
        if unknown:
            raise CaptureError(f"{what}: {unknown[0]!r} is not an output of the model; "
                               f"its outputs: {', '.join(names)}")
        return value.get(names[i])
    return value[i] if isinstance(value, (list, tuple)) and i < len(value) else \
        (None if isinstance(value, (list, tuple)) else value)


def trains_itself(model) -> bool:
    """A model with a ``train_step`` of its own and no compiled loss computes its losses itself (the
    guide's VAE, compiled with an optimizer only and trained with ``fit(x)``): its step takes x alone."""
    return getattr(model, "loss", None) is None and type(model).train_step is not keras.Model.train_step


def label_specs(model, batch_size: int, x_structure, x_specs, label_shapes=None, label_dtype=None):
    """(structure, names, specs) of the labels: one per output, its loss's shape and dtype; none for a
    model that ``trains_itself`` unless ``label_shapes`` are given."""
    if label_shapes is None and trains_itself(model):
        return None, [], []
    structure, names, shapes = _outputs(model, x_structure, x_specs)
    if label_shapes is not None and not isinstance(label_shapes, dict) and len(names) == 1 and label_shapes \
            and not isinstance(label_shapes[0], (list, tuple)):
        label_shapes = [label_shapes]
    specs = []
    for i, (name, shape) in enumerate(zip(names, shapes)):
        loss = _per_output(model.loss, names, i, "loss")
        sparse = loss is not None and is_sparse_loss(loss)
        given = None if label_shapes is None else _per_output(label_shapes, names, i, "label_shapes")
        if given is not None:
            shape = tuple(int(d) for d in given)
        elif sparse:
            shape = shape[:-1]
        if any(d is None for d in shape):
            raise CaptureError(f"output {name!r} has open dimensions {shape}: give label_shapes")
        dtype = None if label_dtype is None else _per_output(label_dtype, names, i, "label_dtype")
        dtype = tf.as_dtype(dtype) if dtype else (tf.int32 if sparse else tf.float32)
        specs.append(tf.TensorSpec((batch_size,) + tuple(shape), dtype,
                                   name=f"y{i}" if len(names) > 1 else "y"))
    return structure, names, specs


def step_specs(model, batch_size: int, inputs: StepInputs = NO_STEP_INPUTS, *, sample_weight: bool = False) -> StepSpecs:
    """The specs and structures of ``model``'s step at ``batch_size``, with the shapes ``inputs`` gives;
    ``sample_weight``: one weight per sample of the loss too (a model with several outputs takes one
    weight for all of them, as ``class_weight`` gives)."""
    x_structure, x_names, x_specs = input_specs(model, batch_size, inputs.input_shapes)
    y_structure, y_names, y_specs = label_specs(model, batch_size, x_structure, x_specs, inputs.label_shapes,
                                                inputs.label_dtype)
    weight = tf.TensorSpec((batch_size,), tf.float32, name="sample_weight") if sample_weight else None
    return StepSpecs(tuple(x_names), tuple(y_names), tuple(x_specs), tuple(y_specs),
                     _indexed(x_structure), _indexed(y_structure), weight)


def build_if_needed(model, step: StepSpecs) -> None:
    """A subclassed model loaded unbuilt creates its variables on a first call: make it here, eagerly
    (inside the traced step TF would refuse to create them)."""
    if getattr(model, "built", True) and model.weights:
        return
    zeros = [tf.zeros((1,) + tuple(spec.shape)[1:], spec.dtype) for spec in step.x_specs]  # batch 1: cheap
    try:
        model(keras.tree.pack_sequence_as(step.x_structure, zeros))
    except Exception as error:  # the model's own code failed on these shapes
        raise CaptureError(f"calling the model on inputs {[tuple(s.shape) for s in step.x_specs]} failed: "
                           f"{type(error).__name__}: {error}") from error


def output_classes(model, step: StepSpecs) -> list[int]:
    """Per label, a bound for integer labels: the output's last dimension (sparse losses' classes)."""
    _, _, shapes = _outputs(model, step.x_structure, step.x_specs)
    return [int(s[-1]) if s and s[-1] is not None else 2 for s in shapes]


def _all_layers(model) -> list:
    found = []
    for layer in model.layers:
        found.append(layer)
        if isinstance(layer, keras.Model):
            found.extend(_all_layers(layer))
    return found


def _token_vocab(model, inp) -> int:
    """Vocabulary size for an integer input: the Embedding that reads it (2 without one)."""
    embeddings = [l for l in _all_layers(model) if isinstance(l, keras.layers.Embedding)]
    for layer in embeddings:
        try:
            consumed = keras.tree.flatten(layer.input)
        except (AttributeError, ValueError):  # layer called several times
            continue
        if any(t is inp for t in consumed):
            return int(layer.input_dim)
    for layer in embeddings:
        if layer.name == "token_embedding":
            return int(layer.input_dim)
    if embeddings:
        return int(min(l.input_dim for l in embeddings))
    return 2


def _input_vocabularies(model, count: int) -> list[int]:
    """Per flat input, the bound of integer values it takes (token ids below the Embedding's size)."""
    structure = getattr(model, "_inputs_struct", None)
    leaves = keras.tree.flatten(structure) if structure is not None and getattr(model, "inputs", None) else []
    if len(leaves) != count:
        return [2] * count
    return [_token_vocab(model, leaf) for leaf in leaves]


def synthetic_batch(model, batch_size: int, inputs: StepInputs = NO_STEP_INPUTS, *, seed: int = 0):
    """A deterministic random batch shaped as the captured step expects, in the model's own structures
    (a dict for dict inputs): float inputs in [0, 1), integer inputs token ids below the vocabulary of
    the Embedding that reads them; labels as each output's loss expects (``loss_kind``): class ids
    below the output's last dimension (sparse), one-hot (categorical), values in [0, 1) (binary), or
    standard-normal floats. The one synthetic batch of the tool, its tests and benchmarks."""
    if int(batch_size) < 1:
        raise CaptureError(f"batch size must be a positive integer, got {batch_size!r}")
    rng = np.random.default_rng(seed)
    step = step_specs(model, batch_size, inputs)

    def values(spec, kind: str, high: int) -> np.ndarray:
        shape, dtype = tuple(spec.shape), spec.dtype.as_numpy_dtype
        if kind == "sparse" or spec.dtype.is_integer:
            return rng.integers(0, max(high, 1), size=shape, dtype=np.int32).astype(dtype)
        if spec.dtype.is_bool:
            return rng.random(shape) < 0.5
        if kind == "categorical":
            return np.eye(high, dtype=np.float32)[rng.integers(0, high, size=shape[:-1])].astype(dtype)
        if kind == "binary":
            return rng.random(shape, dtype=np.float32).astype(dtype)
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    xs = []
    for spec, vocab in zip(step.x_specs, _input_vocabularies(model, len(step.x_specs))):
        if spec.dtype.is_integer:
            xs.append(rng.integers(0, vocab, size=tuple(spec.shape)).astype(spec.dtype.as_numpy_dtype))
        elif spec.dtype.is_bool:
            xs.append(rng.random(tuple(spec.shape)) < 0.5)
        else:
            xs.append(rng.random(tuple(spec.shape), dtype=np.float32).astype(spec.dtype.as_numpy_dtype))
    kinds = [loss_kind(_per_output(model.loss, list(step.y_names), i, "loss")) for i in range(len(step.y_specs))]
    ys = [values(spec, kind, high) for spec, kind, high in zip(step.y_specs, kinds, output_classes(model, step))]
    return step.pack(xs, ys)

