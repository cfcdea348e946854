"""Searches at many batch sizes of one graph: the largest batch that fits with a plan (``SwapProbes``).

A probe at one batch is a search there; the probes are kept so that the questions asked of them (the
largest batch, the largest under an overhead cap, the same with no host limit) share the searches they have
in common. Where the step's floor is over the budget, or its plans are none or slow, a probe may search the step
split along the batch (``autotune.search.parts``), the number of parts with the plan. A probe also tries the
plans that were fastest at the batches probed nearest it: a search of a few hundred trials may miss, one batch
further, the plan its neighbour found.
"""

from __future__ import annotations

from dataclasses import replace

import optuna

from autotune.search.parts import SPLIT_WHEN_OVERHEAD_OVER, PartsSearch, parts_to_search, search_parts
from autotune.search.policies import Budget, make_policy, with_candidates
from autotune.search.off_grid import refine_off_grid
from autotune.search.space import (Evaluation, SearchSpace, TuningProblem, add_evaluation, best_of,
                                   evaluation_from_trial, fits_first)
from simulator import DeviceModel, OpGraph, SwapParams
from simulator.buffers import peak_lower_bound_bytes
from simulator.split import floor_after_splitting

MAX_BATCH = 1 << 16
HOST_UNLIMITED_BYTES = 1 << 62  # a host limit no plan reaches
NEAR_BEST = 3  # a probe also evaluates this many of the fastest plans of the nearest batches probed


def largest_batch(fits, start: int = 1) -> int:
    """The largest batch in start..MAX_BATCH for which ``fits`` holds, taken as monotone there (start - 1 when it
    does not hold at ``start``): steps doubling from ``start``, then a bisection."""
    if not fits(start):
        return start - 1
    base = start - 1  # from 1, the steps double the batch
    low, high = start, start + 1
    while high <= MAX_BATCH and fits(high):
        low, high = high, base + 2 * (high - base)
    high = min(high, MAX_BATCH + 1)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


class SwapProbes:
    """Swap searches at each batch size of one graph, kept so that several questions about it
    (the largest batch, the largest under an overhead cap) share the searches they have in common:
    a probe's search does not depend on the question, only which of its plans count does. Beside its
    search's plans a probe evaluates the best of the batches probed nearest it (``near_best``)."""

    def __init__(self, graph: OpGraph, budget_bytes: int, device: DeviceModel, *, probe_trials: int = 80,
                 seed: int | None = 0, recompute: bool = False, split: bool = False,
                 parts_doublings: int = 0) -> None:
        self.graph, self.budget_bytes, self.device = graph, budget_bytes, device
        self.probe_trials, self.seed, self.recompute = probe_trials, seed, recompute
        # ``split``: where no plan of the step as captured can fit (its floor is over the budget) or its search
        # found none or only slow ones (``SPLIT_WHEN_OVERHEAD_OVER``), the step split along the batch is searched,
        # in the fewest parts whose floor fits and ``parts_doublings`` doublings of them (``autotune.search.parts``),
        # each k with the probe's trials;
        # what each batch's parts search found is kept in ``parts_at`` (without its graphs: ``PartsSearch.slim``)
        self.split, self.parts_doublings = split, parts_doublings
        self.parts_at: dict[int, PartsSearch] = {}
        # batch -> every plan the search evaluated there; None: the step fits without swapping,
        # [] when no plan can fit: not even its resident memory and its largest op's working set
        # (``peak_lower_bound_bytes``, which no swap or recomputation lowers: a clone's inputs and
        # outputs are its original's), so the search there is not run
        self.evaluations_at: dict[int, list[Evaluation] | None] = {}
        # (batch, parts) -> the plans ``revisit`` started from there
        self.revisited_from: dict[tuple[int, int], set[SwapParams]] = {}

    def at(self, batch: int) -> list[Evaluation] | None:
        if batch not in self.evaluations_at:
            problem = self._problem(batch, 1)
            graph = problem.graph
            if problem.resident_bytes > self.budget_bytes:
                found = []
            elif peak_lower_bound_bytes(graph) > self.budget_bytes:
                found = self._split_at(graph) if self.split else []
            elif problem.baseline().feasible:
                found = None
            else:
                study = optuna.create_study(direction="minimize")
                found = with_candidates(make_policy("optuna", seed=self.seed).search(
                    problem, study, Budget(trials=self.probe_trials)), problem, self.near_best(batch, 1)).evaluations
                # more, smaller parts may leave room for a plan, or for a faster one (as ``autotune.tune`` does)
                best = best_of([e for e in found if e.feasible])
                if self.split and (best is None or best.metrics["overhead"] > SPLIT_WHEN_OVERHEAD_OVER):
                    found = found + self._split_at(graph)
            self.evaluations_at[batch] = found
        return self.evaluations_at[batch]

    def _split_at(self, graph: OpGraph) -> list[Evaluation]:
        """The plans the parts search finds on ``graph`` split along the batch (none: no split fits)."""
        splits = parts_to_search(graph, self.budget_bytes, self.parts_doublings)
        if not splits:
            return []
        found = search_parts(splits, lambda split: TuningProblem(
            split, self.device, self.budget_bytes, space=SearchSpace.for_graph(split, recompute=self.recompute),
            captured=graph), make_policy("optuna", seed=self.seed), Budget(trials=self.probe_trials), shared=False,
            candidates=lambda parts: self.near_best(graph.batch_size, parts))
        self.parts_at[graph.batch_size] = found.slim()  # the graphs of every k at every batch ran out of memory
        return [e for outcome in found.outcomes.values() for e in outcome.evaluations]

    def near_best(self, batch: int, parts: int) -> list[SwapParams]:
        """The fastest plans (``NEAR_BEST`` of each) on ``parts`` parts (1: the step whole) at the nearest batches
        probed below and above ``batch`` that have any: a probe evaluates them beside its search's. Plans tuned one
        batch apart stay close to the best (ResNet-50 with elide-broadcasts in 4 parts on v100-16gb: the best
        plan at 1031, 19.3 %, fits at 1071 at the same overhead, where a search of 200 trials found 31 %)."""
        near = []
        for side in (sorted((b for b in self.evaluations_at if b < batch), reverse=True),
                     sorted(b for b in self.evaluations_at if b > batch)):
            for other in side:
                fit = sorted((e for e in self._plans_on(other, parts) if e.feasible and e.params is not None),
                             key=lambda e: e.step_s)
                if fit:
                    near += [e.params for e in fit[:NEAR_BEST]]
                    break
        return near

    def _plans_on(self, batch: int, parts: int) -> list[Evaluation]:
        """The plans probed at ``batch`` on ``parts`` parts (1: the step whole)."""
        found = self.parts_at.get(batch)
        if parts > 1:
            return list(found.outcomes[parts].evaluations) if found and parts in found.outcomes else []
        split = {id(e) for outcome in found.outcomes.values() for e in outcome.evaluations} if found else set()
        return [e for e in self.evaluations_at[batch] or () if id(e) not in split]

    def parts_of(self, batch: int, evaluation: Evaluation) -> int:
        """The parts of the split ``evaluation`` was simulated on at ``batch`` (1: the step as captured)."""
        found = self.parts_at.get(batch)
        return 1 if found is None else found.parts_of(evaluation)

    def problem_of(self, batch: int, evaluation: Evaluation) -> TuningProblem:
        """The problem ``evaluation`` belongs to at ``batch``: on the split graph of its parts, or the step's."""
        return self._problem(batch, self.parts_of(batch, evaluation))

    def _problem(self, batch: int, parts: int) -> TuningProblem:
        """The problem at ``batch`` on ``parts`` parts (1: the step whole), made again: the probes do not keep it."""
        graph = self.graph.with_batch(batch)
        searched = graph if parts == 1 else floor_after_splitting(graph, parts).split_graph
        return TuningProblem(searched, self.device, self.budget_bytes,
                             space=SearchSpace.for_graph(searched, recompute=self.recompute),
                             captured=None if parts == 1 else graph)

    def revisit(self, batch: int) -> None:
        """Evaluate at the probed ``batch`` the nearest batches' best plans (``near_best``) and refine the first
        ``OFF_GRID_STARTS`` of them off the grid with the probe's trials (``refine_off_grid``, a plan that misses
        climbing towards one that fits), once per plan: a bisection probes a batch before the ones beside it
        (ResNet-50 with elide-broadcasts in 4 parts on v100-16gb: 1032 from 1024's plans, 31 %, before 1031 found
        one of 19.3 % that fits at 1038), and a plan that fits one batch may miss the next by a few recomputations
        (as captured in 8 parts: 15.7 % at 1033, 1.3 GB over at 1034)."""
        found = self.evaluations_at.get(batch)
        if not found:  # not probed, no plan needed, or none can fit
            return
        split = self.parts_at.get(batch)
        searched = ([1] if self._plans_on(batch, 1) else []) + (list(split.outcomes) if split else [])
        for parts in searched:
            done = self.revisited_from.setdefault((batch, parts), set())
            starts = [params for params in dict.fromkeys(self.near_best(batch, parts)) if params not in done]
            if not starts:
                continue
            done.update(starts)
            problem = self._problem(batch, parts)
            study = optuna.create_study(direction="minimize")
            for params in starts:
                add_evaluation(study, problem.evaluate(params), problem, asked=params)
            refine_off_grid(problem, study, self.probe_trials, None,
                            starts=sorted(starts, key=lambda params: fits_first(problem.evaluate(params))))
            tried = {e.params for e in self._plans_on(batch, parts)}
            refined = [evaluation_from_trial(trial, problem) for trial in study.trials]
            more = [e for e in refined if e.params not in tried]
            self.evaluations_at[batch] = self.evaluations_at[batch] + more
            if parts > 1:
                self.parts_at[batch] = self.parts_at[batch].with_more(parts, more)

    def good_at(self, batch: int, max_overhead: float | None = None) -> list[Evaluation] | None:
        """The plans that fit at ``batch`` (None: no plan needed)."""
        found = self.at(batch)
        if found is None:
            return None
        return [e for e in found if e.feasible and (max_overhead is None or e.metrics["overhead"] <= max_overhead)]

    def largest(self, max_overhead: float | None = None) -> tuple[int, list[Evaluation]]:
        """As :func:`largest_batch_with_swap`; then, while the batch after the answer fits with the plans found
        since it was probed (``revisit``), on from there."""
        def fits(batch: int) -> bool:
            good = self.good_at(batch, max_overhead)
            return good is None or bool(good)

        batch = largest_batch(fits)
        while 0 < batch < MAX_BATCH:
            self.revisit(batch + 1)
            if not fits(batch + 1):
                break
            batch = largest_batch(fits, start=batch + 1)
        return batch, (self.good_at(batch, max_overhead) or []) if batch else []

    def host_unlimited(self) -> SwapProbes:
        """The same probes with no limit on host memory. A search where no plan went over the host
        limit, nor was mended to fit it (``keep_tensors``), runs the same way without it (samplers
        see only violated constraints), so those probes carry over; the others are searched again
        when asked; so are the revisits of the probes carried over."""
        device = replace(self.device, host_memory_bytes=HOST_UNLIMITED_BYTES)
        other = SwapProbes(self.graph, self.budget_bytes, device, probe_trials=self.probe_trials, seed=self.seed,
                           recompute=self.recompute, split=self.split, parts_doublings=self.parts_doublings)
        limit = self.device.host_memory_bytes
        for batch, found in self.evaluations_at.items():
            if found is None or all(e.metrics["host_peak_bytes"] <= limit and not (e.params and e.params.keep_tensors)
                                    for e in found):
                other.evaluations_at[batch] = found
                if batch in self.parts_at:
                    other.parts_at[batch] = self.parts_at[batch]
        # what a carried batch was revisited from is in its plans already (the refinement ran under the limit too)
        other.revisited_from = {key: set(starts) for key, starts in self.revisited_from.items()
                                if key[0] in other.evaluations_at}
        return other


def largest_batch_with_swap(graph: OpGraph, budget_bytes: int, device: DeviceModel, *, max_overhead: float | None,
                            probe_trials: int = 80, seed: int | None = 0,
                            recompute: bool = False) -> tuple[int, list[Evaluation]]:
    """The largest batch for which the search finds a plan that fits (and, if given, whose
    simulated overhead stays under ``max_overhead``), and the plans that did there (none when the
    step fits without swapping)."""
    return SwapProbes(graph, budget_bytes, device, probe_trials=probe_trials, seed=seed,
                      recompute=recompute).largest(max_overhead)
