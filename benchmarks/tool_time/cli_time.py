"""Where the CLI's time goes: ``python -m autotune`` end to end, stage by stage, on a few models.

    python -m benchmarks cli-time [--models small_cnn,resnet50,densenet121,efficientnetv2b0] [--runs 1]

Each model is saved, then ``python -m autotune`` runs on it in a fresh process as a user would run it
(capture, calibration, search, measured run, report; 200 trials) and the seconds of each stage are
read from its summary.json (``stage_seconds``, ``autotune.run.stage_times``). The cases: a small CNN of
the zoo, the demo's ResNet-50 (224x224, batch 256, v100-16gb preset: ``scripts/demo``), DenseNet-121
and EfficientNetV2B0 at 32x32, batch 16. The small models are tuned for the CPU testbed with a budget
halfway between their lowest swap plan's predicted peak and the unswapped one (as ``benchmarks
verdict`` sets it), so that they need a plan. ``--runs 2`` runs each model twice in the same output
directory: the second run shows what a repeated run costs (its calibration is reused from the cache, a
fresh one per benchmark: the first run always calibrates).
The table beside the machine and the load average (``os.getloadavg``) before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from autotune.run.stage_times import STAGES
from benchmarks.common import write_results

ROOT = Path(__file__).resolve().parents[2]
TARGET_S = 60.0  # a user wants an answer in about a minute on a 2-core machine


@dataclass(frozen=True)
class TimedModel:
    """One model: ``source`` "zoo" (``benchmarks.zoo.ZOO``) or "models" (``benchmarks.models.MODELS``);
    ``device``: the preset the CLI tunes for; ``swap_budget``: the budget is set between the lowest swap
    plan's predicted peak and the unswapped one (else the preset's own)."""

    name: str
    source: str
    model: str
    batch: int
    device: str
    swap_budget: bool
    kwargs: dict = field(default_factory=dict)


CASES = {case.name: case for case in (
    TimedModel("small_cnn", "zoo", "separable_cnn", 8, "cpu-testbed", True),
    TimedModel("resnet50", "models", "resnet50", 256, "v100-16gb", False),
    TimedModel("densenet121", "models", "densenet121", 16, "cpu-testbed", True, {"image_size": 32}),
    TimedModel("efficientnetv2b0", "zoo", "efficientnetv2b0", 16, "cpu-testbed", True),
)}


def _build(case: TimedModel):
    if case.source == "zoo":
        from benchmarks.zoo import ZOO

        return ZOO[case.model].build()
    from benchmarks.models import build_model

    return build_model(case.model, **case.kwargs)


def _swap_budget_bytes(model, batch: int) -> int:
    """Halfway between the lowest swap plan's predicted peak and the unswapped one on the testbed."""
    from rewriter.trace.tracing import capture
    from simulator import SwapParams, plan_swaps, replay

    graph = capture(model, batch)
    unswapped = replay(graph, None, "cpu-testbed").peak_bytes
    lowest = replay(graph, plan_swaps(graph, SwapParams(threshold=1, lb=1, ub=8, sync="both")), "cpu-testbed").peak_bytes
    return (unswapped + lowest) // 2


def _run(case: TimedModel, directory: Path, runs: int, trials: int) -> list[dict]:
    model_dir = directory / case.name
    model_dir.mkdir(parents=True)
    model = _build(case)
    model.save(model_dir / "model.keras")
    budget = ["--memory", str(_swap_budget_bytes(model, case.batch))] if case.swap_budget else []
    out = directory / f"out-{case.name}"
    command = [sys.executable, "-m", "autotune", str(model_dir), "--batch-size", str(case.batch), "--device",
               case.device, *budget, "--trials", str(trials), "--out", str(out), "--quiet"]
    # a calibration cache of its own: the first run calibrates whatever earlier runs on this machine kept
    env = {**os.environ, "AUTOTUNE_CACHE_DIR": str(directory / "calibration-cache")}
    rows = []
    for run in range(1, runs + 1):
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
        wall_s = time.perf_counter() - start
        summary_file = out / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        stages = summary.get("stage_seconds", {})
        rows.append({"model": case.name, "run": run, "batch": case.batch, "device": case.device,
                     "exit": done.returncode, "wall_s": wall_s,
                     **{f"{stage}_s": stages.get(f"{stage}_s", float("nan")) for stage in STAGES},
                     "other_s": stages.get("other_s", float("nan")), "trials": summary.get("trials"),
                     "load_before": load_before, "load_after": os.getloadavg()[0],
                     "verdict": summary.get("verdict") or (done.stderr.strip().splitlines() or [""])[-1][:120]})
        print(f"{case.name} run {run}: exit {done.returncode}, {wall_s:.1f} s, {stages}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks cli-time", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--runs", type=int, default=1, help="runs of each model in the same output directory")
    parser.add_argument("--trials", type=int, default=200, help="search trials (the CLI's default, 200)")
    parser.add_argument("--name", default="cli_time", help="results file name under benchmarks/results/")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in names if name not in CASES]
    if unknown or not names or args.runs < 1:
        print(f"error: unknown model {unknown[0]!r}; known: {', '.join(CASES)}" if unknown
              else "error: give at least one model and one run", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for name in names:
            rows += _run(CASES[name], Path(directory), args.runs, args.trials)
    table = pd.DataFrame(rows)
    command = "python -m benchmarks cli-time" + ("" if args.models == ",".join(CASES) else f" --models {args.models}")
    command += "" if args.runs == 1 else f" --runs {args.runs}"
    command += "" if args.trials == 200 else f" --trials {args.trials}"
    notes = [f"Seconds of each stage of `python -m autotune` (summary.json's stage_seconds) in a fresh process per "
             f"run; wall_s is the process's wall time (TensorFlow's start-up included: other_s is what no stage "
             f"covers). Target: about {TARGET_S:.0f} s on a 2-core machine; "
             + "; ".join(f"{row['model']} run {row['run']}: {row['wall_s']:.0f} s" for row in rows) + ".",
             "load_before/load_after: the 1-minute load average (os.getloadavg) around each run; above 2 on this "
             "2-core machine the run shared its cores."]
    path = write_results(args.name, table, settings={"command": command, "trials": args.trials,
                                                     "cases": {n: CASES[n].__dict__ for n in names}}, notes=notes)
    print(table.drop(columns=["verdict"]).to_string(index=False))
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
