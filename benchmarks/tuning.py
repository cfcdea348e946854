"""Search policies on the same simulator: Optuna, random, tflms-v2 and the exhaustive grid.

    python -m benchmarks tuning [--trials 200] [--seeds 3]

For ResNet-50 (batch 256) and a 3D U-Net (64^3, batch 96) under the v100-16gb budget, each policy
searches one grid (small enough for the exhaustive policy to walk whole); the table gives the best
simulated step time each finds, its gap to the exhaustive optimum, the trials and the wall time;
the plot shows the best plan that fits against trials. Target (docs/design.md 5): Optuna within 1% of
the exhaustive optimum in at most 200 trials, and clearly faster plans than tflms-v2.
"""

from __future__ import annotations

import argparse
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import optuna  # noqa: E402
import pandas as pd  # noqa: E402

from autotune.search.policies import Budget, make_policy  # noqa: E402
from autotune.search.space import SearchSpace, TuningProblem  # noqa: E402
from autotune.report.writer import markdown_table  # noqa: E402
from benchmarks.common import RESULTS_DIR, write_results  # noqa: E402
from benchmarks.models.graphs import captured_graph  # noqa: E402
from simulator import get_device, replay  # noqa: E402

CASES = {
    "resnet50": (dict(), 256),
    "unet3d": (dict(size=64), 96),
}


def benchmark_space(graph) -> SearchSpace:
    """A grid the exhaustive policy walks in a few minutes; every policy searches this one."""
    default = SearchSpace.for_graph(graph, points=14)
    return SearchSpace(threshold=default.threshold, lb=tuple(default.lb[::3]), window=(0, 4, 16, 64),
                       groupby=(0, 4, 16), min_bytes=(4096, 16 << 20))


def _curve(evaluations) -> np.ndarray:
    """Best feasible step time after each evaluation (inf before the first that fits)."""
    best, values = np.inf, []
    for evaluation in evaluations:
        if evaluation.feasible:
            best = min(best, evaluation.step_s)
        values.append(best)
    return np.asarray(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks tuning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the Optuna and random searches")
    parser.add_argument("--models", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    device = get_device("v100-16gb")
    rows = []
    fig, axes = plt.subplots(1, len(args.models), figsize=(6 * len(args.models), 4), squeeze=False)
    for ax, name in zip(axes[0], args.models):
        kwargs, batch = CASES[name]
        graph = captured_graph(name, **kwargs).with_batch(batch)
        space = benchmark_space(graph)
        baseline = replay(graph, None, device)
        runs = {}
        for policy, seeds in (("exhaustive", [0]), ("tflms-v2", [0]), ("optuna", range(args.seeds)),
                              ("random", range(args.seeds))):
            for seed in seeds:
                problem = TuningProblem(graph, device, device.budget_bytes, space=space)
                start = time.perf_counter()
                trials = None if policy == "exhaustive" else args.trials
                outcome = make_policy(policy, seed=seed).search(problem, optuna.create_study(), Budget(trials=trials))
                seconds = time.perf_counter() - start
                runs[(policy, seed)] = (outcome, seconds)
        optimum = runs[("exhaustive", 0)][0].chosen
        for (policy, seed), (outcome, seconds) in runs.items():
            chosen = outcome.chosen
            rows.append({
                "model": name, "batch": batch, "policy": policy, "seed": seed, "trials": len(outcome.evaluations),
                "seconds": seconds, "best_step_s": np.nan if chosen is None else chosen.step_s,
                "overhead": np.nan if chosen is None else chosen.metrics["overhead"],
                "gap_to_exhaustive": np.nan if chosen is None or optimum is None else chosen.step_s / optimum.step_s - 1,
                "params": None if chosen is None or chosen.params is None else
                f"t={chosen.params.threshold} lb={chosen.params.lb} ub={chosen.params.ub} g={chosen.params.groupby} "
                f"{chosen.params.sync} {chosen.params.order} {chosen.params.tensors} {chosen.params.distance} "
                f"{chosen.params.trigger}{' after-copies-out' if chosen.params.after_copies_out else ''}"
                f"{f' keep={len(chosen.params.keep_tensors)}' if chosen.params.keep_tensors else ''}",
            })
            curve = _curve(outcome.evaluations)
            if policy in ("optuna", "random"):
                ax.plot(np.arange(1, len(curve) + 1), curve, lw=1, label=f"{policy} seed {seed}",
                        color="tab:blue" if policy == "optuna" else "tab:grey", alpha=0.9 if seed == 0 else 0.5)
            elif policy == "tflms-v2" and chosen is not None:
                ax.scatter([len(outcome.evaluations)], [chosen.step_s], color="tab:red", marker="x", s=60,
                           label="tflms-v2 (its choice)", zorder=3)
        if optimum is not None:
            ax.axhline(optimum.step_s, color="black", ls="--", lw=1,
                       label=f"exhaustive optimum ({space.size():,} plans)")
        ax.axhline(baseline.compute_s, color="tab:green", ls=":", lw=1, label="no-swap compute time")
        ax.set_xlabel("trials")
        ax.set_ylabel("best simulated step time that fits (s)")
        ax.set_title(f"{name}, batch {batch}, v100-16gb")
        ax.set_xlim(0, args.trials)
        finite = [r["best_step_s"] for r in rows if r["model"] == name and np.isfinite(r["best_step_s"])]
        if finite:
            ax.set_ylim(baseline.compute_s * 0.95, max(finite) * 1.1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "tuning.png", dpi=110)
    table = pd.DataFrame(rows)
    summary = table.groupby(["model", "policy"]).agg(
        best_step_s=("best_step_s", "median"), worst_gap=("gap_to_exhaustive", "max"),
        trials=("trials", "median"), seconds=("seconds", "median")).reset_index()
    notes = ["Median over seeds; worst_gap is the largest gap to the exhaustive optimum over seeds.",
             "tflms-v2 keeps the last parameter set that fits, as the original did; it is memory-only."]
    path = write_results("tuning", table, settings={"device": device.name, "trials": args.trials,
                                                    "seeds": args.seeds, "command": "python -m benchmarks tuning"},
                         notes=notes + ["", "Summary:", "", markdown_table(summary)])
    print(table.to_string(index=False))
    print(summary.to_string(index=False))
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
