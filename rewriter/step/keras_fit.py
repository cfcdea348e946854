"""Train with the rewritten step: ``model.fit`` (and ``train_on_batch``) call a ``SwapStep``.

``use_swap_step(model, step_or_plan, ...)`` replaces the model's ``train_function`` (what Keras 3's
``fit``/``train_on_batch`` call once per batch) with one that feeds each batch to the ``SwapStep`` and
returns its logs, so callbacks, progress bars, History and metrics work as before. A batch of another
size (the last, smaller batch of an epoch) gets the same plan applied at its size (cached).
``restore_train_function(model)`` undoes it; ``swapping(model, plan, ...)`` is the context-manager form.

``sample_weight`` and ``class_weight`` (which ``fit`` turns into a weight per sample) only weight the
loss: a batch that has them runs the plan applied to the step traced with the weights as one more
input (``rewriter.apply(..., sample_weight=True)``, cached); one weight per output is refused.
``model.compile`` resets Keras' train function and so drops the swap step (apply again).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import tensorflow as tf

from rewriter.step.apply_plan import apply
from rewriter.step.swap_step import SwapStep

log = logging.getLogger(__name__)

_ORIGINAL = "_swap_original_train_function"
WEIGHT_PER_OUTPUT = ("the swap-rewritten training step takes one sample weight per sample (as class_weight gives), "
                     "not one per output")
_STEP = "_swap_step"


def _unpack(data) -> tuple[Any, Any, Any]:
    if isinstance(data, (list, tuple)):
        if len(data) == 2:
            return data[0], data[1], None
        if len(data) == 3:
            return data[0], data[1], data[2]
        if len(data) == 1:
            return data[0], None, None
    return data, None, None


def _batches(iterator, count: int) -> Iterator[Any]:
    """Up to ``count`` batches from a tf.data / distributed iterator or a Python iterator."""
    if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
        for _ in range(count):
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                return
            yield optional.get_value()
    else:
        for _, data in zip(range(count), iterator):
            yield data


def train_function_of(model, step, run_batch: Callable[[Any, Any, Any], Any]):
    """A Keras ``train_function(iterator) -> logs`` running ``run_batch(x, y, sample_weight) -> logs`` on each
    of the up to ``steps_per_execution`` batches Keras hands it; marked as ``step``'s."""

    def train_function(iterator):
        logs = None
        for data in _batches(iterator, max(int(getattr(model, "steps_per_execution", 1) or 1), 1)):
            logs = run_batch(*_unpack(data))
        if logs is None:
            raise StopIteration
        return logs

    train_function._swap_step = step  # noqa: SLF001 -- marks it as ours
    return train_function


def make_train_function(model, step: SwapStep):
    """A Keras ``train_function(iterator) -> logs`` that runs ``step`` on each batch."""

    def run_batch(x, y, sample_weight):
        if y is None and step.traced.inputs is not None and step.traced.inputs.y_names:
            raise ValueError("the swap-rewritten training step needs labels (x, y)")
        if isinstance(sample_weight, (dict, list, tuple)):
            raise ValueError(f"{WEIGHT_PER_OUTPUT}; undo it with rewriter.step.keras_fit.restore_train_function(model)")
        # with sample_weight or class_weight: the plan applied to the step traced with the weights
        target = step.for_batch(step.batch_of(x), weighted=sample_weight is not None or step.weighted)
        return target.run(x, y, sample_weight)

    return train_function_of(model, step, run_batch)


def use_swap_step(model, step_or_plan, *, batch_size: int | None = None, **apply_kwargs) -> SwapStep:
    """Make ``model.fit``/``train_on_batch`` run the swap-rewritten step; returns the ``SwapStep``.

    ``step_or_plan``: a ``SwapStep`` built for ``model``, or a plan (anything ``rewriter.step.apply_plan``
    accepts, e.g. a path to a plan JSON) applied at ``batch_size`` with ``apply_kwargs``.
    """
    if isinstance(step_or_plan, SwapStep):
        step = step_or_plan
        if step._model is not None and step._model is not model:  # noqa: SLF001
            raise ValueError("this SwapStep was built for another model")
    else:
        step = apply(model, step_or_plan, batch_size=batch_size, **apply_kwargs)
    if getattr(model, "jit_compile", False):
        log.warning("%s: model.fit now runs the swap-rewritten step without XLA, where Keras compiled its own "
                    "train_step with XLA (jit_compile=True, its default on a GPU): the plan was made and measured "
                    "for the step without XLA", getattr(model, "name", "model"))
    install_train_function(model, make_train_function(model, step), step)
    log.info("model %s trains with the swap-rewritten step (%d swaps)", getattr(model, "name", "?"), step.n_swap_outs)
    return step


def install_train_function(model, function, step) -> None:
    """Make ``function`` the model's train function, Keras' own kept for ``restore_train_function``."""
    if not hasattr(model, _ORIGINAL):
        setattr(model, _ORIGINAL, model.train_function)
    model.train_function = function
    setattr(model, _STEP, step)


def restore_train_function(model) -> None:
    """Undo ``use_swap_step``: Keras' own train function is used again."""
    if hasattr(model, _ORIGINAL):
        model.train_function = getattr(model, _ORIGINAL)
        delattr(model, _ORIGINAL)
    if hasattr(model, _STEP):
        delattr(model, _STEP)


def swap_step_of(model) -> SwapStep | None:
    """The SwapStep ``model.fit`` currently uses, if any (None after ``compile`` reset it)."""
    function = getattr(model, "train_function", None)
    return getattr(function, "_swap_step", None)


@contextlib.contextmanager
def swapping(model, step_or_plan, *, batch_size: int | None = None, **apply_kwargs):
    """``with swapping(model, plan, batch_size=32): model.fit(...)`` -- undone on exit."""
    step = use_swap_step(model, step_or_plan, batch_size=batch_size, **apply_kwargs)
    try:
        yield step
    finally:
        restore_train_function(model)


class KerasStep:
    """Keras' own ``train_step`` in a ``tf.function``, as a plain ``model.fit`` runs it without XLA:
    TF's executor picks the op order and Grappler runs as configured. This is the step a user trains
    with when not using the tool's, so "fits without swapping" is measured on it too (its peak can be
    well above the serialized step's). ``rewriter.timing.measurement`` takes it like a ``SwapStep``."""

    def __init__(self, model) -> None:
        self._model = model
        # fit(x) gives a model that trains on its inputs alone x itself (rewriter.trace.step_inputs.trains_itself)
        self._function = tf.function(lambda x, y: model.train_step(x if y is None else (x, y)), autograph=False)
        self.calls = 0  # its first call makes its constants (rewriter.timing.measurement)
        self.constant_bytes: int | None = None

    def __call__(self, x, y):
        self.calls += 1
        return self._function(x, y)

    def snapshot(self) -> "ModelSnapshot":
        return ModelSnapshot(self._model)


class ModelSnapshot:
    """Host copies of a model's weights, optimizer state and metric state, put back by ``restore()``."""

    def __init__(self, model) -> None:
        seen = {}
        for variable in (list(model.variables) + list(model.optimizer.variables)
                         + list(getattr(model, "metrics_variables", []))):
            seen[id(variable)] = variable
        self._values = [(v, v.numpy()) for v in seen.values()]

    def restore(self) -> None:
        for variable, value in self._values:
            variable.assign(value)
