"""Exact graph rewrites that lower the peak where swapping cannot: applied to the traced step before
capture (so the simulator sees the graph that runs) and again, identically, before a plan's swaps.

``split-concat``: a convolution reading a channel concatenation ``conv(concat(x_0, .., x_n), W)``
becomes ``conv(x_0, W_0) + .. + conv(x_n, W_n)`` with ``W_k`` the kernel's input-channel slices;
its gradients follow (one ``BackpropInput`` per part in place of the concat gradient's slices, one
``BackpropFilter`` per part concatenated into the kernel's gradient). The concatenation never
exists, so no op must hold its inputs and output at once: in a U-Net's decoder that is the largest
working set of the step, the floor of any swap plan (``simulator.buffers.peak_lower_bound_bytes``).
The sum is the same up to float rounding (the channel sum is split in two).

``elide-broadcasts``: a ``Tile`` (or ``BroadcastTo``) whose output feeds only elementwise ops that
broadcast their operands anyway is dropped; they read its input. TF's gradient of a mean (Keras'
batch normalisation computes its moments with two) tiles the mean's per-channel gradient to the
activation's full shape and divides that by the count; after the rewrite the division is made on
the per-channel tensor and the sum of the batch-norm gradient's terms (an ``AddN``, which does not
broadcast) becomes a chain of ``AddV2`` with the full-shape terms first. Two activation-sized
buffers per batch normalisation never exist, so its backward holds two such buffers, not three
(with the convolution's input swapped back in). The values are the same (the same elementwise
operations on the same numbers); only the sum's order of additions can change its rounding.

Names: an op the rewrite replaces keeps its name (the sum takes the convolution's, the per-part
input gradients take the slices', the concatenated kernel gradient the filter gradient's), so the
rest of the graph reads the same tensors; new ops are ``<conv>/part<k>`` and friends.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import numpy as np
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2, tensor_pb2, types_pb2

from rewriter.tf_effects.passthrough import BROADCASTING_BINARY

# forward op -> (input gradient, filter gradient), all with the inputs of TF's convolution kernels
CONVOLUTIONS = {
    "Conv2D": ("Conv2DBackpropInput", "Conv2DBackpropFilter"),
    "Conv3D": ("Conv3DBackpropInputV2", "Conv3DBackpropFilterV2"),
}
CHANNELS_LAST = (b"NHWC", b"NDHWC")



def _editable_copy(graph_def: graph_pb2.GraphDef) -> tuple[graph_pb2.GraphDef, dict[str, Any],
                                                           dict[tuple[str, int], list[tuple[Any, int]]]]:
    """A copy of ``graph_def`` to rewrite, its nodes by name, and the (node, slot) reading each tensor."""
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    nodes = {node.name: node for node in out.node}
    readers: dict[tuple[str, int], list[tuple[Any, int]]] = defaultdict(list)
    for node in out.node:
        for slot, ref in enumerate(node.input):
            if not ref.startswith("^"):
                readers[_parse(ref)].append((node, slot))
    return out, nodes, readers

def _parse(ref: str) -> tuple[str, int]:
    name, _, index = ref.lstrip("^").partition(":")
    return name, int(index) if index else 0


def _const_value(node) -> np.ndarray | None:
    if node is None or node.op != "Const":
        return None
    tensor = node.attr["value"].tensor
    if tensor.int_val:
        return np.asarray(tensor.int_val, dtype=np.int64).reshape([d.size for d in tensor.tensor_shape.dim])
    if tensor.int64_val:
        return np.asarray(tensor.int64_val, dtype=np.int64).reshape([d.size for d in tensor.tensor_shape.dim])
    if tensor.tensor_content:
        dtype = np.int32 if tensor.dtype == types_pb2.DT_INT32 else np.int64
        return np.frombuffer(tensor.tensor_content, dtype=dtype).reshape([d.size for d in tensor.tensor_shape.dim])
    return None


def _int_const(name: str, values, device: str, *, int64: bool = False) -> node_def_pb2.NodeDef:
    """An int32 (or int64) constant: a vector, or a scalar when ``values`` is an int."""
    values = np.asarray(values, dtype=np.int64)
    dtype = types_pb2.DT_INT64 if int64 else types_pb2.DT_INT32
    node = node_def_pb2.NodeDef(name=name, op="Const", device=device)
    node.attr["dtype"].type = dtype
    tensor = tensor_pb2.TensorProto(dtype=dtype)
    if values.ndim:
        tensor.tensor_shape.dim.add().size = values.size
    (tensor.int64_val if int64 else tensor.int_val).extend(values.reshape(-1).tolist())
    node.attr["value"].tensor.CopyFrom(tensor)
    return node


def _node(name: str, op: str, inputs: list[str], like=None, device: str = "", **attrs) -> node_def_pb2.NodeDef:
    node = node_def_pb2.NodeDef(name=name, op=op, device=like.device if like is not None else device)
    node.input.extend(inputs)
    if like is not None:
        for key, value in like.attr.items():
            if not key.startswith("_"):
                node.attr[key].CopyFrom(value)
    for key, value in attrs.items():
        node.attr[key].CopyFrom(value)
    return node


def _type_attr(dtype: int) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(type=dtype)


def split_concat_convs(graph_def: graph_pb2.GraphDef, shape_of: Callable[[str], list[int] | None]
                       ) -> tuple[graph_pb2.GraphDef, list[str]]:
    """Return a rewritten copy of ``graph_def`` and the names of the concatenations split.

    ``shape_of("op:k")`` gives a tensor's static shape in the traced step. A concatenation is split
    when it joins channels-last inputs along the channel axis and its only readers are one
    convolution (as its input) and that convolution's filter gradients; anything else (another
    reader, an unknown shape, a grouped convolution) leaves it as it is.
    """
    out, nodes, readers = _editable_copy(graph_def)
    replaced: dict[str, list[Any]] = {}  # old name -> new nodes (same name first if kept)
    removed: set[str] = set()
    stand_in: dict[str, list[str]] = {}  # removed op -> control inputs that replace a control edge from it
    split: list[str] = []

    for concat in [node for node in out.node if node.op == "ConcatV2"]:
        n_parts = concat.attr["N"].i
        values = list(concat.input[:n_parts])
        axis = _const_value(nodes.get(_parse(concat.input[n_parts])[0]))
        out_shape = shape_of(f"{concat.name}:0")
        shapes = [shape_of(f"{_parse(v)[0]}:{_parse(v)[1]}") for v in values]
        if axis is None or out_shape is None or any(s is None for s in shapes) or n_parts < 2:
            continue
        rank = len(out_shape)
        if int(axis.reshape(-1)[0]) % rank != rank - 1:
            continue
        users = readers[(concat.name, 0)]
        forward = [node for node, slot in users if node.op in CONVOLUTIONS and slot == 0]
        if len(forward) != 1 or forward[0].attr["data_format"].s not in CHANNELS_LAST:
            continue
        conv = forward[0]
        input_grad_op, filter_grad_op = CONVOLUTIONS[conv.op]
        filter_grads = [node for node, slot in users if node.op == filter_grad_op and slot == 0]
        shape_readers = [node for node, _ in users if node.op in ("Shape", "ShapeN")]
        if len(forward) + len(filter_grads) + len(shape_readers) != len(users):
            continue
        static = {(reader.name, k): shape_of("%s:%d" % _parse(ref))
                  for reader in shape_readers for k, ref in enumerate(r for r in reader.input if r[0] != "^")}
        if any(shape is None for shape in static.values()):
            continue
        kernel_ref = conv.input[1]
        kernel_shape = shape_of("%s:%d" % _parse(kernel_ref))
        if kernel_shape is None or kernel_shape[-2] != out_shape[-1]:
            continue  # a grouped convolution, or a kernel of unknown shape
        # the concat gradient: one input gradient of this kernel whose readers are slices, matched
        # to the parts by the ConcatOffset output each slice starts at
        input_grads = [node for node, slot in readers[_parse(kernel_ref)] if node.op == input_grad_op and slot == 1]
        slices_of: dict[str, dict[int, Any]] = {}
        for grad in input_grads:
            found: dict[int, Any] = {}
            for reader, slot in readers[(grad.name, 0)]:
                offset = nodes.get(_parse(reader.input[1])[0]) if reader.op == "Slice" and slot == 0 else None
                if offset is None or offset.op != "ConcatOffset":
                    found = {}
                    break
                found[_parse(reader.input[1])[1]] = reader
            if found and len(found) == len(readers[(grad.name, 0)]):
                slices_of[grad.name] = found
        if len(slices_of) != len(input_grads):
            continue  # an input gradient of this kernel that is not the concat's: leave it whole

        device = conv.device
        widths = [s[-1] for s in shapes]
        starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(int).tolist()
        dtype = conv.attr["T"].type
        new: list[Any] = []
        kernel_parts = []
        for k, (start, width) in enumerate(zip(starts, widths)):
            begin = [0] * len(kernel_shape)
            begin[-2] = start
            size = list(kernel_shape)
            size[-2] = width
            base = f"{conv.name}/part{k}"
            new += [_int_const(f"{base}/kernel/begin", begin, device), _int_const(f"{base}/kernel/size", size, device)]
            new.append(_node(f"{base}/kernel", "Slice", [kernel_ref, f"{base}/kernel/begin", f"{base}/kernel/size"],
                             device=device, T=_type_attr(dtype), Index=_type_attr(types_pb2.DT_INT32)))
            kernel_parts.append(f"{base}/kernel")
            part = _node(base, conv.op, [values[k], f"{base}/kernel"], like=conv)
            part.input.extend(r for r in conv.input if r.startswith("^"))
            new.append(part)
        # the sum keeps the convolution's name: its readers are unchanged
        total = f"{conv.name}/part0"
        for k in range(1, n_parts):
            name = conv.name if k == n_parts - 1 else f"{conv.name}/sum{k}"
            new.append(_node(name, "AddV2", [total, f"{conv.name}/part{k}"], device=device, T=_type_attr(dtype)))
            total = name
        replaced[conv.name] = new

        for grad in filter_grads:
            parts = []
            for k, (width, value) in enumerate(zip(widths, values)):
                size = list(kernel_shape)
                size[-2] = width
                base = f"{grad.name}/part{k}"
                replaced.setdefault(grad.name, []).append(_int_const(f"{base}/filter_sizes", size, grad.device))
                replaced[grad.name].append(_node(base, grad.op, [value, f"{base}/filter_sizes", grad.input[2]],
                                                 like=grad))
                parts.append(base)
            axis_name = f"{grad.name}/axis"
            joined = _node(grad.name, "ConcatV2", parts + [axis_name], device=grad.device, T=_type_attr(dtype),
                           N=attr_value_pb2.AttrValue(i=n_parts), Tidx=_type_attr(types_pb2.DT_INT32))
            joined.input.extend(r for r in grad.input if r.startswith("^"))
            replaced[grad.name] += [_int_const(axis_name, len(kernel_shape) - 2, grad.device), joined]

        for grad_name, slices in slices_of.items():
            grad = nodes[grad_name]
            for k, piece in slices.items():
                sizes = f"{piece.name}/input_sizes"
                part_grad = _node(piece.name, grad.op, [sizes, kernel_parts[k], grad.input[2]], like=grad)
                part_grad.input.extend(r for r in list(grad.input) + list(piece.input) if r.startswith("^"))
                replaced[piece.name] = [_int_const(sizes, shapes[k], grad.device), part_grad]
            removed.add(grad_name)
            stand_in[grad_name] = [f"^{piece.name}" for piece in slices.values()]
        # shapes read from the concatenation (gradients' size inputs): constants, as Grappler folds them
        for (reader_name, k), shape in static.items():
            reader = nodes[reader_name]
            const = _int_const(f"{reader_name}/static{k}", shape, reader.device,
                               int64=reader.attr["out_type"].type == types_pb2.DT_INT64)
            replaced.setdefault(reader_name, []).append(const)
            for user, slot in readers[(reader_name, k)]:
                user.input[slot] = const.name
            removed.add(reader_name)
            stand_in[reader_name] = [f"^{_parse(v)[0]}" for v in values]
        removed.add(concat.name)
        stand_in[concat.name] = [f"^{_parse(v)[0]}" for v in values]
        split.append(concat.name)

    if not split:
        return out, split
    rebuilt = graph_pb2.GraphDef()
    rebuilt.CopyFrom(out)
    del rebuilt.node[:]
    for node in out.node:
        if node.name in replaced:
            rebuilt.node.extend(replaced[node.name])
        elif node.name not in removed:
            rebuilt.node.append(node)
    for node in rebuilt.node:  # control edges from removed ops: from what stands in for them
        if any(ref.startswith("^") and ref[1:] in stand_in for ref in node.input):
            refs = []
            for ref in node.input:
                refs += stand_in[ref[1:]] if ref.startswith("^") and ref[1:] in stand_in else [ref]
            del node.input[:]
            node.input.extend(dict.fromkeys(refs))
    return rebuilt, split


BROADCAST_OPS = ("Tile", "BroadcastTo")


def elide_broadcasts(graph_def: graph_pb2.GraphDef, shape_of: Callable[[str], list[int] | None]
                     ) -> tuple[graph_pb2.GraphDef, list[str]]:
    """Return a rewritten copy of ``graph_def`` and the names of the broadcasts dropped.

    A broadcast is dropped when every op downstream of it, up to one whose output keeps its full
    shape through another operand, is a broadcasting binary op or an ``AddN`` with a full-shape
    input; anything else (another reader, an unknown shape) keeps it.
    """
    out, nodes, readers = _editable_copy(graph_def)

    def shape(ref: str) -> tuple[int, ...] | None:
        known = shape_of("%s:%d" % _parse(ref))
        return None if known is None else tuple(known)

    def is_full(ref: str, full_shape: tuple[int, ...], shrunk: set[str]) -> bool:
        return shape(ref) == full_shape and _parse(ref)[0] not in shrunk and nodes[_parse(ref)[0]].op not in BROADCAST_OPS

    dropped: list[str] = []
    sums: set[str] = set()  # AddNs to rebuild as AddV2 chains (they do not broadcast)
    shrunk: set[str] = set()  # ops whose output is now smaller than before
    for broadcast in [node for node in out.node if node.op in BROADCAST_OPS]:
        source = broadcast.input[0]
        small, full = shape(source), shape(f"{broadcast.name}:0")
        if small is None or full is None:
            continue
        try:
            if np.broadcast_shapes(small, full) != full:
                continue
        except ValueError:
            continue
        # walk downstream while outputs are smaller than before: every reader must broadcast, and
        # stops the walk when another operand gives its output the full shape again
        walk, ok, new_shrunk, new_sums = [(broadcast.name, small)], True, set(), set()
        while walk and ok:
            name, now = walk.pop()
            for reader, slot in readers[(name, 0)]:
                before = shape(f"{reader.name}:0")
                if before is None:
                    ok = False
                elif reader.op in BROADCASTING_BINARY:
                    other = reader.input[1 - slot]
                    other_shape = shape(other)
                    if other_shape is None or _parse(other)[0] in shrunk | new_shrunk | {broadcast.name}:
                        ok = False
                        break
                    after = np.broadcast_shapes(now, other_shape)
                    if after != before:  # control edges from it still hold: the op stays
                        new_shrunk.add(reader.name)
                        walk.append((reader.name, after))
                elif reader.op == "AddN":
                    ok = any(is_full(ref, before, shrunk | new_shrunk) for ref in reader.input if ref[0] != "^")
                    new_sums.add(reader.name)
                else:
                    ok = False
                if not ok:
                    break
        if not ok:
            continue
        for reader, slot in readers[(broadcast.name, 0)]:
            reader.input[slot] = source
        shrunk |= new_shrunk
        sums |= new_sums
        dropped.append(broadcast.name)

    if not dropped:
        return out, dropped
    stand_in = {f"^{name}": f"^{_parse(nodes[name].input[0])[0]}" for name in dropped}
    rebuilt = graph_pb2.GraphDef()
    rebuilt.CopyFrom(out)
    del rebuilt.node[:]
    for node in out.node:
        if node.name in dropped:
            continue
        if any(ref in stand_in for ref in node.input):  # control edges from a dropped broadcast: from its input
            refs = [stand_in.get(ref, ref) for ref in node.input]
            del node.input[:]
            node.input.extend(dict.fromkeys(refs))
        if node.name not in sums:
            rebuilt.node.append(node)
            continue
        before = shape(f"{node.name}:0")
        terms = [ref for ref in node.input if not ref.startswith("^")]
        full_terms = [ref for ref in terms if is_full(ref, before, shrunk)]
        terms = full_terms + [ref for ref in terms if ref not in full_terms]
        total = terms[0]
        for k, term in enumerate(terms[1:], start=1):
            name = node.name if k == len(terms) - 1 else f"{node.name}/add{k}"
            controls = [ref for ref in node.input if ref.startswith("^")] if k == 1 else []
            rebuilt.node.append(_node(name, "AddV2", [total, term] + controls, device=node.device,
                                      T=_type_attr(node.attr["T"].type)))
            total = name
    return rebuilt, dropped


# name (as given to --rewrite and kept in plans) -> rewrite(graph_def, shape_of) -> (graph_def, changed ops)
REWRITES: dict[str, Callable[..., tuple[graph_pb2.GraphDef, list[str]]]] = {
    "split-concat": split_concat_convs,
    "elide-broadcasts": elide_broadcasts,
}


def apply_rewrites(graph_def: graph_pb2.GraphDef, rewrites, shape_of) -> tuple[graph_pb2.GraphDef, dict[str, list[str]]]:
    """Run the named rewrites in order; returns the graph and, per rewrite, what it changed."""
    changed: dict[str, list[str]] = {}
    for name in rewrites:
        if name not in REWRITES:
            raise ValueError(f"unknown graph rewrite {name!r}; known: {', '.join(REWRITES)}")
        graph_def, changed[name] = REWRITES[name](graph_def, shape_of)
    return graph_def, changed
