"""Simulator speed against graph size, and the end-to-end CLI time for ResNet-50.

    python -m benchmarks speed [--seconds 4] [--no-cli] [--references numpy,compiled,onecall]

Replays (and plans) per second for synthetic training graphs of about 1k, 10k and 100k ops and for
captured graphs (3D U-Net, ResNet-50, DenseNet-121), each with a plan that swaps a good share of
the activations, and ResNet-50 at batch 32 with the 474-swap plan of docs/design.md 5's target. Then ``python -m
autotune`` on a saved ResNet-50 (batch 256, v100-16gb preset, 200 trials, --no-measure) timed as a
user would run it. Targets (docs/design.md 5): ResNet-50 b32 474 swaps <= 0.1 ms per
replay, DenseNet-121 <= 0.2 ms, 100k ops <= 5 ms, on one core; the CLI run in about a minute. The
simulators of ``benchmarks.reference.REFERENCES`` (the numpy replay, the first compiled one, the one-call
replay before its fields were read on demand) are timed beside today's in the same process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from benchmarks.common import RESULTS_DIR, write_results  # noqa: E402
from benchmarks.models.graphs import captured_graph  # noqa: E402
from benchmarks.reference import (REFERENCES, add_reference_options, references_from_options,  # noqa: E402
                                  references_note, speed_row)
from simulator import SwapParams  # noqa: E402
from simulator.synthetic import training_graph  # noqa: E402

PARAMS = SwapParams(threshold=20, lb=2, ub=12, groupby=2, min_bytes=4096)
ALL_TENSORS = SwapParams(threshold=20, lb=2, ub=12, groupby=2)  # no size filter: ResNet-50 b32's 474-swap plan
TARGETS_MS = {"resnet50 (batch 32, all sizes)": 0.1, "densenet121 (batch 32)": 0.2, "synthetic 25000 layers": 5.0}


def _graphs():
    for layers in (250, 2500, 25000):
        yield f"synthetic {layers} layers", training_graph(layers, batch_size=32), PARAMS
    yield "unet3d 64^3 (batch 4)", captured_graph("unet3d", size=64).with_batch(4), PARAMS
    resnet = captured_graph("resnet50").with_batch(32)
    yield "resnet50 (batch 32)", resnet, PARAMS
    yield "resnet50 (batch 32, all sizes)", resnet, ALL_TENSORS
    yield "densenet121 (batch 32)", captured_graph("densenet121").with_batch(32), PARAMS


def _cli_seconds() -> tuple[float, str]:
    """Wall time of the CLI on a freshly saved ResNet-50 (model saving not included)."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as directory:
        subprocess.run([sys.executable, "-m", "benchmarks.models", "save", "resnet50", directory], check=True,
                       capture_output=True, cwd=root)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "autotune", directory, "--batch-size", "256", "--device",
                               "v100-16gb", "--trials", "200", "--no-measure", "--quiet", "--out",
                               str(Path(directory) / "out")], capture_output=True, text=True, cwd=root)
        seconds = time.perf_counter() - start
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return seconds, f"exit {done.returncode}: {last}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0, help="time spent per graph")
    parser.add_argument("--no-cli", action="store_true", help="skip the end-to-end CLI run")
    add_reference_options(parser)
    args = parser.parse_args(argv)

    references = references_from_options(parser, args)
    if references is None:
        return 2
    labels = list(references)
    load_before = os.getloadavg()
    rows = []
    for name, g, params in _graphs():
        rows.append({"graph": name, "min_bytes": params.min_bytes,
                     **speed_row(g, params, "v100-16gb", references, args.seconds)})
        print(rows[-1], flush=True)
    load_after = os.getloadavg()
    table = pd.DataFrame(rows)
    verdicts = [f"{graph}: {row['ms_per_replay']:.3g} ms per replay (median {row['ms_per_replay_median']:.3g}), "
                f"target {target} ms: {'met' if row['ms_per_replay'] <= target else 'missed'}"
                for graph, target in TARGETS_MS.items() for _, row in table[table["graph"] == graph].iterrows()]
    notes = ["Targets (docs/design.md 5): ResNet-50 b32 with the 474-swap plan (all sizes) <= 0.1 ms per replay, "
             "DenseNet-121 <= 0.2 ms, 100k ops (synthetic 25000 layers) <= 5 ms, on one core. " + "; ".join(verdicts)
             + ".",
             "ms_per_replay: the fastest of 15 timed rounds (timeit), with the median and slowest; ms_per_trial: "
             "plan_swaps + replay. " + references_note(labels),
             f"Load average (1, 5, 15 min) before: {load_before[0]:.2f}, {load_before[1]:.2f}, {load_before[2]:.2f}; "
             f"after: {load_after[0]:.2f}, {load_after[1]:.2f}, {load_after[2]:.2f} (a 2-core machine: above 1 the "
             "timed core is shared and the slowest rounds say so)."]
    if not args.no_cli:
        seconds, tail = _cli_seconds()
        notes.append(f"End-to-end `python -m autotune` on ResNet-50 (batch 256, v100-16gb, 200 trials, --no-measure): "
                     f"{seconds:.0f} s wall time, including TensorFlow start-up, loading and capture ({tail}). "
                     "Target: about a minute.")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.loglog(table["ops"], table["ms_per_replay"], "o-", label="replay")
    ax.loglog(table["ops"], table["ms_per_trial"], "s--", label="plan + replay (one trial)")
    for label, style in zip(labels, ("o:", "o-.", "x:")):
        ax.loglog(table["ops"], table[f"ms_per_replay_{label}"], style, color="grey",
                  label=f"{label} replay ({REFERENCES[label][0]})")
    for _, row in table.iterrows():
        ax.annotate(row["graph"].split(" (")[0], (row["ops"], row["ms_per_replay"]), fontsize=7)
    ax.set_xlabel("ops in the graph")
    ax.set_ylabel("milliseconds")
    ax.set_title("Simulator speed (one core)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "speed.png", dpi=110)
    path = write_results("speed", table, settings={"params": PARAMS.to_dict(), "device": "v100-16gb",
                                                   "command": "python -m benchmarks speed"}, notes=notes)
    print(table.to_string(index=False))
    print("\n".join(notes))
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
