"""Captured training graphs of the suite's models, cached as .npz under benchmarks/results/graphs/
so simulation-only benchmarks need TensorFlow once per model and size."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from benchmarks.common import RESULTS_DIR
from benchmarks.models.builders import build_model
from benchmarks.zoo import ZOO
from simulator import OpGraph

# a cached graph is stale when the code that captured it changed
CAPTURE_SOURCES = ("rewriter/trace/tracing.py", "rewriter/trace/graph_rewrites.py", "rewriter/trace/optimizer_state.py")


def _capture_code() -> str:
    root = Path(__file__).resolve().parents[2]
    return hashlib.sha256(b"".join((root / path).read_bytes() for path in CAPTURE_SOURCES)).hexdigest()[:16]


def captured_graph(name: str, graph_rewrites: tuple[str, ...] = (), **kwargs) -> OpGraph:
    """``build_model(name, **kwargs)``'s step captured at batch 1 (sizes are linear in the batch),
    after ``graph_rewrites`` (``rewriter.trace.tracing``'s)."""
    key = "_".join([name] + [f"{k}{v}" for k, v in sorted(kwargs.items())] + list(graph_rewrites))
    return _cached_capture(key, kwargs, lambda: build_model(name, **kwargs), name, graph_rewrites, batch_size=1)


def zoo_graph(name: str) -> OpGraph:
    """The step of ``benchmarks.zoo.ZOO[name]`` captured at its testbed batch (some steps trace to another
    graph at batch 1), cached like ``captured_graph``'s."""
    entry = ZOO[name]
    return _cached_capture(f"zoo_{name}", entry.kwargs, entry.build, name, (), batch_size=entry.batch)


def _cached_capture(key: str, kwargs: dict, build, name: str, graph_rewrites: tuple[str, ...], *,
                    batch_size: int) -> OpGraph:
    """The graph cached under ``key``, captured again (with TensorFlow) when missing or stale."""
    path = RESULTS_DIR / "graphs" / f"{key}.npz"
    if path.exists():
        graph = OpGraph.load(path)
        if (graph.meta.get("build_kwargs") == json.loads(json.dumps(kwargs)) and graph.batch_size == batch_size
                and graph.meta.get("capture_code") == _capture_code()):
            return graph
    from rewriter.environment import prepare_environment  # before TensorFlow is imported

    prepare_environment()
    from rewriter.trace.tracing import capture

    graph = capture(build(), batch_size, name=name, graph_rewrites=graph_rewrites)
    graph.meta["build_kwargs"] = kwargs
    graph.meta["capture_code"] = _capture_code()
    graph.save(path)
    return graph
