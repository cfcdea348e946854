"""Conditionals in a captured step (``tf.cond``: an optimizer's ``gradient_accumulation_steps``, a
``LossScaleOptimizer``'s update): their memory.

An ``If`` op is one node of the step's graph, but TensorFlow lowers it into the step (``Switch`` and
``Merge`` around both branches' ops), so what its branches allocate is allocated while it runs, and
the constants of both branches are made when the step's kernels are (``rewriter.timing.measurement``
counts them as resident from the first call, whichever branch runs). Keras 3's gradient accumulation
applies the update in one branch every ``gradient_accumulation_steps`` steps: (gradient +
accumulator) / steps per variable, the optimizer's temporaries, and the accumulators reset from
folded ``zeros`` constants as large as the trainable weights (a small CNN with Adam and 4 steps:
5.4 MiB of constants and 6 MiB of update temporaries the step did not count, measured 37.5 MiB
where 31.5 were predicted; ``tests/rewriter/state/test_state.py``).

``working_set_bytes`` is the most one branch holds at once (its ops replayed as a loop body's,
``loops.graph_working_set_bytes``), which the capture adds as the op's scratch: the simulator
predicts the step whose branch holds the most (the update, not the accumulation).
``constant_tensors`` are the branches' folded constants, resident for the whole step.
"""

from __future__ import annotations

from typing import Any, Callable

from rewriter.tf_effects import loops
from rewriter.tf_effects.grappler import SHAPE_TYPES, underlying

IF_TYPES = frozenset({"If", "StatelessIf"})


def branch_graphs(op) -> list[Any]:
    """The FuncGraphs of an ``If`` op's branches (empty for other ops, or where tracing kept none)."""
    if op.type not in IF_TYPES:
        return []
    return [graph for graph in (getattr(op, "_true_graph", None), getattr(op, "_false_graph", None))
            if graph is not None]


def _folded(branch) -> frozenset[str]:
    """Ops of a branch Grappler folds into constants (``grappler.reduce_step``'s rule)."""
    folded: set[str] = set()
    for op in branch.get_operations():  # creation order: inputs first
        if op.type == "Const" or (op.type in SHAPE_TYPES and all(t.shape.is_fully_defined() for t in op.inputs)):
            folded.add(op.name)
        elif (op.inputs and not op.op_def.is_stateful and all(underlying(t).op.name in folded for t in op.inputs)
              and all(c.name in folded for c in op.control_inputs)):
            folded.add(op.name)
    return frozenset(folded)


def constant_tensors(op) -> list[Any]:
    """The folded constants ``op``'s branches read (resident from the step's first call on)."""
    found: dict[str, Any] = {}
    for branch in branch_graphs(op):
        folded = _folded(branch)
        for inner in branch.get_operations():
            if inner.name in folded:
                continue
            for tensor in inner.inputs:
                source = underlying(tensor)
                if source.op.name in folded and source.graph is branch:
                    found[source.name] = source
    return list(found.values())


def working_set_bytes(op, nbytes: Callable[[Any], int], *, forwarding: frozenset[str],
                      aliasing: frozenset[str]) -> int:
    """The most bytes a branch of ``op`` holds at once beyond its inputs and outputs (0: not an ``If``), a
    conditional inside a branch with its own (Keras' optimizer update inside a LossScaleOptimizer's branch)."""
    def inside(inner) -> int:
        return working_set_bytes(inner, nbytes, forwarding=forwarding, aliasing=aliasing)

    return max((loops.graph_working_set_bytes(branch, set(), nbytes, forwarding=forwarding, aliasing=aliasing,
                                              constant=_folded(branch), nested=inside)
                for branch in branch_graphs(op)), default=0)
