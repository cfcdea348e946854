"""What of a swap plan survived Grappler: swap nodes, trigger edges, rewired reads, transfers, recomputations.

TensorFlow optimises a function when it is first instantiated. With graph collection on
(``context.context().enable_graph_collection()``) that first call records, per function, the
post-optimization graph and the per-device partition graphs (``export_run_metadata()``). This module
reads them back and counts, for the swap nodes ``rewriter.step.apply_plan`` added:

* swap-outs and swap-ins that survived (in the partition graphs: what really runs),
* trigger control edges kept on their swap-in (a trigger op folded away or an edge dropped or moved
  to another op is named),
* consumer inputs that still read the swap-in (a consumer rewired back to the original buffer would
  keep it alive),
* cross-device transfers (``_Send``/``_Recv`` pairs) by direction,
* what each copy to the accelerator waits for, the property that decides whether a swap-in saves
  memory: TensorFlow starts a cross-device ``_Recv``'s copy (and allocates its device buffer) as soon
  as its ``_Send`` has run, and gives that ``_Recv`` no control inputs (``graph_partition.cc`` adds
  them only for ref-typed edges), so the copy waits for the trigger only if the host-side node it is
  sent from does. The partition graphs are joined at their ``_Send``/``_Recv`` pairs and each
  accelerator-side ``_Recv`` carrying a swap-in must depend on every control source apply gave it;
* for the plan's recomputations (``rewriter.edit.recompute_clones``): the clones that still run, the far reads
  they still serve, their trigger edges (``rewriter.check.recompute_check``; Grappler's common-subgraph
  elimination would merge a clone back into its original, saving nothing);
* for its split regions (``rewriter.edit.split_parts``): the parts and combines that still run, found by the
  name each carries (``SPLIT_ATTR``); one merged away or fused into another op is named.

The collected graphs themselves are read by ``rewriter.check.collected``.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from tensorflow.core.framework import graph_pb2

from rewriter.trace.tracing import import_step
from rewriter.check.collected import collect_first_call, grappler_renames, pick_function_graph, profiled_first_call
from rewriter.edit.graph_refs import Ancestry
from rewriter.placement.placements import SWAP_IN_PREFIX
from rewriter.edit.recompute_clones import AppliedRecompute
from rewriter.edit.split_parts import SPLIT_ATTR, AppliedSplit
from rewriter.check.recompute_check import RecomputeVerification, check_recomputes, recompute_names

log = logging.getLogger(__name__)


@dataclass
class Verification:
    """Counts and names of what ran compared with what the plan asked for."""

    planned_swap_outs: int
    planned_swap_ins: int
    planned_triggers: int
    planned_rewired_inputs: int
    swap_outs: int = 0
    swap_ins: int = 0
    triggers_kept: int = 0  # triggered swap-ins whose planned trigger is still a direct control input
    rewired_inputs: int = 0
    transfers_to_host: int = 0  # _Recv nodes on the host device
    transfers_to_accelerator: int = 0  # _Recv nodes on the accelerator device
    sends: int = 0
    recvs: int = 0
    control_transfers: int = 0  # _Recv nodes carrying a control edge between devices (not counted above)
    removed: list[str] = field(default_factory=list)  # swap nodes Grappler removed
    triggers_dropped: list[str] = field(default_factory=list)  # "swap_in <- trigger": edge gone
    triggers_moved: list[str] = field(default_factory=list)  # "swap_in <- trigger (now after: x, y)"
    triggers_folded: list[str] = field(default_factory=list)  # control sources that no longer exist
    triggers_replaced: list[str] = field(default_factory=list)  # planned trigger swapped for its inputs by
    # apply (it could be fused with the consumer): informational, not a failure
    planned_control_edges: int = 0  # control inputs apply gave the swap-ins (triggers, sync sources, after)
    control_edges_kept: int = 0  # still a direct control input of the swap-in
    control_edges_implied: int = 0  # removed as redundant, the swap-in still runs after the source
    triggers_ordered: int = 0  # triggered swap-ins that still run after all their control sources
    reads_lost: list[str] = field(default_factory=list)  # "consumer:slot" no longer reading its swap-in
    reads_renamed: list[str] = field(default_factory=list)  # consumer rewritten/fused, new node reads the swap-in
    copies_checked: int = 0  # (accelerator-side copy, control source) pairs checked in the partition graphs
    copies_waiting: int = 0  # of those, the copy depends on the source (it cannot start before it)
    copies_early: list[str] = field(default_factory=list)  # "swap_in: copy <- source": the copy need not wait
    # a variable's update placed beside its slots on the host (rewriter.step.host_state): its nodes found in the
    # partition graphs, and those that ran elsewhere (Grappler renames or folds some, which are neither)
    host_updates_planned: int = 0
    host_updates_on_host: int = 0
    host_updates_elsewhere: list[str] = field(default_factory=list)
    copy_waits: dict[str, list[str]] = field(default_factory=dict)  # swap-in -> ops its copy in waits for
    devices: dict[str, int] = field(default_factory=dict)  # partition graph device -> node count
    collected: bool = True  # False when the run metadata held no graph of the step
    recompute: RecomputeVerification | None = None  # the plan's recomputations, when it has any
    planned_split_nodes: int = 0  # the parts and combines of the plan's split regions
    split_nodes: int = 0  # of those, still in the optimized graph
    split_lost: list[str] = field(default_factory=list)  # parts or combines Grappler merged away or fused

    @property
    def ok(self) -> bool:
        return self.collected and not (self.removed or self.triggers_dropped or self.triggers_moved
                                       or self.triggers_folded or self.reads_lost or self.copies_early
                                       or self.split_lost or self.host_updates_elsewhere) \
            and (self.recompute is None or self.recompute.ok)

    def problem_items(self) -> list[tuple[str, list[str]]]:
        """(what went wrong, the names it happened to), swaps' first, then the recomputations'."""
        items = [] if self.collected else [("no optimized graph of the step was collected (it had run before "
                                            "verification)", [])]
        for label, names in (("swap node(s) removed", self.removed), ("trigger op(s) folded away", self.triggers_folded),
                             ("trigger edge(s) dropped", self.triggers_dropped),
                             ("trigger edge(s) moved", self.triggers_moved),
                             ("copy(ies) to the accelerator need not wait for their trigger", self.copies_early),
                             ("consumer input(s) no longer read their swap-in", self.reads_lost),
                             ("split part(s) or combine(s) merged away", self.split_lost),
                             ("host update op(s) ran off the host", self.host_updates_elsewhere)):
            if names:
                items.append((f"{len(names)} {label}", list(names)))
        if self.recompute is not None:
            items += [item for item in self.recompute.problem_items() if item not in items]
        return items

    def problems(self) -> list[str]:
        """Each problem with up to ten of its names (for the report)."""
        return [label + (f": {', '.join(names[:10])}" if names else "") for label, names in self.problem_items()]

    def headline(self) -> str:
        """One line for the output: what did not survive, counted; the names are in ``problems()``."""
        return ("parts of the swap plan did not survive graph optimization: "
                + "; ".join(label for label, _ in self.problem_items())
                + " (the names: SwapStep.verification.problems(), and the report's measured run)")

    def summary(self) -> str:
        text = (f"swap-outs {self.swap_outs}/{self.planned_swap_outs}, swap-ins {self.swap_ins}/{self.planned_swap_ins}, "
                f"trigger edges kept {self.triggers_kept}/{self.planned_triggers} (ordered "
                f"{self.triggers_ordered}), control edges {self.control_edges_kept}+{self.control_edges_implied} implied"
                f"/{self.planned_control_edges}, rewired reads "
                f"{self.rewired_inputs}/{self.planned_rewired_inputs}, transfers to host {self.transfers_to_host}, "
                f"to accelerator {self.transfers_to_accelerator}, copies in waiting for their sources "
                f"{self.copies_waiting}/{self.copies_checked}")
        if self.recompute is not None:
            text += f"; recomputations: {self.recompute.counts()}"
        if self.planned_split_nodes:
            text += f"; split parts and combines {self.split_nodes}/{self.planned_split_nodes}"
        if self.host_updates_planned:
            text += f"; host update ops on the host {self.host_updates_on_host}/{self.host_updates_planned}"
        problems = self.problems()
        return text + ("" if not problems else "; " + "; ".join(problems))

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items()} | {
            "ok": self.ok, "recompute": None if self.recompute is None else self.recompute.as_dict()}


def _node_map(graph_def) -> dict[str, Any]:
    return {node.name: node for node in graph_def.node}


def _short(device: str) -> str:
    return device.rsplit("device:", 1)[-1] if device else ""


def check(function_graphs, applied, *, accelerator: str = "", host: str = "",
          recomputed: Sequence[AppliedRecompute] = (), split: Sequence[AppliedSplit] = (),
          host_updates: frozenset[str] = frozenset()) -> Verification:
    """Compare the collected graphs of one step with the applied swaps (``SwapStep.applied``),
    recomputations (``SwapStep.recomputed``), split regions (``SwapStep.split``) and the update ops placed
    on the host (``host_updates``)."""
    swap_ins = [item for swap in applied for item in swap.swap_ins]
    split_nodes = [name for item in split for name in item.part_nodes + item.combines]
    names = {swap.swap_out for swap in applied} | {item.name for item in swap_ins} | recompute_names(recomputed) \
        | set(split_nodes) | set(host_updates)
    result = Verification(
        planned_swap_outs=len(applied), planned_swap_ins=len(swap_ins),
        planned_triggers=sum(1 for item in swap_ins if item.trigger),
        planned_rewired_inputs=sum(len(item.rewired) for item in swap_ins), planned_split_nodes=len(split_nodes),
        host_updates_planned=len(host_updates),
    )
    if recomputed:
        result.recompute = check_recomputes(function_graphs, recomputed)
    fg = pick_function_graph(function_graphs, names)
    if fg is None:
        result.collected = False
        return result
    post = _node_map(fg.post_optimization_graph)
    ran = {node.attr[SPLIT_ATTR].s.decode() for node in post.values() if SPLIT_ATTR in node.attr}
    result.split_nodes = sum(name in ran for name in split_nodes)
    result.split_lost = [name for name in split_nodes if name not in ran]
    partitions: dict[str, Any] = {}
    waits = CopyWaits(fg.partition_graphs, post, accelerator=accelerator)
    for partition in fg.partition_graphs:
        for node in partition.node:
            partitions[node.name] = node
            result.devices[_short(node.device)] = result.devices.get(_short(node.device), 0) + 1
            if node.name in host_updates:
                if _short(node.device) == _short(host):
                    result.host_updates_on_host += 1
                else:
                    result.host_updates_elsewhere.append(node.name)
            if node.op == "_Send":
                result.sends += 1
            elif node.op == "_Recv":
                result.recvs += 1
                if waits.carries_control(node.name):  # a control edge across devices: a dummy value, no copy
                    result.control_transfers += 1
                elif host and _short(node.device) == _short(host) and _short(host) != _short(accelerator):
                    result.transfers_to_host += 1
                elif accelerator and _short(node.device) == _short(accelerator):
                    result.transfers_to_accelerator += 1
    running = partitions or post
    ancestry = Ancestry(fg.post_optimization_graph)
    renamed = grappler_renames(post)

    # readers of each swap-in in what runs (a _Recv may sit between on another device)
    recv_source: dict[str, str] = {}
    for node in running.values():
        if node.op == "_Recv":
            tensor = node.attr["tensor_name"].s.decode() if "tensor_name" in node.attr else ""
            recv_source[node.name] = tensor.split(":")[0]
    # (Grappler may reorder a commutative op's inputs: reads are counted per consumer, not per slot)
    readers: dict[str, Counter] = {}
    for node in running.values():
        for ref in node.input:
            if ref.startswith("^"):
                continue
            source = ref.split(":")[0]
            source = recv_source.get(source, source)
            if source.startswith(SWAP_IN_PREFIX):
                readers.setdefault(source, Counter())[node.name] += 1

    for swap in applied:
        if swap.swap_out in running:
            result.swap_outs += 1
        else:
            result.removed.append(swap.swap_out)
        for item in swap.swap_ins:
            node = running.get(item.name)
            if node is None:
                result.removed.append(item.name)
                continue
            host_node = item.host_node or item.name
            if host_node not in running:
                result.removed.append(host_node)
                continue
            result.swap_ins += 1
            found = Counter(readers.get(item.name, Counter()))
            unplanned = sum(count for name, count in found.items() if name not in item.consumers)
            for consumer, slot in item.rewired:
                if found[consumer] > 0:
                    found[consumer] -= 1
                    result.rewired_inputs += 1
                elif unplanned > 0:  # the consumer was rewritten or fused under another name
                    unplanned -= 1
                    result.rewired_inputs += 1
                    others = sorted(name for name in found if name not in item.consumers)
                    result.reads_renamed.append(f"{consumer}:{slot} -> {', '.join(others[:2])}")
                else:
                    result.reads_lost.append(f"{consumer}:{slot}")
            if not item.controls:
                continue
            direct = _controls(post.get(host_node), post, {}) | _controls(running[host_node], running, recv_source)
            ordered = True
            copies = waits.copies_of(item.name)
            result.copy_waits[item.name] = waits.waits_of(host_node)
            for source in item.controls:
                result.planned_control_edges += 1
                if source not in running and source not in post and source in renamed:
                    source = renamed[source]  # the op still runs, under Grappler's name
                for copy in copies if source in waits.nodes else ():  # what has to wait: the accelerator-side copy
                    result.copies_checked += 1
                    if waits.depends(copy, source):
                        result.copies_waiting += 1
                    else:
                        result.copies_early.append(f"{item.name}: {copy} <- {source}")
                if source not in running and source not in post:
                    result.triggers_folded.append(f"{item.name} <- {source}")
                    ordered = False
                elif source in direct:
                    result.control_edges_kept += 1
                elif ancestry.depends(host_node, source):
                    result.control_edges_implied += 1  # Grappler dropped the edge as redundant: still ordered
                else:
                    ordered = False
                    others = sorted(direct - set(item.controls))
                    if others:
                        result.triggers_moved.append(f"{item.name} <- {source} (now after: {', '.join(others[:3])})")
                    else:
                        result.triggers_dropped.append(f"{item.name} <- {source}")
            if item.trigger:
                if item.trigger in direct or renamed.get(item.trigger) in direct:
                    result.triggers_kept += 1
                if ordered:
                    result.triggers_ordered += 1
                if item.trigger not in item.controls:
                    result.triggers_replaced.append(f"{item.name}: {item.trigger} -> {', '.join(item.controls)}")
    return result


class CopyWaits:
    """The partition graphs of one function joined into one dependency graph: every ``_Recv`` also
    depends on its ``_Send`` (same ``tensor_name``, ``send_device`` and ``recv_device``), which is when
    TensorFlow starts the copy. Answers which accelerator-side node copies a swap-in to the accelerator
    and what that copy waits for."""

    def __init__(self, partition_graphs, post: dict[str, Any], *, accelerator: str = ""):
        self.post = post
        self.accelerator = _short(accelerator)
        merged = graph_pb2.GraphDef()
        sends: dict[tuple[str, str, str], str] = {}
        for partition in partition_graphs:
            merged.node.extend(partition.node)
        for node in merged.node:
            if node.op == "_Send":
                sends[_link(node)] = node.name
        self.nodes = {node.name: node for node in merged.node}
        self.send_of: dict[str, str] = {}
        for node in merged.node:
            if node.op == "_Recv" and _link(node) in sends:
                self.send_of[node.name] = sends[_link(node)]
                node.input.append(f"^{sends[_link(node)]}")
        self.readers: dict[str, list[str]] = {}
        for node in merged.node:
            for ref in node.input:
                self.readers.setdefault(ref.lstrip("^").split(":")[0], []).append(node.name)
        self._ancestry = Ancestry(merged) if merged.node else None

    def copies_of(self, swap_in: str) -> list[str]:
        """The accelerator-side nodes that make the swap-in's device copy: the ``_Recv``s on the
        accelerator it reads (whatever sends them); the swap-in itself when it reads no ``_Recv``
        (both sides one device, as on the single-device testbed)."""
        node = self.nodes.get(swap_in)
        if node is None:
            return []
        found = []
        for ref in node.input:
            if ref.startswith("^"):
                continue
            source = self.nodes.get(ref.split(":")[0])
            if source is not None and source.op == "_Recv" and _short(source.device) == self.accelerator:
                found.append(source.name)
        return found or [swap_in]

    def carries_control(self, recv: str) -> bool:
        """True for a ``_Recv`` that partitioning added for a control edge: its ``_Send`` sends a
        constant that is not an op of the step."""
        send = self.nodes.get(self.send_of.get(recv, ""))
        if send is None:
            return False
        data = [ref for ref in send.input if not ref.startswith("^")]
        source = self.nodes.get(data[0].split(":")[0]) if data else None
        return source is not None and source.op == "Const" and source.name not in self.post

    def depends(self, node: str, on: str) -> bool:
        return self._ancestry is not None and self._ancestry.depends(node, on)

    def waits_of(self, name: str) -> list[str]:
        """The ops of the step (post-optimization names) that ``name`` waits for by control edges,
        looked up through the nodes partitioning added (``_Recv``, ``_Send``, dummy constants)."""
        node = self.nodes.get(name)
        if node is None:
            return []
        found: list[str] = []
        pending = [ref[1:] for ref in node.input if ref.startswith("^")]
        seen: set[str] = set()
        while pending:
            source = pending.pop().split(":")[0]
            if source in seen:
                continue
            seen.add(source)
            if source in self.post or source not in self.nodes:
                if source not in found:
                    found.append(source)
                continue
            pending.extend(ref.lstrip("^") for ref in self.nodes[source].input)  # partitioning's own node
        return sorted(found)


def _link(node) -> tuple[str, str, str]:
    attr = node.attr
    return (attr["tensor_name"].s.decode() if "tensor_name" in attr else "",
            _short(attr["send_device"].s.decode()) if "send_device" in attr else "",
            _short(attr["recv_device"].s.decode()) if "recv_device" in attr else "")


def _controls(node, nodes, recv_source) -> set[str]:
    if node is None:
        return set()
    found = set()
    for ref in node.input:
        if ref.startswith("^"):
            name = ref[1:]
            found.add(recv_source.get(name, name))
    return found


def verify_first_call(step, example=None) -> Verification:
    """Verify ``step`` on its first call (``apply`` does this), then restore every variable. The call
    is profiled too, for the constants it materialises (``step.constant_bytes``, ``rewriter.timing.measurement``)."""
    flat = step._flat_inputs(*example) if example is not None else step.zeros()
    snapshot = step.snapshot()
    try:
        _, graphs, step.constant_bytes = profiled_first_call(step.run_flat, *flat,
                                                             allocator_prefix=step.placement.allocator_prefix)
    finally:
        snapshot.restore()
    result = check(graphs, step.applied, accelerator=step.placement.accelerator, host=step.placement.host,
                   recomputed=step.recomputed, split=step.split,
                   host_updates=frozenset().union(*step.host_updates.values()))
    _report(result)
    return result


def verify(step, x=None, y=None) -> Verification:
    """Re-verify a step: import its GraphDef afresh (so it is optimized again and collected), run it
    once on (x, y) or zeros, and restore every variable. Leaves ``step`` itself untouched."""
    function = import_step(step.graph_def, step.traced)
    flat = step._flat_inputs(x, y) if x is not None else step.zeros()
    snapshot = step.snapshot()
    try:
        _, graphs = collect_first_call(function, *flat)
    finally:
        snapshot.restore()
    result = check(graphs, step.applied, accelerator=step.placement.accelerator, host=step.placement.host,
                   recomputed=step.recomputed, split=step.split,
                   host_updates=frozenset().union(*step.host_updates.values()))
    _report(result)
    return result


def _report(result: Verification) -> None:
    if result.ok:
        log.info("swap plan verified: %s", result.summary())
    else:
        log.warning("%s", result.headline())
