"""Variable writes that copy the variable: the old buffer a pending read still holds.

``ReadVariableOp`` returns the variable's own buffer. An update op (``AssignSubVariableOp``,
``AssignAddVariableOp``, ``ResourceApply*``) that finds that buffer referenced by another tensor
copies the variable into a new buffer first and updates the copy (copy-on-write); ``AssignVariableOp``
makes the variable take its value's buffer. Either way the old buffer stays until the last reader of
the read that holds it has run. AdamW's weight decay (``var -= var * wd * lr``) does not wait for the
gradients: run before the backward MatMul that reads the forward's read of the same weight, it
holds the weight twice until that MatMul ran (the 3x1024 Dense MLP: 4 MiB per 1024x1024 kernel,
measured 43.4 MiB where 39.4 were predicted without it; ``tests/rewriter/state/test_state.py``).

TensorFlow's automatic control dependencies run the reads and writes of one variable in program
order, so the reads a write can find pending are those made since the variable's previous write
(``held_reads``); whether one is still read after the write depends on the execution order, which
the simulator decides (``OpGraph.held_tensor``, ``simulator.sharing``).
"""

from __future__ import annotations

import tensorflow as tf

# ops that write a variable (its resource handle among their inputs)
WRITE_TYPES_PREFIX = ("Assign", "ResourceApply", "ResourceScatter", "ResourceSparseApply")


def _handle(tensor) -> str | None:
    return tensor.op.name if tensor.dtype == tf.resource else None


def held_reads(graph, kept: set[str]) -> dict[str, list[str]]:
    """Per write op of ``graph`` (a traced step's FuncGraph) in ``kept``: the kept ``ReadVariableOp``s of
    the variables it writes made since their previous write, in program order (the graph's creation
    order). Writes with none are left out."""
    since_write: dict[str, list[str]] = {}
    held: dict[str, list[str]] = {}
    for op in graph.get_operations():
        if op.type == "ReadVariableOp" and op.inputs and (handle := _handle(op.inputs[0])) is not None:
            if op.name in kept:
                since_write.setdefault(handle, []).append(op.name)
        elif op.type.startswith(WRITE_TYPES_PREFIX):
            for tensor in op.inputs:
                handle = _handle(tensor)
                reads = since_write.pop(handle, []) if handle is not None else []
                if reads and op.name in kept:
                    held.setdefault(op.name, []).extend(reads)
    return held
