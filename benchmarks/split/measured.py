"""Split plans measured on the CPU testbed: the peak against its prediction and against the unsplit floor.

    python -m benchmarks split-measured [--parts 2 4] [--runs 5]

Per model and number of parts k: the floor of the captured step (no plan that moves whole tensors goes
under it), the floor after splitting the ops that set it in k parts (``simulator.split.floor_after_splitting``),
the lowest predicted peak of a small grid of swap parameters on the unsplit step and on the split step (the
grid: thresholds 1-3, swap-in windows 5 and 20, both orders, both triggers, both distances, every tensor or
activations only), the chosen split plan built by ``rewriter.apply`` and its peak measured ``--runs`` times
in this process (``rewriter.measure``), and its weights after three steps against Keras' own (max relative
difference of a weight to its scale), beside Keras' own step on the batch in another sample order: splitting
sums over the batch in another order, so the comparison is with Keras' own rounding, not bitwise.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import numpy as np
import pandas as pd

from benchmarks.common import start_measuring_process, write_results

NAME = "split_measured"
MiB = 2 ** 20
# model name -> (benchmarks.models builder keyword arguments, batch)
MODELS = {"small_cnn-32": ({"image_size": 32}, 8), "small_cnn-64": ({"image_size": 64}, 16)}
STEPS = 3


def _grid():
    from simulator import SwapParams

    for threshold, ub, order, trigger, distance, tensors in itertools.product(
            (1, 2, 3), (5, 20), ("cto", "memory"), ("ancestor", "level"), ("level", "slot"), ("activations", "all")):
        yield SwapParams(threshold=threshold, ub=ub, order=order, trigger=trigger, distance=distance, tensors=tensors)


def _lowest(graph, kept_reads):
    """The plan of the grid with the lowest predicted peak on ``graph`` (testbed), and that peak."""
    from simulator import GraphError, plan_swaps, replay

    best = None
    for params in _grid():
        try:
            plan = plan_swaps(graph, params, kept_reads=kept_reads)
        except GraphError:
            continue
        peak = replay(graph, plan, "cpu-testbed").peak_bytes
        if best is None or peak < best[1]:
            best = (plan, peak)
    return best


def row_of(name: str, parts: int, runs: int) -> dict:
    import rewriter
    from benchmarks.models import build_model, example_batch
    from simulator.split import floor_after_splitting

    kwargs, batch = MODELS[name]
    build = lambda: build_model("small_cnn", seed=0, **kwargs)  # noqa: E731
    graph = rewriter.capture(build(), batch)
    found = floor_after_splitting(graph, parts)
    kept = rewriter.detect().kept_reads
    _, unsplit_peak = _lowest(graph, kept)
    plan, predicted = _lowest(found.split_graph, kept)
    model, reference, permuted = build(), build(), build()
    x, y = example_batch(model, batch)
    start = _weights(model)
    step = rewriter.apply(model, plan.to_named(found.split_graph), batch_size=batch)
    peaks = [rewriter.measure(step, x, y, warmup=1, repeats=1).peak_bytes for _ in range(runs)]
    order = np.random.default_rng(1).permutation(batch)
    for _ in range(STEPS):
        step(x, y)
        reference.train_on_batch(x, y)
        permuted.train_on_batch(x[order], y[order])
    split_diff = _differences(_weights(model), _weights(reference))
    own_diff = _differences(_weights(permuted), _weights(reference))
    return {"model": name, "batch": batch, "parts": parts, "floor_MiB": found.floor_bytes / MiB,
            "split_floor_MiB": found.split_floor_bytes / MiB, "best_unsplit_pred_MiB": unsplit_peak / MiB,
            "swaps": plan.n_swaps, "predicted_MiB": predicted / MiB,
            "measured_median_MiB": statistics.median(peaks) / MiB, "measured_max_MiB": max(peaks) / MiB,
            "max_over_pred": max(peaks) / predicted, "median_over_pred": statistics.median(peaks) / predicted,
            "measured_over_floor": max(peaks) / found.floor_bytes,
            "verified": bool(step.verification is not None and step.verification.ok),
            "trained": min(_differences(start, _weights(reference))) > 0, "weights_rel_diff": max(split_diff),
            "keras_permuted_rel_diff": max(own_diff),
            "within_keras_rounding": all(a <= max(1e-5, b) for a, b in zip(split_diff, own_diff))}


def _weights(model) -> list[np.ndarray]:
    return [np.array(v.numpy(), np.float64) for v in model.weights]


def _differences(a: list[np.ndarray], b: list[np.ndarray]) -> list[float]:
    """Per weight: the largest difference as a share of the weight's scale."""
    return [float(np.abs(x - y).max(initial=0.0) / max(np.abs(y).max(initial=0.0), 1e-12)) for x, y in zip(a, b)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks split-measured", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=int, nargs="+", default=[2, 4], help="numbers of parts k (each >= 2)")
    parser.add_argument("--runs", type=int, default=5, help="measured runs per plan")
    parser.add_argument("--name", default=NAME, help="results file name")
    args = parser.parse_args(argv)
    if any(k < 2 for k in args.parts) or args.runs < 1:
        print("--parts must be 2 or more and --runs at least 1", file=sys.stderr)
        return 2
    start_measuring_process()
    rows = []
    for name in MODELS:
        for parts in sorted(set(args.parts)):
            rows.append(row_of(name, parts, args.runs))
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    table = pd.DataFrame(rows)
    within = int(((table.max_over_pred <= 1.05) & (table.median_over_pred >= 0.95)).sum())
    below = int((table.max_over_pred < 0.95).sum())
    path = write_results(args.name, table, settings={
        "command": ("python -m benchmarks split-measured " + " ".join(argv or [])).strip(), "runs": args.runs,
        "parts": ", ".join(map(str, sorted(set(args.parts))))},
        notes=["The floor bounds every plan that moves whole tensors; a split plan's measured peak below it "
               "(measured_over_floor < 1) is what splitting adds. Peaks are measured in this process on the "
               "testbed's accelerator (CPU:0), as rewriter.measure reports them.",
               f"{within} of {len(table)} plans measured within 5 % of their prediction on every run, {below} "
               "below it by more (the safe side). On the testbed each copy out runs where the replay has it: "
               "waited for by the op after its producer, and by the swap-ins its producer starts "
               "(docs/design.md 11)."])
    print(path)
    return 0
