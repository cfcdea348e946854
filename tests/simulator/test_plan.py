"""The plan contract (simulator.plan): one format, read and written in one place, with its rules once.

No TensorFlow: the fixture plan.json and its graph were written by the code before the contract existed
(commit 95ea400: ``small_cnn`` at batch 4, captured; ``plan_swaps`` with the parameters it records), so a
plan written by that version must still load, the same, here and in the rewriter
(tests/rewriter/test_apply.py applies the same file)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from simulator import (GraphError, NamedPlan, OpGraph, PlanError, Swap, SwapIn, SwapParams, SwapPlan, get_device,
                       load_plan, plan_swaps, replay)
from simulator.plan import FORMAT, check_structure
from simulator.recompute.actions import Recompute, recomputed_tensors, with_recomputes
from simulator.state import HOST_UPDATE, HOST_WEIGHTS, STREAM_SLOTS, HostState
from simulator.recompute.choice import RecomputeParams, actions_of, choose_recomputes

PLANS = Path(__file__).resolve().parents[1] / "data" / "plans"
FIXTURE_GRAPH = PLANS / "small_cnn_b4.npz"
FIXTURE_PLAN = PLANS / "small_cnn_b4.plan.json"
PLAN_ARRAYS = ("tensor", "sync_out", "in_swap", "in_trigger", "in_after", "in_consumer_ptr", "in_consumers", "order")


@pytest.fixture(scope="module")
def fixture():
    return OpGraph.load(FIXTURE_GRAPH), FIXTURE_PLAN.read_text()


def test_a_plan_written_before_the_contract_loads_the_same(fixture):
    graph, text = fixture
    plan = SwapPlan.from_json(graph, text)
    again = plan_swaps(graph, plan.params, kept_reads=get_device("cpu-testbed").kept_reads)
    for name in PLAN_ARRAYS:
        assert np.array_equal(getattr(plan, name), getattr(again, name)), name
    assert (plan.order_name, plan.after_copies_out, plan.batch_size) == ("memory", True, 4)
    assert plan.n_swaps == 6 and plan.n_swap_ins == 12 and (plan.in_trigger >= 0).any() and plan.sync_out.all()
    assert replay(graph, plan, "cpu-testbed").peak_bytes == 1033968  # what that version predicted
    # written again in the current format: the same file with its version and empty lists of the later actions
    written = json.loads(NamedPlan.from_json(text).to_json())
    assert text.count('"format": "swap-plan/1"') == 1 and FORMAT == "swap-plan/6"
    assert written == {**json.loads(text), "format": FORMAT, "recomputes": [], "splits": [], "host_state": []}
    assert NamedPlan.from_json(text).recomputes == () and json.loads(again.to_json(graph)) == written


def test_every_accepted_form_reads_the_same(fixture, tmp_path):
    graph, text = fixture
    named = NamedPlan.from_json(text)
    plan = SwapPlan.from_named(graph, named)
    path = tmp_path / "plan.json"
    path.write_text(text)
    for form in (named, json.loads(text), text, str(path), path):
        assert load_plan(form) == named
    assert load_plan(plan, graph) == named
    with pytest.raises(PlanError, match="graph="):
        load_plan(plan)
    assert load_plan(SwapPlan.empty()).swaps == ()


def test_the_named_form_is_typed(fixture):
    named = NamedPlan.from_json(fixture[1])
    swap = named.swaps[0]
    assert swap.producer + f":{swap.output}" == swap.tensor and swap.bytes > 0
    assert all(isinstance(c, str) for item in swap.swap_ins for c in item.consumers)
    assert named.params is not None and named.params.order == "memory" and named.ordering == "memory"
    assert len(named.order) > 0 and named.changes_step
    assert set(named.names()) >= {swap.tensor, *swap.swap_ins[0].consumers}


def _plan(**changes) -> dict:
    data = {"format": FORMAT, "swaps": [{"tensor": "a:0", "sync_out": False,
                                         "swap_ins": [{"consumers": ["b"], "trigger": None, "after": "a"}]}]}
    data.update(changes)
    return data


@pytest.mark.parametrize("data, message", [
    ({"swaps": []}, "not a swap plan"),
    ([], "not a swap plan"),
    (_plan(format="swap-plan/99"), "newer version"),
    (_plan(swaps=None), "no 'swaps' list"),
    (_plan(swaps=[{"tensor": "a:0"}]), "malformed"),
    (_plan(swaps=[{"tensor": "a", "swap_ins": []}]), "op:output"),
    (_plan(swaps=[{"tensor": "a:²", "swap_ins": []}]), "op:output"),  # str.isdigit() takes it, int() does not
    (_plan(swaps=[{"tensor": "a:0", "swap_ins": []}]), "no swap-in"),
    (_plan(swaps=[{"tensor": "a:0", "swap_ins": [{"consumers": []}]}]), "consumers"),
    (_plan(swaps=[{"tensor": "a:0", "swap_ins": [{"consumers": "b"}]}]), "consumers"),
    (_plan(swaps=[{"tensor": "a:0", "swap_ins": [{"consumers": ["b"]}, {"consumers": ["b"]}]}]), "two swap-ins"),
    (_plan(swaps=[{"tensor": "a:0", "swap_ins": [{"consumers": ["b"]}]}] * 2), "swapped twice"),
    (_plan(ordering="random"), "ordering"),
    (_plan(params={"threshold": 0}), "params"),
    (_plan(params={"colour": "red"}), "params"),
    (_plan(batch_size="eight"), "batch_size"),
    (_plan(recomputes={}), "no 'recomputes' list"),
    (_plan(host_state={}), "host_state must list"),
    (_plan(host_state=[{"variable": "d/kernel", "mode": "teleport"}]), "host_state must list"),
    (_plan(host_state=[{"variable": "d/kernel", "mode": "host-update"}] * 2), "each variable once"),
    (_plan(recomputes=[{"tensor": "a:0", "ops": ["a"], "trigger": "t"}]), "recomputation 0 of the plan is malformed"),
    (_plan(recomputes=[{"tensor": "a", "ops": ["a"], "trigger": "t", "consumers": ["b"]}]), "op:output"),
    (_plan(recomputes=[{"tensor": "a:²", "ops": ["a"], "trigger": "t", "consumers": ["b"]}]), "op:output"),
    (_plan(recomputes=[{"tensor": "a:0", "ops": "a", "trigger": "t", "consumers": ["b"]}]), "malformed"),
    (_plan(recomputes=[{"tensor": "a:0", "ops": [], "trigger": "t", "consumers": ["b"]}]), "no ops"),
    (_plan(recomputes=[{"tensor": "a:0", "ops": ["c"], "trigger": "t", "consumers": ["b"]}]), "does not make"),
    (_plan(recomputes=[{"tensor": "a:0", "ops": ["a"], "trigger": "t", "consumers": ["b"]}] * 2), "recomputed twice"),
    (_plan(recomputes=[{"tensor": "a:0", "ops": ["a"], "trigger": "t/recompute_0", "consumers": ["b"]}]),
     "names the clone"),
    (_plan(splits={}), "'splits' must be a list"),
    (_plan(splits=[{"ops": ["a"]}]), "split region 0 of the plan is malformed"),
    (_plan(splits=[{"ops": [], "parts": 2}]), "malformed"),
    (_plan(splits=[{"ops": ["a"], "parts": 1}]), "at least 2"),
    (_plan(splits=[{"ops": ["a"], "parts": True}]), "malformed"),
])
def test_malformed_plans_are_one_plan_error(data, message):
    with pytest.raises(PlanError, match=message) as info:
        NamedPlan.from_dict(data)
    assert isinstance(info.value, GraphError) and isinstance(info.value, ValueError)


def test_not_json_and_unreadable_files(tmp_path):
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan("{nope")
    (tmp_path / "plan.json").write_bytes(b"\xff\xfe{\x00")
    with pytest.raises(PlanError, match="not text"):
        load_plan(tmp_path / "plan.json")
    with pytest.raises(PlanError, match="cannot read"):
        load_plan("/nonexistent/plan.json")


def test_the_structure_rules_hold_for_indices_and_names_alike(fixture):
    graph, _ = fixture
    swap_in = SwapIn((5,), None)
    with pytest.raises(PlanError, match="no swap-in"):
        check_structure([Swap(0, False, ())])
    with pytest.raises(PlanError, match="two swap-ins"):
        check_structure([Swap(0, False, (swap_in, swap_in))])
    with pytest.raises(PlanError, match="no swap-in"):  # the same rule when a plan is built by hand
        SwapPlan.from_swaps(graph, [Swap(0, False, ())])


def test_names_the_graph_does_not_have_are_one_error(fixture):
    graph, text = fixture
    data = json.loads(text)
    data["swaps"][0]["tensor"] = "old_model/conv9/Conv2D:0"
    data["swaps"][1]["swap_ins"][0]["consumers"] = ["old_model/gradients/conv9_grad"]
    with pytest.raises(PlanError, match=r"2 op\(s\)/tensor\(s\) this graph does not have.*old_model/conv9"):
        SwapPlan.from_dict(graph, data)


def _recomputing(graph: OpGraph) -> tuple[list[Recompute], OpGraph, SwapPlan]:
    """The fixture graph's cheap recomputations (64 KiB or more), and a swap plan made on the graph with them."""
    actions = actions_of(graph, choose_recomputes(graph, get_device("cpu-testbed"), RecomputeParams(min_bytes=64 << 10)))
    transformed = with_recomputes(graph, actions)
    return actions, transformed, plan_swaps(transformed, SwapParams(threshold=2, recompute="cheap"))


def test_a_plan_with_recomputations_writes_reads_and_rebuilds_the_same(fixture):
    graph, _ = fixture
    actions, transformed, plan = _recomputing(graph)
    assert actions and plan.n_swaps and recomputed_tensors(transformed) == actions
    named = plan.to_named(transformed)
    assert named.recomputes == tuple(actions) and named.changes_step
    # the swaps and the order may name the clones: they exist once the recomputations are built
    clones = {name for name in named.order if name not in graph.op_index()}
    assert clones and clones <= set(transformed.op_index())
    data = json.loads(named.to_json())
    assert data["format"] == FORMAT and data["recomputes"][0] == {
        "tensor": actions[0].tensor, "ops": list(actions[0].ops), "trigger": actions[0].trigger,
        "consumers": list(actions[0].consumers)}
    again = NamedPlan.from_dict(data)
    assert again == named
    # rebuilt on the captured graph (the recomputations are made there first) or on the graph holding them
    for on in (graph, transformed):
        rebuilt = SwapPlan.from_named(on, again)
        for name in PLAN_ARRAYS:
            assert np.array_equal(getattr(rebuilt, name), getattr(plan, name)), name
    assert replay(transformed, SwapPlan.from_named(graph, again), "cpu-testbed").peak_bytes == \
        replay(transformed, plan, "cpu-testbed").peak_bytes
    with pytest.raises(PlanError, match="another graph"):  # its indices are of the graph with the clones
        plan.to_named(graph)


def test_recomputations_the_graph_cannot_hold_are_one_plan_error(fixture):
    graph, _ = fixture
    actions, transformed, plan = _recomputing(graph)
    data = plan.to_named(transformed).to_dict()
    data["recomputes"][0]["consumers"] = [data["recomputes"][0]["trigger"]]
    with pytest.raises(PlanError, match="recomputations do not fit this graph"):
        SwapPlan.from_dict(graph, data)


def test_optimizer_state_on_the_host_reads_back_and_older_versions_have_none():
    """``host_state`` (swap-plan/3): written and read back; a version-2 file names none and reads as before."""
    named = NamedPlan(host_state=(HostState("dense/kernel"), HostState("dense/bias")), batch_size=4)
    data = named.to_dict()
    assert data["host_state"] == [{"variable": "dense/kernel", "mode": HOST_UPDATE},
                                  {"variable": "dense/bias", "mode": HOST_UPDATE}]
    assert NamedPlan.from_dict(data) == named and named.changes_step
    older = {**_plan(), "format": "swap-plan/2", "host_state": [{"variable": "x", "mode": HOST_UPDATE}]}
    assert NamedPlan.from_dict(older).host_state == ()  # a key version 2 did not have is not read from it


def test_weights_on_the_host_read_back_from_version_4_only():
    """Mode ``host-weights`` (swap-plan/4) is written and read back; a version-3 file naming it is refused
    with the version it needs, and its ``host-update`` records still read."""
    named = NamedPlan(host_state=(HostState("dense/kernel", HOST_WEIGHTS), HostState("dense/bias")), batch_size=4)
    data = named.to_dict()
    assert data["host_state"][0]["mode"] == HOST_WEIGHTS
    assert NamedPlan.from_dict(data) == named == NamedPlan.from_dict({**data, "format": "swap-plan/4"})
    with pytest.raises(PlanError, match="'host-weights', which needs format swap-plan/4"):
        NamedPlan.from_dict({**data, "format": "swap-plan/3"})
    older = {**data, "format": "swap-plan/3", "host_state": [data["host_state"][1]]}
    assert NamedPlan.from_dict(older).host_state == (HostState("dense/bias"),)


def test_streamed_slots_read_back_from_version_5_on():
    """Mode ``stream-slots`` (swap-plan/5) is written and read back beside the other modes; a version-4 or version-3
    file naming it is refused with the version it needs, and their other records still read."""
    named = NamedPlan(host_state=(HostState("dense/kernel", STREAM_SLOTS), HostState("dense/bias", HOST_WEIGHTS),
                                  HostState("out/kernel")), batch_size=4)
    data = named.to_dict()
    assert data["format"] == "swap-plan/6" and data["host_state"][0]["mode"] == STREAM_SLOTS
    assert NamedPlan.from_dict(data) == named == NamedPlan.from_dict({**data, "format": "swap-plan/5"})
    for version in (3, 4):
        with pytest.raises(PlanError, match=f"'stream-slots', which needs format swap-plan/5 .this file says "
                                            f"swap-plan/{version}"):
            NamedPlan.from_dict({**data, "format": f"swap-plan/{version}"})
    older = {**data, "format": "swap-plan/4", "host_state": data["host_state"][1:]}
    assert NamedPlan.from_dict(older).host_state == named.host_state[1:]
    with pytest.raises(PlanError, match="each variable once"):
        NamedPlan.from_dict({**data, "host_state": [{"variable": "x", "mode": "stream"}]})
    with pytest.raises(PlanError, match="each variable once"):
        NamedPlan.from_dict({**data, "host_state": [{"variable": "x", "mode": [STREAM_SLOTS]}]})


def test_triggered_reads_read_back_from_version_6_only():
    """A record's ``triggered_reads`` (swap-plan/6, the format written): written only when set, read back; a version-5
    file saying it is refused with the version it needs; refused on a mode that copies nothing in (``host-update``)
    and when not a boolean."""
    named = NamedPlan(host_state=(HostState("dense/kernel", STREAM_SLOTS, triggered_reads=True),
                                  HostState("dense/bias", HOST_WEIGHTS, triggered_reads=True), HostState("out/kernel")),
                      batch_size=4)
    data = named.to_dict()
    assert [record.get("triggered_reads") for record in data["host_state"]] == [True, True, None]
    assert NamedPlan.from_dict(data) == named and NamedPlan.from_dict(json.loads(named.to_json())) == named
    too_old = "'triggered_reads', which needs format swap-plan/6 .this file says swap-plan/5"
    with pytest.raises(PlanError, match=too_old):
        NamedPlan.from_dict({**data, "format": "swap-plan/5"})
    for record in ({"variable": "x", "mode": "host-update", "triggered_reads": True},
                   {"variable": "x", "mode": STREAM_SLOTS, "triggered_reads": "yes"}):
        with pytest.raises(PlanError, match="'triggered_reads' .a boolean. true only with a mode that copies reads in"):
            NamedPlan.from_dict({**data, "host_state": [record]})
