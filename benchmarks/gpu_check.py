"""A first check on a real GPU: does a swap plan save the memory it promises there?

    python -m benchmarks gpu-check [--model resnet50] [--batch 16] [--swaps 20] [--memory 12GiB]
    python -m benchmarks gpu-check --dry-run --model small_cnn --batch 8   # no GPU needed

ResNet-50 at a small batch, a plan of about ``--swaps`` swaps (every far read of the largest
activations) and the empty plan, each measured on GPU:0 (``rewriter.timing.measurement``: the peak in requested
bytes from the profiler, as the prediction counts, beside TensorFlow's allocator figure) next to the
simulator's prediction for the GPU's preset. From the partition graphs of the swapped step's first call
(``rewriter.check.verification``) it lists, for every swap-in, the ops its copy to the GPU waits for: each must be
its trigger (or the ops apply gave it instead); a copy that waits for nothing is the failure this check
is for (the copy would start right after the copy out, and the swap would save nothing).

``--memory`` makes the budget GPU:0's memory limit before the model is built. ``--dry-run`` needs no
GPU: it builds the GraphDef the GPU would run (``rewriter.rewritten_graph_def``), runs Grappler's GPU
passes on it offline (``rewriter.step.gpu_graph.optimize_for_gpu``) and checks the same two properties on it:
every host-side node a GPU swap-in reads waits for the swap-in's control sources, and nothing stands
between a producer and its swap-out. Writes ``benchmarks/results/gpu_check.{csv,md}`` (``--dry-run``:
``gpu_check_dry.*``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import pandas as pd

from benchmarks.common import write_results

log = logging.getLogger(__name__)
MiB = 2**20


def plan_of_about(graph, n_swaps: int, kept_reads=()):
    """The plan swapping every far read (threshold 1) of the largest tensors, with a size filter whose
    number of swaps comes nearest ``n_swaps`` (tensors of equal size come in or go out together)."""
    from simulator import SwapParams, plan_swaps

    def plan(min_bytes: int):
        return plan_swaps(graph, SwapParams(threshold=1, min_bytes=min_bytes), kept_reads=kept_reads)

    low, high = 0, 1 << 40  # min_bytes: at least n_swaps swaps at low, fewer at high
    while high - low > 1:
        middle = (low + high) // 2
        if plan(middle).n_swaps >= n_swaps:
            low = middle
        else:
            high = middle
    more, fewer = plan(low), plan(high)
    return more if more.n_swaps - n_swaps <= n_swaps - fewer.n_swaps or not fewer.n_swaps else fewer


def between_producer_and_swap_out(optimized, step) -> list[str]:
    """Swap-outs that no longer read their tensor's producer after Grappler (a Transpose put between)."""
    nodes = {node.name: node for node in optimized.node}
    found = []
    for swap in step.applied:
        node = nodes.get(swap.swap_out)
        if node is None:
            found.append(f"{swap.swap_out}: removed")
            continue
        source = node.input[0].split(":")[0]
        if source != swap.tensor.split(":")[0]:
            found.append(f"{swap.swap_out} <- {source} ({nodes[source].op if source in nodes else '?'})")
    return found


def _row(label: str, plan, predicted, measured=None, verification=None) -> dict[str, Any]:
    row: dict[str, Any] = {"plan": label, "swaps": plan.n_swaps, "swap_ins": plan.n_swap_ins,
                           "predicted_MiB": predicted.peak_bytes / MiB, "pred_step_s": predicted.step_s}
    if measured is not None:
        row.update(measured_MiB=measured.peak_bytes / MiB, allocator_MiB=measured.allocator_peak_bytes / MiB,
                   ratio=predicted.peak_bytes / measured.peak_bytes if measured.peak_bytes else None,
                   meas_step_s=measured.step_s, host_peak_MiB=(measured.host_peak_bytes or 0) / MiB,
                   jit_compile=measured.jit_compile)
    if verification is not None:
        row.update(verified=verification.ok, copies_waiting=f"{verification.copies_waiting}/{verification.copies_checked}")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", help="a benchmarks.models name (default resnet50)")
    parser.add_argument("--image-size", type=int, default=None, help="input size (default: the model's)")
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    parser.add_argument("--swaps", type=int, default=20, help="about this many swaps (default 20)")
    parser.add_argument("--memory", default=None, help="GPU:0's memory limit, e.g. 12GiB (default: none)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per plan (default 5)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: build and check the GPU GraphDef only")
    parser.add_argument("--out", default=None, help="result folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.swaps < 1 or args.repeats < 1:
        print("--batch, --swaps and --repeats must be >= 1", file=sys.stderr)
        return 2
    from rewriter.environment import prepare_environment

    prepare_environment()  # before TensorFlow is imported
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from autotune.inputs import InputError, parse_bytes

    try:
        limit = parse_bytes(args.memory) if args.memory else None
    except InputError as error:
        print(f"--memory: {error}", file=sys.stderr)
        return 2
    import tensorflow as tf

    import rewriter
    from autotune.run.plan_run import run_plan
    from benchmarks.models import build_model
    from rewriter.step.gpu_graph import host_side_problems, jit_compile_note, optimize_for_gpu
    from rewriter.trace.step_inputs import synthetic_batch
    from rewriter.placement.placements import limit_device_memory
    from simulator import SwapPlan, get_device, replay

    if not tf.config.list_physical_devices("GPU") and not args.dry_run:
        print("no GPU visible to TensorFlow (scripts/setup --gpu installs the GPU build); "
              "--dry-run checks the GPU GraphDef without one", file=sys.stderr)
        return 2
    if limit is not None and not args.dry_run and not limit_device_memory(limit):
        print("could not set GPU:0's memory limit (TensorFlow had started)", file=sys.stderr)
        return 2
    kwargs = {} if args.image_size is None else {"image_size": args.image_size}
    try:
        model = build_model(args.model, **kwargs)
    except (ValueError, TypeError) as error:
        print(f"--model: {error}", file=sys.stderr)
        return 2
    graph = rewriter.capture(model, args.batch)
    placement = rewriter.GpuPlacement()
    device = get_device((placement.simulator_device if not args.dry_run else None) or "v100-16gb")
    plan = plan_of_about(graph, args.swaps, device.kept_reads)
    empty = SwapPlan.empty(graph)
    settings = {"model": f"{args.model}({', '.join(f'{k}={v}' for k, v in kwargs.items())}) b{args.batch}",
                "plan": f"threshold=1 over the {plan.n_swaps} largest swappable tensors (asked: about {args.swaps})", "device": device.name,
                "memory_limit": args.memory or "none", "command": "python -m benchmarks gpu-check " + " ".join(argv or sys.argv[1:])}
    notes: list[str] = []
    if args.dry_run:
        step = rewriter.apply(model, plan, graph=graph, batch_size=args.batch, placement=placement, verify=False)
        fetches = [tensor.name for tensor in step.traced.concrete.outputs]
        problems = host_side_problems(step.graph_def, step.applied, step.placement.host)
        inserted = between_producer_and_swap_out(optimize_for_gpu(step.graph_def, fetches), step)
        rows = [_row("none", empty, replay(graph, empty, device)), _row("swaps", plan, replay(graph, plan, device))]
        rows[1].update(host_side_ok=not problems, nothing_before_swap_outs=not inserted)
        notes += ["## What each GPU-side swap-in reads (host-side node: its control inputs)", ""]
        nodes = {node.name: node for node in step.graph_def.node}
        for swap in step.applied:
            for item in swap.swap_ins:
                host = nodes[item.host_node]
                waits = [ref[1:] for ref in host.input if ref.startswith("^")]
                notes.append(f"- `{item.name}` ({nodes[item.name].device}) reads `{host.name}` ({host.device}), "
                             f"which waits for {', '.join(f'`{w}`' for w in waits) or 'nothing'}")
        notes += [""] + [f"- problem: {line}" for line in problems + inserted]
        path = write_results("gpu_check_dry", pd.DataFrame(rows), settings=settings, notes=notes, directory=args.out)
        print(f"{step.n_swap_ins} swap-in(s): {len(problems)} host-side problem(s), {len(inserted)} swap-out(s) "
              f"with something before them; {path}")
        return 0 if not problems and not inserted else 1

    data = synthetic_batch(model, args.batch)
    rows = []
    for label, this in (("none", empty), ("swaps", plan)):
        run = run_plan(model, graph, this, device, data, warmup=2, repeats=args.repeats)
        if run.out_of_memory:
            print(f"the {label} step ran out of memory at batch {args.batch}", file=sys.stderr)
            return 1
        step = run.step
        rows.append(_row(label, this, run.predicted, run.measured, step.verification))
        if step.verification is not None:
            v = step.verification
            notes += [f"## {label}: verification", "", f"- {v.summary()}", "",
                      "## What each GPU-side copy waits for (from the partition graphs)", ""]
            notes += [f"- `{name}`: {', '.join(f'`{w}`' for w in waits) or 'NOTHING (starts right after the copy out)'}"
                      for name, waits in v.copy_waits.items()]
            notes.append("")
    notes.append(f"- {jit_compile_note(model)[1]}")
    path = write_results("gpu_check", pd.DataFrame(rows), settings=settings, notes=notes, directory=args.out)
    saved = rows[0]["measured_MiB"] - rows[1]["measured_MiB"]
    promised = rows[0]["predicted_MiB"] - rows[1]["predicted_MiB"]
    print(f"measured saving {saved:.1f} MiB of a predicted {promised:.1f} MiB; {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
