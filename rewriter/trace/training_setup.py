"""What a compiled Keras model trains with: optimizer, loss and dtype policy. Recorded in the captured
graph's ``meta["training"]`` so the report says what was tuned (a plan made for Adam is not a plan
for SGD: the optimizer state is resident memory, ``rewriter.trace.state_kinds``)."""

from __future__ import annotations

from collections import Counter
from typing import Any


# optimizer settings that change what the optimizer keeps (its state) or how a step updates it
STATE_SETTINGS = ("momentum", "nesterov", "beta_1", "beta_2", "amsgrad", "rho", "centered", "weight_decay",
                  "use_ema", "ema_momentum", "gradient_accumulation_steps", "clipnorm", "global_clipnorm", "clipvalue",
                  "loss_scale_factor", "initial_scale", "dynamic_growth_steps")


def _plain(value: Any) -> Any:
    """A config value as JSON holds it: numbers and strings as they are, a schedule or object by its class."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return float(f"{value:.6g}")  # float32 settings read back as 0.009999999776
    if isinstance(value, dict) and "class_name" in value:
        return value["class_name"]
    return type(value).__name__


def _learning_rate(optimizer) -> Any:
    rate = getattr(optimizer, "_learning_rate", None)
    if rate is not None and not hasattr(rate, "numpy") and callable(rate):  # a LearningRateSchedule
        return type(rate).__name__
    try:
        return _plain(float(optimizer.learning_rate))
    except (TypeError, ValueError, AttributeError):
        return _plain(optimizer.get_config().get("learning_rate"))


def describe_optimizer(optimizer) -> dict[str, Any] | None:
    """Class, learning rate and the settings that shape its state; a loss-scale wrapper with its inner optimizer."""
    if optimizer is None:
        return None
    try:
        config = optimizer.get_config()
    except (NotImplementedError, TypeError, AttributeError):
        config = {}
    inner = getattr(optimizer, "inner_optimizer", None)
    described: dict[str, Any] = {"class": type(optimizer).__name__}
    if inner is not None:
        described["inner"] = describe_optimizer(inner)
    else:
        described["learning_rate"] = _learning_rate(optimizer)
    described["settings"] = {key: _plain(config[key]) for key in STATE_SETTINGS if key in config}
    return described


def describe_loss(loss: Any) -> Any:
    """The compiled loss by name: a string as given, a function or Loss object by its name; lists and dicts item by item."""
    if loss is None or isinstance(loss, str):
        return loss
    if isinstance(loss, dict):
        return {str(key): describe_loss(value) for key, value in loss.items()}
    if isinstance(loss, (list, tuple)):
        return [describe_loss(value) for value in loss]
    return getattr(loss, "__name__", None) or type(loss).__name__


def dtype_policies(model) -> str | None:
    """The dtype policies of the layers that hold weights (the model's own when none do): one name when
    they agree, else each with its count, most used first (``mixed_float16 (3 layers), float32 (1 layer)``)."""
    layers = [layer for layer in model._flatten_layers(include_self=False) if layer.weights]
    names = Counter(getattr(layer.dtype_policy, "name", str(layer.dtype_policy)) for layer in layers)
    if not names:
        policy = getattr(model, "dtype_policy", None)
        return None if policy is None else getattr(policy, "name", str(policy))
    if len(names) == 1:
        return next(iter(names))
    return ", ".join(f"{name} ({count} layer{'s' * (count != 1)})" for name, count in names.most_common())


def describe_training(model) -> dict[str, Any]:
    """What ``model`` trains with."""
    optimizer = getattr(model, "optimizer", None)
    return {
        "optimizer": describe_optimizer(optimizer),
        "loss": describe_loss(getattr(model, "loss", None)),
        "dtype_policy": dtype_policies(model),
    }
