"""Search quality on real captured graphs: Optuna against the exhaustive grid and against tflms-v2."""

from __future__ import annotations

import dataclasses
import math

import pytest

pytest.importorskip("tensorflow")

import optuna  # noqa: E402

import autotune  # noqa: E402
from autotune.run.options import MeasureOptions, SearchOptions  # noqa: E402
from autotune.run.probes import NEAR_BEST, SwapProbes, largest_batch  # noqa: E402
from autotune.search.off_grid import refine_off_grid  # noqa: E402
from autotune.search.parts import SPLIT_WHEN_OVERHEAD_OVER  # noqa: E402
from autotune.search.policies import Budget, OptunaPolicy, _threshold_frontier, make_policy  # noqa: E402
from autotune.search.space import (Evaluation, SearchSpace, TuningProblem, add_evaluation, best_of,  # noqa: E402
                                   closest_of, evaluation_from_trial, fits_first)
from autotune.run.tuning import study_name_for, tune_graph  # noqa: E402
from autotune.search.state_moves import modes_per_variable  # noqa: E402
from benchmarks.models import build_model  # noqa: E402
from benchmarks.zoo import build_zoo_model  # noqa: E402
from rewriter.trace.tracing import capture  # noqa: E402
from simulator import SwapParams, get_device, n_levels, plan_swaps, replay  # noqa: E402
from simulator.buffers import peak_lower_bound_bytes  # noqa: E402
from simulator.plan import validate_plan  # noqa: E402
from simulator.split import split_parts  # noqa: E402
from simulator.state import HOST_UPDATE, STREAM_SLOTS, HostState  # noqa: E402
from simulator.synthetic import training_graph  # noqa: E402
from tests.simulator.test_recompute_choice import conv_relu_graph  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def small_unet():
    return capture(build_model("unet3d", size=32, base_filters=8, depth=3), 1).with_batch(64)


def _search(policy, graph, budget, space=None, seed=0, trials=200):
    problem = TuningProblem(graph, get_device("v100-16gb"), budget, space=space)
    outcome = make_policy(policy, seed=seed).search(problem, optuna.create_study(), Budget(trials=trials))
    return outcome


@pytest.mark.parametrize("fraction", [0.6, pytest.param(0.4, marks=pytest.mark.long)])  # the default run: one
def test_optuna_within_one_percent_of_exhaustive(small_unet, fraction):
    g = small_unet
    base = replay(g, None, "v100-16gb").peak_bytes
    default = SearchSpace.for_graph(g, points=8)
    # every rule's dimension, the ordered ones narrowed to keep the exhaustive walk short (18,432
    # plans: every categorical choice doubles it, and the suite must stay within its time budget)
    space = SearchSpace(threshold=default.threshold, lb=(1, 4, 8), window=(0, 16, 64), groupby=(0, 16),
                        min_bytes=(4096,))
    budget = int(base * fraction)
    exhaustive = _search("exhaustive", g, budget, space, trials=None)
    assert len(exhaustive.evaluations) == space.size() and exhaustive.chosen is not None
    for seed in (0, 1, 2):
        tuned = _search("optuna", g, budget, space, seed=seed)
        # 200 trials, and a new search's off-grid refinement on top of them
        assert len(tuned.evaluations) <= 200 + int(200 * OptunaPolicy.OFF_GRID_SHARE) and tuned.chosen is not None
        gap = tuned.chosen.step_s / exhaustive.chosen.step_s - 1
        print(f"\nbudget {fraction:.0%} of the unswapped peak, seed {seed}: exhaustive ({space.size()} plans) "
              f"{exhaustive.chosen.step_s:.5f} s, optuna (200 trials) {tuned.chosen.step_s:.5f} s, gap {gap:+.2%}")
        assert gap <= 0.01


@pytest.mark.slow
@pytest.mark.parametrize("name,kwargs,batch", [  # ResNet-50's with -m long, and in python -m benchmarks tuning
    pytest.param("resnet50", {}, 256, marks=pytest.mark.long), ("unet3d", {"size": 64}, 96)])
def test_optuna_no_worse_than_tflms_v2(name, kwargs, batch):
    g = capture(build_model(name, **kwargs), 1).with_batch(batch)
    budget = get_device("v100-16gb").budget_bytes
    assert replay(g, None, "v100-16gb").peak_bytes > budget  # swapping is needed
    tflms = _search("tflms-v2", g, budget)
    tuned = _search("optuna", g, budget)
    assert tuned.chosen is not None
    print(f"\n{name} batch {batch}: tflms-v2 {tflms.chosen.step_s if tflms.chosen else float('nan'):.4f} s, "
          f"optuna {tuned.chosen.step_s:.4f} s")
    assert tflms.chosen is None or tuned.chosen.step_s <= tflms.chosen.step_s


def test_trials_refinement_does_not_complete_go_back_to_the_sampler(small_unet, monkeypatch):
    """Refinement can spend its share without completing trials: on a resumed study, Optuna skips
    enqueuing points that failed or waited in the interrupted run, and the sampler's stand-ins may be
    repeats (pruned). The search must still complete as many new trials as it was given (the CLI
    promises "a resumed study adds this many"); here refinement completes none of its share."""

    monkeypatch.setattr(OptunaPolicy, "_refine", staticmethod(lambda problem, study, run, budget, per_round=12: 0))
    g = small_unet
    budget = int(replay(g, None, "v100-16gb").peak_bytes * 0.5)
    study = optuna.create_study()
    make_policy("optuna", seed=0).search(TuningProblem(g, get_device("v100-16gb"), budget), study, Budget(trials=40))
    before = len(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)))
    make_policy("optuna", seed=0).search(TuningProblem(g, get_device("v100-16gb"), budget), study, Budget(trials=10))
    assert len(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))) - before == 10


def test_threshold_frontier_finds_the_plans_host_memory_leaves(small_unet):
    """A larger threshold swaps less: more device memory, less host memory. When host memory also
    binds, only a window of thresholds fits; the frontier's binary search must look for the largest
    that fits the device (then check the host), not for the largest that fits both, which steers
    away from that window whenever it probes below it."""
    g = small_unet
    default = SearchSpace.for_graph(g, points=24)
    space = SearchSpace(threshold=default.threshold, lb=default.lb, window=default.window, groupby=default.groupby,
                        sync=("none",), order=("cto",), tensors=("activations",), min_bytes=(4096,))
    middling = {"lb": len(space.lb) // 3, "window": len(space.window) // 2, "groupby": len(space.groupby) - 1}
    device = get_device("v100-16gb")
    probe = TuningProblem(g, device, 1 << 62, space=space)
    runs = [probe.replay(space.params(dict(middling, threshold=i, sync="none", order="cto", min_bytes=0,
                                           tensors="activations"))) for i in range(len(space.threshold))]
    # a threshold above the binary search's first probe such that the device budget (the largest peak up
    # to it) admits it and every smaller one, but no larger one, and the host limit (its host peak)
    # admits it but no smaller one: the window is that one threshold
    first_probe = (len(space.threshold) - 1) // 2
    peak = [r.peak_bytes for r in runs]
    host = [r.host_peak_bytes for r in runs]
    index = next(i for i in range(first_probe + 1, len(runs) - 1)
                 if min(peak[i + 1:]) > max(peak[:i + 1]) and host[i] > 0 and min(host[:i]) > host[i])
    problem = TuningProblem(g, device, max(peak[:index + 1]), host_limit_bytes=host[index], space=space)
    frontier = _threshold_frontier(problem, optuna.create_study(), lambda n, *choices: True)
    assert frontier, "no starting point found"
    assert all(problem.evaluate(space.params(choice)).feasible for choice in frontier)
    assert frontier[0]["threshold"] == index


def test_threshold_frontier_recomputes_more_where_the_host_has_no_room():
    """With the most recomputation (the last finite cost) a first-stage plan fits the device but its copies
    overflow the host; recomputing at any cost swaps nothing. The frontier searches that stage again at the
    costlier cost at once, instead of escalating it to tighter swap-ins, which swap no less."""
    g = conv_relu_graph(n_layers=12, size=64 << 20)
    device = get_device("v100-16gb")
    space = dataclasses.replace(SearchSpace.for_graph(g, recompute=True), sync=("none",), order=("cto",),
                                recompute_cost=(1e-11, math.inf))
    problem = TuningProblem(g, device, replay(g, None, device).peak_bytes // 2, host_limit_bytes=100 << 20,
                            space=space)
    frontier = _threshold_frontier(problem, optuna.create_study(), lambda n, *choices: True)
    assert frontier and all(problem.evaluate(space.params(choice)).feasible for choice in frontier)
    first = frontier[0]
    assert first["tensors"] == space.tensors[0] and first["recompute"] == "expensive" and first["recompute_cost"] == 1
    at_most = problem.evaluate(space.params(dict(first, recompute_cost=0, threshold=0)))
    assert at_most.excess_bytes <= 0 and not at_most.feasible  # the host, not the device, bars the finite cost


def test_search_space_covers_both_sets_of_tensors(small_unet):
    space = SearchSpace.for_graph(small_unet)
    assert space.tensors == ("activations", "all")
    choice = next(c for c in space.grid() if c["tensors"] == "all")
    params = space.params(choice)
    assert params.tensors == "all" and space.choice(params) == choice
    older = {k: v for k, v in choice.items() if k != "tensors"}  # a trial of a study made before the option
    assert space.params(older).tensors == "activations"
    # size() counts what grid() walks, every dimension included (the long ordered ones cut to a few values:
    # walking the whole grid, millions of points, took 19 s of the suite)
    few = dataclasses.replace(space, threshold=space.threshold[:3], lb=space.lb[:2], window=space.window[:2],
                              groupby=space.groupby[:2])
    assert few.size() == len(list(few.grid())) < space.size()


def test_search_space_counts_distances_in_levels_or_slots(small_unet):
    space = SearchSpace.for_graph(small_unet)
    assert space.distance == ("level", "slot") and space.trigger == ("ancestor", "level")
    assert space.after_copies_out == (False, True)
    choice = next(c for c in space.grid() if c["distance"] == "slot" and c["trigger"] == "level"
                  and c["after_copies_out"])
    params = space.params(choice)
    assert (params.distance, params.trigger, params.after_copies_out) == ("slot", "level", True)
    assert space.choice(params) == choice
    older = {k: v for k, v in choice.items() if k not in ("distance", "trigger", "after_copies_out")}  # studies
    # made before them
    assert (space.params(older).distance, space.params(older).trigger) == ("level", "ancestor")
    assert space.params(older).after_copies_out is False
    # the same rules, other units: the slot plan swaps reads of one level that the order runs apart
    level_plan = plan_swaps(small_unet, dataclasses.replace(params, distance="level"))
    slot_plan = plan_swaps(small_unet, params)
    assert slot_plan.n_swap_ins > level_plan.n_swap_ins


def test_parameters_off_a_narrowed_space_have_no_grid_point(small_unet):
    """A policy's candidate (tflms-v2, a probe) enters a study only as a point of its space."""
    full = SearchSpace.for_graph(small_unet)
    narrow = dataclasses.replace(full, sync=("none",), order=("memory",))
    choice = next(full.grid())
    assert full.choice(full.params(choice)) == choice
    assert narrow.choice(full.params(dict(choice, sync="out", order="memory"))) is None
    assert narrow.choice(full.params(dict(choice, sync="none", order="cto"))) is None
    assert narrow.choice(full.params(dict(choice, sync="none", order="memory"))) is not None


def test_python_api_tunes_a_keras_model_and_can_pick_the_batch():
    """``autotune.tune`` as the README shows it, and with the batch left to the search."""
    model = build_model("small_cnn", image_size=32)
    fixed = autotune.tune(model, batch_size=9, device="cpu-testbed", memory=2 << 20, measure=False, trials=40)
    assert fixed.batch_size == 9 and fixed.feasible and fixed.plan is not None
    assert fixed.shown.peak_bytes <= 2 << 20 < fixed.baseline.peak_bytes
    picked = autotune.tune(model, device="cpu-testbed", memory=2 << 20, measure=False, trials=3, maximize_batch=True)
    assert picked.feasible and picked.batch_size > picked.max_batch_without_swap >= 1
    with pytest.raises(ValueError, match="batch_size is required"):
        autotune.tune(model, device="cpu-testbed", memory=2 << 20, measure=False)


def test_batch_probes_are_shared_without_changing_answers():
    """The max-batch benchmark asks three questions of one set of probes (largest batch, largest
    under a 30 % overhead cap, largest with host memory unlimited). Each must get the answer its
    own search gets; probes where no plan went over the host limit carry over to the unlimited
    question unchanged, the others are searched again. A probe's own search is the same whichever batches were
    probed before it; those nearest it only add their best plans to what it evaluates."""
    from autotune.run.tuning import HOST_UNLIMITED_BYTES, SwapProbes, largest_batch_with_swap

    g = training_graph(40, batch_size=1)
    plain_peak = replay(g.with_batch(64), None, "v100-16gb").peak_bytes
    budget = plain_peak // 2
    device = dataclasses.replace(get_device("v100-16gb"), host_memory_bytes=2 * plain_peak)
    unlimited = dataclasses.replace(device, host_memory_bytes=HOST_UNLIMITED_BYTES)
    probes = SwapProbes(g, budget, device, probe_trials=30)
    swapped, _ = probes.largest()
    capped, _ = probes.largest(max_overhead=0.3)
    any_host = probes.host_unlimited()
    assert swapped == largest_batch_with_swap(g, budget, device, max_overhead=None, probe_trials=30)[0]
    assert capped == largest_batch_with_swap(g, budget, device, max_overhead=0.3, probe_trials=30)[0]
    assert any_host.largest()[0] == largest_batch_with_swap(g, budget, unlimited, max_overhead=None,
                                                            probe_trials=30)[0] > swapped
    carried = [b for b, found in probes.evaluations_at.items() if any_host.evaluations_at.get(b, 0) is found]
    searched_again = [b for b in probes.evaluations_at if b not in carried and b in any_host.evaluations_at]
    assert searched_again, "no probe hit the host limit: the test does not exercise the re-search"
    batch = max(b for b in carried if probes.evaluations_at[b])  # a probe that searched and stayed under the limit
    fresh = SwapProbes(g, budget, unlimited, probe_trials=30).at(batch)  # alone: no batch probed near it
    shared = probes.evaluations_at[batch]  # its search's plans, then the nearest batches' best (near_best)
    assert [(e.params, e.step_s, e.feasible) for e in fresh] == [
        (e.params, e.step_s, e.feasible) for e in shared[:len(fresh)]]
    assert len(shared) - len(fresh) <= 2 * NEAR_BEST
    revisited = [key for key in probes.revisited_from if key[0] in carried]
    assert revisited and all(any_host.revisited_from[key] == probes.revisited_from[key] for key in revisited)


def test_a_probe_also_tries_the_best_plans_of_the_batch_probed_nearest():
    """A short probe next to a batch searched longer also evaluates the plans that were best there: they fit
    and beat its own search's (the batch search's steps then follow the plans, not the search's luck)."""
    g = training_graph(40, batch_size=1)
    device = get_device("v100-16gb")
    budget = replay(g.with_batch(64), None, device).peak_bytes // 2
    probes = SwapProbes(g, budget, device, probe_trials=60)
    probes.at(64)
    near = probes.near_best(66, 1)
    assert 0 < len(near) <= NEAR_BEST
    probes.probe_trials = 3
    warm = best_of([e for e in probes.at(66) if e.feasible])
    cold = best_of([e for e in SwapProbes(g, budget, device, probe_trials=3).at(66) if e.feasible])
    assert warm.step_s < cold.step_s and warm.params in near


def test_a_batch_probed_before_its_neighbours_is_revisited_with_their_best_plans():
    """A batch probed first with a short search, then its neighbour with a long one: revisited, the first
    evaluates the neighbour's best plans and refines them (plans beyond those carried), and gets faster than its
    own search was; revisited again, it has nothing new to start from."""
    g = training_graph(40, batch_size=1)
    device = get_device("v100-16gb")
    budget = replay(g.with_batch(64), None, device).peak_bytes // 2
    probes = SwapProbes(g, budget, device, probe_trials=3)
    cold = best_of([e for e in probes.at(66) if e.feasible])
    probed = len(probes.at(66))
    probes.probe_trials = 60
    probes.at(64)
    near = probes.near_best(66, 1)
    probes.revisit(66)
    found = probes.at(66)
    carried = [e for e in found[probed:] if e.params in near and e.feasible]
    warm = best_of(found)
    assert carried and len(found) - probed > len(near)  # the plans carried over, and the refinement's
    assert warm.step_s < cold.step_s
    probes.revisit(66)
    assert len(probes.at(66)) == len(found)


def test_the_largest_batch_walks_on_while_the_next_fits_once_revisited():
    """The bisection's answer is followed up: the batch after it is revisited and, while it then fits, the steps
    go on from there. Here batches up to 10 fit, those up to 20 only with the plans of a batch below them (a
    batch probed after them needs no revisit), none above."""
    probes = SwapProbes(training_graph(4, batch_size=1), 1 << 30, get_device("v100-16gb"))
    first, revisited = {}, set()

    def good_at(batch, max_overhead=None):
        if batch not in first:  # its probe: what fits there, with the plans of the batches probed below it
            first[batch] = batch <= 10 or batch <= 20 and any(10 < b < batch for b in first)
        return ["a plan"] if first[batch] or batch <= 20 and batch in revisited else []

    probes.good_at, probes.revisit = good_at, revisited.add
    assert largest_batch(lambda batch: bool(good_at(batch))) == 10
    first.clear()
    assert probes.largest()[0] == 20
    assert largest_batch(lambda batch: batch <= 37, start=30) == 37 and largest_batch(lambda b: False, start=5) == 4


def test_probes_skip_the_search_where_no_plan_can_fit(monkeypatch):
    """A batch whose resident memory plus largest op working set exceeds the budget fits no plan
    (swapping and recomputation leave every op's inputs and outputs on the device): its probe is
    empty without a search; below that bound the probe searches."""
    import autotune.run.probes as probes_module

    g = training_graph(40, batch_size=1)
    device = get_device("v100-16gb")
    budget = peak_lower_bound_bytes(g.with_batch(64))
    searched = []
    real = probes_module.make_policy
    monkeypatch.setattr(probes_module, "make_policy", lambda *a, **k: searched.append(a) or real(*a, **k))
    probes = probes_module.SwapProbes(g, budget, device, probe_trials=10)
    above = next(b for b in range(65, 200) if peak_lower_bound_bytes(g.with_batch(b)) > budget)
    assert probes.at(above) == [] and not searched
    assert probes.at(64) is not None and searched


def test_a_changed_recompute_space_gets_its_own_default_study_name():
    """A version whose recompute space differs starts a new study instead of refusing the stored one;
    a swap-only search keeps its name (and resumes), unless its swap-in groups grew (a deep graph's)."""
    g = training_graph(6)
    device = get_device("v100-16gb")
    space = SearchSpace.for_graph(g, recompute=True)
    other = dataclasses.replace(space, recompute_cost=space.recompute_cost[:-1])
    names = [study_name_for(g, 1, device, 10**9, "optuna", "tpe", 0, True, s) for s in (space, other, space)]
    assert names[0] != names[1] and names[0] == names[2]
    swap_only = SearchSpace.for_graph(g)
    assert study_name_for(g, 1, device, 10**9, "optuna", "tpe", 0, False, swap_only) == \
        study_name_for(g, 1, device, 10**9, "optuna", "tpe", 0)
    deep = training_graph(200)  # its swap-in groups go past the ones a swap-only study was made with
    assert 64 < SearchSpace.for_graph(deep).groupby[-1] <= n_levels(deep) // 2
    assert study_name_for(deep, 1, device, 10**9, "optuna", "tpe", 0, False, SearchSpace.for_graph(deep)) != \
        study_name_for(deep, 1, device, 10**9, "optuna", "tpe", 0)


def _slow_link_problem():
    g = conv_relu_graph().with_batch(64)
    device = dataclasses.replace(get_device("v100-16gb"), h2d_bytes_per_s=2e9, d2h_bytes_per_s=2e9)
    return g, device, int(replay(g, None, device).peak_bytes * 0.6)


def test_a_timed_search_with_recomputation_leaves_time_for_recomputation():
    """The swap-only search that runs first gets half the time: the rest searches recomputation."""
    g, device, budget = _slow_link_problem()
    result = tune_graph(g, device=device, memory=budget, trials=None, timeout_s=3, recompute=True, seed=1)
    assert any(e.params is not None and e.params.recomputes for e in result.evaluations)


def test_an_interrupted_swap_only_phase_keeps_its_trials(monkeypatch):
    """Ctrl-C during the swap-only search that runs first: its finished trials are in the user's study
    (the same command resumes from them), and the interrupt goes on to the caller."""
    g, device, budget = _slow_link_problem()
    evaluate, calls = TuningProblem.evaluate, []

    def interrupted(self, params):
        calls.append(params)
        if len(calls) == 25:
            raise KeyboardInterrupt
        return evaluate(self, params)

    monkeypatch.setattr(TuningProblem, "evaluate", interrupted)
    study = optuna.create_study(direction="minimize")
    problem = TuningProblem(g, device, budget, space=SearchSpace.for_graph(g, recompute=True))
    with pytest.raises(KeyboardInterrupt):
        make_policy("optuna").search(problem, study, Budget(trials=40))
    kept = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(kept) >= 10


def test_off_grid_refinement_beats_the_whole_grid_and_resumes():
    """The compass search off the grid finds a plan faster than every grid point (checked by walking
    the whole grid), valid and within the budget; its trials are in the study with their parameters,
    so a resumed search (a new problem, nothing memoised) evaluates them again to the same plan."""
    g = training_graph(24, batch_size=1).with_batch(64)
    device = get_device("v100-16gb")
    budget = int(replay(g, None, device).peak_bytes * 0.5)
    full = SearchSpace.for_graph(g)
    space = SearchSpace(threshold=full.threshold[::4], lb=(1, 8), window=(0, 16), groupby=(0, 16), sync=("none",),
                        order=("cto",), min_bytes=(4096,), tensors=("activations",), distance=("level",),
                        trigger=("ancestor",), after_copies_out=(False,))
    problem = TuningProblem(g, device, budget, space=space)
    study = optuna.create_study()
    grid = make_policy("exhaustive").search(problem, study, Budget(trials=None))
    assert len(grid.evaluations) == space.size() and grid.chosen is not None
    assert len(study.trials) == 1  # the exhaustive policy records its choice
    added = refine_off_grid(problem, study, 40, None)
    assert 0 < added <= 40 and len(study.trials) == 1 + added
    best = min((t for t in study.trials if t.user_attrs["feasible"]), key=lambda t: t.value)
    assert best.value < grid.chosen.step_s * 0.95, "nothing off the grid beat the grid's best"
    assert not best.params and space.choice(SwapParams.from_dict(best.user_attrs["params"])) is None  # off the grid
    resumed = TuningProblem(g, device, budget, space=space)
    again = evaluation_from_trial(best, resumed)
    assert again.feasible and again.step_s == best.value and again.peak_bytes <= budget
    validate_plan(g, resumed.plan(again.params))
    outcome = make_policy("optuna").search(resumed, study, Budget(trials=5))
    assert outcome.chosen.step_s <= best.value


def test_a_grid_point_asked_with_tensors_of_its_own_is_recorded_off_the_grid():
    """Parameters carried from another batch name the tensors they recompute and keep; their grid point would
    derive others, so the study records them whole and reads back the plan evaluated."""
    g = training_graph(24, batch_size=1).with_batch(64)
    problem = TuningProblem(g, get_device("v100-16gb"), 1 << 40, space=SearchSpace.for_graph(g))
    space = problem.space
    bare = SwapParams(threshold=space.threshold[0], lb=space.lb[0], ub=space.lb[0] + space.window[0],
                      groupby=space.groupby[0], min_bytes=space.min_bytes[0])
    named = dataclasses.replace(bare, keep_tensors=(g.tensor_name(0),), recompute_tensors=(g.tensor_name(1),))
    assert space.choice(named) == space.choice(bare) is not None
    study = optuna.create_study()
    for params in (bare, named):
        add_evaluation(study, problem.evaluate(params), problem, asked=params)
    back = [evaluation_from_trial(trial, problem) for trial in study.trials]
    assert [e.params for e in back] == [problem.evaluate(bare).params, problem.evaluate(named).params]
    assert back[0].params != back[1].params and study.trials[0].params and not study.trials[1].params


def test_off_grid_a_move_that_helps_goes_on_twice_as_far():
    """Where the best plan lies many grid steps from the start (a step time falling with lb up to 120, from
    lb 8), a move that helps is made again with its step doubled, so a few trials get there (the compass alone,
    half a grid step a round over five parameters, gets lb to 13 in the same trials)."""
    g = training_graph(24, batch_size=1).with_batch(64)
    problem = TuningProblem(g, get_device("v100-16gb"), 1 << 40, space=SearchSpace.for_graph(g))
    start = SwapParams(threshold=4, lb=8, ub=16, groupby=4)
    simulate = problem.evaluate
    metrics = simulate(start).metrics
    asked: dict[SwapParams, object] = {}

    def evaluate(params):  # the simulated plan, with a step time that only lb sets
        step_s = 1.0 + abs(math.log(params.lb / 120))
        return asked.setdefault(params, dataclasses.replace(
            simulate(params), metrics={**metrics, "step_s": step_s}, feasible=True, excess_bytes=0))

    problem.evaluate, problem.simulated = evaluate, lambda params: params in asked
    study = optuna.create_study()
    add_evaluation(study, evaluate(start), problem)
    added = refine_off_grid(problem, study, 16, None)
    best = min(asked.values(), key=lambda e: e.step_s)
    assert added <= 16 and best.params.lb >= 40, best.params


def test_off_grid_from_a_plan_that_misses_climbs_to_one_that_fits():
    """Started from a plan over the budget (a threshold that swaps too little), the compass search takes the moves
    that miss by less, then the ones that fit (``SwapProbes.revisit`` starts it from a neighbour batch's plans)."""
    g = training_graph(24, batch_size=1).with_batch(64)
    device = get_device("v100-16gb")
    problem = TuningProblem(g, device, int(replay(g, None, device).peak_bytes * 0.7), space=SearchSpace.for_graph(g))
    start = SwapParams(threshold=44, lb=8, ub=16)
    assert not problem.evaluate(start).feasible
    study = optuna.create_study()
    add_evaluation(study, problem.evaluate(start), problem)
    assert refine_off_grid(problem, study, 40, None) == 0  # by default it starts from plans that fit: none here
    refine_off_grid(problem, study, 40, None, starts=[start])
    found = [evaluation_from_trial(trial, problem) for trial in study.trials]
    assert any(e.feasible for e in found)
    assert min(e.excess_bytes for e in found[1:3]) < found[0].excess_bytes  # the start, then moves that miss less


def test_plans_that_miss_rank_by_the_larger_of_their_device_and_host_misses():
    """A plan with room on the device but 500 bytes over the host limit is further from fitting than one 100 bytes
    over the device budget: the compass search climbs from the latter first."""
    fits = Evaluation(None, {"step_s": 2.0}, True, -10, -10)
    device_miss = Evaluation(None, {"step_s": 1.0}, False, 100, -5)
    host_miss = Evaluation(None, {"step_s": 1.0}, False, -1000, 500)
    assert sorted([host_miss, device_miss, fits], key=fits_first) == [fits, device_miss, host_miss]
    assert host_miss.miss_bytes == 500 and device_miss.miss_bytes == 100
    assert closest_of([host_miss, device_miss]) is device_miss  # the report's closest plan, by the same rank
    assert closest_of([Evaluation(None, {"step_s": 1.0}, False, 600, -5), host_miss]) is host_miss


def test_a_step_that_misses_on_the_host_names_the_plan_nearest_to_fitting(tmp_path):
    """With a host too small for the swaps, the plans with room on the device miss by their host memory: the
    verdict and the report name the plan that misses least either way, and say where it misses (not "over the
    budget" for a plan within it)."""
    from autotune.report.writer import write_report

    g = training_graph(24, batch_size=1).with_batch(64)
    base = get_device("v100-16gb")
    peak = replay(g, None, base).peak_bytes
    device = dataclasses.replace(base, host_memory_bytes=int(peak * 0.05))
    result = tune_graph(g, device=device, memory=int(peak * 0.6), trials=30, state=False, recompute=False)
    assert not result.feasible
    assert any(e.excess_bytes <= 0 < e.host_excess_bytes for e in result.evaluations)  # room on the device only
    closest = result.closest
    assert closest.miss_bytes == min(e.miss_bytes for e in result.evaluations + [result.baseline])
    assert closest.host_excess_bytes > 0 and "more host memory than the host has" in result.verdict.headline
    assert ("over the budget" in result.verdict.headline) == (closest.excess_bytes > 0)
    write_report(result, tmp_path)
    assert "more than the host has." in (tmp_path / "report.md").read_text()


def test_each_variable_is_tried_in_the_other_mode_from_the_state_kept_so_far():
    """A group's variables flip one at a time: a flip that is faster stays, and the next starts from it (the second
    variable is tried with the first already streamed)."""
    step_s = {(HOST_UPDATE, HOST_UPDATE): 10.0, (STREAM_SLOTS, HOST_UPDATE): 8.0, (HOST_UPDATE, STREAM_SLOTS): 9.0,
              (STREAM_SLOTS, STREAM_SLOTS): 7.0}
    asked = []

    def searched(state):
        modes = tuple(item.mode for item in state)
        asked.append(modes)
        chosen = dataclasses.make_dataclass("Chosen", ["step_s"])(step_s[modes])
        copies = tuple(HostState(item.variable, item.mode) for item in state)  # as a plan file reads them back
        return dataclasses.make_dataclass("Found", ["chosen", "plan"])(
            chosen, dataclasses.make_dataclass("Plan", ["host_state"])(copies))

    start = (HostState("a"), HostState("b"))
    found = modes_per_variable(searched(start), searched)
    assert asked[1:] == [(STREAM_SLOTS, HOST_UPDATE), (STREAM_SLOTS, STREAM_SLOTS)]
    assert found.chosen.step_s == 7.0 and [item.mode for item in found.plan.host_state] == [STREAM_SLOTS] * 2


def test_where_the_step_whole_is_slow_its_split_is_searched_too_and_the_faster_kept():
    """The zoo's separable CNN at batch 8 under half its unswapped peak: its floor fits, and the best plan of the
    step whole costs 16.7 % (preset step times, 60 trials); split in 2 parts a plan costs 7.4 %: ``autotune.tune``
    keeps the split, confirmed by a measured run, and says what each cost; the batch probes of
    ``max-batch --split`` search it there too. With ``--no-split``, the step whole."""
    model = build_zoo_model("separable_cnn")
    graph = capture(model, 8)
    device = get_device("cpu-testbed")
    budget = int(0.5 * replay(graph, None, device).peak_bytes)
    assert peak_lower_bound_bytes(graph) <= budget
    no_calibration = MeasureOptions(calibrate=False)
    whole = autotune.tune(model, batch_size=8, device="cpu-testbed", memory=budget, trials=60,
                          measurement=no_calibration, search=SearchOptions(split=False, progress=False))
    assert whole.verdict.ok and whole.chosen.metrics["overhead"] > SPLIT_WHEN_OVERHEAD_OVER
    split = autotune.tune(model, batch_size=8, device="cpu-testbed", memory=budget, trials=60,
                          measurement=no_calibration, search=SearchOptions(progress=False))
    assert split.verdict.ok and split.verdict.confirmed_by_measurement and split_parts(split.graph) == 2
    assert split.chosen.step_s < whole.chosen.step_s
    assert any(note.startswith(f"the step whole fits at {whole.chosen.metrics['overhead']:.1%} overhead; split in")
               for note in split.notes)
    probes = SwapProbes(graph, budget, device, probe_trials=60, recompute=True, split=True)
    fastest = best_of([e for e in probes.at(8) if e.feasible])
    assert probes.parts_of(8, fastest) >= 2
