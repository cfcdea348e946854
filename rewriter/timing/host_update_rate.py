"""How fast this machine's CPU applies a Keras optimizer's update: the host's side of a plan that keeps optimizer
state on the host beside a GPU (docs/design.md 13).

Beside a GPU the update of a moved variable runs on the host's CPU, not on the device whose op times the graph
has, and a CPU is one to two orders of magnitude slower at it than the GPU's memory. ``measure_host_update``
times the user's own optimizer (a fresh copy of its class and configuration, the same Keras ops the step runs)
on variables on the host, at two shapes (many small variables, a few large ones), interleaved and repeated
(``timed_passes``), and fits ``seconds = variables * per_variable_s + state_bytes / bytes_per_s``, where a
variable's state bytes are its weight, its gradient and its slots (``simulator.DeviceModel``'s
``host_update_bytes_per_s`` and ``host_update_variable_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from rewriter.timing.device_calibration import nonnegative_least_squares, timed_passes

# (variables, parameters each): many small variables time the per-variable cost, a few large ones the rate
SHAPES = ((96, 256), (2, 1 << 24))  # the large ones past the caches, as a large model's are


class HostUpdateError(ValueError):
    """An optimizer whose update cannot be timed on its own (it needs more than gradients and variables)."""


@dataclass(frozen=True)
class HostUpdateRate:
    """The fitted rate: ``seconds = variables * per_variable_s + state_bytes / bytes_per_s``."""

    optimizer: str  # the optimizer's class name
    bytes_per_s: float
    per_variable_s: float
    measured_s: tuple[float, ...]  # per shape of ``shapes``, the median update
    state_bytes: tuple[int, ...]
    shapes: tuple[tuple[int, int], ...]

    def seconds(self, variables: int, state_bytes: float) -> float:
        return variables * self.per_variable_s + state_bytes / self.bytes_per_s

    def describe(self) -> str:
        return (f"{self.optimizer} on the host: {self.bytes_per_s / 1e9:.2f} GB/s of weights, gradients and slots, "
                f"{self.per_variable_s * 1e6:.1f} us per variable (" + ", ".join(
                    f"{n} x {size} parameters: {t * 1e3:.2f} ms" for (n, size), t in zip(self.shapes, self.measured_s))
                + ")")


def measure_host_update(optimizer: keras.optimizers.Optimizer, *, host: str = "/device:CPU:0",
                        shapes: tuple[tuple[int, int], ...] = SHAPES, min_timing_s: float = 2.0,
                        max_timing_s: float = 10.0) -> HostUpdateRate:
    """Time ``optimizer``'s update (a fresh copy: its class and ``get_config()``) on float32 variables on ``host``
    at each of ``shapes`` and fit the rate. Raises ``HostUpdateError`` for an optimizer that cannot be copied or
    applied on its own."""
    calls, state_bytes = {}, []
    for variables, size in shapes:
        call, nbytes = _update_call(optimizer, host, variables, size)
        calls[(variables, size)] = call
        state_bytes.append(nbytes)
    for call in calls.values():  # traced and warmed up outside the timing
        try:
            call()
        except (tf.errors.OpError, ValueError, TypeError, NotImplementedError) as error:
            raise HostUpdateError(f"{type(optimizer).__name__}'s update does not run on variables alone: "
                                  f"{_own_words(error)}") from None
    timing = timed_passes(calls, min_passes=4, max_passes=30, min_total_s=min_timing_s, max_total_s=max_timing_s)
    measured = np.array([timing.step_s[key] for key in calls])
    design = np.array([[variables, nbytes] for (variables, _), nbytes in zip(shapes, state_bytes)], np.float64)
    per_variable_s, seconds_per_byte = nonnegative_least_squares(design, measured)
    if not seconds_per_byte > 0:
        raise HostUpdateError(f"{type(optimizer).__name__}'s update took no longer on {max(state_bytes)} bytes of "
                              "state than on a few: its rate cannot be measured")
    return HostUpdateRate(type(optimizer).__name__, 1.0 / seconds_per_byte, per_variable_s,
                          tuple(float(t) for t in measured), tuple(state_bytes), tuple(shapes))


def _update_call(optimizer, host: str, variables: int, size: int):
    """A traced call of a fresh copy of ``optimizer`` applying constant gradients to ``variables`` variables of
    ``size`` parameters on ``host``, and the state bytes it updates (weights, gradients, slots)."""
    try:
        fresh = type(optimizer).from_config(optimizer.get_config())
    except (TypeError, ValueError, KeyError) as error:
        raise HostUpdateError(f"{type(optimizer).__name__} cannot be copied from its config: {error}") from None
    with tf.device(host):
        weights = [keras.Variable(np.full(size, 0.5, np.float32), name=f"w{k}") for k in range(variables)]
        grads = [tf.constant(np.full(size, 1e-3, np.float32)) for _ in range(variables)]
        fresh.build(weights)
    slot_bytes = sum(int(np.prod(v.shape)) * 4 for v in fresh.variables if int(np.prod(v.shape)) == size)

    @tf.function
    def apply():
        with tf.device(host):
            fresh.apply(grads, weights)
        return fresh.iterations

    return apply, variables * size * 4 * 2 + slot_bytes


def _own_words(error: BaseException) -> str:
    """The error's type and own message: a traced function's error puts them last, after "in user code:" and a
    trace."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    words, kind = (lines[-1][:300] if lines else ""), type(error).__name__
    return words if words.startswith(kind) else f"{kind}: {words}"
