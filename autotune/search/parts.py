"""How many parts a split along the batch has (docs/design.md 12), searched with the swaps and recomputations.

Splitting the ops that set the floor in k parts lowers the floor, the more so the more parts, but makes
smaller kernels (on the presets' roofline, ResNet-50 at batch 1456 computes 0.1 % longer in 2 parts, 3.7 %
in 32) and a larger graph to simulate (5,484 ops; 7,227 in 2 parts, 17,037 in 8). The fewest parts whose
floor fits may leave room only for a slow plan where twice as many leave room for a fast one, so the parts
are a dimension of the search: ``search_parts`` searches each candidate k (``parts_to_search``: the fewest
that fits and a few doublings) on its split graph, made once per k, and keeps the fastest plan that fits
over all of them. A plan records its k in its regions (``splits``, section 8).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import optuna

from autotune.search.policies import Budget, Outcome, SearchPolicy, with_candidates
from autotune.search.space import Evaluation, TuningProblem, best_of
from simulator import OpGraph, SwapParams
from simulator.split import SplitFloor, floor_after_splitting

SPLIT_PARTS = (2, 4, 8, 16, 32)  # the parts a split may have, fewest first (fewer parts: fewer, larger kernels)
PARTS_DOUBLINGS = 2  # the search tries the fewest parts that fit and this many doublings of them
# a plan of the step whole slower than this (simulated overhead): the step split along the batch is searched too,
# where its floor fits as well (parts leave room for plans that move less), and the faster plan kept
SPLIT_WHEN_OVERHEAD_OVER = 0.10


FloorOf = Callable[[OpGraph], int]  # a split step's floor: as split, or with what else the search may move


def split_floor(found: SplitFloor, floor_of: FloorOf | None = None) -> int:
    """``found``'s floor after splitting, or ``floor_of`` its split step (the floor with the optimizer state the
    search may move on the host too: ``autotune.run.floor.state_floor_bytes``)."""
    return found.split_floor_bytes if floor_of is None else floor_of(found.split_graph)


def split_to_budget(g: OpGraph, budget_bytes: int, floor_of: FloorOf | None = None) -> SplitFloor | None:
    """The split with the fewest parts (``SPLIT_PARTS``, at most the batch) whose floor (``split_floor``) is within
    the budget, else the one with the lowest floor; None when no region of ``g`` can be split."""
    lowest, lowest_bytes = None, 0
    for parts in (p for p in SPLIT_PARTS if p <= g.batch_size):
        found = floor_after_splitting(g, parts)
        if not found.regions:
            continue
        floor_bytes = split_floor(found, floor_of)
        if floor_bytes <= budget_bytes:
            return found
        if lowest is None or floor_bytes < lowest_bytes:
            lowest, lowest_bytes = found, floor_bytes
    return lowest


def parts_to_search(g: OpGraph, budget_bytes: int, doublings: int = PARTS_DOUBLINGS,
                    first: SplitFloor | None = None, floor_of: FloorOf | None = None) -> list[SplitFloor]:
    """The splits a search tries, fewest parts first: the fewest parts whose floor (``split_floor``) is within the
    budget (``split_to_budget``, or ``first`` where the caller has it already) and up to ``doublings`` doublings
    of them (``SPLIT_PARTS``, at most the batch); none when no split gets under the budget."""
    first = first or split_to_budget(g, budget_bytes, floor_of)
    if first is None or split_floor(first, floor_of) > budget_bytes:
        return []
    found = [first]
    for parts in SPLIT_PARTS:
        if first.parts < parts <= g.batch_size and len(found) <= doublings:
            more = floor_after_splitting(g, parts)
            if more.regions and split_floor(more, floor_of) <= budget_bytes:
                found.append(more)
    return found


@dataclass(frozen=True)
class PartsSearch:
    """What ``search_parts`` found: per k searched, its split and the policy's outcome there; ``parts`` is
    the k of the fastest plan that fits (the fewest parts when none fits: its closest miss is the one shown)."""

    splits: dict[int, SplitFloor]
    outcomes: dict[int, Outcome]
    problems: dict[int, TuningProblem]
    parts: int
    stop_reasons: dict[int, str]  # per k, why its split went no further (``SplitFloor.stop_reason``)

    def slim(self) -> "PartsSearch":
        """The same without the split graphs and problems (each holds its memoised analyses and recomputed
        graphs, a few hundred MB on ResNet-50): what a search at many batch sizes keeps of each."""
        return replace(self, splits={}, problems={})

    @property
    def chosen(self) -> Evaluation | None:
        return self.outcomes[self.parts].chosen

    @property
    def split(self) -> SplitFloor:
        return self.splits[self.parts]

    def with_more(self, parts: int, evaluations: list[Evaluation]) -> "PartsSearch":
        """The same with ``evaluations``, plans simulated on ``parts`` parts after the search, added."""
        old = self.outcomes[parts]
        outcomes = {**self.outcomes, parts: Outcome(
            old.evaluations + evaluations, best_of([e for e in (old.chosen, *evaluations) if e is not None]))}
        return replace(self, outcomes=outcomes, parts=_fastest_parts(outcomes, self.parts))

    def parts_of(self, evaluation: Evaluation) -> int:
        """The k whose split graph ``evaluation`` was simulated on (1: none of them)."""
        return next((k for k, outcome in self.outcomes.items() if any(e is evaluation for e in outcome.evaluations)), 1)

    def line(self) -> str:
        """Each k's fastest plan that fits, for a note: what the search traded."""
        found = [f"{k} parts: " + ("no plan fits" if outcome.chosen is None else
                                   f"{outcome.chosen.step_s:.4g} s, overhead {outcome.chosen.metrics['overhead']:.1%}")
                 for k, outcome in self.outcomes.items()]
        return f"the number of parts searched with the plan: {'; '.join(found)}; chosen: {self.parts} parts"


def search_parts(splits: list[SplitFloor], problem_for: Callable[[OpGraph], TuningProblem], policy: SearchPolicy,
                 budget: Budget, shared: bool = True,
                 candidates: Callable[[int], Sequence[SwapParams]] = lambda parts: ()) -> PartsSearch:
    """Search the plan on each split of ``splits`` (``parts_to_search``), each with ``budget`` (``shared``
    budget: an equal share of its trials and time each), and keep the k of the fastest plan that fits over
    all of them. ``problem_for(split graph)``: the problem there (its overheads against the step as
    captured, ``TuningProblem.captured``); each k's trials go to a study of its own, in memory.
    ``candidates(k)``: plans evaluated on k parts beside the search's (``with_candidates``)."""
    share = len(splits) if shared else 1
    each = replace(budget, trials=None if budget.trials is None else max(1, budget.trials // share),
                   timeout_s=None if budget.timeout_s is None else budget.timeout_s / share)
    outcomes, problems = {}, {}
    for split in splits:
        problem = problem_for(split.split_graph)
        outcomes[split.parts] = with_candidates(policy.search(problem, optuna.create_study(direction="minimize"), each),
                                                problem, candidates(split.parts))
        problems[split.parts] = problem
    return PartsSearch(splits={split.parts: split for split in splits}, outcomes=outcomes, problems=problems,
                       parts=_fastest_parts(outcomes, splits[0].parts),
                       stop_reasons={split.parts: split.stop_reason for split in splits})


def _fastest_parts(outcomes: dict[int, Outcome], none_fits: int) -> int:
    """The k of the fastest plan that fits over ``outcomes`` (``none_fits`` when none does)."""
    best = best_of([outcome.chosen for outcome in outcomes.values() if outcome.chosen is not None])
    return none_fits if best is None else next(k for k, outcome in outcomes.items() if outcome.chosen is best)
