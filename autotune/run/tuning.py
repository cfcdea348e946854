"""The tuning run: pick a budget, search swap parameters by simulation, check the winner for real.

``tune_graph`` works on a captured OpGraph and never needs TensorFlow (benchmarks use it);
``autotune.run.confirm.tune`` captures a Keras model first and, unless told not to, applies the winning
plan to the real training step and measures it until a measured run confirms it (``autotune.run.verdict``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import optuna

from autotune.inputs import format_bytes
from autotune.run.options import SearchOptions
from autotune.run.probes import (HOST_UNLIMITED_BYTES, MAX_BATCH, SwapProbes, largest_batch,  # noqa: F401 -- re-exported
                                  largest_batch_with_swap)
from autotune.search.policies import Budget, make_policy
from autotune.search.space import (GROUPBY_LEVELS, Evaluation, SearchSpace, TuningProblem, add_evaluation, best_of,
                                   closest_of)
from autotune.search.state_moves import search_state
from autotune.search.study_copy import in_memory, open_study
from autotune.run.verdict import SERIALIZED_STEP, Check, PeakCorrection, Verdict, actions_phrase, check_run, predicted
from autotune.run.target import DEFAULT_DEVICE, Target, resolve_device, resolve_target  # noqa: F401 -- DEFAULT_DEVICE, resolve_device: re-exported
from simulator import BACKWARD, CalibratedDevice, DeviceModel, NamedPlan, OpGraph, SwapPlan, replay
from simulator.buffers import largest_working_set_op, peak_lower_bound_bytes
from simulator.recompute.actions import Recompute, clone_name
from simulator.replay import Replay, op_seconds
from simulator.split import split_parts
from simulator.state import (HostState, host_working_set_bytes, moved_bytes, moved_kinds, with_host_state,
                              writes_after_reads)

log = logging.getLogger(__name__)



@dataclass
class MeasuredRun:
    """A measured run of the chosen plan (on a GPU, or on the CPU testbed at a smaller batch), with the
    prediction for the same batch beside it (``autotune.run.plan_run``; one measured step is a
    ``rewriter.Measurement``)."""

    measured_on: str
    batch_size: int
    peak_bytes: int
    step_s: float
    baseline_peak_bytes: int | None
    baseline_step_s: float | None
    predicted_peak_bytes: int
    predicted_step_s: float
    predicted_baseline_peak_bytes: int
    allocator_peak_bytes: int | None = None
    note: str = ""
    swaps_survived: int | None = None
    swaps_planned: int | None = None
    # the plan's recomputations in the optimized graph that ran (rewriter.check.recompute_check): clones still
    # running (or fused with their original) of those planned, and what Grappler undid
    clones_survived: int | None = None
    clones_planned: int | None = None
    recompute_problems: list[str] = field(default_factory=list)
    # what of the plan's swaps Grappler undid (rewriter.check.verification), with the names: the report's, not the log's
    verification_problems: list[str] = field(default_factory=list)
    # without swapping: the step a plain model.fit runs (Keras' own train_step, TF's executor order)
    plain_peak_bytes: int | None = None
    out_of_memory: bool = False  # the plan's run raised ResourceExhausted (peak_bytes is then 0)
    # the device model that predicted step_s (a calibration, autotune.run.calibrated_timing, or a preset's estimate)
    time_model: str = ""
    time_calibrated: bool = False
    # a calibrated prediction re-anchored to the calibration's unswapped steps timed beside the plan's
    # (rewriter.timing.anchored): what they were, and the prediction before it; step_s is then that timing's
    time_anchored_to: str | None = None
    predicted_step_s_unanchored: float | None = None
    # a replicated step's run (autotune.run.plan_run.ReplicatedRuns): each replica's device, host, measured peak
    # and host peak; peak_bytes is then the highest of them
    replicas: tuple[dict, ...] = ()


@dataclass
class TuneResult:
    """Everything a run found; ``summary()`` is what goes into summary.json."""

    model: str
    batch_size: int
    target: Target  # the device the plan is for, its budgets and where they came from (resolved once)
    graph: OpGraph
    policy: str
    baseline: Evaluation
    chosen: Evaluation | None
    closest: Evaluation | None
    evaluations: list[Evaluation]
    study: optuna.Study | None
    plan: SwapPlan | None
    replay: Replay | None
    baseline_replay: Replay
    space: SearchSpace
    max_batch_without_swap: int | None = None
    measurement: MeasuredRun | None = None
    notes: list[str] = field(default_factory=list)
    # the budget the search held predicted peaks to: the budget less what measured runs showed the
    # simulator misses on this model (``correction``); equal to budget_bytes before any measured run
    search_budget_bytes: int | None = None
    correction: PeakCorrection = field(default_factory=PeakCorrection)
    verdict: Verdict | None = None
    # the step the plan is made on: ``graph`` with the plan's recomputations (``recomputes``), else ``graph``
    plan_graph: OpGraph | None = None
    recomputes: list[Recompute] = field(default_factory=list)
    # step times measured on this machine (rewriter.timing.device_calibration), when the run calibrated: the search's
    # device when it models the device searched for, and the measured run's prediction
    calibration: CalibratedDevice | None = None

    @property
    def feasible(self) -> bool:
        return self.chosen is not None

    @property
    def device(self) -> DeviceModel:
        """The device model the search simulated (the target's, timed by a calibration where it models it)."""
        return self.target.device

    @property
    def budget_bytes(self) -> int:
        return self.target.device_budget_bytes

    @property
    def budget_source(self) -> str:
        return self.target.budget_source

    def recomputed(self) -> list[dict[str, Any]]:
        """The plan's recomputations: tensor, its bytes, the ops cloned, their seconds on the
        device, the far readers served, largest first."""
        if not self.recomputes:
            return []
        g = self.plan_graph if self.plan_graph is not None else self.graph
        index, ops = g.tensor_index(), g.op_index()
        seconds = op_seconds(g, self.device)
        rows = [{"tensor": action.tensor, "bytes": int(g.tensor_bytes[index[action.tensor]]), "ops": len(action.ops),
                 "seconds": float(sum(seconds[ops[clone_name(op, k)]] for op in action.ops)),
                 "consumers": len(action.consumers)} for k, action in enumerate(self.recomputes)]
        return sorted(rows, key=lambda row: -row["bytes"])

    @property
    def params(self):
        return None if self.chosen is None else self.chosen.params

    @property
    def graph_rewrites(self) -> list[str]:
        """Rewrites the step was captured with (``rewriter.trace.graph_rewrites``): every figure here,
        the unswapped ones too, is of the rewritten step, and the plan makes the rewriter redo them."""
        return list(self.graph.meta.get("graph_rewrites", []))

    @property
    def applies_plan(self) -> bool:
        """A plan fits and changes the step (swaps, reorders or rewrites it), or only the tool's
        serialized step fits: there is something to apply."""
        serialized = self.verdict is not None and self.verdict.train_with == SERIALIZED_STEP
        return self.feasible and self.plan is not None and (self.plan.changes_step or bool(self.recomputes)
                                                            or bool(self.graph_rewrites) or serialized)

    @property
    def action_phrase(self) -> str:
        """What the shown plan does, in the verdict's words."""
        return actions_phrase(0 if self.plan is None else self.plan.n_swaps, len(self.recomputes),
                              0 if self.plan is None else len(self.plan.host_state), split_parts(self.graph))

    @property
    def has_actions(self) -> bool:
        """Whether the shown plan swaps, recomputes or moves optimizer state (else it at most reorders the step)."""
        return self.plan is not None and bool(self.plan.n_swaps or self.recomputes or self.plan.host_state)

    def named_plan(self) -> NamedPlan | None:
        """The shown plan by name (what ``plan.json`` holds), its recomputations included."""
        return None if self.plan is None else self.plan.to_named(self.plan_graph if self.plan_graph is not None
                                                                 else self.graph)

    @property
    def shown(self) -> Evaluation | None:
        """The chosen candidate, or the closest miss when nothing fits."""
        return self.chosen or self.closest

    def resident_bytes(self, batch_size: int | None = None) -> int:
        """What stays resident through the shown plan's step at ``batch_size`` (the run's by default): the captured
        step's weights, optimizer state and inputs less the state the plan keeps on the host. A measured peak is
        corrected and carried by what lies above this (``autotune.run.verdict.check_run``), not above state that
        is not on the device."""
        g = self.graph if batch_size is None else self.graph.with_batch(batch_size)
        return with_host_state(g, () if self.plan is None else self.plan.host_state).persistent_bytes

    def check_of(self, run: MeasuredRun, measured_bytes: int | None, round_: int, correction: PeakCorrection,
                 reused_from: int | None = None) -> Check:
        """``run`` (``measured_bytes``: its peak, or one replica's) against the prediction for the machine it ran
        on, carried to the target's prediction (``autotune.run.verdict.check_run``)."""
        return check_run(round=round_, measured_on=run.measured_on, measured_bytes=measured_bytes,
                         predicted_bytes=run.predicted_peak_bytes,
                         resident_bytes=self.resident_bytes(run.batch_size),
                         predicted_at_request_bytes=self.shown.peak_bytes,
                         resident_at_request_bytes=self.resident_bytes(), measured_batch=run.batch_size,
                         requested_batch=self.batch_size, budget_bytes=self.budget_bytes, correction=correction,
                         target_on=getattr(self.device, "preset", None) or self.device.name, reused_from=reused_from)

    def replica_memory(self) -> dict[str, Any] | None:
        """Memory per device and per machine of a replicated step (docs/design.md 14; None for one device): each
        replica's predicted and measured peak against the per-device budget and its verdict (its own check,
        swaps verified), the host memory every replica's swaps and moved optimizer state share against the
        machine's host budget, and the gradients' all-reduce pack."""
        meta = self.graph.meta.get("replicas")
        if meta is None:
            return None
        shown, m = self.shown, self.measurement
        measured = {row["device"]: row for row in (m.replicas if m is not None else ())}
        round_ = self.verdict.checks[-1].round if self.verdict is not None and self.verdict.checks else 1
        # a replica's host holds its swapped tensors, the optimizer state (slots, weights) the plan moved and its
        # update's copies and temporaries (an upper bound: the executor decides which are live together)
        host_state = () if self.plan is None else self.plan.host_state
        host_bytes = None if shown is None else int(shown.metrics["host_peak_bytes"]) + moved_bytes(
            self.graph, host_state) + host_working_set_bytes(self.graph, host_state)
        devices = []
        # this worker's replicas, then those the other workers of a cluster measured (each its own machine)
        places = [*zip(meta["devices"], meta["hosts"], [0] * len(meta["devices"])),
                  *((row["device"], row["host"], row["worker"]) for row in measured.values()
                    if row["device"] not in meta["devices"])]
        for device, host, worker in places:
            row = measured.get(device)
            check = None if row is None else self.check_of(m, row["measured_bytes"], round_, self.correction)
            devices.append({
                "device": device, "host": host, "worker": worker, "budget_bytes": self.budget_bytes,
                "predicted_bytes": None if shown is None else int(shown.peak_bytes),
                "predicted_host_bytes": host_bytes,
                **({} if row is None else {
                    "predicted_where_measured_bytes": m.predicted_peak_bytes, "measured_bytes": row["measured_bytes"],
                    "projected_bytes": check.projected_bytes,
                    "measured_host_bytes": row["host_peak_bytes"] + row.get("host_state_bytes", 0),
                    "measured_host_state_bytes": row.get("host_state_bytes", 0),
                    "host_shared": bool(row.get("host_shared")), "swaps_verified": row["swaps_verified"],
                    "check": check.describe(), "confirmed": check.confirmed and row["swaps_verified"]})})
        host_budget = self.target.machine_host_budget_bytes or self.target.host_budget_bytes
        predicted_host = None if host_bytes is None else len(meta["devices"]) * host_bytes
        machines = {d["worker"] for d in devices}  # the fullest machine's host memory: its replicas' hosts
        def machine_bytes(rows: list[dict]) -> int:  # on GPUs every row holds the one pinned allocator's peak
            state = [r["measured_host_state_bytes"] for r in rows]
            return (max if any(r.get("host_shared") for r in rows) else sum)(
                r["measured_host_bytes"] - r["measured_host_state_bytes"] for r in rows) + sum(state)
        measured_host = max(machine_bytes([d for d in devices if d["worker"] == worker]) for worker in machines) \
            if all("measured_host_bytes" in d for d in devices) else None
        machine_host = predicted_host if measured_host is None else measured_host
        return {"devices": devices, "replicas": len(devices), "workers": meta.get("workers", 1),
                "measured_on": None if m is None else m.measured_on, "out_of_memory": bool(m and m.out_of_memory),
                "global_batch_size": meta.get("in_sync", len(devices)) * self.batch_size,
                "per_replica_batch_size": self.batch_size, "all_reduce_bytes": meta["all_reduce_bytes"],
                "all_reduce_ops": meta["all_reduce_ops"],
                "machine": {"host_budget_bytes": host_budget, "predicted_host_bytes": predicted_host,
                            "measured_host_bytes": measured_host,
                            "within_budget": None if machine_host is None else machine_host <= host_budget}}

    def summary(self) -> dict[str, Any]:
        shown = self.shown
        m = self.measurement
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "device": self.device.name,
            "policy": self.policy,
            "study_name": None if self.study is None else self.study.study_name,
            "budget_bytes": self.budget_bytes,
            "budget_source": self.budget_source,
            "target": self.target.to_dict(),
            **(self.verdict.to_dict() if self.verdict is not None else {}),
            "search_budget_bytes": self.search_budget_bytes,
            "peak_correction": {"factor": self.correction.factor, "excess_bytes": self.correction.excess_bytes},
            "feasible": self.feasible,
            "params": None if self.params is None else self.params.to_dict(),
            "closest_params": None if self.chosen or not shown or not shown.params else shown.params.to_dict(),
            # what was tuned (rewriter.trace.training_setup): a plan is made for this optimizer, loss and dtype policy
            **{key: (self.graph.meta.get("training") or {}).get(key) for key in ("optimizer", "loss", "dtype_policy")},
            "graph_rewrites": self.graph_rewrites,
            "graph_rewrite_changes": self.graph.meta.get("graph_rewrite_changes", {}),
            "resident_bytes": self.graph.persistent_bytes,
            "peak_lower_bound_bytes": peak_lower_bound_bytes(self.graph),
            "baseline_peak_bytes": self.baseline.peak_bytes,
            "baseline_step_s": self.baseline.step_s,
            "predicted_peak_bytes": None if shown is None else shown.peak_bytes,
            "predicted_step_s": None if shown is None else shown.step_s,
            "predicted_overhead": None if shown is None else shown.metrics["overhead"],
            "predicted_d2h_bytes": None if shown is None else int(shown.metrics["d2h_bytes"]),
            "predicted_h2d_bytes": None if shown is None else int(shown.metrics["h2d_bytes"]),
            "predicted_host_peak_bytes": None if shown is None else int(shown.metrics["host_peak_bytes"]),
            # without any plan (a budget under the floor, autotune.floor): what the least peak any plan reaches is over
            "excess_bytes": max(0, shown.excess_bytes if shown is not None
                                else peak_lower_bound_bytes(self.graph) - self.budget_bytes),
            "recomputes": self.recomputed(),
            "recomputed_bytes": sum(row["bytes"] for row in self.recomputed()),
            "predicted_recompute_s": None if shown is None else shown.metrics.get("recompute_s", 0.0),
            "swaps": 0 if self.plan is None else self.plan.n_swaps,
            "swap_ins": 0 if self.plan is None else self.plan.n_swap_ins,
            # variables whose optimizer slots (and weights) the plan keeps on the host (simulator.state), and their bytes
            "host_state": [] if self.plan is None else [item.variable for item in self.plan.host_state],
            "host_state_bytes": 0 if self.plan is None else moved_bytes(self.graph, self.plan.host_state),
            # of the predicted step, the host's CPU applying their update (0 where it runs in the step's ops: the testbed)
            "predicted_host_update_s": None if self.replay is None else self.replay.host_update_s,
            "trials": len(self.evaluations),
            "max_batch_without_swap": self.max_batch_without_swap,
            "measured_on": None if m is None else m.measured_on,
            "measured_batch_size": None if m is None else m.batch_size,
            "measured_peak_bytes": None if m is None else m.peak_bytes,
            "measured_step_s": None if m is None else m.step_s,
            "measured_baseline_peak_bytes": None if m is None else m.baseline_peak_bytes,
            "measured_baseline_step_s": None if m is None else m.baseline_step_s,
            "predicted_peak_bytes_at_measured_batch": None if m is None else m.predicted_peak_bytes,
            "predicted_step_s_at_measured_batch": None if m is None else m.predicted_step_s,
            # predicted over measured step time at the measured batch, and what predicted it
            "step_time_ratio": (m.predicted_step_s / m.step_s if m is not None and m.step_s and m.step_s == m.step_s
                                else None),
            "step_time_model": None if m is None else m.time_model,
            "step_time_calibrated": None if m is None else m.time_calibrated,
            "step_time_anchored_to": None if m is None else m.time_anchored_to,
            "predicted_step_s_before_anchoring": None if m is None else m.predicted_step_s_unanchored,
            "search_time_calibrated": isinstance(self.device, CalibratedDevice),
            "calibration": None if self.calibration is None else {
                "device": self.calibration.name, "batch_sizes": list(self.calibration.batch_sizes),
                "measured_step_s": list(self.calibration.measured_step_s),
                "h2d_bytes_per_s": self.calibration.h2d_bytes_per_s,
                "transfer_latency_s": self.calibration.transfer_latency_s,
                "copy_contention": self.calibration.copy_contention,
                "copy_overhead_s": self.calibration.copy_overhead_s, "notes": list(self.calibration.notes)},
            "measured_clones_survived": None if m is None else m.clones_survived,
            "measured_clones_planned": None if m is None else m.clones_planned,
            "measured_recompute_problems": None if m is None else m.recompute_problems,
            "measured_plain_fit_peak_bytes": None if m is None else m.plain_peak_bytes,
            "measured_out_of_memory": None if m is None else m.out_of_memory,
            "notes": self.notes,
            **({} if self.replica_memory() is None else {"replicas": self.replica_memory()}),
        }


def max_batch_without_swap(graph: OpGraph, budget_bytes: int, device: DeviceModel) -> int:
    """The largest batch whose unswapped step fits (0 if not even batch 1)."""
    def fits(batch: int) -> bool:
        return replay(graph.with_batch(batch), None, device).peak_bytes <= budget_bytes

    return largest_batch(fits)


def study_name_for(graph: OpGraph, batch_size: int, device: DeviceModel, budget_bytes: int, policy: str,
                   sampler: str, seed: int | None, recompute: bool = False, space: SearchSpace | None = None,
                   host_state: tuple[HostState, ...] = ()) -> str:
    """A study's default name; searches with and without recomputation keep theirs apart (a
    swap-only search keeps the name it had before recomputation existed). With recomputation the
    name holds the search space too: a version whose recompute space changed starts a new study
    instead of refusing the stored one (``open_study``), which is kept as it is; so does a swap-only space whose
    swap-in groups are more than ``GROUPBY_LEVELS`` (a deep graph's). Optimizer state on the host
    (``host_state``) is another step: its own study."""
    key = f"{graph.fingerprint()}|{batch_size}|{device.name}|{budget_bytes}|{policy}|{sampler}|{seed}"
    if recompute:
        key += "|recompute" + ("" if space is None else "|" + json.dumps(space.to_dict(), sort_keys=True))
    elif space is not None and space.groupby != GROUPBY_LEVELS:
        key += "|groupby|" + ",".join(map(str, space.groupby))
    if host_state:
        key += "|host_state|" + ",".join(sorted(f"{item.variable}:{item.mode}" + ":triggered" * item.triggered_reads
                                                for item in host_state))
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    model = str(graph.meta.get("model", "model")).replace(" ", "_")
    return f"{model}-b{batch_size}-{device.name}-{policy}-{digest}"


def tune_graph(graph: OpGraph, *, batch_size: int | None = None, device: str | DeviceModel | None = None,
               memory: int | None = None, target: Target | None = None, options: SearchOptions | None = None,
               **option_fields: Any) -> TuneResult:
    """Search swap parameters for ``graph`` by simulation (no TensorFlow needed): ``search_graph`` for
    the ``target`` given, else the one ``device`` and ``memory`` name (``resolve_target``).
    ``option_fields``: ``SearchOptions`` fields (trials=..., recompute=...), over ``options``."""
    options = replace(options or SearchOptions(), **option_fields)
    return search_graph(graph, target or resolve_target(device, memory), options, batch_size=batch_size)


def search_graph(graph: OpGraph, target: Target, options: SearchOptions, *, batch_size: int | None = None,
                 correction: PeakCorrection | None = None, measured: bool = False) -> TuneResult:
    """Search swap parameters for ``graph`` on ``target`` by simulation.

    ``options.recompute`` (default): the search may also recompute tensors instead of keeping or swapping
    them (``SearchSpace.for_graph(recompute=True)``); False: it swaps only (``--no-recompute``).
    ``options.state`` (default): where no plan fits with the optimizer state on the device, the search is run again
    with the slots of the largest variables on the host (``simulator.state.state_groups``: a quarter of the movable
    slots' bytes, half, three quarters, all; each group updated on the host and, where the host has a rate of its
    own, streamed around an update on the device, mode ``stream-slots``, the faster that fits kept; where one mode
    fits and the other not, its variables tried in the other one at a time; the copies in of weights and streamed
    slots then started by triggers where that is faster, ``autotune.search.state_moves``), then with their weights
    too (the same shares of weights and slots, mode ``host-weights``), and the first group that fits is the plan's
    ``host_state``; False: the state stays (``--no-state``).

    ``correction``: what measured runs showed the simulator misses on this model; the search holds
    corrected peaks within the budget. ``measured``: a measured run will follow (the verdict then
    waits for it instead of calling the prediction final)."""
    result = _search(graph, target, options, batch_size=batch_size, correction=correction, measured=measured)
    if result.chosen is not None or not options.state or options.maximize_batch:
        return result

    def search(state: tuple[HostState, ...]) -> TuneResult:  # the search with that state on the host
        return _search(graph, target, options, batch_size=batch_size, correction=correction, measured=measured,
                       host_state=state)

    return search_state(result, graph.with_batch(batch_size or graph.batch_size), search,
                        streaming=target.device.host_update_bytes_per_s > 0)


def _search(graph: OpGraph, target: Target, options: SearchOptions, *, batch_size: int | None = None,
            correction: PeakCorrection | None = None, measured: bool = False,
            host_state: tuple[HostState, ...] = ()) -> TuneResult:
    """``search_graph`` with the optimizer slots of ``host_state`` on the host (none: the step as captured), the
    variable writes after the reads they would hold where it moves any."""
    device_model, user_budget = target.device, target.device_budget_bytes
    policy, sampler, seed, recompute = options.policy, options.sampler, options.seed, options.recompute
    max_overhead = options.max_overhead
    correction = correction or PeakCorrection()
    notes: list[str] = []
    captured = graph.with_batch(batch_size or graph.batch_size)
    # with state on the host the tool runs its own step anyway: variable writes (AdamW's decay) wait for the reads
    # they would hold (simulator.state.writes_after_reads), as that step is chained
    g = with_host_state(writes_after_reads(captured) if host_state else captured, host_state,
                        copies_in=not device_model.host_buffers_shared)
    budget = correction.search_budget(user_budget, g.persistent_bytes)
    if not correction.is_identity and budget <= g.persistent_bytes:
        notes.append(f"measured runs showed the simulator short on this model ({correction.describe()}): with "
                     f"that correction not even the resident memory leaves room in the budget of "
                     f"{format_bytes(user_budget)}, so no plan can fit")
    elif not correction.is_identity:
        notes.append(f"measured runs showed the simulator short on this model ({correction.describe()}): the "
                     f"search held predicted peaks to {format_bytes(budget)} so that the corrected peak fits "
                     f"the budget of {format_bytes(user_budget)}")
    elif g.persistent_bytes > budget:
        notes.append(f"the model's weights, optimizer state and inputs alone take {format_bytes(g.persistent_bytes)}, "
                     f"more than the budget of {format_bytes(budget)}: no swap plan can fit")
    no_swap_max = max_batch_without_swap(g, budget, device_model)
    found: list[Evaluation] = []  # plans the batch search found at the batch it picked
    if options.maximize_batch:
        best_batch, found = largest_batch_with_swap(g, budget, device_model, max_overhead=max_overhead, seed=seed,
                                                    recompute=recompute)
        cap = "" if max_overhead is None else f" with a simulated overhead of at most {max_overhead:.0%}"
        if best_batch == 0:
            notes.append(f"not even batch 1 fits with swapping{cap}: the report is of batch 1")
            best_batch = 1
        else:
            notes.append(f"largest batch that fits{cap}: {best_batch} (without swapping: {no_swap_max})")
        g = g.with_batch(best_batch)
    problem = TuningProblem(g, device_model, budget, space=SearchSpace.for_graph(g, recompute=recompute),
                            host_state=host_state)
    baseline = problem.baseline()
    lower_bound = peak_lower_bound_bytes(g)
    if g.persistent_bytes <= budget < lower_bound:
        op = largest_working_set_op(g)
        notes.append(f"no swap plan can fit: {g.op_name[op]} ({g.op_type[op]}) needs its inputs and outputs on the "
                     f"device at once, {format_bytes(lower_bound)} with the resident memory"
                     + ("; --rewrite split-concat removes that concatenation" if _splittable(g, op) else ""))
    name = study_name_for(g, g.batch_size, device_model, budget, policy, sampler, seed, recompute, problem.space,
                          host_state)
    if options.study_name:  # the name given is the step as captured's; one split or with moved state has its own
        name = f"{options.study_name}/{name}" if host_state or split_parts(g) > 1 else options.study_name
    study = open_study(options.storage, name, g, problem.space)
    if baseline.feasible and host_state:
        notes.append(f"with those {moved_kinds(host_state)} on the host the step fits without swapping")
        outcome_evaluations, chosen = [baseline], baseline
    elif baseline.feasible:
        notes.append("the rewritten step fits without swapping: plan.json holds only the graph rewrites"
                     if g.meta.get("graph_rewrites") else "the step fits without swapping: no plan needed")
        outcome_evaluations, chosen = [baseline], baseline
    else:
        chosen_policy = make_policy(policy, sampler=sampler, seed=seed)
        with in_memory(study) if options.storage is not None else contextlib.nullcontext(study) as searched:
            outcome = chosen_policy.search(problem, searched, Budget(options.trials, options.timeout_s,
                                                                     options.progress))
            outcome_evaluations, chosen = outcome.evaluations, outcome.chosen
            best = best_of([e for e in (chosen, *found) if e is not None])
            if best is not chosen:  # a short search may miss what the batch search found: it counts, and enters the study
                add_evaluation(searched, best, problem)
                outcome_evaluations, chosen = outcome_evaluations + [best], best
        if max_overhead is not None and chosen is not None and chosen.metrics["overhead"] > max_overhead:
            notes.append(f"the fastest plan that fits has a simulated overhead of {chosen.metrics['overhead']:.0%}, "
                         f"over the {max_overhead:.0%} asked for")
    notes += capture_notes(g)
    tiled = _broadcasts_left(g) if chosen is None else 0
    if tiled:
        notes.append(f"{tiled} gradients are tiled to an activation's full shape (the gradient of a mean, as in "
                     "batch normalisation's backward): --rewrite elide-broadcasts lets the ops that read them "
                     "broadcast")
    if chosen is not None and chosen.params is not None and chosen.params.keep_tensors:
        notes.append(f"{len(chosen.params.keep_tensors)} tensors the swap rules pick stay on the device: the host's "
                     f"{format_bytes(problem.host_limit_bytes)} of RAM cannot hold every copy at once "
                     "(keep_tensors in the parameters)")
    closest = None if chosen is not None else closest_of(outcome_evaluations + [baseline])
    shown = chosen or closest
    plan = problem.plan(shown.params) if shown is not None else None
    plan_graph = problem.graph_for(None if shown is None else shown.params)
    shown_replay = None if shown is None else replay(plan_graph, plan, device_model)
    recomputes = problem.recomputes(None if shown is None else shown.params)
    parts = split_parts(g)  # a split step is an action of its own, even where nothing is swapped
    verdict = predicted(fits=chosen is not None,
                        swaps=bool(parts or plan is not None and (plan.n_swaps or recomputes or plan.host_state)),
                        peak_bytes=None if shown is None else correction.corrected(shown.peak_bytes, g.persistent_bytes),
                        budget_bytes=user_budget, measured=measured,
                        action=actions_phrase(0 if plan is None else plan.n_swaps, len(recomputes), len(host_state),
                                              parts),
                        host_miss_bytes=0 if closest is None else max(0, closest.host_excess_bytes))
    return TuneResult(
        model=str(g.meta.get("model", "model")), batch_size=g.batch_size, target=target, graph=captured, policy=policy,
        # "without swapping": the step as captured, its state on the device
        baseline=TuningProblem(captured, device_model, budget).baseline() if host_state else baseline,
        chosen=chosen, closest=closest,
        evaluations=outcome_evaluations, study=study, plan=plan,
        replay=shown_replay, baseline_replay=replay(captured, None, device_model),
        space=problem.space, max_batch_without_swap=no_swap_max, notes=notes, search_budget_bytes=budget,
        correction=correction, verdict=verdict, plan_graph=plan_graph,
        recomputes=recomputes,
    )


def capture_notes(g: OpGraph) -> list[str]:
    """What the capture could not size or no plan can move (``graph.meta``), said where it applies."""
    notes = []
    held = g.meta.get("unswappable") or {}
    if held.get("bytes"):
        names = ", ".join(item["tensor"] for item in held.get("tensors", [])[:3])
        notes.append(f"{format_bytes(held['bytes'])} (at batch {held.get('batch')}) is held inside loops no plan can "
                     f"swap ({names}{', ...' if len(held.get('tensors', [])) > 3 else ''}): {held.get('reason', '')}")
    unresolved = g.meta.get("unresolved_tensors") or []
    if unresolved:
        names = ", ".join(str(item.get("tensor", item) if isinstance(item, dict) else item) for item in unresolved[:3])
        notes.append(f"{len(unresolved)} tensor(s) of unknown size are counted as 0 bytes ({names}"
                     f"{', ...' if len(unresolved) > 3 else ''}): the measured run is what shows what they take")
    together = (g.meta.get("movable_state") or {}).get("gradients_together")
    if together and g.meta.get("host_state"):
        notes.append(f"the optimizer reads every gradient before it updates any variable ({together}): the device "
                     "holds all gradients at once, so the slots moved to the host save their own bytes only")
    elif together:  # the planned step updates each variable as its gradient is final, unless this holds them
        notes.append(f"the optimizer reads every gradient before it updates any variable ({together}): the device "
                     "holds all gradients at once; without it each variable's update runs, and frees its gradient, "
                     "as soon as that gradient is final")
    return notes


def _broadcasts_left(g: OpGraph) -> int:
    """Backward ``Tile``/``BroadcastTo`` ops whose output grows with the batch, not yet rewritten:
    the case of ``--rewrite elide-broadcasts`` (the capture checks which of them it can drop)."""
    if "elide-broadcasts" in g.meta.get("graph_rewrites", []):
        return 0
    ops = np.flatnonzero(np.isin(g.op_type, ["Tile", "BroadcastTo"]) & (g.op_phase == BACKWARD))
    return int((g.tensor_bytes_ab[np.isin(g.tensor_producer, ops), 1] > 0).sum())


def _splittable(g: OpGraph, op: int) -> bool:
    """A concatenation a convolution reads, not yet rewritten: the case of ``--rewrite split-concat``
    (which also needs the convolution to be its only reader; the capture checks the rest)."""
    if g.op_type[op] != "ConcatV2" or "split-concat" in g.meta.get("graph_rewrites", []):
        return False
    outputs = np.flatnonzero(g.tensor_producer == op)
    readers = g.edge_consumer[np.isin(g.edge_tensor, outputs)]
    return bool(np.isin(g.op_type[readers], ["Conv2D", "Conv3D"]).any())
