"""simulator.CalibratedDevice without TensorFlow: measured op times serve every batch size of the
calibrated model's graph, copies add their contention, and another model's graph is refused."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from autotune.run.calibrated_timing import calibration_batches, extrapolation_note
from autotune.run.tuning import resolve_device
from benchmarks.step_time import MODELS as BENCH_MODELS, calibration_batches as bench_calibration_batches
from simulator import CalibratedDevice, CalibrationError, CalibrationMismatchError, SwapParams, plan_swaps, replay
from simulator.device.presets import get_device
from simulator.graph import BACKWARD, FORWARD, OpGraph
from simulator.recompute.actions import clone_name
from simulator.replay import op_seconds
from simulator.synthetic import OpSpec, from_spec, training_graph


def _calibrated(g: OpGraph, *, contention: float = 0.0, rows: slice = slice(None), seed: int = 0) -> CalibratedDevice:
    """A calibration of ``g`` with random per-op (a, b); with ``rows``, of a graph of the same model that
    differs from ``g`` (as a graph rewrite makes it) and has only those of g's ops."""
    rng = np.random.default_rng(seed)
    ab = np.stack([rng.uniform(1e-5, 1e-4, g.n_ops), rng.uniform(1e-5, 1e-3, g.n_ops)], axis=1)
    device = CalibratedDevice.from_preset(
        get_device("cpu-testbed"), g, op_seconds_ab=ab, batch_sizes=(2, 4), measured_step_s=(0.1, 0.2),
        h2d_bytes_per_s=2e10, d2h_bytes_per_s=2e10, transfer_latency_s=2e-6, copy_contention=contention,
        roofline_scale=3.0)
    if rows != slice(None):
        device = dataclasses.replace(device, op_names=device.op_names[rows], op_seconds_ab=device.op_seconds_ab[rows],
                                     graph_fingerprint="another structure")
    return device


def test_measured_op_times_serve_every_batch_size():
    g = training_graph(12, batch_size=2)
    device = _calibrated(g)
    ab = np.asarray(device.op_seconds_ab)
    for batch in (2, 8, 64):
        at = g.with_batch(batch)
        expected = ab[:, 0] + ab[:, 1] * batch
        assert np.allclose(op_seconds(at, device), expected)
        assert replay(at, None, device).step_s == pytest.approx(expected.sum())
    # the roofline preset gives other times: the calibration is what is used
    assert not np.allclose(op_seconds(g, device), op_seconds(g, get_device("cpu-testbed")))


def test_contention_adds_its_share_of_the_compute_beside_copies_to_the_step():
    g = training_graph(12, batch_size=8)
    plan = plan_swaps(g, SwapParams(threshold=1))
    assert plan.n_swaps > 0
    free, contended = _calibrated(g), _calibrated(g, contention=0.7)
    assert free != contended and hash(free) != hash(contended)
    base, slowed = replay(g, plan, free), replay(g, plan, contended)
    # the compute time inside each copy's interval, counted op by op
    copies = list(zip(base.swap_out_start_s, base.swap_out_end_s)) + list(zip(base.swap_in_start_s, base.swap_in_end_s))
    overlap_s = sum(max(0.0, min(end, op_end) - max(start, op_start))
                    for start, end in copies for op_start, op_end in zip(base.op_start_s, base.op_end_s))
    transfer_s = sum(end - start for start, end in copies)
    assert 0 < overlap_s < transfer_s  # some copies run while the step waits for them
    assert base.copy_overlap_s == pytest.approx(overlap_s)
    assert slowed.step_s == pytest.approx(base.step_s + 0.7 * overlap_s)
    assert slowed.peak_bytes == base.peak_bytes  # memory does not depend on it
    assert replay(g, None, contended).step_s == pytest.approx(replay(g, None, free).step_s)  # no copies, no cost


def test_a_graph_of_another_model_is_refused():
    g = training_graph(12, batch_size=2)
    device = _calibrated(g)
    other = training_graph(20, batch_size=2)  # another structure
    with pytest.raises(CalibrationMismatchError, match="synthetic-12"):
        replay(other, None, device)
    wider = training_graph(12, seed=3, batch_size=2)  # same structure, other tensor sizes
    assert wider.fingerprint() == g.fingerprint()
    with pytest.raises(CalibrationMismatchError, match="other tensor shapes"):
        replay(wider, None, device)
    assert issubclass(CalibrationMismatchError, CalibrationError) and issubclass(CalibrationError, ValueError)


def test_ops_the_calibration_did_not_see_take_the_scaled_roofline():
    g = training_graph(30, batch_size=4)
    keep = int(0.95 * g.n_ops)
    device = _calibrated(g, rows=slice(0, keep))
    # a graph that differs a little from the calibrated one is served
    seconds = op_seconds(g, device)
    roofline = np.asarray(get_device("cpu-testbed").op_seconds(g.op_flops, g.op_touched_bytes))
    assert np.allclose(seconds[keep:], 3.0 * roofline[keep:])
    ab = np.asarray(device.op_seconds_ab)
    assert np.allclose(seconds[:keep], ab[:, 0] + ab[:, 1] * 4)
    # too little of it calibrated: another model
    with pytest.raises(CalibrationMismatchError, match="% of its ops calibrated"):
        op_seconds(g, _calibrated(g, rows=slice(0, g.n_ops // 2)))


def test_one_replica_s_step_takes_the_single_device_step_s_op_times_by_name_and_type():
    """A replica's step (docs/design.md 14) names its optimizer's ops apart and adds the all-reduce: an op keeps its
    measured time where the calibrated graph has an op of its name and type, the others take the scaled roofline."""
    g = training_graph(12, batch_size=4)
    device = _calibrated(g)
    names, types = g.op_name.astype(object), g.op_type.copy()
    names[-20:] = [f"replica/renamed_{k}" for k in range(20)]
    names = names.astype(str)
    types[0] = "CollectiveReduceV2"  # a name the calibration saw, another op
    replica = dataclasses.replace(g, op_name=names, op_type=types)
    served = device.for_graph(replica, g, "one replica's step")
    seconds = op_seconds(replica, served)
    roofline = 3.0 * np.asarray(get_device("cpu-testbed").op_seconds(g.op_flops, g.op_touched_bytes))
    ab = np.asarray(device.op_seconds_ab)
    kept = np.arange(1, g.n_ops - 20)
    assert np.allclose(seconds[kept], ab[kept, 0] + ab[kept, 1] * 4)
    assert np.allclose(seconds[[0, *range(g.n_ops - 20, g.n_ops)]], roofline[[0, *range(g.n_ops - 20, g.n_ops)]])
    assert served.notes[-1].startswith(f"one replica's step: {len(kept)} of its {g.n_ops} ops by their measured")
    assert served.name != device.name and served.preset == device.preset


def test_ops_named_apart_in_one_scope_take_the_times_of_as_many_of_their_type_in_order():
    """Adam's update ops are numbered apart in a replica's trace: within one name scope and type, in graph order,
    they take the calibrated ones' times where both graphs have as many; where the counts differ, the roofline."""
    g = training_graph(12, batch_size=4)
    updates = [i for i, kind in enumerate(g.op_type.tolist()) if kind == "AssignSubVariableOp"]
    renamed = g.op_name.astype(object)
    renamed[updates] = [f"adam/Assign_{k}" for k in range(len(updates))]
    renamed = renamed.astype(str)
    single = dataclasses.replace(g, op_name=renamed)
    device = _calibrated(single)
    ab = np.asarray(device.op_seconds_ab)
    apart = renamed.astype(object)
    apart[updates] = [f"adam/Assign_{k + 100}" for k in range(len(updates))]
    apart = apart.astype(str)
    seconds = op_seconds(dataclasses.replace(g, op_name=apart), device.for_graph(
        dataclasses.replace(g, op_name=apart), single, "a replica"))
    assert np.allclose(seconds[updates], ab[updates, 0] + ab[updates, 1] * 4)
    types = g.op_type.copy()
    types[updates[0]] = "AssignVariableOp"  # one fewer of the type in the scope: no pairing by order
    other = dataclasses.replace(g, op_name=apart, op_type=types)
    roofline = 3.0 * np.asarray(get_device("cpu-testbed").op_seconds(g.op_flops, g.op_touched_bytes))
    assert np.allclose(op_seconds(other, device.for_graph(other, single, "a replica"))[updates], roofline[updates])


def test_the_tuner_takes_a_calibrated_device():
    g = training_graph(8, batch_size=2)
    device = _calibrated(g)
    chosen, budget, why = resolve_device(device, 2**30)
    assert chosen is device and budget == 2**30
    assert device.name.startswith("cpu-testbed-calibrated-") and device.name != _calibrated(g, seed=1).name
    moved = dataclasses.replace(device, host_memory_bytes=2**40)  # what tune_graph does for unlimited host RAM
    assert isinstance(moved, CalibratedDevice) and op_seconds(g, moved).sum() == pytest.approx(op_seconds(g, device).sum())


def test_anchoring_again_keeps_the_shares_and_moves_the_totals():
    g = training_graph(12, batch_size=2)
    device = _calibrated(g)
    first, second = device.measured_step_s
    again = device.with_step_times([2 * first, 3 * second])
    for b, factor in zip(device.batch_sizes, (2, 3)):
        at = g.with_batch(b)
        assert np.allclose(op_seconds(at, again), factor * op_seconds(at, device))
    assert again != device and again.name != device.name and again.graph_fingerprint == device.graph_fingerprint
    with pytest.raises(ValueError):
        device.with_step_times([1.0])


def test_a_recomputed_clone_takes_its_originals_time():
    """Recomputation (simulator.recompute.actions) adds clones named ``<op>/recompute_<k>`` that run their
    original's kernel: a calibration of the model serves them with the original's measured time."""
    specs = [OpSpec("x", "Placeholder", FORWARD, (), ((0.0, 1024.0),)),
             OpSpec("conv", "Conv2D", FORWARD, ["x"], ((0.0, 4096.0),)),
             OpSpec("relu", "Relu", FORWARD, ["conv"], ((0.0, 4096.0),)),
             OpSpec("loss", "Sum", FORWARD, ["relu"], (4,)),
             OpSpec("grad", "ReluGrad", BACKWARD, ["loss", "relu"], ((0.0, 4096.0),))]
    g = from_spec(specs, outputs=["grad"], batch_size=2, meta={"model": "tiny"})
    clone = clone_name("relu", 0)
    recomputed = from_spec(specs[:-1] + [OpSpec(clone, "Relu", FORWARD, ["conv"], ((0.0, 4096.0),), control_inputs=["loss"]),
                                         OpSpec("grad", "ReluGrad", BACKWARD, ["loss", clone], ((0.0, 4096.0),))],
                           outputs=["grad"], batch_size=2, meta={"model": "tiny"})
    device = _calibrated(g)
    seconds = dict(zip(recomputed.op_name.tolist(), op_seconds(recomputed, device)))
    measured = dict(zip(g.op_name.tolist(), op_seconds(g, device)))
    assert seconds[clone] == pytest.approx(measured["relu"]) and seconds["relu"] == pytest.approx(measured["relu"])
    assert device.coverage(recomputed) == 1.0


def test_where_the_op_after_a_producer_waits_for_its_copy_out_every_copy_out_is_waited_for():
    # the CPU testbed makes the op after a swapped tensor's producer wait for its copy out
    # (Placement.copies_wait_for_compute): the replay waits for it as for a synchronous one, and each swap-in
    # waits for the copies out of what its trigger made (after_copies_out), as the testbed's rewrite has it
    g = training_graph(12, batch_size=8)
    plan = plan_swaps(g, SwapParams(threshold=1))
    synchronous = plan_swaps(g, SwapParams(threshold=1, sync="out", after_copies_out=True))
    assert not plan.sync_out.any() and synchronous.sync_out.all() and not plan.after_copies_out
    device = _calibrated(g)
    waiting = dataclasses.replace(device, copies_out_wait=True)
    assert waiting != device
    free, waited = replay(g, plan, device), replay(g, plan, waiting)
    assert waited.step_s > free.step_s
    assert waited.step_s == pytest.approx(replay(g, synchronous, device).step_s)
    assert replay(g, synchronous, waiting).step_s == pytest.approx(replay(g, synchronous, device).step_s)
    forced = plan_swaps(g, SwapParams(threshold=1, after_copies_out=True))
    assert (replay(g, forced, waiting).step_s, replay(g, forced, waiting).peak_bytes) == (waited.step_s,
                                                                                          waited.peak_bytes)


def test_the_product_calibrates_at_two_batch_sizes_of_2_or_more_up_to_the_measured_one():
    g = training_graph(12, batch_size=1)
    testbed = SimpleNamespace(measured_on="cpu")
    assert calibration_batches(g, 16, testbed) == (8, 16)  # the measured run's batch and half of it
    # batch 1 is off the line the larger ones lie on; a run that maximizes the batch starts from 1
    assert calibration_batches(g, 1, testbed) == (2, 3)
    assert calibration_batches(g, 2, testbed) == (2, 3)
    assert calibration_batches(g, 4, testbed) == (2, 4)
    assert extrapolation_note((8, 16), 16) == ""
    assert "4.0x" in extrapolation_note((8, 16), 64)


def test_the_benchmark_calibrates_every_model_at_half_and_three_quarters_of_its_measured_batch():
    assert bench_calibration_batches(4) == (2, 3) and bench_calibration_batches(16) == (8, 12)
    assert all(bench_calibration_batches(setup.batch)[-1] < setup.batch for setup in BENCH_MODELS.values())
    for bad in (2, 6):
        with pytest.raises(ValueError):
            bench_calibration_batches(bad)
