"""Everything a user hands the tool, checked: model directory, ``autotune.toml``, sizes.

Each mistake ends in one ``InputError`` with a message saying what is wrong and what to do;
the CLI turns it into one line on stderr and exit code 2.
"""

from __future__ import annotations

import re
import tomllib
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

CONFIG_NAME = "autotune.toml"


class InputError(ValueError):
    """A user mistake: bad path, bad model file, bad config value."""


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_bytes(text: str | int | float, what: str = "memory") -> int:
    """'16GiB', '16 GB', '800MiB', '1.5e9' -> bytes (GiB/MiB binary, GB/MB decimal)."""
    if isinstance(text, bool):
        raise InputError(f"{what}: expected a size like 16GiB, got {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise InputError(f"{what}: {text!r} is not a size; use e.g. 16GiB, 800MiB, 12GB or a number of bytes")
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise InputError(f"{what} must be positive, got {text!r}")
    return size


_BINARY_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def format_bytes(size: float) -> str:
    for unit, scale in _BINARY_UNITS:
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


def byte_unit(size: float) -> tuple[str, int]:
    """(name, bytes per unit) of the unit ``format_bytes`` would show ``size`` in: an axis of a
    small model's figure reads in KiB or MiB, not "0.01 GiB"."""
    for unit, scale in _BINARY_UNITS:
        if abs(size) >= scale:
            return unit, scale
    return "B", 1


@dataclass
class Config:
    """Defaults from ``autotune.toml`` (command-line flags override them)."""

    batch_size: int | None = None
    memory: str | None = None
    device: str | None = None
    input_shapes: dict[str, list[int]] | list[list[int]] | None = None
    label_shapes: list[list[int]] | dict[str, list[int]] | None = None  # per output: by position or name
    label_dtype: str | dict[str, str] | None = None
    trials: int | None = None
    timeout: float | None = None
    sampler: str | None = None
    policy: str | None = None
    seed: int | None = None
    max_overhead: float | None = None
    recompute: bool | None = None  # false: swap only (--no-recompute)
    split: bool | None = None  # false: never run ops in parts along the batch (--no-split)
    state: bool | None = None  # false: the optimizer state stays on the device (--no-state)
    plots: bool | None = None  # false: the report without its figures (--no-plots)
    graph_rewrites: list[str] | None = None
    imports: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def load_config(directory: Path) -> Config:
    path = directory / CONFIG_NAME
    if not path.exists():
        return Config()
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"cannot read {path}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise InputError(f"{path} is not valid TOML: {error}") from None
    known = {f.name for f in fields(Config)} - {"extra"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InputError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    expected = {"batch_size": int, "trials": int, "seed": int, "timeout": (int, float), "max_overhead": (int, float),
                "memory": (str, int), "device": str, "sampler": str, "policy": str,
                "input_shapes": (dict, list), "label_shapes": (dict, list), "graph_rewrites": list,
                "imports": list, "label_dtype": (str, dict), "recompute": bool,
                "split": bool, "state": bool, "plots": bool}
    for key, value in data.items():
        if isinstance(value, bool) != (expected[key] is bool) or not isinstance(value, expected[key]):
            raise InputError(f"{path}: {key} = {value!r} has the wrong type")
        check_config_value(f"{path}: {key}", key, value)
    return Config(**data)


# the dtypes a label may have (TensorFlow's names; checked here without importing it)
LABEL_DTYPES = ("bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                "uint32", "uint64", "bool", "complex64", "complex128")


def check_config_value(where: str, key: str, value) -> None:
    """One ``autotune.toml`` value, checked as the flag it stands for is (``where`` names it in the file)."""
    positive = {"batch_size": 1, "trials": 1, "seed": 0}
    if key in positive and value < positive[key]:
        raise InputError(f"{where} must be {'positive' if positive[key] else 'non-negative'}, got {value}")
    if key == "timeout" and value <= 0:
        raise InputError(f"{where} must be positive, got {value}")
    if key == "max_overhead" and value < 0:
        raise InputError(f"{where} must not be negative, got {value}")
    if key == "memory":
        parse_bytes(value, where)
    if key == "device":
        from simulator.device.presets import DEVICES

        if value.lower().replace("_", "-") not in DEVICES:
            raise InputError(f"{where}: unknown device {value!r}; known: {', '.join(sorted(DEVICES))}")
    if key in ("input_shapes", "label_shapes"):
        shapes = value.items() if isinstance(value, dict) else \
            ([("", value)] if value and not isinstance(value[0], list) else [(str(i), s) for i, s in enumerate(value)])
        for name, shape in shapes:
            if not isinstance(shape, list) or (not shape and key == "input_shapes") or \
                    not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
                label = f"{where}.{name}" if isinstance(value, dict) else where
                raise InputError(f"{label} = {shape!r}: expected a list of positive whole numbers (the shape "
                                 f"without the batch), e.g. [224, 224, 3]")
    if key == "label_dtype":
        for name, dtype in (value.items() if isinstance(value, dict) else [("", value)]):
            if dtype not in LABEL_DTYPES:
                label = f"{where}.{name}" if isinstance(value, dict) else where
                raise InputError(f"{label} = {dtype!r} is not a dtype; use one of {', '.join(LABEL_DTYPES)}")
    if key in ("imports", "graph_rewrites") and not all(isinstance(v, str) and v.strip() for v in value):
        raise InputError(f"{where} = {value!r}: expected a list of names")


def find_model_file(path: str | Path) -> Path:
    """MODEL_DIR holds exactly one ``.keras`` file; a path to the file itself works too."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path} does not exist")
    if path.is_file():
        if path.suffix != ".keras":
            raise InputError(f"{path} is not a .keras model file")
        return path
    models = sorted(path.glob("*.keras"))
    if not models:
        raise InputError(f"no .keras model in {path} (save one with model.save('{path}/model.keras'))")
    if len(models) > 1:
        names = ", ".join(m.name for m in models)
        raise InputError(f"{path} holds {len(models)} models ({names}): pass the file to tune")
    return models[0]


OPTIMIZER_SKIPPED = re.compile(r"Skipping variable loading for optimizer '([^']*)', because it has (\d+) variables "
                               r"whereas the saved optimizer has (\d+) variables")


def load_model(path: Path, describe_error=None, notes: list[str] | None = None):
    """Load a compiled Keras model, or explain why it cannot be used (``describe_error(error)``: the
    message, by default Keras' first line). Keras' warning that it skipped the saved optimizer's
    variables (a model saved before it trained has none) becomes a sentence in ``notes``: the tuning
    sizes the optimizer state from the model's weights, so it changes nothing here."""
    import keras

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            model = keras.models.load_model(path)
        skipped_optimizers = []  # Keras' warning per optimizer it skipped (a LossScaleOptimizer and its inner one: two)
        for warning in caught:
            skipped = OPTIMIZER_SKIPPED.search(str(warning.message))
            if skipped:
                skipped_optimizers.append(skipped)
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        if skipped_optimizers and notes is not None:
            named = len(skipped_optimizers) > 1
            counts = "; ".join(f"{found.group(3)} variables saved, {found.group(2)} built"
                               + (f" for {found.group(1)}" if named else "") for found in skipped_optimizers)
            notes.append(f"the optimizer state saved in {Path(path).name} was not loaded (Keras: {counts}; a model "
                         "saved before it trained has none): the tuning sizes the optimizer state from the model's "
                         "weights, so the result is the same")
    except Exception as error:  # Keras raises many kinds for a broken or foreign file
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        text = describe_error(error) if describe_error is not None else first[:300]
        raise InputError(f"{path} could not be loaded as a Keras model: {text}") from None
    from rewriter.trace.step_inputs import trains_itself

    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None or (
            model.loss is None and not trains_itself(model)):
        raise InputError(f"{path} holds a model that is not compiled with an optimizer and a loss: "
                         "call model.compile(optimizer=..., loss=...) before model.save(...) (a model whose "
                         "own train_step computes its losses needs only the optimizer)")
    return model
