"""The tuning problem: a search space over swap parameters and the simulator as objective.

Every policy (policies.py) searches the same ``SearchSpace`` and is judged by the same
``TuningProblem.evaluate``: simulated step time, subject to predicted peak <= budget and host
memory <= the host limit. Trials are recorded in an Optuna study whatever the policy, so
storage, resuming and Optuna's plots work the same for all of them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator

import numpy as np
import optuna

from simulator import DeviceModel, OpGraph, SwapParams, SwapPlan, n_levels, plan_swaps, replay
from simulator.host_room import fit_host
from simulator.ordering import orders_of
from simulator.params import DISTANCES, SWAP_SCOPES, SYNC_MODES, TRIGGER_POLICIES
from simulator.recompute.actions import Recompute
from simulator.recompute.choice import recomputed_graph, stalled_recomputes
from simulator.replay import Replay
from simulator.state import moved_bytes

METRICS = ("peak_bytes", "step_s", "compute_s", "stall_s", "overhead", "d2h_bytes", "h2d_bytes", "host_peak_bytes",
           "n_swap_outs", "n_swap_ins")
# TuningProblem's per-tensor pass: rounds of it (each makes a new graph), only where it should save
# at least this share of the compute
PER_TENSOR_PASSES = 2
PER_TENSOR_MIN_STALL = 0.02


# the recompute knobs a search with recomputation varies (``SwapParams.recompute*``): op classes and
# seconds per byte freed (on the v100-16gb preset a chain of elementwise ops costs 3e-12 to 2e-11 s/B,
# a convolution's output up to 3e-10 and more when recomputed twice; an unhidden swap out and back
# over PCIe 3 costs 1.6e-10; ResNet-50 at batch 692: 1e-11 frees 30 % of the unswapped peak for
# 3 % more compute, 4e-11 68 % for 17 %, 1e-10 75 % for 31 %)
RECOMPUTE_SCOPES = ("none", "cheap", "expensive")
RECOMPUTE_COSTS = (1e-11, 1.5e-11, 2e-11, 3e-11, 4e-11, 5e-11, 7e-11, 1e-10, 2e-10, math.inf)


GROUPBY_LEVELS = (0, 1, 2, 4, 8, 16, 32, 64)  # the groups of a graph under 256 levels deep


def groupby_levels(depth: int) -> tuple[int, ...]:
    """Swap-in groups searched on a graph ``depth`` levels deep: ``GROUPBY_LEVELS``, then powers of two up to
    half the depth. On a deep graph far consumers are far apart: ResNet-50 in 4 parts (2,400 levels) at
    batch 1038 on v100-16gb, with groups up to 1024 levels 200 trials find a plan of 28 %, 38 % up to 64."""
    more = tuple(1 << power for power in range(7, max(7, (depth // 2).bit_length())))
    return GROUPBY_LEVELS + more


@dataclass(frozen=True)
class SearchSpace:
    """A finite grid per parameter; ``ub`` is searched as ``lb + window``, so lb <= ub always.

    Optuna samples grid *indices* for the ordered parameters (so TPE sees their order) and the
    sync mode as a category; ``exhaustive`` walks the same grid, so optima are comparable. The
    recompute parameters take part only in a space that varies them (``recomputes``); a swap-only
    space is the one searched before recomputation existed, so its studies resume.
    """

    threshold: tuple[int, ...]
    lb: tuple[int, ...]
    window: tuple[int, ...]
    groupby: tuple[int, ...]
    sync: tuple[str, ...] = SYNC_MODES
    min_bytes: tuple[int, ...] = (4096, 1 << 20, 16 << 20)
    order: tuple[str, ...] = ("cto", "memory")
    tensors: tuple[str, ...] = SWAP_SCOPES
    distance: tuple[str, ...] = DISTANCES
    trigger: tuple[str, ...] = TRIGGER_POLICIES
    after_copies_out: tuple[bool, ...] = (False, True)
    recompute: tuple[str, ...] = ("none",)
    recompute_cost: tuple[float, ...] = (math.inf,)
    recompute_per_tensor: tuple[bool, ...] = (False,)

    SWAP_ORDERED = ("threshold", "lb", "window", "groupby", "min_bytes")
    SWAP_CATEGORICAL = ("sync", "order", "tensors", "distance", "trigger", "after_copies_out")
    RECOMPUTE_ORDERED = ("recompute_cost",)
    RECOMPUTE_CATEGORICAL = ("recompute", "recompute_per_tensor")

    @classmethod
    def for_graph(cls, g: OpGraph, *, points: int = 40, recompute: bool = False) -> "SearchSpace":
        """Thresholds spread geometrically over the graph's depth; trigger windows and groups in
        powers of two (the distances that matter are short ones), groups up to half the depth on deep
        graphs (``groupby_levels``). ``recompute``: recomputation beside swapping (``RECOMPUTE_SCOPES``,
        ``RECOMPUTE_COSTS``, the stall pass)."""
        depth = max(n_levels(g) - 1, 2)
        thresholds = np.unique(np.round(np.geomspace(1, depth, points)).astype(int))
        lbs = np.unique(np.round(np.geomspace(1, max(2, min(256, depth // 4)), 12)).astype(int))
        more = dict(recompute=RECOMPUTE_SCOPES, recompute_cost=RECOMPUTE_COSTS, recompute_per_tensor=(False, True)
                    ) if recompute else {}
        return cls(
            threshold=tuple(int(t) for t in thresholds),
            lb=tuple(int(v) for v in lbs),
            window=(0, 1, 2, 4, 8, 16, 32, 64, 128),
            groupby=groupby_levels(depth),
            order=orders_of(g),
            **more,
        )

    @property
    def recomputes(self) -> bool:
        """Whether the space varies recomputation (else every point swaps only)."""
        return self.recompute != ("none",) or any(
            len(getattr(self, name)) > 1 for name in (*self.RECOMPUTE_ORDERED, *self.RECOMPUTE_CATEGORICAL))

    def swap_only(self) -> "SearchSpace":
        """This space without recomputation."""
        return replace(self, recompute=("none",), recompute_cost=(math.inf,), recompute_per_tensor=(False,))

    @property
    def ordered(self) -> tuple[str, ...]:
        """Parameters searched as grid indices."""
        return self.SWAP_ORDERED + (self.RECOMPUTE_ORDERED if self.recomputes else ())

    @property
    def categorical(self) -> tuple[str, ...]:
        """Parameters searched as categories."""
        return self.SWAP_CATEGORICAL + (self.RECOMPUTE_CATEGORICAL if self.recomputes else ())

    def recompute_corners(self) -> list[dict[str, Any]]:
        """Starting points for the recompute parameters (grid choices): none, and the most (the last
        class, the last finite cost: recomputing whatever it costs clones long chains again and
        again, whose outputs then take more memory than they free); one empty choice in a space
        that does not vary them."""
        if not self.recomputes:
            return [{}]
        finite = [k for k, cost in enumerate(self.recompute_cost) if math.isfinite(cost)]
        least = {"recompute": self.recompute[0], "recompute_cost": 0, "recompute_per_tensor": self.recompute_per_tensor[0]}
        most = {"recompute": self.recompute[-1], "recompute_cost": finite[-1] if finite else len(self.recompute_cost) - 1,
                "recompute_per_tensor": self.recompute_per_tensor[0]}
        return [least, most] if most != least else [least]

    def size(self) -> int:
        return math.prod(len(getattr(self, name)) for name in (*self.ordered, *self.categorical))

    def params(self, choice: dict[str, Any]) -> SwapParams:
        """Grid indices (and a sync name) -> SwapParams."""
        lb = self.lb[choice["lb"]]
        return SwapParams(threshold=self.threshold[choice["threshold"]], lb=lb, ub=lb + self.window[choice["window"]],
                          groupby=self.groupby[choice["groupby"]], sync=choice["sync"],
                          min_bytes=self.min_bytes[choice["min_bytes"]], order=choice["order"],
                          # absent in studies made before they were searched
                          tensors=choice.get("tensors", "activations"), distance=choice.get("distance", "level"),
                          trigger=choice.get("trigger", "ancestor"),
                          after_copies_out=choice.get("after_copies_out", False),
                          recompute=choice.get("recompute", self.recompute[0]),
                          recompute_cost=self.recompute_cost[choice.get("recompute_cost", 0)],
                          recompute_per_tensor=choice.get("recompute_per_tensor", self.recompute_per_tensor[0]))

    def choice(self, params: SwapParams) -> dict[str, Any] | None:
        """The grid point of ``params`` (None when they are off the grid). ``keep_tensors`` and
        ``recompute_tensors`` are not part of it: ``TuningProblem.evaluate`` derives them again from
        the grid point."""
        categorical = self.SWAP_CATEGORICAL + self.RECOMPUTE_CATEGORICAL
        if any(getattr(params, name) not in getattr(self, name) for name in categorical):
            return None
        try:
            found = {"threshold": self.threshold.index(params.threshold), "lb": self.lb.index(params.lb),
                     "window": self.window.index(params.ub - params.lb), "groupby": self.groupby.index(params.groupby),
                     "min_bytes": self.min_bytes.index(params.min_bytes),
                     "recompute_cost": self.recompute_cost.index(params.recompute_cost),
                     **{name: getattr(params, name) for name in categorical}}
        except ValueError:
            return None
        return {name: found[name] for name in (*self.ordered, *self.categorical)}

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        dists: dict[str, optuna.distributions.BaseDistribution] = {
            name: optuna.distributions.IntDistribution(0, len(getattr(self, name)) - 1) for name in self.ordered}
        for name in self.categorical:
            dists[name] = optuna.distributions.CategoricalDistribution(getattr(self, name))
        return dists

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        choice = {name: trial.suggest_int(name, 0, len(getattr(self, name)) - 1) for name in self.ordered}
        for name in self.categorical:
            choice[name] = trial.suggest_categorical(name, getattr(self, name))
        return choice

    def grid(self) -> Iterator[dict[str, Any]]:
        names = (*self.ordered, *self.categorical)
        ranges = [range(len(getattr(self, name))) for name in self.ordered] + [getattr(self, n) for n in self.categorical]
        for values in itertools.product(*ranges):
            yield dict(zip(names, values))

    def to_dict(self) -> dict[str, list]:
        data = {key: list(value) for key, value in asdict(self).items()}
        if not self.recomputes:  # as before recomputation existed: its studies resume
            for name in (*self.RECOMPUTE_ORDERED, *self.RECOMPUTE_CATEGORICAL):
                del data[name]
        else:  # JSON has no infinity
            data["recompute_cost"] = [None if math.isinf(v) else v for v in self.recompute_cost]
        return data


@dataclass(frozen=True)
class Evaluation:
    """One simulated candidate: its parameters and what the replay predicted (no per-op arrays,
    so thousands can be kept)."""

    params: SwapParams | None
    metrics: dict[str, float]
    feasible: bool
    excess_bytes: int  # how far the peak is over the budget (<= 0 when it fits)
    host_excess_bytes: int = 0  # how far the host peak is over the host limit (<= 0 when it fits)

    @property
    def miss_bytes(self) -> int:
        """How far it misses the device budget or the host limit, whichever it misses by more."""
        return max(self.excess_bytes, self.host_excess_bytes)

    @property
    def step_s(self) -> float:
        return float(self.metrics["step_s"])

    @property
    def peak_bytes(self) -> int:
        return int(self.metrics["peak_bytes"])

    def row(self) -> dict[str, Any]:
        params = self.params.to_dict() if self.params else {"threshold": None}
        flat = {k: v for k, v in params.items() if not isinstance(v, list)}
        return {**flat, **self.metrics, "feasible": self.feasible, "excess_bytes": self.excess_bytes}


@dataclass
class TuningProblem:
    """The graph at one batch size on one device with one memory budget; ``host_limit_bytes``: what the plan's
    copies on the host may take, by default the device's host memory less the optimizer state moved there."""

    graph: OpGraph
    device: DeviceModel
    budget_bytes: int
    host_limit_bytes: int | None = None
    space: SearchSpace | None = None
    # optimizer slots on the host (simulator.state): ``graph`` is the step with them moved, and every plan
    # carries them, so its replay counts their copies
    host_state: tuple = ()
    # the step as captured when ``graph`` is it split along the batch (simulator.split): overheads are against
    # its compute, so the parts' own cost counts (smaller kernels) and plans on different splits compare
    captured: OpGraph | None = None
    _cache: dict = field(default_factory=dict, repr=False)
    _plain_compute_s: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.space is None:
            self.space = SearchSpace.for_graph(self.graph)
        if self.host_limit_bytes is None:  # the host holds the state moved there beside what the plan swaps
            self.host_limit_bytes = max(0, self.device.host_memory_bytes - moved_bytes(self.graph, self.host_state))

    def graph_for(self, params: SwapParams | None) -> OpGraph:
        """The graph the plan of ``params`` is made on: the step with the recomputations they choose
        (``simulator.recompute.choice``), the step itself when they recompute nothing."""
        if params is None or not params.recomputes:
            return self.graph
        return recomputed_graph(self.graph, params, self.device)[0]

    def recomputes(self, params: SwapParams | None) -> list[Recompute]:
        """The recomputations of ``params``' plan, as actions (in the order their clones are named)."""
        if params is None or not params.recomputes:
            return []
        return recomputed_graph(self.graph, params, self.device)[1]

    def plan(self, params: SwapParams | None) -> SwapPlan:
        if params is None:
            return self._with_state(SwapPlan.empty(self.graph))
        return self._with_state(plan_swaps(self.graph_for(params), params, kept_reads=self.device.kept_reads))

    def _with_state(self, plan: SwapPlan) -> SwapPlan:
        return replace(plan, host_state=self.host_state) if self.host_state else plan

    def replay(self, params: SwapParams | None) -> Replay:
        return replay(self.graph_for(params), None if params is None else self.plan(params), self.device)

    def evaluate(self, params: SwapParams | None) -> Evaluation:
        """Simulate ``params`` (None: no swapping); results are memoised per parameter set.

        Parameters asking for it (``recompute_per_tensor``) first recompute, instead of swapping,
        the tensors whose swap-ins the step waits for, where that is cheaper than the wait
        (``simulator.recompute.choice.stalled_recomputes``; a few passes, kept while they help). A
        plan that fits the device but overflows the host is then evaluated as
        ``simulator.host_room.fit_host`` mends it, when it can. The evaluation carries the mended
        parameters (``recompute_tensors``, ``keep_tensors``)."""
        if params in self._cache:
            return self._cache[params]
        asked = params
        graph = self.graph_for(params)
        plan = self.plan(params)
        result = replay(graph, plan, self.device)
        if params is not None and params.recompute_per_tensor:
            params, graph, plan, result = self._recompute_per_tensor(params, graph, plan, result)
        if (params is not None and result.host_peak_bytes > self.host_limit_bytes
                and result.peak_bytes <= self.budget_bytes):
            # fits the device but not the host: keep on the device what the host has no room for
            fit = fit_host(graph, params, self.device, self.budget_bytes, self.host_limit_bytes,
                           plan=plan, result=result)
            if fit is not None:
                params, result = fit.params, fit.result
        evaluation = self._evaluation(params, result)
        self._cache[asked] = self._cache[params] = evaluation
        return evaluation

    def _recompute_per_tensor(self, params: SwapParams, graph: OpGraph, plan: SwapPlan, result: Replay,
                              passes: int = PER_TENSOR_PASSES) -> tuple[SwapParams, OpGraph, SwapPlan, Replay]:
        """``params`` with the tensors the per-tensor pass recomputes: while the step waits for
        swap-ins, tensors cheaper to recompute than the wait, where that should save
        ``PER_TENSOR_MIN_STALL`` of the compute at least (kept when the step gets faster and still
        fits: a new graph to simulate each time)."""
        for _ in range(passes):
            if result.stall_s < PER_TENSOR_MIN_STALL * self.plain_compute_s:
                break
            more, saved_s = stalled_recomputes(self.graph, self.device, params, graph, plan, result)
            if not more or saved_s < PER_TENSOR_MIN_STALL * self.plain_compute_s:
                break
            trial = self._with_recomputed(params, more)
            if trial[3].step_s >= result.step_s or trial[3].peak_bytes > max(result.peak_bytes, self.budget_bytes):
                break
            params, graph, plan, result = trial
        return params, graph, plan, result

    def _with_recomputed(self, params: SwapParams, tensors: tuple[str, ...]
                         ) -> tuple[SwapParams, OpGraph, SwapPlan, Replay]:
        more = replace(params, recompute_tensors=params.recompute_tensors + tensors)
        graph = self.graph_for(more)
        plan = self._with_state(plan_swaps(graph, more, kept_reads=self.device.kept_reads))
        return more, graph, plan, replay(graph, plan, self.device)

    def _evaluation(self, params: SwapParams | None, result: Replay) -> Evaluation:
        """The metrics of ``result``, with times against the step as captured: ``compute_s`` is its
        compute, ``recompute_s`` what the plan's clones add, ``overhead`` the slow-down over it."""
        metrics = {name: getattr(result, name) for name in METRICS}
        plain = self.plain_compute_s
        metrics["recompute_s"] = max(0.0, result.compute_s - plain)
        metrics["compute_s"] = plain
        metrics["overhead"] = result.step_s / plain - 1.0 if plain > 0 else 0.0
        excess = int(result.peak_bytes - self.budget_bytes)
        host_excess = int(result.host_peak_bytes - self.host_limit_bytes)
        return Evaluation(params, metrics, excess <= 0 and host_excess <= 0, excess, host_excess)

    @property
    def plain_compute_s(self) -> float:
        """The compute time of the step as captured (no clones, no waits, no split)."""
        if self._plain_compute_s is None:
            self._plain_compute_s = replay(self.captured or self.graph, None, self.device).compute_s
        return self._plain_compute_s

    def simulated(self, params: SwapParams | None) -> bool:
        """Whether ``evaluate(params)`` has run already (it would cost nothing now)."""
        return params in self._cache

    def baseline(self) -> Evaluation:
        return self.evaluate(None)

    @property
    def resident_bytes(self) -> int:
        return self.graph.persistent_bytes


def best_of(evaluations: list[Evaluation]) -> Evaluation | None:
    """The fastest feasible candidate; among equally fast ones, the one moving the fewest bytes
    (less host memory, less link traffic). None when nothing fits."""
    feasible = [e for e in evaluations if e.feasible]
    if not feasible:
        return None
    fastest = min(e.step_s for e in feasible)
    ties = [e for e in feasible if e.step_s <= fastest * (1 + 1e-9)]
    return min(ties, key=lambda e: (e.metrics["d2h_bytes"], e.peak_bytes))


def fits_first(evaluation: Evaluation) -> tuple[int, float]:
    """A rank of plans: those that fit first, fastest first (seconds); then those that miss, by how much they miss
    the device budget or the host limit (bytes): a plan with room on the device but over the host limit is not
    nearer to fitting than one a little over the device budget."""
    return (0, evaluation.step_s) if evaluation.feasible else (1, evaluation.miss_bytes)


def closest_of(evaluations: list[Evaluation]) -> Evaluation | None:
    """When nothing fits: the candidate that misses by the least, the device budget or the host limit
    (``fits_first``'s rank of misses); among equal misses, the fastest."""
    return min(evaluations, key=lambda e: (e.miss_bytes, e.step_s)) if evaluations else None


# ---------------------------------------------------------------------- Optuna bookkeeping


def _user_attrs(evaluation: Evaluation) -> dict[str, float | bool]:
    """What a candidate predicted, as a trial's user attributes."""
    return {**{name: float(value) for name, value in evaluation.metrics.items()}, "feasible": bool(evaluation.feasible)}


def record_trial_attrs(trial: optuna.Trial, evaluation: Evaluation, problem: TuningProblem) -> None:
    """What a trial predicted, and the budget as Optuna constraints (<= 0 means satisfied, in GiB)."""
    for name, value in _user_attrs(evaluation).items():
        trial.set_user_attr(name, value)
    for name, value in constraint_values(evaluation, problem).items():
        trial.set_constraint(name, value)


def constraint_values(evaluation: Evaluation, problem: TuningProblem) -> dict[str, float]:
    return {"device_memory": float(evaluation.excess_bytes) / 2**30,
            "host_memory": float(evaluation.metrics["host_peak_bytes"] - problem.host_limit_bytes) / 2**30}


def evaluation_from_trial(trial: optuna.trial.FrozenTrial, problem: TuningProblem) -> Evaluation | None:
    """The candidate a finished trial stands for: its grid point, or (a candidate off the grid,
    e.g. found by the tflms-v2 search) the parameters stored with it."""
    params = trial_params(trial, problem)
    return None if params is None else problem.evaluate(params)


def trial_params(trial: optuna.trial.FrozenTrial, problem: TuningProblem) -> SwapParams | None:
    """The parameters a finished trial asked for (before ``TuningProblem.evaluate`` mends them)."""
    if trial.state != optuna.trial.TrialState.COMPLETE:
        return None
    if trial.params:
        return problem.space.params(trial.params)
    if "params" in trial.user_attrs:
        return SwapParams.from_dict(trial.user_attrs["params"])
    return None


def add_evaluation(study: optuna.Study, evaluation: Evaluation, problem: TuningProblem,
                   asked: SwapParams | None = None) -> None:
    """Record a candidate found by a non-Optuna policy as a finished trial (off the grid: with its
    parameters as an attribute). ``asked``: the parameters evaluated, when the evaluation carries
    mended ones (``TuningProblem.evaluate``), so that a resumed study evaluates the same again; asked
    parameters that name tensors themselves (a plan carried from another batch) are off the grid, as their
    grid point would derive other tensors."""
    params = asked if asked is not None else evaluation.params
    choice = problem.space.choice(params) if params is not None else None
    if asked is not None and (asked.keep_tensors or asked.recompute_tensors):
        choice = None
    user_attrs: dict = _user_attrs(evaluation)
    if choice is None and params is not None:
        user_attrs["params"] = params.to_dict()
    constraints = {f"constraints:{name}": value for name, value in constraint_values(evaluation, problem).items()}
    study.add_trial(optuna.trial.create_trial(
        params=choice or {}, distributions=problem.space.distributions() if choice else {},
        value=evaluation.step_s, user_attrs=user_attrs, system_attrs=constraints))
