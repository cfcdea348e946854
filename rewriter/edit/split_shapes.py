"""What the split's rewrite reads of the step's tensors before it runs: which grow with the batch and along
which axis (``BatchShapes``, from two traces), and values known before the step runs (``const_value``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.framework import op_def_registry

from rewriter.edit.graph_edit import GraphEditor
from rewriter.edit.graph_refs import parse_ref
from rewriter.trace.op_names import canonical
from simulator.plan import PlanError


def pure(node) -> bool:
    """A node whose only effect is its outputs: one nothing reads can go."""
    op_def = op_def_registry.get(node.op)
    return op_def is not None and not op_def.is_stateful and node.op not in ("Placeholder", "NoOp")


@dataclass(frozen=True)
class BatchShapes:
    """Static shapes of the step's tensors ("op:k") at the batch (``at_batch``) and at one sample more
    (``at_next``); a tensor grows with the batch when one of its dimensions does and nothing else does."""

    batch_size: int
    at_batch: dict[str, tuple[int, ...] | None]
    at_next: dict[str, tuple[int, ...] | None]
    outputs: dict[str, int]  # op -> its number of outputs
    dtypes: dict[str, Any]  # "op:k" -> tf.DType

    @classmethod
    def of(cls, first, second) -> "BatchShapes":
        """From two ``TracedStep``s of one model (``second`` at one sample more), matched by canonical names."""
        def shapes(traced):
            found, outputs, dtypes = {}, {}, {}
            for op in traced.concrete.graph.get_operations():
                name = canonical(op.name, traced.canonical)
                outputs[name] = len(op.outputs)
                for k, tensor in enumerate(op.outputs):
                    shape = tensor.shape
                    found[f"{name}:{k}"] = tuple(shape.as_list()) if shape.is_fully_defined() else None
                    dtypes[f"{name}:{k}"] = tensor.dtype
            return found, outputs, dtypes

        canon_first, outputs, dtypes = shapes(first)
        canon_second, _, _ = shapes(second)
        back = {canonical(op.name, first.canonical): op.name for op in first.concrete.graph.get_operations()}

        def traced(ref: str) -> str:
            op, _, k = ref.rpartition(":")
            return f"{back.get(op, op)}:{k}"

        return cls(first.batch_size, {traced(r): s for r, s in canon_first.items()},
                   {traced(r): canon_second.get(r) for r in canon_first},
                   {back.get(op, op): n for op, n in outputs.items()}, {traced(r): d for r, d in dtypes.items()})

    def grows(self, ref: str) -> bool:
        """Whether tensor ``ref`` grows with the batch; PlanError when it does but not along one axis."""
        return self.axis(ref) is not None

    def axis(self, ref: str) -> int | None:
        """The axis of tensor ``ref`` that is the batch (the leading one, or another: TimeDistributed's frames
        lead as ``(frames, batch, ...)``), None when it does not grow with the batch; PlanError when it grows but
        not along one axis (a batch flattened into another dimension but the leading one)."""
        return self._batch_axis(ref)[0]

    def rows(self, ref: str) -> int:
        """Rows a sample has along the batch axis of ``ref``: 1, or k for a batch flattened with the axes after
        it (``(batch x steps, width)``, a Dense layer's ``Tensordot`` on a sequence), which leads the tensor."""
        return self._batch_axis(ref)[1]

    def _batch_axis(self, ref: str) -> tuple[int | None, int]:
        small, large = self.at_batch.get(ref), self.at_next.get(ref)
        if small is None or large is None or small == large:
            return None, 1
        grown = [a for a, (x, y) in enumerate(zip(small, large)) if x != y] if len(small) == len(large) else []
        if len(grown) == 1:
            axis = grown[0]
            if small[axis] == self.batch_size and large[axis] == self.batch_size + 1:
                return axis, 1
            rows, left = divmod(small[axis], self.batch_size)
            if not left and large[axis] == rows * (self.batch_size + 1) and all(d == 1 for d in small[:axis]):
                return axis, rows
        raise PlanError(f"tensor {ref} {small} grows with the batch ({large} at one sample more) but not along one "
                        "axis: its rows are not blocks of samples, it cannot be split")

    def with_part(self, ref: str, samples: int) -> tuple[int, ...]:
        """The static shape of a part of ``samples`` samples of batch-dependent tensor ``ref``."""
        shape, (axis, rows) = list(self.at_batch[ref]), self._batch_axis(ref)
        shape[axis] = samples * rows
        return tuple(shape)


FOLD_LIMIT = 32  # nodes: a shape computed from constants is a few (a cross-entropy's Slice of a Shape's constant)


def const_value(editor: GraphEditor, ref: str, folded: dict[tuple[str, int], np.ndarray | None]) -> np.ndarray | None:
    """The value of ``ref`` when it is known before the step runs: a ``Const``, or a small pure computation on
    constants only (softmax cross-entropy's reshape back to the batch reads ``Slice(shape, [0], [rank - 1])``
    of its logits' static shape), evaluated once (``folded`` keeps it); None otherwise."""
    source, k = editor.resolve(ref)
    node = editor.nodes.get(source)
    if node is None:
        return None
    if node.op == "Const":
        return tf.make_ndarray(node.attr["value"].tensor)
    if (source, k) not in folded:
        folded[(source, k)] = _folded(editor, source, k)
    return folded[(source, k)]


def _folded(editor: GraphEditor, source: str, k: int) -> np.ndarray | None:
    """Tensor ``source:k`` computed from its ancestors when they are all pure and end in constants."""
    found, stack = {}, [source]
    while stack:
        name = stack.pop()
        if name in found:
            continue
        node = editor.nodes.get(name)
        if node is None or not pure(node) or len(found) >= FOLD_LIMIT:
            return None
        found[name] = node
        stack.extend(parse_ref(ref)[0] for _, ref in editor.data_inputs(node))
    graph_def = graph_pb2.GraphDef()
    for node in found.values():
        copy = graph_def.node.add()
        copy.CopyFrom(node)
        del copy.input[:]
        copy.input.extend(ref for _, ref in editor.data_inputs(node))
    graph = tf.Graph()
    try:
        with graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=graph) as folding:
            return np.asarray(folding.run(f"{source}:{k}"))
    except (ValueError, tf.errors.OpError):
        return None


