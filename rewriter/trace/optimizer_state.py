"""Which optimizer state can live on the host, and which ops update it (docs/design.md 13).

Only optimizers whose slots and update are known move (``KNOWN_SLOTS``: Keras' SGD, Adam and AdamW); any
other, or one whose update runs inside a branch (``gradient_accumulation_steps``) or keeps an average of
the weights (``use_ema``), keeps its state on the device, with the reason (``state_refusal``). A variable's
update on the host is the optimizer's ops (its name scope) that lead only to writes of the variable and of
its slots (``host_update_ops``); the capture records them per variable in ``graph.meta["movable_state"]``
(``describe_movable_state``) for the simulator, and ``rewriter.step.host_state`` places them.
"""

from __future__ import annotations

import re
from collections import defaultdict

import tensorflow as tf

from rewriter.tf_effects.collectives import COLLECTIVE_TYPES
from rewriter.tf_effects.variable_writes import WRITE_TYPES_PREFIX
from rewriter.trace.state_kinds import keras_kinds

# Keras optimizer class -> the attributes holding its slot lists (one entry per trainable variable, in the
# order of ``optimizer._trainable_variables``; None where a variable has no slot)
KNOWN_SLOTS: dict[str, tuple[str, ...]] = {
    "keras.src.optimizers.sgd.SGD": ("momentums",),
    "keras.src.optimizers.adam.Adam": ("_momentums", "_velocities", "_velocity_hats"),
    "keras.src.optimizers.adamw.AdamW": ("_momentums", "_velocities", "_velocity_hats"),
}
RESOURCE_READ_TYPES = ("ReadVariableOp", "ResourceGather")


def _class_name(optimizer) -> str:
    kind = type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


def state_refusal(model) -> str | None:
    """Why the optimizer state of ``model`` cannot move to the host (None: it can)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return "the model has no optimizer"
    name = type(optimizer).__name__
    if hasattr(optimizer, "inner_optimizer"):  # Keras wraps a mixed_float16 model's optimizer in it
        return (f"{name} (mixed precision's loss scaling around {type(optimizer.inner_optimizer).__name__}) applies "
                "the update inside a branch, skipped where a gradient is not finite: its state stays on the device")
    if _class_name(optimizer) not in KNOWN_SLOTS:
        return (f"optimizer {name} is not one whose slots and update the tool knows (Keras' SGD, Adam, AdamW): "
                "its state stays on the device")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        return f"{name} with gradient_accumulation_steps updates inside a branch: its state stays on the device"
    if getattr(optimizer, "use_ema", False):
        return f"{name} with use_ema keeps an average of the weights: its state stays on the device"
    return None


def gradients_read_together(model) -> str | None:
    """Why the optimizer reads every gradient before it updates any variable (None: each update reads its own
    gradient only): then the device holds all gradients at once, however early each is copied out to the host."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    if getattr(optimizer, "global_clipnorm", None):
        return "global_clipnorm scales every gradient by the norm of all of them"
    if getattr(optimizer, "gradient_accumulation_steps", None):
        return "gradient_accumulation_steps adds every gradient to its accumulator before the update's branch"
    if hasattr(optimizer, "inner_optimizer"):  # LossScaleOptimizer
        return f"{type(optimizer).__name__} checks every gradient for non-finite values before any update"
    return None


def slots_by_variable(model) -> dict[str, list]:
    """Trainable variable path -> its optimizer slots (Keras variables), for a known optimizer."""
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    found: dict[str, list] = {}
    lists = [getattr(optimizer, attr, None) or [] for attr in KNOWN_SLOTS.get(_class_name(optimizer), ())]
    for index, variable in enumerate(optimizer._trainable_variables):
        found[variable.path] = [slots[index] for slots in lists if index < len(slots) and slots[index] is not None]
    return found


def movable_state(model) -> dict[str, int]:
    """Trainable variable path -> bytes of its slots, for the variables whose slots can move (none when
    ``state_refusal`` gives a reason)."""
    if state_refusal(model) is not None:
        return {}
    return {path: sum(int(slot.value.shape.num_elements()) * slot.value.dtype.size for slot in slots)
            for path, slots in slots_by_variable(model).items() if slots}


def _node_input(name: str) -> str:
    return name.lstrip("^").split(":")[0]


def host_update_ops(graph_def, handles: dict[str, str], groups: dict[str, set[str]], scope: str) -> dict[str, set[str]]:
    """Nodes of ``graph_def`` to place on the host, per moved variable: the optimizer's nodes (``scope``, its
    name scope) that lead only to writes of the variable or of its slots (``groups``: variable path -> the
    paths of it and its slots), without the reads and writes, which follow their variable, and without what leads
    to them through a collective (a replicated step's all-gather of a sparse gradient runs on the replicas' devices).
    ``handles``: the placeholder node of each captured variable -> its path."""
    nodes = {node.name: node for node in graph_def.node}
    in_scope = re.compile(rf"^{scope}(_\d+)?/")
    owner = {path: variable for variable, paths in groups.items() for path in paths}
    writers: dict[str, set[str]] = defaultdict(set)  # node -> the variables it leads to a write of
    for node in graph_def.node:
        if not node.op.startswith(WRITE_TYPES_PREFIX) or not node.input:
            continue
        written = handles.get(_node_input(node.input[0]))
        if written is None:
            continue
        stack, seen = [_node_input(i) for i in node.input[1:] if not i.startswith("^")], set()
        while stack:
            name = stack.pop()
            if name in seen or name not in nodes or not in_scope.match(name) or nodes[name].op == "Placeholder" \
                    or nodes[name].op in COLLECTIVE_TYPES:
                continue
            seen.add(name)
            writers[name].add(written)
            stack.extend(_node_input(i) for i in nodes[name].input if not i.startswith("^"))
    placed: dict[str, set[str]] = defaultdict(set)
    for name, written in writers.items():
        variables = {owner.get(path) for path in written}
        node = nodes[name]
        if len(variables) != 1 or None in variables or node.op in RESOURCE_READ_TYPES:
            continue
        if any(_node_input(i) in handles for i in node.input):
            continue
        placed[next(iter(variables))].add(name)
    return dict(placed)



def variable_handles(concrete, model) -> dict[str, str]:
    """The placeholder node of each variable a traced step captures -> the variable's Keras path."""
    kinds = keras_kinds(model)
    return {internal.op.name: kinds[id(external)][0] for external, internal in concrete.graph.captures
            if internal.dtype == tf.resource and id(external) in kinds}


def slot_access_ops(graph_def, handles: dict[str, str], paths: set[str]) -> set[str]:
    """Nodes that read or write one of the variables ``paths`` (they run where the variable lives)."""
    return {node.name for node in graph_def.node
            if node.input and handles.get(_node_input(node.input[0])) in paths}


def describe_movable_state(concrete, model, scope: str | None) -> dict:
    """``graph.meta["movable_state"]``: ``refusal`` (why nothing moves, or None), ``gradients_together`` (why
    every gradient is alive at once whatever moves, or None) and per variable whose slots can move,
    ``slot_bytes`` and ``ops``, the ops that run on the host once they do (its update and the reads and writes
    of its slots), ``slot_ops``, those reads and writes alone (what runs on the host when the slots are streamed
    around an update left on the device), ``weight_bytes`` and ``weight_ops``, the reads and writes of the variable
    itself (they run on the host too when the weight moves, ``simulator.state.with_host_state``)."""
    reason = state_refusal(model) if scope is not None else "the step's optimizer has no name scope"
    together = gradients_read_together(model)
    if reason is not None:
        return {"refusal": reason, "gradients_together": together, "variables": {}}
    graph_def = concrete.graph.as_graph_def()
    handles = variable_handles(concrete, model)
    sizes = movable_state(model)
    groups = {path: {path, *(slot.path for slot in slots)} for path, slots in slots_by_variable(model).items()
              if path in sizes}
    placed = host_update_ops(graph_def, handles, groups, scope)
    weights = {variable.path: variable for variable in model.trainable_variables}
    found = {}
    for path, names in placed.items():
        slot_ops = slot_access_ops(graph_def, handles, groups[path] - {path})
        weight = weights[path].value
        found[path] = {"slot_bytes": int(sizes[path]), "ops": sorted(names | slot_ops), "slot_ops": sorted(slot_ops),
                       "weight_bytes": int(weight.shape.num_elements()) * weight.dtype.size,
                       "weight_ops": sorted(slot_access_ops(graph_def, handles, {path}))}
    return {"refusal": None, "gradients_together": together, "variables": found}
