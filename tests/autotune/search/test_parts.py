"""The number of parts of a split along the batch, searched with the plan (autotune/search/parts.py,
docs/design.md 12): a small training-like graph on a device where copies cost what compute does."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from autotune.run.probes import SwapProbes
from autotune.search.parts import parts_to_search, search_parts, split_to_budget
from autotune.search.policies import Budget, make_policy
from autotune.search.space import SearchSpace, TuningProblem, best_of
from simulator import SwapPlan, replay
from simulator.buffers import peak_lower_bound_bytes
from simulator.plan import NamedPlan
from simulator.split import floor_after_splitting
from simulator.synthetic import training_graph
from tests.conftest import unit_device

optuna.logging.set_verbosity(optuna.logging.WARNING)
TRIALS = 40
SIDE_BY_SIDE = ("cto", "memory")


@pytest.fixture(scope="module")
def step():
    """Six layers at batch 8 (floor 38.4 MB; 19.2 MB in 2 parts, 17.0 MB in 4 and in 8), and a link of
    1e-3 B/s against one FLOP a second: a swap costs about as much as the compute it overlaps."""
    return training_graph(6, seed=3, batch_size=8), unit_device(bandwidth_bytes_per_s=1e-3)


def _search(g, device, budget_bytes: int, doublings: int):
    """The parts searched with the plan, in the orders that run the parts side by side (the micro-batch order,
    one part after the other, has tests of its own: tests/simulator/test_split.py)."""
    splits = parts_to_search(g, budget_bytes, doublings)
    return search_parts(splits, lambda split: TuningProblem(
        split, device, budget_bytes, space=replace(SearchSpace.for_graph(split), order=SIDE_BY_SIDE), captured=g),
        make_policy("optuna", seed=0), Budget(trials=TRIALS), shared=False)


def test_the_parts_searched_start_at_the_fewest_that_fit(step):
    g, _ = step
    floors = {k: floor_after_splitting(g, k).split_floor_bytes for k in (2, 4, 8)}
    assert floors[2] > floors[4] == floors[8] and peak_lower_bound_bytes(g) > floors[2]
    assert [s.parts for s in parts_to_search(g, floors[2])] == [2, 4, 8]
    assert [s.parts for s in parts_to_search(g, floors[2], doublings=0)] == [2]
    assert [s.parts for s in parts_to_search(g, floors[2] - 1)] == [4, 8]  # 2 parts no longer fit
    assert split_to_budget(g, floors[2]).parts == 2
    assert parts_to_search(g, floors[4] - 1) == []  # no split gets under it


@pytest.mark.parametrize("budget_bytes, parts", [(23_000_000, 4), (30_000_000, 8)])
def test_the_search_takes_more_parts_where_that_is_faster(step, budget_bytes, parts):
    """At 23 MB the fewest parts that fit (2) leave no plan the search finds, 4 parts do; at 30 MB 2 parts
    fit with a plan 76 % slower than the step, 4 parts with one 63 % slower and 8 with one 61 % slower (the
    swap-ins of 8 parts start after their own parts: ``planning._trigger_candidates``): the joint search
    takes more parts where the rule of the fewest parts (``doublings=0``) takes 2, and its plan is faster."""
    g, device = step
    joint, fewest = _search(g, device, budget_bytes, 2), _search(g, device, budget_bytes, 0)
    assert fewest.parts == 2 and set(joint.outcomes) == {2, 4, 8}
    assert joint.parts == parts and joint.chosen is not None and joint.chosen.feasible
    assert fewest.chosen is None or joint.chosen.step_s < fewest.chosen.step_s
    # each k's search is the one the fewest-parts rule runs on that split: the same plans for 2 parts
    assert (joint.outcomes[2].chosen is None) == (fewest.chosen is None)
    assert joint.parts_of(joint.chosen) == parts
    assert f"{parts} parts: " in joint.line() and f"chosen: {parts} parts" in joint.line()


def test_the_chosen_parts_are_recorded_in_the_plan_and_reloaded(step):
    g, device = step
    joint = _search(g, device, 30_000_000, 2)
    problem = joint.problems[joint.parts]
    plan = problem.plan(joint.chosen.params)
    named = plan.to_named(problem.graph)
    assert [region.parts for region in named.splits] == [joint.parts] * len(joint.split.regions)
    text = named.to_json()
    again = SwapPlan.from_json(g, text)  # read on the step as captured: the split graph is rebuilt
    assert again.graph_fingerprint == problem.graph.fingerprint()
    assert NamedPlan.from_json(text).splits == named.splits
    split_graph = floor_after_splitting(g, joint.parts).split_graph
    assert replay(split_graph, again, device).step_s == replay(problem.graph, plan, device).step_s
    # the overhead is against the step as captured: the parts' own cost counts
    assert problem.plain_compute_s == replay(g, None, device).compute_s


def test_probes_search_split_steps_where_the_step_finds_no_plan(step):
    """Probes with splits reach a batch the step as captured does not (its search finds no plan there),
    and say the parts of the plans they found."""
    g, device = step
    budget_bytes = 30_000_000
    whole = SwapProbes(g, budget_bytes, device, probe_trials=20)
    split = SwapProbes(g, budget_bytes, device, probe_trials=20, split=True, parts_doublings=1)
    unsplit_batch, unsplit_found = whole.largest()
    split_batch, found = split.largest()
    assert unsplit_batch >= 1 and split_batch > unsplit_batch and found
    assert not whole.good_at(split_batch)
    assert split.parts_of(split_batch, found[0]) >= 2 and split.parts_of(unsplit_batch, unsplit_found[0]) == 1
    assert split.problem_of(split_batch, found[0]).graph.meta.get("splits")
    assert not split.problem_of(unsplit_batch, unsplit_found[0]).graph.meta.get("splits")


def test_a_revisited_split_probe_adds_its_plans_to_their_parts(step):
    """A split probe revisited with the plans of a batch probed after it (``SwapProbes.revisit``): each plan, and
    those refined from it, is simulated on its own number of parts, kept with that k's plans, and the fastest of
    all is chosen."""
    g, device = step
    batch, _ = SwapProbes(g, 30_000_000, device, probe_trials=20, split=True, parts_doublings=1).largest()
    probes = SwapProbes(g, 30_000_000, device, probe_trials=2, split=True, parts_doublings=1)
    probes.at(batch)
    before = {k: len(outcome.evaluations) for k, outcome in probes.parts_at[batch].outcomes.items()}
    probes.probe_trials = 20
    probes.at(batch - 1)
    probes.revisit(batch)
    found = probes.parts_at[batch]
    added = {k: outcome.evaluations[before[k]:] for k, outcome in found.outcomes.items()}
    assert any(added.values()) and all(probes.parts_of(batch, e) == k for k, more in added.items() for e in more)
    assert found.chosen is best_of([e for outcome in found.outcomes.values() for e in outcome.evaluations])
    assert all(set(probes.near_best(batch, k)) <= {e.params for e in more} for k, more in added.items() if more)


def test_a_split_step_that_fits_unswapped_is_said_to_be_split(step):
    """A split step's plan that swaps nothing (the video classifier of benchmarks/results/split_user_models.md:
    its parts alone take it under the budget) still changes the step: the verdict names the split and sends
    the user to the swap step, not to "Fits without swapping"."""
    from autotune.run.options import SearchOptions
    from autotune.run.target import resolve_target
    from autotune.run.tuning import search_graph
    from autotune.run.verdict import FITS, SWAP_STEP

    g, _ = step
    split = floor_after_splitting(g, 4).split_graph
    budget = int(1.05 * replay(split, None, "cpu-testbed").peak_bytes)
    found = search_graph(split, resolve_target("cpu-testbed", budget), SearchOptions(trials=20, progress=False))
    assert found.verdict.status == FITS and found.verdict.train_with == SWAP_STEP
    assert found.verdict.headline.startswith("Fits with the batch split in 4 parts")
