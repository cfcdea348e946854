"""Everything a user hands the tool, checked: model directory, ``autotune.toml``, sizes.

Each mistake ends in one ``InputError`` with a message saying what is wrong and what to do;
the CLI turns it into one line on stderr and exit code 2.
"""

from __future__ import annotations

import re
import tomllib
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
    label_shapes: list[list[int]] | None = None
    label_dtype: str | None = None
    trials: int | None = None
    timeout: float | None = None
    sampler: str | None = None
    policy: str | None = None
    seed: int | None = None
    max_overhead: float | None = None
    graph_rewrites: list[str] | None = None
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
                "memory": (str, int), "device": str, "sampler": str, "policy": str, "label_dtype": str,
                "input_shapes": (dict, list), "label_shapes": list, "graph_rewrites": list}
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, expected[key]):
            raise InputError(f"{path}: {key} = {value!r} has the wrong type")
    return Config(**data)


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


def load_model(path: Path):
    """Load a compiled Keras model, or explain why it cannot be used."""
    import keras

    try:
        model = keras.models.load_model(path)
    except Exception as error:  # Keras raises many kinds for a broken or foreign file
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(f"{path} could not be loaded as a Keras model: {first[:300]}") from None
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None or model.loss is None:
        raise InputError(f"{path} holds a model that is not compiled with an optimizer and a loss: "
                         "call model.compile(optimizer=..., loss=...) before model.save(...)")
    return model
