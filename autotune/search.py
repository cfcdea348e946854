"""The tuning problem: a search space over swap parameters and the simulator as objective.

Every policy (policies.py) searches the same ``SearchSpace`` and is judged by the same
``TuningProblem.evaluate``: simulated step time, subject to predicted peak <= budget and host
memory <= the host limit. Trials are recorded in an Optuna study whatever the policy, so
storage, resuming and Optuna's plots work the same for all of them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import numpy as np
import optuna

from simulator import DeviceModel, OpGraph, SwapParams, SwapPlan, n_levels, plan_swaps, replay
from simulator.host_room import fit_host
from simulator.params import DISTANCES, SWAP_SCOPES, SYNC_MODES, TRIGGER_POLICIES
from simulator.replay import Replay

METRICS = ("peak_bytes", "step_s", "compute_s", "stall_s", "overhead", "d2h_bytes", "h2d_bytes", "host_peak_bytes",
           "n_swap_outs", "n_swap_ins")


@dataclass(frozen=True)
class SearchSpace:
    """A finite grid per parameter; ``ub`` is searched as ``lb + window``, so lb <= ub always.

    Optuna samples grid *indices* for the ordered parameters (so TPE sees their order) and the
    sync mode as a category; ``exhaustive`` walks the same grid, so optima are comparable.
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

    ORDERED = ("threshold", "lb", "window", "groupby", "min_bytes")
    CATEGORICAL = ("sync", "order", "tensors", "distance", "trigger", "after_copies_out")

    @classmethod
    def for_graph(cls, g: OpGraph, *, points: int = 40) -> "SearchSpace":
        """Thresholds spread geometrically over the graph's depth; trigger windows and groups in
        powers of two (the distances that matter are short ones)."""
        depth = max(n_levels(g) - 1, 2)
        thresholds = np.unique(np.round(np.geomspace(1, depth, points)).astype(int))
        lbs = np.unique(np.round(np.geomspace(1, max(2, min(256, depth // 4)), 12)).astype(int))
        return cls(
            threshold=tuple(int(t) for t in thresholds),
            lb=tuple(int(v) for v in lbs),
            window=(0, 1, 2, 4, 8, 16, 32, 64, 128),
            groupby=(0, 1, 2, 4, 8, 16, 32, 64),
        )

    def size(self) -> int:
        return math.prod(len(getattr(self, name)) for name in (*self.ORDERED, *self.CATEGORICAL))

    def params(self, choice: dict[str, Any]) -> SwapParams:
        """Grid indices (and a sync name) -> SwapParams."""
        lb = self.lb[choice["lb"]]
        return SwapParams(threshold=self.threshold[choice["threshold"]], lb=lb, ub=lb + self.window[choice["window"]],
                          groupby=self.groupby[choice["groupby"]], sync=choice["sync"],
                          min_bytes=self.min_bytes[choice["min_bytes"]], order=choice["order"],
                          # absent in studies made before they were searched
                          tensors=choice.get("tensors", "activations"), distance=choice.get("distance", "level"),
                          trigger=choice.get("trigger", "ancestor"),
                          after_copies_out=choice.get("after_copies_out", False))

    def choice(self, params: SwapParams) -> dict[str, Any] | None:
        """The grid point of ``params`` (None when they are off the grid). ``keep_tensors`` is not
        part of it: ``TuningProblem.evaluate`` derives it again from the grid point."""
        if any(getattr(params, name) not in getattr(self, name) for name in self.CATEGORICAL):
            return None
        try:
            return {"threshold": self.threshold.index(params.threshold), "lb": self.lb.index(params.lb),
                    "window": self.window.index(params.ub - params.lb), "groupby": self.groupby.index(params.groupby),
                    "min_bytes": self.min_bytes.index(params.min_bytes),
                    **{name: getattr(params, name) for name in self.CATEGORICAL}}
        except ValueError:
            return None

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        dists: dict[str, optuna.distributions.BaseDistribution] = {
            name: optuna.distributions.IntDistribution(0, len(getattr(self, name)) - 1) for name in self.ORDERED}
        for name in self.CATEGORICAL:
            dists[name] = optuna.distributions.CategoricalDistribution(getattr(self, name))
        return dists

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        choice = {name: trial.suggest_int(name, 0, len(getattr(self, name)) - 1) for name in self.ORDERED}
        for name in self.CATEGORICAL:
            choice[name] = trial.suggest_categorical(name, getattr(self, name))
        return choice

    def grid(self) -> Iterator[dict[str, Any]]:
        names = (*self.ORDERED, *self.CATEGORICAL)
        ranges = [range(len(getattr(self, name))) for name in self.ORDERED] + [getattr(self, n) for n in self.CATEGORICAL]
        for values in itertools.product(*ranges):
            yield dict(zip(names, values))

    def to_dict(self) -> dict[str, list]:
        return {key: list(value) for key, value in asdict(self).items()}


@dataclass(frozen=True)
class Evaluation:
    """One simulated candidate: its parameters and what the replay predicted (no per-op arrays,
    so thousands can be kept)."""

    params: SwapParams | None
    metrics: dict[str, float]
    feasible: bool
    excess_bytes: int  # how far the peak is over the budget (<= 0 when it fits)

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
    """The graph at one batch size on one device with one memory budget."""

    graph: OpGraph
    device: DeviceModel
    budget_bytes: int
    host_limit_bytes: int | None = None
    space: SearchSpace | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.space is None:
            self.space = SearchSpace.for_graph(self.graph)
        if self.host_limit_bytes is None:
            self.host_limit_bytes = self.device.host_memory_bytes

    def plan(self, params: SwapParams | None) -> SwapPlan:
        if params is None:
            return SwapPlan.empty(self.graph)
        return plan_swaps(self.graph, params, kept_reads=self.device.kept_reads)

    def replay(self, params: SwapParams | None) -> Replay:
        return replay(self.graph, None if params is None else self.plan(params), self.device)

    def evaluate(self, params: SwapParams | None) -> Evaluation:
        """Simulate ``params`` (None: no swapping); results are memoised per parameter set. A plan
        that fits the device but overflows the host is evaluated as ``simulator.host_room.fit_host``
        mends it, when it can: the evaluation then carries the mended parameters (``keep_tensors``)."""
        if params in self._cache:
            return self._cache[params]
        plan = self.plan(params)
        result = replay(self.graph, plan, self.device)
        if (params is not None and result.host_peak_bytes > self.host_limit_bytes
                and result.peak_bytes <= self.budget_bytes):
            # fits the device but not the host: keep on the device what the host has no room for
            fit = fit_host(self.graph, params, self.device, self.budget_bytes, self.host_limit_bytes,
                           plan=plan, result=result)
            if fit is not None:
                evaluation = self._evaluation(fit.params, fit.result)
                self._cache[params] = self._cache[fit.params] = evaluation
                return evaluation
        evaluation = self._evaluation(params, result)
        self._cache[params] = evaluation
        return evaluation

    def _evaluation(self, params: SwapParams | None, result: Replay) -> Evaluation:
        metrics = {name: getattr(result, name) for name in METRICS}
        excess = int(result.peak_bytes - self.budget_bytes)
        feasible = excess <= 0 and result.host_peak_bytes <= self.host_limit_bytes
        return Evaluation(params, metrics, feasible, excess)

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


def closest_of(evaluations: list[Evaluation]) -> Evaluation | None:
    """When nothing fits: the candidate that misses the budget by the least."""
    return min(evaluations, key=lambda e: (e.excess_bytes, e.step_s)) if evaluations else None


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
    if trial.state != optuna.trial.TrialState.COMPLETE:
        return None
    if trial.params:
        return problem.evaluate(problem.space.params(trial.params))
    if "params" in trial.user_attrs:
        return problem.evaluate(SwapParams.from_dict(trial.user_attrs["params"]))
    return None


def add_evaluation(study: optuna.Study, evaluation: Evaluation, problem: TuningProblem) -> None:
    """Record a candidate found by a non-Optuna policy as a finished trial (off the grid: with its
    parameters as an attribute)."""
    choice = problem.space.choice(evaluation.params) if evaluation.params is not None else None
    user_attrs: dict = _user_attrs(evaluation)
    if choice is None and evaluation.params is not None:
        user_attrs["params"] = evaluation.params.to_dict()
    constraints = {f"constraints:{name}": value for name, value in constraint_values(evaluation, problem).items()}
    study.add_trial(optuna.trial.create_trial(
        params=choice or {}, distributions=problem.space.distributions() if choice else {},
        value=evaluation.step_s, user_attrs=user_attrs, system_attrs=constraints))
