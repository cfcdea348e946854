"""Replays per second of ResNet-50's captured training graph (batch 32) with a non-trivial plan.

    python -m benchmarks.simulator_speed [--batch 32] [--seconds 3]

Target (DESIGN.md 5): about 1 ms per replay, i.e. 1,000 replays/s on one core. The tuner calls
plan + replay once per trial, so both are timed.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from benchmarks.common import per_second, write_results
from benchmarks.graphs import captured_graph
from simulator import SwapParams, plan_swaps, replay

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=3.0, help="time spent per measurement")
    args = parser.parse_args(argv)

    g = captured_graph("resnet50").with_batch(args.batch)
    params = SwapParams(threshold=20, lb=2, ub=12, groupby=2)
    plan = plan_swaps(g, params)
    base = replay(g, None, "v100-16gb")
    result = replay(g, plan, "v100-16gb")
    replays, _ = per_second(lambda: replay(g, plan, "v100-16gb"), min_seconds=args.seconds)
    plans, _ = per_second(lambda: plan_swaps(g, params), min_seconds=args.seconds)
    trials, _ = per_second(lambda: replay(g, plan_swaps(g, params), "v100-16gb"), min_seconds=args.seconds)
    table = pd.DataFrame([{
        "graph": f"resnet50 b{args.batch}", "ops": g.n_ops, "swaps": plan.n_swaps, "swap_ins": plan.n_swap_ins,
        "replays_per_s": round(replays), "ms_per_replay": 1e3 / replays, "plans_per_s": round(plans),
        "trials_per_s": round(trials), "peak_GiB": result.peak_bytes / 2**30, "baseline_peak_GiB": base.peak_bytes / 2**30,
    }])
    path = write_results("simulator_speed", table, settings={
        "params": params.to_dict(), "device": "v100-16gb", "command": "python -m benchmarks.simulator_speed"},
        notes=["Target: 1,000 replays/s on one core (about 1 ms per replay).",
               f"Rates: the fastest of 5 timed rounds of about {args.seconds / 5:.1f} s each (timeit), one process."])
    print(table.to_string(index=False))
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
