"""Optimizer slots on the host, updated there (a plan's ``host_state``, docs/design.md 13).

TensorFlow places an op that reads or writes a resource variable with the variable. So the slots of a
variable the plan names are re-homed on the host device (each Keras slot variable takes a new
``tf.Variable`` made under ``tf.device(host)`` with its value: Keras' optimizer, ``get_weights``,
``save_weights`` and checkpoints reach it as before), and the arithmetic of that variable's update in
the step's GraphDef (the optimizer's ops that lead only to writes of the variable and of its slots) is
placed on the host: the gradient is copied out, the update runs beside the slots, and the weight's change
is copied in to the write, which stays with the weight on the device. Same kernels on both sides, so the
step trains bitwise like Keras' (``tests/rewriter/state/test_host_state.py``).

Only optimizers whose slots and update are known are moved (``KNOWN_SLOTS``: Keras' SGD, Adam and
AdamW); any other, or one whose update runs inside a branch (``gradient_accumulation_steps``) or keeps
an average of the weights (``use_ema``), is refused with the reason (``state_refusal``).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from typing import Iterable, Sequence

import tensorflow as tf

from rewriter.tf_effects.variable_writes import WRITE_TYPES_PREFIX
from rewriter.trace.state_kinds import keras_kinds
from rewriter.trace.tracing import forget_traces
from simulator.plan import PlanError
from simulator.state import HostState

log = logging.getLogger(__name__)

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
    if _class_name(optimizer) not in KNOWN_SLOTS:
        return (f"optimizer {name} is not one whose slots and update the tool knows (Keras' SGD, Adam, AdamW): "
                "its state stays on the device")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        return f"{name} with gradient_accumulation_steps updates inside a branch: its state stays on the device"
    if getattr(optimizer, "use_ema", False):
        return f"{name} with use_ema keeps an average of the weights: its state stays on the device"
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


def home_slots(model, paths: Iterable[str], device: str) -> list[str]:
    """Put the slots of the trainable variables ``paths`` on ``device`` (their values kept); returns the
    paths whose slots moved. A Keras slot keeps its identity, its ``tf.Variable`` is made anew there, so
    every function traced before (the step's traces, Keras' train function) is dropped."""
    reason = state_refusal(model)
    if reason is not None:
        raise PlanError(f"the plan moves optimizer state, but {reason}")
    slots = slots_by_variable(model)
    wanted = list(paths)
    unknown = [path for path in wanted if path not in slots]
    if unknown:
        raise PlanError(f"the plan's host_state names {len(unknown)} variable(s) that are not trainable variables "
                        f"of this model (e.g. {unknown[0]!r}): it was made for another model")
    target = tf.DeviceSpec.from_string(device)
    moved = []
    for path in wanted:
        changed = False
        for slot in slots[path]:
            old = slot.value
            placed = tf.DeviceSpec.from_string(old.device)
            if (placed.device_type, placed.device_index) == (target.device_type, target.device_index):
                continue
            with tf.device(device):
                slot._value = tf.Variable(old.read_value(), dtype=old.dtype, trainable=old.trainable,
                                          name=old.name.split(":")[0])
            changed = True
        if changed:
            moved.append(path)
    if moved:
        _forget_functions(model)
        log.info("optimizer slots of %d variable(s) on %s", len(moved), device)
    return moved


def _forget_functions(model) -> None:
    """Drop what captured the slots' old variables: the step's traces and Keras' train function (also the
    one ``rewriter.use_swap_step`` keeps to restore)."""
    forget_traces(model)
    model.train_function = None
    if getattr(model, "_swap_original_train_function", None) is not None:
        model._swap_original_train_function = None


# ---------------------------------------------------------------------- the GraphDef


def _node_input(name: str) -> str:
    return name.lstrip("^").split(":")[0]


def host_update_ops(graph_def, handles: dict[str, str], groups: dict[str, set[str]], scope: str) -> dict[str, set[str]]:
    """Nodes of ``graph_def`` to place on the host, per moved variable: the optimizer's nodes (``scope``, its
    name scope) that lead only to writes of the variable or of its slots (``groups``: variable path -> the
    paths of it and its slots), without the reads and writes, which follow their variable.
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
            if name in seen or name not in nodes or not in_scope.match(name) or nodes[name].op == "Placeholder":
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


def place_on_host(graph_def, names: Iterable[str], device: str):
    """A copy of ``graph_def`` with the nodes ``names`` placed on ``device``."""
    edited = tf.compat.v1.GraphDef()
    edited.CopyFrom(graph_def)
    wanted = set(names)
    for node in edited.node:
        if node.name in wanted:
            node.device = device
    return edited


def apply_host_state(graph_def, traced, model, host_state: Sequence[HostState], device: str):
    """The step's GraphDef with the update of each ``host_state`` variable on ``device``: (graph_def,
    {variable path: the nodes placed there}). The slots must be on ``device`` already (``home_slots``)."""
    if not host_state:
        return graph_def, {}
    kinds = keras_kinds(model)
    handles = {internal.op.name: kinds[id(external)][0] for external, internal in traced.concrete.graph.captures
               if internal.dtype == tf.resource and id(external) in kinds}
    slots = slots_by_variable(model)
    groups = {item.variable: {item.variable, *(slot.path for slot in slots[item.variable])} for item in host_state}
    if traced.optimizer_scope is None:
        raise PlanError("the plan moves optimizer state, but the step's optimizer has no name scope to find its update")
    placed = host_update_ops(graph_def, handles, groups, traced.optimizer_scope)
    missing = [path for path in groups if not placed.get(path)]
    if missing:
        raise PlanError(f"the update of {missing[0]!r} was not found among the optimizer's ops: its state cannot "
                        "move to the host")
    return place_on_host(graph_def, set().union(*placed.values()), device), placed
