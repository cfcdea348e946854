"""The report's figures, one function per PNG. Each returns the path written (None when the data
cannot support the plot, e.g. parameter importances from a single trial)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import optuna  # noqa: E402
import pandas as pd  # noqa: E402

from autotune.inputs import byte_unit  # noqa: E402
from simulator import FORWARD, categorized_levels, edge_distances  # noqa: E402
from simulator.ordering import slot_levels_view  # noqa: E402
from simulator.planning import is_activation  # noqa: E402
from simulator.recompute.actions import original_levels  # noqa: E402

log = logging.getLogger(__name__)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory_timeline(result, path: Path) -> Path:
    """Device memory over the categorized ordering, without and with the plan, against the budget;
    where the plan swaps tensors back in and recomputes them."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    measured = result.measurement.peak_bytes if result.measurement is not None else 0
    unit, scale = byte_unit(max(result.budget_bytes, result.baseline.peak_bytes, measured))
    base = result.baseline_replay.level_peak_bytes / scale
    ax.plot(np.arange(len(base)), base, color="tab:red", lw=1.2, label="without swapping")
    if result.replay is not None and result.plan is not None and (result.plan.changes_step or result.recomputes):
        memory, swap_ins, recomputes = memory_by_original_level(result)
        ax.plot(np.arange(len(memory)), memory / scale, color="tab:blue", lw=1.2,
                label=f"with the plan ({result.plan.n_swaps} tensors swapped"
                      + (f", {len(result.recomputes)} recomputed" if result.recomputes else "")
                      + f", {result.plan.order_name} order)")
        # where the plan acts: each swap-in and each recomputation at the level of its first reader
        if len(swap_ins):
            ax.plot(swap_ins, np.zeros(len(swap_ins)), "|", color="tab:purple", ms=10, label="swap-ins")
        if len(recomputes):
            ax.plot(recomputes, np.zeros(len(recomputes)), "|", color="tab:green", ms=16, label="recomputations")
    ax.axhline(result.budget_bytes / scale, color="black", ls="--", lw=1,
               label=f"budget {result.budget_bytes / scale:.2f} {unit}")
    m = result.measurement
    if m is not None and m.batch_size == result.batch_size and not m.out_of_memory:
        ax.axhline(m.peak_bytes / scale, color="tab:orange", ls="-.", lw=1,
                   label=f"measured peak of the plan ({m.measured_on})")
    ax.axhline(result.graph.persistent_bytes / scale, color="grey", ls=":", lw=1, label="weights, optimizer state, inputs")
    forward_levels = result.graph.op_phase == FORWARD
    if forward_levels.any():
        end = int(categorized_levels(result.graph)[forward_levels].max())
        ax.axvline(end, color="grey", lw=0.8)
        ax.text(end, ax.get_ylim()[1] * 0.98, " end of forward", va="top", fontsize=8, color="grey")
    ax.set_xlabel("level of the categorized topological ordering")
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_title(f"{result.model}, batch {result.batch_size}: predicted device memory")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_ylim(bottom=0)
    return _save(fig, path)


def memory_by_original_level(result) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The plan's device memory per level of the step as captured (each op at its own level there, clones at their
    far readers': ``simulator.recompute.actions.original_levels``), and the levels of its swap-ins' and
    recomputations' first readers."""
    plan_graph = result.plan_graph if result.plan_graph is not None else result.graph
    levels = categorized_levels(plan_graph)
    # (its control edges, where it moves weights or runs writes after reads, can shift its levels too)
    stands_for = original_levels(result.graph, plan_graph)
    # an original level holds what the plan's graph holds at the levels its ops (and clones standing for
    # it) run at, the most of them: every original level has ops there, so none is drawn empty
    memory = np.zeros(len(result.baseline_replay.level_peak_bytes))
    peaks = result.replay.level_peak_bytes
    ran = levels < len(peaks)
    np.maximum.at(memory, stands_for[ran], peaks[levels[ran]])
    plan = result.plan
    swap_ins = stands_for[plan.in_consumers[plan.in_consumer_ptr[:-1]]] if plan.n_swap_ins else np.zeros(0)
    index = result.graph.op_index()
    base_levels = categorized_levels(result.graph)
    recomputes = np.asarray([min(base_levels[index[name]] for name in action.consumers)
                             for action in result.recomputes], dtype=np.int64)
    return memory, swap_ins, recomputes


def distance_histogram(result, path: Path) -> Path:
    """How far apart producers and consumers of activations are: the long edges swapping splits."""
    g = result.graph
    in_slots = result.params is not None and result.params.distance == "slot"
    # in the plan's units: execution steps of its order, or levels
    distance = edge_distances(slot_levels_view(g.with_order(result.params.order)) if in_slots else g)
    activation = is_activation(g)[g.edge_tensor]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    values = distance[activation]
    read_bytes = g.tensor_bytes[g.edge_tensor[activation]]
    unit, scale = byte_unit(read_bytes.sum() if len(values) else 0)
    if len(values):
        bins = np.unique(np.geomspace(1, max(values.max(), 2), 40).astype(int))
        ax.hist(values, bins=bins, color="tab:blue", alpha=0.8,
                weights=read_bytes / scale)
        ax.set_xscale("log")
    if result.params is not None:
        ax.axvline(result.params.threshold, color="tab:red", ls="--", label=f"threshold {result.params.threshold}")
        ax.legend(fontsize=8)
    ax.set_xlabel(f"edge distance ({'execution steps' if in_slots else 'levels'} from producer to consumer)")
    ax.set_ylabel(f"{unit} read over such edges")
    ax.set_title("Distances of activation reads (edges right of the threshold are swapped)")
    return _save(fig, path)


def optimization_history(study: optuna.Study, path: Path) -> Path | None:
    trials = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    if not trials:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib backend experimental
        ax = optuna.visualization.matplotlib.plot_optimization_history(study)
    ax.set_ylabel("simulated step time (s)")
    fig = ax.figure
    fig.set_size_inches(8, 4)
    return _save(fig, path)


def param_importances(study: optuna.Study, path: Path) -> Path | None:
    trials = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE and t.params]
    if len(trials) < 4 or len({tuple(sorted(t.params.items())) for t in trials}) < 3:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ax = optuna.visualization.matplotlib.plot_param_importances(study)
    except (RuntimeError, ValueError, ZeroDivisionError) as error:  # e.g. no variance in the objective
        log.info("no parameter importances: %s", error)
        return None
    fig = ax.figure
    fig.set_size_inches(8, 3.8)
    return _save(fig, path)


def pareto_front(result, path: Path) -> Path | None:
    """Peak memory against step time for every candidate simulated; the front and the choice marked."""
    rows = pd.DataFrame([e.row() for e in result.evaluations])
    if rows.empty:
        return None
    rows = rows.drop_duplicates(subset=["peak_bytes", "step_s"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    unit, scale = byte_unit(max(result.budget_bytes, float(rows["peak_bytes"].max())))
    fits = rows["feasible"].astype(bool)
    ax.scatter(rows.loc[~fits, "step_s"], rows.loc[~fits, "peak_bytes"] / scale, s=10, color="tab:grey", alpha=0.5,
               label="over the budget")
    ax.scatter(rows.loc[fits, "step_s"], rows.loc[fits, "peak_bytes"] / scale, s=12, color="tab:blue", alpha=0.7,
               label="fits")
    ordered = rows.sort_values(["step_s", "peak_bytes"])
    peaks = ordered["peak_bytes"].astype(float)
    front = ordered[peaks < peaks.cummin().shift(fill_value=np.inf)]
    ax.step(front["step_s"], front["peak_bytes"] / scale, where="post", color="tab:green", lw=1.5, label="Pareto front")
    ax.axhline(result.budget_bytes / scale, color="black", ls="--", lw=1, label="budget")
    base = result.baseline
    ax.scatter([base.step_s], [base.peak_bytes / scale], marker="s", color="tab:red", s=40, label="no swapping", zorder=3)
    if result.shown is not None:
        ax.scatter([result.shown.step_s], [result.shown.peak_bytes / scale], marker="*", color="gold", edgecolor="black",
                   s=160, label="chosen" if result.chosen else "closest miss", zorder=4)
    ax.set_xlabel("simulated step time (s)")
    ax.set_ylabel(f"predicted peak memory ({unit})")
    ax.set_title(f"{len(rows)} distinct candidates simulated (same peak and time counted once)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def measured_vs_predicted(result, path: Path) -> Path | None:
    m = result.measurement
    if m is None:
        return None
    unit, scale = byte_unit(max(m.predicted_peak_bytes, m.peak_bytes))
    labels, predicted, measured = ["with the plan"], [m.predicted_peak_bytes / scale], [m.peak_bytes / scale]
    if m.baseline_peak_bytes is not None:
        labels.insert(0, "without swapping")
        predicted.insert(0, m.predicted_baseline_peak_bytes / scale)
        measured.insert(0, m.baseline_peak_bytes / scale)
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.bar(x - 0.2, predicted, 0.4, label="predicted", color="tab:blue")
    ax.bar(x + 0.2, measured, 0.4, label=f"measured ({m.measured_on})", color="tab:orange")
    ax.set_xticks(x, labels)
    ax.set_ylabel(f"peak device memory ({unit})")
    ax.set_title(f"Batch {m.batch_size}: predicted and measured")
    ax.legend(fontsize=8)
    return _save(fig, path)


def replica_memory(result, path: Path) -> Path | None:
    """Each replica's peak, predicted for the target and measured (carried to it), against the budget per device."""
    memory = result.replica_memory()
    if memory is None:
        return None
    devices = memory["devices"]
    values = [d.get(key) or 0 for d in devices for key in ("predicted_bytes", "projected_bytes")]
    unit, scale = byte_unit(max([*values, result.budget_bytes]))
    x = np.arange(len(devices))
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.bar(x - 0.2, [(d["predicted_bytes"] or 0) / scale for d in devices], 0.4, label="predicted", color="tab:blue")
    ax.bar(x + 0.2, [(d.get("projected_bytes") or 0) / scale for d in devices], 0.4,
           label="measured, carried to the target", color="tab:orange")
    ax.axhline(result.budget_bytes / scale, color="black", linestyle="--", linewidth=1, label="budget per device")
    ax.set_xticks(x, [f"replica {k}\n{d['device'].rsplit('device:', 1)[-1]}" for k, d in enumerate(devices)])
    ax.set_ylabel(f"peak device memory ({unit})")
    ax.set_title(f"{len(devices)} replicas at global batch {memory['global_batch_size']}")
    ax.legend(fontsize=8)
    return _save(fig, path)


FIGURES = {
    "memory_timeline.png": memory_timeline,
    "distance_histogram.png": distance_histogram,
    "pareto_front.png": pareto_front,
    "measured_vs_predicted.png": measured_vs_predicted,
    "replica_memory.png": replica_memory,
}
STUDY_FIGURES = {
    "optimization_history.png": optimization_history,
    "param_importances.png": param_importances,
}


def draw_all(result, directory: Path) -> dict[str, Path]:
    """Every figure that the result supports, by file name."""
    drawn: dict[str, Path] = {}
    for name, draw in FIGURES.items():
        path = draw(result, directory / name)
        if path is not None:
            drawn[name] = path
    if result.study is not None:
        for name, draw in STUDY_FIGURES.items():
            path = draw(result.study, directory / name)
            if path is not None:
                drawn[name] = path
    return drawn
