"""Splitting ops along the batch in the real step: each op of a region runs in parts (docs/design.md 12).

``apply_splits(graph_def, regions, shapes)`` builds a plan's ``simulator.split.SplitRegion`` records in a
step's GraphDef the way ``simulator.split.with_splits`` has them, under the same names:

* every op of a region becomes ``parts`` clones, ``<op>/split_part_<i>``, on ``part_batches(batch, parts)[i]``
  samples (as even as they can be, the first ones one larger). A *per-sample* op's clone reads the parts of
  the tensors made in its region; its outputs keep the batch as their leading axis. A *batch-summing* op
  (its output does not grow with the batch: a moment of batch normalisation, the loss's sum, a filter, bias
  or weight gradient; ``simulator.split.COMBINE_KINDS``) makes one partial per part, joined by a running
  combine ``<op>/split_combine_<j>`` (``AddV2``; ``Maximum``, ``Minimum``, ``Mul`` for the other kinds;
  part j + 2 waits for step j, as the simulator has it). A ``Mean`` over the batch runs as a ``Sum`` per part
  and one division of the combined sum by the whole batch's count (the last step's name is the division's,
  its sum ``<step>/sum``, as the simulator has it), so it rounds as a mean does, not as a mean of means;
* a batch-dependent tensor from outside a region is cut at its entry by one ``SplitV`` along axis 0
  (``<producer>/split_batch_<output>_<region>``): the step's inputs, Dropout's masks (a random op ends a
  region: the mask is drawn whole, so it keeps its values), constants Grappler folds (the loss gradient's
  ``Tile`` of ones);
* a reader outside a region (or a control edge from one) reads a per-sample tensor whole as a ``ConcatV2`` of its
  parts (``<op>/split_concat_<output>``) and a batch-summing op's output as its combined result;
* constants that name the batch (or values computed from constants only, ``split_shapes.const_value``), the
  shape input of ``Reshape``, ``BroadcastTo``, ``Fill``, a ``Slice``'s size, a convolution's or pooling's
  input-size input and a ``Tile``'s multiples (``SHAPE_INPUTS``), are made again per part with the part's batch,
  at the place of the batch in the op's output. A ``Tile`` repeating a batch-dependent tensor along the batch,
  and a ``ConcatV2``, ``Split`` or ``SplitV`` along the batch axis, are refused: the graph the simulator
  reads does not record an op's axis (an ``Unpack`` along it makes tensors that do not grow with the batch:
  it is no per-sample op). Every part's static shapes are checked after import
  (``check_part_shapes``);
* the batch is the leading axis of a tensor, or the one axis that grows between the two traces
  (``BatchShapes.axis``: TimeDistributed's ``(frames, batch, ...)``): entries split, concatenations join and
  slices are checked along it. A batch flattened with the axes after it (a Dense layer's ``Tensordot`` on a
  sequence: ``(batch x steps, width)``) leads with ``BatchShapes.rows`` rows a sample; parts take that many rows
  a sample where those rows are blocks of samples (``_sample_major``, as ``simulator.split.sample_major``), and a
  ``Reshape`` whose shape is computed when the step runs (an embedding gradient's rows) takes its part's share
  of its static output shape.

Which tensors grow with the batch is read from two traces of the step (``BatchShapes``: at the batch and
one more), as the capture does. Nothing is changed when a region is refused (one ``PlanError`` naming the op
and why). Every node added carries Grappler's keep mark: its common-subgraph elimination never merges
parts back, its arithmetic optimizer keeps the combine's order, and its constant folding does not move a
part's division by a constant ahead of the ``Tile`` it reads, taking along the control edge the plan's
order put on it (a cycle: the arithmetic and dependency optimizers then skip the whole step; seen on batch
normalisation's mean gradient). A ``Shape``, ``Size`` or ``Rank`` of a split op is made the constant it is,
for the same reason. Splits sum in another order than the whole batch: rounding differs from Keras (a few
1e-7 of the weights' scale after three steps, ``tests/rewriter/edit/test_split_parts.py``), never bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from rewriter.edit.graph_edit import GraphEditor
from rewriter.edit.graph_refs import parse_ref, tensor_ref
from rewriter.edit.recompute_clones import KEEP_ATTR
from rewriter.edit.split_shapes import BatchShapes, const_value, pure
from simulator.graph import PART_MARK, GraphError
from simulator.plan import PlanError
from simulator.recompute.actions import original_name
from simulator.split.actions import (COMBINE_OP_TYPES, SplitRegion, combine_name, concat_name, entry_name, part_batches,
                                     part_name, split_origin)
from simulator.split.classes import COMBINE_KINDS, NEVER_SPLIT, PER_SAMPLE_TYPES

SPLIT_ATTR = "_split_part"  # every node the split adds carries its own name (found again after Grappler)
# op type -> the input slot that holds a shape (or multiples) whose first element is the batch
SHAPE_INPUTS = {"Reshape": 1, "BroadcastTo": 1, "Tile": 1, "Fill": 0, "Slice": 2, "Conv2DBackpropInput": 0,
                "Conv3DBackpropInputV2": 0, "DepthwiseConv2dNativeBackpropInput": 0, "AvgPoolGrad": 0,
                "AvgPool3DGrad": 0, "StridedSliceGrad": 0}
# op types whose shape input is their output's shape, and the attribute naming its type
OUTPUT_SHAPE_INPUTS = {"Reshape": "Tshape", "BroadcastTo": "Tidx", "Fill": "index_type"}
# op type -> the input slot of its axis: along axis 0 the op moves samples across parts
AXIS_INPUTS = {"Split": 0, "SplitV": 2}


@dataclass(frozen=True)
class AppliedSplit:
    """One region as built in the graph."""

    region: int
    parts: int
    part_batches: tuple[int, ...]
    ops: tuple[str, ...]  # the region's ops, in the order they were built
    per_sample: tuple[str, ...]  # the ops whose parts keep the batch (the rest are batch-summing)
    part_nodes: tuple[str, ...]  # every part of every op
    combines: tuple[str, ...]  # the combines' nodes (the scale of a mean last)
    concats: tuple[str, ...]
    entries: tuple[str, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.part_nodes + self.combines + self.concats + self.entries


class _PartsBuilder:
    """The nodes of every region, added to the editor's GraphDef; originals removed at the end."""

    def __init__(self, editor: GraphEditor, regions: Sequence[SplitRegion], shapes: BatchShapes):
        self.editor, self.regions, self.shapes = editor, regions, shapes
        self.batch = shapes.batch_size
        self.region_of: dict[str, int] = {}
        self.kind: dict[str, str] = {}  # op -> "per-sample" or its combine kind
        self.parts: dict[str, list[str]] = {}  # op -> its part nodes
        self.done: dict[str, list[str]] = {}  # op -> what a control edge from it waits for
        self.whole: dict[str, str] = {}  # "op:k" -> the whole tensor (combined, or concatenated lazily)
        self.entries: dict[tuple[int, str], str] = {}
        self.folded: dict[tuple[str, int], np.ndarray | None] = {}  # values computed from constants (const_value)
        self.major: dict[str, bool] = {}  # "op:k" -> whether its rows are blocks of samples (_sample_major)
        self.added: dict[int, dict[str, list[str]]] = {r: {"combines": [], "concats": [], "entries": []}
                                                       for r in range(len(regions))}

    # ------------------------------------------------------------------ nodes

    def add(self, name: str, op: str, inputs: list[str], *, like=None, keep: bool = False, region: int = -1,
            role: str = "") -> Any:
        if name in self.editor.nodes:
            raise PlanError(f"the graph already has a node named {name!r} (was the plan applied twice?)")
        node = self.editor.graph_def.node.add()
        if like is not None:
            node.CopyFrom(like)
            del node.input[:]
        node.name, node.op = name, op
        node.input.extend(inputs)
        node.attr[SPLIT_ATTR].s = name.encode()
        if keep:
            node.attr[KEEP_ATTR].b = True
        self.editor.nodes[name] = node
        if role:
            self.added[region][role].append(name)
        return node

    def const(self, name: str, value: np.ndarray) -> str:
        node = self.add(name, "Const", [])
        node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
        node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
        return name

    # ------------------------------------------------------------------ classes

    def classify(self, op: str) -> str:
        node = self.editor.nodes[op]
        outputs = [f"{op}:{k}" for k in range(self.shapes.outputs.get(op, 0))]
        reads = [self.editor.resolve(ref) for _, ref in self.editor.data_inputs(node)]
        grown_in = [tensor_ref(*t) for t in reads if self.shapes.grows(f"{t[0]}:{t[1]}")]
        grown_out = [ref for ref in outputs if self.shapes.grows(ref)]
        if node.op in NEVER_SPLIT:
            raise PlanError(f"split: {op} cannot run in parts: a {node.op}: {NEVER_SPLIT[node.op]}")
        interleaved = [ref for ref in ["%s:%d" % t for t in reads] + grown_out
                       if self.shapes.grows(ref) and not self._sample_major(ref)]
        if interleaved:
            raise PlanError(f"split: {op} cannot run in parts: {interleaved[0]} holds the batch flattened with other "
                            "axes in an order whose rows are not blocks of samples")
        if grown_out and len(grown_out) == len(outputs):
            if node.op not in PER_SAMPLE_TYPES:
                raise PlanError(f"split: {op} cannot run in parts: a {node.op}: how its outputs depend on other "
                                "samples is not known")
            data = [ref for _, ref in self.editor.data_inputs(node)]
            axis = AXIS_INPUTS.get(node.op, {"ConcatV2": len(data) - 1}.get(node.op))
            if axis is not None:
                value = const_value(self.editor, data[axis], self.folded)
                rank = len(self.shapes.at_batch[outputs[0]] or ()) or 1
                if value is None or int(value) % rank == self.shapes.axis(outputs[0]):
                    raise PlanError(f"split: {op} cannot run in parts: a {node.op} along the batch axis (or an "
                                    "axis not known before the step runs) moves samples across parts")
            if node.op in ("Slice", "StridedSlice") and not self._keeps_every_sample(node, data):
                raise PlanError(f"split: {op} cannot run in parts: a {node.op} that does not keep every sample in "
                                "order (or whose bounds are not known before the step runs)")
            return "per-sample"
        if grown_out or not grown_in:
            raise PlanError(f"split: {op} cannot run in parts: a {node.op} "
                            + ("making per-sample and batch-wide outputs at once" if grown_out else
                               "reading nothing that grows with the batch"))
        if node.op not in COMBINE_KINDS:
            raise PlanError(f"split: {op} cannot run in parts: a {node.op} reducing over the batch in a way that is "
                            "not known")
        return COMBINE_KINDS[node.op]

    def _leads(self, ref: str) -> bool:
        """Whether the batch is the first axis of ``ref`` but for axes of size 1."""
        axis = self.shapes.axis(ref)
        return axis is not None and all(d == 1 for d in self.shapes.at_batch[ref][:axis])

    def _sample_major(self, ref: str) -> bool:
        """Whether a block of rows of ``ref``'s batch axis is a block of samples (as ``simulator.split.sample_major``
        has it): one row a sample, or a batch flattened by a ``Reshape`` of a tensor whose samples lead, or made from
        such tensors with as many rows a sample (a matmul over the features, a per-row loss) or from none."""
        if self.shapes.rows(ref) == 1:
            return True
        if ref not in self.major:
            self.major[ref] = False  # a cycle is no proof
            node = self.editor.nodes[parse_ref(ref)[0]]
            reads = ["%s:%d" % self.editor.resolve(data) for _, data in self.editor.data_inputs(node)]
            grown = [read for read in reads if self.shapes.grows(read)]
            if node.op == "Reshape":
                self.major[ref] = bool(grown) and all(self._leads(read) and self._sample_major(read) for read in grown)
            else:
                self.major[ref] = all(self.shapes.rows(read) == self.shapes.rows(ref) and self._sample_major(read)
                                      for read in grown)  # none: a constant tiled over the rows, all alike
        return self.major[ref]

    def _keeps_every_sample(self, node, data: list[str]) -> bool:
        """Whether a ``Slice`` or ``StridedSlice`` takes the whole batch axis of its input, in order (a slice of
        TimeDistributed's frames, ``x[t]`` of ``(frames, batch, ...)``, keeps every sample)."""
        source = "%s:%d" % self.editor.resolve(data[0])
        axis, whole = self.shapes.axis(source) or 0, self.batch * self.shapes.rows(source)
        bounds = [const_value(self.editor, ref, self.folded) for ref in data[1:]]
        known = [value is not None and value.ndim == 1 and len(value) > axis for value in bounds]
        if node.op == "Slice":  # a size of the whole batch starts at 0 (a concatenation's gradient: ConcatOffset)
            begin, size = bounds
            return known[1] and (int(size[axis]) == whole
                                 or int(size[axis]) == -1 and known[0] and int(begin[axis]) == 0)
        masks = {key: node.attr[key].i for key in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                                                   "shrink_axis_mask")}
        if axis and (masks["ellipsis_mask"] or masks["new_axis_mask"]):  # the spec's axes are not the input's
            return False
        if axis and all(value is not None and value.ndim == 1 for value in bounds) \
                and len(bounds[0]) <= axis:  # a spec that stops before the batch axis takes it whole
            return True
        if not all(known):
            return False
        begin, end, strides = bounds
        bit = 1 << axis
        if masks["ellipsis_mask"] & bit or masks["new_axis_mask"] & bit or masks["shrink_axis_mask"] & bit:
            return False
        return int(strides[axis]) == 1 and (masks["begin_mask"] & bit or int(begin[axis]) == 0) \
            and (masks["end_mask"] & bit or int(end[axis]) >= whole)

    # ------------------------------------------------------------------ reads

    def whole_of(self, ref: str) -> str:
        """What a reader outside a region reads for tensor ``ref`` of a split op."""
        op, k = parse_ref(ref)
        key = f"{op}:{k}"
        if key not in self.whole:  # a per-sample tensor: the concatenation of its parts, made once
            r = self.region_of[op]
            axis = self.const(f"{concat_name(op, k)}/axis", np.asarray(self.shapes.axis(key), np.int32))
            node = self.add(concat_name(op, k), "ConcatV2", [tensor_ref(part, k) for part in self.parts[op]] + [axis],
                            region=r, role="concats")
            node.attr["N"].i = len(self.parts[op])
            node.attr["T"].type = self.shapes.dtypes[key].as_datatype_enum
            node.attr["Tidx"].type = tf.int32.as_datatype_enum
            self.whole[key] = node.name
        return self.whole[key]

    def entry(self, r: int, ref: str) -> list[str]:
        """The parts of batch-dependent tensor ``ref`` from outside region ``r``: one SplitV along axis 0."""
        if (r, ref) not in self.entries:
            op, k = parse_ref(ref)
            source = self.whole_of(ref) if op in self.region_of else ref
            batches = part_batches(self.batch, self.regions[r].parts)
            name = entry_name(op, k, r)
            rows = self.shapes.rows(f"{op}:{k}")  # a batch flattened with the axes after it: k rows a sample
            sizes = self.const(f"{name}/sizes", np.asarray(batches, np.int64) * rows)
            axis = self.const(f"{name}/axis", np.asarray(self.shapes.axis(f"{op}:{k}"), np.int32))
            node = self.add(name, "SplitV", [source, sizes, axis], keep=True, region=r, role="entries")
            node.attr["num_split"].i = len(batches)
            node.attr["T"].type = self.shapes.dtypes[f"{op}:{k}"].as_datatype_enum
            node.attr["Tlen"].type = tf.int64.as_datatype_enum
            self.entries[(r, ref)] = name
        return [tensor_ref(self.entries[(r, ref)], i) for i in range(self.regions[r].parts)]

    def part_input(self, r: int, op: str, slot: int, ref: str, i: int, n: int) -> str:
        """What part ``i`` (of ``n`` samples) of region-``r`` op ``op`` reads in input ``slot``."""
        source, k = self.editor.resolve(ref)
        key = f"{source}:{k}"
        if self.region_of.get(source) == r and self.kind[source] == "per-sample":
            return tensor_ref(self.parts[source][i], k)
        if source in self.region_of:
            return self.whole_of(key)
        if self.shapes.grows(key):
            return self.entry(r, key)[i]
        node_type = self.editor.nodes[op].op
        if SHAPE_INPUTS.get(node_type) == slot:
            value = const_value(self.editor, ref, self.folded)
            axis = self.shapes.axis(f"{op}:0") or 0  # where the op's output holds the batch
            rows = self.shapes.rows(f"{op}:0")
            if value is None and node_type in OUTPUT_SHAPE_INPUTS and self.shapes.grows(f"{op}:0"):
                # a shape computed at run time (an embedding gradient's rows: the ids' size beside the table's
                # shape): the op makes that shape, known statically, so a part's is its share of it
                dtype = tf.as_dtype(self.editor.nodes[op].attr[OUTPUT_SHAPE_INPUTS[node_type]].type)
                return self.const(f"{part_name(op, i)}/batch_shape",
                                  np.asarray(self.shapes.with_part(f"{op}:0", n), dtype.as_numpy_dtype))
            if value is not None and value.ndim == 1 and len(value) > axis and int(value[axis]) == self.batch * rows:
                if node_type == "Tile" and self._tiles_a_part(r, op, i):
                    raise PlanError(f"split: {op} cannot run in parts: a Tile repeating a batch-dependent tensor "
                                    "along the batch")
                value = value.copy()
                value[axis] = n * rows
                return self.const(f"{part_name(op, i)}/batch_shape", value)
        waits = self._waits_only_for_region(source)
        if waits:  # a constant made after region ops (TF's gradients make some so): part i's copy waits for part i
            copy = part_name(source, i)
            if copy not in self.editor.nodes:
                parts = self.regions[r].parts
                self.add(copy, self.editor.nodes[source].op, [f"^{c}" for wait in waits
                                                              for c in self._control_sources(wait, i, parts)],
                         like=self.editor.nodes[source], keep=True)
            return tensor_ref(copy, k)
        return ref

    def _waits_only_for_region(self, source: str) -> list[str]:
        """The region ops an op outside the regions with no data input waits for (a constant under TF's control
        dependencies) where it waits for nothing else, else none: the simulator has no such constant."""
        node = self.editor.nodes.get(source)
        if node is None or source in self.region_of or self.editor.data_inputs(node):
            return []
        waits = [ref[1:] for ref in node.input if ref.startswith("^")]
        return waits if waits and all(wait in self.region_of for wait in waits) else []

    def _tiles_a_part(self, r: int, op: str, i: int) -> bool:
        ref = self.editor.data_inputs(self.editor.nodes[op])[0][1]
        source, k = self.editor.resolve(ref)
        return self.region_of.get(source) == r or self.shapes.grows(f"{source}:{k}")

    # ------------------------------------------------------------------ building

    def build(self, fetches: frozenset[str]) -> list[AppliedSplit]:
        for r, region in enumerate(self.regions):
            try:
                part_batches(self.batch, region.parts)
            except GraphError as error:
                raise PlanError(f"split region {r}: {error}") from None
            for op in region.ops:
                if op not in self.editor.nodes:
                    raise PlanError(f"split region {r} names {op!r}, which this model's training step does not "
                                    "have: the plan was made for another model or version")
                if op in self.region_of:
                    raise PlanError(f"split region {r}: {op!r} is in region {self.region_of[op]} already")
                self.region_of[op] = r
        for op in self.region_of:
            self.kind[op] = self.classify(op)
        self._fold_static_shapes()
        order = self._topological()
        for op in order:
            self._build_op(op)
        self._rewire_outside(fetches)
        return [AppliedSplit(r, region.parts, tuple(part_batches(self.batch, region.parts)),
                             tuple(op for op in order if self.region_of[op] == r),
                             tuple(op for op in order if self.region_of[op] == r and self.kind[op] == "per-sample"),
                             tuple(p for op in order if self.region_of[op] == r for p in self.parts[op]),
                             tuple(self.added[r]["combines"]), tuple(self.added[r]["concats"]),
                             tuple(self.added[r]["entries"]))
                for r, region in enumerate(self.regions)]

    def _topological(self) -> list[str]:
        order: list[str] = []
        state: dict[str, int] = {}

        def visit(op: str) -> None:
            stack = [(op, False)]
            while stack:
                name, leaving = stack.pop()
                if leaving:
                    state[name] = 2
                    order.append(name)
                    continue
                if state.get(name):
                    continue
                state[name] = 1
                stack.append((name, True))
                node = self.editor.nodes[name]
                for ref in node.input:
                    source = self.editor.resolve(ref.lstrip("^"))[0] if not ref.startswith("^") else ref[1:]
                    for before in [source, *self._waits_only_for_region(source)]:  # a part's copy waits for them
                        if before in self.region_of and not state.get(before):
                            stack.append((before, False))

        for op in self.region_of:
            visit(op)
        return order

    def _build_op(self, op: str) -> None:
        r, original = self.region_of[op], self.editor.nodes[op]
        batches = part_batches(self.batch, self.regions[r].parts)
        kind = self.kind[op]
        sources = [ref[1:] for ref in original.input if ref.startswith("^")]
        self.parts[op] = []
        for i, n in enumerate(batches):
            inputs = [self.part_input(r, op, slot, ref, i, n) for slot, ref in self.editor.data_inputs(original)]
            node = self.add(part_name(op, i), "Sum" if kind == "mean" else original.op, inputs, like=original,
                            keep=True)
            node.input.extend(f"^{c}" for source in sources for c in self._control_sources(source, i, len(batches)))
            self.parts[op].append(node.name)
        self.done[op] = list(self.parts[op])
        if kind == "per-sample":
            return
        outputs = self.shapes.outputs[op]
        self.done[op] = []
        for k in range(outputs):
            so_far, dtype = tensor_ref(self.parts[op][0], k), self.shapes.dtypes[f"{op}:{k}"]
            last = len(self.parts[op]) - 2
            for j, part in enumerate(self.parts[op][1:]):
                name = combine_name(op, j if outputs == 1 else f"{k}_{j}")
                step = f"{name}/sum" if kind == "mean" and j == last else name  # the mean itself keeps the name
                node = self.add(step, COMBINE_OP_TYPES[kind], [so_far, tensor_ref(part, k)], keep=True, region=r,
                                role="combines")
                node.attr["T"].type = dtype.as_datatype_enum
                if j + 2 < len(self.parts[op]):  # the next partial waits: two partials at once, not all
                    self.editor.nodes[self.parts[op][j + 2]].input.append(f"^{step}")
                so_far = step
                self.done[op].append(step)
            if kind == "mean":
                so_far = self._scale(op, so_far, so_far.removesuffix("/sum"), dtype)
                self.done[op].append(so_far)
            self.whole[f"{op}:{k}"] = so_far

    def _control_sources(self, source: str, part: int, parts: int) -> list[str]:
        """What part ``part`` of an op in ``parts`` parts waits for where the op waited for ``source``: the same part
        of a per-sample op in as many parts (``simulator.split.actions._part_by_part``), else all ``source`` does."""
        done = self.done.get(source, [source])
        if self.kind.get(source) == "per-sample" and len(done) == parts:
            return [done[part]]
        return done

    def _scale(self, op: str, total: str, name: str, dtype) -> str:
        """A mean's combined sum divided by the whole batch's count of reduced elements: the combine's last
        step (``name``; the simulator's, whose last step makes the mean), the sum its ``/sum``."""
        original = self.editor.nodes[op]
        data, axes = [ref for _, ref in self.editor.data_inputs(original)][:2]
        shape = self.shapes.at_batch.get("%s:%d" % self.editor.resolve(data))
        axes_value = const_value(self.editor, axes, self.folded)
        if shape is None or axes_value is None:
            raise PlanError(f"split: {op} cannot run in parts: a Mean over axes or a shape not known before the step")
        count = int(np.prod([shape[int(a)] for a in np.atleast_1d(axes_value)]))
        divisor = self.const(f"{name}/count", np.asarray(count, dtype.as_numpy_dtype))
        node = self.add(name, "RealDiv", [total, divisor], keep=True, region=self.region_of[op], role="combines")
        node.attr["T"].type = dtype.as_datatype_enum
        return node.name

    def _fold_static_shapes(self) -> None:
        """A ``Shape``, ``ShapeN``, ``Size`` or ``Rank`` of a split op's output (or of any tensor that grows with
        the batch: a region's shape input computed from it is then a constant too) becomes the constant it is,
        before the parts are made: a part's shape input naming the batch is then a constant to rewrite (a
        convolution's input-size gradient reads a ``ShapeN``), and no concatenation of the parts is made for
        it (Grappler's constant folding would fold it with a control edge from that concatenation, which the
        plan's order runs late: a cycle)."""
        for node in list(self.editor.graph_def.node):
            data = self.editor.data_inputs(node)
            reads = [self.editor.resolve(ref) for _, ref in data]
            if node.name in self.region_of or node.op not in ("Shape", "ShapeN", "Size", "Rank") \
                    or not any(source in self.region_of or self.shapes.grows(f"{source}:{k}") for source, k in reads):
                continue
            shapes = [self.shapes.at_batch.get(f"{source}:{k}") for source, k in reads]
            if any(shape is None for shape in shapes):
                continue
            dtype = tf.as_dtype(node.attr["out_type"].type) if "out_type" in node.attr else tf.int32
            values = [{"Shape": shape, "ShapeN": shape, "Size": np.prod(shape), "Rank": len(shape)}[node.op]
                      for shape in shapes]
            controls = [ref for ref in node.input if ref.startswith("^")]
            consts = [self.const(f"{node.name}/split_static_{k}", np.asarray(value, dtype.as_numpy_dtype))
                      for k, value in enumerate(values)]
            was = node.op
            node.ClearField("attr")
            del node.input[:]
            if was == "ShapeN":  # its outputs, one constant each
                node.op = "IdentityN"
                node.input.extend(consts + controls)
                node.attr["T"].list.type.extend([dtype.as_datatype_enum] * len(consts))
            else:
                node.op = "Identity"
                node.input.extend(consts[:1] + controls)
                node.attr["T"].type = dtype.as_datatype_enum

    def _rewire_outside(self, fetches: frozenset[str]) -> None:
        """Readers outside the regions read the whole tensors; the originals go, and so do the concatenations
        and pure readers nothing reads any more (an Identity between two ops of a region, the gradient of a
        Dropout mask's zeros, of the step's input: Grappler drops them, but only after folding constants)."""
        rewired = set()
        for node in list(self.editor.graph_def.node):
            if node.name in self.region_of or SPLIT_ATTR in node.attr:
                continue
            inputs = []
            for ref in node.input:
                if ref.startswith("^"):
                    source = ref[1:]
                    inputs += [f"^{c}" for c in self.done[source]] if source in self.region_of else [ref]
                elif parse_ref(ref)[0] in self.region_of:
                    inputs.append(self.whole_of(ref))
                else:
                    inputs.append(ref)
            if inputs != list(node.input):
                data = [ref for ref in inputs if not ref.startswith("^")]
                del node.input[:]
                node.input.extend(data + list(dict.fromkeys(ref for ref in inputs if ref.startswith("^"))))
                rewired.add(node.name)
        readers: dict[str, list[str]] = {}
        for node in self.editor.graph_def.node:
            for ref in node.input:
                readers.setdefault(parse_ref(ref.lstrip("^"))[0], []).append(node.name)
        pending = list(rewired)
        while pending:  # what reads a whole tensor, directly or not, may be dead code of the original step
            for reader in readers.get(pending.pop(), ()):
                if reader not in rewired:
                    rewired.add(reader)
                    pending.append(reader)
        gone = set(self.region_of)
        while True:  # readers counted without the nodes gone
            read = {parse_ref(ref.lstrip("^"))[0] for node in self.editor.graph_def.node if node.name not in gone
                    for ref in node.input}
            concats = {name for name in self.whole.values() if self.editor.nodes[name].op == "ConcatV2"}
            live = gone | read | fetches
            dead = {node.name for node in self.editor.graph_def.node if node.name not in live
                    and ((node.name in rewired and pure(node)) or node.name in concats
                         or node.name.rpartition("/")[0] in concats)}
            if not dead:
                break
            gone |= dead
        for r, added in self.added.items():
            added["concats"][:] = [name for name in added["concats"] if name not in gone]
        kept = [node for node in self.editor.graph_def.node if node.name not in gone]
        for node in kept:  # colocation with a node that is gone: dropped (a part is placed as its original was)
            if "_class" in node.attr:
                groups = [g for g in node.attr["_class"].list.s if g.decode().removeprefix("loc:@") not in gone]
                if groups:
                    del node.attr["_class"].list.s[:]
                    node.attr["_class"].list.s.extend(groups)
                else:
                    del node.attr["_class"]
        del self.editor.graph_def.node[:]
        self.editor.graph_def.node.extend(kept)
        for name in gone:
            del self.editor.nodes[name]


def with_weighted_ops(graph_def: graph_pb2.GraphDef, regions: Sequence[SplitRegion], shapes: BatchShapes,
                      order: Sequence[str], weights: Sequence[str]) -> tuple[SplitRegion, ...]:
    """``regions`` grown by the ops a weight per sample adds to the step the plan was made on: ``model.fit`` with
    ``sample_weight`` runs the plan on the step traced with the weights (``weights``: their input nodes), whose loss
    is multiplied by them between two ops of a region. Such an op (fed by the weights, none of the plan's ``order``
    stands for it, every data reader of its in one region, an input from it, its outputs per-sample) joins that
    region; left out, the region would join its parts there and split them again, every part's loss would wait for
    every part's forward, and an order that runs a part's backward before the next part's forward is a cycle."""
    if not order or not regions or not weights:
        return tuple(regions)
    planned = {split_origin(original_name(op)) for op in order}
    nodes = {node.name: node for node in graph_def.node}
    readers: dict[str, set[str]] = {}
    for node in graph_def.node:
        for ref in node.input:
            if not ref.startswith("^"):
                readers.setdefault(parse_ref(ref)[0], set()).add(node.name)
    weighted, stack = set(), list(weights)
    while stack:  # every op fed by a weight
        for reader in readers.get(stack.pop(), ()):
            if reader not in weighted:
                weighted.add(reader)
                stack.append(reader)
    grown = [set(region.ops) for region in regions]
    changed = True
    while changed:
        changed = False
        for name in sorted(weighted - planned):
            outputs = [f"{name}:{k}" for k in range(shapes.outputs.get(name, 0))]
            if any(name in ops for ops in grown) or not outputs or not all(shapes.grows(ref) for ref in outputs):
                continue
            inputs = {parse_ref(ref)[0] for ref in nodes[name].input if not ref.startswith("^")}
            for ops in grown:
                if readers.get(name) and readers[name] <= ops and inputs & ops:
                    ops.add(name)
                    changed = True
                    break
    return tuple(SplitRegion(tuple(region.ops) + tuple(sorted(ops - set(region.ops))), region.parts)
                 for region, ops in zip(regions, grown))


def apply_splits(graph_def: graph_pb2.GraphDef, regions: Sequence[SplitRegion], shapes: BatchShapes, *,
                 fetches: Sequence[str] = (), passthrough: dict[str, int] | None = None
                 ) -> tuple[graph_pb2.GraphDef, list[AppliedSplit]]:
    """A copy of ``graph_def`` with every region built (see the module's docstring); PlanError for one that
    cannot be, naming the op that ends it and why (nothing is changed). ``fetches``: the step's outputs
    (node names), which must not be ops of a region."""
    split_fetches = sorted(set(fetches) & {op for region in regions for op in region.ops})
    if split_fetches:
        raise PlanError(f"split: {split_fetches[0]} is an output of the step: a region cannot hold it")
    edited = graph_pb2.GraphDef()
    edited.CopyFrom(graph_def)
    editor = GraphEditor(edited, passthrough=passthrough)
    applied = _PartsBuilder(editor, regions, shapes).build(frozenset(fetches))
    editor.check_acyclic()
    return edited, applied


def check_part_shapes(graph, applied: Sequence[AppliedSplit], shapes: BatchShapes) -> None:
    """PlanError when a part's static shape in the imported ``graph`` is not its share of the original's
    (a per-sample op: the part's batch, then the original's dimensions) or a partial's is not the original's."""
    for item in applied:
        for part in item.part_nodes:
            op, _, i = part.rpartition(PART_MARK)
            for k in range(shapes.outputs.get(op, 0)):
                whole = shapes.at_batch.get(f"{op}:{k}")
                if whole is None:
                    continue
                want = shapes.with_part(f"{op}:{k}", item.part_batches[int(i)]) if op in item.per_sample else whole
                got = graph.get_tensor_by_name(f"{part}:{k}").shape
                if not got.is_fully_defined() or tuple(got.as_list()) != tuple(want):
                    raise PlanError(f"split: part {i} of {op} has shape {got} where {list(want)} was expected: a "
                                    "constant in it names the batch, or it moves samples along the batch axis")
