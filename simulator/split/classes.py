"""Which ops can run in parts along the batch, and how far a split region reaches.

An op of a training step is one of three things to a split along the batch (docs/design.md 12):

- *per-sample*: every output sample depends on the same sample of its inputs (convolutions, matmuls
  over features, elementwise ops, pooling, LayerNorm-like reductions over the features, their
  gradients): part i of its outputs is the op run on part i of its inputs, exactly;
- *batch-summing*: it reduces over the batch (batch normalisation's moments and the sums in their
  gradient, the loss's mean, a filter or weight gradient, which sums over the samples): each part makes a
  partial result of the whole output's size, combined over the parts (``COMBINE_KINDS``);
- anything else ends a split region, with the reason (an op whose cross-sample semantics are not
  known, one that moves samples across the batch axis, a stateful or random one).

The class is read from the op type and the tensor sizes the ``OpGraph`` holds: a tensor is
batch-dependent when its ``b`` of ``a + b * batch`` is not zero, and its shape text (``N`` marks a
dimension that grows with the batch) must start with the batch, so that a part is a block of rows, but for
the few ops the rewriter splits along another axis (``OFF_AXIS_TYPES``). A batch flattened with the axes
after it (``N*k``: ``k`` rows a sample, a Dense layer's ``Tensordot`` on a sequence) starts it too where its
rows are blocks of samples (``sample_major``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from simulator.graph import OpGraph, level_order
from simulator.recompute.actions import NEVER_RECOMPUTED, RECOMPUTE_CLASSES, inputs_of, outputs_of

PER_SAMPLE, BATCH_SUM, ENDS = "per-sample", "batch-sum", "ends"

# Per-sample op types: part i of every batch-dependent output is the op on part i of the
# batch-dependent inputs. Reductions are per-sample where their output keeps the batch (a LayerNorm's
# moments, global pooling); the same types reduce over the batch where the output does not.
PER_SAMPLE_TYPES = (RECOMPUTE_CLASSES["activation"] | RECOMPUTE_CLASSES["elementwise"]
                    | RECOMPUTE_CLASSES["expensive"] | frozenset({
                        # shapes and copies that keep the batch as the leading axis
                        "Reshape", "Squeeze", "ExpandDims", "Identity", "Pad", "PadV2", "MirrorPad", "MirrorPadGrad",
                        "Slice", "StridedSlice", "StridedSliceGrad", "ConcatV2", "Tile", "BroadcastTo", "Fill",
                        "Split", "SplitV", "GatherV2", "Transpose", "Pack", "Unpack",
                        # convolutions' and pooling's gradients with respect to their inputs, pooling
                        "DepthwiseConv2dNativeBackpropInput", "Conv2DBackpropInputV2", "Conv3DBackpropInput",
                        "MaxPool", "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D", "MaxPoolGrad", "MaxPoolGradV2",
                        "AvgPoolGrad", "MaxPool3DGrad", "AvgPool3DGrad",
                        # activations' gradients, softmax and the per-sample losses
                        "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "SigmoidGrad", "TanhGrad",
                        "SoftplusGrad", "SoftsignGrad", "RsqrtGrad", "SqrtGrad", "ReciprocalGrad",
                        "SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits",
                        "Mean", "Sum", "Max", "Min", "Prod", "ArgMax", "ArgMin", "L2Loss",
                        # elementwise on bits and on values' kinds (Keras' argmax tells -0.0 from 0.0 with a Bitcast
                        # and a BitwiseAnd), and top-k membership row by row (a top-k accuracy metric)
                        "Bitcast", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Invert", "LeftShift", "RightShift",
                        "IsNan", "IsInf", "IsFinite", "InTopKV2"}))

# Types that reduce over the batch where a batch-dependent input makes a batch-independent output, and
# how their parts' partial results combine: "sum" adds them, "mean" adds them weighted by each part's
# share of the batch, "max"/"min"/"prod" take the elementwise maximum, minimum or product.
COMBINE_KINDS: dict[str, str] = {
    "Sum": "sum", "Mean": "mean", "Max": "max", "Min": "min", "Prod": "prod", "L2Loss": "sum", "BiasAddGrad": "sum",
    "Conv2DBackpropFilter": "sum", "Conv2DBackpropFilterV2": "sum", "Conv3DBackpropFilter": "sum",
    "Conv3DBackpropFilterV2": "sum", "DepthwiseConv2dNativeBackpropFilter": "sum", "MatMul": "sum",
    "BatchMatMul": "sum", "BatchMatMulV2": "sum", "BatchMatMulV3": "sum", "Einsum": "sum",
}

# ops whose parts could not be exact whatever their shapes: state, randomness drawn per call, inputs,
# control flow (``NEVER_RECOMPUTED``), and ops that move samples across the batch axis
NEVER_SPLIT: dict[str, str] = {
    **{name: "stateful, random, an input or control flow" for name in NEVER_RECOMPUTED},
    **{name: "draws its random numbers per call: parts would not draw the whole batch's" for name in
       RECOMPUTE_CLASSES["random"]},
    "SpaceToBatchND": "moves spatial blocks into the batch axis: a block of its rows is not a block of samples",
    "BatchToSpaceND": "moves the batch axis into spatial blocks: a block of its rows is not a block of samples",
    "SpaceToBatch": "moves spatial blocks into the batch axis: a block of its rows is not a block of samples",
    "BatchToSpace": "moves the batch axis into spatial blocks: a block of its rows is not a block of samples",
    "FusedBatchNorm": "normalises with moments it computes itself: split it into moments and normalisation first",
    "FusedBatchNormV2": "normalises with moments it computes itself: split it into moments and normalisation first",
    "FusedBatchNormV3": "normalises with moments it computes itself: split it into moments and normalisation first",
}

# ops that hold the batch on another axis than the first (TimeDistributed's ``(frames, batch, ...)``: its
# transposes, its slice per frame and that slice's gradient, their stack, its gradient and sums) and that the
# rewriter splits along the axis it reads from the step's traces (``rewriter.edit.split_shapes.BatchShapes.axis``),
# checking a slice's bounds and an unstack's axis there; any other op ends a region at such a tensor
OFF_AXIS_TYPES = frozenset({"Transpose", "Pack", "Unpack", "StridedSlice", "StridedSliceGrad", "AddN", "AddV2",
                            "Identity"})

# per-sample where they gather from a table that does not grow with the batch (an embedding lookup); from a
# batch-dependent tensor an index may name another sample
GATHERS = frozenset({"GatherV2", "Gather", "ResourceGather", "GatherNd"})

# shape texts of batch-dependent tensors an op keeps for itself (oneDNN's pooling workspace, kernel scratch):
# per-sample like the op that makes them
OWN_BUFFER_SHAPES = ("(workspace)", "(scratch)")


@dataclass(frozen=True)
class OpSplit:
    """How one op runs in parts: ``kind`` (``PER_SAMPLE``, ``BATCH_SUM``, ``ENDS``), the combine of a
    batch-summing op (``COMBINE_KINDS``), and why an op that ends a region does."""

    kind: str
    combine: str = ""
    reason: str = ""


def batch_dependent(g: OpGraph) -> np.ndarray:
    """Per tensor: whether its size grows with the batch."""
    return g.tensor_bytes_ab[:, 1] > 0


def _one_batch_axis(shape: str) -> bool:
    """Whether one dimension of the shape text is the batch (``(8,N,32,32,16)``), none a product with it."""
    dims = shape.strip("()").split(",")
    return dims.count("N") == 1 and not any("N" in dim and dim != "N" for dim in dims)


def _leading_dim(shape: str) -> str | None:
    """The first dimension of the shape text but for dimensions of size 1 (``(1,N,1,8,...)``, an upsampling's
    repeat, lies as ``(N,...)``); None for a scalar."""
    dims = shape.strip("()").split(",")
    while dims and dims[0] == "1":
        dims.pop(0)
    return dims[0] if dims and dims[0] else None


def rows_per_sample(shape: str) -> int | None:
    """How many leading rows a sample has when the batch leads the shape text: 1 for ``(N,...)``, k for a batch
    flattened with the axes after it (``(N*k,...)``: a Dense layer's ``Tensordot`` on a sequence reshapes
    ``(batch, steps, width)`` to ``(batch x steps, width)``), None when the batch does not lead."""
    return rows_of_dim(_leading_dim(shape))


def rows_of_dim(dim: str | None) -> int | None:
    """The rows a sample has in one dimension of shape text: 1 for ``N``, k for ``N*k``, None for any other."""
    if dim == "N":
        return 1
    if dim and re.fullmatch(r"N\*[0-9]+", dim):
        return int(dim[2:])
    return None


def sample_major(g: OpGraph) -> np.ndarray:
    """Per tensor: whether a block of its leading rows is a block of samples. A tensor led by ``N`` is; one led
    by ``N*k`` only where the rows came so: made by a ``Reshape`` of a tensor whose samples lead (row-major
    order keeps each sample's elements together), or by an op whose batch-dependent inputs all have the same
    rows a sample and are so (a matmul over the features, an elementwise op, a per-row loss), or by one that
    reads none (a constant tiled over the rows: every block alike; a part's is made at its shape). The same shape
    text can hold the steps' rows interleaved (a ``Transpose`` to ``(steps, batch, ...)``, then a ``Reshape``;
    a ``Tile`` along the batch): those are not, and end a region."""
    def compute(graph: OpGraph) -> np.ndarray:
        grows = batch_dependent(graph)
        shapes = [str(shape) for shape in graph.tensor_shape]
        rows = [rows_per_sample(shape) for shape in shapes]
        read, made = inputs_of(graph), outputs_of(graph)
        major = np.array([rows[t] == 1 or not grows[t] for t in range(graph.n_tensors)])
        for op in level_order(graph).tolist():
            flattened = [t for t in made[op] if grows[t] and rows[t] is not None and rows[t] > 1]
            if not flattened:
                continue
            grown_in = [t for t, _ in read[op] if grows[t]]
            if str(graph.op_type[op]) == "Reshape":
                ok = bool(grown_in) and all(rows[t] is not None and major[t] for t in grown_in)
                major[flattened] = ok
                continue
            major[flattened] = all(rows[s] == rows[t] and major[s] for s in grown_in for t in flattened)
        return major

    return g.cached("sample_major", compute, structural=True)


def _leading_batch(g: OpGraph, tensor: int) -> bool:
    """Whether a block of rows of the batch axis is a block of the tensor's memory (``sample_major``)."""
    shape = str(g.tensor_shape[tensor])
    if shape in ("", *OWN_BUFFER_SHAPES):
        return True
    return rows_per_sample(shape) is not None and bool(sample_major(g)[tensor])


def op_split(g: OpGraph, op: int) -> OpSplit:
    """The class of ``op`` of ``g`` for a split along the batch (see the module's docstring)."""
    grows = batch_dependent(g)
    op_type = str(g.op_type[op])
    inputs = [tensor for tensor, _ in inputs_of(g)[op]]
    outputs = outputs_of(g)[op]
    grown_in = [t for t in inputs if grows[t]]
    own = [t for t in outputs if str(g.tensor_shape[t]) in OWN_BUFFER_SHAPES]  # each part has its own
    outputs = [t for t in outputs if t not in own]
    grown_out = [t for t in outputs if grows[t]]
    if not grown_in and not grown_out and not any(grows[t] for t in own):
        return OpSplit(ENDS, reason="nothing it reads or makes grows with the batch")
    if op_type in NEVER_SPLIT:
        return OpSplit(ENDS, reason=f"a {op_type}: {NEVER_SPLIT[op_type]}")
    off_axis = [t for t in grown_in + grown_out if not _leading_batch(g, t)
                and not (op_type in OFF_AXIS_TYPES and _one_batch_axis(str(g.tensor_shape[t])))]
    if off_axis:
        return OpSplit(ENDS, reason=f"{g.tensor_name(off_axis[0])} {g.tensor_shape[off_axis[0]]} does not have the "
                                    "batch as its leading axis")
    if any(g.tensor_persistent[t] for t in outputs):
        return OpSplit(ENDS, reason="makes a resident tensor")
    if op_type in GATHERS and inputs and grows[inputs[0]]:
        return OpSplit(ENDS, reason=f"a {op_type} from a batch-dependent tensor: it may pick other samples")
    if grown_out and len(grown_out) == len(outputs):
        if op_type in PER_SAMPLE_TYPES:
            return OpSplit(PER_SAMPLE)
        return OpSplit(ENDS, reason=f"a {op_type}: how its outputs depend on other samples is not known")
    if grown_out:
        return OpSplit(ENDS, reason=f"a {op_type} making per-sample and batch-wide outputs at once")
    if not outputs:
        return OpSplit(ENDS, reason=f"a {op_type} with no outputs")
    if op_type in COMBINE_KINDS:
        return OpSplit(BATCH_SUM, combine=COMBINE_KINDS[op_type])
    return OpSplit(ENDS, reason=f"a {op_type} reducing over the batch in a way that is not known")


def splittable(g: OpGraph, op: int) -> bool:
    return op_split(g, op).kind != ENDS


def grow_region(g: OpGraph, start: int, exclude: frozenset[int] = frozenset()) -> tuple[list[int], dict[int, str]]:
    """The ops reached from ``start`` over batch-dependent tensors through splittable ops (not in
    ``exclude``), sorted, and the ops where the region ends with their reasons. A batch-summing op
    is a region's edge on its output side: its combined output no longer grows with the batch.
    ``start`` itself ending a region gives no ops and its reason."""
    grows = batch_dependent(g)
    first = op_split(g, start)
    if first.kind == ENDS or start in exclude:
        return [], {start: first.reason or "split already"}
    readers: list[list[int]] = [[] for _ in range(g.n_tensors)]
    for tensor, consumer in zip(g.edge_tensor.tolist(), g.edge_consumer.tolist()):
        readers[tensor].append(consumer)
    made, read = outputs_of(g), inputs_of(g)
    region, ends = {start}, {}
    frontier = [start]
    while frontier:
        op = frontier.pop()
        neighbours = [int(g.tensor_producer[t]) for t, _ in read[op] if grows[t]]
        neighbours += [reader for t in made[op] if grows[t] for reader in readers[t]]
        for other in neighbours:
            if other in region or other in ends or other in exclude:
                continue
            found = op_split(g, other)
            if found.kind == ENDS:
                ends[other] = found.reason
                continue
            region.add(other)
            frontier.append(other)
    return sorted(region), ends
