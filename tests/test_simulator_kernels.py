"""The compiled replay's parts that mirror numpy where the golden set cannot reach every case
(tests/test_simulator_golden.py holds the whole replay to recorded results)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from simulator import SwapParams, kernel_memory, plan_swaps, replay
from simulator.replay import Replay
from simulator.synthetic import training_graph


@pytest.mark.parametrize("seed", range(3))
def test_pairwise_sum_is_numpys_sum_bit_for_bit(seed):
    """``Replay.copy_overlap_s`` is an ``np.sum`` in the numpy replay: the kernel's sum must round alike."""
    rng = np.random.default_rng(seed)
    for n in [*range(0, 300), *rng.integers(300, 20_000, 40)]:
        values = rng.standard_normal(int(n)) * 10.0 ** rng.integers(-6, 6, int(n))
        assert np.float64(kernel_memory._pairwise_sum(values)).tobytes() == np.float64(np.sum(values)).tobytes(), n


def test_searchsorted_is_numpys_where_values_are_not_in_order():
    """Slot starts (finish - duration) can step back by an ulp after ops of no time: there the kernel
    searches as numpy does, and must find what numpy finds."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        values = np.cumsum(rng.random(int(rng.integers(1, 400))))
        values[rng.integers(0, len(values), 5)] -= rng.random(5)  # some out of order
        keys = np.concatenate([np.sort(rng.random(50) * values[-1]), rng.random(20) * values[-1]])
        found = np.empty(len(keys), np.int64)
        kernel_memory._numpy_searchsorted_right(values, keys, found)
        assert np.array_equal(found, np.searchsorted(values, keys, side="right"))


def test_a_replay_carries_every_field():
    """The replay fills a Replay without its ``__init__``: a field it leaves out would read as the
    class default, not fail."""
    g = training_graph(30, batch_size=4)
    result = replay(g, plan_swaps(g, SwapParams(threshold=3, lb=1, ub=4)), "v100-16gb")
    assert result.n_swap_outs > 0
    assert set(vars(result)) == {field.name for field in dataclasses.fields(Replay)}
