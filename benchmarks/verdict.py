"""The verdict on models the simulator was not tuned for: never "fits" over the budget.

    python -m benchmarks verdict [--cases NAME,...]

The cases are those a new user met before the measured run decided the verdict (docs/design.md 6): a
mixed_float16 CNN and U-Net, LSTM and GRU classifiers, a U-Net with transposed convolutions (swapped,
and without swapping against model.fit's own step), a multi-input multi-output model. Each zoo model
is saved, its budget set from the simulator's own prediction (so the prediction alone says "fits"),
and ``python -m autotune`` runs on it in a fresh process on the CPU testbed. A case passes when the
tool's exit code and verdict stand: exit 0 only with a measured peak within the budget, confirmed
by measurement; otherwise exit 3 and a verdict that does not say "fits".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from benchmarks.common import write_results
from benchmarks.zoo import ZOO

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    budget: str  # "baseline" (the prediction without swapping, plus `slack`) or "swap" (between the lowest swap peak and it)
    slack: float = 0.03


CASES = (
    Case("mixed_float16 CNN, fits as predicted", "mixed16_cnn", "baseline"),
    Case("mixed_float16 U-Net, swapped", "mixed16_unet2d", "swap"),
    Case("LSTM classifier, fits as predicted", "lstm", "baseline", 0.10),
    Case("GRU classifier, fits as predicted", "gru", "baseline", 0.10),
    Case("U-Net, transposed convolutions, swapped", "unet2d_transpose", "swap"),
    Case("U-Net, transposed convolutions, without swapping", "unet2d_transpose", "baseline", 0.05),
    Case("multi-input multi-output, swapped", "multi_io", "swap"),
)


def _budget(case: Case, model, batch: int) -> tuple[int, int, int]:
    """(budget, predicted unswapped peak, lowest predicted swap peak) at ``batch`` on the testbed."""
    from rewriter.trace.tracing import capture
    from simulator import SwapParams, plan_swaps, replay

    graph = capture(model, batch)
    unswapped = replay(graph, None, "cpu-testbed").peak_bytes
    lowest = replay(graph, plan_swaps(graph, SwapParams(threshold=1, lb=1, ub=8, sync="both")), "cpu-testbed").peak_bytes
    budget = int(unswapped * (1 + case.slack)) if case.budget == "baseline" else (unswapped + lowest) // 2
    return budget, unswapped, lowest


def _run_case(case: Case, directory: Path, trials: int) -> dict:
    entry = ZOO[case.model]
    model = entry.build()
    model_dir = directory / case.model
    if not model_dir.exists():
        model_dir.mkdir(parents=True)
        model.save(model_dir / "model.keras")
    budget, unswapped, lowest = _budget(case, model, entry.batch)
    out = directory / f"out-{len(list(directory.glob('out-*')))}"
    done = subprocess.run([sys.executable, "-m", "autotune", str(model_dir), "--batch-size", str(entry.batch),
                           "--memory", str(budget), "--device", "cpu-testbed", "--trials", str(trials), "--out",
                           str(out), "--quiet"], capture_output=True, text=True, cwd=ROOT)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    measured = summary.get("measured_peak_bytes")
    rounds = summary.get("measured_rounds") or []
    says_fits = str(summary.get("headline", "")).startswith("Fits")
    honest = ((done.returncode == 0 and says_fits and bool(summary.get("confirmed_by_measurement"))
               and measured is not None and summary.get("measured_batch_size") == entry.batch and measured <= budget)
              or (done.returncode == 3 and not says_fits))
    first = rounds[0] if rounds else {}
    return {
        "case": case.name, "model": case.model, "batch": entry.batch, "budget_MiB": budget / MiB,
        "predicted_unswapped_MiB": unswapped / MiB, "lowest_swap_MiB": lowest / MiB,
        "first_predicted_MiB": first.get("predicted_bytes", float("nan")) / MiB if first else float("nan"),
        "first_measured_MiB": (first.get("measured_bytes") or float("nan")) / MiB if first else float("nan"),
        "rounds": len(rounds), "exit": done.returncode, "verdict": summary.get("verdict"),
        "train_with": summary.get("train_with"), "final_measured_MiB": (measured or float("nan")) / MiB,
        "plain_fit_MiB": (summary.get("measured_plain_fit_peak_bytes") or float("nan")) / MiB,
        "honest": honest, "headline": summary.get("headline") or done.stderr.strip().splitlines()[-1:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks verdict", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", help="comma-separated zoo model names (default: every case)")
    parser.add_argument("--trials", type=int, default=60, help="search trials per round (default 60)")
    args = parser.parse_args(argv)
    wanted = set(args.cases.split(",")) if args.cases else None
    cases = [c for c in CASES if wanted is None or c.model in wanted]
    if not cases:
        print(f"error: no case for {args.cases!r}; known: {', '.join(sorted({c.model for c in CASES}))}",
              file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for case in cases:
            row = _run_case(case, Path(directory), args.trials)
            print(f"{case.name}: exit {row['exit']}, {row['verdict']}, honest={row['honest']}", file=sys.stderr)
            rows.append(row)
    table = pd.DataFrame(rows)
    honest = int(table["honest"].sum())
    notes = [f"{honest} of {len(table)} cases honest: exit 0 only with a confirmed measured peak within the budget at "
             "the requested batch, otherwise exit 3 and no 'Fits'. budget: the predicted unswapped peak plus the "
             "case's slack ('fits as predicted'), or halfway between the lowest swap plan's predicted peak and the "
             "unswapped one ('swapped'). first_*: the first plan's prediction and measurement (before any correction)."]
    write_results("verdict", table, settings={
        "command": "python -m benchmarks verdict" + (f" --cases {args.cases}" if args.cases else ""),
        "trials": args.trials, "measured_on": "cpu-testbed (CPU:0 accelerator, CPU:1 host)"}, notes=notes)
    print(table.drop(columns=["headline"]).to_string(index=False))
    return 0 if honest == len(table) else 1


if __name__ == "__main__":
    sys.exit(main())
