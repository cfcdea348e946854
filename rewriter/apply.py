"""Apply a swap plan to the real TensorFlow training step (docs/design.md 3).

``apply(model, plan, batch_size=...)`` traces the model's ``train_step`` (``rewriter.capture``),
edits the step's ``GraphDef`` by name and re-imports it with the model's variables re-bound, so the
returned ``SwapStep`` updates the same variables and optimizer slots in place:

* one swap-out node per swapped tensor, on the host device, reading the tensor;
* one swap-in per swap-in group, as two nodes (TFLMS' construction): ``<swap-in>_host``, an
  ``Identity`` on the host reading the swap-out, started by a control edge ``^trigger`` (or,
  synchronous, by control edges from the producers of its first consumer's other inputs and from its
  control inputs), never before ``after`` (the last device reader of the previous copy); and the
  swap-in itself on the accelerator, reading it. The copy to the accelerator is the ``_Recv`` between
  the two, and TensorFlow gives a cross-device ``_Recv`` no control inputs (``graph_partition.cc``):
  it starts the copy when its ``_Send`` runs, i.e. when the host-side node has run, after the trigger.
  A control edge on the accelerator-side node would only delay an op that forwards a buffer already
  copied (``rewriter.verify`` checks what the accelerator-side copy waits for);
* every listed consumer input that reads the tensor, directly or through ops the capture bypassed
  (Identity, IdentityN, StopGradient, ...), rewired to the swap-in output, in that input slot;
* ``sync_out`` swaps: the tensor's remaining readers wait for the swap-out (control edges); with
  none left, the op the plan's order runs after its producer does.

Swap nodes are named ``swap_out/<producer>_<k>`` and ``swap_in/<producer>_<k>/<j>``, carry explicit
devices and ``_grappler_do_not_remove=True``. The plan is checked against the traced graph before
anything runs: names the graph does not have raise one ``PlanError``; tensors inside ``While`` loop
bodies (functions of the graph's library, not top-level nodes) are skipped with a logged reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections import defaultdict, deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

from rewriter.capture import (BYPASS_TYPES, SHAPE_TYPES, CaptureError, TracedStep, _nbytes, import_step,
                              rewrite_graph_def, trace_keras_step)
from rewriter.host_memory import warn_if_pinned_limit_short
from rewriter.passthrough import passthrough_input, passthrough_ops
from rewriter.placement import SWAP_IN_PREFIX, SWAP_OUT_PREFIX, Placement, resolve as resolve_placement
from rewriter.step_inputs import planned_step_inputs
from simulator.devices import ONEDNN_POOL_READS
from simulator.fusion import fusion_neighbourhood

log = logging.getLogger(__name__)

PLAN_FORMAT = "swap-plan/1"
# Fusions TF's graph passes make, and why a swap-in cannot wait for a part of its consumer's fused
# chain: simulator.fusion (the replay applies the same rule to predict when such a swap-in starts).
# MaxPool reads that must stay on the device on the CPU testbed (why: simulator.devices.ONEDNN_POOL_READS);
# the planner leaves them out for the cpu-testbed preset, and apply skips them in plans made for another device.
_POOLS = frozenset(pool for pool, _ in ONEDNN_POOL_READS)
_POOL_GRADS = frozenset(grad for _, grad in ONEDNN_POOL_READS)
# Sources of a control edge that tell nothing about timing (always ready).
_ALWAYS_READY = frozenset({"Const", "Placeholder", "ReadVariableOp", "VarHandleOp", "NoOp"}) | SHAPE_TYPES
SWAP_OPS = ("Identity", "DeepCopy")
HOST_SWAP_IN_OP = "Identity"  # the host-side half of a swap-in forwards the host copy (no allocation)
HOST_SWAP_IN_SUFFIX = "_host"
RESHAPE_LIKE = frozenset({"Reshape", "Squeeze", "ExpandDims", "BroadcastTo"})
REDUCTIONS = frozenset({"Sum", "Mean", "Prod", "Max", "Min", "All", "Any"})


class PlanError(ValueError):
    """A plan that cannot be applied to this model's step (made for another graph, malformed, cyclic)."""


# ---------------------------------------------------------------------- plan records


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


@dataclass(frozen=True)
class SkippedSwap:
    tensor: str
    reason: str


def load_plan(plan: Any, graph: Any = None) -> dict[str, Any]:
    """Any accepted plan form as the JSON dict of ``SwapPlan.to_dict`` (format 'swap-plan/1').

    ``plan``: a ``simulator.SwapPlan`` (with ``graph``, the OpGraph it was made on), a dict, a JSON
    string, or a path to a JSON file.
    """
    from simulator.planning import SwapPlan

    if isinstance(plan, SwapPlan):
        if graph is None and not plan.changes_step:
            return dict(empty_plan(), batch_size=plan.batch_size)
        if graph is None:
            raise PlanError("a SwapPlan holds op indices: pass graph=, the OpGraph it was made on "
                            "(or pass the plan as JSON, SwapPlan.to_json(graph))")
        try:
            return plan.to_dict(graph)
        except ValueError as error:
            raise PlanError(f"the plan does not belong to the given graph: {error}") from None
    if isinstance(plan, (str, os.PathLike)):
        text = str(plan)
        if isinstance(plan, os.PathLike) or not text.lstrip().startswith("{"):
            path = Path(text)
            try:
                text = path.read_text()
            except OSError as error:
                raise PlanError(f"cannot read the plan file {path}: {error.strerror or error}") from None
        try:
            plan = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanError(f"the plan is not valid JSON ({error})") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise PlanError(f"not a swap plan (expected a JSON object with format {PLAN_FORMAT!r})")
    swaps = plan.get("swaps")
    if not isinstance(swaps, list):
        raise PlanError("the plan has no 'swaps' list")
    for i, record in enumerate(swaps):
        if not isinstance(record, dict) or not isinstance(record.get("tensor"), str) \
                or not isinstance(record.get("swap_ins"), list):
            raise PlanError(f"swap {i} of the plan is malformed (needs 'tensor' and 'swap_ins')")
        if not record["swap_ins"]:  # the simulator would count a copy out that nothing reads back
            raise PlanError(f"the swap of {record['tensor']} has no swap-in: a swapped tensor must be read back")
        for item in record["swap_ins"]:
            if not isinstance(item, dict) or not isinstance(item.get("consumers"), list) or not item["consumers"]:
                raise PlanError(f"a swap-in of {record['tensor']} is malformed (needs a non-empty 'consumers' list)")
    return plan


def empty_plan() -> dict[str, Any]:
    return {"format": PLAN_FORMAT, "swaps": []}


# ---------------------------------------------------------------------- GraphDef editing


def _parse(name: str) -> tuple[str, int]:
    node, _, index = name.partition(":")
    return node, int(index) if index else 0


def _tensor_ref(node: str, index: int) -> str:
    return node if index == 0 else f"{node}:{index}"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-/>]", "_", name)


class _GraphEditor:
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
        reader's own (``capture._reduce``), so the simulator waits for them where the reader waits."""
        return self._walk(ref)[1]

    def _walk(self, ref: str) -> tuple[tuple[str, int], list[str]]:
        name, index = _parse(ref)
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
            name, index = _parse(data[pick][1])
        return (name, index), controls

    def bypassed(self, node) -> bool:
        """Whether readers of ``node`` read one of its inputs once Grappler has run (Identity-like
        ops, ``x * 1`` and the like)."""
        return node.op in BYPASS_TYPES or node.name in self.passthrough

    def unswapped(self, ref: str) -> str:
        """The tensor a read of a swap-in stands for (the read itself otherwise)."""
        return self.swapped_reads.get(_parse(ref)[0], ref)

    def sources(self, name: str, *, raw: bool = True) -> list[str]:
        """Producers of a node's data inputs, resolved through bypassed ops (and as written, with ``raw``)."""
        node = self.nodes.get(name)
        if node is None:
            return []
        found = []
        for _, ref in self.data_inputs(node):
            ref = self.unswapped(ref)
            for source in ((_parse(ref)[0], self.resolve(ref)[0]) if raw else (self.resolve(ref)[0],)):
                if source in self.nodes and source not in found:
                    found.append(source)
        return found

    def _readers_index(self) -> dict[str, list[str]]:
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
        readers = self._readers_index()

        def op_type(name: str) -> str:
            node = self.nodes.get(name)
            return "" if node is None else node.op

        danger: set[str] = set()
        for consumer in consumers:
            if consumer in self.nodes:
                danger |= fusion_neighbourhood(consumer, op_type, self.sources, lambda name: readers.get(name, ()))
        return danger

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
            if node is None or node.op in _ALWAYS_READY:
                continue
            if name in self.foldable and name in self.previous:  # Grappler removes it: the op before it
                pending.append(self.previous[name])
            elif name in danger or node.op in BYPASS_TYPES or name in self.foldable:  # Grappler removes these
                pending.extend(self.sources(name, raw=False))
            elif name not in result:
                result.append(name)
        if len(result) > 1:
            if not hasattr(self, "_ancestry"):
                self._ancestry = Ancestry(self.graph_def)  # original nodes; swap nodes are not sources
            result = self._ancestry.latest(result)
        return result

    def readers(self, tensor: tuple[str, int]) -> list[tuple[str, int]]:
        """(node, slot) of every non-bypassed input that reads ``tensor`` (resolved)."""
        found = []
        for node in self.graph_def.node:
            if self.bypassed(node):
                continue
            for slot, ref in self.data_inputs(node):
                if self.resolve(ref) == tensor:
                    found.append((node.name, slot))
        return found

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
        """Raise PlanError when the edited graph has a cycle (a trigger that depends on its consumer)."""
        indegree = {name: 0 for name in self.nodes}
        children: dict[str, list[str]] = defaultdict(list)
        for node in self.graph_def.node:
            for ref in node.input:
                source = _parse(ref.lstrip("^"))[0]
                if source in self.nodes:
                    children[source].append(node.name)
                    indegree[node.name] += 1
        queue = deque(name for name, count in indegree.items() if count == 0)
        seen = 0
        while queue:
            name = queue.popleft()
            seen += 1
            for child in children[name]:
                indegree[child] -= 1
                if indegree[child] == 0:
                    queue.append(child)
        if seen != len(self.nodes):
            stuck = sorted(name for name, count in indegree.items() if count > 0
                           and name.startswith((SWAP_IN_PREFIX, SWAP_OUT_PREFIX)))
            raise PlanError(f"the plan makes the step cyclic (a trigger or 'after' op depends on the consumer it "
                            f"should run before), e.g. around {stuck[:3] or 'the swap nodes'}")


class Ancestry:
    """Which nodes of a GraphDef each node depends on (data or control), as Python-int bitsets."""

    def __init__(self, graph_def):
        nodes = list(graph_def.node)
        self.index = {node.name: i for i, node in enumerate(nodes)}
        parents = [[self.index[p] for p in (_parse(ref.lstrip("^"))[0] for ref in node.input) if p in self.index]
                   for node in nodes]
        children: list[list[int]] = [[] for _ in nodes]
        indegree = [len(p) for p in parents]
        for child, plist in enumerate(parents):
            for parent in plist:
                children[parent].append(child)
        queue = deque(i for i, count in enumerate(indegree) if count == 0)
        self.bits = [0] * len(nodes)
        while queue:
            i = queue.popleft()
            acc = 0
            for parent in parents[i]:
                acc |= self.bits[parent] | (1 << parent)
            self.bits[i] = acc
            for child in children[i]:
                indegree[child] -= 1
                if indegree[child] == 0:
                    queue.append(child)

    def depends(self, node: str, on: str) -> bool:
        """True when ``node`` runs after ``on`` (a path of data/control edges from ``on`` to ``node``)."""
        i, j = self.index.get(node), self.index.get(on)
        return i is not None and j is not None and bool(self.bits[i] >> j & 1)

    def latest(self, names: list[str]) -> list[str]:
        """Drop the names another name of the list already depends on (their edges would be redundant)."""
        return [a for a in names if not any(b != a and self.depends(b, a) for b in names)]


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
            name, index = _parse(ref.lstrip("^"))
            if name not in doomed:
                rewritten.append(ref)
                continue
            source = nodes[name]
            data = [r for r in source.input if not r.startswith("^")]
            controls = [r for r in source.input if r.startswith("^")]
            if ref.startswith("^"):
                extra_controls += [f"^{_parse(r)[0]}" for r in data] + controls
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


def edit_graph_def(graph_def: graph_pb2.GraphDef, plan: dict[str, Any], placement: Placement, *, swap_op: str,
                   tensor_info: dict[str, tuple[Any, int]], foldable: frozenset[str] = frozenset(),
                   passthrough: dict[str, int] | None = None,
                   ) -> tuple[graph_pb2.GraphDef, list[AppliedSwap], list[SkippedSwap]]:
    """Return a copy of ``graph_def`` with the plan's swap nodes; raise PlanError on stale names.

    ``tensor_info`` maps "op:k" to (dtype, bytes) of the traced step's tensors; ``foldable`` names
    ops Grappler removes (``foldable_ops``), which must not carry a swap-in's control edge: the op
    before one in the plan's order (or its inputs' producers, without an order) carries it instead;
    ``passthrough`` (``passthrough_ops``) the arithmetic it reduces to one input, read through as the
    capture does.
    """
    edited = graph_pb2.GraphDef()
    edited.CopyFrom(graph_def)
    node_op = {node.name: node.op for node in edited.node}
    runnable = [name for name in plan.get("order", []) if node_op.get(name, "Placeholder") != "Placeholder"]
    # the op the simulator runs after each one (what a synchronous swap-out with no reader left holds)
    next_in_order = dict(zip(runnable, runnable[1:]))
    editor = _GraphEditor(edited, foldable, previous=dict(zip(runnable[1:], runnable)), passthrough=passthrough)
    missing: list[str] = []
    skipped: list[SkippedSwap] = []
    todo = []

    def known(name: str | None) -> bool:
        return name is None or name in editor.nodes

    for record in plan["swaps"]:
        tensor_name = record["tensor"]
        node_name, index = _parse(tensor_name)
        names = [node_name] + [c for item in record["swap_ins"] for c in item["consumers"]]
        names += [item.get(key) for item in record["swap_ins"] for key in ("trigger", "after") if item.get(key)]
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
        unique = list(dict.fromkeys(missing))
        raise PlanError(f"the plan names {len(unique)} op(s)/tensor(s) this model's training step does not have "
                        f"(e.g. {', '.join(repr(n) for n in unique[:3])}): it was made for another model, batch "
                        "structure or version; capture the model again and make a new plan")
    for item in skipped:
        log.warning("swap of %s skipped: %s", item.tensor, item.reason)

    applied: list[AppliedSwap] = []
    for record in todo:
        tensor = _parse(record["tensor"])
        dtype, nbytes = tensor_info[record["tensor"]]
        if not (dtype.is_floating or dtype.is_complex or dtype.is_integer or dtype.is_bool):
            raise PlanError(f"tensor {record['tensor']} has dtype {dtype.name}, which cannot be copied to the host")
        out_name = _node_name(SWAP_OUT_PREFIX, tensor)
        editor.add_node(out_name, swap_op, [_tensor_ref(*tensor)], placement.host, dtype)
        rewired_all: set[tuple[str, int]] = set()
        swap_ins = []
        groups = []
        for item in record["swap_ins"]:
            consumers = tuple(item["consumers"])
            if placement.measured_on == "cpu-testbed" and editor.nodes[tensor[0]].op in _POOLS:
                paired = tuple(c for c in consumers if editor.nodes[c].op in _POOL_GRADS)
                for consumer in paired:
                    skipped.append(SkippedSwap(record["tensor"], f"read by {consumer!r}: oneDNN pairs it with the "
                                               "MaxPool through a workspace, so it keeps reading the original"))
                    log.warning("swap-in of %s for %s skipped: %s", record["tensor"], consumer, skipped[-1].reason)
                consumers = tuple(c for c in consumers if c not in paired)
            if consumers:
                groups.append(dict(item, consumers=list(consumers)))
        if not groups:
            editor.graph_def.node.pop()  # the swap-out just added: nothing reads it
            del editor.nodes[out_name]
            continue
        for j, item in enumerate(groups):
            in_name = _node_name(SWAP_IN_PREFIX, tensor, j)
            consumers = tuple(item["consumers"])
            trigger, after = item.get("trigger"), item.get("after")
            rewired = []
            editor.swapped_reads[in_name] = _tensor_ref(*tensor)
            # control edges of ops the first consumer reads through (before its reads are rewired)
            passed_controls = [name for _, ref in editor.data_inputs(editor.nodes[consumers[0]])
                               for name in editor.bypassed_controls(ref)]
            for consumer in consumers:
                node = editor.nodes[consumer]
                slots = [slot for slot, ref in editor.data_inputs(node) if editor.resolve(ref) == tensor]
                if not slots:
                    raise PlanError(f"op {consumer!r} does not read tensor {record['tensor']} in this model's "
                                    "step: the plan was made for another graph")
                for slot in slots:
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
        if record.get("sync_out"):
            for reader, slot in editor.readers(tensor):
                if reader.startswith((SWAP_OUT_PREFIX, SWAP_IN_PREFIX)) or (reader, slot) in rewired_all:
                    continue
                if reader not in sync_controls:
                    sync_controls.append(reader)
            if not sync_controls and tensor[0] in next_in_order:  # no reader left: the op after the producer
                sync_controls.append(next_in_order[tensor[0]])
            for reader in sync_controls:
                editor.nodes[reader].input.append(f"^{out_name}")
        applied.append(AppliedSwap(record["tensor"], out_name, dtype.name, int(nbytes), bool(record.get("sync_out")),
                                   tuple(swap_ins), tuple(sync_controls)))
    if plan.get("after_copies_out"):  # a swap-in waits for the copies out of what the op it starts after made
        copies_of: dict[str, list[str]] = defaultdict(list)
        for swap in applied:
            copies_of[_parse(swap.tensor)[0]].append(swap.swap_out)
        position = {name: k for k, name in enumerate(runnable)}
        for k, swap in enumerate(applied):
            swap_ins = []
            for item in swap.swap_ins:
                # the op it starts after, as the replay has it: the trigger, or the last control source
                sources = [item.trigger] if item.trigger else [c for c in item.controls if c in position]
                last = max(sources, key=lambda name: position.get(name, -1), default="")
                waits = tuple(name for name in copies_of.get(last, ()) if name not in item.controls)
                if waits:
                    editor.nodes[item.host_node or item.name].input.extend(f"^{name}" for name in waits)
                    item = replace(item, controls=item.controls + waits)
                swap_ins.append(item)
            applied[k] = replace(swap, swap_ins=tuple(swap_ins))
    order = runnable
    if order:
        _bypass_identity_n(edited)
        editor = _GraphEditor(edited, foldable, passthrough=passthrough)
    # run the step in the order the simulator assumed: each op waits for the one before it and, past
    # ops Grappler may remove (taking their control edges along), for every op back to one it keeps
    since_kept: list[str] = []
    for before, after in zip(order, order[1:]):
        if not _may_vanish(editor.nodes[before], editor.nodes, foldable):
            since_kept.clear()
        since_kept.append(before)
        node = editor.nodes[after]
        for source in since_kept:
            if f"^{source}" not in node.input and source not in {_parse(ref)[0] for ref in node.input}:
                node.input.append(f"^{source}")
    editor.check_acyclic()
    return edited, applied, skipped


# ---------------------------------------------------------------------- variable state


class StateSnapshot:
    """Host copies of every variable a traced step captures (weights, optimizer slots, metrics, RNG
    state), to put the model back exactly as it was after a verification or measurement run."""

    def __init__(self, concrete):
        self._values = []
        for external, _ in concrete.graph.captures:
            if getattr(external, "dtype", None) != tf.resource:
                continue
            data = _handle_dtype(external)
            if data is None:
                continue
            value = tf.raw_ops.ReadVariableOp(resource=external, dtype=data)
            self._values.append((external, data, value.numpy()))

    def restore(self) -> None:
        for handle, dtype, value in self._values:
            tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(value, dtype=dtype))

    @property
    def nbytes(self) -> int:
        return int(sum(value.nbytes for _, _, value in self._values))


def _handle_dtype(handle):
    from tensorflow.python.ops import resource_variable_ops

    try:
        data = resource_variable_ops.get_eager_safe_handle_data(handle)
    except Exception:  # noqa: BLE001 -- handles without shape/type data are not variables we can read
        return None
    if not data.is_set or not data.shape_and_type:
        return None
    return tf.as_dtype(data.shape_and_type[0].dtype)


# ---------------------------------------------------------------------- the rewritten step


def swap_grappler_config(config: config_pb2.ConfigProto) -> config_pb2.ConfigProto:
    """Switch off, in ``config``, the graph passes that would move or copy swapped tensors (in place).

    * the memory optimizer: its AddN rewrite and its own swapping depend on a static memory estimate
      against the device's size, which makes the executed graph (and its peak) unpredictable; the
      plan already decides what leaves the device;
    * the layout optimizer: on a GPU it turns fp32 NHWC convolutions into NCHW with ``Transpose``s
      between a producer and its swap-out and between a swap-in and its reader, full-size buffers
      outside the plan (it does nothing on the CPU testbed, so the testbed runs what a GPU would);
    * pin-to-host: it may move small ops, a swap node among them, to the other device;
    * XLA auto-clustering: a cluster would swallow the swap nodes and their control edges.
    """
    rewrite = config.graph_options.rewrite_options
    rewrite.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    rewrite.layout_optimizer = rewriter_config_pb2.RewriterConfig.OFF
    rewrite.pin_to_host_optimization = rewriter_config_pb2.RewriterConfig.OFF
    config.graph_options.optimizer_options.global_jit_level = config_pb2.OptimizerOptions.OFF
    return config


@contextlib.contextmanager
def fixed_grappler_config():
    """Run functions with the Grappler configuration of ``swap_grappler_config``."""
    ctx = context.context()
    saved = ctx.function_call_options
    config = config_pb2.ConfigProto()
    config.ParseFromString(saved.config_proto_serialized)
    swap_grappler_config(config)
    ctx.function_call_options = context.FunctionCallOptions(executor_type=saved.executor_type, config_proto=config)
    try:
        yield
    finally:
        ctx.function_call_options = saved


class SwapStep:
    """One optimizer step of the rewritten training step: ``step(x, y) -> loss``.

    ``run(x, y)`` returns the step's logs as Keras' ``train_step`` does (the metrics dict). The step
    updates the model's variables in place. Attributes: ``plan`` (the plan dict that was applied),
    ``applied``/``skipped`` (per-swap records), ``placement``, ``verification`` (what survived
    Grappler, see ``rewriter.verify``), ``graph_def`` (the edited GraphDef), ``batch_size``.
    """

    def __init__(self, *, function, traced: TracedStep, graph_def, plan: dict, applied: list[AppliedSwap],
                 skipped: list[SkippedSwap], placement: Placement, swap_op: str, model=None,
                 apply_kwargs: dict | None = None):
        self._function = function
        self.traced = traced
        self.graph_def = graph_def
        self.plan = plan
        self.applied = applied
        self.skipped = skipped
        self.placement = placement
        self.swap_op = swap_op
        self.batch_size = traced.batch_size
        self.verification = None
        self.calls = 0  # how often it ran: its first call makes its constants (rewriter.measure)
        self.constant_bytes: int | None = None  # what its kernels' constants take, once a first call was profiled
        self._model = model
        self._apply_kwargs = dict(apply_kwargs or {})
        self._others: dict[int, SwapStep] = {}
        concrete = traced.concrete
        self.input_specs = [tf.TensorSpec(t.shape, t.dtype) for t in concrete.inputs[: len(traced.input_names)]]
        signature = concrete.structured_input_signature[0]
        self._n_x = len(signature[0])
        self._n_y = len(signature[1])
        self._output_structure = concrete.structured_outputs

    # -------------------------------------------------------------- facts

    @property
    def n_swap_outs(self) -> int:
        return len(self.applied)

    @property
    def n_swap_ins(self) -> int:
        return sum(len(s.swap_ins) for s in self.applied)

    @property
    def swapped_bytes(self) -> int:
        """Bytes copied to the host per step (d2h)."""
        return sum(s.bytes for s in self.applied)

    @property
    def swapped_in_bytes(self) -> int:
        """Bytes copied back per step (h2d): one copy per swap-in."""
        return sum(s.bytes * len(s.swap_ins) for s in self.applied)

    def swap_node_names(self) -> list[str]:
        names = []
        for swap in self.applied:
            names.append(swap.swap_out)
            names.extend(name for item in swap.swap_ins for name in (item.host_node, item.name) if name)
        return names

    def __repr__(self) -> str:
        return (f"SwapStep(batch_size={self.batch_size}, swaps={self.n_swap_outs}, swap_ins={self.n_swap_ins}, "
                f"skipped={len(self.skipped)}, placement={self.placement.describe()!r})")

    # -------------------------------------------------------------- running

    def _flat_inputs(self, x, y) -> list[tf.Tensor]:
        if self.traced.inputs is not None:  # a Keras step: dicts by name (any key order), lists in flat order
            xs, ys = self.traced.inputs.flatten(x, y)
        else:
            xs = list(x) if isinstance(x, (list, tuple)) else [x]
            ys = list(y) if isinstance(y, (list, tuple)) else [y]
        if isinstance(x, dict) and self.traced.inputs is None:
            raise TypeError("dict inputs are not supported by a traced function's step: pass a list")
        if len(xs) != self._n_x or len(ys) != self._n_y:
            raise ValueError(f"the step takes {self._n_x} input(s) and {self._n_y} label(s), "
                             f"got {len(xs)} and {len(ys)}")
        flat = []
        for value, spec in zip(xs + ys, self.input_specs):
            tensor = value if isinstance(value, tf.Tensor) else tf.convert_to_tensor(np.asarray(value))
            if tensor.dtype != spec.dtype:
                tensor = tf.cast(tensor, spec.dtype)
            if not spec.shape.is_compatible_with(tensor.shape):
                raise ValueError(f"input of shape {tuple(tensor.shape)} does not match the step's "
                                 f"{tuple(spec.shape)} (the step was built for batch size {self.batch_size}; "
                                 "use step.for_batch(n) for another batch size)")
            flat.append(tensor)
        return flat

    def batch_of(self, x) -> int:
        first = next(iter(x.values())) if isinstance(x, dict) else x[0] if isinstance(x, (list, tuple)) else x
        return int(first.shape[0])

    def run_flat(self, *flat):
        self.calls += 1
        with fixed_grappler_config():
            outputs = self._function(*flat)
        loss = outputs[-1]
        logs = tf.nest.pack_sequence_as(self._output_structure, list(outputs[:-1]))
        return logs, loss

    def run(self, x, y):
        """One optimizer step; returns the logs of Keras' ``train_step`` (e.g. ``{'loss': ...}``)."""
        return self.run_flat(*self._flat_inputs(x, y))[0]

    def __call__(self, x, y):
        """One optimizer step; returns this batch's loss (a scalar tensor)."""
        return self.run_flat(*self._flat_inputs(x, y))[1]

    def zeros(self) -> list[tf.Tensor]:
        return [tf.zeros(spec.shape, spec.dtype) for spec in self.input_specs]

    def for_batch(self, batch_size: int) -> "SwapStep":
        """The same plan applied at another batch size (names do not depend on it); cached."""
        if int(batch_size) == self.batch_size:
            return self
        if self._model is None:
            raise ValueError("this step was built from a traced function; trace it again at the other batch size")
        if int(batch_size) not in self._others:
            kwargs = dict(self._apply_kwargs, batch_size=int(batch_size), placement=self.placement,
                          swap_op=self.swap_op)
            kwargs.setdefault("verify", False)
            self._others[int(batch_size)] = apply(self._model, self.plan, **kwargs)
        return self._others[int(batch_size)]

    def snapshot(self) -> StateSnapshot:
        """Host copies of the step's variables (``.restore()`` puts them back)."""
        return StateSnapshot(self.traced.concrete)


def foldable_ops(concrete) -> frozenset[str]:
    """Ops Grappler removes, so a control edge from one would vanish: shape ops and reductions whose
    output has the static shape of their input (the arithmetic optimizer's
    RemoveRedundantReshapeOrBroadcastTo; a gradient's Sum over the axes BroadcastGradientArgs found
    to be none), ops computed from constants alone (constant folding: a loss's ``range`` of
    reduction axes) and arithmetic it reduces to one operand (``x * 1``: ``rewriter.passthrough``)."""
    found, constant = set(), set()
    for op in concrete.graph.get_operations():  # in creation order: inputs before their readers
        if op.inputs and not op.control_inputs and op.type not in _ALWAYS_READY and not op.op_def.is_stateful \
                and all(t.op.type == "Const" or t.op.name in constant for t in op.inputs):
            constant.add(op.name)
            found.add(op.name)
            continue
        if passthrough_input(op) is not None:  # x * 1 and the like (rewriter.passthrough)
            found.add(op.name)
            continue
        if op.type in RESHAPE_LIKE | REDUCTIONS and op.inputs and op.outputs:
            before, after = op.inputs[0].shape, op.outputs[0].shape
            if before.is_fully_defined() and after.is_fully_defined() and before == after:
                found.add(op.name)
    return frozenset(found)


# Ops Grappler's arithmetic optimizer and constant folding may remove besides ``foldable_ops``: a
# reshape of a reshape (the bias gradient's [64] -> [1,1,1,64] -> [64]), identities, and arithmetic
# with a constant operand (a loss weight of 1.0). Where one goes, the control edges it carried in the
# chain go with it (not forwarded: measured on multi_io, whose MaxPoolGrad then ran beside the filter
# gradient the order put before it, holding its input: 17 % above the prediction).
_VANISHING_TYPES = RESHAPE_LIKE | REDUCTIONS | frozenset({"Identity", "Snapshot", "StopGradient", "NoOp"})
_ARITHMETIC = frozenset({"Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum"})


def _may_vanish(node, nodes: dict[str, Any], foldable: frozenset[str]) -> bool:
    """Whether Grappler may remove ``node`` and the control edges it carries: the chain then also
    ties the next op to the ops before it back to one that stays, edges the order already implies
    (never a cycle; redundant where nothing is removed)."""
    if node.name in foldable or node.op in _VANISHING_TYPES:
        return True
    return node.op in _ARITHMETIC and any(
        nodes.get(_parse(ref)[0]) is not None and nodes[_parse(ref)[0]].op == "Const"
        for ref in node.input if not ref.startswith("^"))


def _tensor_info(concrete) -> dict[str, tuple[Any, int]]:
    info = {}
    for op in concrete.graph.get_operations():
        for k, tensor in enumerate(op.outputs):
            info[f"{op.name}:{k}"] = (tensor.dtype, _nbytes(tensor))
    return info


def apply(model, plan, *, batch_size: int | None = None, graph=None, placement: Placement | str | None = None,
          swap_op: str = "auto", input_shapes=None, label_shapes=None, label_dtype=None,
          verify: bool = True, verify_with=None, serialize: bool = True) -> SwapStep:
    """Apply ``plan`` to ``model``'s training step and return the rewritten step.

    ``model``: a compiled Keras model (its ``train_step`` is traced at ``batch_size``), or a
    ``rewriter.capture.TracedStep`` of a hand-written step. ``plan``: a ``simulator.SwapPlan`` (with
    ``graph``), a plan dict, JSON text or a path to a plan JSON file. ``placement``: a ``Placement``,
    "auto"/None (``placement.detect()``), "gpu", "cpu-testbed" or "cpu-testbed-1". ``swap_op``:
    "auto" (the placement's), "Identity" or "DeepCopy". ``serialize`` (default) chains the ops in the
    plan's ``order`` with control edges, so the step runs in the order the simulator assumed;
    without it TF's executor picks its own order and the measured peak can differ from the
    prediction by 10-30%.

    ``verify`` runs the step once with graph collection on, on ``verify_with`` = (x, y) or zeros,
    then restores every variable, and warns about swap nodes or trigger edges Grappler removed
    (``SwapStep.verification``). Errors: ``PlanError`` for a plan that does not fit the model
    (nothing is changed), ``CaptureError`` for a model that cannot be traced.
    """
    plan_dict = load_plan(plan, graph)
    input_shapes, label_shapes, label_dtype = planned_step_inputs(plan_dict, input_shapes, label_shapes, label_dtype)
    if not serialize:
        plan_dict = dict(plan_dict, order=[])
    place = resolve_placement(placement)
    chosen_op = place.swap_op if swap_op in (None, "auto") else swap_op
    if chosen_op not in SWAP_OPS:
        raise ValueError(f"swap_op must be 'auto' or one of {SWAP_OPS}, got {swap_op!r}")
    if isinstance(model, TracedStep):
        traced = model
        model = None
    else:
        if batch_size is None:
            batch_size = plan_dict.get("batch_size")
        if batch_size is None or int(batch_size) < 1:
            raise CaptureError(f"batch size must be a positive integer, got {batch_size!r}")
        traced = trace_keras_step(model, int(batch_size), input_shapes=input_shapes,
                                                 label_shapes=label_shapes, label_dtype=label_dtype)
    planned_batch = plan_dict.get("batch_size")
    if planned_batch and int(planned_batch) != traced.batch_size:
        log.info("plan made at batch size %s applied at %d (names do not depend on it; sizes do)",
                 planned_batch, traced.batch_size)
    concrete = traced.concrete
    rewritten = concrete
    graph_def = concrete.graph.as_graph_def()
    rewrites = plan_dict.get("graph_rewrites") or []
    if rewrites:  # the plan was made on the rewritten step: rewrite it the same way first
        try:
            graph_def, _ = rewrite_graph_def(graph_def, rewrites, concrete.graph)
        except ValueError as error:
            raise PlanError(f"the plan asks for a graph rewrite this version does not have: {error}") from None
        rewritten = import_step(graph_def, traced, keep_input_names=True)
    graph_def, applied, skipped = edit_graph_def(graph_def, plan_dict, place, swap_op=chosen_op,
                                                 tensor_info=_tensor_info(rewritten), foldable=foldable_ops(rewritten),
                                                 passthrough=passthrough_ops(rewritten.graph))
    function = import_step(graph_def, traced)
    step = SwapStep(function=function, traced=traced, graph_def=graph_def, plan=plan_dict, applied=applied,
                    skipped=skipped, placement=place, swap_op=chosen_op, model=model,
                    apply_kwargs=dict(input_shapes=input_shapes, label_shapes=label_shapes, label_dtype=label_dtype))
    log.info("applied %d swap(s) with %d swap-in(s) (%d skipped), swap op %s, on %s", step.n_swap_outs,
             step.n_swap_ins, len(skipped), chosen_op, place.describe())
    if place.measured_on == "gpu":  # copies out land in TF's pinned host allocator, which has a limit
        warn_if_pinned_limit_short(step.swapped_bytes)
    if verify and applied:
        from rewriter.verify import verify_first_call

        step.verification = verify_first_call(step, verify_with)
    return step
