"""The host's rate at a Keras optimizer's update (``rewriter.timing.host_update_rate``): what a plan that keeps
optimizer state on the host beside a GPU spends on the host's CPU (docs/design.md 13)."""

from __future__ import annotations

import tests.tf_tools as th  # noqa: I001 -- first: configures TF before its runtime starts

import keras
import pytest

from rewriter.timing import HostUpdateError, measure_host_update

pytestmark = pytest.mark.tf
SMALL = ((16, 64), (2, 1 << 18))  # a default run's shapes: a second each
HOST = "/device:CPU:1"  # the testbed's host


@pytest.mark.parametrize("optimizer, slots", [
    pytest.param(lambda: keras.optimizers.SGD(0.01, momentum=0.9), 1, id="sgd-momentum"),
    pytest.param(lambda: keras.optimizers.Adam(1e-3), 2, id="adam", marks=pytest.mark.long),  # as AdamW's
    pytest.param(lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.01), 2, id="adamw")])
def test_the_rate_counts_weights_gradients_and_the_optimizers_own_slots(optimizer, slots):
    rate = measure_host_update(optimizer(), host=HOST, shapes=SMALL, min_timing_s=0.2, max_timing_s=3.0)
    assert rate.state_bytes == tuple(n * size * 4 * (2 + slots) for n, size in SMALL)
    assert rate.bytes_per_s > 0 and rate.per_variable_s >= 0
    assert rate.measured_s[1] > rate.measured_s[0] > 0  # 512K parameters take longer than 1K
    # the fit is the measurements' own where it needs no clamp at zero
    if rate.per_variable_s > 0:
        for (n, size), nbytes, seconds in zip(rate.shapes, rate.state_bytes, rate.measured_s):
            assert rate.seconds(n, nbytes) == pytest.approx(seconds, rel=1e-9)


def test_an_optimizer_that_cannot_be_copied_is_refused_in_words():
    class Fixed(keras.optimizers.SGD):
        def __init__(self, *, rate):  # get_config's keys are not its arguments
            super().__init__(rate)

    with pytest.raises(HostUpdateError, match="cannot be copied from its config"):
        measure_host_update(Fixed(rate=0.1), shapes=SMALL, min_timing_s=0.2, max_timing_s=1.0)


@pytest.mark.timing
def test_the_rate_predicts_an_update_of_other_shapes():
    """Fitted at the default shapes, the time of 24 variables of 1M parameters within 30 %."""
    optimizer = keras.optimizers.AdamW(1e-3)
    rate = measure_host_update(optimizer)
    other = measure_host_update(optimizer, shapes=((24, 1 << 20), (1, 1 << 10)))
    predicted = rate.seconds(24, other.state_bytes[0])
    assert predicted == pytest.approx(other.measured_s[0], rel=0.3)


def test_an_optimizer_whose_update_needs_more_than_its_variables_is_refused_in_words():
    class Reads(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            raise ValueError("reads the model's loss")

    with pytest.raises(HostUpdateError, match="does not run on variables alone: ValueError: reads the model's loss"):
        measure_host_update(Reads(0.1), shapes=SMALL, min_timing_s=0.2, max_timing_s=1.0)
