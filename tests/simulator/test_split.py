"""Splitting ops along the batch (simulator/split, docs/design.md 12): hand-computed small graphs, and the
micro-batch order of a split step (``simulator.ordering.micro_batch_order``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from simulator import BACKWARD, FORWARD, UPDATE, GraphError, OpGraph, SwapParams, plan_swaps, replay
from simulator.graph import part_of_op
from simulator.ordering import execution_order, orders_of
from simulator.plan import NamedPlan, PlanError, SwapPlan
from simulator.buffers import op_working_set_bytes, peak_lower_bound_bytes
from simulator.split import (BATCH_SUM, ENDS, PER_SAMPLE, SplitRegion, floor_after_splitting, grow_region, op_split,
                             part_batches, split_regions, with_splits)
from simulator.split.classes import rows_per_sample, sample_major
from simulator.split.overhead_bound import least_overhead
from simulator.synthetic import OpSpec, from_spec, training_graph
from tests.conftest import unit_device


def chain(batch: int = 4, persistent: float = 0.0):
    """a -> b -> c -> s: per-sample ops (100, 100, 50 B a sample) and the loss's sum over the batch."""
    return from_spec([
        OpSpec("a", "Conv2D", FORWARD, [], ((0.0, 100.0),), flops=(10.0, 1.0)),
        OpSpec("b", "Relu", FORWARD, ["a"], ((0.0, 100.0),), flops=(0.0, 1.0)),
        OpSpec("c", "Conv2D", FORWARD, ["b"], ((0.0, 50.0),), flops=(0.0, 1.0)),
        OpSpec("s", "Sum", FORWARD, ["c"], (4,), flops=(1.0, 0.0)),
    ], outputs=["s"], batch_size=batch, persistent_bytes=(persistent, 0.0))


def names(g):
    return g.op_name.tolist()


def test_op_classes_from_types_and_sizes():
    g = chain()
    index = g.op_index()
    assert op_split(g, index["a"]).kind == PER_SAMPLE
    assert op_split(g, index["b"]).kind == PER_SAMPLE
    assert op_split(g, index["s"]) == op_split(g, index["s"]).__class__(BATCH_SUM, combine="sum")
    # a Sum that keeps the batch (a LayerNorm's moments) is per-sample
    kept = from_spec([OpSpec("x", "Conv2D", FORWARD, [], ((0.0, 64.0),)),
                      OpSpec("m", "Sum", FORWARD, ["x"], ((0.0, 4.0),))], outputs=["m"])
    assert op_split(kept, 1).kind == PER_SAMPLE
    # leading dimensions of size 1 keep a block of the batch a block of memory; a batch further in does not
    for shape, kind in (("(1,N,1,8)", PER_SAMPLE), ("(N,4)", PER_SAMPLE), ("(2,N,8)", ENDS), ("(4,N)", ENDS)):
        shaped = OpGraph.build(op_name=["x", "r"], op_type=["Conv2D", "Reshape"], op_phase=[FORWARD, FORWARD],
                               tensor_producer=[0, 1], tensor_bytes_ab=[(0.0, 64.0), (0.0, 64.0)],
                               tensor_shape=["(N,8)", shape], edge_tensor=[0], edge_consumer=[1], outputs=[1])
        assert op_split(shaped, 1).kind == kind, shape
    # a gather is per-sample from an embedding table, not from a batch-dependent tensor
    lookup = from_spec([OpSpec("table", "Identity", FORWARD, [], (4096,)),
                        OpSpec("ids", "Cast", FORWARD, [], ((0.0, 8.0),)),
                        OpSpec("rows", "GatherV2", FORWARD, ["table", "ids"], ((0.0, 64.0),)),
                        OpSpec("picked", "GatherV2", FORWARD, ["rows", "ids"], ((0.0, 64.0),))], outputs=["picked"])
    assert op_split(lookup, 2).kind == PER_SAMPLE
    assert op_split(lookup, 3).kind == ENDS and "other samples" in op_split(lookup, 3).reason
    # an op whose rows are not blocks of samples ends a region
    moved = from_spec([OpSpec("x", "Conv2D", FORWARD, [], ((0.0, 64.0),)),
                       OpSpec("s2b", "SpaceToBatchND", FORWARD, ["x"], ((0.0, 64.0),))], outputs=["s2b"])
    assert op_split(moved, 1).kind == ENDS and "batch axis" in op_split(moved, 1).reason


def _flattened(first_type: str, first_shape: str, flat_type: str = "Reshape"):
    """x -> first -> flat (a batch flattened with 4 steps, ``(N*4,8)``) -> a matmul over its rows."""
    shapes = ["(N,4,8)", first_shape, "(N*4,8)", "(N*4,16)"]
    return OpGraph.build(op_name=["x", "first", "flat", "matmul"], op_type=["Conv2D", first_type, flat_type, "MatMul"],
                         op_phase=[FORWARD] * 4, tensor_producer=[0, 1, 2, 3],
                         tensor_bytes_ab=[(0.0, 128.0), (0.0, 128.0), (0.0, 128.0), (0.0, 256.0)],
                         tensor_shape=shapes, edge_tensor=[0, 1, 2], edge_consumer=[1, 2, 3], outputs=[3])


def test_a_flattened_batch_splits_where_its_rows_are_blocks_of_samples():
    """A Dense layer on a sequence (``Tensordot``: a Reshape to ``(batch x steps, width)``, a MatMul): rows of a
    ``(N*4,8)`` tensor made by reshaping a tensor whose samples lead are blocks of samples, and so are the
    MatMul's rows; the same shape made from ``(steps, batch, ...)`` or by a Tile along the batch is not."""
    sample_major_graph = _flattened("Identity", "(N,4,8)")
    assert rows_per_sample("(N*4,8)") == 4 and rows_per_sample("(1,N,8)") == 1 and rows_per_sample("(4,N*2)") is None
    assert sample_major(sample_major_graph).tolist() == [True, True, True, True]
    assert [op_split(sample_major_graph, op).kind for op in (2, 3)] == [PER_SAMPLE, PER_SAMPLE]
    ops, ends = grow_region(sample_major_graph, 0)
    assert ops == [0, 1, 2, 3] and not ends
    interleaved = _flattened("Transpose", "(4,N,8)")  # (steps, batch, width) flattened: rows step-major
    assert sample_major(interleaved).tolist() == [True, False, False, False]
    assert op_split(interleaved, 2).kind == ENDS and op_split(interleaved, 3).kind == ENDS
    assert "leading axis" in op_split(interleaved, 3).reason
    tiled = _flattened("Identity", "(N,4,8)", flat_type="Tile")  # the whole batch repeated: not sample-major
    assert op_split(tiled, 2).kind == ENDS and op_split(tiled, 3).kind == ENDS


def test_a_kernels_scratch_is_each_parts_own():
    """A weight gradient whose kernel takes scratch memory growing with the batch (the capture's ``(scratch)``
    tensor: Eigen's half-precision matmul on CPUs without native float16) still sums over the batch: each part
    has its own scratch, and only the gradient is combined."""
    g = OpGraph.build(op_name=["x", "dy", "dw"], op_type=["Conv2D", "Relu", "MatMul"],
                      op_phase=[FORWARD, FORWARD, FORWARD], tensor_producer=[0, 1, 2, 2],
                      tensor_bytes_ab=[(0.0, 64.0), (0.0, 64.0), (256.0, 0.0), (0.0, 32.0)],
                      tensor_shape=["(N,16)", "(N,16)", "(16,16)", "(scratch)"], edge_tensor=[0, 0, 1],
                      edge_consumer=[1, 2, 2], outputs=[2], batch_size=4)
    assert op_split(g, 2).kind == BATCH_SUM
    s = with_splits(g, [SplitRegion(("x", "dy", "dw"), 2)])
    assert names(s)[-1] == "dw/split_combine_0" and names(s).count("dw/split_combine_0") == 1
    scratch = [t for t in range(s.n_tensors) if str(s.tensor_shape[t]) == "(scratch)"]
    assert s.tensor_bytes[scratch].tolist() == [64, 64]


def test_a_write_holding_a_read_holds_it_in_the_split_step():
    """A variable's write while a read of it is still to be read keeps the old buffer (TensorFlow's copy-on-write,
    ``OpGraph.held_tensor``: AdamW's decay in the forward pass). The split step keeps those pairs, renumbered: the
    weight is held twice from the write to the read's last reader, as in the step as captured (without them a
    split transformer trained with AdamW measured 6 % over its prediction: test_split_parts)."""
    g = OpGraph.build(op_name=["w", "x", "y", "decay", "dx"], op_type=["ReadVariableOp", "Conv2D", "MatMul",
                                                                       "AssignSubVariableOp", "MatMul"],
                      op_phase=[FORWARD, FORWARD, FORWARD, FORWARD, BACKWARD], tensor_producer=[0, 1, 2, 3, 4],
                      tensor_bytes_ab=[(400.0, 0.0), (0.0, 64.0), (0.0, 64.0), (400.0, 0.0), (0.0, 64.0)],
                      tensor_shape=["(10,10)", "(N,10)", "(N,10)", "(10,10)", "(N,10)"],
                      edge_tensor=[1, 0, 0, 2, 0], edge_consumer=[2, 2, 3, 4, 4], outputs=[4],
                      tensor_persistent=[True, False, False, False, False], held_tensor=[3], held_read=[0],
                      batch_size=4)
    s = with_splits(g, [SplitRegion(("x", "y"), 2)])
    assert [(s.tensor_name(t), s.tensor_name(r)) for t, r in zip(s.held_tensor, s.held_read)] == [
        ("decay:0", "w:0")]


def test_part_batches_uneven():
    assert part_batches(4, 2) == [2, 2]
    assert part_batches(4, 3) == [2, 1, 1]
    assert part_batches(10, 4) == [3, 3, 2, 2]
    with pytest.raises(GraphError, match="cannot run in 5 parts"):
        part_batches(4, 5)
    with pytest.raises(GraphError):
        part_batches(1, 2)


def test_chain_in_two_parts_peak_and_floor(unit):
    g = chain()
    # unsplit: slot b holds a (400) and b (400); the floor is b's working set
    assert replay(g, None, unit).peak_bytes == 800
    assert peak_lower_bound_bytes(g) == 800
    s = with_splits(g, [SplitRegion(("a", "b", "c", "s"), 2)])
    assert names(s) == ["a/split_part_0", "a/split_part_1", "b/split_part_0", "b/split_part_1", "c/split_part_0",
                        "c/split_part_1", "s/split_part_0", "s/split_part_1", "s/split_combine_0"]
    assert s.tensor_bytes.tolist() == [200, 200, 200, 200, 100, 100, 4, 4, 4]
    # CTO: a0 a1 b0 b1 c0 c1 s0 s1 combine; at b0: a0 + a1 + b0 = 600 (a0 freed after b0),
    # at b1: a1 + b0 + b1 = 600; then 500, 400, 204, 108 and the combine writes into s0: 8
    r = replay(s, None, unit)
    assert r.level_peak_bytes.tolist() == [400, 600, 500, 204, 8]
    assert r.peak_bytes == 600
    # the floor: a part of b reads a part of a, 200 + 200
    assert peak_lower_bound_bytes(s) == 400
    # the combine reads the partial sums; the step's fetch is the combined sum
    assert s.tensor_name(int(s.outputs[0])) == "s/split_combine_0:0"
    assert split_regions(s)[0]["combines"] == {"s": "sum"}
    assert split_regions(s)[0]["concats"] == [] and split_regions(s)[0]["entries"] == []


def test_uneven_parts_sizes_and_costs(unit):
    g = chain()
    s = with_splits(g, [SplitRegion(("a", "b", "c", "s"), 3)])  # 2, 1, 1 samples
    by_name = dict(zip(names(s), range(s.n_ops)))
    sizes = {s.tensor_name(t): int(size) for t, size in enumerate(s.tensor_bytes)}
    assert [sizes[f"a/split_part_{i}:0"] for i in range(3)] == [200, 100, 100]
    assert [sizes[f"c/split_part_{i}:0"] for i in range(3)] == [100, 50, 50]
    # an op's cost at its part's batch, a + b * n_i: a has 10 + 1 * batch FLOPs
    assert [s.op_flops[by_name[f"a/split_part_{i}"]] for i in range(3)] == [12.0, 11.0, 11.0]
    assert s.op_flops[by_name["s/split_part_2"]] == 1.0
    # a running combine: two steps, the third partial waits for the first step
    assert [n for n in names(s) if "combine" in n] == ["s/split_combine_0", "s/split_combine_1"]
    controls = {(s.op_name[a], s.op_name[b]) for a, b in zip(s.control_src, s.control_dst)}
    assert controls == {("s/split_combine_0", "s/split_part_2")}
    # the largest working set is a part of b on 2 samples: 200 + 200
    assert peak_lower_bound_bytes(s) == 400
    assert replay(s, None, unit).peak_bytes >= peak_lower_bound_bytes(s)


def batch_norm():
    """x -> mean over the batch -> x - mean -> loss; the mean reduces over the batch."""
    return from_spec([
        OpSpec("x", "Conv2D", FORWARD, [], ((0.0, 100.0),), flops=(0.0, 1.0)),
        OpSpec("mean", "Mean", FORWARD, ["x"], (16,), flops=(0.0, 1.0)),
        OpSpec("centred", "Sub", FORWARD, ["x", "mean"], ((0.0, 100.0),), flops=(0.0, 1.0)),
        OpSpec("loss", "Sum", FORWARD, ["centred"], (4,), flops=(0.0, 1.0)),
    ], outputs=["loss"], batch_size=8)


def test_batch_mixing_ops_get_partials_and_a_combine(unit):
    g = batch_norm()
    region, ends = grow_region(g, g.op_index()["centred"])
    assert [g.op_name[op] for op in region] == ["x", "mean", "centred", "loss"] and ends == {}
    s = with_splits(g, [SplitRegion(tuple(g.op_name[op] for op in region), 4)])
    record = split_regions(s)[0]
    assert record["combines"] == {"mean": "mean", "loss": "sum"} and record["part_batches"] == [2, 2, 2, 2]
    by_name = dict(zip(names(s), range(s.n_ops)))
    combined = s.tensor_index()["mean/split_combine_2:0"]
    # every part of the subtraction reads its part of x and the combined mean, not a partial
    for i in range(4):
        read = sorted(s.tensor_name(t) for t, c in zip(s.edge_tensor, s.edge_consumer)
                      if c == by_name[f"centred/split_part_{i}"])
        assert read == sorted([f"x/split_part_{i}:0", "mean/split_combine_2:0"])
    assert int(s.tensor_bytes[combined]) == 16
    assert s.op_type[by_name["mean/split_combine_0"]] == "AddV2"
    # partials of the mean are of the whole mean's size; parts of x a quarter of x
    assert int(s.tensor_bytes[s.tensor_index()["mean/split_part_3:0"]]) == 16
    assert int(s.tensor_bytes[s.tensor_index()["x/split_part_3:0"]]) == 200
    # the floor: x's part and the subtraction's part with the mean, 200 + 200 + 16
    assert peak_lower_bound_bytes(g) == 800 + 800 + 16
    assert peak_lower_bound_bytes(s) == 416


def test_an_unknown_op_ends_a_region_and_reads_the_whole():
    g = from_spec([
        OpSpec("a", "Conv2D", FORWARD, [], ((0.0, 100.0),)),
        OpSpec("odd", "MysteryOp", FORWARD, ["a"], ((0.0, 100.0),)),
        OpSpec("c", "Relu", FORWARD, ["odd"], ((0.0, 100.0),)),
    ], outputs=["c"], batch_size=4)
    region, ends = grow_region(g, 0)
    assert region == [0]
    assert list(ends) == [1] and "MysteryOp" in ends[1] and "not known" in ends[1]
    with pytest.raises(GraphError, match="cannot run in parts: a MysteryOp"):
        with_splits(g, [SplitRegion(("a", "odd"), 2)])
    s = with_splits(g, [SplitRegion(("a",), 2)])
    by_name = dict(zip(names(s), range(s.n_ops)))
    # the unknown op reads a concatenation of a's parts; its working set is whole again
    assert [s.tensor_name(t) for t, c in zip(s.edge_tensor, s.edge_consumer) if c == by_name["odd"]] == [
        "a/split_concat_0:0"]
    assert s.op_type[by_name["a/split_concat_0"]] == "ConcatV2"
    assert split_regions(s)[0]["concats"] == ["a:0"]
    ws = op_working_set_bytes(s)
    assert ws[by_name["a/split_concat_0"]] == 800  # both parts and the whole
    assert ws[by_name["odd"]] == 800


def _entry_chain(row_bytes: int, shape: str):
    """a -> b -> c: per-sample ops at batch 4, b's rows ``row_bytes`` each, shaped ``shape``."""
    return OpGraph.build(op_name=["a", "b", "c"], op_type=["Conv2D", "Relu", "Conv2D"],
                         op_phase=[FORWARD, FORWARD, FORWARD], tensor_producer=[0, 1, 2],
                         tensor_bytes_ab=[(0.0, 64.0), (0.0, float(row_bytes)), (0.0, 64.0)],
                         tensor_shape=["(N,16)", shape, "(N,16)"], edge_tensor=[0, 1], edge_consumer=[1, 2],
                         outputs=[2], batch_size=4)


@pytest.mark.parametrize("row_bytes, shape, shared", [(128, "(N,32)", True), (288, "(N,6,6,2)", False),
                                                      (100, "(N,25)", False)])
def test_a_region_entry_shares_the_whole_buffer_where_tfs_split_does(row_bytes, shape, shared):
    """A region that starts at c cuts b at its entry: TF's split along the first axis leaves the parts in b's
    buffer where a row is a multiple of 64 bytes (each part of c then has all of b on the device), and copies
    each part elsewhere (a row of 288 bytes: the 6x6x2 float input of a small CNN, measured)."""
    g = _entry_chain(row_bytes, shape)
    s = with_splits(g, [SplitRegion(("c",), 2)])
    by_name = dict(zip(names(s), range(s.n_ops)))
    entry = s.tensor_index()["b/split_batch_0_0:1"]
    assert split_regions(s)[0]["entries"] == ["b:0"]
    ws = op_working_set_bytes(s)
    if shared:
        assert s.tensor_alias_of[entry] == s.tensor_index()["b:0"]
        assert ws[by_name["c/split_part_1"]] == 4 * row_bytes + 2 * 64
    else:
        assert s.tensor_alias_of[entry] == -1 and s.tensor_bytes[entry] == 2 * row_bytes
        assert ws[by_name["c/split_part_1"]] == 2 * row_bytes + 2 * 64
        assert ws[by_name["b/split_batch_0_0"]] == 4 * row_bytes + 2 * 2 * row_bytes  # the whole and its copies


def test_floor_after_splitting_is_lower_where_it_should_be():
    g = chain(persistent=1000.0)
    assert peak_lower_bound_bytes(g) == 1800
    halves, quarters = floor_after_splitting(g, 2), floor_after_splitting(g, 4)
    assert (halves.floor_bytes, halves.split_floor_bytes) == (1800, 1400)
    assert (quarters.floor_bytes, quarters.split_floor_bytes) == (1800, 1200)
    assert halves.regions == (SplitRegion(("a", "b", "c", "s"), 2),)
    assert "a part of a split region" in quarters.stop_reason
    # a floor set by an op whose sizes do not grow with the batch stays where it is
    fixed = from_spec([
        OpSpec("x", "Conv2D", FORWARD, [], ((0.0, 10.0),)),
        OpSpec("w", "Mul", BACKWARD, ["x"], ((0.0, 10.0),)),
        OpSpec("grad", "Sum", BACKWARD, ["w"], (5000,)),
        OpSpec("update", "AssignSubVariableOp", BACKWARD, ["grad"], (5000,)),
    ], outputs=["update"], batch_size=4)
    found = floor_after_splitting(fixed, 2)
    assert found.split_floor_bytes == found.floor_bytes == peak_lower_bound_bytes(fixed)
    assert found.regions == () and "cannot run in parts" in found.stop_reason


def test_split_graph_replays_consistently_with_its_floor():
    """A training-like step: no replay of the split graph, with or without swaps, goes under its floor, and
    swapping in the memory-aware order takes it below the captured step's floor, which the same
    plan rules on the captured step reach and do not pass."""
    g = training_graph(6, seed=3, batch_size=8)
    device = unit_device(bandwidth_bytes_per_s=1e9)
    found = floor_after_splitting(g, 4)
    assert found.floor_bytes == peak_lower_bound_bytes(g)
    assert found.split_floor_bytes == peak_lower_bound_bytes(found.split_graph) < found.floor_bytes / 2
    s = found.split_graph
    params = SwapParams(threshold=1, lb=1, ub=2, order="memory")
    plain = replay(s, None, device).peak_bytes
    swapped = replay(s.with_order("memory"), plan_swaps(s, params), device).peak_bytes
    assert plain >= found.split_floor_bytes and swapped >= found.split_floor_bytes
    assert swapped < found.floor_bytes
    captured = replay(g.with_order("memory"), plan_swaps(g, params), device).peak_bytes
    assert found.floor_bytes <= captured < found.floor_bytes * 1.001


def test_split_graph_rejects_bad_regions():
    g = chain()
    with pytest.raises(GraphError, match="not an op"):
        with_splits(g, [SplitRegion(("nope",), 2)])
    with pytest.raises(GraphError, match="in region 0 already"):
        with_splits(g, [SplitRegion(("a",), 2), SplitRegion(("a", "b"), 2)])
    s = with_splits(g, [SplitRegion(("a", "b"), 2)])
    with pytest.raises(GraphError, match="not an op of the captured step"):
        with_splits(s, [SplitRegion(("a/split_part_0",), 2)])


def test_a_split_plan_writes_reads_and_replays_the_same(unit):
    """The plan file's ``splits`` (format 3): a plan made on the split graph names its parts, its file holds
    the regions, and read back on the captured graph it rebuilds the same split graph and the same plan."""
    g = chain(batch=5)
    region = SplitRegion(("a", "b", "c", "s"), 3)
    split = with_splits(g, [region])
    plan = plan_swaps(split, SwapParams(threshold=1))
    named = plan.to_named(split)
    assert named.splits == (region,) and "b/split_part_2" in named.order
    text = named.to_json()
    assert json.loads(text)["splits"] == [{"ops": ["a", "b", "c", "s"], "parts": 3}]
    again = SwapPlan.from_json(g, text)
    assert again.graph_fingerprint == split.fingerprint()
    assert replay(split, again, unit).peak_bytes == replay(split, plan, unit).peak_bytes
    assert NamedPlan.from_json(text) == named
    # a plan's regions the graph cannot hold are one PlanError
    wrong = json.loads(text) | {"splits": [{"ops": ["a", "nope"], "parts": 2}]}
    with pytest.raises(PlanError, match="split regions do not fit"):
        SwapPlan.from_dict(g, wrong)


# ---------------------------------------------------------------- the micro-batch order (simulator.ordering)

PARTS = 4


def _layers():
    """Three layers, a loss summed over the batch, their gradients (each layer's weight gradient a sum over the
    batch, read by its update): per sample 100 B an activation and a gradient."""
    return from_spec([
        OpSpec("x0", "Conv2D", FORWARD, [], ((0.0, 100.0),), flops=(0.0, 10.0)),
        OpSpec("x1", "Relu", FORWARD, ["x0"], ((0.0, 100.0),), flops=(0.0, 1.0)),
        OpSpec("x2", "Conv2D", FORWARD, ["x1"], ((0.0, 100.0),), flops=(0.0, 10.0)),
        OpSpec("loss", "Sum", FORWARD, ["x2"], (4,), flops=(0.0, 1.0)),
        OpSpec("g2", "Mul", BACKWARD, ["x2"], ((0.0, 100.0),), flops=(0.0, 1.0)),
        OpSpec("dw2", "Conv2DBackpropFilter", BACKWARD, ["x1", "g2"], (64,), flops=(0.0, 10.0)),
        OpSpec("g1", "Conv2DBackpropInput", BACKWARD, ["g2"], ((0.0, 100.0),), flops=(0.0, 10.0)),
        OpSpec("g0", "ReluGrad", BACKWARD, ["g1", "x0"], ((0.0, 100.0),), flops=(0.0, 1.0)),
        OpSpec("dw0", "Conv2DBackpropFilter", BACKWARD, ["g0"], (64,), flops=(0.0, 10.0)),
        OpSpec("u2", "AssignSubVariableOp", UPDATE, ["dw2"], (4,)),
        OpSpec("u0", "AssignSubVariableOp", UPDATE, ["dw0"], (4,)),
    ], outputs=["loss", "u0", "u2"], batch_size=8)


def _split_step():
    g = _layers()
    return g, floor_after_splitting(g, PARTS).split_graph


def test_each_part_runs_forward_and_backward_before_the_next():
    """Ops of part i all run before any of part i + 1; an op outside the parts runs once the parts it waits for
    ran (the running combines between, the updates after the last); the peak without swapping is about a part's
    activations, where level order runs the parts side by side (on a step this small the memory order's greedy
    choice finds the same; on a transformer block it keeps 1.5x more, tests/rewriter/edit/test_micro_batches.py)."""
    g, split = _split_step()
    part = part_of_op(split)
    assert part.max() == PARTS - 1 and split.n_ops > 3 * g.n_ops
    order = execution_order(split.with_order("micro-batch"))
    assert sorted(order.tolist()) == list(range(split.n_ops))
    ran = part[order]
    assert (np.diff(ran[ran >= 0]) >= 0).all()
    position = {str(split.op_name[op]): k for k, op in enumerate(order)}
    assert position["u0"] > position["dw0/split_part_3"] and position["u2"] > position["dw2/split_part_3"]
    device = unit_device()
    micro, memory, level = (replay(split.with_order(name), None, device) for name in ("micro-batch", "memory", "cto"))
    assert micro.peak_bytes <= memory.peak_bytes and micro.peak_bytes < 0.5 * level.peak_bytes
    assert micro.peak_bytes < 0.5 * replay(g.with_order("memory"), None, device).peak_bytes
    assert micro.compute_s == level.compute_s  # the same ops, run in another order


def test_only_a_split_step_has_the_micro_batch_order():
    g = training_graph(6, seed=3, batch_size=8)
    split = floor_after_splitting(g, PARTS).split_graph
    assert "micro-batch" in orders_of(split) and "micro-batch" not in orders_of(g)
    assert np.array_equal(execution_order(g.with_order("micro-batch")), execution_order(g.with_order("memory")))


def test_parts_that_wait_for_every_part_run_when_they_can():
    """A batch sum every part's backward reads (a batch norm's moments): no part's backward runs before the last
    part's forward, and the order is still one the step can run."""
    g = from_spec([
        OpSpec("x", "Conv2D", FORWARD, [], ((0.0, 100.0),)),
        OpSpec("moments", "Sum", FORWARD, ["x"], (4,)),
        OpSpec("y", "Mul", FORWARD, ["x", "moments"], ((0.0, 100.0),)),
        OpSpec("loss", "Sum", FORWARD, ["y"], (4,)),
        OpSpec("dy", "Mul", BACKWARD, ["loss", "y"], ((0.0, 100.0),)),
        OpSpec("dx", "Mul", BACKWARD, ["dy", "moments"], ((0.0, 100.0),)),
        OpSpec("dw", "Sum", BACKWARD, ["dx", "x"], (4,)),
    ], outputs=["dw"], batch_size=4)
    split = with_splits(g, [SplitRegion(tuple(g.op_name.tolist()), 2)])
    order = execution_order(split.with_order("micro-batch"))
    position = {str(split.op_name[op]): k for k, op in enumerate(order)}
    assert position["y/split_part_0"] > position["x/split_part_1"]  # the moments' combine waits for both parts
    for op in range(split.n_ops):  # topological
        assert all(position[str(split.op_name[p])] < position[str(split.op_name[op])]
                   for p in split.tensor_producer[split.edge_tensor[split.edge_consumer == op]])


def _normalised_step():
    """x -> moments (over the batch) -> centred -> a gradient reading centred and x -> loss, at batch 8: 24 s of
    FLOPs on the unit device, x (100 B a sample) made before the moments and read after them."""
    return from_spec([
        OpSpec("x", "Conv2D", FORWARD, [], ((0.0, 100.0),), flops=(0.0, 1.0)),
        OpSpec("moments", "Mean", FORWARD, ["x"], (16,), flops=(0.0, 0.5)),
        OpSpec("centred", "Sub", FORWARD, ["x", "moments"], ((0.0, 100.0),), flops=(0.0, 0.5)),
        OpSpec("grad", "ReluGrad", BACKWARD, ["centred", "x"], ((0.0, 100.0),), flops=(0.0, 1.0)),
        OpSpec("loss", "Sum", BACKWARD, ["grad"], (4,)),
    ], outputs=["loss"], batch_size=8)


def test_the_least_overhead_of_any_plan_by_hand():
    """After the moments x (800 B) and the moments (16 B) are live in every order and split. At 416 B and 20 B/s
    the best is 16 free bytes and 224 of x recomputed (2.24 s at 1 s a sample, 100 B a sample), 160 B copied out
    in the 8 s of x and back beside the 12 s after: 26.24 s against 24 s, 9.33 %."""
    g = _normalised_step()
    slow_link = unit_device(bandwidth_bytes_per_s=20.0)
    bound = least_overhead(g, slow_link, budget_bytes=416)
    assert g.op_name[bound.cut_op] == "moments" and bound.live_bytes == 816 and bound.compute_s == 24.0
    assert 0.0933 - 0.002 < bound.overhead <= 2.24 / 24 + 1e-12
    assert bound.recomputed_bytes == pytest.approx(240, abs=1) and bound.host_bytes_moved == pytest.approx(160, abs=1)
    # the same bytes over a link that carries them within the ops around the cut: nothing to pay
    assert least_overhead(g, unit_device(bandwidth_bytes_per_s=100.0), budget_bytes=416).overhead == 0.0
    # the live set fits: no cut binds
    assert least_overhead(g, slow_link, budget_bytes=816).cut_op == -1


def test_a_recomputation_pays_for_the_freed_inputs_it_needs():
    """x is live after the moments only through its ReLU (it made y, then died): recomputing y needs x again,
    so y's price is x's time and its own; holding x instead gains nothing (same bytes)."""
    g = from_spec([
        OpSpec("x", "Conv2D", FORWARD, [], ((0.0, 100.0),), flops=(0.0, 3.0)),
        OpSpec("y", "Relu", FORWARD, ["x"], ((0.0, 100.0),), flops=(0.0, 0.5)),
        OpSpec("moments", "Mean", FORWARD, ["y"], (16,), flops=(0.0, 0.5)),
        OpSpec("grad", "ReluGrad", BACKWARD, ["moments", "y"], ((0.0, 100.0),), flops=(0.0, 1.0)),
        OpSpec("loss", "Sum", BACKWARD, ["grad"], (4,)),
    ], outputs=["loss"], batch_size=8)
    # no link to speak of: all but the budget's 16 B go, the moments' 16 B (they do not grow with the batch:
    # free) and 784 B of y at (3 + 0.5) s a sample of 100 B: 27.44 s on top of 40 (y's own time alone: 3.92 s)
    bound = least_overhead(g, unit_device(bandwidth_bytes_per_s=1e-9), budget_bytes=16)
    assert bound.recomputed_bytes == pytest.approx(800, abs=1) and bound.host_bytes_moved <= 1
    assert bound.overhead == pytest.approx(27.44 / 40, rel=0.005) and bound.overhead <= 27.44 / 40 + 1e-12
