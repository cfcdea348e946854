"""The floor before and after splitting along the batch, over the benchmark models and the zoo (simulated).

    python -m benchmarks floor-split [--parts 2 4 8] [--models resnet50 zoo:lstm ...]

The floor is the least peak any plan of swaps and recomputations can reach: resident memory plus the
largest working set of one op (``simulator.buffers.peak_lower_bound_bytes``). Per model, from its
cached captured graph (``benchmarks.models.graphs``; a missing one is captured with TensorFlow first):
the unswapped peak and the floor, and the floor after splitting the ops that set it in k parts along
the batch (``simulator.split.floor_after_splitting``), as shares of the unswapped peak; the split
graph's own unswapped peak, which no replay of it goes under the floor of, in op-major order and in the
micro-batch order (each part's forward and backward in turn); what sets the floor at the
largest k. Each model at the batch whose unswapped step fills the v100-16gb preset's budget (where a
user starts to need the tool), the zoo's models also at their testbed batch. The 3D U-Net trains at
batch 1 (it grows by voxels), where no split along the batch exists. The rewriter builds these splits and
the CLI offers them under the floor (docs/design.md 12); ``split-measured`` measures some on the testbed.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from autotune.run.floor import state_floor_bytes
from autotune.run.tuning import max_batch_without_swap
from benchmarks.common import write_results
from benchmarks.models.graphs import captured_graph, zoo_graph
from benchmarks.zoo import ZOO
from rewriter.errors import CaptureError
from simulator import UPDATE, OpGraph, get_device, replay
from simulator.buffers import peak_lower_bound_bytes
from simulator.split import SplitFloor, floor_after_splitting, split_origin
from simulator.state import movable_state

NAME = "floor_split"
DEVICE = "v100-16gb"
MiB = 2 ** 20
TARGET_PCT = 40.0  # the median floor after splitting, as a share of the unswapped peak (docs/design.md 12)
# the benchmark models (``benchmarks.models``) and their builders' keyword arguments
BENCHMARK_MODELS: dict[str, dict] = {"resnet50": {}, "vgg16": {}, "mobilenetv2": {}, "densenet121": {},
                                     "unet2d": {}, "unet3d": {"size": 64}, "transformer_encoder": {}}
FIXED_BATCH = {"unet3d": 1}
# ops that run a function of their own: what they do across samples is not known from the step's graph
LOOPS = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "PartitionedCall", "StatefulPartitionedCall"})  # trains at batch 1: its size grows by voxels per sample


def graph_of(name: str) -> OpGraph:
    """A benchmark model's graph, or a zoo model's (``zoo:NAME``)."""
    if name.startswith("zoo:"):
        return zoo_graph(name[4:])
    return captured_graph(name, **BENCHMARK_MODELS[name])


def set_by(g: OpGraph, found: SplitFloor) -> str:
    """What sets the floor after splitting, in a word: a part of a region, or why the op there is not split."""
    op = g.op_index()[split_origin(found.binding_op)]
    if found.binding_op != split_origin(found.binding_op):
        return "a split part"
    if g.op_phase[op] == UPDATE:
        return "an optimizer update"
    if g.op_type[op] in LOOPS:
        return "a loop or call"
    return f"a {g.op_type[op]}"


def row_of(name: str, graph: OpGraph, batch: int, rule: str, parts: list[int]) -> dict:
    """One model at one batch: its peak, its floor, the floor after splitting in each number of parts."""
    g = graph.with_batch(batch)
    peak = replay(g, None, DEVICE).peak_bytes
    row = {"model": name, "batch": batch, "batch_rule": rule, "ops": g.n_ops, "peak_MiB": peak / MiB,
           "resident_pct": 100 * g.persistent_bytes / peak, "floor_pct": 100 * peak_lower_bound_bytes(g) / peak}
    found, floors = None, {}
    for k in parts:  # more parts than samples: one sample a part
        if batch > 1:
            if min(k, batch) not in floors:
                floors[min(k, batch)] = floor_after_splitting(g, min(k, batch))
            found = floors[min(k, batch)]
        row[f"k{k}_pct"] = 100 * found.split_floor_bytes / peak if found else row["floor_pct"]
    if batch < max(parts):
        row["parts_note"] = f"batch {batch}: {batch} parts at most" if batch > 1 else "batch 1: no split"
    # what the tool's search reaches with both: the split step with every movable weight and slot on the host
    split_step = found.split_graph if found is not None and found.regions else g
    row[f"k{max(parts)}_state_pct"] = 100 * state_floor_bytes(split_step, get_device(DEVICE)) / peak
    row["state_movable"] = len(movable_state(g))
    if found is not None:
        binding = split_origin(found.binding_op)
        row["set_by"] = set_by(g, found)
        row.update({"split_peak_pct": 100 * replay(found.split_graph, None, DEVICE).peak_bytes / peak,
                    "micro_peak_pct": 100 * replay(found.split_graph.with_order("micro-batch"), None,
                                                   DEVICE).peak_bytes / peak,
                    "region_ops": found.region_ops,
                    "binding": f"{g.op_type[g.op_index()[binding]]} {binding}"[:70],
                    "stop": found.stop_reason.split(":")[0].split(" (")[0][:110]})
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks floor-split", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=int, nargs="+", default=[2, 4, 8], help="numbers of parts k (each >= 2)")
    parser.add_argument("--models", nargs="+", default=list(BENCHMARK_MODELS) + [f"zoo:{name}" for name in ZOO],
                        help="benchmark models and zoo models as zoo:NAME (default: all)")
    parser.add_argument("--name", default=NAME, help="results file name")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in BENCHMARK_MODELS and m.removeprefix("zoo:") not in ZOO]
    if unknown or any(k < 2 for k in args.parts):
        print(f"unknown models {unknown}" if unknown else "--parts must be 2 or more", file=sys.stderr)
        return 2
    parts = sorted(set(args.parts))
    budget = get_device(DEVICE).budget_bytes
    rows, failed = [], []
    for name in args.models:
        try:
            graph = graph_of(name)
        except CaptureError as error:  # a step the capture cannot size is a line of the notes
            failed.append(f"{name}: {str(error).splitlines()[0][:160]}")
            continue
        batch = FIXED_BATCH.get(name) or max_batch_without_swap(graph, budget, get_device(DEVICE))
        rows.append(row_of(name, graph, batch, "fixed" if name in FIXED_BATCH else f"fills {DEVICE}", parts))
        if name.startswith("zoo:"):
            rows.append(row_of(name, graph, ZOO[name[4:]].batch, "testbed", parts))
        print({key: round(value, 1) if isinstance(value, float) else value for key, value in rows[-1].items()},
              flush=True)
    table = pd.DataFrame(rows)
    medians = []
    for rule, group in table.groupby("batch_rule", sort=False):
        if len(group) > 1:
            medians.append({"model": f"median ({len(group)} models)", "batch_rule": rule,
                            **group.select_dtypes("number").drop(columns=["batch", "ops"]).median().to_dict()})
    table = pd.concat([table, pd.DataFrame(medians)], ignore_index=True)
    largest = max(parts)
    fills = table[(table["batch_rule"] == f"fills {DEVICE}") & ~table["model"].str.startswith("median")]
    testbed = table[(table["batch_rule"] == "testbed") & ~table["model"].str.startswith("median")]

    def verdict(group: pd.DataFrame) -> str:
        median = group[f"k{largest}_pct"].median()
        causes = ", ".join(f"{cause} {count}" for cause, count in group["set_by"].value_counts().items())
        return (f"median floor after splitting in {largest} parts {median:.1f} % of the unswapped peak over "
                f"{len(group)} models (before: {group['floor_pct'].median():.1f} %): target <= {TARGET_PCT:.0f} % "
                + ("met" if median <= TARGET_PCT else "missed")
                + (" (and before splitting)" if group["floor_pct"].median() <= TARGET_PCT else "")
                + f"; what sets the floor after: {causes}; with every movable weight and optimizer slot on the host "
                f"too (what the search combines): {group[f'k{largest}_state_pct'].median():.1f} %; the split step's "
                f"unswapped peak in the micro-batch order: median {group['micro_peak_pct'].median():.1f} %, under "
                f"60 % for {int((group['micro_peak_pct'] < 60).sum())} models")

    notes = [
        "## Notes", "",
        f"- At the batch that fills {DEVICE}: {verdict(fills)}.",
        f"- At the zoo's testbed batches: {verdict(testbed)}." if len(testbed) else "",
        ("- peak_MiB: the unswapped step's replayed peak (resident state included); resident_pct: the resident "
         "state's share of it; floor_pct: `peak_lower_bound_bytes` over the peak; kK_pct: the floor after "
         "`floor_after_splitting(g, K)` over the same peak; at the largest K: split_peak_pct, the split graph's own "
         "unswapped replay (op-major order: every part of an op before the next op), never under its floor, and "
         "micro_peak_pct the same in the micro-batch order (each part's forward and backward in turn where no op "
         "mixes samples: what a split plan reaches with nothing swapped, docs/design.md 12); "
         "region_ops: ops split; binding: the op whose working set sets the floor after splitting, set_by: what it is, "
         "and stop: why splitting went no further; kK_state_pct: the floor of the same split step with every movable "
         "weight and optimizer slot on the host (`autotune.run.floor.state_floor_bytes`), state_movable: the "
         "variables whose state can move (none under a LossScaleOptimizer, docs/design.md 13)."),
        ("- More parts than samples: one sample a part (`parts_note`)."),
        ("- The 3D U-Net trains at batch 1 (sizes grow by voxels per sample): no split along the batch exists, "
         "its floor stays; splitting it would need the spatial axes (TSPLIT splits those too)."),
        ("- Where a split floor is set by an op that does not grow with the batch (an optimizer update, a weight "
         "gradient's combine) or by resident state, more parts do not lower it."),
        *(f"- Not captured: {line}" for line in failed),
    ]
    settings = {"command": "python -m benchmarks floor-split " + " ".join(argv if argv is not None else sys.argv[2:]),
                "device": DEVICE, "parts": ", ".join(map(str, parts))}
    path = write_results(args.name, table, settings=settings, notes=[n for n in notes if n], float_format="{:.4g}")
    print("\n".join(n for n in notes if n))
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
