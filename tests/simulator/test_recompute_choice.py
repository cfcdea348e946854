"""Recomputation in the simulator: the graph transformation, its replay, and which tensors qualify.

Hand graphs on the unit device (an op takes its FLOP count in seconds, a copy bytes / 100 B/s),
numbers worked out from the rules in simulator/recompute/actions.py and simulator/recompute/choice.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from simulator import BACKWARD, FORWARD, GraphError, SwapParams, plan_swaps, replay
from simulator import CalibratedDevice, SwapPlan, get_device, load_plan
from simulator.ordering import categorized_levels, execution_order
from simulator.recompute.actions import (NEVER_RECOMPUTED, RECOMPUTE_CLASSES, Recompute, clone_name, original_name,
                                 with_recomputes)
from simulator.recompute.choice import (RecomputeParams, actions_of, choose_recomputes, recompute_candidates,
                                        recomputed_graph)
from simulator.synthetic import OpSpec, from_spec

ANY_SIZE = dict(min_bytes=0)  # the hand graphs' tensors are bytes, not MiB


def relu_chain(backward_types=("MatMul", "ReluGrad", "Conv2DBackpropFilter"), relu_type="Relu", f0_flops=1):
    """x (input) -> f0 conv -> f1 relu -> f2 conv; backward: b0 reads f2, b1 reads f1 (far), b2
    reads f0 (far). f1 can be recomputed from f0, which the backward keeps anyway."""
    b0, b1, b2 = backward_types
    return from_spec([
        OpSpec("x", "Placeholder", FORWARD, [], ((0, 10),), persistent=True),
        OpSpec("f0", "Conv2D", FORWARD, ["x"], ((0, 100),), flops=f0_flops),
        OpSpec("f1", relu_type, FORWARD, ["f0"], ((0, 100),), flops=1),
        OpSpec("f2", "Conv2D", FORWARD, ["f1"], ((0, 50),), flops=1),
        OpSpec("b0", b0, BACKWARD, ["f2"], ((0, 10),), flops=1),
        OpSpec("b1", b1, BACKWARD, ["b0", "f1"], ((0, 10),), flops=1),
        OpSpec("b2", b2, BACKWARD, ["b1", "f0"], ((0, 10),), flops=1),
    ], outputs=["b2"])


def f1_action():
    return Recompute(tensor="f1:0", ops=("f1",), trigger="b0", consumers=("b1",))


def test_clone_names_round_trip():
    assert clone_name("a/b/Relu", 3) == "a/b/Relu/recompute_3"
    assert original_name("a/b/Relu/recompute_3") == "a/b/Relu"
    assert original_name("a/b/Relu") == "a/b/Relu"
    assert original_name("a/recompute_x") == "a/recompute_x"


def test_transform_adds_clones_and_rewires_far_readers_only():
    g = relu_chain()
    before = {name: getattr(g, name).copy() for name in g._ARRAY_FIELDS}
    t = with_recomputes(g, [f1_action()])
    for name, array in before.items():  # pure: the original is untouched
        assert np.array_equal(getattr(g, name), array), name
    assert t.n_ops == g.n_ops + 1 and t.n_tensors == g.n_tensors + 1
    clone = t.op_index()["f1/recompute_0"]
    original = g.op_index()["f1"]
    assert t.op_type[clone] == "Relu" and t.op_phase[clone] == BACKWARD
    assert np.array_equal(t.op_flops_ab[clone], g.op_flops_ab[original])
    assert np.array_equal(t.op_touched_bytes_ab[clone], g.op_touched_bytes_ab[original])
    out = t.tensor_index()["f1/recompute_0:0"]
    f1 = g.tensor_index()["f1:0"]
    assert np.array_equal(t.tensor_bytes_ab[out], g.tensor_bytes_ab[f1])
    assert (t.tensor_dtype[out], t.tensor_shape[out]) == (g.tensor_dtype[f1], g.tensor_shape[f1])
    # the clone reads the source f0; b1 reads the clone; f2 (near) still reads f1
    ops, tensors = t.op_index(), t.tensor_index()
    readers = lambda tensor: sorted(t.op_name[t.edge_consumer[t.edge_tensor == tensors[tensor]]].tolist())
    assert readers("f0:0") == ["b2", "f1", "f1/recompute_0"]
    assert readers("f1:0") == ["f2"]
    assert readers("f1/recompute_0:0") == ["b1"]
    assert [(t.op_name[s], t.op_name[d]) for s, d in zip(t.control_src, t.control_dst)] == [("b0", "f1/recompute_0")]
    assert t.meta["recomputes"] == [dataclasses.asdict(f1_action())]
    assert with_recomputes(g, []) is g


def test_clone_chain_keeps_aliasing_and_reads_clones():
    """f0 -> m (Mul, near only) -> r (Reshape, an alias of m) -> t (Relu, read far): the clone of r
    aliases the clone of m, the clone of t reads the clone of r, the clone of m reads f0."""
    g = from_spec([
        OpSpec("f0", "Conv2D", FORWARD, [], ((0, 100),), flops=1),
        OpSpec("m", "Mul", FORWARD, ["f0", "f0"], ((0, 100),), flops=1),
        OpSpec("r", "Reshape", FORWARD, ["m"], ((0, 100),), alias_of="m"),
        OpSpec("t", "Relu", FORWARD, ["r"], ((0, 100),), flops=1),
        OpSpec("u", "Conv2D", FORWARD, ["t"], ((0, 10),), flops=1),
        OpSpec("b0", "MatMul", BACKWARD, ["u"], ((0, 10),), flops=1),
        OpSpec("b1", "ReluGrad", BACKWARD, ["b0", "t"], ((0, 10),), flops=1),
        OpSpec("b2", "MatMul", BACKWARD, ["b1", "f0"], ((0, 10),), flops=1),
    ], outputs=["b2"])
    (candidate,) = recompute_candidates(g, get_device("v100-16gb"), RecomputeParams(**ANY_SIZE))
    action = candidate.action(g)
    assert action == Recompute(tensor="t:0", ops=("m", "r", "t"), trigger="b0", consumers=("b1",))
    t = with_recomputes(g, [action])
    index = t.tensor_index()
    assert t.tensor_alias_of[index["r/recompute_0:0"]] == index["m/recompute_0:0"]
    reads = {(t.tensor_name(e), t.op_name[c]) for e, c in zip(t.edge_tensor, t.edge_consumer)}
    assert {("f0:0", "m/recompute_0"), ("m/recompute_0:0", "r/recompute_0"), ("r/recompute_0:0", "t/recompute_0"),
            ("t/recompute_0:0", "b1")} <= reads
    controls = {(t.op_name[s], t.op_name[d]) for s, d in zip(t.control_src, t.control_dst)}
    assert controls == {("b0", "m/recompute_0")}  # only the clone with no cloned input waits for the trigger


def test_replay_frees_the_tensor_and_runs_the_clone_on_the_compute_stream(unit):
    g = relu_chain()
    t = with_recomputes(g, [f1_action()])
    base, after = replay(g, None, unit), replay(t, None, unit)
    # levels: x f0 f1 f2 b0 | clone | b1 b2; the clone takes 1 s of compute, nothing waits for a copy
    assert after.compute_s == pytest.approx(base.compute_s + 1.0)
    assert after.step_s == pytest.approx(after.compute_s) and after.stall_s == pytest.approx(0.0)
    clone = t.op_index()["f1/recompute_0"]
    b0, b1 = t.op_index()["b0"], t.op_index()["b1"]
    assert after.op_start_s[clone] >= after.op_end_s[b0] and after.op_end_s[clone] <= after.op_start_s[b1]
    # memory: without recomputation b0's slot holds f0 f1 f2 b0 = 260 B; with it f1 is gone (160 B);
    # the clone's slot holds f0, b0 and the clone (210 B), b1's f0, clone, b1 (and b0) = 220 B
    assert level_bytes(g, base, "b0") == 260 and level_bytes(t, after, "b0") == 160
    assert level_bytes(t, after, "f1/recompute_0") == 210
    assert base.peak_bytes == 260 and after.peak_bytes == 250  # now at f2: f0 f1 f2
    # a swap plan on the transformed graph sees the clone's read of f0 as an ordinary far read
    plan = plan_swaps(t, SwapParams(threshold=2, lb=1, ub=4))
    assert t.tensor_name(int(plan.tensor[0])) == "f0:0"
    consumers = {str(t.op_name[c]) for c in plan.in_consumers}
    assert "f1/recompute_0" in consumers


def level_bytes(g, result, op: str) -> int:
    """Memory at the level of ``op`` (every op of these graphs has a level of its own)."""
    return int(result.level_peak_bytes[categorized_levels(g)[g.op_index()[op]]])


def test_candidates_and_choice_on_the_chain(unit):
    g = relu_chain()
    (candidate,) = recompute_candidates(g, unit, RecomputeParams(**ANY_SIZE))
    assert candidate.action(g) == f1_action()
    assert candidate.freed_bytes == 100 and candidate.extra_bytes == 0 and candidate.seconds == pytest.approx(1.0)
    assert candidate.seconds_per_byte == pytest.approx(0.01)
    assert choose_recomputes(g, unit, RecomputeParams(max_seconds_per_byte=0.009, **ANY_SIZE)) == []
    assert choose_recomputes(g, unit, RecomputeParams(max_seconds_per_byte=0.01, **ANY_SIZE)) == [candidate]
    # Conv2D outputs only with the expensive class: f0 from the input x, f2 is read near only
    expensive = RecomputeParams(classes=RECOMPUTE_CLASSES.keys(), **ANY_SIZE)
    found = {g.tensor_name(c.tensor) for c in recompute_candidates(g, unit, expensive)}
    assert found == {"f0:0", "f1:0"}


def test_a_chosen_source_is_cloned_again_by_its_readers(unit):
    """With f1 recomputed from f0, recomputing f0 too (from the input) makes f1's chain clone f0
    again instead of holding it: one action per tensor, no chains of actions."""
    g = relu_chain()
    chosen = choose_recomputes(g, unit, RecomputeParams(classes=RECOMPUTE_CLASSES.keys(), **ANY_SIZE))
    actions = {a.tensor: a for a in actions_of(g, chosen)}
    assert set(actions) == {"f0:0", "f1:0"}
    assert actions["f1:0"].ops == ("f0", "f1")  # reads x, not the original f0
    assert actions["f0:0"].ops == ("f0",)
    t = with_recomputes(g, actions_of(g, chosen))
    assert replay(t, None, unit).level_peak_bytes.max() < replay(g, None, unit).level_peak_bytes.max()


def test_a_named_tensor_is_recomputed_for_its_own_far_readers_only(unit):
    """A tensor named in ``tensors`` (what the per-tensor pass adds, where the step waits for its
    swap-in) gets its own recomputation, while the recomputations already reading it keep reading
    the original: cloning it again for each of them would cost more than the wait it saves."""
    g = relu_chain(f0_flops=2)  # f0 costs twice f1 per byte: the cost rule takes f1 alone
    cheap_f1 = RecomputeParams(classes=RECOMPUTE_CLASSES.keys(), max_seconds_per_byte=0.01, **ANY_SIZE)
    assert [a.tensor for a in actions_of(g, choose_recomputes(g, unit, cheap_f1))] == ["f1:0"]
    named = dataclasses.replace(cheap_f1, tensors=("f0:0",))
    actions = {a.tensor: a for a in actions_of(g, choose_recomputes(g, unit, named))}
    assert actions["f0:0"].ops == ("f0",) and actions["f0:0"].consumers == ("b2",)
    assert actions["f1:0"].ops == ("f1",)  # reads the original f0, as without the name
    t = with_recomputes(g, list(actions.values()))
    f1_clone = t.op_index()[clone_name("f1", 1)]
    assert [t.tensor_name(x) for x in t.edge_tensor[t.edge_consumer == f1_clone]] == ["f0:0"]


def test_stateful_and_unlisted_ops_are_never_recomputed(unit):
    g = relu_chain(relu_type="RandomUniform")
    every_class = RecomputeParams(classes=RECOMPUTE_CLASSES.keys(), **ANY_SIZE)
    assert "f1:0" not in {g.tensor_name(c.tensor) for c in recompute_candidates(g, unit, every_class)}
    assert not (set().union(*RECOMPUTE_CLASSES.values()) & NEVER_RECOMPUTED)
    with pytest.raises(GraphError, match="only pure ops"):
        with_recomputes(g, [Recompute(tensor="f1:0", ops=("f1",), trigger="b0", consumers=("b1",))])
    # an op no class lists is not chosen either
    g = relu_chain(relu_type="SomeCustomOp")
    assert {g.tensor_name(c.tensor) for c in recompute_candidates(g, unit, every_class)} == {"f0:0"}


def test_stateless_random_is_recomputed_from_the_original_key():
    """Dropout's mask: the clone of the stateless random op reads the key/counter tensors (sources),
    which are not cloned."""
    g = from_spec([
        OpSpec("seed", "StatelessRandomGetKeyCounter", FORWARD, [], ((16, 0), (16, 0))),
        OpSpec("x", "Conv2D", FORWARD, [], ((0, 100),), flops=1),
        OpSpec("noise", "StatelessRandomUniformV2", FORWARD, ["seed:0", "seed:1"], ((0, 100),), flops=1),
        OpSpec("mask", "GreaterEqual", FORWARD, ["noise"], ((0, 100),), flops=1),
        OpSpec("y", "Mul", FORWARD, ["x", "mask"], ((0, 100),), flops=1),
        OpSpec("z", "Conv2D", FORWARD, ["y"], ((0, 10),), flops=1),
        OpSpec("b0", "MatMul", BACKWARD, ["z"], ((0, 10),), flops=1),
        OpSpec("b1", "Mul", BACKWARD, ["b0", "mask"], ((0, 10),), flops=1),
        OpSpec("b2", "Conv2DBackpropFilter", BACKWARD, ["b1", "x"], ((0, 10),), flops=1),
    ], outputs=["b2"])
    found = {c.action(g).tensor: c.action(g) for c in
             recompute_candidates(g, get_device("v100-16gb"), RecomputeParams(**ANY_SIZE))}
    assert found["mask:0"].ops == ("noise", "mask")


def test_no_valid_trigger_no_recomputation(unit):
    # backward ops no trigger may be (Grappler may fold them): f1's clone would have nothing to wait for
    g = relu_chain(backward_types=("Mul", "Mul", "Mul"))
    assert recompute_candidates(g, unit, RecomputeParams(**ANY_SIZE)) == []
    # a trigger window that ends before the only candidate
    g = relu_chain()
    assert recompute_candidates(g, unit, RecomputeParams(lb=2, ub=2, **ANY_SIZE)) == []


def test_bad_actions_are_refused():
    g = relu_chain()
    with pytest.raises(GraphError, match="does not make"):
        with_recomputes(g, [Recompute(tensor="f1:0", ops=("f0",), trigger="b0", consumers=("b1",))])
    with pytest.raises(GraphError, match="does not read"):
        with_recomputes(g, [Recompute(tensor="f1:0", ops=("f1",), trigger="b0", consumers=("b2",))])
    with pytest.raises(GraphError, match="not an op"):
        with_recomputes(g, [Recompute(tensor="f1:0", ops=("f1",), trigger="nope", consumers=("b1",))])
    with pytest.raises(GraphError, match="cycle"):  # the trigger depends on the far reader
        with_recomputes(g, [Recompute(tensor="f1:0", ops=("f1",), trigger="b2", consumers=("b1",))])


def test_recomputed_graph_follows_the_swap_params(unit):
    g = relu_chain()
    params = SwapParams(threshold=100, recompute="cheap", recompute_cost=1.0)
    rules = RecomputeParams.from_swap_params(params)
    assert rules is not None and rules.max_seconds_per_byte == 1.0
    # the default rules skip tensors under 1 MiB: at batch 2**16 f1 is 6.25 MiB
    big = g.with_batch(1 << 16)
    transformed, actions = recomputed_graph(big, params, unit)
    assert actions == [f1_action()] and transformed.batch_size == big.batch_size
    assert recomputed_graph(g, params, unit) == (g, [])  # f1 too small at batch 1
    assert recomputed_graph(big, SwapParams(threshold=100), unit) == (big, [])
    # the same choice at another batch shares the transformed graph's structure
    again, _ = recomputed_graph(big.with_batch(1 << 17), params, unit)
    assert again.fingerprint() == transformed.fingerprint()
    assert execution_order(again) is execution_order(transformed)


def test_a_capture_of_the_same_structure_at_other_sizes_gets_its_own_recomputed_graph(unit):
    """Two captures with the same op names (another input resolution, another model's meta) share no
    transformed graph: each carries its own sizes and meta into the plan."""
    params = SwapParams(threshold=100, recompute="cheap", recompute_cost=1.0)
    g = relu_chain().with_batch(1 << 16)
    g3 = dataclasses.replace(relu_chain(), tensor_bytes_ab=relu_chain().tensor_bytes_ab * 3,
                             meta={**relu_chain().meta, "model": "other"}).with_batch(1 << 16)
    assert g3.fingerprint() == g.fingerprint()
    first, actions = recomputed_graph(g, params, unit)
    other, other_actions = recomputed_graph(g3, params, unit)
    assert other_actions == actions == [f1_action()]
    assert other.tensor_bytes.sum() == 3 * first.tensor_bytes.sum() and other.meta["model"] == "other"


def test_swap_params_without_recomputation_serialise_as_before():
    plain = SwapParams(threshold=3)
    assert "recompute" not in plain.to_dict()
    params = SwapParams(threshold=3, recompute="expensive", recompute_per_tensor=True, recompute_tensors=("a:0",))
    data = params.to_dict()
    assert data["recompute_cost"] is None  # infinity, in JSON
    assert SwapParams.from_dict(data) == params
    with pytest.raises(ValueError, match="recompute must be one of"):
        SwapParams(threshold=3, recompute="all")
    with pytest.raises(ValueError, match="recompute_cost"):
        SwapParams(threshold=3, recompute="cheap", recompute_cost=-1.0)


def test_calibrated_clone_costs_what_its_original_costs():
    g = relu_chain()
    device = CalibratedDevice.from_preset(
        get_device("v100-16gb"), g, op_seconds_ab=[(0.0, float(i + 1)) for i in range(g.n_ops)], batch_sizes=(1, 2),
        measured_step_s=(1.0, 2.0), h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, transfer_latency_s=0.0)
    t = with_recomputes(g, [f1_action()])
    assert device.coverage(t) == 1.0
    seconds = device.graph_op_seconds(t)
    assert seconds[t.op_index()["f1/recompute_0"]] == seconds[t.op_index()["f1"]] == 3.0


# ---------------------------------------------------------------------- in the search


def conv_relu_graph(n_layers: int = 8, size: int = 1 << 20):
    """conv -> relu layers; the backward reads each conv output (as batch norm's gradient would)
    and each relu output (ReluGrad, the next filter gradient) far from where they were made."""
    specs = [OpSpec("x", "Placeholder", FORWARD, [], ((0, size),), persistent=True)]
    previous = "x"
    for i in range(n_layers):
        specs.append(OpSpec(f"c{i}", "Conv2D", FORWARD, [previous], ((0, size),), flops=(0, 4e9),
                            touched_bytes=(0, 3 * size)))
        specs.append(OpSpec(f"r{i}", "Relu", FORWARD, [f"c{i}"], ((0, size),), touched_bytes=(0, 2 * size)))
        previous = f"r{i}"
    specs.append(OpSpec("loss", "SparseSoftmaxCrossEntropyWithLogits", FORWARD, [previous], ((0, 64),)))
    grad = "loss"
    for i in reversed(range(n_layers)):
        specs.append(OpSpec(f"gr{i}", "ReluGrad", BACKWARD, [grad, f"r{i}"], ((0, size),), touched_bytes=(0, 3 * size)))
        specs.append(OpSpec(f"gb{i}", "Mul", BACKWARD, [f"gr{i}", f"c{i}"], ((0, size),), touched_bytes=(0, 3 * size)))
        source = f"r{i - 1}" if i else "x"
        specs.append(OpSpec(f"gf{i}", "Conv2DBackpropFilter", BACKWARD, [f"gb{i}", source], ((4096, 0),),
                            flops=(0, 4e9), touched_bytes=(0, 2 * size)))
        specs.append(OpSpec(f"gi{i}", "Conv2DBackpropInput", BACKWARD, [f"gb{i}"], ((0, size),), flops=(0, 4e9),
                            touched_bytes=(0, 2 * size)))
        grad = f"gi{i}"
    return from_spec(specs, outputs=[grad], meta={"model": "conv-relu"})


def test_search_space_without_recomputation_is_the_swap_only_one():
    from autotune.search.space import SearchSpace

    g = conv_relu_graph()
    plain, both = SearchSpace.for_graph(g), SearchSpace.for_graph(g, recompute=True)
    assert not plain.recomputes and "recompute" not in plain.to_dict() and "recompute" not in plain.categorical
    assert both.recomputes and both.size() == plain.size() * 3 * len(both.recompute_cost) * 2
    assert both.to_dict()["recompute_cost"][-1] is None
    choice = next(c for c in both.grid() if c["recompute"] == "expensive" and c["recompute_per_tensor"])
    params = both.params(choice)
    assert params.recompute == "expensive" and params.recompute_per_tensor and both.choice(params) == choice
    assert plain.choice(params) is None  # off the swap-only grid
    assert both.choice(dataclasses.replace(params, recompute_tensors=("r0:0",))) == choice  # derived, not searched


def test_search_with_recomputation_beats_swapping_alone_where_the_link_is_slow():
    """On a slow link every swapped byte costs; recomputing a relu from its conv output (kept for the
    backward anyway) costs an elementwise op. The evaluation counts the clones' time in the
    overhead, against the step as captured."""
    import optuna

    from autotune.search.policies import Budget, make_policy
    from autotune.search.space import SearchSpace, TuningProblem

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    g = conv_relu_graph().with_batch(64)
    device = dataclasses.replace(get_device("v100-16gb"), h2d_bytes_per_s=2e9, d2h_bytes_per_s=2e9)
    plain_peak = replay(g, None, device).peak_bytes
    budget = int(plain_peak * 0.6)
    found = {}
    for recompute in (False, True):
        problem = TuningProblem(g, device, budget, space=SearchSpace.for_graph(g, recompute=recompute))
        found[recompute] = make_policy("optuna", seed=0).search(problem, optuna.create_study(), Budget(trials=120)).chosen
    swap_only, both = found[False], found[True]
    assert swap_only is not None and both is not None
    assert both.params.recomputes and both.metrics["recompute_s"] > 0
    assert both.step_s < swap_only.step_s
    assert both.metrics["overhead"] == pytest.approx(both.step_s / swap_only.metrics["compute_s"] - 1)
    assert both.metrics["compute_s"] == swap_only.metrics["compute_s"]  # the step as captured


def test_summary_report_and_plot_list_the_recomputations(tmp_path):
    """summary.json gives the recomputed tensors, their bytes and the clones' seconds; the report
    has a section for them; the memory plot draws the plan on the captured step's levels."""
    import optuna

    from autotune.report.plots import memory_by_original_level
    from autotune.report.writer import write_report
    from autotune.run.tuning import tune_graph

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    g = conv_relu_graph().with_batch(64)
    device = dataclasses.replace(get_device("v100-16gb"), h2d_bytes_per_s=2e9, d2h_bytes_per_s=2e9)
    budget = int(replay(g, None, device).peak_bytes * 0.6)
    result = tune_graph(g, device=device, memory=budget, trials=120)  # recomputation is the default
    summary = result.summary()
    assert result.feasible and summary["recomputes"]
    first = summary["recomputes"][0]
    assert set(first) == {"tensor", "bytes", "ops", "seconds", "consumers"} and first["bytes"] == 64 << 20
    assert summary["recomputed_bytes"] == sum(row["bytes"] for row in summary["recomputes"])
    assert summary["predicted_recompute_s"] == pytest.approx(sum(row["seconds"] for row in summary["recomputes"]))
    memory, _, recomputes = memory_by_original_level(result)
    assert len(memory) == len(result.baseline_replay.level_peak_bytes) and len(recomputes) == len(result.recomputes)
    assert memory.max() == result.replay.peak_bytes - g.persistent_bytes
    write_report(result, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "## Recomputation" in report and first["tensor"] in report
    plan_file = load_plan(tmp_path / "plan.json")  # the plan file carries the recomputations, its swaps name clones
    assert plan_file.recomputes == tuple(result.recomputes)
    assert SwapPlan.from_named(g, plan_file).n_swaps == result.plan.n_swaps
    swap_only = tune_graph(g, device=device, memory=budget, trials=40, recompute=False)
    assert swap_only.summary()["recomputes"] == [] and swap_only.summary()["recomputed_bytes"] == 0


def test_a_transformed_graph_knows_its_recomputations():
    from simulator.recompute.actions import original_levels, recomputed_tensors

    g = relu_chain()
    t = with_recomputes(g, [f1_action()])
    assert recomputed_tensors(t) == [f1_action()] and recomputed_tensors(g) == []
    levels = original_levels(g, t)
    # the originals keep their levels; the clone stands at its far reader's (b1)
    assert levels[:g.n_ops].tolist() == categorized_levels(g).tolist()
    assert levels[t.op_index()["f1/recompute_0"]] == categorized_levels(g)[g.op_index()["b1"]]
