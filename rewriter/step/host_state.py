"""Optimizer slots on the host, updated there (a plan's ``host_state``, docs/design.md 13).

TensorFlow places an op that reads or writes a resource variable with the variable. So the slots of a
variable the plan names are re-homed on the host device (each Keras slot variable takes a new
``tf.Variable`` made under ``tf.device(host)`` with its value: Keras' optimizer, ``get_weights``,
``save_weights`` and checkpoints reach it as before), and the arithmetic of that variable's update in
the step's GraphDef (the optimizer's ops that lead only to writes of the variable and of its slots) is
placed on the host: the gradient is copied out, the update runs beside the slots, and the weight's change
is copied in to the write, which stays with the weight on the device. Same kernels on both sides, so the
step trains bitwise like Keras' (``tests/rewriter/state/test_host_state.py``).

Which optimizers and which ops: ``rewriter.trace.optimizer_state`` (an optimizer it does not know is
refused with the reason).
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

import tensorflow as tf

from rewriter.trace.optimizer_state import host_update_ops, slots_by_variable, state_refusal, variable_handles
from rewriter.trace.tracing import forget_traces
from simulator.plan import PlanError
from simulator.state import HostState

log = logging.getLogger(__name__)


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


def place_on_host(graph_def, names: Iterable[str], device: str):
    """A copy of ``graph_def`` with the nodes ``names`` placed on ``device``, reading past the optimizer's
    ``IdentityN`` over all gradients: Grappler removes it from a step on one device, but keeps it where its
    readers are on another, and there it held every gradient until the last was made (the 3x1024 MLP with
    Adam: 9 MiB of gradients live at once where the step on one device holds one 4 MiB gradient at a time)."""
    edited = tf.compat.v1.GraphDef()
    edited.CopyFrom(graph_def)
    wanted = set(names)
    barriers = {node.name: list(node.input) for node in edited.node if node.op == "IdentityN"}
    for node in edited.node:
        if node.name not in wanted:
            continue
        node.device = device
        for k, name in enumerate(node.input):
            source, _, output = name.partition(":")
            if source in barriers and not name.startswith("^"):
                node.input[k] = barriers[source][int(output or 0)]
    return edited


def apply_host_state(graph_def, traced, model, host_state: Sequence[HostState], device: str):
    """The step's GraphDef with the update of each ``host_state`` variable on ``device``: (graph_def,
    {variable path: the nodes placed there}). The slots must be on ``device`` already (``home_slots``)."""
    if not host_state:
        return graph_def, {}
    handles = variable_handles(traced.concrete, model)
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
