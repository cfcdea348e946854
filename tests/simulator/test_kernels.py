"""The compiled replay's parts that mirror numpy where the golden set cannot reach every case
(tests/simulator/test_golden.py holds the whole replay to recorded results)."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from benchmarks.reference import same_replay
from simulator import SwapParams, plan_swaps, replay
from simulator.device.presets import get_device
from simulator.fusion import fusion_tables
from simulator.graph import ORDER_NAMES
from simulator.kernels import memory as kernel_memory
from simulator.kernels import plan_loops
from simulator.kernels.records import FusionRecord
from simulator.ordering import execution_order, position_of
from simulator.replay import ON_DEMAND_FIELDS, Replay, op_seconds
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


@pytest.mark.parametrize("device", ["v100-16gb", "cpu-testbed"])
def test_a_replay_carries_every_field(device):
    """The replay fills a Replay without its ``__init__``: a field it leaves out would read as the
    class default, not fail; those it leaves to be computed on demand are computed at their first read
    (copy_overlap_s at once where the step time depends on it: a device with copy contention)."""
    g = training_graph(30, batch_size=4)
    result = replay(g, plan_swaps(g, SwapParams(threshold=3, lb=1, ub=4)), device)
    assert result.n_swap_outs > 0
    fields = {field.name for field in dataclasses.fields(Replay)}
    assert set(vars(result)) == fields - set(ON_DEMAND_FIELDS) | {"_on_demand"} | (
        {"copy_overlap_s"} if get_device(device).copy_contention else set())
    copy = pickle.loads(pickle.dumps(result))  # every field computed, not the graph's context
    assert set(vars(copy)) == fields and same_replay(copy, result) and same_replay(result, copy)
    for name in fields:
        getattr(result, name)
    assert set(vars(result)) == fields | {"_on_demand"}


def test_fields_on_demand_are_the_replays():
    """op_end_s, op_start_s and copy_overlap_s, read on demand, are what the kernels made before they
    were left out: each op's slot finish, less its time; the compute inside copies (here against
    numpy's own ``cumsum``, ``clip`` and ``sum`` of it, as the numpy replay took it)."""
    g = training_graph(30, batch_size=4)
    device = get_device("v100-16gb")
    result = replay(g, plan_swaps(g, SwapParams(threshold=3, lb=1, ub=4)), device)
    finish = result.op_end_s[execution_order(g)]
    assert np.array_equal(result.op_start_s, result.op_end_s - op_seconds(g, device))
    assert np.all(np.diff(finish) > 0) and finish[-1] == result.step_s
    start = result.op_start_s[execution_order(g)]
    done = np.concatenate([[0.0], np.cumsum(finish - start)])
    copies = [(result.swap_out_start_s, result.swap_out_end_s), (result.swap_in_start_s, result.swap_in_end_s)]

    def done_by(times):
        slot = np.searchsorted(start, times, side="right") - 1
        inside = done[slot] + np.clip(times - start[slot], 0.0, (finish - start)[slot])
        return np.where(slot >= 0, inside, 0.0)

    expected = np.sum(np.concatenate([done_by(end) - done_by(begin) for begin, end in copies]))
    assert result.copy_overlap_s > 0 and result.copy_overlap_s == expected


def test_a_record_takes_exactly_its_fields():
    """The kernels' records are built by name: a field left out or one too many is an error, not a
    record whose fields are shifted by one."""
    g = training_graph(10, batch_size=2)
    fields = {"position": position_of(g), "tensor_producer": g.tensor_producer,
              **{name: getattr(fusion_tables(g), name) for name in fusion_tables(g).__dataclass_fields__}}
    assert isinstance(FusionRecord(**fields), FusionRecord)
    with pytest.raises(TypeError, match="position"):
        FusionRecord(**{name: value for name, value in fields.items() if name != "position"})
    with pytest.raises(TypeError, match="n_keys"):
        FusionRecord(**fields, n_keys=3)


def test_graphs_orders_and_devices_share_one_compiled_replay():
    """Every record's field has one type whatever the graph, order, batch size or device, so the replay
    and the planner compile once (a second type would compile them again: tens of seconds)."""
    for ops, batch in ((12, 2), (30, 4)):
        for order in ORDER_NAMES:
            g = training_graph(ops, batch_size=batch).with_order(order)
            for device in ("v100-16gb", "cpu-testbed"):
                params = SwapParams(threshold=3, lb=1, ub=4, order=order)
                assert replay(g, plan_swaps(g, params, kept_reads=get_device(device).kept_reads), device).n_swap_outs
    assert len(plan_loops.replay_plan.signatures) == 1
    assert len(plan_loops.plan_reads.signatures) == 1
