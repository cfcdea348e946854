"""A split region as a graph transformation: its ops run in parts along the batch (docs/design.md 12).

``with_splits(g, regions)`` returns a new ``OpGraph`` in which every op of a region is replaced by
``parts`` ops, each running on its part of the batch, as ``with_recomputes`` adds clones. The split
graph is a simulation of what the rewriter would build; it holds at ``g.batch_size`` (the parts'
sizes are that batch's; at another batch size each part keeps its share of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from simulator.graph import COMBINE_MARK, PART_MARK, SPLIT_MARK, GraphError, OpGraph
from simulator.recompute.actions import inputs_of, outputs_of
from simulator.split.classes import BATCH_SUM, ENDS, OWN_BUFFER_SHAPES, batch_dependent, op_split, rows_of_dim

# TF's Split/SplitV along the first axis hands out parts of its input's buffer only when a row's bytes are a
# multiple of Eigen's largest alignment (split_op.cc's IsInnerDimsSizeAligned: EIGEN_MAX_ALIGN_BYTES, 64 on the
# testbed's build; a build aligned to less shares more, so 64 errs on the side of a copy)
SPLIT_SHARE_ALIGN_BYTES = 64
# the op type of one step of each combine kind (a running combine: part i's partial joins the result so far)
COMBINE_OP_TYPES = {"sum": "AddV2", "mean": "AddV2", "max": "Maximum", "min": "Minimum", "prod": "Mul"}


@dataclass(frozen=True)
class SplitRegion:
    """Ops of the captured step (by name) that run in ``parts`` parts along the batch."""

    ops: tuple[str, ...]
    parts: int


def split_records(regions: Sequence[SplitRegion]) -> list[dict]:
    """The plan file's ``splits`` entry (``simulator.plan``, format 3): a region per record."""
    return [{"ops": list(region.ops), "parts": region.parts} for region in regions]


def read_split_records(records, error: type[GraphError] = GraphError) -> tuple[SplitRegion, ...]:
    """The regions of a plan file's ``splits`` entry; ``error`` names the first malformed record."""
    if not isinstance(records, list):
        raise error("the plan's 'splits' must be a list of regions")
    regions = []
    for r, record in enumerate(records):
        ops, parts = (record.get("ops"), record.get("parts")) if isinstance(record, dict) else (None, None)
        if not isinstance(ops, list) or not ops or not all(isinstance(op, str) for op in ops) \
                or isinstance(parts, bool) or not isinstance(parts, int) or parts < 2:
            raise error(f"split region {r} of the plan is malformed (needs 'ops', a list of op names, and "
                             "'parts', a whole number of at least 2)")
        regions.append(SplitRegion(tuple(ops), parts))
    return tuple(regions)


def split_parts(g: OpGraph) -> int:
    """The most parts of a region ``g`` holds (0: a step not split)."""
    return max((region.parts for region in held_regions(g)), default=0)


def held_regions(g: OpGraph) -> tuple[SplitRegion, ...]:
    """The regions a split graph holds, as ``SplitRegion`` records (none for a captured step)."""
    return tuple(SplitRegion(tuple(record["ops"]), int(record["parts"])) for record in split_regions(g))


def with_plan_splits(g: OpGraph, regions: Sequence[SplitRegion], error: type[GraphError] = GraphError) -> OpGraph:
    """``g`` with a plan's ``regions`` (``g`` itself when it holds them, or when there are none); ``error`` for
    a graph split otherwise or regions that do not fit it."""
    held = held_regions(g)
    if held == tuple(regions):
        return g
    if held:
        raise error("the graph holds other split regions than the plan's: pass the captured step's graph")
    try:
        return with_splits(g, regions)
    except GraphError as found:
        raise error(f"the plan's split regions do not fit this graph ({found})") from None


def part_batches(batch_size: int, parts: int) -> list[int]:
    """The samples of each part: as even as they can be, the first ``batch_size % parts`` one larger."""
    if parts < 2 or parts > batch_size:
        raise GraphError(f"a batch of {batch_size} cannot run in {parts} parts (2 to the batch size)")
    return [batch_size // parts + (i < batch_size % parts) for i in range(parts)]


def part_name(op: str, part: int) -> str:
    return f"{op}{PART_MARK}{part}"


def combine_name(op: str, step: int | str) -> str:
    """Step ``step`` of the running combine of ``op``'s partials (``<output>_<step>`` for an op of several)."""
    return f"{op}{COMBINE_MARK}{step}"


def concat_name(op: str, output: int) -> str:
    return f"{op}{SPLIT_MARK}concat_{output}"


def entry_name(op: str, output: int, region: int) -> str:
    return f"{op}{SPLIT_MARK}batch_{output}_{region}"


def split_origin(name: str) -> str:
    """The op of the captured step that a split graph's op stands for (``name`` itself when it is one)."""
    return name.partition(SPLIT_MARK)[0]


def split_step_ops(g: OpGraph) -> np.ndarray:
    """Per op of ``g``: a part or a combine of a split region (none in a step not split)."""
    if not g.meta.get("splits"):
        return np.zeros(g.n_ops, bool)
    return g.cached("split_step_ops", lambda graph: (np.char.find(graph.op_name.astype(str), PART_MARK) >= 0)
                    | (np.char.find(graph.op_name.astype(str), COMBINE_MARK) >= 0), structural=True)


def split_regions(g: OpGraph) -> list[dict]:
    """The regions a split graph holds, as ``with_splits`` noted them in its meta."""
    return list(g.meta.get("splits", []))


class _SplitGraphBuilder:
    """The split graph's arrays as lists, the captured graph's rows copied in first."""

    def __init__(self, g: OpGraph, kept_ops: np.ndarray):
        self.g = g
        self.op_rows = {name: [] for name in ("name", "type", "phase", "flops", "touched", "forwards")}
        self.tensor_rows = {name: [] for name in
                            ("producer", "output", "dtype", "shape", "bytes", "alias", "persistent", "swappable")}
        self.edges: list[tuple[int, int, int]] = []
        self.controls: list[tuple[int, int]] = []
        self.new_op = np.full(g.n_ops, -1, np.int64)
        for op in kept_ops.tolist():
            self.new_op[op] = self.add_op(str(g.op_name[op]), op)

    def add_op(self, name: str, like: int, *, type_: str | None = None, flops=None, touched=None,
               forwards: bool | None = None) -> int:
        g, rows = self.g, self.op_rows
        rows["name"].append(name)
        rows["type"].append(str(g.op_type[like]) if type_ is None else type_)
        rows["phase"].append(int(g.op_phase[like]))
        rows["flops"].append(tuple(g.op_flops_ab[like]) if flops is None else flops)
        rows["touched"].append(tuple(g.op_touched_bytes_ab[like]) if touched is None else touched)
        rows["forwards"].append(bool(g.op_forwards_input[like]) if forwards is None else forwards)
        return len(rows["name"]) - 1

    def add_tensor(self, producer: int, output: int, like: int, *, bytes_ab=None, shape: str | None = None,
                   alias: int = -1, persistent: bool = False) -> int:
        g, rows = self.g, self.tensor_rows
        rows["producer"].append(producer)
        rows["output"].append(output)
        rows["dtype"].append(str(g.tensor_dtype[like]))
        rows["shape"].append(str(g.tensor_shape[like]) if shape is None else shape)
        rows["bytes"].append(tuple(g.tensor_bytes_ab[like]) if bytes_ab is None else bytes_ab)
        rows["alias"].append(alias)
        rows["persistent"].append(persistent)
        rows["swappable"].append(bool(g.tensor_swappable[like]))
        return len(rows["producer"]) - 1

    def graph(self, outputs: list[int], meta: dict, held: list[tuple[int, int]]) -> OpGraph:
        g, ops, tensors = self.g, self.op_rows, self.tensor_rows
        edges = np.asarray(self.edges, np.int64).reshape(-1, 3)
        controls = np.asarray(self.controls, np.int64).reshape(-1, 2)
        return OpGraph.build(
            op_name=ops["name"], op_type=ops["type"], op_phase=ops["phase"], op_flops_ab=ops["flops"],
            op_touched_bytes_ab=ops["touched"], op_forwards_input=ops["forwards"],
            tensor_producer=tensors["producer"], tensor_output=tensors["output"], tensor_dtype=tensors["dtype"],
            tensor_shape=tensors["shape"], tensor_bytes_ab=tensors["bytes"], tensor_alias_of=tensors["alias"],
            tensor_persistent=tensors["persistent"], tensor_swappable=tensors["swappable"],
            edge_tensor=edges[:, 0], edge_consumer=edges[:, 1], edge_slot=edges[:, 2],
            control_src=controls[:, 0], control_dst=controls[:, 1], persistent_bytes_ab=g.persistent_bytes_ab,
            outputs=outputs, held_tensor=[t for t, _ in held], held_read=[r for _, r in held],
            batch_size=g.batch_size, meta=meta)


def _itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named by the capture (4 for one numpy does not know)."""
    try:
        return max(np.dtype(dtype).itemsize, 1)
    except TypeError:
        return 4


def _entry_shares_buffer(g: OpGraph, tensor: int) -> bool:
    """Whether TF's split of ``tensor`` at a region's entry leaves its parts in the whole's buffer: only along the
    first axis and where a row's bytes are a multiple of ``SPLIT_SHARE_ALIGN_BYTES``; elsewhere it copies each
    part (the tiny CNN's 6x6x2 float input, 288 B a sample, was copied: 2.3 KiB at batch 8 over its prediction)."""
    rows = rows_of_dim(str(g.tensor_shape[tensor]).strip("()").split(",")[0])  # the first axis, as TF's split sees it
    if not rows:  # the batch on another axis (or no shape known): TF's split copies
        return False
    row_bytes = float(g.tensor_bytes_ab[tensor][1]) / rows
    return row_bytes.is_integer() and int(row_bytes) % SPLIT_SHARE_ALIGN_BYTES == 0


def _part_shape(shape: str, share: str) -> str:
    """The shape text of a part: the batch dimension marked with the part's share (the leading one, or the one
    ``N`` of a tensor holding the batch on another axis)."""
    if shape.startswith("(N"):
        return f"(N*{share}{shape[2:]}"
    dims = shape.strip("()").split(",")
    return "(" + ",".join(f"N*{share}" if dim == "N" else dim for dim in dims) + ")" if dims.count("N") == 1 else shape


def _part_by_part(src: int, dst: int, part_ops: dict[int, list[int]], done_ops: dict[int, list[int]]) -> bool:
    """Whether a control edge between two split ops joins their parts one to one: ``src`` runs per sample (what
    waits for it waits for its parts, no combine) and both run in as many parts, so part ``i`` holds the same
    samples in both. Such an edge only orders stateless ops (stateful ones end a region), and part ``i`` of
    ``dst`` after part ``i`` of ``src`` keeps that order for the samples it holds."""
    return (src in part_ops and dst in part_ops and done_ops.get(src) is part_ops[src]
            and len(part_ops[src]) == len(part_ops[dst]))


def with_splits(g: OpGraph, regions: Sequence[SplitRegion]) -> OpGraph:
    """A new graph: every op of every region replaced by its ``parts`` parts (``g`` is left as it is).

    Part i of op ``o`` (``part_name(o, i)``) runs on ``part_batches(batch, parts)[i]`` samples: its
    batch-dependent outputs and its cost coefficients are ``a + b * n_i`` (the op's own coefficients
    at the part's batch, not a share of its time). A per-sample op's parts read the parts of tensors
    made in the region (kept as separate tensors between its ops); a batch-dependent tensor from
    outside is cut at the region's entry by a ``Split`` along the batch whose parts share its buffer
    where TF's split does not copy (``_entry_shares_buffer``), else are copies of their own. A batch-summing
    op's parts make partial results of the whole output's size, joined by a running combine
    (``COMBINE_OP_TYPES``, writing in place;
    part i + 2 waits for the step that joined part i + 1, so two partials are on the device at once, not
    ``parts``; a mean's parts make sums, its last step is their sum ``<step>/sum`` over the whole batch's
    count, as the rewriter builds it); its combined output is what every reader
    reads. A reader outside the region, or the step's fetch, that needs a per-sample tensor whole
    reads a ``ConcatV2`` of its parts. Control edges from a split op wait for all its parts (or its
    combine), those to it hold back every part. Raises GraphError on a region ``g`` cannot hold.
    """
    if not regions:
        return g
    op_index = g.op_index()
    region_of = np.full(g.n_ops, -1, np.int64)
    classes = {}
    for r, region in enumerate(regions):
        part_batches(g.batch_size, region.parts)
        for name in region.ops:
            op = op_index.get(name)
            if op is None or split_origin(name) != name:
                raise GraphError(f"split region {r}: {name!r} is not an op of the captured step")
            if region_of[op] >= 0:
                raise GraphError(f"split region {r}: {name!r} is in region {region_of[op]} already")
            found = op_split(g, op)
            if found.kind == ENDS:
                raise GraphError(f"split region {r}: {name!r} cannot run in parts: {found.reason}")
            region_of[op] = r
            classes[op] = found
    grows = batch_dependent(g)
    made, read = outputs_of(g), inputs_of(g)
    builder = _SplitGraphBuilder(g, np.flatnonzero(region_of < 0))
    new_tensor = np.full(g.n_tensors, -1, np.int64)
    for tensor in np.flatnonzero(region_of[g.tensor_producer] < 0).tolist():
        new_tensor[tensor] = builder.add_tensor(
            int(builder.new_op[g.tensor_producer[tensor]]), int(g.tensor_output[tensor]), tensor,
            persistent=bool(g.tensor_persistent[tensor]))
    parts_of_tensor: dict[int, list[int]] = {}  # a per-sample op's output -> its parts
    done_ops: dict[int, list[int]] = {}  # a split op -> the new ops a control edge from it waits for
    part_ops: dict[int, list[int]] = {}
    records = []
    for r, region in enumerate(regions):
        batches = part_batches(g.batch_size, region.parts)
        shares = [n / g.batch_size for n in batches]
        combines = {}
        for name in region.ops:
            op = op_index[name]
            a_flops, b_flops = g.op_flops_ab[op]
            a_touched, b_touched = g.op_touched_bytes_ab[op]
            part_ops[op] = [builder.add_op(part_name(name, i), op, flops=(a_flops, b_flops * share),
                                           touched=(a_touched, b_touched * share)) for i, share in enumerate(shares)]
            if classes[op].kind == BATCH_SUM:
                combines[name] = classes[op].combine
            outputs_of_op = [t for t in made[op] if str(g.tensor_shape[t]) not in OWN_BUFFER_SHAPES]  # not its scratch
            for tensor in made[op]:
                a, b = g.tensor_bytes_ab[tensor]
                parts = [builder.add_tensor(new, int(g.tensor_output[tensor]), tensor, bytes_ab=(a, b * share),
                                            shape=_part_shape(str(g.tensor_shape[tensor]), f"{n}/{g.batch_size}"))
                         for new, n, share in zip(part_ops[op], batches, shares)]
                if classes[op].kind != BATCH_SUM or tensor not in outputs_of_op:
                    parts_of_tensor[tensor] = parts  # a batch-summing op's scratch: each part its own
                    continue
                # the running combine: step j joins partial j + 1 to the result so far, in its buffer
                so_far, combine_ops = parts[0], []
                elements = a / _itemsize(str(g.tensor_dtype[tensor]))
                for step, partial in enumerate(parts[1:]):
                    step_name = combine_name(name, step if len(outputs_of_op) == 1
                                             else f"{g.tensor_output[tensor]}_{step}")
                    mean = classes[op].combine == "mean" and step == len(parts) - 2  # the sum, then the mean
                    combine = builder.add_op(f"{step_name}/sum" if mean else step_name, op,
                                             type_=COMBINE_OP_TYPES[classes[op].combine], flops=(elements, 0.0),
                                             touched=(3.0 * a, 0.0), forwards=True)
                    builder.edges += [(so_far, combine, 0), (partial, combine, 1)]
                    if step + 2 < len(parts):  # the next partial waits: two partials on the device, not all
                        builder.controls.append((combine, part_ops[op][step + 2]))
                    so_far = builder.add_tensor(combine, 0, tensor)
                    combine_ops.append(combine)
                    if mean:  # the rewriter's mean: the parts' sums over the whole batch's count, in place
                        scale = builder.add_op(step_name, op, type_="RealDiv", flops=(elements, 0.0),
                                               touched=(2.0 * a, 0.0), forwards=True)
                        builder.edges.append((so_far, scale, 0))
                        so_far = builder.add_tensor(scale, 0, tensor)
                        combine_ops.append(scale)
                new_tensor[tensor] = so_far
                done_ops[op] = done_ops.get(op, []) + combine_ops
            done_ops.setdefault(op, part_ops[op])
        records.append({"ops": list(region.ops), "parts": region.parts, "batch_size": g.batch_size,
                        "part_batches": batches, "combines": combines, "concats": [], "entries": []})

    def whole(tensor: int) -> int:
        """A per-sample tensor made in a region, whole: the concatenation of its parts (made once)."""
        if new_tensor[tensor] < 0:
            producer = int(g.tensor_producer[tensor])
            a, b = g.tensor_bytes_ab[tensor]
            concat = builder.add_op(concat_name(str(g.op_name[producer]), int(g.tensor_output[tensor])), producer,
                                    type_="ConcatV2", flops=(0.0, 0.0), touched=(2.0 * a, 2.0 * b), forwards=False)
            builder.edges += [(part, concat, i) for i, part in enumerate(parts_of_tensor[tensor])]
            new_tensor[tensor] = builder.add_tensor(concat, 0, tensor)
            records[region_of[producer]]["concats"].append(g.tensor_name(tensor))
        return int(new_tensor[tensor])

    entries: dict[tuple[int, int], list[int]] = {}

    def parts_in(r: int, tensor: int, reader: int) -> list[int]:
        """What part i of a region-``r`` op reads for ``tensor``."""
        if region_of[g.tensor_producer[tensor]] == r and tensor in parts_of_tensor:
            return parts_of_tensor[tensor]
        if not grows[tensor]:
            return [whole(tensor) if tensor in parts_of_tensor else int(new_tensor[tensor])] * regions[r].parts
        if (r, tensor) not in entries:  # cut at the region's entry, the parts sharing the whole's buffer or copied
            source = whole(tensor) if tensor in parts_of_tensor else int(new_tensor[tensor])
            producer = int(g.tensor_producer[tensor])
            a, b = g.tensor_bytes_ab[tensor]
            shared = _entry_shares_buffer(g, tensor)
            split = builder.add_op(entry_name(str(g.op_name[producer]), int(g.tensor_output[tensor]), r), reader,
                                   type_="Split", flops=(0.0, 0.0), touched=(0.0, 0.0) if shared else (0.0, 2.0 * b),
                                   forwards=False)
            builder.edges.append((source, split, 0))
            batches = part_batches(g.batch_size, regions[r].parts)
            entries[(r, tensor)] = [
                builder.add_tensor(split, i, tensor, bytes_ab=(a, b * n / g.batch_size), alias=source if shared else -1,
                                   shape=_part_shape(str(g.tensor_shape[tensor]), f"{n}/{g.batch_size}"))
                for i, n in enumerate(batches)]
            records[r]["entries"].append(g.tensor_name(tensor))
        return entries[(r, tensor)]

    for op in range(g.n_ops):
        r = int(region_of[op])
        if r < 0:
            builder.edges += [(whole(t) if new_tensor[t] < 0 else int(new_tensor[t]), int(builder.new_op[op]), slot)
                              for t, slot in read[op]]
            continue
        for tensor, slot in read[op]:
            builder.edges += [(source, part, slot) for source, part in zip(parts_in(r, tensor, op), part_ops[op])]
    # an output aliasing an input aliases what its part reads there
    inputs_at = {(int(c), int(s)): int(t) for t, c, s in builder.edges}
    for tensor, parts in parts_of_tensor.items():
        parent = int(g.tensor_alias_of[tensor])
        if parent < 0:
            continue
        producer = int(g.tensor_producer[tensor])
        slot = next((s for t, s in read[producer] if t == parent), None)
        for part, op in zip(parts, part_ops[producer]):
            builder.tensor_rows["alias"][part] = inputs_at.get((op, slot), -1) if slot is not None else -1
    for src, dst in zip(g.control_src.tolist(), g.control_dst.tolist()):
        sources = done_ops.get(src, [int(builder.new_op[src])])
        targets = part_ops.get(dst, [int(builder.new_op[dst])])
        if _part_by_part(src, dst, part_ops, done_ops):  # each part waits for its own: micro-batches stay apart
            builder.controls += list(zip(sources, targets))
        else:
            builder.controls += [(s, d) for s in sources for d in targets]
    outputs = [whole(t) if new_tensor[t] < 0 else int(new_tensor[t]) for t in g.outputs.tolist()]
    meta = {**g.meta, "splits": split_regions(g) + records}
    # a variable's write holding a read's buffer (copy-on-write): both outside every region, renumbered
    held = [(int(new_tensor[t]), int(new_tensor[r])) for t, r in zip(g.held_tensor.tolist(), g.held_read.tolist())
            if new_tensor[t] >= 0 and new_tensor[r] >= 0]
    return builder.graph(outputs, meta, held).with_order(g.order)
