"""Optimizer slots on the host, updated there (a plan's ``host_state``, docs/design.md 13).

TensorFlow places an op that reads or writes a resource variable with the variable. So the slots of a
variable the plan names are re-homed on the host device (each Keras slot variable takes a new
``tf.Variable`` made under ``tf.device(host)`` with its value: Keras' optimizer, ``get_weights``,
``save_weights`` and checkpoints reach it as before), and the arithmetic of that variable's update in
the step's GraphDef (the optimizer's ops that lead only to writes of the variable and of its slots) is
placed on the host: the gradient is copied out, the update runs beside the slots, and the weight's change
is copied in to the write, which stays with the weight on the device. Same kernels on both sides, so the
step trains bitwise like Keras' (``tests/rewriter/state/test_host_state.py``). Streamed slots (mode
``stream-slots``): the slots live on the host as well, but only their reads and writes run there; the arithmetic
stays on the accelerator, which reads each slot through a copy in and whose values written to a slot are copied
out (``tests/rewriter/state/test_stream_slots.py``).

Which optimizers and which ops: ``rewriter.trace.optimizer_state`` (an optimizer it does not know is
refused with the reason). On a ``MirroredStrategy`` step each variable is mirrored, one component per replica:
``place_replica_state`` makes replica k's anew on replica k's host, and ``StateNodes.renamed`` names replica k's
update from the first replica's (``rewriter.step.replicated``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Sequence

import tensorflow as tf

from rewriter.edit.graph_edit import HOST_SWAP_IN_SUFFIX
from rewriter.edit.graph_refs import Ancestry
from rewriter.placement.placements import SWAP_IN_PREFIX, SWAP_OUT_PREFIX, Placement
from rewriter.trace.optimizer_state import (RESOURCE_READ_TYPES, host_update_ops, slot_access_ops, slots_by_variable,
                                            state_refusal, variable_handles)
from rewriter.trace.tracing import forget_traces
from simulator.plan import PlanError
from simulator.state import HOST_WEIGHTS, STREAM_SLOTS, HostState

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
    moved = [path for path in wanted if _home(slots[path], device)]
    if moved:
        _forget_functions(model)
        log.info("optimizer slots of %d variable(s) on %s", len(moved), device)
    return moved


def _on(value, device: str) -> bool:
    """Whether the ``tf.Variable`` ``value`` lives on ``device`` (by type and index)."""
    placed, target = tf.DeviceSpec.from_string(value.device), tf.DeviceSpec.from_string(device)
    return (placed.device_type, placed.device_index) == (target.device_type, target.device_index)


def _made_on(value, device: str):
    """A new ``tf.Variable`` on ``device`` with ``value``'s value, dtype, trainability and name."""
    with tf.device(device):
        return tf.Variable(value.read_value(), dtype=value.dtype, trainable=value.trainable,
                           name=value.name.split(":")[0])


def _home(variables: Iterable, device: str) -> bool:
    """Make each Keras variable's ``tf.Variable`` anew on ``device`` with its value, where it is elsewhere;
    whether any moved (the caller drops what traced the old ones)."""
    changed = False
    for variable in variables:
        if not _on(variable.value, device):
            variable._value = _made_on(variable.value, device)
            changed = True
    return changed


def _home_mirrored(variables: Iterable, devices: Sequence[str]) -> bool:
    """``_home`` for the variables of a model built under ``MirroredStrategy``: each one's component k made anew on
    ``devices[k]`` where it is elsewhere, gathered in a new mirrored variable of the same strategy and aggregation
    (Keras reads and checkpoints it as before); whether any moved."""
    changed = False
    for variable in variables:
        old = variable.value
        components = list(old.values)
        if all(_on(value, device) for value, device in zip(components, devices)):
            continue
        made = [value if _on(value, device) else _made_on(value, device) for value, device in zip(components, devices)]
        variable._value = type(old)(old.distribute_strategy, made, old.aggregation)
        changed = True
    return changed


def home_weights(model, paths: Iterable[str], placement: Placement) -> None:
    """The trainable variables ``paths`` on the placement's host, every other one on its accelerator (a plan's
    ``host-weights`` records): read on the device through copies in (``copy_weights_in``), updated where they live."""
    wanted = set(paths)
    weights = list(model.trainable_variables)
    unknown = wanted - {variable.path for variable in weights}
    if unknown:
        raise PlanError(f"the plan's host_state names {len(unknown)} variable(s) that are not trainable variables "
                        f"of this model (e.g. {sorted(unknown)[0]!r}): it was made for another model")
    if _keyed_again(model, lambda: [_home([v for v in weights if v.path in wanted], placement.host),
                                    _home([v for v in weights if v.path not in wanted], placement.accelerator)]):
        _forget_functions(model)
        log.info("%d weight(s) on %s", len(wanted), placement.host)


def _keyed_again(model, move) -> bool:
    """``move()`` (which makes trainable variables anew, returning whether each of its moves changed any) with the
    optimizer's index of each variable kept: Keras finds a variable's slots by its ``tf.Variable``'s id."""
    optimizer = model.optimizer
    indices = optimizer._trainable_variables_indices
    weights = list(model.trainable_variables)
    index_of = {variable.path: indices.pop(optimizer._var_key(variable)) for variable in weights}
    try:
        return any(move())
    finally:
        for variable in weights:
            indices[optimizer._var_key(variable)] = index_of[variable.path]


def place_state(model, host_state: Sequence[HostState], placement: Placement) -> None:
    """The slots of ``host_state``'s variables on the placement's host, every other slot on its accelerator (put
    back where an earlier plan had moved it), and the weights of its ``host-weights`` records likewise, so the step
    traced next finds the state where the plan wants it."""
    host_paths = [item.variable for item in host_state]
    if host_paths:
        home_slots(model, host_paths, placement.host)
    if state_refusal(model) is None:
        wanted = set(host_paths)
        home_slots(model, [path for path in slots_by_variable(model) if path not in wanted], placement.accelerator)
        home_weights(model, [item.variable for item in host_state if item.mode == HOST_WEIGHTS], placement)


def place_replica_state(model, host_state: Sequence[HostState], placements: Sequence[Placement]) -> None:
    """``place_state`` for a model built under ``MirroredStrategy``: the slots of ``host_state``'s variables on each
    replica's host (replica k's component on ``placements[k]``'s), every other slot on its replica's accelerator,
    and the weights of its ``host-weights`` records likewise."""
    wanted = {item.variable for item in host_state}
    weights = {item.variable for item in host_state if item.mode == HOST_WEIGHTS}
    reason = state_refusal(model)
    if reason is not None:
        if wanted:
            raise PlanError(f"the plan moves optimizer state, but {reason}")
        return
    slots = slots_by_variable(model)
    unknown = sorted(wanted - set(slots))
    if unknown:
        raise PlanError(f"the plan's host_state names {len(unknown)} variable(s) that are not trainable variables "
                        f"of this model (e.g. {unknown[0]!r}): it was made for another model")
    moved = False
    for path, variables in slots.items():
        devices = [place.host if path in wanted else place.accelerator for place in placements]
        moved = _home_mirrored(variables, devices) or moved
    trainable = list(model.trainable_variables)
    moved = _keyed_again(model, lambda: [
        _home_mirrored([v], [place.host if v.path in weights else place.accelerator for place in placements])
        for v in trainable]) or moved
    if moved:
        _forget_functions(model)
        log.info("optimizer state of %d variable(s) (%d with the weight) on each of %d replicas' hosts", len(wanted),
                 len(weights), len(placements))


def _forget_functions(model) -> None:
    """Drop what captured the slots' old variables: the step's traces and Keras' train function (also the
    one ``rewriter.use_swap_step`` keeps to restore)."""
    forget_traces(model)
    model.train_function = None
    if getattr(model, "_swap_original_train_function", None) is not None:
        model._swap_original_train_function = None


def place_on_host(graph_def, names: Iterable[str], device: str, *, on_host: Iterable[str] = (),
                  copy: tuple[str, str] | None = None, tensor_info: dict | None = None):
    """A copy of ``graph_def`` with the nodes ``names`` placed on ``device``, reading past the optimizer's
    ``IdentityN`` over all gradients (Grappler removes it from a step on one device, not where its readers
    run on another). ``copy`` = (op, device): each tensor they read from the accelerator (the gradient, a
    weight's read) is copied out by that op first, one copy per tensor, named as a swap-out (its bytes are
    the host's): on the testbed a tensor read across the two logical CPUs stayed referenced by the
    send/receive after its readers ran (the 3x1024 MLP with Adam: every gradient lived to the end of the
    step, 18.1 MiB measured where 13.2 are predicted), as for swaps (``CpuTestbedPlacement.swap_out_device``).
    ``on_host``: other nodes already there (the slots' reads), whose outputs need no copy."""
    edited = tf.compat.v1.GraphDef()
    edited.CopyFrom(graph_def)
    wanted = set(names)
    host_side = wanted | set(on_host)
    barriers = {node.name: list(node.input) for node in edited.node if node.op == "IdentityN"}
    copies: dict[str, str] = {}
    for node in list(edited.node):
        if node.name not in wanted:
            continue
        node.device = device
        for k, name in enumerate(node.input):
            if name.startswith("^"):
                continue
            source, _, output = name.partition(":")
            if source in barriers:
                name = node.input[k] = barriers[source][int(output or 0)]
                source, _, output = name.partition(":")
            info = (tensor_info or {}).get(f"{source}:{output or 0}")
            if copy is None or source in host_side or info is None or info[0] == tf.resource:  # a handle: no data
                continue
            if name not in copies:
                copies[name] = f"{SWAP_OUT_PREFIX}host_update/{source}_{output or 0}"
                added = edited.node.add()
                added.name, added.op, added.device = copies[name], copy[0], copy[1]
                added.input.append(name)
                added.attr["T"].type = info[0].as_datatype_enum
                added.attr["_grappler_do_not_remove"].b = True
            node.input[k] = copies[name]
    _copies_out_where_read(edited, set(copies.values()))
    return edited


def _copies_out_where_read(graph_def, copies: set[str]) -> None:
    """Make each copy out in ``copies`` wait for what its readers on the host wait for (their control inputs that
    do not come after the copy) and for the swap-ins those start: it runs where the replay frees the tensor, when
    the host reads it (``simulator.state.with_host_state``), after the copies in started by the same op, instead
    of wherever the executor queues it. Left to the executor, the MLP's gradient copy ran before or after a swap-in
    started beside it, and the measured peak was the prediction or a whole kernel below it, from call to call
    (tests/rewriter/state/test_host_weights.py)."""
    nodes = {node.name: node for node in graph_def.node}
    readers: dict[str, set[str]] = {}
    for node in graph_def.node:
        for name in node.input:
            readers.setdefault(name.lstrip("^").split(":")[0], set()).add(node.name)
    swap_ins_after: dict[str, list[str]] = {}  # a swap-in's start -> the swap-ins (their copies in) it starts
    for node in graph_def.node:
        if node.name.startswith(SWAP_IN_PREFIX) and node.name.endswith(HOST_SWAP_IN_SUFFIX):
            copy_in = node.name[:-len(HOST_SWAP_IN_SUFFIX)]
            for name in node.input:
                if name.startswith("^") and copy_in in nodes:
                    swap_ins_after.setdefault(name[1:], []).append(copy_in)
    ancestry = Ancestry(graph_def)

    def after(name: str, copy: str) -> bool:  # what runs after the copy is never waited for (a cycle)
        return name == copy or ancestry.depends(name, copy)

    for copy in sorted(copies):
        starts = [name[1:] for reader in sorted(readers.get(copy, ())) for name in nodes[reader].input
                  if name.startswith("^") and not after(name[1:], copy)]
        waits = starts + [copy_in for start in starts for copy_in in swap_ins_after.get(start, ())
                          if not after(copy_in, copy)]
        node = nodes[copy]
        node.input.extend(f"^{name}" for name in dict.fromkeys(waits) if f"^{name}" not in node.input)


@dataclass(frozen=True)
class StateNodes:
    """The step's nodes a plan's ``host_state`` moves, per variable path: its update's arithmetic (``updates``,
    the optimizer's ops that lead only to writes of it and its slots), the reads and writes of its slots
    (``slot_ops``) and, for a weight on the host, of the weight (``weight_ops``); ``streamed``: the variables whose
    slots are streamed around an update left on the accelerator; ``triggered``: those whose reads the plan's swap-ins
    copy in (``HostState.triggered_reads``)."""

    updates: dict[str, set[str]]
    slot_ops: dict[str, set[str]]
    weight_ops: dict[str, set[str]]
    streamed: frozenset[str]
    triggered: frozenset[str] = frozenset()

    def renamed(self, names: dict[str, str]) -> "StateNodes":
        """The same nodes on another replica (``names``: this replica's node -> that one's); one ``PlanError`` for a
        node without a counterpart."""
        missing = sorted(name for group in (self.updates, self.slot_ops, self.weight_ops)
                         for nodes in group.values() for name in nodes if name not in names)
        if missing:
            raise PlanError(f"{len(missing)} node(s) of the optimizer's update have no counterpart on another replica "
                            f"(e.g. {missing[0]!r})")

        def mapped(group: dict[str, set[str]]) -> dict[str, set[str]]:
            return {path: {names[name] for name in nodes} for path, nodes in group.items()}

        return StateNodes(mapped(self.updates), mapped(self.slot_ops), mapped(self.weight_ops), self.streamed,
                          self.triggered)


def state_nodes(graph_def, traced, model, host_state: Sequence[HostState]) -> StateNodes:
    """What ``host_state`` moves in the step's GraphDef (``StateNodes``); one ``PlanError`` where a variable's update
    is not among the optimizer's ops."""
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
    slot_ops = {path: slot_access_ops(graph_def, handles, paths - {path}) for path, paths in groups.items()}
    weight_ops = {item.variable: slot_access_ops(graph_def, handles, {item.variable}) for item in host_state
                  if item.mode == HOST_WEIGHTS}
    streamed = frozenset(item.variable for item in host_state if item.mode == STREAM_SLOTS)
    triggered = frozenset(item.variable for item in host_state if item.triggered_reads)
    return StateNodes(placed, slot_ops, weight_ops, streamed, triggered)


def apply_host_state(graph_def, traced, model, host_state: Sequence[HostState], placement: Placement,
                     tensor_info: dict):
    """The step's GraphDef with the update of each ``host_state`` variable on the placement's host: (graph_def,
    {variable path: the nodes placed there}). The slots must be there already (``home_slots``). Where copies
    wait for the compute (the testbed) what the update reads from the accelerator is copied out explicitly
    (``place_on_host``); ``tensor_info``: "op:k" -> (dtype, bytes) of the step's tensors."""
    if not host_state:
        return graph_def, {}
    return place_state_nodes(graph_def, state_nodes(graph_def, traced, model, host_state), placement, tensor_info)


def place_state_nodes(graph_def, nodes: StateNodes, placement: Placement, tensor_info: dict):
    """``apply_host_state`` for the nodes ``nodes`` (a replica's, ``StateNodes.renamed`` from the first one's)."""
    placed, slot_ops, weight_ops, streamed = nodes.updates, nodes.slot_ops, nodes.weight_ops, nodes.streamed
    kinds = {node.name: node.op for node in graph_def.node}
    # a streamed update's arithmetic stays on the accelerator; the values it writes to the slots go out to them
    updates = {path: slot_writes(slot_ops[path], kinds) if path in streamed else names
               for path, names in placed.items()}
    copy = (placement.swap_op, placement.swap_out_device) if placement.copies_wait_for_compute else None
    host_side = set().union(*slot_ops.values(), *weight_ops.values())
    edited = place_on_host(graph_def, set().union(*updates.values()), placement.host, on_host=host_side, copy=copy,
                           tensor_info=tensor_info)
    on_host = set().union(*updates.values()) | host_side
    if streamed:  # placed, not left to the placer beside the slots they read
        edited = place_on_host(edited, set().union(*(placed[path] for path in streamed)), placement.accelerator)
    copied_in = set().union(*weight_ops.values(), *(slot_ops[path] for path in streamed))
    if copied_in:
        triggered = set().union(*(weight_ops.get(path, set()) | (slot_ops[path] if path in streamed else set())
                                  for path in nodes.triggered))
        edited = copy_weights_in(edited, copied_in, on_host, placement, tensor_info, triggered=triggered)
    # the state's reads and writes run on the host: what they allocate is the host's (the measured peak's rule)
    return edited, {path: (slot_ops[path] if path in streamed else names) | weight_ops.get(path, set())
                    for path, names in placed.items()}


def slot_writes(names: set[str], kinds: dict[str, str]) -> set[str]:
    """The nodes of ``names`` (a variable's slot reads and writes) that write: those not of a read's type."""
    return {name for name in names if kinds[name] not in RESOURCE_READ_TYPES}


def copy_weights_in(graph_def, weight_ops: set[str], host_side: set[str], placement: Placement, tensor_info: dict,
                    *, triggered: set[str] = frozenset()):
    """A copy of ``graph_def`` where the device reads a weight (or a streamed slot) on the host through a copy in:
    each read of it (a node of ``weight_ops`` with an output) read by a node off the host gets one copy on the
    accelerator (the placement's swap op, named ``weight_in/<read>``), which its device readers read; it runs where
    the read runs in the plan's order, just before its first reader (``simulator.state.with_host_state``). A plan's
    swap of the read (its later readers, swap-ins started by triggers) copies in from the read itself: its copy out
    is an ``Identity`` on the host, which allocates nothing. A read of ``triggered`` (the ops of variables moved with
    ``HostState.triggered_reads``) the plan swaps gets no copy of its own: the plan's swap-ins serve every reader the
    simulator knows (``simulator.state.with_host_state``); a reader left (a shape's ``ShapeN``, a gradient nothing
    reads) is one Grappler folds or prunes. One the plan does not swap is copied in where it runs, as simulated."""
    edited = tf.compat.v1.GraphDef()
    edited.CopyFrom(graph_def)
    nodes = {node.name: node for node in edited.node}
    swapped = set()
    for node in edited.node:
        if node.name.startswith(SWAP_OUT_PREFIX) and node.input and node.input[0].split(":")[0] in weight_ops:
            node.op, node.device = "Identity", placement.host
            swapped.add(node.input[0].split(":")[0])
    planned = swapped & triggered
    copies: dict[str, str] = {}
    for node in list(edited.node):
        if node.name in host_side or node.name.startswith(SWAP_OUT_PREFIX) or node.device == placement.host:
            continue
        for k, name in enumerate(node.input):
            source = name.lstrip("^").split(":")[0]
            if name.startswith("^") or source not in weight_ops or source in planned \
                    or nodes[source].op not in ("ReadVariableOp",):
                continue
            if name not in copies:
                copies[name] = f"weight_in/{source}"
                added = edited.node.add()
                added.name, added.op, added.device = copies[name], placement.swap_op, placement.accelerator
                added.input.append(name)
                added.attr["T"].type = tensor_info[f"{source}:0"][0].as_datatype_enum
                added.attr["_grappler_do_not_remove"].b = True
            node.input[k] = copies[name]
    return edited

