"""The graphs a step's first call ran, as TensorFlow collects them, and what is read from them.

TensorFlow optimises a function when it is first instantiated. With graph collection on
(``context.context().enable_graph_collection()``) that first call records, per function, the
post-optimization graph and the per-device partition graphs (``export_run_metadata()``). The swap
check (``rewriter.check.verification``), the recomputation check (``rewriter.check.recompute_check``) and the measured
constants (``rewriter.timing.measurement``) read them.
"""

from __future__ import annotations

import re
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context

from rewriter.placement import memtrace

# A node a Grappler optimizer rewrote under a new name: "ArithmeticOptimizer/AddOpsRewrite_AddN_3"
# (the 3D U-Net's gradient sums, once elide-broadcasts made them AddV2 chains, are merged that way),
# inside its scope for a scoped node: "a/MatMul/ArithmeticOptimizer/FoldTransposeIntoMatMul_MatMul"
# stands for "a/MatMul/MatMul" (an attention gradient's matrix product)
_RENAMED = re.compile(r"^(.*/)?[A-Za-z]+Optimizer/[A-Za-z]+_([^/]+)$")


def grappler_renames(names) -> dict[str, str]:
    """Original name -> the name a Grappler optimizer gave the node, for ``names`` of a graph."""
    return {(match.group(1) or "") + match.group(2): name for name in names if (match := _RENAMED.match(name))}


def pick_function_graph(function_graphs, names: set[str]):
    """The collected function whose optimized graph holds the most of our swap nodes."""
    best, best_count = None, -1
    for fg in function_graphs:
        count = sum(1 for node in fg.post_optimization_graph.node if node.name in names)
        for partition in fg.partition_graphs:
            count += sum(1 for node in partition.node if node.name in names)
        if count > best_count:
            best, best_count = fg, count
    return best if best_count > 0 else None


def collect_first_call(fn, *args) -> tuple[Any, list[Any]]:
    """Run ``fn(*args)`` with graph collection on; return its result and the collected function graphs.

    Only a function's first call (its instantiation) records graphs.
    """
    ctx = context.context()
    ctx.export_run_metadata()  # drop anything collected before
    ctx.enable_graph_collection()
    try:
        result = fn(*args)
        for tensor in tf.nest.flatten(result):
            if hasattr(tensor, "numpy"):
                tensor.numpy()
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_graph_collection()
    return result, list(metadata.function_graphs) if metadata is not None else []


def constant_nodes(function_graphs) -> set[str]:
    """Names of the ``Const`` nodes of the graphs a function ran (post-optimization and partition graphs)."""
    names: set[str] = set()
    for function in function_graphs:
        for graph in [*function.partition_graphs, function.post_optimization_graph]:
            names.update(node.name for node in graph.node if node.op in ("Const", "HostConst"))
    return names


def profiled_first_call(fn, *args, allocator_prefix: str | None = None) -> tuple[Any, list[Any], int]:
    """``fn``'s first call with graph collection and the profiler on: its result, the graphs that ran
    and the bytes of the constants the call materialised on the accelerator (``memtrace.constant_bytes``;
    ``allocator_prefix``: ``Placement.allocator_prefix``)."""
    found = []

    def run(*inputs):
        found.append(collect_first_call(fn, *inputs))
        return found[-1]

    space = memtrace.profile_call(run, *args)
    result, graphs = found[0]
    return result, graphs, memtrace.constant_bytes(memtrace.memory_events(space), constant_nodes(graphs),
                                                   allocator_prefix)
