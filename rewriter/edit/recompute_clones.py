"""Recomputation in the real step: clones of pure forward ops serve a tensor's far reads (docs/design.md 9).

``apply_recomputes(graph_def, actions)`` builds each ``simulator.recompute.actions.Recompute`` in a step's
GraphDef, the way the simulator's transformed graph has it (``docs/design.md``, recomputation):

* the TF subgraph between the action's sources and its ``tensor`` is cloned: walking back from the
  tensor's node, every listed op is cloned, and so is every op the capture bypassed (Identity,
  StopGradient, ...) that sits between two of them; anything else (a source, a constant, a
  variable read, a static shape) stays shared, so a clone reads the very tensors its original read.
  Clones are named ``clone_name(op, k)`` (k: the action's index in the plan), the names the
  simulator gives them, and carry Grappler's keep mark (``KEEP_ATTR``): its common-subgraph
  elimination would merge a clone back into its original (saving nothing), and its arithmetic
  optimizer would reassociate a clone chain (rounding differently from the original). Kept, a
  clone computes what its original computes as written, bit for bit;
* every clone with no cloned data input waits for the trigger (a control edge), so the
  recomputation runs late, not beside its sources; a trigger a graph pass might fuse with a far
  reader is replaced by its inputs' producers, as for swap-ins (``rewriter.edit.graph_edit.GraphEditor.safe_controls``);
* every input of a far reader (``consumers``) that reads the tensor, directly or through bypassed
  ops, reads the clone instead.

Only pure ops are cloned: an action that would clone a stateful op (``op_def.is_stateful``: variable
reads and writes, stateful random ops, IO, asserts), a placeholder, control flow, a function call or
anything handling resources or variants is refused with one ``PlanError``, as is one that names ops
the step does not have. Stateless random ops are cloned: their clones read the original key and
counter tensors (sources), so Dropout's mask is made again bit for bit although the step advances
the seed generator's variable.

What Grappler does with the originals can still change: a source read by a clone has one more
reader, and the arithmetic optimizer merges an add chain only through nodes with one reader, so the
original chain may be summed in another order than in Keras' own step (rounding: the transformer
encoder's weights differ from Keras' by up to 3e-7 of their scale after two steps).
``rewriter.check.recompute_check.check_recomputes`` reads the optimized graphs of a first call and reports clones
merged back, far reads lost and trigger edges dropped.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from tensorflow.core.framework import graph_pb2, types_pb2
from tensorflow.python.framework import op_def_registry

from rewriter.trace.tracing import SHAPE_TYPES
from rewriter.edit.graph_edit import GraphEditor
from rewriter.edit.graph_refs import parse_ref, tensor_ref
from simulator.plan import PlanError
from simulator.recompute.actions import Recompute, clone_name, original_name

# Attributes every clone carries: its own name (how verification finds it under a name Grappler gave it),
# and Grappler's keep mark, which puts it in the optimizers' preserve set: common-subgraph elimination
# then never merges it into its original or into another action's clone of the same op (the trigger's
# control edge alone did not keep two actions' clones of one BiasAdd apart on norm_mix), and the
# arithmetic optimizer never reassociates it (a LayerNorm's clone chain was rewritten into an AddN that
# rounded differently from its original on the transformer encoder).
CLONE_ATTR = "_recompute_clone"
KEEP_ATTR = "_grappler_do_not_remove"
# Nodes a walk back from the tensor stops at: their outputs are shared by the clones.
SHARED_TYPES = frozenset({"Const", "Placeholder", "ReadVariableOp", "VarHandleOp"}) | SHAPE_TYPES
# Ops never cloned besides those TF declares stateful: graph inputs, control flow and function calls
# (whatever they hold), tensor lists (variants), cross-device transfers.
REFUSED_TYPES = frozenset({
    "Placeholder", "PlaceholderWithDefault", "While", "StatelessWhile", "If", "StatelessIf", "Case",
    "StatelessCase", "PartitionedCall", "StatefulPartitionedCall", "_Send", "_Recv", "_HostSend", "_HostRecv",
    "Enter", "Exit", "Merge", "Switch", "NextIteration", "LoopCond",
})
_UNCLONABLE_DTYPES = frozenset({types_pb2.DT_RESOURCE, types_pb2.DT_VARIANT})


@dataclass(frozen=True)
class AppliedRecompute:
    """One recomputation as built in the graph."""

    index: int  # the action's position in the plan's list (the k of clone_name)
    tensor: str  # the original tensor, "op:k"
    clone: str  # the tensor the far readers read now, "clone:k"
    ops: tuple[str, ...]  # the listed ops' clones (what the simulator models)
    extra: tuple[str, ...]  # clones of bypassed ops between listed ones (Identity, ...)
    trigger: str
    controls: tuple[str, ...]  # the control inputs the clones that start the recomputation got
    starts: tuple[str, ...]  # those clones: the ones with no cloned data input
    rewired: tuple[tuple[str, int], ...]  # (far reader, input slot) now reading the clone

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.ops + self.extra


def unclonable_reason(node) -> str | None:
    """Why ``node`` (a NodeDef) must not be cloned, or None when it is a pure op."""
    if node.op in REFUSED_TYPES:
        return f"a {node.op}"
    op_def = op_def_registry.get(node.op)
    if op_def is None:
        return f"a {node.op}, an op TensorFlow's registry does not know (a function or custom op)"
    if op_def.is_stateful:
        return f"a stateful {node.op} (variable access, stateful randomness, IO or an assertion)"
    for arg in list(op_def.input_arg) + list(op_def.output_arg):
        if arg.type in _UNCLONABLE_DTYPES:
            return f"a {node.op} handling a {types_pb2.DataType.Name(arg.type)}"
    for key, value in node.attr.items():
        types = [value.type] if value.HasField("type") else list(value.list.type)
        if any(t in _UNCLONABLE_DTYPES for t in types):
            return f"a {node.op} of type {types_pb2.DataType.Name(types[0])} ({key})"
        if value.HasField("func") or value.list.func:
            return f"a {node.op} calling a function"
    return None


def _action(record: Any) -> Recompute:
    """``record`` itself: plan files are read by ``simulator.plan`` (the one reader of their records)."""
    if not isinstance(record, Recompute):
        raise PlanError(f"a recomputation must be a simulator.recompute.actions.Recompute (plan files: simulator.load_plan), "
                        f"got {type(record).__name__}")
    return record


def apply_recomputes(graph_def: graph_pb2.GraphDef, actions: Sequence[Recompute], *,
                     foldable: frozenset[str] = frozenset(), order: Sequence[str] = (),
                     passthrough: dict[str, int] | None = None) -> tuple[graph_pb2.GraphDef, list[AppliedRecompute]]:
    """A copy of ``graph_def`` with every action built; raise PlanError for one that cannot be.

    ``actions``: ``Recompute`` records, in the plan's order (``NamedPlan.recomputes``). ``foldable``
    (``rewriter.tf_effects.grappler.foldable_ops``) names ops Grappler removes, which must not carry a trigger's
    control edge: the op before one in ``order`` (the plan's) or its inputs' producers carry it
    instead, as for swap-ins. ``passthrough`` (``rewriter.tf_effects.passthrough.passthrough_ops`` of the traced
    step): arithmetic Grappler reduces to one input (a dropout mask's ``uniform * 1 + 0``), which the
    capture reads through, so an action's listed ops may have them in between; they are cloned with
    them. Nothing is changed when any action is refused.
    """
    edited = graph_pb2.GraphDef()
    edited.CopyFrom(graph_def)
    actions = [_action(record) for record in actions]
    names = {node.name for node in edited.node}  # once: per name of the order it was 10 s of ResNet-50's apply
    runnable = [name for name in order if name in names]
    editor = GraphEditor(edited, foldable, previous=dict(zip(runnable[1:], runnable)), passthrough=passthrough)
    _check_names(editor, actions)
    clone_sets = [_clone_set(editor, action, k) for k, action in enumerate(actions)]
    applied = [_build(editor, action, k, cloned) for k, (action, cloned) in enumerate(zip(actions, clone_sets))]
    editor.check_acyclic()
    return edited, applied


def _check_names(editor: GraphEditor, actions: list[Recompute]) -> None:
    missing: list[str] = []
    for k, action in enumerate(actions):
        if not action.ops or not action.consumers:
            raise PlanError(f"recomputation {k} of {action.tensor} lists no ops or no far readers")
        node, _ = parse_ref(action.tensor)
        if node != action.ops[-1]:
            raise PlanError(f"recomputation {k}: its last op {action.ops[-1]!r} does not make its tensor "
                            f"{action.tensor!r}")
        for name in (*action.ops, action.trigger, *action.consumers):
            if name not in editor.nodes:
                missing.append(name)
            elif original_name(name) != name:
                raise PlanError(f"recomputation {k} names the clone {name!r}: sources, triggers and far readers "
                                "are ops of the original step (no chains of recomputations)")
        for name in action.ops:
            if clone_name(name, k) in editor.nodes:
                raise PlanError(f"the graph already has a node named {clone_name(name, k)!r} (was the plan "
                                "applied twice?)")
    if missing:
        unique = list(dict.fromkeys(missing))
        raise PlanError(f"the plan's recomputations name {len(unique)} op(s) this model's training step does not "
                        f"have (e.g. {', '.join(repr(n) for n in unique[:3])}): it was made for another model or "
                        "version; capture the model again and make a new plan")


def _clone_set(editor: GraphEditor, action: Recompute, k: int) -> list[str]:
    """The nodes to clone for ``action``, producers before readers: the listed ops and the bypassed
    ops between them, found walking back from the tensor's node; refused when one is not pure or a
    listed op does not feed the tensor."""
    listed = set(action.ops)
    memo: dict[str, bool] = {}

    def between(name: str) -> bool:  # a bypassed node with a cloned node upstream of it
        if name in memo:
            return memo[name]
        memo[name] = False  # a cycle (none in a valid graph) ends here
        node = editor.nodes.get(name)
        found = name in listed or (node is not None and editor.bypassed(node)
                                   and any(between(parse_ref(ref)[0]) for _, ref in editor.data_inputs(node)))
        memo[name] = found
        return found

    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:  # post-order: inputs first
        if name in seen:
            return
        seen.add(name)
        node = editor.nodes[name]
        if node.op in SHARED_TYPES and name in listed:
            raise PlanError(f"recomputation {k} of {action.tensor} lists {name!r}, a {node.op}: constants, "
                            "variable reads and static shapes are shared, never recomputed")
        for _, ref in editor.data_inputs(node):
            source = parse_ref(ref)[0]
            if source in editor.nodes and editor.nodes[source].op not in SHARED_TYPES and between(source):
                visit(source)
        order.append(name)

    visit(parse_ref(action.tensor)[0])
    unreached = [name for name in action.ops if name not in seen]
    if unreached:
        raise PlanError(f"recomputation {k} of {action.tensor} lists {unreached[0]!r}, which does not feed the "
                        "tensor through the other listed ops")
    for name in order:
        reason = unclonable_reason(editor.nodes[name])
        if reason is not None:
            raise PlanError(f"recomputation {k} of {action.tensor} would clone {name!r}, {reason}: only pure "
                            "ops are recomputed (their clones must compute what the originals computed)")
    return order


def _build(editor: GraphEditor, action: Recompute, k: int, cloned: list[str]) -> AppliedRecompute:
    tensor = parse_ref(action.tensor)
    names = {name: clone_name(name, k) for name in cloned}
    controls = editor.safe_controls([action.trigger], action.consumers)
    starts = []
    for name in cloned:
        original = editor.nodes[name]
        node = editor.graph_def.node.add()
        node.CopyFrom(original)
        node.name = names[name]
        inputs = []
        for ref in original.input:
            if ref.startswith("^"):
                continue  # the original's ordering: its data inputs are values already made
            source, index = parse_ref(ref)
            inputs.append(tensor_ref(names[source], index) if source in names else ref)
        if not any(parse_ref(ref)[0] in names for ref in original.input if not ref.startswith("^")):
            starts.append(node.name)
        if node.name in starts:
            inputs.extend(f"^{c}" for c in controls)
        del node.input[:]
        node.input.extend(inputs)
        node.attr[CLONE_ATTR].s = node.name.encode()
        node.attr[KEEP_ATTR].b = True
        editor.nodes[node.name] = node
    clone = tensor_ref(names[tensor[0]], tensor[1])
    rewired: list[tuple[str, int]] = []
    for consumer in action.consumers:
        node = editor.nodes[consumer]
        slots = [slot for slot, ref in editor.data_inputs(node) if editor.resolve(ref) == tensor]
        if not slots:
            raise PlanError(f"op {consumer!r} does not read tensor {action.tensor} in this model's step: the plan "
                            "was made for another graph")
        for slot in slots:
            node.input[slot] = clone
            rewired.append((consumer, slot))
    listed = set(action.ops)
    return AppliedRecompute(k, action.tensor, f"{names[tensor[0]]}:{tensor[1]}",
                            tuple(names[n] for n in cloned if n in listed),
                            tuple(names[n] for n in cloned if n not in listed), action.trigger, tuple(controls),
                            tuple(starts), tuple(rewired))


def clone_tensor_info(tensor_info: dict[str, Any], applied: Iterable[AppliedRecompute]) -> dict[str, Any]:
    """``tensor_info`` ("op:k" -> (dtype, bytes), ``rewriter.step.apply_plan``) with the clones' tensors: a clone's
    outputs are its original's."""
    by_op: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for key, value in tensor_info.items():
        op, _, index = key.rpartition(":")
        by_op[op].append((index, value))
    info = dict(tensor_info)
    for item in applied:
        for name in item.nodes:
            for index, value in by_op.get(original_name(name), ()):
                info[f"{name}:{index}"] = value
    return info
