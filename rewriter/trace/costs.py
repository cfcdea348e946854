"""What an op costs, from the static shapes of a traced step: FLOPs, bytes touched, tensor sizes.

The simulator's time model reads them (``OpGraph.op_flops_ab``, ``op_touched_bytes_ab``); a
calibration (``rewriter.timing.device_calibration``) measures what they only estimate.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def static_dims(shape) -> list[int] | None:
    try:
        return [int(d) for d in shape] if shape.is_fully_defined() else None
    except (TypeError, ValueError):
        return None


def static_elements(shape) -> int:
    dims = static_dims(shape)
    return int(np.prod(dims)) if dims is not None else 0


def tensor_nbytes(tensor) -> int:
    dtype = tensor.dtype
    if dtype in (tf.resource, tf.variant, tf.string):
        return 0
    return static_elements(tensor.shape) * dtype.size


def _einsum_flops(op) -> float:
    equation = op.get_attr("equation").decode()
    lhs = equation.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for term, tensor in zip(lhs, op.inputs):
        dims = static_dims(tensor.shape)
        if dims is None or "." in term:
            return float(static_elements(op.outputs[0].shape))
        sizes.update(zip(term, dims))
    return 2.0 * float(np.prod(list(sizes.values()))) if sizes else 0.0


def op_flops(op) -> float:
    """FLOPs of one op from its static shapes: exact for convolutions and matmuls, one per output
    element otherwise (those ops are bound by memory traffic, which ``touched`` accounts for)."""
    kind = op.type
    out = static_elements(op.outputs[0].shape) if op.outputs else 0
    try:
        if kind in ("Conv2D", "Conv3D", "DepthwiseConv2dNative"):
            kernel = static_dims(op.inputs[1].shape)
            per_out = np.prod(kernel[:-1]) if kind != "DepthwiseConv2dNative" else np.prod(kernel[:2])
            return 2.0 * out * float(per_out)
        if kind in ("Conv2DBackpropInput", "Conv3DBackpropInputV2", "DepthwiseConv2dNativeBackpropInput"):
            kernel = static_dims(op.inputs[1].shape)
            grad = static_elements(op.inputs[2].shape)
            per = np.prod(kernel[:-1]) if not kind.startswith("Depthwise") else np.prod(kernel[:2])
            return 2.0 * grad * float(per)
        if kind in ("Conv2DBackpropFilter", "Conv3DBackpropFilterV2", "DepthwiseConv2dNativeBackpropFilter"):
            kernel = static_dims(op.outputs[0].shape)
            grad = static_elements(op.inputs[2].shape)
            per = np.prod(kernel[:-1]) if not kind.startswith("Depthwise") else np.prod(kernel[:2])
            return 2.0 * grad * float(per)
        if kind == "MatMul":
            a = static_dims(op.inputs[0].shape)
            k = a[0] if op.get_attr("transpose_a") else a[1]
            return 2.0 * out * k
        if kind in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
            a = static_dims(op.inputs[0].shape)
            k = a[-2] if op.get_attr("adj_x") else a[-1]
            return 2.0 * out * k
        if kind == "Einsum":
            return _einsum_flops(op)
    except (TypeError, ValueError, IndexError):
        pass
    return float(out)


def op_touched_bytes(op) -> float:
    return float(sum(tensor_nbytes(t) for t in op.inputs) + sum(tensor_nbytes(t) for t in op.outputs))
