"""Arithmetic Grappler removes: ``x * 1``, ``1 * x``, ``x / 1``, ``x + 0``, ``0 + x``, ``x - 0``.

Grappler's constant folding (``ConstantFolding::SimplifyArithmeticOperations``) replaces such an op,
where the other operand is a folded constant of ones (zeros) and ``x`` has the output's shape, by a
snapshot of ``x``, which the later passes drop: its readers read ``x`` itself and nothing is allocated.
Two places in Keras models bring them: ``tf.nn.silu``'s ``beta * x`` (EfficientNet's swish, beta 1,
in the forward pass and again in its gradient, which recomputes the sigmoid from ``x``), and a dropout
mask's ``uniform * (maxval - minval) + minval`` (1 and 0). Counted as ops of their own, the gradient's
``beta * x`` is computed as soon as ``x`` exists and held until the backward pass needs it: EfficientNetB0
(image 64, batch 4) was predicted 10 % above its measured peak, 7.7 MB of such copies; in the executed
partition graph the gradient's ``Mul`` reads ``x`` directly. ``passthrough_input`` names the input
such an op passes on; ``capture`` makes its output an alias of that input (one buffer, no new bytes).
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

MUL_TYPES = frozenset({"Mul", "MulNoNan"})
DIV_TYPES = frozenset({"RealDiv", "Div", "DivNoNan"})
ADD_TYPES = frozenset({"Add", "AddV2", "BiasAdd"})
SUB_TYPES = frozenset({"Sub"})
# elementwise ops whose two operands broadcast against each other (numpy rules)
BROADCASTING_BINARY = frozenset({"Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "MulNoNan", "Maximum",
                                 "Minimum", "SquaredDifference"})
# elementwise ops a folded operand is computed with (``maxval - minval``), evaluated here when small
_EVALUATED = {"Sub": np.subtract, "Add": np.add, "AddV2": np.add, "Mul": np.multiply, "RealDiv": np.divide,
              "Neg": np.negative}
_MAX_EVALUATED_ELEMENTS = 64
_PASS_TYPES = frozenset({"Identity", "StopGradient", "Snapshot", "Cast"})
_MAX_CONSTANT_ELEMENTS = 1 << 20  # larger constants are not read to see whether they are all ones


# per graph, (tensor name, depth) -> static_value's answer: each op of a step asks for its operands, whose
# small (scalar) inputs' trees were walked again for every reader (ResNet-50 b256's capture: 280,000 calls)
_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _of_graph(memo: weakref.WeakKeyDictionary, graph) -> dict:
    """``graph``'s answers in a per-graph ``memo`` (a dict not kept for a graph weak references cannot point to)."""
    try:
        return memo.setdefault(graph, {})
    except TypeError:
        return {}


def static_value(tensor, depth: int = 8) -> np.ndarray | None:
    """The value of a tensor computed from constants alone (small ones), else None (remembered per graph:
    a graph's existing tensors keep their values)."""
    known = _of_graph(_KNOWN, tensor.graph)
    key = (tensor.name, depth)
    if key not in known:
        known[key] = _static_value(tensor, depth)
    return known[key]


def _static_value(tensor, depth: int) -> np.ndarray | None:
    if tensor.shape.is_fully_defined() and tensor.shape.num_elements() > _MAX_CONSTANT_ELEMENTS:
        return None
    value = tensor_util.constant_value(tensor)
    if value is not None or depth <= 0:
        return None if value is None else np.asarray(value)
    op = tensor.op
    if not op.inputs or not tensor.shape.is_fully_defined() or tensor.shape.num_elements() > _MAX_EVALUATED_ELEMENTS:
        return None
    inputs = [static_value(t, depth - 1) for t in op.inputs]
    if any(v is None for v in inputs):
        return None
    if op.type in _PASS_TYPES:
        return inputs[0].astype(tensor.dtype.as_numpy_dtype) if op.type == "Cast" else inputs[0]
    if op.type in _EVALUATED and len(inputs) == (1 if op.type == "Neg" else 2):
        with np.errstate(all="ignore"):
            return np.asarray(_EVALUATED[op.type](*inputs))
    return None


def _all(tensor, number: float) -> bool:
    value = static_value(tensor)
    return value is not None and value.size > 0 and bool(np.all(value == number))


def _same_shape(a, b) -> bool:
    return a.shape.is_fully_defined() and b.shape.is_fully_defined() and a.shape == b.shape


_ARITHMETIC_TYPES = MUL_TYPES | DIV_TYPES | ADD_TYPES | SUB_TYPES
# per graph, op name -> passthrough_input's answer: the capture and every plan's apply ask it of each op, and
# ``underlying`` again of every input they follow (an op's inputs are fixed once it is made)
_PASSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def passthrough_input(op) -> int | None:
    """The input slot whose tensor ``op`` passes on unchanged once Grappler simplifies it (see the
    module's docstring), None for any other op (remembered per graph)."""
    known = _of_graph(_PASSED, op.graph)
    name = op.name
    if name not in known:
        known[name] = _passthrough_input(op)
    return known[name]


def _passthrough_input(op) -> int | None:
    kind = op.type
    if kind not in _ARITHMETIC_TYPES or len(op.inputs) != 2 or not op.outputs:
        return None
    if op.outputs[0].dtype in (tf.resource, tf.variant, tf.string):
        return None
    x, y = op.inputs
    out = op.outputs[0]
    if kind in MUL_TYPES | ADD_TYPES:  # 1 * y, 0 + y
        if _all(x, 1 if kind in MUL_TYPES else 0) and _same_shape(y, out):
            return 1
    if _all(y, 1 if kind in MUL_TYPES | DIV_TYPES else 0) and _same_shape(x, out):  # x * 1, x / 1, x +- 0
        return 0
    return None


def passthrough_ops(graph) -> dict[str, int]:
    """Op name -> the input slot it passes on, for every such op of a traced step's ``graph`` (the
    rewriter reads through them as the capture does)."""
    return {op.name: slot for op in graph.get_operations() if (slot := passthrough_input(op)) is not None}
