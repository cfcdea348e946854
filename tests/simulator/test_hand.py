"""Hand-computed cases: every number below was worked out on paper from the rules in replay.py."""

from __future__ import annotations

import pytest

from simulator import BACKWARD, FORWARD, GraphError, SwapParams, SwapPlan, categorized_levels, plan_swaps, replay
from simulator.buffers import op_working_set_bytes, peak_lower_bound_bytes
from simulator.replay import live_buffers
from simulator.planning import Swap, SwapIn
from simulator.synthetic import OpSpec, from_spec
from tests.conftest import unit_device


def chain():
    """f0 -> f1 -> f2 -> b2 -> b1 -> b0, backward ops reading the forward activations."""
    return from_spec([
        OpSpec("f0", "Conv2D", FORWARD, [], (100,), flops=1),
        OpSpec("f1", "Conv2D", FORWARD, ["f0"], (200,), flops=1),
        OpSpec("f2", "Conv2D", FORWARD, ["f1"], (300,), flops=1),
        OpSpec("b2", "MatMul", BACKWARD, ["f2"], (50,), flops=1),
        OpSpec("b1", "MatMul", BACKWARD, ["b2", "f1"], (60,), flops=1),
        OpSpec("b0", "MatMul", BACKWARD, ["b1", "f0"], (70,), flops=1),
    ], outputs=["b0"])


def test_chain_levels_and_baseline(unit):
    g = chain()
    assert categorized_levels(g).tolist() == [0, 1, 2, 3, 4, 5]
    r = replay(g, None, unit)
    # slot 3 holds f0 (100) + f1 (200) + f2 (300) + b2 (50)
    assert r.peak_bytes == 650
    assert r.level_peak_bytes.tolist() == [100, 300, 600, 650, 410, 230]
    assert r.step_s == pytest.approx(6.0)
    assert (r.stall_s, r.d2h_bytes, r.h2d_bytes, r.host_peak_bytes) == (0.0, 0, 0, 0)


def test_chain_threshold_two(unit):
    g = chain()
    plan = plan_swaps(g, SwapParams(threshold=2, lb=1, ub=2))
    names = {g.tensor_name(s.tensor): [(tuple(g.op_name[c] for c in i.consumers), g.op_name[i.trigger])
                                       for i in s.swap_ins] for s in plan.swaps()}
    assert names == {"f0:0": [(("b0",), "b1")], "f1:0": [(("b1",), "b2")]}
    r = replay(g, plan, unit)
    # f0 out 1..2 s; f1 out 2..4 s; f1 in 4..6 s (trigger b2 ends at 4) -> b1 waits 2 s;
    # f0 in 7..8 s (trigger b1 ends at 7) -> b0 waits 1 s.
    assert r.swap_out_end_s.tolist() == [2.0, 4.0]
    assert r.swap_in_start_s.tolist() == [7.0, 4.0]
    assert r.step_s == pytest.approx(9.0) and r.stall_s == pytest.approx(3.0)
    assert r.level_peak_bytes.tolist() == [100, 300, 500, 550, 310, 230]
    assert r.peak_bytes == 550
    assert (r.d2h_bytes, r.h2d_bytes) == (300, 300)
    assert r.host_peak_bytes == 300  # both copies on the host from 2 s to 6 s


def test_window_without_valid_trigger_is_synchronous(unit):
    g = chain()
    plan = plan_swaps(g, SwapParams(threshold=2, lb=2, ub=2))
    triggers = {g.tensor_name(s.tensor): s.swap_ins[0].trigger for s in plan.swaps()}
    # f1's consumer b1 is on level 4: the window is level 2, where only forward f2 lies
    assert triggers["f1:0"] is None
    assert g.op_name[triggers["f0:0"]] == "b2"
    r = replay(g, plan, unit)
    # both swap-ins ready at 4 s (after b2): f0 first (lower index), 4..5; f1 5..7; b1 waits 3 s
    assert r.swap_in_start_s.tolist() == [4.0, 5.0]
    assert r.step_s == pytest.approx(9.0)
    assert r.level_peak_bytes.tolist() == [100, 300, 500, 550, 410, 230]


def test_sync_swap_out_makes_near_consumers_wait(unit):
    g = chain()
    plan = plan_swaps(g, SwapParams(threshold=2, lb=1, ub=2, sync="out"))
    r = replay(g, plan, unit)
    # f1 waits for f0's copy (1..2 s): 1 s; f1's copy 3..5 s, so f2 waits 2 s; b2 ends at 7;
    # f1 back 7..9 (trigger b2), b1 waits 2 s, ends 10; f0 back 10..11, b0 waits 1 s, ends 12.
    assert r.swap_out_end_s.tolist() == [2.0, 5.0]
    assert r.swap_in_end_s.tolist() == [11.0, 9.0]
    assert r.step_s == pytest.approx(12.0)
    assert r.stall_s == pytest.approx(6.0)


def diamond():
    """a -> (b, c) -> d; backward reads a far away."""
    return from_spec([
        OpSpec("a", "Conv2D", FORWARD, [], (400,), flops=1),
        OpSpec("b", "Conv2D", FORWARD, ["a"], (100,), flops=1),
        OpSpec("c", "Conv2D", FORWARD, ["a"], (100,), flops=1),
        OpSpec("d", "AddV2", FORWARD, ["b", "c"], (100,), flops=1),
        OpSpec("gd", "MatMul", BACKWARD, ["d"], (100,), flops=1),
        OpSpec("gb", "MatMul", BACKWARD, ["gd", "b"], (100,), flops=1),
        OpSpec("gc", "MatMul", BACKWARD, ["gd", "c"], (100,), flops=1),
        OpSpec("ga", "MatMul", BACKWARD, ["gb", "gc", "a"], (10,), flops=1),
    ], outputs=["ga"])


def test_diamond(unit):
    g = diamond()
    assert categorized_levels(g).tolist() == [0, 1, 1, 2, 3, 4, 4, 5]
    base = replay(g, None, unit)
    # slots a, b, c, d, gd, gb, gc, ga; slots 4..6 hold 800 B each
    assert base.level_peak_bytes.tolist() == [400, 600, 700, 800, 800, 610]
    plan = plan_swaps(g, SwapParams(threshold=3, lb=1, ub=1))
    assert [g.tensor_name(s.tensor) for s in plan.swaps()] == ["a:0"]
    (swap,) = plan.swaps()
    assert g.op_name[swap.swap_ins[0].trigger] == "gc"  # latest ancestor on level 4, highest index
    assert g.op_name[swap.swap_ins[0].after] == "c"  # the last near reader of a
    r = replay(g, plan, unit)
    # a out 1..5 s (400 B at 100 B/s) -> freed after slot 4 (ends at 5 s);
    # a in after gc (ends at 7 s): 7..11 s, ga waits 4 s
    assert r.swap_out_end_s.tolist() == [5.0]
    assert r.swap_in_start_s.tolist() == [7.0]
    assert r.step_s == pytest.approx(12.0)
    assert r.level_peak_bytes.tolist() == [400, 600, 700, 800, 400, 610]
    assert r.peak_bytes == 800


def unet():
    """Two-level U-Net-like skip: e0 is read by the decoder (forward) and by backward ops."""
    return from_spec([
        OpSpec("e0", "Conv2D", FORWARD, [], (200,), flops=1),
        OpSpec("e1", "Conv2D", FORWARD, ["e0"], (100,), flops=1),
        OpSpec("m", "Conv2D", FORWARD, ["e1"], (50,), flops=1),
        OpSpec("d1", "Conv2D", FORWARD, ["m", "e1"], (100,), flops=1),
        OpSpec("d0", "Conv2D", FORWARD, ["d1", "e0"], (200,), flops=1),
        OpSpec("g0", "Conv2DBackpropInput", BACKWARD, ["d0", "e0"], (200,), flops=1),
        OpSpec("g1", "Conv2DBackpropInput", BACKWARD, ["g0", "d1"], (100,), flops=1),
        OpSpec("gm", "Conv2DBackpropInput", BACKWARD, ["g1", "m", "e1"], (50,), flops=1),
        OpSpec("ge", "Conv2DBackpropInput", BACKWARD, ["gm", "e0"], (10,), flops=1),
    ], outputs=["ge"])


def test_unet_skip_connection(unit):
    g = unet()
    assert categorized_levels(g).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    base = replay(g, None, unit)
    # slot 5 (g0): e0 e1 m d1 d0 g0 = 200+100+50+100+200+200
    assert base.peak_bytes == 850
    plan = plan_swaps(g, SwapParams(threshold=4, lb=2, ub=3))
    swaps = {g.tensor_name(s.tensor): s for s in plan.swaps()}
    assert set(swaps) == {"e0:0", "e1:0", "m:0"}
    e0_first, e0_second = swaps["e0:0"].swap_ins
    # g0 (level 5): window 2..3 but e0 is read by d0 (level 4) until then -> synchronous
    assert [g.op_name[c] for c in e0_first.consumers] == ["g0"] and e0_first.trigger is None
    # ge (level 8): after g0 (level 5), window 5..6 -> g1
    assert g.op_name[e0_second.trigger] == "g1" and g.op_name[e0_second.after] == "g0"
    assert g.op_name[swaps["e1:0"].swap_ins[0].trigger] == "g0"
    assert g.op_name[swaps["m:0"].swap_ins[0].trigger] == "g0"
    r = replay(g, plan, unit)
    # copies out: e0 1..3, e1 3..4, m 4..4.5; e0 back (sync, after d0) 5..7 -> g0 waits 2 s;
    # e1 back 8..9, m back 9..9.5 -> gm waits 0.5 s; e0 back again 9.5..11.5 -> ge waits 1 s
    assert r.swap_out_end_s.tolist() == [3.0, 4.0, 4.5]
    assert r.swap_in_start_s.tolist() == [5.0, 9.5, 8.0, 9.0]
    assert r.step_s == pytest.approx(12.5) and r.stall_s == pytest.approx(3.5)
    # m's copy back is ready at 8 (g0 done) like e1's and waits for the engine until 9: its buffer
    # exists from 8, so slot 6 (g1, 8..9) holds it too (TF allocates as the copy op runs)
    assert r.level_peak_bytes.tolist() == [200, 300, 350, 450, 550, 700, 550, 500, 260]
    assert r.peak_bytes == 700


def test_peak_lower_bound_is_the_largest_op_working_set():
    g = unet()
    # gm reads g1 (100), m (50), e1 (100) and writes 50 B; g0 reads d0 (200), e0 (200), writes 200
    assert op_working_set_bytes(g).tolist() == [200, 300, 150, 250, 500, 600, 400, 300, 260]
    assert peak_lower_bound_bytes(g) == 600


def test_working_set_bound_holds_in_every_order(unit):
    """w forwards into x's buffer only where it is x's last reader: in the memory order (r runs
    first), not in cto (r, one level later, still reads x). The bound is the least over the
    orders a plan may pick, and a plan that rewired r's read would let w forward in cto too."""
    g = from_spec([
        OpSpec("x", "Conv2D", FORWARD, [], (1,), flops=1),
        OpSpec("c", "Conv2D", BACKWARD, [], (0,), flops=1, control_inputs=["x"]),
        OpSpec("r", "Conv2D", BACKWARD, ["x", "c"], (0,), flops=1),
        OpSpec("z", "Conv2D", BACKWARD, [], (0,), flops=1),
        OpSpec("w", "Conv2D", BACKWARD, ["x"], (1,), flops=1, forwards_input=True),
    ], outputs=["w"])
    assert replay(g.with_order("cto"), None, unit).peak_bytes == 2
    assert replay(g.with_order("memory"), None, unit).peak_bytes == 1
    assert op_working_set_bytes(g.with_order("cto"))[4] == 2
    assert peak_lower_bound_bytes(g) == 1


def test_hand_plan_round_trips_through_json(unit):
    g = chain()
    plan = SwapPlan.from_swaps(g, [Swap(0, False, (SwapIn((5,), 4),))])
    again = SwapPlan.from_json(g, plan.to_json(g))
    assert again.tensor.tolist() == [0] and again.in_trigger.tolist() == [4]
    assert replay(g, again, unit).step_s == replay(g, plan, unit).step_s


def test_hand_plan_with_trigger_before_release_is_rejected():
    g = chain()
    with pytest.raises(GraphError, match="twice"):
        SwapPlan.from_swaps(g, [Swap(0, False, (SwapIn((5,), 1),))])  # f1 still reads f0
    with pytest.raises(GraphError, match="does not read"):
        SwapPlan.from_swaps(g, [Swap(0, False, (SwapIn((4,), None),))])
    with pytest.raises(GraphError, match="no swap-in"):
        SwapPlan.from_swaps(g, [Swap(0, False, ())])


def test_plan_from_another_graph_is_refused(unit):
    plan = plan_swaps(chain(), SwapParams(threshold=2))
    with pytest.raises(GraphError, match="another graph"):
        replay(diamond(), plan, unit)


def test_gradient_op_writing_into_a_swapped_activation(unit):
    """s reads a far away and writes its output into a's buffer (forwarding): once a is swapped,
    s writes into the swap-in buffer, which then lives until s's output is consumed."""
    g = from_spec([
        OpSpec("f0", "Conv2D", FORWARD, [], (100,), flops=1),
        OpSpec("f1", "Conv2D", FORWARD, ["f0"], (100,), flops=1),
        OpSpec("f2", "Conv2D", FORWARD, ["f1"], (100,), flops=1),
        OpSpec("b2", "MatMul", BACKWARD, ["f2"], (10,), flops=1),
        OpSpec("s", "Sub", BACKWARD, ["b2", "f0"], (100,), flops=1, forwards_input=True),
        OpSpec("b0", "MatMul", BACKWARD, ["s"], (10,), flops=1),
    ], outputs=["b0"])
    base = replay(g, None, unit)
    assert base.level_peak_bytes.tolist() == [100, 200, 300, 210, 110, 110]
    plan = plan_swaps(g, SwapParams(threshold=2, lb=1, ub=2))
    assert [g.tensor_name(s.tensor) for s in plan.swaps()] == ["f0:0"]
    r = replay(g, plan, unit)
    # f0 out 1..2 s, freed after slot 1; back 4..5 s after b2, s waits 1 s; the swap-in buffer
    # holds s's output until b0
    assert r.swap_in_start_s.tolist() == [4.0]
    assert r.level_peak_bytes.tolist() == [100, 200, 200, 110, 110, 110]


def batch_norm_like(conv_bytes: int = 100):
    """c -> m -> sq (elementwise, as a BatchNorm's mean and SquaredDifference) -> r, and the
    backward b0 reads c again: sq cannot write into c's buffer while b0 still needs it."""
    return from_spec([
        OpSpec("c", "Conv2D", FORWARD, [], (conv_bytes,), flops=1),
        OpSpec("m", "Mean", FORWARD, ["c"], (10,), flops=1),
        OpSpec("sq", "SquaredDifference", FORWARD, ["c", "m"], (conv_bytes,), flops=1, forwards_input=True),
        OpSpec("r", "Conv2D", FORWARD, ["sq"], (10,), flops=1),
        OpSpec("b2", "MatMul", BACKWARD, ["r"], (10,), flops=1),
        OpSpec("b1", "MatMul", BACKWARD, ["b2"], (10,), flops=1),
        OpSpec("b0", "MatMul", BACKWARD, ["b1", "c"], (10,), flops=1),
    ], outputs=["b0"])


def test_swapping_lets_the_last_near_reader_write_in_place(unit):
    g = batch_norm_like()
    assert replay(g, None, unit).level_peak_bytes.tolist() == [100, 110, 210, 210, 120, 120, 120]
    plan = plan_swaps(g, SwapParams(threshold=2, lb=1, ub=1))
    assert [g.tensor_name(s.tensor) for s in plan.swaps()] == ["c:0"]
    r = replay(g, plan, unit)
    # c's copy (1..2 s) is done when sq starts (2 s): sq is the buffer's last reader and writes
    # its output into it (110, not 210); c comes back 6..7 s after b1 for b0 (100 + 10 + 10)
    assert r.swap_out_end_s.tolist() == [2.0] and r.swap_in_end_s.tolist() == [7.0]
    assert r.level_peak_bytes.tolist() == [100, 110, 110, 110, 20, 20, 120]
    assert [g.tensor_name(t) for t in r.in_place_outputs] == ["sq:0"]
    at_sq = live_buffers(g, plan, r, slot=2)
    assert at_sq["bytes"].sum() == 110
    assert dict(zip(at_sq["tensor"], at_sq["kind"]))["sq:0"] == "in place"


def test_an_op_writes_into_the_swap_in_of_its_second_input_when_its_first_is_still_read(unit):
    """A softmax gradient: m = dy * s, then sub = dy - sum(m), m2 = sub * s. m cannot write into dy
    (sub reads it later) but, with s swapped and read by m through a swap-in of its own, writes into
    that swap-in (TF tries its inputs in order): the zoo's attention model was predicted 13 % above
    its measured peak while only the first input was a candidate."""
    g = from_spec([
        OpSpec("x", "Conv2D", FORWARD, [], (10,), flops=1),
        OpSpec("s", "Softmax", FORWARD, ["x"], (100,), flops=1),
        OpSpec("p1", "Conv2D", FORWARD, ["s"], (10,), flops=1),
        OpSpec("p2", "Conv2D", FORWARD, ["p1"], (10,), flops=1),
        OpSpec("p3", "Conv2D", FORWARD, ["p2"], (10,), flops=1),
        OpSpec("dy", "MatMul", BACKWARD, ["p3"], (100,), flops=1),
        OpSpec("m", "Mul", BACKWARD, ["dy", "s"], (100,), flops=1, forwards_input=True),
        OpSpec("sm", "Sum", BACKWARD, ["m"], (10,), flops=1),
        OpSpec("sub", "Sub", BACKWARD, ["dy", "sm"], (100,), flops=1, forwards_input=True),
        OpSpec("m2", "Mul", BACKWARD, ["sub", "s"], (100,), flops=1, forwards_input=True),
    ], outputs=["m2"])
    plan = plan_swaps(g, SwapParams(threshold=2, lb=1, ub=1, groupby=1))
    assert [g.tensor_name(s.tensor) for s in plan.swaps()] == ["s:0"] and plan.n_swap_ins == 2
    r = replay(g, plan, unit)
    assert [g.tensor_name(t) for t in r.in_place_outputs] == ["m:0"]
    # in m's slot: dy and s's first swap-in, which m writes into (300 with a buffer of its own)
    assert r.level_peak_bytes.tolist() == [10, 110, 110, 20, 20, 110, 200, 210, 110, 200]


def test_no_writing_in_place_while_the_copy_out_still_reads(unit):
    g = batch_norm_like(conv_bytes=250)
    r = replay(g, plan_swaps(g, SwapParams(threshold=2, lb=1, ub=1)), unit)
    # c's copy takes 2.5 s (1..3.5 s), past sq's slot (2..3 s): sq needs its own 250, and c's
    # buffer stays until the copy ends in r's slot
    assert r.swap_out_end_s.tolist() == [3.5]
    assert r.level_peak_bytes.tolist() == [250, 260, 510, 510, 20, 20, 270]
    assert r.in_place_outputs.tolist() == []


def test_copy_out_ending_in_a_stall_frees_before_the_op(unit):
    """x (400) goes out 1..5 s; its far reader c waits for x to come back (5..9 s). The original
    is gone at 5 s, before the swap-in allocates: the two never count together in c's slot."""
    g = from_spec([
        OpSpec("x", "Conv2D", FORWARD, [], (400,), flops=1),
        OpSpec("p1", "Conv2D", FORWARD, ["x"], (10,), flops=1),
        OpSpec("p2", "Conv2D", FORWARD, ["p1"], (10,), flops=1),
        OpSpec("p3", "Conv2D", FORWARD, ["p2"], (10,), flops=1),
        OpSpec("c", "MatMul", BACKWARD, ["p3", "x"], (10,), flops=1),
    ], outputs=["c"])
    r = replay(g, plan_swaps(g, SwapParams(threshold=2, lb=1, ub=1)), unit)
    assert r.swap_out_end_s.tolist() == [5.0] and r.swap_in_start_s.tolist() == [5.0]
    assert r.step_s == pytest.approx(10.0)
    # x until p3's slot (its copy), then the swap-in 400 + p3 + c in c's slot
    assert r.level_peak_bytes.tolist() == [400, 410, 420, 420, 420]


def _written_into_x(*rest: OpSpec):
    """x (100) read by s three levels later (after a1 -> a2 -> a3), which writes into x's buffer;
    n reads s; ``rest`` ends with the step's output b."""
    return from_spec([
        OpSpec("x", "Conv2D", FORWARD, [], (100,), flops=1),
        OpSpec("a1", "Conv2D", FORWARD, [], (10,), flops=1),
        OpSpec("a2", "Conv2D", FORWARD, ["a1"], (10,), flops=1),
        OpSpec("a3", "Conv2D", FORWARD, ["a2"], (10,), flops=1),
        OpSpec("s", "Mul", FORWARD, ["x", "a3"], (100,), flops=1, forwards_input=True),  # not fused with a3
        OpSpec("n", "Conv2D", FORWARD, ["s"], (10,), flops=1),
        *rest,
    ], outputs=["b"])


def test_copy_out_of_a_tensor_written_into_a_swap_in(unit):
    """s reads x far away and writes into x's buffer; once x is swapped, s writes into the swap-in
    buffer, and s's own copy out (s is swapped for b) holds that buffer, not x's original."""
    g = _written_into_x(OpSpec("m1", "Conv2D", FORWARD, ["n"], (10,), flops=1),
                        OpSpec("m2", "Conv2D", FORWARD, ["m1"], (10,), flops=1),
                        OpSpec("b", "MatMul", BACKWARD, ["m2", "s"], (10,), flops=1))
    plan = plan_swaps(g, SwapParams(threshold=2, lb=1, ub=1))
    assert [g.tensor_name(s.tensor) for s in plan.swaps()] == ["x:0", "s:0"]
    r = replay(g, plan, unit)
    # no trigger in either one-level window (a3, m2: triggers are backward ops): x comes back 4..5 s
    # once a3 is done, s runs 5..6 s; s goes out 6..7 s and back 9..10 s once m2 is done
    assert r.swap_out_end_s.tolist() == [2.0, 7.0] and r.swap_in_end_s.tolist() == [5.0, 10.0]
    # slots: x | a1 | a2 | a3 | s | n | m1 | m2 | b; x's original lives in slots 0-1 (its copy
    # ends in slot 1), its swap-in (holding s) in slots 4-5 (n reads s and s's copy ends in
    # slot 5), s's swap-in in slot 8
    assert r.level_peak_bytes.tolist() == [110, 20, 20, 110, 110, 20, 20, 120]


def test_swap_in_of_a_tensor_written_into_a_swap_in_waits_for_its_home(unit):
    """s lives in x's swap-in buffer (written in place); a synchronous swap-in of s must follow the
    last reader of that buffer (n), not of x's original, which was done before s existed."""
    g = _written_into_x(OpSpec("b", "MatMul", BACKWARD, ["a1", "s"], (10,), flops=1))
    op = {str(name): k for k, name in enumerate(g.op_name)}
    plan = SwapPlan.from_swaps(g, [Swap(0, False, (SwapIn((op["s"],), None),)),
                                   Swap(4, False, (SwapIn((op["b"],), None),))])
    assert [g.op_name[a] for a in plan.in_after] == ["x", "n"]
    r = replay(g, plan, unit)
    # x out 1..2 s, back 4..5 s once a3 is done; s runs 5..6 s in that buffer, n 6..7 s; s goes
    # out 6..7 s and back 7..8 s (after n; its other input a1 was ready at 2 s); b 8..9 s
    assert r.swap_out_end_s.tolist() == [2.0, 7.0] and r.swap_in_start_s.tolist() == [4.0, 7.0]
    assert r.step_s == pytest.approx(9.0)
    # slots x | a1 | a2 | a3 | s | n | b hold 100 | 110 | 20 | 30 | 120 | 120 | 120: a1 lives until
    # b; x's swap-in holds s through n (and s's copy out, ending in n's slot); s's swap-in is
    # allocated in b's slot. Per level (x and a1 on 0, n and b on 4):
    assert r.level_peak_bytes.tolist() == [110, 20, 30, 120, 120]


def test_memory_order_allocates_a_gradient_part_when_it_is_read(unit):
    """The greedy pass runs x (9 per sample, the cheapest ready op) first and keeps it through the
    chain c1 -> c2 -> c3 (c1 and c2 live together); the sinking pass moves x to just before its
    reader, so the chain's 20 and x's 9 are never live together."""
    g = from_spec([
        OpSpec("s", "Op", FORWARD, [], ((0, 1),), flops=1),
        OpSpec("c1", "Op", FORWARD, ["s"], ((0, 10),), flops=1),
        OpSpec("c2", "Op", FORWARD, ["c1"], ((0, 10),), flops=1),
        OpSpec("c3", "Op", FORWARD, ["c2"], ((0, 10),), flops=1, forwards_input=True),
        OpSpec("x", "Tile", FORWARD, ["s"], ((0, 9),), flops=1),
        OpSpec("end", "AddV2", FORWARD, ["x", "c3"], ((0, 10),), flops=1, forwards_input=True),
    ], outputs=["end"])
    from simulator.ordering import _greedy_memory_order, execution_order

    names = lambda order: [str(g.op_name[op]) for op in order]  # noqa: E731
    assert names(_greedy_memory_order(g)) == ["s", "x", "c1", "c2", "c3", "end"]
    assert names(execution_order(g.with_order("memory"))) == ["s", "c1", "c2", "c3", "x", "end"]
    # sunk: s 1 + c1 10 + c2 10 at c2, then c3 (in c2's buffer) 10 + x 9 + s 1 at x
    assert replay(g.with_order("memory"), None, unit).peak_bytes == 21
    # cto (like greedy) runs x next to c1: x 9 + c1 10 + c2 10 at c2 (s is gone by then)
    assert replay(g, None, unit).peak_bytes == 29


def skip_gradient():
    """A gradient (gs) made early in the backward pass and read at its end, as a U-Net's skip
    connection gradient waits for the branch that joins it: f -> gs, f -> b1 -> b2 -> b3 -> join(gs, b3)."""
    return from_spec([
        OpSpec("f", "Conv2D", FORWARD, [], (10,), flops=1),
        OpSpec("gs", "MatMul", BACKWARD, ["f"], (100,), flops=1),
        OpSpec("b1", "MatMul", BACKWARD, ["f"], (20,), flops=1),
        OpSpec("b2", "MatMul", BACKWARD, ["b1"], (30,), flops=1),
        OpSpec("b3", "MatMul", BACKWARD, ["b2"], (40,), flops=1),
        OpSpec("join", "MatMul", BACKWARD, ["gs", "b3"], (5,), flops=1),
    ], outputs=["join"])


def test_all_tensors_swaps_backward_tensors(unit):
    g = skip_gradient()
    assert categorized_levels(g).tolist() == [0, 1, 1, 2, 3, 4]
    # slot 4 (b3): f is dead after b1; gs (100) + b2 (30) + b3 (40)
    assert replay(g, None, unit).peak_bytes == 170
    activations = plan_swaps(g, SwapParams(threshold=2, lb=1, ub=2))
    assert activations.n_swaps == 0  # f's reads are all near, and gs is a gradient
    plan = plan_swaps(g, SwapParams(threshold=2, lb=1, ub=2, tensors="all"))
    (swap,) = plan.swaps()
    assert g.tensor_name(swap.tensor) == "gs:0"
    (swap_in,) = swap.swap_ins
    # join is on level 4: window levels 2..3, latest first -> b3 (an ancestor of join)
    assert [g.op_name[c] for c in swap_in.consumers] == ["join"] and g.op_name[swap_in.trigger] == "b3"
    r = replay(g, plan, unit)
    # slots f gs b1 b2 b3 join, 1 s each: gs goes out 2..3 s (freed as b2 starts), comes back 5..6 s
    # (b3 ends at 5), join waits 1 s; level 2 holds b1 + b2, level 4 gs + b3 + join
    assert (r.swap_out_start_s.tolist(), r.swap_in_start_s.tolist()) == ([2.0], [5.0])
    assert r.level_peak_bytes.tolist() == [10, 130, 50, 70, 145]
    assert r.peak_bytes == 145 and r.step_s == pytest.approx(7.0) and r.stall_s == pytest.approx(1.0)
    assert (r.d2h_bytes, r.h2d_bytes) == (100, 100)
    assert SwapParams.from_dict(SwapParams(threshold=2, tensors="all").to_dict()).tensors == "all"
    with pytest.raises(Exception, match="tensors"):
        SwapParams(threshold=2, tensors="gradients")


@pytest.mark.parametrize("dtype,swapped", [("float32", True), ("int64", False)])
def test_activations_are_floats_all_tensors_takes_int64_too(dtype, swapped):
    """Labels cast at the step's start and read by the loss at its end: a long edge whatever their
    dtype, but only floats are activations."""
    g = from_spec([
        OpSpec("labels", "Cast", FORWARD, [], (100,), dtype=dtype),
        OpSpec("f1", "Conv2D", FORWARD, [], (10,), flops=1),
        OpSpec("f2", "Conv2D", FORWARD, ["f1"], (10,), flops=1),
        OpSpec("f3", "Conv2D", FORWARD, ["f2"], (10,), flops=1),
        OpSpec("loss", "Mul", FORWARD, ["f3", "labels"], (1,), flops=1),
        OpSpec("b", "MatMul", BACKWARD, ["loss", "f1"], (10,), flops=1),
    ], outputs=["b"])
    labels = g.op_index()["labels"]

    def swaps(tensors):
        return {int(g.tensor_producer[s.tensor]) for s in plan_swaps(g, SwapParams(threshold=1, tensors=tensors)).swaps()}

    assert (labels in swaps("activations")) == swapped
    assert labels in swaps("all")


def test_slot_distance_swaps_a_read_one_level_but_three_slots_away(unit):
    """f0 -> c is one level long, but the order runs g0 and g1 in between: counted in slots it is
    far. c writes its output into the buffer it reads (as Mul does): once rewired, into the swap-in's."""
    g = from_spec([
        OpSpec("f0", "Conv2D", FORWARD, [], (100,), flops=1),
        OpSpec("g0", "Conv2D", BACKWARD, [], (1,), flops=1),
        OpSpec("g1", "Conv2D", BACKWARD, [], (1,), flops=1),
        OpSpec("c", "Mul", BACKWARD, ["f0", "g0", "g1"], (100,), flops=1, forwards_input=True),
    ], outputs=["c"])
    assert categorized_levels(g).tolist() == [0, 0, 0, 1]
    assert plan_swaps(g, SwapParams(threshold=1, lb=1, ub=1, trigger="level")).n_swaps == 0
    baseline = replay(g, None, unit)
    assert baseline.peak_bytes == 102  # slot 3: f0's buffer, now c's, and g0, g1
    for trigger in ("level", "ancestor"):
        plan = plan_swaps(g, SwapParams(threshold=1, lb=1, ub=1, trigger=trigger, distance="slot"))
        assert [(g.tensor_name(s.tensor), [g.op_name[i.trigger] for i in s.swap_ins]) for s in plan.swaps()] == \
            [("f0:0", ["g1"])]
        r = replay(g, plan, unit)
        # f0 out 1..2 s (f0's buffer freed after g0); in 3..4 s (after g1), c waits 1 s, ends at 5
        assert r.swap_out_end_s.tolist() == [2.0] and r.swap_in_start_s.tolist() == [3.0]
        assert r.step_s == pytest.approx(5.0)
        # slot 2: g0 and g1 only; slot 3: the swap-in (c written into it) and g0, g1 -- not f0's
        # original buffer as well, which a read rewired one level away would leave to c
        assert r.level_peak_bytes.tolist() == [101, 102] and r.peak_bytes == 102
        assert live_buffers(g, plan, r, slot=2)["bytes"].sum() == 2
        # its trigger g1 shares f0's level but runs after it: the plan round-trips through JSON
        again = SwapPlan.from_json(g, plan.to_json(g))
        assert again.in_trigger.tolist() == plan.in_trigger.tolist() and replay(g, again, unit).step_s == r.step_s


def test_sync_swap_out_without_a_reader_left_holds_the_next_op(unit):
    """f0's only reader is far: with sync "out" the op after f0 waits for its copy, so f0's buffer is
    gone before f1 allocates (without a waiting op, the copy would still hold it during f1)."""
    g = from_spec([
        OpSpec("f0", "Conv2D", FORWARD, [], (100,), flops=1),
        OpSpec("f1", "Conv2D", FORWARD, [], (100,), flops=1),
        OpSpec("f2", "Conv2D", FORWARD, ["f1"], (100,), flops=1),
        OpSpec("b0", "MatMul", BACKWARD, ["f2", "f0"], (10,), flops=1),
    ], outputs=["b0"])
    assert categorized_levels(g).tolist() == [0, 0, 1, 2]
    plan = plan_swaps(g, SwapParams(threshold=1, lb=1, ub=1, sync="out"))
    assert [g.tensor_name(t) for t in plan.tensor] == ["f0:0"]
    r = replay(g, plan, unit)
    # f0 0..1 s, its copy 1..2 s; f1 waits for it: 2..3, f2 3..4; f0 back 4..5 (no backward op in
    # the window: after b0's other input), b0 5..6
    assert r.swap_out_end_s.tolist() == [2.0] and r.op_start_s.tolist() == [0.0, 2.0, 3.0, 5.0]
    assert r.step_s == pytest.approx(6.0)
    # slot 1 holds f1 alone; slot 3 the swap-in, f2 and b0
    assert r.level_peak_bytes.tolist() == [100, 200, 210]
    unwaited = replay(g, plan_swaps(g, SwapParams(threshold=1, lb=1, ub=1)), unit)
    assert unwaited.level_peak_bytes.tolist() == [200, 200, 210] and unwaited.step_s == pytest.approx(5.0)


def test_swap_in_allocated_while_a_copy_out_is_running_counts_both(unit):
    """b1's output z (200) goes out 6..8 s; y (300) comes back for b2, allocated when its trigger b1
    is done (6 s) and copied 6..9 s, while b2 waits. From 6 to 8 s both buffers are on the device,
    though z's copy ends before b2 starts: the wait is the peak, in no op's own slot."""
    g = from_spec([
        OpSpec("y", "Conv2D", FORWARD, [], (300,), flops=1),
        OpSpec("f1", "Conv2D", FORWARD, [], (10,), flops=1),
        OpSpec("f2", "Conv2D", FORWARD, ["f1"], (10,), flops=1),
        OpSpec("f3", "Conv2D", FORWARD, ["f2"], (10,), flops=1),
        OpSpec("f4", "Conv2D", FORWARD, ["f3"], (10,), flops=1),
        OpSpec("b1", "MatMul", BACKWARD, ["f4"], (200,), flops=1),
        OpSpec("b2", "MatMul", BACKWARD, ["f4", "y"], (10,), flops=1, control_inputs=["b1"]),
        OpSpec("b3", "MatMul", BACKWARD, ["b2", "b1"], (10,), flops=1),
    ], outputs=["b3"])
    plan = SwapPlan.from_swaps(g, [Swap(0, False, (SwapIn((6,), 5),)), Swap(5, False, (SwapIn((7,), 6),))])
    r = replay(g, plan, unit)
    assert r.swap_out_end_s.tolist() == [4.0, 8.0] and r.swap_in_start_s.tolist() == [6.0, 10.0]
    assert r.op_start_s.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0, 12.0]
    # y 300 with f-chain outputs until its copy ends; in the wait y's swap-in 300 + z 200 + f4 10
    assert r.wait_slots.tolist() == [6] and r.wait_moment_s.tolist() == [6.0]
    assert r.peak_bytes == 510 and r.peak_slot == 6
    at_wait = live_buffers(g, plan, r)
    assert at_wait["bytes"].sum() == 510 and at_wait.attrs["moment_s"] == 6.0
    kinds = dict(zip(at_wait["tensor"], at_wait["kind"]))
    assert kinds["b1:0"] == "copying out" and kinds["y:0"] == "swap-in" and "b2:0" not in kinds
    # with free transfers z is gone as y's swap-in is allocated: no wait holds more than an op
    free = replay(g, plan, unit_device(bandwidth_bytes_per_s=1e30))
    assert free.wait_slots.tolist() == [] and free.peak_bytes == 320
    # after_copies_out: y's swap-in waits for the copy of its trigger b1's output (ends 8 s): 8..11 s,
    # b2 at 11 s; z back 12..14 s, b3 at 14 s. One more second, and z and y never meet
    waiting = SwapPlan.from_swaps(g, [Swap(0, False, (SwapIn((6,), 5),)), Swap(5, False, (SwapIn((7,), 6),))],
                                  after_copies_out=True)
    r = replay(g, waiting, unit)
    assert r.swap_in_start_s.tolist() == [8.0, 12.0] and r.op_start_s[6:].tolist() == [11.0, 14.0]
    assert r.wait_slots.tolist() == [] and r.peak_bytes == 320 and r.step_s == pytest.approx(15.0)
    again = SwapPlan.from_json(g, waiting.to_json(g))
    assert again.after_copies_out and replay(g, again, unit).step_s == r.step_s


@pytest.mark.parametrize("second", ["BiasAdd", "Conv2D"])
def test_sync_swap_in_cannot_wait_for_an_op_fused_into_its_consumer(unit, second):
    """s = p0 + p1: p0's sync swap-in waits for p1. Where p1 is a bias add, a graph pass may fuse it
    into s (contraction + bias + add), so the rewriter has the swap-in wait for p1's input u instead
    (simulator.fusion): it comes back during p1, not after. Where p1 is a convolution too (the 3D
    U-Net's split concatenation), nothing fuses into that sum: the swap-in waits for p1 and s stalls."""
    g = from_spec([
        OpSpec("x", "Conv2D", FORWARD, [], (100,), flops=1),
        OpSpec("p0", "Conv2D", FORWARD, ["x"], (100,), flops=1),
        OpSpec("u", "MaxPool", FORWARD, ["x"], (100,), flops=1),
        OpSpec("p1", second, FORWARD, ["u"], (100,), flops=1),
        OpSpec("s", "AddV2", FORWARD, ["p0", "p1"], (100,), flops=1),
    ], outputs=["s"])
    ops = {name: k for k, name in enumerate(g.op_name)}
    plan = SwapPlan.from_swaps(g, [Swap(ops["p0"], False, (SwapIn((ops["s"],), None),))])
    r = replay(g, plan, unit)
    at_p1 = live_buffers(g, plan, r, slot=3)
    assert r.swap_out_end_s.tolist() == [3.0]
    if second == "BiasAdd":
        # p0 out 2..3 s; back 3..4 s (after u, during p1), so s runs 4..5 s without a stall
        assert r.op_start_s.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and r.swap_in_start_s.tolist() == [3.0]
        # during p1: u, p1's output and the swap-in (p0's original went with its copy)
        assert set(at_p1["tensor"][at_p1["bytes"] > 0]) == {"p0:0", "p1:0", "u:0"} and at_p1["bytes"].sum() == 300
    else:
        # back 4..5 s, after p1: s waits a second for it
        assert r.swap_in_start_s.tolist() == [4.0] and r.step_s == pytest.approx(6.0)
        assert at_p1["bytes"].sum() == 200  # u and p1 only


@pytest.mark.parametrize(("sibling", "start_s"), [("BiasAddGrad", 2.0), ("Conv2DBackpropFilter", 3.0)])
def test_swap_in_triggered_by_a_sibling_it_may_be_fused_with(unit, sibling, start_s):
    """y comes back for the filter gradient w1, triggered by w0, which reads the same gradient g.
    A bias gradient may be fused with w1 (then y waits for g, the trigger's input); another filter
    gradient never is, and the trigger holds."""
    g = from_spec([
        OpSpec("y", "Conv2D", FORWARD, [], (100,), flops=1),
        OpSpec("g", "Conv2D", BACKWARD, [], (10,), flops=1),
        OpSpec("w0", sibling, BACKWARD, ["g"], (1,), flops=1),
        OpSpec("w1", "Conv2DBackpropFilter", BACKWARD, ["y", "g"], (1,), flops=1),
    ], outputs=["w0", "w1"])
    assert g.op_name.tolist() == ["y", "g", "w0", "w1"]
    plan = SwapPlan.from_swaps(g, [Swap(0, False, (SwapIn((3,), 2),))])
    r = replay(g, plan, unit)
    # y out 1..2 s; back from start_s for a second; w1 at 3 s or after the copy
    assert r.swap_out_end_s.tolist() == [2.0] and r.swap_in_start_s.tolist() == [start_s]
    assert r.op_start_s[3] == pytest.approx(max(3.0, start_s + 1.0))


@pytest.mark.parametrize(("after_b", "trigger"), [("MatMul", "b"), ("ReluGrad", "k")])
def test_no_swap_in_waits_for_what_depends_on_its_readers_sibling(after_b, trigger):
    """y comes back for the filter gradient w, whose sibling b (the bias gradient of the same gradient g) oneDNN
    merges with it. The latest trigger candidate before w is k. Where k reads b, b and w merged would wait for k
    through the swap-in, a cycle the step hangs on (the zoo's custom_layer_loss split in 4 parts): the rules take
    the latest candidate below k, b itself (waited for through g, as a fused part). Where k reads g, as b does, it
    still starts the swap-in (the rule is a bound: a candidate later than and above a sibling is taken for one of
    its dependents)."""
    g = from_spec([
        OpSpec("y", "Conv2D", FORWARD, [], (100,), flops=1),
        OpSpec("f", "Conv2D", FORWARD, ["y"], (100,), flops=1),
        OpSpec("g", "Conv2DBackpropInput", BACKWARD, ["f"], (10,), flops=1),
        OpSpec("b", "BiasAddGrad", BACKWARD, ["g"], (1,), flops=1),
        OpSpec("q", "Mul", BACKWARD, ["g"], (1,), flops=1),
        OpSpec("k", after_b, BACKWARD, ["b" if after_b == "MatMul" else "g"], (1,), flops=1),
        OpSpec("r", "Mul", BACKWARD, ["q"], (1,), flops=1),
        OpSpec("w", "Conv2DBackpropFilter", BACKWARD, ["y", "g", "r"], (1,), flops=1),
    ], outputs=["k", "w"])
    plan = plan_swaps(g, SwapParams(threshold=3, lb=1, ub=8, trigger="level", distance="slot", order="cto"))
    assert [str(g.op_name[op]) for op in plan.order] == ["y", "f", "g", "b", "q", "k", "r", "w"]
    assert [str(g.op_name[t]) for t in plan.tensor] == ["y"]
    assert str(g.op_name[plan.in_trigger[0]]) == trigger


@pytest.mark.parametrize(("reader_of_c", "trigger"), [("BiasAdd", "e"), ("Relu", "c")])
def test_no_swap_in_waits_for_an_op_merged_with_one_after_its_reader(reader_of_c, trigger):
    """y comes back for r; the latest trigger candidate before r is the convolution c. Where a bias add alone reads
    c, oneDNN merges the two into one node, which runs where the bias add does: after r in this order, so a swap-in
    started by c would close a cycle through r (the zoo's unet2d_transpose in 2 parts, cto order, hung): the rules
    take the latest candidate below c, the convolution e. Read by a Relu, c is merged with nothing and starts it."""
    g = from_spec([
        OpSpec("y", "Conv2D", FORWARD, [], (100,), flops=1),
        OpSpec("a", "Conv2D", BACKWARD, ["y"], (100,), flops=1),
        OpSpec("b", "Relu", BACKWARD, ["a"], (100,), flops=1),
        OpSpec("e", "Conv2D", BACKWARD, ["a"], (1,), flops=1),
        OpSpec("c", "Conv2D", BACKWARD, ["b"], (10,), flops=1),
        OpSpec("d", "Relu", BACKWARD, ["b"], (10,), flops=1),
        OpSpec("r", "Mul", BACKWARD, ["y", "d"], (10,), flops=1),
        OpSpec("p", reader_of_c, BACKWARD, ["c"], (10,), flops=1),
    ], outputs=["e", "r", "p"])
    plan = plan_swaps(g, SwapParams(threshold=3, lb=1, ub=8, trigger="level", distance="level", order="cto"))
    assert [str(g.op_name[op]) for op in plan.order] == ["y", "a", "b", "e", "c", "d", "r", "p"]
    assert [str(g.op_name[t]) for t in plan.tensor] == ["y"]
    assert str(g.op_name[plan.in_trigger[0]]) == trigger
