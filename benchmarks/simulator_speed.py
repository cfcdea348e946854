"""Replays per second of ResNet-50's captured training graph (batch 32) with a non-trivial plan.

    python -m benchmarks.simulator_speed [--batch 32] [--seconds 6] [--no-reference]

Target (docs/design.md 5, issue 23): <= 0.1 ms per replay (474 swaps), 10,000 replays/s on one core. The
tuner calls plan + replay once per trial, so both are timed, beside the simulator at
``benchmarks.reference.REFERENCE_COMMIT`` (the numpy replay) in the same process.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from benchmarks.common import write_results
from benchmarks.graphs import captured_graph
from benchmarks.reference import REFERENCE_COMMIT, reference_simulator, speed_row
from simulator import SwapParams, plan_swaps, replay

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=6.0, help="time spent measuring")
    parser.add_argument("--no-reference", action="store_true", help="time today's simulator only")
    args = parser.parse_args(argv)

    g = captured_graph("resnet50").with_batch(args.batch)
    params = SwapParams(threshold=20, lb=2, ub=12, groupby=2)
    reference = None if args.no_reference else reference_simulator()
    base = replay(g, None, "v100-16gb")
    result = replay(g, plan_swaps(g, params), "v100-16gb")
    row = speed_row(g, params, "v100-16gb", reference, args.seconds)
    table = pd.DataFrame([{"graph": f"resnet50 b{args.batch}", **row, "replays_per_s": round(1e3 / row["ms_per_replay"]),
                           "peak_GiB": result.peak_bytes / 2**30, "baseline_peak_GiB": base.peak_bytes / 2**30}])
    path = write_results("simulator_speed", table, settings={
        "params": params.to_dict(), "device": "v100-16gb", "command": "python -m benchmarks.simulator_speed"},
        notes=["Target (issue 23): 10,000 replays/s on one core (<= 0.1 ms per replay).",
               "ms_per_*: the fastest of 7 timed rounds (timeit), with the median and slowest; trial: plan_swaps + "
               f"replay; *_reference: the simulator at {REFERENCE_COMMIT} (numpy replay), its rounds taken in turn "
               "with today's in the same process; identical: every Replay field equal."])
    print(table.to_string(index=False))
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
