"""Which tensor of a traced ``train_step`` is its loss, for Keras' own step and for custom ones.

Keras' ``train_step`` calls ``self._compute_loss``; a custom one written as the Keras guide does calls
``self.compute_loss`` (so do ``_compute_loss`` and a user's override of ``compute_loss``); one that
computes its loss by hand still takes its gradient with ``tape.gradient(loss, ...)``. While the step is
traced, all three are watched: the last ``compute_loss`` result is the loss, else the last scalar a
gradient was taken of.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import tensorflow as tf


@dataclass
class RecordedLosses:
    computed: list[Any] = field(default_factory=list)  # what (_)compute_loss returned
    differentiated: list[Any] = field(default_factory=list)  # scalar targets of tape.gradient

    def loss(self):
        """The step's loss tensor, or None when the step neither computed nor differentiated one."""
        found = [t for t in self.computed if isinstance(t, tf.Tensor)] or self.differentiated
        return found[-1] if found else None


@contextlib.contextmanager
def recording_losses(model) -> Iterator[RecordedLosses]:
    """Watch ``model``'s loss computations and every ``GradientTape.gradient`` while tracing."""
    recorded = RecordedLosses()
    names = [name for name in ("compute_loss", "_compute_loss") if hasattr(model, name)]
    originals = {name: getattr(model, name) for name in names}

    def watching(original):
        def compute_loss(*args, **kwargs):
            loss = original(*args, **kwargs)
            recorded.computed.append(loss)
            return loss
        return compute_loss

    gradient = tf.GradientTape.gradient

    def watched_gradient(tape, target, *args, **kwargs):
        if isinstance(target, tf.Tensor) and target.shape.rank == 0:
            recorded.differentiated.append(target)
        return gradient(tape, target, *args, **kwargs)

    for name in names:
        setattr(model, name, watching(originals[name]))
    tf.GradientTape.gradient = watched_gradient
    try:
        yield recorded
    finally:
        tf.GradientTape.gradient = gradient
        for name in names:
            with contextlib.suppress(AttributeError):
                delattr(model, name)
