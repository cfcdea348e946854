"""Editing the step's GraphDef: swap nodes added, reads rewired, the step chained in the plan's order.

``edit_graph_def(graph_def, plan, placement, ...)`` applies a ``simulator.NamedPlan`` to a traced
step's GraphDef by name (``rewriter.step.apply_plan`` traces the step and re-imports the result) and adds:

* one swap-out node per swapped tensor, reading the tensor, on ``placement.swap_out_device`` (the host,
  or the accelerator where the copy runs there: the CPU testbed);
* one swap-in per swap-in group, as two nodes (TFLMS' construction): ``<swap-in>_host``, an
  ``Identity`` on the host reading the swap-out, started by a control edge ``^trigger`` (or,
  synchronous, by control edges from the producers of its first consumer's other inputs and from its
  control inputs), never before ``after`` (the last device reader of the previous copy); and the
  swap-in itself on the accelerator, reading it. The copy to the accelerator is the ``_Recv`` between
  the two, and TensorFlow gives a cross-device ``_Recv`` no control inputs (``graph_partition.cc``):
  it starts the copy when its ``_Send`` runs, i.e. when the host-side node has run, after the trigger.
  A control edge on the accelerator-side node would only delay an op that forwards a buffer already
  copied (``rewriter.check.verification`` checks what the accelerator-side copy waits for);
* every listed consumer input that reads the tensor, directly or through ops the capture bypassed
  (Identity, IdentityN, StopGradient, ...), rewired to the swap-in output, in that input slot;
* ``sync_out`` swaps: the tensor's remaining readers wait for the swap-out (control edges); with
  none left, the op the plan's order runs after its producer does.

Swap nodes are named ``swap_out/<producer>_<k>`` and ``swap_in/<producer>_<k>/<j>``, carry explicit
devices and ``_grappler_do_not_remove=True``. The plan is checked against the traced graph before
anything is added: names the graph does not have raise one ``PlanError``; tensors inside ``While``
loop bodies (functions of the graph's library, not top-level nodes) are skipped with a logged
reason, and so are reads the device keeps (``DeviceModel.kept_reads``: oneDNN's pooling gradients
on the CPU testbed).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Iterable

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from rewriter.edit.chain_order import chain_in_order, merged_pairs, partners_adjacent
from rewriter.edit.graph_refs import Ancestry, cyclic_nodes, parse_ref, tensor_ref
from rewriter.tf_effects.grappler import ALWAYS_READY, BYPASS_TYPES, may_vanish
from rewriter.placement.placements import SWAP_IN_PREFIX, SWAP_OUT_PREFIX, Placement
from simulator.fusion import WAIT_OPERANDS, fusion_neighbourhood, in_fused_chain
from simulator.plan import NamedPlan, NamedSwap, PlanError, missing_names_error, not_read_error

log = logging.getLogger(__name__)
MISSING_ORDER_SHARE = 10  # more than one op in this many of a plan's order missing: the plan is another model's

SWAP_OPS = ("Identity", "DeepCopy")
HOST_SWAP_IN_OP = "Identity"  # the host-side half of a swap-in forwards the host copy (no allocation)
HOST_SWAP_IN_SUFFIX = "_host"


# ---------------------------------------------------------------------- what was added


@dataclass(frozen=True)
class AppliedSwapIn:
    """One swap-in node as added to the graph."""

    name: str
    consumers: tuple[str, ...]
    trigger: str | None
    after: str | None
    controls: tuple[str, ...]  # every control input given to the node (trigger / sync sources, after)
    rewired: tuple[tuple[str, int], ...]  # (consumer node, input slot) now reading the swap-in
    host_node: str = ""  # the host-side node that carries ``controls`` (the swap-in reads it)


@dataclass(frozen=True)
class AppliedSwap:
    """One swapped tensor as added to the graph."""

    tensor: str
    swap_out: str
    dtype: str
    bytes: int
    sync_out: bool
    swap_ins: tuple[AppliedSwapIn, ...]
    sync_controls: tuple[str, ...] = ()  # readers made to wait for the swap-out (sync_out)
    # where copies wait for the compute threads (Placement.copies_wait_for_compute): the op after the
    # producer, made to wait for the copy out so it runs when the simulator starts it
    started_by: str = ""
    waits_through: str = ""  # the Identity of started_by's operand that waits for it, where that op is in a chain


@dataclass(frozen=True)
class SkippedSwap:
    tensor: str
    reason: str



# ---------------------------------------------------------------------- GraphDef editing


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-/>]", "_", name)


class GraphEditor:
    """The step's GraphDef with name lookups and input resolution through bypassed ops."""

    def __init__(self, graph_def: graph_pb2.GraphDef, foldable: frozenset[str] = frozenset(),
                 previous: dict[str, str] | None = None, passthrough: dict[str, int] | None = None):
        self.graph_def = graph_def
        self.foldable = foldable
        self.passthrough = passthrough or {}  # arithmetic Grappler reduces to one input (passthrough_ops)
        self.previous = previous or {}  # op -> the op before it in the order the step is chained in
        self.nodes = {node.name: node for node in graph_def.node}
        # swap-in node -> the tensor it brings back: the fusion walk sees the step as the simulator's
        # graph has it, where a rewired read is still a read of the original producer
        self.swapped_reads: dict[str, str] = {}
        self.loop_of: dict[str, str] = {}  # function name -> top-level While node running it
        for node in graph_def.node:
            for key in ("body", "cond", "then_branch", "else_branch", "f"):
                if key in node.attr and node.attr[key].func.name:
                    self.loop_of.setdefault(node.attr[key].func.name, node.name)
        self.library_nodes: dict[str, str] = {}  # node name (and "function/node") -> function name
        for function in graph_def.library.function:
            fname = function.signature.name
            for node in function.node_def:
                self.library_nodes.setdefault(node.name, fname)
                self.library_nodes[f"{fname}/{node.name}"] = fname

    def data_inputs(self, node) -> list[tuple[int, str]]:
        return [(i, name) for i, name in enumerate(node.input) if not name.startswith("^")]

    def resolve(self, ref: str) -> tuple[str, int]:
        """The tensor really flowing into an input: follow Identity-like ops back to their source."""
        return self._walk(ref)[0]

    def bypassed_controls(self, ref: str) -> list[str]:
        """Control inputs of the bypassed ops an input reads through: the capture makes them the
        reader's own (``rewriter.tf_effects.grappler.reduce_step``), so the simulator waits for them where the
        reader waits."""
        return self._walk(ref)[1]

    def _walk(self, ref: str) -> tuple[tuple[str, int], list[str]]:
        name, index = parse_ref(ref)
        controls: list[str] = []
        for _ in range(10_000):
            node = self.nodes.get(name)
            if node is None or not self.bypassed(node):
                break
            data = self.data_inputs(node)
            pick = index if node.op == "IdentityN" else self.passthrough.get(name, 0)
            if pick >= len(data):
                break
            controls.extend(item[1:] for item in node.input if item.startswith("^"))
            name, index = parse_ref(data[pick][1])
        return (name, index), controls

    def bypassed(self, node) -> bool:
        """Whether readers of ``node`` read one of its inputs once Grappler has run (Identity-like
        ops, ``x * 1`` and the like)."""
        return node.op in BYPASS_TYPES or node.name in self.passthrough

    def unswapped(self, ref: str) -> str:
        """The tensor a read of a swap-in stands for (the read itself otherwise)."""
        return self.swapped_reads.get(parse_ref(ref)[0], ref)

    def sources(self, name: str, *, raw: bool = True) -> list[str]:
        """Producers of a node's data inputs, resolved through bypassed ops (and as written, with ``raw``)."""
        node = self.nodes.get(name)
        if node is None:
            return []
        found = []
        for _, ref in self.data_inputs(node):
            ref = self.unswapped(ref)
            for source in ((parse_ref(ref)[0], self.resolve(ref)[0]) if raw else (self.resolve(ref)[0],)):
                if source in self.nodes and source not in found:
                    found.append(source)
        return found

    def readers_index(self) -> dict[str, list[str]]:
        if not hasattr(self, "_readers_cache"):
            index: dict[str, list[str]] = defaultdict(list)
            for node in self.graph_def.node:
                for _, ref in self.data_inputs(node):
                    index[self.resolve(self.unswapped(ref))[0]].append(node.name)
            self._readers_cache = index
        return self._readers_cache

    def fusion_neighbourhood(self, consumers: Iterable[str]) -> set[str]:
        """Ops a graph pass might fuse with one of ``consumers`` (``simulator.fusion``, the same walk
        as the replay's)."""
        readers = self.readers_index()
        danger: set[str] = set()
        for consumer in consumers:
            if consumer in self.nodes:
                danger |= fusion_neighbourhood(consumer, self._op_type, self.sources,
                                               lambda name: readers.get(name, ()))
        return danger

    def in_fused_chain(self, name: str) -> bool:
        """Whether a graph pass might fuse ``name`` with a neighbour (``simulator.fusion.in_fused_chain``)."""
        readers = self.readers_index()
        return in_fused_chain(name, self._op_type, self.sources, lambda op: readers.get(op, ()))

    def _op_type(self, name: str) -> str:
        node = self.nodes.get(name)
        return "" if node is None else node.op

    def safe_controls(self, controls: list[str], consumers: Iterable[str]) -> list[str]:
        """Replace control sources that could be fused with a consumer by their own inputs' producers
        (a little earlier, never a cycle); sources that are always ready are dropped."""
        danger = self.fusion_neighbourhood(consumers)
        result: list[str] = []
        pending = list(controls)
        seen: set[str] = set()
        while pending:
            name = pending.pop(0)
            if name in seen:
                continue
            seen.add(name)
            node = self.nodes.get(name)
            if node is None or node.op in ALWAYS_READY:
                continue
            if name in self.foldable and name in self.previous:  # Grappler removes it: the op before it
                pending.append(self.previous[name])
            elif name in danger or self.bypassed(node) or name in self.foldable:  # Grappler removes these
                pending.extend(self.sources(name, raw=False))
            elif name not in result:
                result.append(name)
        if len(result) > 1:
            if not hasattr(self, "_ancestry"):
                self._ancestry = Ancestry(self.graph_def)  # original nodes; swap nodes are not sources
            result = self._ancestry.latest(result)
        return result

    def readers(self, tensor: tuple[str, int]) -> list[tuple[str, int]]:
        """(node, slot) of every non-bypassed input that reads ``tensor`` (resolved), in node order: from an
        index of the reads (a scan per swap took most of applying thousands of swaps to 20,000 ops), checked on
        the graph as edited; the edits move reads off a tensor, never onto another one."""
        if not hasattr(self, "_reads"):
            self._reads, self._reads_indexed = defaultdict(list), 0
        for node in self.graph_def.node[self._reads_indexed:]:  # the nodes added since
            for slot, ref in [] if self.bypassed(node) else self.data_inputs(node):
                self._reads[self.resolve(ref)].append((node.name, slot))
        self._reads_indexed = len(self.graph_def.node)
        return [(name, slot) for name, slot in self._reads.get(tensor, ()) if slot < len(self.nodes[name].input)
                and not self.nodes[name].input[slot].startswith("^")
                and self.resolve(self.nodes[name].input[slot]) == tensor]

    def add_node(self, name: str, op: str, inputs: Iterable[str], device: str, dtype) -> Any:
        if name in self.nodes:
            raise PlanError(f"the graph already has a node named {name!r} (was the plan applied twice?)")
        node = self.graph_def.node.add()
        node.name = name
        node.op = op
        node.input.extend(inputs)
        node.device = device
        node.attr["T"].type = dtype.as_datatype_enum
        node.attr["_grappler_do_not_remove"].b = True
        self.nodes[name] = node
        return node

    def check_acyclic(self) -> None:
        """Raise PlanError when the edited graph has a cycle (a trigger that depends on its consumer), or would
        have one once oneDNN merges ops into one node (``chain_order.merged_pairs``)."""
        stuck = cyclic_nodes(self.graph_def, {})
        if stuck is not None:
            raise PlanError(f"the plan makes the step cyclic (a trigger or 'after' op depends on the consumer it "
                            f"should run before), e.g. around {_swap_nodes(stuck)}")
        merged = merged_pairs(self)
        stuck = cyclic_nodes(self.graph_def, merged) if merged else None
        if stuck is not None:
            raise PlanError(f"the plan makes the step cyclic once oneDNN merges ops into one node (a filter "
                            f"gradient with its bias gradient, a convolution with its bias add), which TensorFlow "
                            f"does not report: the step would hang; e.g. around {_swap_nodes(stuck)}")


def _swap_nodes(names: list[str]) -> str:
    swaps = [name for name in names if name.startswith((SWAP_IN_PREFIX, SWAP_OUT_PREFIX))]
    return str(swaps[:3]) if swaps else "the swap nodes"


COPY_WAIT_PREFIX = "copy_wait/"  # an operand of a fused chain's op, forwarded once a copy out is done


def _node_name(kind: str, tensor: tuple[str, int], j: int | None = None) -> str:
    base = f"{kind}{_safe(tensor[0])}_{tensor[1]}"
    return base if j is None else f"{base}/{j}"


def _bypass_identity_n(graph_def: graph_pb2.GraphDef) -> None:
    """Remove IdentityN nodes, wiring their readers to the matching inputs (what Grappler does
    before the step runs). Keras' optimizer puts one over every (gradient, variable) pair; left in
    place, chaining the step in the simulated order would make each update wait for all gradients
    and close a cycle."""
    nodes = {node.name: node for node in graph_def.node}
    doomed = {name for name, node in nodes.items() if node.op == "IdentityN"}
    if not doomed:
        return
    for node in graph_def.node:
        if node.name in doomed:
            continue
        rewritten: list[str] = []
        extra_controls: list[str] = []
        for ref in node.input:
            name, index = parse_ref(ref.lstrip("^"))
            if name not in doomed:
                rewritten.append(ref)
                continue
            source = nodes[name]
            data = [r for r in source.input if not r.startswith("^")]
            controls = [r for r in source.input if r.startswith("^")]
            if ref.startswith("^"):
                extra_controls += [f"^{parse_ref(r)[0]}" for r in data] + controls
            else:
                rewritten.append(data[index])
                extra_controls += controls
        rewritten += [c for c in dict.fromkeys(extra_controls) if c not in rewritten]
        if list(node.input) != rewritten:
            del node.input[:]
            node.input.extend(rewritten)
    kept = [node for node in graph_def.node if node.name not in doomed]
    del graph_def.node[:]
    graph_def.node.extend(kept)


# ---------------------------------------------------------------------- applying a plan


def edit_graph_def(graph_def: graph_pb2.GraphDef, plan: NamedPlan, placement: Placement, *, swap_op: str,
                   tensor_info: dict[str, tuple[Any, int]], foldable: frozenset[str] = frozenset(),
                   kept_reads: Iterable[tuple[str, str]] = (), passthrough: dict[str, int] | None = None,
                   ) -> tuple[graph_pb2.GraphDef, list[AppliedSwap], list[SkippedSwap]]:
    """Return a copy of ``graph_def`` with the plan's swap nodes; raise PlanError on stale names.

    ``tensor_info`` maps "op:k" to (dtype, bytes) of the traced step's tensors; ``foldable`` names
    ops Grappler removes (``rewriter.tf_effects.grappler.foldable_ops``), which must not carry a swap-in's
    control edge: the op before one in the plan's order (or its inputs' producers, without an order)
    carries it instead. ``kept_reads``: (producer type, consumer type) reads the placement's device
    keeps (``DeviceModel.kept_reads``), skipped in a plan made for another device. ``passthrough``
    (``rewriter.tf_effects.passthrough.passthrough_ops``): the arithmetic Grappler reduces to one input, read
    through as the capture does.
    """
    edited = graph_pb2.GraphDef()
    edited.CopyFrom(graph_def)
    node_op = {node.name: node.op for node in edited.node}
    unknown = [name for name in plan.order if name not in node_op]
    if plan.canonical_names and len(unknown) * MISSING_ORDER_SHARE > len(plan.order):  # another model's order
        raise missing_names_error(unknown, "this model's training step")
    if unknown:  # never dropped silently: a step traced otherwise (op determinism), or a plan without canonical names
        log.warning("%d of the %d ops of the plan's order are not in this model's training step (e.g. %s): they run "
                    "where TensorFlow puts them (a step traced otherwise, as with op determinism, or a plan written "
                    "before plans carried canonical names)", len(unknown), len(plan.order), ", ".join(unknown[:3]))
    runnable = [name for name in plan.order if node_op.get(name, "Placeholder") != "Placeholder"]
    # the op the simulator runs after each one (what a synchronous swap-out with no reader left holds)
    next_in_order = dict(zip(runnable, runnable[1:]))
    editor = GraphEditor(edited, foldable, previous=dict(zip(runnable[1:], runnable)), passthrough=passthrough)
    todo, skipped = _applicable(editor, plan, tensor_info)
    applied: list[AppliedSwap] = []
    for swap in todo:
        added = _add_swap(editor, swap, placement, swap_op=swap_op, tensor_info=tensor_info,
                          kept_reads=frozenset(kept_reads), next_in_order=next_in_order, skipped=skipped)
        if added is not None:
            applied.append(added)
    # a swap-in waits for the copies out of what the op it starts after made; where copies wait for the compute
    # threads always, as the replay has it there (DeviceModel.copies_out_wait): the executor ran such a swap-in
    # before such a copy out now and then, both buffers on the device together
    if plan.after_copies_out or placement.copies_wait_for_compute:
        applied = _after_copies_out(editor, applied, runnable)
    if runnable:
        _bypass_identity_n(edited)
        editor = GraphEditor(edited, foldable, passthrough=passthrough)
        chain_in_order(editor, partners_adjacent(editor, runnable), foldable)
    editor.check_acyclic()
    return edited, applied, skipped


def _applicable(editor: GraphEditor, plan: NamedPlan, tensor_info: dict[str, tuple[Any, int]],
                ) -> tuple[list[NamedSwap], list[SkippedSwap]]:
    """The swaps to add, and those skipped because a name is inside a function of the graph's library
    (a While loop's body); one PlanError for names the step does not have at all."""
    missing: list[str] = []
    skipped: list[SkippedSwap] = []
    todo = []

    def known(name: str | None) -> bool:
        return name is None or name in editor.nodes

    for record in plan.swaps:
        tensor_name = record.tensor
        node_name = record.producer
        names = [node_name] + [c for item in record.swap_ins for c in item.consumers]
        names += [name for item in record.swap_ins for name in (item.trigger, item.after) if name]
        in_loop = [n for n in names if n not in editor.nodes and n in editor.library_nodes]
        if in_loop:
            function = editor.library_nodes[in_loop[0]]
            owner = editor.loop_of.get(function)
            is_loop = (owner and editor.nodes[owner].op in ("While", "StatelessWhile")) or \
                re.search(r"while_(body|cond)", function) is not None
            kind = (f"the body of a While loop{f' {owner!r}' if owner else ''} (function {function!r})" if is_loop
                    else f"the function {function!r}" + (f" called by {owner!r}" if owner else ""))
            skipped.append(SkippedSwap(tensor_name, f"{in_loop[0]!r} is inside {kind}, which a top-level "
                                       "rewrite cannot swap"))
            continue
        absent = [tensor_name if n == node_name else n for n in names if not known(n)]
        if absent:
            missing.extend(absent)
            continue
        if tensor_name not in tensor_info:
            missing.append(tensor_name)
            continue
        todo.append(record)
    if missing:
        raise missing_names_error(missing, "this model's training step")
    for item in skipped:
        log.warning("swap of %s skipped: %s", item.tensor, item.reason)
    return todo, skipped


def _add_swap(editor: GraphEditor, record: NamedSwap, placement: Placement, *, swap_op: str,
              tensor_info: dict[str, tuple[Any, int]], kept_reads: frozenset[tuple[str, str]],
              next_in_order: dict[str, str], skipped: list[SkippedSwap]) -> AppliedSwap | None:
    """The swap-out of one tensor and its swap-ins (None when the device keeps every read of it)."""
    tensor = (record.producer, record.output)
    dtype, nbytes = tensor_info[record.tensor]
    if not (dtype.is_floating or dtype.is_complex or dtype.is_integer or dtype.is_bool):
        raise PlanError(f"tensor {record.tensor} has dtype {dtype.name}, which cannot be copied to the host")
    producer_type = editor.nodes[tensor[0]].op
    groups = []
    for item in record.swap_ins:
        kept = tuple(c for c in item.consumers if (producer_type, editor.nodes[c].op) in kept_reads)
        for consumer in kept:
            skipped.append(SkippedSwap(record.tensor, f"read by {consumer!r}: this device keeps a {producer_type} "
                                       f"read by {editor.nodes[consumer].op} on the device (DeviceModel.kept_reads: "
                                       "oneDNN pairs a pooling with its gradient), so it keeps reading the original"))
            log.warning("swap-in of %s for %s skipped: %s", record.tensor, consumer, skipped[-1].reason)
        if len(kept) < len(item.consumers):
            groups.append(replace(item, consumers=tuple(c for c in item.consumers if c not in kept)))
    if not groups:
        return None
    out_name = _node_name(SWAP_OUT_PREFIX, tensor)
    editor.add_node(out_name, swap_op, [tensor_ref(*tensor)], placement.swap_out_device, dtype)
    rewired_all: set[tuple[str, int]] = set()
    swap_ins = []
    for j, item in enumerate(groups):
        in_name = _node_name(SWAP_IN_PREFIX, tensor, j)
        consumers, trigger, after = item.consumers, item.trigger, item.after
        rewired = []
        editor.swapped_reads[in_name] = tensor_ref(*tensor)
        # control edges of ops the first consumer reads through (before its reads are rewired)
        passed_controls = [name for _, ref in editor.data_inputs(editor.nodes[consumers[0]])
                           for name in editor.bypassed_controls(ref)]
        for consumer in consumers:
            node = editor.nodes[consumer]
            slots = [slot for slot, ref in editor.data_inputs(node) if editor.resolve(ref) == tensor]
            if not slots:
                raise not_read_error(repr(consumer), record.tensor, " in this model's step")
            for slot in slots:
                wait = _innermost_copy_wait(editor, node.input[slot])
                if wait is not None:  # the read keeps waiting for the copies out it waited for
                    wait.input[0] = in_name
                else:
                    node.input[slot] = in_name
                rewired.append((consumer, slot))
        rewired_all.update(rewired)
        controls: list[str] = []
        if trigger:
            controls.append(trigger)
        else:  # synchronous: start when the first consumer's other inputs (and control inputs) are ready
            first = editor.nodes[consumers[0]]
            for _, ref in editor.data_inputs(first):
                source = editor.resolve(ref)
                if source != tensor and source[0] != in_name and source[0] in editor.nodes \
                        and source[0] not in controls:
                    controls.append(source[0])
            # the step's own control edges, as the simulator counts them (those of ops read through too)
            for name in [ref[1:] for ref in first.input if ref.startswith("^")] + passed_controls:
                if name in editor.nodes and name not in controls \
                        and not name.startswith((SWAP_OUT_PREFIX, SWAP_IN_PREFIX)):
                    controls.append(name)
        if after and after not in controls and after != tensor[0]:
            controls.append(after)
        controls = editor.safe_controls([c for c in controls if c != in_name], consumers)
        if trigger and trigger not in controls:
            log.debug("trigger %s of %s could be fused with its consumer: the swap-in waits for %s instead",
                      trigger, in_name, controls)
        host_name = in_name + HOST_SWAP_IN_SUFFIX  # waits on the host: the copy in starts after it
        editor.add_node(host_name, HOST_SWAP_IN_OP, [out_name] + [f"^{c}" for c in controls], placement.host, dtype)
        editor.add_node(in_name, swap_op, [host_name], placement.accelerator, dtype)
        swap_ins.append(AppliedSwapIn(in_name, consumers, trigger, after, tuple(controls), tuple(rewired),
                                      host_name))
    sync_controls: list[str] = []
    if record.sync_out:
        for reader, slot in editor.readers(tensor):
            if reader.startswith((SWAP_OUT_PREFIX, SWAP_IN_PREFIX)) or (reader, slot) in rewired_all:
                continue
            if reader not in sync_controls:
                sync_controls.append(reader)
        if not sync_controls and tensor[0] in next_in_order:  # no reader left: the op after the producer
            sync_controls.append(next_in_order[tensor[0]])
        for reader in sync_controls:
            editor.nodes[reader].input.append(f"^{out_name}")
    started_by = through = ""
    if not record.sync_out and placement.copies_wait_for_compute:
        started_by, through = _wait_for_copy(editor, tensor, next_in_order, out_name)
    return AppliedSwap(record.tensor, out_name, dtype.name, int(nbytes), record.sync_out, tuple(swap_ins),
                       tuple(sync_controls), started_by, through)


def _innermost_copy_wait(editor: GraphEditor, ref: str):
    """The last of the ``copy_wait/`` Identities ``ref`` reads through (each waits for a copy out; ``_wait_for_copy``),
    None if it reads through none: a swap-in rewires its input, so the reader still waits for every copy."""
    wait = None
    node = editor.nodes.get(parse_ref(ref)[0])
    while node is not None and node.name.startswith(COPY_WAIT_PREFIX):
        wait, node = node, editor.nodes.get(parse_ref(node.input[0])[0])
    return wait


def _wait_for_copy(editor: GraphEditor, tensor: tuple[str, int], next_in_order: dict[str, str],
                   copy: str) -> tuple[str, str]:
    """Make the op after ``tensor``'s producer in the chained order wait for its copy out ``copy``: that op's name
    and the node it waits through ("" for its own control edge; ("", "") at the end of the order).

    An op of a fused chain takes no control edge (Grappler's remapper would leave the chain unfused): where it has
    an operand outside the chain (``simulator.fusion.WAIT_OPERANDS``: a contraction's second operand, a bias), that
    operand comes through an ``Identity`` that waits for the copy, which forwards the buffer and fuses as before;
    elsewhere the wait goes past the chain (``_next_kept``). Waited for past the next chains, a copy out ran after
    them on a loaded testbed now and then, its buffer held through them (a split convolution stack's forward measured
    one part's activation over its prediction). An op after the producer that Grappler may remove
    (``may_vanish``) waits too, beside the next op it keeps: waited for by that one alone, a split batch norm's
    four part copies ran after all four parts, their buffers together (small_cnn in 4 parts, 18 % over)."""
    following = next_in_order.get(tensor[0])
    if following and may_vanish(editor.nodes[following], editor.nodes, editor.foldable) \
            and not editor.in_fused_chain(following):  # where Grappler keeps it, it waits (and the next kept op)
        editor.nodes[following].input.append(f"^{copy}")
    following = _next_kept(editor, tensor[0], next_in_order, past_chains=False)
    if following and editor.in_fused_chain(following):
        node = editor.nodes[following]
        data = editor.data_inputs(node)
        slot = WAIT_OPERANDS.get(node.op)
        if slot is not None and slot < len(data):
            wait = editor.add_node(_node_name(COPY_WAIT_PREFIX, tensor), "Identity", [data[slot][1], f"^{copy}"],
                                   node.device, tf.dtypes.as_dtype(node.attr["T"].type))
            node.input[data[slot][0]] = wait.name
            return following, wait.name
        following = _next_kept(editor, tensor[0], next_in_order)
    if following:
        editor.nodes[following].input.append(f"^{copy}")
    return following or "", ""


def _next_kept(editor: GraphEditor, name: str, next_in_order: dict[str, str], *, past_chains: bool = True) -> str:
    """The first op after ``name`` in the chained order that Grappler keeps and (``past_chains``) that is no part
    of a fused chain ("" at the end).

    Where copies wait for the compute threads, TF's executor queues a copy out behind the ops it runs
    inline, one after the other in the chained order: measured on the testbed, a copy out ran right
    after its producer in some steps and hundreds of ops later, just before its swap-in, in others,
    its buffer held all that while (the every_model multi-output model: 96.1 or 112.1 KiB against
    103.8 predicted). Waited for by that op, it runs where the simulator starts it. A control edge on
    an op of a chain Grappler's remapper would fuse (a Conv2D and its BiasAdd, swish's Sigmoid and
    Mul) keeps the chain unfused, and the step then rounds otherwise than Keras' own: where the chain's op
    has no operand to wait through (``_wait_for_copy``), the wait goes past the chain
    (``simulator.fusion.in_fused_chain``; the replay places it there too)."""
    following = next_in_order.get(name)
    while following and (may_vanish(editor.nodes[following], editor.nodes, editor.foldable)
                         or past_chains and editor.in_fused_chain(following)):
        following = next_in_order.get(following)
    return following or ""


def _after_copies_out(editor: GraphEditor, applied: list[AppliedSwap], runnable: list[str]) -> list[AppliedSwap]:
    """Each swap-in also waits for the copies out of what the op it starts after made
    (``SwapParams.after_copies_out``)."""
    copies_of: dict[str, list[str]] = defaultdict(list)
    for swap in applied:
        copies_of[parse_ref(swap.tensor)[0]].append(swap.swap_out)
    position = {name: k for k, name in enumerate(runnable)}
    result = []
    for swap in applied:
        swap_ins = []
        for item in swap.swap_ins:
            # the op it starts after, as the replay has it: the trigger, or the last control source where it has none;
            # none where the trigger may be fused with a reader (``safe_controls`` replaced it: its copy out would
            # close a cycle once a filter gradient and its sibling are merged)
            if item.trigger:
                sources = [item.trigger] if item.trigger in item.controls else []
            else:
                sources = [c for c in item.controls if c in position]
            last = max(sources, key=lambda name: position.get(name, -1), default="")
            waits = tuple(name for name in copies_of.get(last, ()) if name not in item.controls)
            if waits:
                editor.nodes[item.host_node or item.name].input.extend(f"^{name}" for name in waits)
                item = replace(item, controls=item.controls + waits)
            swap_ins.append(item)
        result.append(replace(swap, swap_ins=tuple(swap_ins)))
    return result


