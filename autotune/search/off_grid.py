"""A compass search off the search space's grid, from the best plans a search found.

A grid is coarse where a few tensors decide: ResNet-50 at batch 692 on v100-16gb (recomputation on)
had its best plans between the grid's lb 56 and 93 and groupby past its largest, 64; the search's
22.1 % plan became 16.9 % off the grid in 30 more simulations. A move that helps is made again twice
as far (``_further``): where the best plan lies many grid steps away, a few trials reach it. ``OptunaPolicy``
runs it after its grid stages, each plan a trial of the user's study.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, NamedTuple, Sequence

import numpy as np
import optuna

from autotune.search.space import TuningProblem, add_evaluation, best_of, fits_first, trial_params
from simulator import SwapParams
from simulator.params import SYNC_IN_MODES

# off the grid: the ordered parameters a pattern search moves (lb with the window's width kept)
OFF_GRID = ("threshold", "lb", "window", "groupby", "recompute_cost")
OFF_GRID_STARTS = 3  # the best plans that fit it starts from, one after the other
OFF_GRID_LEAST_RATIO = 1.005  # a parameter's step, as a ratio, below which it stops moving


def refine_off_grid(problem: TuningProblem, study: optuna.Study, budget: int, deadline: float | None,
                     interrupted: Callable[[], bool] = lambda: False,
                     starts: Sequence[SwapParams] | None = None) -> int:
    """A compass search off the grid from the best plans that fit (``OFF_GRID_STARTS`` of them, by
    step time, in turn), or from ``starts``: each ordered parameter one step up and down, by a ratio that
    starts at half a grid step (in log scale) and halves whenever no move helps. A grid is coarse where a
    few tensors decide (ResNet-50 at batch 692 on v100-16gb: lb 64 between the grid's 56 and 93). From a
    plan that misses the budget, a move helps that misses it by less, until one fits (``fits_first``).
    Every plan it evaluates is a trial of ``study`` (``add_evaluation``, off-grid parameters as an
    attribute), so the user's study holds it and a resumed search starts from it. Returns the
    trials added (at most ``budget``)."""
    if starts is None:
        trials = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                  if t.user_attrs.get("feasible")]
        starts = []
        for trial in sorted(trials, key=lambda t: t.value):
            params = trial_params(trial, problem)
            if params is not None and params not in starts:
                starts.append(params)
    added = 0
    ratios0 = {name: _half_grid_step(problem.space, name) for name in OFF_GRID}
    for current in starts[:OFF_GRID_STARTS]:
        ratios = dict(ratios0)
        while ratios and added < budget:
            if deadline is not None and time.monotonic() >= deadline or interrupted():
                return added
            moves = [m for m in _off_grid_moves(current, ratios) if not problem.simulated(m.params)][:budget - added]
            for move in moves:
                add_evaluation(study, problem.evaluate(move.params), problem, asked=move.params)
            added += len(moves)
            evaluations = [problem.evaluate(m.params) for m in moves]
            best = best_of(evaluations) or min(evaluations, key=fits_first, default=None)
            moved = next((m for m, e in zip(moves, evaluations) if e is best), None)
            if moved is not None and fits_first(best) < fits_first(problem.evaluate(current)):
                current, more = _further(problem, study, moved, budget - added)
                added += more
            else:
                ratios = {name: ratio ** 0.5 for name, ratio in ratios.items() if ratio ** 0.5 > OFF_GRID_LEAST_RATIO}
    return added


def _half_grid_step(space, name: str) -> float:
    """Half the space's typical step of an ordered parameter, as a ratio (its grid is geometric)."""
    values = np.array([v for v in getattr(space, name) if np.isfinite(v)], float)
    values = np.unique(values + (1.0 if name in ("window", "groupby") else 0.0))
    values = values[values > 0]
    if len(values) < 2:
        return 1.0
    return float(np.exp(np.mean(np.diff(np.log(values))) / 2))


class _Move(NamedTuple):
    """``params``: a plan with the ordered parameter ``name`` scaled by ``factor``."""

    name: str
    factor: float
    params: SwapParams


def _further(problem: TuningProblem, study: optuna.Study, move: _Move, budget: int) -> tuple[SwapParams, int]:
    """From a move that helped, the same move again, its factor squared each time (twice the step in log
    scale), while that helps and ``budget`` lasts: a best plan many grid steps away (ResNet-50 in 4 parts at
    batch 1038 on v100-16gb: lb from 8 to 120) is reached in a few trials, not one half grid step a round.
    Returns where it stopped and the trials it added."""
    name, factor, current = move
    added = 0
    while added < budget:
        factor *= factor
        further = _moved(current, name, factor)
        if further is None or problem.simulated(further):
            break
        evaluation = problem.evaluate(further)
        add_evaluation(study, evaluation, problem, asked=further)
        added += 1
        if not fits_first(evaluation) < fits_first(problem.evaluate(current)):
            break
        current = further
    return current, added


def _moved(params: SwapParams, name: str, factor: float) -> SwapParams | None:
    """``params`` with the ordered parameter ``name`` scaled by ``factor`` (integers rounded; window and groupby
    counted from 1, as they may be 0); None where that changes nothing or the parameter does not apply."""
    if name == "recompute_cost":
        if not params.recomputes or not math.isfinite(params.recompute_cost):
            return None
        return replace(params, recompute_cost=params.recompute_cost * factor)
    if name in ("lb", "window") and params.sync in SYNC_IN_MODES:
        return None  # no trigger window: they change nothing
    window = params.ub - params.lb
    shift = 1 if name in ("window", "groupby") else 0
    old = window if name == "window" else getattr(params, name)
    new = max(1 - shift, int(round((old + shift) * factor)) - shift)
    if new == old:
        return None
    if name == "window":
        return replace(params, ub=params.lb + new)
    if name == "lb":
        return replace(params, lb=new, ub=new + window)
    return replace(params, **{name: new})


def _off_grid_moves(params: SwapParams, ratios: dict[str, float]) -> list[_Move]:
    """``params`` with one ordered parameter moved up or down by its ratio (``_moved``; moves that change
    nothing left out)."""
    moves = []
    for name, ratio in ratios.items():
        for factor in (ratio, 1 / ratio):
            moved = _moved(params, name, factor)
            if moved is not None:
                moves.append(_Move(name, factor, moved))
    return moves
