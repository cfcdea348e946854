"""A variable write while a read of the variable is still pending holds the old buffer beside the new
one (``OpGraph.held_tensor``, ``simulator.sharing``), and the writes moved after their reads
(``simulator.state.writes_after_reads``); hand-computed cases, a moved step's derived graph, and the host's CPU
timing the update a plan moved there."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from simulator import BACKWARD, FORWARD, UPDATE, GraphError, OpGraph, SwapPlan, get_device, replay
from simulator.ordering import execution_order
from simulator.replay import live_buffers, op_seconds
from simulator.state import STREAM_SLOTS, HostState, host_ops, with_host_state, writes_after_reads
from simulator.state.host_update import WEIGHT_READS, host_cpu_seconds

WEIGHT_BYTES = 1000


def weight_decay_step(backward_first: bool) -> OpGraph:
    """A forward read W of a weight feeds the forward f and the backward b; the weight decay d = W * wd
    and its write w (which stands for the old buffer, tensor "w:0") only follow the read. With
    ``backward_first`` a control edge makes the write wait for b."""
    return OpGraph.build(
        op_name=["read", "f", "decay", "write", "b"],
        op_type=["ReadVariableOp", "MatMul", "Mul", "AssignSubVariableOp", "MatMul"],
        op_phase=[FORWARD, FORWARD, UPDATE, UPDATE, BACKWARD],
        tensor_producer=[0, 1, 2, 3, 4],
        tensor_bytes_ab=[(WEIGHT_BYTES, 0), (100, 0), (WEIGHT_BYTES, 0), (WEIGHT_BYTES, 0), (100, 0)],
        tensor_persistent=[True, False, False, False, False],
        tensor_swappable=[False, True, True, False, True],
        edge_tensor=[0, 0, 2, 1, 0],
        edge_consumer=[1, 2, 3, 4, 4],
        edge_slot=[1, 0, 0, 0, 1],
        control_src=[0] + ([4] if backward_first else []),
        control_dst=[3] + ([3] if backward_first else []),
        persistent_bytes_ab=(WEIGHT_BYTES, 0),
        outputs=[4],
        held_tensor=[3],
        held_read=[0],
    )


def test_a_write_before_the_last_reader_of_a_read_holds_the_old_buffer(unit):
    g = weight_decay_step(backward_first=False)
    r = replay(g, None, unit)
    # order read, f, decay, write, b: at the write f:0 (100), decay:0 (1000) and the old weight (1000)
    assert r.peak_bytes == WEIGHT_BYTES + 100 + WEIGHT_BYTES + WEIGHT_BYTES
    table = live_buffers(g, None, r)
    held = table[table["tensor"] == "write:0"]
    assert held["bytes"].tolist() == [WEIGHT_BYTES] and held["free_slot"].tolist() == [4]  # b's slot


def test_a_write_after_every_reader_updates_in_place(unit):
    g = weight_decay_step(backward_first=True)
    r = replay(g, None, unit)
    # order read, f, decay, b, write: at b f:0, decay:0 and b:0; the write holds nothing
    assert r.peak_bytes == WEIGHT_BYTES + 100 + WEIGHT_BYTES + 100
    assert "write:0" not in live_buffers(g, None, r)["tensor"].tolist()


def test_held_pairs_are_saved_and_checked(tmp_path):
    g = weight_decay_step(backward_first=False)
    loaded = OpGraph.load(g.save(tmp_path / "g.npz"))
    assert loaded.held_tensor.tolist() == [3] and loaded.held_read.tolist() == [0]
    arrays = {name: getattr(g, name) for name in OpGraph._ARRAY_FIELDS}
    np.savez(tmp_path / "old.npz", header_json=np.asarray('{"format_version": 1, "batch_size": 1}'), **arrays)
    assert len(OpGraph.load(tmp_path / "old.npz").held_tensor) == 0  # files from before the pairs existed
    with pytest.raises(GraphError, match="persistent"):
        OpGraph.build(**{**arrays, "held_tensor": [3], "held_read": [1]})


def test_writes_after_reads_runs_the_write_and_its_own_ops_after_every_reader(unit):
    """``simulator.state.writes_after_reads``: the decay (read only by the write) and the write wait for f and
    b, so the weight is updated in place and the decay's product lives only until the write: the peak drops
    from three weights' bytes to two; the ops, tensors and data edges stay, only control edges are added."""
    g = weight_decay_step(backward_first=False)
    late = writes_after_reads(g)
    assert late.meta["writes_after_reads"] == 2
    assert sorted(zip(late.control_src.tolist(), late.control_dst.tolist())) == [(0, 3), (1, 2), (4, 2)]
    assert np.array_equal(late.edge_tensor, g.edge_tensor) and np.array_equal(late.tensor_bytes_ab, g.tensor_bytes_ab)
    assert late.op_name[execution_order(late)].tolist() == ["read", "f", "b", "decay", "write"]
    r = replay(late, None, unit)
    assert r.peak_bytes == WEIGHT_BYTES + 100 + WEIGHT_BYTES < replay(g, None, unit).peak_bytes
    assert "write:0" not in live_buffers(late, None, r)["tensor"].tolist()
    assert writes_after_reads(late) is late and writes_after_reads(weight_decay_step(backward_first=True)).n_ops == 5
    plain = OpGraph.build(**{name: getattr(g, name) for name in OpGraph._ARRAY_FIELDS if name not in
                             ("held_tensor", "held_read")})
    assert writes_after_reads(plain) is plain  # no write holds a read


def test_a_graph_made_from_a_moved_step_is_not_moved_again(unit):
    """A graph derived from one with optimizer slots on the host (a recomputation's or a split's graph keeps its
    meta, not its memo) is already moved: replaying a plan that carries the state takes the slots' bytes out of
    the resident state once, and a different state is refused."""
    g = weight_decay_step(backward_first=True)
    g = dataclasses.replace(g, persistent_bytes_ab=np.array([3.0 * WEIGHT_BYTES, 0.0]), meta={"movable_state": {
        "refusal": None, "variables": {"w": {"slot_bytes": 2 * WEIGHT_BYTES, "ops": ["decay"]}}}})
    state, copies_in = (HostState("w"),), not unit.host_buffers_shared
    moved = with_host_state(g, state, copies_in=copies_in)
    assert moved.persistent_bytes == WEIGHT_BYTES
    derived = dataclasses.replace(moved, _graph_memo={})  # as recompute.actions and split.actions build theirs
    assert with_host_state(derived, state, copies_in=copies_in) is derived
    plan = dataclasses.replace(SwapPlan.empty(derived), host_state=state)
    assert replay(derived, plan, unit).persistent_bytes == WEIGHT_BYTES
    with pytest.raises(GraphError, match="other optimizer state"):
        with_host_state(derived, state, copies_in=not copies_in)


# the host's CPU updating the state a plan moved there (docs/design.md 13): beside a GPU its time is the host's
# rate, not the op times the graph has; on the testbed the update's ops keep theirs
SLOT_BYTES = 2 * WEIGHT_BYTES


def moved_step():
    g = weight_decay_step(backward_first=True)
    flops = np.array([[1.0, 0.0], [20.0, 0.0], [7.0, 0.0], [1.0, 0.0], [20.0, 0.0]])  # seconds on the unit device
    variables = {"w": {"slot_bytes": SLOT_BYTES, "ops": ["decay"], "weight_bytes": WEIGHT_BYTES}}
    return dataclasses.replace(g, op_flops_ab=flops, persistent_bytes_ab=np.array([3.0 * WEIGHT_BYTES, 0.0]),
                               meta={"movable_state": {"refusal": None, "variables": variables}})


def test_a_host_with_a_rate_runs_the_update_at_it_and_the_device_not_at_all(unit):
    g, state = moved_step(), (HostState("w"),)
    plan = dataclasses.replace(SwapPlan.empty(g), host_state=state)
    rated = dataclasses.replace(unit, host_update_bytes_per_s=50.0, host_update_variable_s=3.0)
    without, beside = replay(g, plan, unit), replay(g, plan, rated)
    decay = g.op_index()["decay"]
    moved = with_host_state(g, state, copies_in=True)
    assert op_seconds(moved, unit)[decay] > 0 and op_seconds(moved, rated)[decay] == 0.0
    assert op_seconds(g, rated)[decay] == op_seconds(g, unit)[decay]  # the step as captured keeps it
    host_s = 3.0 + (2 * WEIGHT_BYTES + SLOT_BYTES) / 50.0  # one variable: weight, gradient, slots
    assert beside.step_s == pytest.approx(without.step_s - op_seconds(g, unit)[decay] + host_s)
    assert beside.peak_bytes == without.peak_bytes


def test_the_gpu_presets_time_the_hosts_update_and_the_testbed_times_it_in_the_step():
    for name in ("v100-16gb", "a100-80gb", "h100-80gb"):
        device = get_device(name)
        assert device.host_update_bytes_per_s > 0 and device.host_update_s(2, 1e9) > device.host_update_s(1, 1e9)
    assert get_device("cpu-testbed").host_update_s(10, 1e9) == 0.0


# a variable whose slot m is streamed (docs/design.md 13): the update reads m, writes m += delta, reads it again
STREAMED = {"slot_bytes": WEIGHT_BYTES, "weight_bytes": WEIGHT_BYTES, "ops": ["m_read", "delta", "m_write",
            "m_read2", "change"], "slot_ops": ["m_read", "m_write", "m_read2"], "weight_ops": ["read", "w_write"]}


def streamed_step(entry: dict = STREAMED) -> OpGraph:
    """read -> f -> b (the gradient g); the update: delta = f(g, m), m += delta (its output the old buffer, held
    while the first read of m is pending), m read again after the write, the weight's change from it, its write.
    Flops: each op's seconds on the unit device."""
    return OpGraph.build(
        op_name=["read", "f", "b", "m_read", "delta", "m_write", "m_read2", "change", "w_write"],
        op_type=["ReadVariableOp", "MatMul", "MatMul", "ReadVariableOp", "Sub", "AssignAddVariableOp",
                 "ReadVariableOp", "Mul", "AssignSubVariableOp"],
        op_phase=[FORWARD, FORWARD, BACKWARD] + [UPDATE] * 6,
        op_flops_ab=[(1.0, 0.0), (20.0, 0.0), (20.0, 0.0), (1.0, 0.0), (5.0, 0.0), (2.0, 0.0), (1.0, 0.0),
                     (5.0, 0.0), (2.0, 0.0)],
        tensor_producer=[0, 1, 2, 3, 4, 5, 6, 7, 8],
        tensor_bytes_ab=[(WEIGHT_BYTES, 0), (100, 0), (WEIGHT_BYTES, 0), (WEIGHT_BYTES, 0), (WEIGHT_BYTES, 0),
                         (WEIGHT_BYTES, 0), (WEIGHT_BYTES, 0), (WEIGHT_BYTES, 0), (WEIGHT_BYTES, 0)],
        tensor_persistent=[True, False, False, True, False, False, True, False, False],
        tensor_swappable=[False, True, True, False, True, False, False, True, False],
        edge_tensor=[0, 0, 1, 2, 3, 4, 6, 7],
        edge_consumer=[1, 2, 2, 4, 4, 5, 7, 8],
        edge_slot=[0, 0, 1, 0, 1, 0, 0, 0],
        control_src=[5, 2], control_dst=[6, 8],
        persistent_bytes_ab=(2 * WEIGHT_BYTES, 0),
        outputs=[1],
        held_tensor=[5], held_read=[3],
        meta={"movable_state": {"refusal": None, "variables": {"w": entry}}},
    )


def test_streamed_slots_run_their_reads_and_writes_on_the_host_and_the_update_on_the_device(unit):
    """Mode ``stream-slots``: only m's reads and writes run on the host. The slot leaves the resident bytes; each
    read of it the device reads is a copy in, a buffer of the device's just before its reader; the delta written to
    it is the device's until the write (its copy out); the write's old buffer is the host's. The copies are the step
    time's, the update keeps its device time and the host's CPU (where it has a rate) runs the slot's writes only:
    the slot's bytes at its rate."""
    g = streamed_step()
    streamed, updated = (HostState("w", STREAM_SLOTS),), (HostState("w"),)
    assert g.op_name[host_ops(g, streamed)].tolist() == ["m_read", "m_write", "m_read2"]
    moved = with_host_state(g, streamed, copies_in=True)
    reads = moved.meta[WEIGHT_READS]
    assert [g.tensor_name(t) for t in reads] == ["m_read:0", "m_read2:0"]
    assert moved.persistent_bytes == WEIGHT_BYTES and not moved.tensor_persistent[reads].any()
    assert moved.tensor_bytes[g.tensor_index()["m_write:0"]] == 0 and len(moved.held_tensor) == 0
    order = moved.op_name[execution_order(moved)].tolist()
    assert order.index("m_read") == order.index("delta") - 1  # copied in just before its reader, not at the start
    plan = dataclasses.replace(SwapPlan.empty(g), host_state=streamed)
    r = replay(g, plan, unit)
    # at delta: the weight (resident), f:0, g, m's copy in and delta; at m_write (on the host) nothing new
    assert r.peak_bytes == WEIGHT_BYTES + 100 + 3 * WEIGHT_BYTES
    assert r.h2d_bytes == 2 * WEIGHT_BYTES and r.d2h_bytes == WEIGHT_BYTES  # m in twice, delta out once
    copies_s = 3 * WEIGHT_BYTES / unit.h2d_bytes_per_s
    assert r.step_s - r.compute_s == pytest.approx(copies_s)
    rated = dataclasses.replace(unit, host_update_bytes_per_s=50.0, host_update_variable_s=3.0)
    beside = replay(g, plan, rated)
    slot_s = 3.0 + WEIGHT_BYTES / 50.0  # m, as many bytes as the weight (streamed_step)
    assert beside.host_update_s == pytest.approx(slot_s) == host_cpu_seconds(moved, streamed, rated)
    unrated = dataclasses.replace(rated, host_update_bytes_per_s=0.0)  # the slot's ops then take device time
    on_host_s = op_seconds(moved, unrated)[host_ops(g, streamed)].sum()
    assert beside.step_s == pytest.approx(replay(g, plan, unrated).step_s - on_host_s + slot_s)
    device_s = op_seconds(moved, rated)
    assert device_s[g.op_index()["delta"]] > 0 and device_s[g.op_index()["m_write"]] == 0.0
    assert replay(g, dataclasses.replace(plan, host_state=updated), rated).host_update_s == pytest.approx(
        3.0 + 3 * WEIGHT_BYTES / 50.0)  # the update on the host: weight, gradient and slot at its rate


def test_streaming_a_graph_captured_before_slot_ops_were_recorded_asks_for_a_new_capture(unit):
    old = streamed_step({key: value for key, value in STREAMED.items() if key != "slot_ops"})
    plan = dataclasses.replace(SwapPlan.empty(old), host_state=(HostState("w", STREAM_SLOTS),))
    with pytest.raises(GraphError, match="streams the slots of 'w'.*capture it again"):
        replay(old, plan, unit)
    assert replay(old, dataclasses.replace(plan, host_state=(HostState("w"),)), unit).persistent_bytes == WEIGHT_BYTES
