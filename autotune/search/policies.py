"""Search policies, chosen by name: how candidates are picked, not how they are judged.

``optuna`` (default): Optuna's sampler (TPE unless told otherwise) with the budget as a constraint.
``random``: Optuna's random sampler, the floor any search must beat.
``exhaustive``: the whole grid, for small graphs and for measuring how far the others are.
``tflms-v2``: the seed system's successor, one parameter at a time by binary search on memory
alone (docs/design.md 1.5), re-implemented on our simulator.
``none``: no swapping.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import signal
import threading
import time
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Protocol

import numpy as np
import optuna
from tqdm import tqdm

from autotune.inputs import format_bytes
from autotune.search.off_grid import refine_off_grid
from autotune.search.space import (Evaluation, TuningProblem, add_evaluation, best_of, closest_of, evaluation_from_trial,
                             record_trial_attrs)
from autotune.search.study_copy import optimize_windowed
from simulator import SwapParams, n_levels
from simulator.params import SYNC_IN_MODES, SYNC_MODES

log = logging.getLogger(__name__)


def _tpe(seed: int | None) -> optuna.samplers.TPESampler:
    """Multivariate TPE over groups of parameters: the space is conditional (recompute settings only with
    recomputation) and off-grid trials have no grid parameters, so without ``group`` TPE fell back to
    sampling each parameter alone, 11 estimators a trial (ResNet-50 b256 with recomputation: 9.5 trials/s
    without, 22 with, the same plan; benchmarks/results/search_speed.md). ``group`` is experimental in Optuna."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=16)


# The budget reaches constraint-aware samplers through Trial.set_constraint (search.record_trial_attrs).
SAMPLERS: dict[str, Callable[[int | None], optuna.samplers.BaseSampler]] = {
    "tpe": _tpe,
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
    "nsga2": lambda seed: optuna.samplers.NSGAIISampler(seed=seed),
    "qmc": lambda seed: optuna.samplers.QMCSampler(seed=seed, scramble=True),
}
# samplers whose cost per trial grows with the trials they see: they see a bounded window of them (TPE
# at 460 trials took 16 ms a trial, more than the simulation, benchmarks/results/search_speed.md)
WINDOWED = ("tpe",)


@dataclass
class Outcome:
    """What a policy evaluated, and the candidate it settles on (None: nothing fits)."""

    evaluations: list[Evaluation]
    chosen: Evaluation | None


def with_candidates(outcome: Outcome, problem: TuningProblem, candidates: Iterable[SwapParams]) -> Outcome:
    """``outcome`` with the plans ``candidates`` (``SwapParams``, e.g. the best of a nearby batch) evaluated beside
    its own, and the fastest that fits of all chosen."""
    more = [problem.evaluate(params) for params in dict.fromkeys(candidates) if not problem.simulated(params)]
    if not more:
        return outcome
    evaluations = outcome.evaluations + more
    return Outcome(evaluations, best_of([e for e in (outcome.chosen, *more) if e is not None]))


@dataclass
class Budget:
    """How long a search may run: a number of trials (new ones, on top of a resumed study) and/or seconds."""

    trials: int | None = 200
    timeout_s: float | None = None
    progress: bool = False


class SearchPolicy(Protocol):
    name: str

    def search(self, problem: TuningProblem, study: optuna.Study, budget: Budget) -> Outcome:
        """Evaluate candidates, record them in ``study``; return every evaluation made or resumed
        and the policy's choice."""
        ...


def _study_evaluations(study: optuna.Study, problem: TuningProblem) -> list[Evaluation]:
    found = (evaluation_from_trial(t, problem) for t in study.get_trials(deepcopy=False))
    return [e for e in found if e is not None]


class OptunaPolicy:
    """Optuna over the grid indices, in phases that all count as trials of the study:

    1. the tflms-v2 search (about 30 candidates): its memory-only binary searches find the
       frontier of what fits, and its answer is kept as a candidate, so the result is never worse;
    2. a binary search for the largest grid threshold that fits seeds the sampler there;
    3. the sampler (TPE by default, seeing the budget through Optuna's constraints) explores;
    4. a share (REFINE_SHARE) of the trials left refines the best grid plan that fits in each of the
       three most promising sync/order basins by coordinate descent: other values of one parameter
       at a time, until none improves (then the next basin in line takes its turn);
    5. a share (OFF_GRID_SHARE) refines the best plans off the grid (``autotune.search.off_grid.refine_off_grid``).
    """

    REFINE_SHARE = 0.6
    OFF_GRID_SHARE = 0.15

    def __init__(self, sampler: str = "tpe", seed: int | None = 0, name: str = "optuna") -> None:
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; known: {', '.join(SAMPLERS)}")
        self.name, self.sampler_name, self.seed = name, sampler, seed

    def sampler(self) -> optuna.samplers.BaseSampler:
        return SAMPLERS[self.sampler_name](self.seed)

    def search(self, problem: TuningProblem, study: optuna.Study, budget: Budget) -> Outcome:
        study.sampler = self.sampler()
        guided = self.name == "optuna"

        def objective(trial: optuna.Trial) -> float:
            params = problem.space.params(problem.space.suggest(trial))
            if guided and problem.simulated(params) and not trial.user_attrs:
                raise optuna.TrialPruned("already simulated")  # samplers repeat points; spend trials on new ones
            evaluation = problem.evaluate(params)
            record_trial_attrs(trial, evaluation, problem)
            return evaluation.step_s

        left = [budget.trials]  # None: until the timeout
        deadline = None if budget.timeout_s is None else time.monotonic() + budget.timeout_s
        window_rng = np.random.default_rng(self.seed)

        def run(n: int | None, *enqueue: dict, windowed: bool = False) -> bool:
            """Evaluate the enqueued choices, then up to n - len(enqueue) sampled ones; False when out of budget.
            ``windowed``: the sampler sees a bounded window of the trials (``study_copy.optimize_windowed``)."""
            if left[0] is not None:
                n = min(n if n is not None else left[0], left[0])
            if n is not None and n <= 0 or deadline is not None and time.monotonic() >= deadline:
                return False
            _enqueue_new(study, enqueue)
            before = _complete(study)
            timeout_s = None if deadline is None else deadline - time.monotonic()
            if windowed and not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
                optimize_windowed(study, objective, n_trials=n, timeout_s=timeout_s, callbacks=[callback, stop],
                                  stopped=lambda: bool(stop.requested), rng=window_rng)
            else:
                study.optimize(objective, n_trials=n, timeout=timeout_s, callbacks=[callback, stop],
                               gc_after_trial=False)
            if left[0] is not None:
                left[0] -= _complete(study) - before
            return True

        def sample(keep: int) -> None:
            """The sampler until ``keep`` trials are left: repeated points are pruned and not
            counted, so it is topped up (a few rounds at most)."""
            for _ in range(8):
                if left[0] is not None and left[0] <= keep or not run(None if left[0] is None else left[0] - keep,
                                                                      windowed=self.sampler_name in WINDOWED):
                    break

        # the off-grid refinement's share: a new search has it on top of its trials, as taking it from
        # the stages before it made them miss plans they found (the frontier's binary searches can take
        # a whole budget: ResNet-50 on v100-16gb with 15 % fewer trials found a 31 % plan for the 22 %
        # one at batch 692 with recomputation, 307 % for 278 % at 981 swapping alone); a resumed study
        # keeps it within its trials (it adds as many as asked)
        off_grid = 0 if not guided or left[0] is None else int(left[0] * self.OFF_GRID_SHARE)
        on_top = _complete(study) == 0
        if off_grid and not on_top:
            left[0] -= off_grid
        with _progress(budget, problem, off_grid if on_top else 0) as (callback, advance), _stop_on_interrupt() as stop:
            if guided and _complete(study) == 0 and problem.space.recomputes:
                # the search without recomputation first, its own trials: recomputation only adds
                self._swaps_first(problem, study, budget, deadline)
                _enqueue_new(study, _threshold_frontier(problem, study, run, swaps=False))
            elif guided and _complete(study) == 0:
                made = TflmsV2Policy().search(problem, study, budget).evaluations
                advance(len(made))
                if left[0] is not None:
                    left[0] -= len(made)
                _enqueue_new(study, _threshold_frontier(problem, study, run))
            refine = 0 if not guided or left[0] is None else int(left[0] * self.REFINE_SHARE)
            sample(refine)
            if guided:
                self._refine(problem, study, run, refine)
                if off_grid:
                    added = refine_off_grid(problem, study, off_grid, deadline, lambda: bool(stop.requested))
                    advance(added)
                    if not on_top:
                        left[0] += off_grid - added
                # whatever refinement did not complete goes back to the sampler: counted in completed
                # trials, as a resumed study may already hold (failed, waiting) trials of the points
                # refinement enqueues, which Optuna then skips
                sample(0)
        evaluations = _study_evaluations(study, problem)
        return Outcome(evaluations, best_of(evaluations))

    def _swaps_first(self, problem: TuningProblem, study: optuna.Study, budget: Budget, deadline: float | None) -> None:
        """Search without recomputation (the swap-only space; the same simulations: the problems share
        their memo) with ``budget.trials`` of its own, so that the search with recomputation is never
        worse than ``--no-recompute``, and half the time left before ``deadline``, so that it always
        gets some. Its trials go into ``study``, also when Ctrl-C stops it (the interrupt goes on)."""
        swaps = replace(problem, space=problem.space.swap_only())
        timeout_s = None if deadline is None else max(0.0, deadline - time.monotonic()) / 2
        inner = optuna.create_study(direction="minimize")
        try:
            OptunaPolicy(self.sampler_name, self.seed, self.name).search(
                swaps, inner, Budget(budget.trials, timeout_s, budget.progress))  # a progress bar of its own
        finally:
            for evaluation in _study_evaluations(inner, swaps):
                add_evaluation(study, evaluation, problem)

    @staticmethod
    def _refine(problem: TuningProblem, study: optuna.Study, run, budget: int, per_round: int = 12) -> None:
        """Coordinate descent from the best plan that fits of each sync/order(/recompute) basin, the
        basins taking turns a few moves at a time, within ``budget`` trials."""
        space = problem.space
        on_grid = [e for e in _study_evaluations(study, problem)
                   if e.feasible and e.params is not None and space.choice(e.params) is not None]
        basins: dict[tuple, Evaluation] = {}
        for evaluation in on_grid:
            key = (evaluation.params.sync, evaluation.params.order, evaluation.params.recompute)
            if key not in basins or evaluation.step_s < basins[key].step_s:
                basins[key] = evaluation
        waiting = sorted(basins, key=lambda key: basins[key].step_s)
        active, waiting = waiting[:3], waiting[3:]  # the most promising basins; the next when one converges
        while budget > 0 and active:
            for key in list(active):
                fresh = [c for c in _neighbours(problem, basins[key])
                         if not problem.simulated(space.params(c))][:min(per_round, budget)]
                if not fresh or not run(len(fresh), *fresh):
                    active.remove(key)
                    if waiting:
                        active.append(waiting.pop(0))
                    continue
                budget -= len(fresh)
                basins[key] = best_of([basins[key]] + [problem.evaluate(space.params(c)) for c in fresh])
                if budget <= 0:
                    break


def _enqueue_new(study: optuna.Study, choices) -> None:
    """Enqueue the choices no trial of the study has had or waits for, as ``enqueue_trial``'s
    ``skip_if_exists`` does; that compares each with every trial through ``np.isclose``, which took
    40 % of a 200-trial search on ResNet-50. Grid choices are ints and labels: equality is exact."""
    seen = None
    for choice in choices:
        if seen is None:
            seen = {_choice_key(t.system_attrs.get("fixed_params", t.params)) for t in study.get_trials(deepcopy=False)}
        key = _choice_key(choice)
        if key not in seen:
            seen.add(key)
            study.enqueue_trial(choice)


def _choice_key(choice: dict) -> tuple:
    return tuple(sorted(choice.items()))


def _complete(study: optuna.Study) -> int:
    return sum(1 for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def _threshold_frontier(problem: TuningProblem, study: optuna.Study, run, *, swaps: bool = True) -> list[dict]:
    """For each sync mode and execution order, a binary search (as trials) for the largest grid
    threshold that fits the device with a middling swap-in window, kept if it also fits the host:
    one feasible starting point per basin (swapping many tensors asynchronously and swapping a few
    big ones synchronously are far apart).
    A basin where nothing fits that way is searched again, after the others, with the tightest
    swap-ins (the earliest trigger window, of width 0, no grouping) and every tensor the space may
    swap, gradients too; and where that fails too, once more counting distances in steps of the
    order, with each swap-in waiting for the copies out of its trigger's outputs (each tensor then
    comes back right before its reader, and never beside the one copied out before it); and where
    that fails too, the same with a swap-in window wide enough to hold a trigger. A basin with
    recomputation whose plan fits the device but not the host is the nearest to fitting: its stage
    is searched again at once with each costlier recompute cost in turn, until one fits. Under a
    tight budget, or near the largest batch that fits at all, only such just-in-time plans fit;
    the search's moves from there try them without that wait.
    In a space with recomputation, the basins are searched without it first, every stage (unless
    ``swaps`` is false: a search without recomputation ran before), then
    (swapping asynchronously or with the next op waiting for the copy out) with the most of it
    (``SearchSpace.recompute_corners``); then, where the most of it fits in the first stage, for
    asynchronous swapping in each order, every recompute cost in turn, cheapest first: the
    threshold that fits only grows with the cost, so each search starts where the last one ended
    (recomputing a little and swapping the rest asynchronously is what keeps the overhead low); and
    where the most of it fits in no stage, the same sweep with the last stage's swap-ins: near the
    bound, recomputing more can miss where less fits (clones of convolutions kept for the readers
    that set the bound; ResNet-50 at 1384 on v100-16gb fits at 3e-11 s/B, not at 1e-10)."""
    space = problem.space
    middling = {"lb": len(space.lb) // 3, "window": len(space.window) // 2, "groupby": len(space.groupby) - 1,
                "tensors": space.tensors[0]}
    tightest = {"lb": 0, "window": 0, "groupby": 0, "tensors": space.tensors[-1]}
    first = {"distance": space.distance[0], "trigger": space.trigger[0], "after_copies_out": space.after_copies_out[0]}
    last = {"distance": space.distance[-1], "trigger": space.trigger[-1], "after_copies_out": space.after_copies_out[-1]}
    # last, the tightest swap-ins again with a window that can hold a trigger: without one a swap-in is
    # synchronous, and one whose reader's other inputs are long made (a recomputation reading a kept
    # source) then starts as soon as the link is free, its buffer held far ahead of the read
    triggered = {**tightest, **last, "window": len(space.window) // 2}
    tries = [{**middling, **first}, {**tightest, **first}, {**tightest, **last}, triggered]
    tries = [t for k, t in enumerate(tries) if t not in tries[:k]]  # a narrowed space may make two alike
    frontier: list[dict] = []
    corners = space.recompute_corners()
    # with the most recomputation, asynchronous swaps and swap-outs the next op waits for (what the
    # largest sizes took); the synchronous swap-ins ("in", "both") only without it
    syncs_with_most = [sync for sync in space.sync if sync in (space.sync[0], "out")]
    basins = [(0, sync, order, corner) for sync in space.sync for corner, syncs in zip(corners, (space.sync,
                                                                                              syncs_with_most))
              if sync in syncs for order in space.order]

    def largest(base: dict, low: int = 0) -> int | None | bool:
        """The largest threshold index from ``low`` whose plan fits the device (None: none does;
        False: out of budget)."""
        high, best = len(space.threshold) - 1, None
        while low <= high:
            middle = (low + high) // 2
            choice = dict(base, threshold=middle)
            if not run(1, choice):
                return False
            # on the device alone: a larger threshold swaps less, so it needs more device memory
            # and less host memory; the largest that fits the device is the basin's best hope
            if problem.evaluate(space.params(choice)).excess_bytes <= 0:
                best, low = middle, middle + 1
            else:
                high = middle - 1
        return best

    def fits_both(base: dict, threshold: int) -> bool:
        """Whether ``base`` at ``threshold`` fits device and host (``largest`` looks at the device alone)."""
        return problem.evaluate(space.params(dict(base, threshold=threshold))).feasible

    # swap-ins started early (a far trigger, a window of a few dozen levels): where recomputation leaves
    # a few large tensors to swap, the link hides them only so (ResNet-50 at 640 on v100-16gb: 8.9 %
    # with lb 93, window 32, where the middling window's plans stay over 20 %)
    early = dict(tries[0], lb=3 * len(space.lb) // 4, window=min(len(space.window) - 1, len(space.window) // 2 + 2))

    def sweep_costs(stage: int) -> bool:
        """Every recompute cost with asynchronous swaps and ``tries[stage]`` (at the first stage, and
        with ``early`` swap-ins), in each order; False when out of budget."""
        for order, start in itertools.product(space.order, [tries[stage]] + ([early] if stage == 0 else [])):
            low = 0
            for cost in range(len(space.recompute_cost)):
                base = dict(start, min_bytes=0, sync=space.sync[0], order=order,
                            **dict(corners[-1], recompute_cost=cost))
                best = largest(base, low)
                if best is False:
                    return False
                if best is not None:
                    low = best
                    if fits_both(base, best):
                        frontier.append(dict(base, threshold=best))
        return True

    most_fits = False  # with the most recomputation, a first-stage plan fits: less may fit too
    most_misses = True  # with the most recomputation, no stage fits: near the bound, less may

    def search(queue: list[tuple]) -> bool:
        """The basins in ``queue``, each escalated through ``tries`` until a plan fits; False when
        out of budget. The largest threshold that fits the device swaps the least of its stage: where
        the host has no room for that, no threshold there fits, but recomputing more swaps less
        (ResNet-50 with elide-broadcasts at 5120 on v100-16gb in 8 parts: 74.7 GiB on the host at
        2e-10 s/B, 49.3 GiB at any cost, the preset's 64 GiB between them)."""
        nonlocal most_fits, most_misses
        while queue:
            stage, sync, order, corner = queue.pop(0)
            base = dict(tries[stage], min_bytes=0, sync=sync, order=order, **corner)
            best = largest(base)
            # fits the device, not the host: the nearest to fitting, searched again at once recomputing more
            while (best is not None and best is not False and corner is not corners[0]
                   and base["recompute_cost"] + 1 < len(space.recompute_cost)
                   and not fits_both(base, best)):
                base = dict(base, recompute_cost=base["recompute_cost"] + 1)
                best = largest(base)
            if best is False:
                return False
            if best is not None and fits_both(base, best):
                frontier.append(dict(base, threshold=best))
                most_fits |= stage == 0 and corner is not corners[0]
                most_misses &= corner is corners[0]
            elif stage + 1 < len(tries):
                queue.append((stage + 1, sync, order, corner))
        return True

    # swapping alone first, every stage (``swaps=False``: done already, by a search of its own)
    if (not swaps or search([basin for basin in basins if basin[3] is corners[0]])) and len(corners) > 1:
        if search([basin for basin in basins if basin[3] is not corners[0]]) and (most_fits or most_misses):
            sweep_costs(0 if most_fits else len(tries) - 1)
    return frontier


def _neighbours(problem: TuningProblem, evaluation: Evaluation) -> list[dict]:
    """Moves from a candidate, nearest first: the threshold up to three grid steps either way,
    every other value of each remaining parameter, and the swap-in window's start and width
    together (they interact: a later start only pays with a wider window).

    Synchronous swap-ins ("in", "both") have no trigger window: there the window's start and width
    change nothing and are not moved, and a move to an asynchronous mode tries every width (the
    one the candidate happens to carry means nothing)."""
    space = problem.space
    centre = space.choice(evaluation.params)
    if centre is None:
        return []
    windowed = centre["sync"] not in SYNC_IN_MODES
    moves: list[tuple[int, dict]] = []
    for name in (*space.ordered, *space.categorical):
        if not windowed and name in ("lb", "window"):
            continue
        values = getattr(space, name)
        for index, value in enumerate(values):
            if name in space.categorical:
                if value != centre[name]:
                    moves.append((1, dict(centre, **{name: value})))
                    if name == "sync" and not windowed and value not in SYNC_IN_MODES:
                        moves += [(2, dict(centre, sync=value, window=w)) for w in range(len(space.window))
                                  if w != centre["window"]]
                continue
            distance = abs(index - centre[name])
            if distance and (name != "threshold" or distance <= 3):
                moves.append((distance, dict(centre, **{name: index})))
    for lb in range(len(space.lb) if windowed else 0):
        for window in range(len(space.window)):
            steps = (abs(lb - centre["lb"]), abs(window - centre["window"]))
            if min(steps) > 0:
                moves.append((max(steps) + 1, dict(centre, lb=lb, window=window)))
    return [choice for _, choice in sorted(moves, key=lambda move: move[0])]


@contextlib.contextmanager
def _stop_on_interrupt():
    """Ctrl-C during a search finishes the running trial, stops the study cleanly (every finished
    trial is stored) and then raises KeyboardInterrupt for the caller to report."""
    requested: list[bool] = []

    def stop(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if requested:
            study.stop()

    stop.requested = requested  # for stages outside ``study.optimize``

    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGINT, lambda *_: requested.append(True))
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
    if requested:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _progress(budget: Budget, problem: TuningProblem, on_top: int = 0):
    """A progress bar showing the best plan that fits so far (Optuna's own bar would show the
    fastest trial even when it breaks the budget). Yields the study callback and a function that
    counts trials added without ``study.optimize``; ``on_top``: simulations beyond the trials (a new
    search's off-grid refinement), counted in the total."""
    bar = tqdm(total=None if budget.trials is None else budget.trials + on_top, disable=not budget.progress,
               desc="search", unit="trial", leave=False)
    best: list[float] = []

    def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if trial.user_attrs.get("feasible") and trial.value is not None:
            if not best or trial.value < best[0]:
                best[:] = [trial.value]
                bar.set_postfix_str(f"best step {trial.value:.4g} s, peak {format_bytes(trial.user_attrs['peak_bytes'])}")
        if trial.state == optuna.trial.TrialState.COMPLETE:  # pruned repeats do not count against the budget
            bar.update(1)

    try:
        yield callback, bar.update
    finally:
        bar.close()


class ExhaustivePolicy:
    """Every grid point; feasible only for small graphs (the space is printed before it starts)."""

    name = "exhaustive"

    def search(self, problem: TuningProblem, study: optuna.Study, budget: Budget) -> Outcome:
        grid = problem.space.grid()
        total = problem.space.size()
        deadline = time.monotonic() + budget.timeout_s if budget.timeout_s else None
        evaluations = []
        for choice in tqdm(grid, total=total, disable=not budget.progress, desc="exhaustive", unit="plan"):
            evaluations.append(problem.evaluate(problem.space.params(choice)))
            if deadline is not None and time.monotonic() > deadline:
                log.warning("exhaustive search stopped by the timeout after %d of %d plans", len(evaluations), total)
                break
        best = best_of(evaluations)
        shown = best or closest_of(evaluations)
        if shown is not None:
            add_evaluation(study, shown, problem)
        return Outcome(evaluations, best)


class TflmsV2Policy:
    """TFLMS v2's auto-tuner (IBM, 2019): memory-only binary searches, one parameter at a time.

    As in the original: first check whether no swapping fits ("LMS not needed"); else find the
    largest threshold that fits (escalating the sync mode 0..3 until threshold 1 fits), then the
    largest swap-in lookahead, then the largest group size. It never looks at step time. Its
    ``ahead`` a maps to our window lb = a + 1, ub = a + 10 (its trigger window is fixed at 10
    levels). Candidates are judged by the same simulator and budget as every other policy.
    """

    name = "tflms-v2"
    SYNC = SYNC_MODES

    def search(self, problem: TuningProblem, study: optuna.Study, budget: Budget) -> Outcome:
        depth = n_levels(problem.graph)
        made: list[Evaluation] = []

        def play(threshold: int, ahead: int, groupby: int, sync: int) -> bool:
            params = SwapParams(threshold=max(1, threshold), lb=ahead + 1, ub=ahead + 10, groupby=groupby,
                                sync=self.SYNC[sync])
            evaluation = problem.evaluate(params)
            made.append(evaluation)
            return evaluation.peak_bytes <= problem.budget_bytes

        def largest(low: int, high: int, passing: int, test: Callable[[int], bool], early_stop: bool = False) -> int:
            best = passing
            while low <= high:
                middle = (low + high) // 2
                if test(middle):
                    best = middle
                    if early_stop:
                        break
                    low = middle + 1
                else:
                    high = middle - 1
            return best

        if play(depth, 1, 0, 0):
            log.info("tflms-v2: no swapping needed")
            made.append(problem.baseline())
            return self._record(made, problem, study)
        sync = 0
        while not play(1, 1, 0, sync):
            if sync == 3:
                return self._record(made, problem, study)  # nothing fits
            sync += 1
        threshold = largest(1, depth, 1, lambda t: play(t, 1, 0, sync))
        if sync < 2:
            ahead = largest(1, depth, 1, lambda a: play(threshold, a, 0, sync))
            if play(threshold, ahead, depth, sync):
                groupby = depth
            else:
                groupby = largest(0, depth, 0, lambda g: play(threshold, ahead, g, sync), early_stop=True)
            play(threshold, ahead, groupby, sync)  # the parameter set it settles on
        return self._record(made, problem, study)

    def _record(self, made: list[Evaluation], problem: TuningProblem, study: optuna.Study) -> Outcome:
        """TFLMS keeps the *last* passing set it found, not the fastest one."""
        passing = [e for e in made if e.feasible]
        final = passing[-1] if passing else None
        for evaluation in made:
            if evaluation.params is not None:
                add_evaluation(study, evaluation, problem)
        return Outcome(made, final)


class NoSwapPolicy:
    name = "none"

    def search(self, problem: TuningProblem, study: optuna.Study, budget: Budget) -> Outcome:
        baseline = problem.baseline()
        return Outcome([baseline], baseline if baseline.feasible else None)


def make_policy(name: str, *, sampler: str = "tpe", seed: int | None = 0) -> SearchPolicy:
    """Policies by name, as the CLI and the API accept them."""
    if name == "optuna":
        return OptunaPolicy(sampler, seed)
    if name == "random":
        return OptunaPolicy("random", seed, name="random")
    if name == "exhaustive":
        return ExhaustivePolicy()
    if name == "tflms-v2":
        return TflmsV2Policy()
    if name == "none":
        return NoSwapPolicy()
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


POLICIES = ("optuna", "random", "exhaustive", "tflms-v2", "none")
