"""XLA's temporaries on the CPU: a grouped convolution's filter gradient computed dense.

Keras 3 runs a grouped ``Conv2D`` (``groups > 1``: ConvNeXt's 7x7 depthwise convolutions) on the
CPU as an XLA-compiled function call (``_XlaMustCompile``; TensorFlow's CPU kernels do not group),
and its gradient as another. XLA's CPU compiler rewrites the grouped filter gradient (a convolution
with a batch group count) into a dense one: a [KH, KW, C, C_out] result and a masked copy of it,
reduced to the [KH, KW, C / groups, C_out] gradient, both in the computation's one temporary buffer,
which the profiler's trace names no op for. Measured on ConvNeXtTiny (image 32, batch 4): one buffer
of 2 x 49 x C^2 x 4 bytes per block while its gradient call runs (3.4, 13.8, 55.1 and 220.5 MiB for
C = 96, 192, 384, 768), whatever the batch and the feature map; the prediction was 36-37 % under the
measured peak without it. ``capture`` adds it as the call's scratch output (as
``rewriter.tf_effects.mixed_precision`` adds a kernel's), read by nothing, live while the call runs. On a GPU
(cuDNN groups natively) nothing is added.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.python.framework import function_def_to_graph

CALL_TYPES = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
DENSE_COPIES = 2  # the dense filter gradient and its masked copy


@functools.lru_cache(maxsize=1)
def _on_cpu() -> bool:
    return not tf.config.list_physical_devices("GPU")


def _xla_compiled(op, definition) -> bool:
    attrs = [op.node_def.attr, definition.attr]
    return any("_XlaMustCompile" in attr and attr["_XlaMustCompile"].b for attr in attrs)


def _body(op):
    """The called function's definition (a FunctionDef), or None."""
    try:
        found = op.graph._get_function(op.get_attr("f").name)  # noqa: SLF001 -- the graph's own library
    except (AttributeError, ValueError):
        return None
    return None if found is None else getattr(found, "cached_definition", None) or getattr(found, "definition", None)


def call_scratch_bytes(op) -> int:
    """Bytes of XLA's dense copies of the grouped filter gradients inside an XLA-compiled call
    ``op`` on the CPU (0 for any other op). Several in one call are summed (an upper bound)."""
    if op.type not in CALL_TYPES or not _on_cpu():
        return 0
    definition = _body(op)
    if definition is None or not _xla_compiled(op, definition):
        return 0
    if not any(node.op == "Conv2DBackpropFilter" for node in definition.node_def):
        return 0
    body = function_def_to_graph.function_def_to_graph(definition, input_shapes=[t.shape for t in op.inputs])
    total = 0
    for inner in body.get_operations():
        if inner.type != "Conv2DBackpropFilter":
            continue
        image, kernel = inner.inputs[0].shape, inner.outputs[0].shape
        if image.rank != 4 or not kernel.is_fully_defined():
            continue
        channels = image[1] if inner.get_attr("data_format") == b"NCHW" else image[-1]
        if channels is None or channels <= kernel[2]:
            continue  # not grouped: XLA computes it as it is
        groups = channels // kernel[2]
        total += DENSE_COPIES * kernel.num_elements() * groups * inner.outputs[0].dtype.size
    return int(total)
