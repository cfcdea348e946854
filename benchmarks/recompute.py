"""Recomputation measured on the testbed: the tool's plans beside swap-only plans and Keras' RematScope.

    python -m benchmarks recompute [--model resnet50] [--image-size 128] [--batch 8] [--budgets 0.6,0.45]
                                   [--rounds 3] [--trials 150] [--no-remat]

One model at one batch, every configuration in this one process (the CPU testbed: ``CPU:0`` plays the
accelerator, ``CPU:1`` the host), each measured with ``rewriter.timing.measurement`` (accelerator-side peak in
requested bytes, the median of ``--rounds`` profiled steps; step time, the median of the rounds'
timed steps, each round timing every configuration once after a round that warms them all up, so
that the machine's slow episodes fall on all of them alike):

* Keras' own step (``rewriter.KerasStep``: ``model.train_step`` in a ``tf.function``, as ``model.fit``
  runs it without XLA), of the model as built and of the model built inside ``keras.RematScope(mode)``
  for each mode (``benchmarks.models.REMAT_MODES``; ``list_of_layers`` names ``REMAT_LAYERS``). A
  mode whose step Keras cannot trace is a row with Keras' reason.
* The tool's serialized step: no plan; every cheap tensor of 64 KiB or more recomputed
  (``simulator.recompute.choice``, no swaps); and, per budget (a fraction of the way from the resident state to the unswapped peak),
  the plan the search finds with swapping alone and with recomputation beside it
  (``autotune.run.tuning.tune_graph``). The search's time model is the ``v100-16gb`` preset's (a GPU's
  compute against a PCIe link: on the testbed a copy costs next to nothing, so swapping always wins
  there) with the testbed's memory rules (its kept reads); each plan's peak is predicted for the
  testbed (``simulator.replay(..., 'cpu-testbed')``) and measured.

Writes ``benchmarks/results/recompute_measured.{csv,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pandas as pd
import tensorflow as tf

import rewriter
from autotune.run.tuning import tune_graph
from benchmarks.common import STARTED_S, write_results
from benchmarks.max_batch import _reason
from benchmarks.models import REMAT_MODES, build_model, example_batch
from rewriter.placement.placements import configure_testbed
from simulator import SwapPlan, get_device, replay
from simulator.recompute.actions import with_recomputes
from simulator.recompute.choice import RecomputeParams, actions_of, choose_recomputes

log = logging.getLogger(__name__)
MiB = 2**20
NAME = "recompute_measured"
TIME_MODEL = "v100-16gb"


@dataclass
class Configuration:
    """One configuration: how to build its step, and what it was predicted and measured to do."""

    label: str
    kind: str  # "keras" (Keras' own step) or "tool" (the serialized, rewritten step)
    build: Callable[[], Any] | None = None  # -> a step rewriter.timing.measurement takes
    info: dict[str, Any] = field(default_factory=dict)
    step: Any = None
    peaks: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: str = ""


def _v100_time_testbed_memory(testbed, v100):
    """The search's device: the V100 preset's compute, bandwidth and link, the testbed's memory rules."""
    return dataclasses.replace(v100, name=f"{v100.name} time, cpu-testbed memory", kept_reads=testbed.kept_reads,
                               capacity_bytes=testbed.capacity_bytes, usable_fraction=1.0)


def tool_configs(model, graph, budgets: list[float], trials: int) -> list[Configuration]:
    """The tool's plans (see the module's docstring), predicted; steps are built when measured."""
    testbed = get_device("cpu-testbed")
    search_device = _v100_time_testbed_memory(testbed, get_device(TIME_MODEL))
    base_time = replay(graph, None, search_device).step_s
    unswapped = replay(graph, None, testbed).peak_bytes
    resident = graph.persistent_bytes

    def config(label: str, plan_graph, plan, recomputes, budget: int | None = None, search=None) -> Configuration:
        predicted = replay(plan_graph, plan, testbed)
        timed = replay(plan_graph, plan, search_device)
        info = {"budget_MiB": None if budget is None else budget / MiB, "predicted_MiB": predicted.peak_bytes / MiB,
                "swaps": plan.n_swaps, "recomputes": len(recomputes),
                "recomputed_MiB": sum(int(plan_graph.tensor_bytes[plan_graph.tensor_index()[a.tensor]])
                                      for a in recomputes) / MiB,
                "sim_overhead_pct": 100 * (timed.step_s / base_time - 1.0), "search": search or ""}

        def build():
            return rewriter.apply(model, plan, graph=plan_graph, batch_size=graph.batch_size)

        return Configuration(label, "tool", build, info)

    configs = [config("tool: no plan (serialized step)", graph, SwapPlan.empty(graph), [])]
    chosen = choose_recomputes(graph, testbed, RecomputeParams(min_bytes=64 << 10))
    actions = actions_of(graph, chosen)
    transformed = with_recomputes(graph, actions)
    configs.append(config("tool: every cheap tensor recomputed", transformed, SwapPlan.empty(transformed), actions))
    for fraction in budgets:
        budget = int(resident + fraction * (unswapped - resident))
        for recompute in (False, True):
            result = tune_graph(graph, device=search_device, memory=budget, trials=trials, recompute=recompute)
            label = f"tool: budget {fraction:.0%}, {'recompute + swap' if recompute else 'swap only'}"
            if result.plan is None or result.chosen is None:
                configs.append(Configuration(label, "tool", None, {"budget_MiB": budget / MiB},
                                      error="the search found no plan within the budget"))
                continue
            plan_graph = result.plan_graph if result.plan_graph is not None else graph
            configs.append(config(label, plan_graph, result.plan, list(result.recomputes), budget,
                                  search=f"tune_graph({trials} trials, recompute={recompute})"))
    return configs


def keras_configs(name: str, kwargs: dict[str, Any], remat: bool) -> list[Configuration]:
    """Keras' own step of the model, and of the model built inside each RematScope mode."""
    configs = [Configuration("keras: model.fit's step", "keras", lambda: rewriter.KerasStep(build_model(name, seed=0, **kwargs)))]
    for mode in REMAT_MODES if remat else ():
        def build(mode=mode):
            return rewriter.KerasStep(build_model(name, seed=0, remat=mode, **kwargs))

        configs.append(Configuration(f"keras: RematScope(mode={mode!r})", "keras", build))
    return configs


def measure(configs: list[Configuration], x, y, rounds: int) -> None:
    """Build every step, then ``rounds`` rounds each timing and profiling every step once."""
    for config in configs:
        if config.build is None:
            continue
        try:
            config.step = config.build()
            verification = getattr(config.step, "verification", None)
            if verification is not None:
                config.info["verified"] = bool(verification.ok)
                if not verification.ok:
                    config.info["verification"] = "; ".join(verification.problems())[:300]
        except Exception as error:  # noqa: BLE001 -- a configuration that cannot be built is a row with why
            config.error = _reason(error)
            log.info("%s: %s", config.label, config.error)
    for round_ in range(rounds + 1):  # round 0 warms every step up (its first calls build kernels): not counted
        for config in configs:
            if config.step is None:
                continue
            try:
                reading = rewriter.measure(config.step, x, y, warmup=1 if round_ == 0 else 0, repeats=1)
                if round_ == 0:
                    continue
            except tf.errors.ResourceExhaustedError as error:
                config.error, config.step = f"out of memory: {str(error).splitlines()[0][:200]}", None
                continue
            except Exception as error:  # noqa: BLE001 -- Keras' remat fails when its step is traced: a row with why
                config.error, config.step = _reason(error), None
                continue
            config.peaks.append(reading.peak_bytes)
            config.times.append(reading.step_s)
        log.info("round %d/%d done (%.0f s since start)", round_, rounds, time.perf_counter() - STARTED_S)


def table_of(configs: list[Configuration]) -> pd.DataFrame:
    keras_times = next((c.times for c in configs if c.kind == "keras" and c.times), [])
    rows = []
    for config in configs:
        row: dict[str, Any] = {"configuration": config.label, **config.info}
        if config.peaks:
            measured = float(np.median(config.peaks))
            row["measured_MiB"] = measured / MiB
            row["peak_spread_pct"] = 100 * (max(config.peaks) - min(config.peaks)) / measured
            if row.get("predicted_MiB") is not None:
                row["error_pct"] = 100 * (row["predicted_MiB"] * MiB / measured - 1.0)
            if row.get("budget_MiB") is not None:
                row["within_budget"] = bool(max(config.peaks) <= row["budget_MiB"] * MiB)
        if config.times:
            row["step_s"] = statistics.median(config.times)
            row["step_spread_pct"] = 100 * (max(config.times) - min(config.times)) / row["step_s"]
            if keras_times:  # per round: the same moment's Keras step
                ratios = [t / k for t, k in zip(config.times, keras_times)]
                row["step_vs_keras"] = statistics.median(ratios)
        row["note"] = config.error
        rows.append(row)
    columns = ["configuration", "budget_MiB", "predicted_MiB", "measured_MiB", "error_pct", "within_budget",
               "peak_spread_pct", "swaps", "recomputes", "recomputed_MiB", "sim_overhead_pct", "step_s",
               "step_spread_pct", "step_vs_keras", "verified", "verification", "search", "note"]
    table = pd.DataFrame(rows)
    return table[[c for c in columns if c in table]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks recompute", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", help="a benchmarks.models model with images (default resnet50)")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budgets", default="0.6,0.45",
                        help="budgets as fractions of the way from the resident state to the unswapped peak")
    parser.add_argument("--rounds", type=int, default=3, help="measurement rounds (each times and profiles every step)")
    parser.add_argument("--trials", type=int, default=150, help="search trials per plan")
    parser.add_argument("--no-remat", action="store_true", help="leave out the keras.RematScope modes")
    args = parser.parse_args(argv)
    try:
        budgets = [float(part) for part in args.budgets.split(",") if part.strip()]
    except ValueError:
        print(f"--budgets must be fractions separated by commas, got {args.budgets!r}", file=sys.stderr)
        return 2
    if not budgets or any(not 0 < b < 1 for b in budgets) or args.rounds < 1 or args.batch < 1 or args.trials < 1:
        print("--budgets must be fractions in (0, 1); --rounds, --batch and --trials positive", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    configure_testbed()  # before TensorFlow's runtime starts: CPU:0 accelerator, CPU:1 host
    kwargs = {"image_size": args.image_size}
    model = build_model(args.model, seed=0, **kwargs)
    graph = rewriter.capture(model, args.batch, name=args.model)
    x, y = example_batch(model, args.batch)
    configs = keras_configs(args.model, kwargs, not args.no_remat) + tool_configs(model, graph, budgets, args.trials)
    measure(configs, x, y, args.rounds)
    table = table_of(configs)
    tool = table["configuration"].str.startswith("tool")
    errors = (pd.to_numeric(table.loc[tool, "error_pct"], errors="coerce").abs().dropna() if "error_pct" in table
              else pd.Series(dtype=float))
    notes = [
        "## Notes", "",
        ("- predicted_MiB: `simulator.replay(plan_graph, plan, 'cpu-testbed').peak_bytes`; measured_MiB: the median "
         "of the rounds' `rewriter.measure(step, x, y).peak_bytes` (accelerator-side, requested bytes, resident state "
         "included); within_budget: the highest measured peak within the budget."),
        (f"- sim_overhead_pct: the plan's simulated step time over the unswapped step's, on the {TIME_MODEL} preset's "
         "time model with the testbed's memory rules (the time model the search used); step_s and step_vs_keras: "
         "measured on the testbed (two cores shared with other work: ratios per round, median over rounds)."),
        ("- Keras' steps are not serialized (TF's executor picks the order), the tool's are (the plan's order)."),
        (f"- Prediction error over the tool's plans: median {errors.median():.2f} %, worst {errors.max():.2f} % "
         f"({len(errors)} plans)." if len(errors) else "- No tool plan was measured."),
    ]
    settings = {"command": "python -m benchmarks recompute " + " ".join(argv if argv is not None else sys.argv[2:]),
                "model": f"{args.model}(image_size={args.image_size}) b{args.batch}",
                "graph": f"{graph.n_ops} ops, resident {graph.persistent_bytes / MiB:.1f} MiB",
                "rounds": args.rounds, "budgets": ", ".join(f"{b:.0%}" for b in budgets)}
    path = write_results(NAME, table, settings=settings, notes=notes, float_format="{:.4g}")
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.max_colwidth", 45):
        print(table.drop(columns=[c for c in ("verification", "search") if c in table]).round(3).to_string(index=False))
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
