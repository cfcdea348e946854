"""Apply a swap plan to the real TensorFlow training step (docs/design.md 3, 8).

``apply(model, plan, batch_size=...)`` traces the model's ``train_step`` (``rewriter.trace.tracing``), edits
the step's ``GraphDef`` by name (the plan's graph rewrites; its split regions, ``rewriter.edit.split_parts``: ops
run in parts along the batch; its recomputations, ``rewriter.edit.recompute_clones``:
clones of forward ops serving far reads; then ``rewriter.edit.graph_edit``: swap nodes, rewired reads, the
step chained in the plan's order, clones included) and re-imports it with the model's variables re-bound, so the returned ``SwapStep``
(``rewriter.step.swap_step``) updates the same variables and optimizer slots in place; its first call is
verified against what Grappler kept (``rewriter.check.verification``). The plan is read by ``simulator.load_plan``
(the one reader of plan files); a plan that does not fit the model raises one ``PlanError`` before
anything runs.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import replace
from typing import Any

from rewriter.trace.tracing import (CaptureError, TracedStep, import_step, rewrite_graph_def, rewritten_step,
                                   trace_keras_step)
from rewriter.trace.costs import tensor_nbytes
from rewriter.edit.graph_edit import SWAP_OPS, AppliedSwap, AppliedSwapIn, SkippedSwap, edit_graph_def  # noqa: F401
from rewriter.tf_effects.grappler import foldable_ops
from rewriter.host_memory import warn_if_pinned_limit_short
from rewriter.trace.op_names import traced_names
from rewriter.tf_effects.passthrough import passthrough_ops
from rewriter.placement.placements import Placement, resolve as resolve_placement
from rewriter.edit.recompute_clones import apply_recomputes, clone_tensor_info
from rewriter.edit.split_parts import BatchShapes, apply_splits, check_part_shapes, with_weighted_ops
from rewriter.trace.step_inputs import NO_STEP_INPUTS, StepInputs
from rewriter.step.swap_step import StateSnapshot, SwapStep  # noqa: F401 -- the step apply returns
from rewriter.step.host_state import apply_host_state, place_state
from rewriter.check.verification import verify_first_call
from simulator.plan import PlanError, load_plan  # noqa: F401 -- the error apply raises

log = logging.getLogger(__name__)


def _tensor_info(concrete) -> dict[str, tuple[Any, int]]:
    info = {}
    for op in concrete.graph.get_operations():
        for k, tensor in enumerate(op.outputs):
            info[f"{op.name}:{k}"] = (tensor.dtype, tensor_nbytes(tensor))
    return info


# per traced graph, what every plan applied to it reads of it: (foldable ops, tensor info, passthrough ops);
# a calibration and a measured run apply up to six plans to one trace (DenseNet-121: about 1 s each)
_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _step_facts(concrete) -> tuple[frozenset[str], dict[str, tuple[Any, int]], dict[str, int]]:
    """``foldable_ops``, ``_tensor_info`` and ``passthrough_ops`` of ``concrete``, read once per graph
    (copies of the dicts: callers may extend theirs)."""
    graph = concrete.graph
    try:
        facts = _FACTS.get(graph)
    except TypeError:  # a graph weak references cannot point to
        facts = None
    if facts is None:
        facts = (foldable_ops(concrete), _tensor_info(concrete), passthrough_ops(graph))
        try:
            _FACTS[graph] = facts
        except TypeError:
            pass
    return facts[0], dict(facts[1]), dict(facts[2])


def apply(model, plan, *, batch_size: int | None = None, graph=None, placement: Placement | str | None = None,
          swap_op: str = "auto", inputs: StepInputs = NO_STEP_INPUTS, verify: bool = True, verify_with=None,
          serialize: bool = True, sample_weight: bool = False) -> SwapStep:
    """Apply ``plan`` to ``model``'s training step and return the rewritten step.

    ``model``: a compiled Keras model (its ``train_step`` is traced at ``batch_size``), or a
    ``rewriter.trace.tracing.TracedStep`` of a hand-written step. ``plan``: anything ``simulator.load_plan``
    reads: a ``simulator.NamedPlan``, a ``simulator.SwapPlan`` (with ``graph``), a plan file's JSON
    object or text, or a path to a plan JSON file. ``placement``: a ``Placement``,
    "auto"/None (``placement.detect()``), "gpu", "cpu-testbed" or "cpu-testbed-1". ``swap_op``:
    "auto" (the placement's), "Identity" or "DeepCopy". ``serialize`` (default) chains the ops in the
    plan's ``order`` with control edges, so the step runs in the order the simulator assumed;
    without it TF's executor picks its own order and the measured peak can differ from the
    prediction by 10-30%.

    ``verify`` runs the step once with graph collection on, on ``verify_with`` = (x, y) or zeros,
    then restores every variable, and warns about swap nodes or trigger edges Grappler removed
    (``SwapStep.verification``). Errors: ``PlanError`` for a plan that does not fit the model
    (nothing is changed), ``CaptureError`` for a model that cannot be traced.

    ``sample_weight``: the step takes a weight per sample of the loss after the labels (what
    ``model.fit`` makes of ``sample_weight`` and ``class_weight``, ``rewriter.step.keras_fit``).
    """
    named = load_plan(plan, graph)
    inputs = inputs.or_planned(named)
    if not serialize:
        named = replace(named, order=())
    place = resolve_placement(placement)
    chosen_op = place.swap_op if swap_op in (None, "auto") else swap_op
    if chosen_op not in SWAP_OPS:
        raise ValueError(f"swap_op must be 'auto' or one of {SWAP_OPS}, got {swap_op!r}")
    if isinstance(model, TracedStep):
        if named.host_state:
            raise PlanError("the plan moves optimizer state, which needs the Keras model (not a traced function)")
        traced = model
        model = None
    else:
        if batch_size is None:
            batch_size = named.batch_size
        if batch_size is None or int(batch_size) < 1:
            raise CaptureError(f"batch size must be a positive integer, got {batch_size!r}")
        # before the trace: the step must capture the slots where the plan keeps them
        place_state(model, named.host_state, place)
        traced = trace_keras_step(model, int(batch_size), inputs, sample_weight=sample_weight)
    planned = named  # by the names the capture gives (rewriter.trace.op_names), whatever this process called the layers
    named = traced_names(named, traced.canonical)
    planned_batch = named.batch_size
    if planned_batch and int(planned_batch) != traced.batch_size:
        log.info("plan made at batch size %s applied at %d (names do not depend on it; sizes do)",
                 planned_batch, traced.batch_size)
    concrete = traced.concrete
    rewritten = concrete
    graph_def = concrete.graph.as_graph_def()
    rewrites = list(named.graph_rewrites)
    if rewrites:  # the plan was made on the rewritten step: rewrite it the same way first
        try:
            graph_def, _ = rewrite_graph_def(graph_def, rewrites, concrete.graph)
        except ValueError as error:
            raise PlanError(f"the plan asks for a graph rewrite this version does not have: {error}") from None
        rewritten = import_step(graph_def, traced, keep_input_names=True)
    foldable, tensor_info, passthrough = _step_facts(rewritten)
    recomputed, split = [], []
    if named.splits:  # first: the plan's recomputations and swaps were made on the split step
        if model is None:
            raise PlanError("a plan with split regions applies to a Keras model's own step (traced at a second batch "
                            "size to see which tensors grow with it)")
        following = trace_keras_step(model, traced.batch_size + 1, inputs, sample_weight=sample_weight)
        # the regions name the rewritten step's ops: both traces rewritten the same way (this one is already)
        shapes = BatchShapes.of(replace(traced, concrete=rewritten), rewritten_step(following, rewrites)[0]) \
            if rewrites else BatchShapes.of(traced, following)
        weights = traced.input_names[-1:] if sample_weight else []  # the weight per sample: the last input
        regions = with_weighted_ops(graph_def, named.splits, shapes, named.order, weights)
        graph_def, split = apply_splits(graph_def, regions, shapes, passthrough=passthrough,
                                        fetches=[t.op.name for t in concrete.outputs] + [traced.loss_op])
        parted = import_step(graph_def, traced)  # the split step as TF reads it: its shapes, what Grappler folds
        check_part_shapes(parted.graph, split, shapes)
        foldable, tensor_info, passthrough = _step_facts(parted)
    if named.recomputes:  # before the swaps: the plan's swaps were made on the step with the clones
        graph_def, recomputed = apply_recomputes(graph_def, named.recomputes, foldable=foldable, order=named.order,
                                                 passthrough=passthrough)
        tensor_info = clone_tensor_info(tensor_info, recomputed)
    graph_def, applied, skipped = edit_graph_def(graph_def, named, place, swap_op=chosen_op, tensor_info=tensor_info,
                                                 foldable=foldable, kept_reads=place.kept_reads,
                                                 passthrough=passthrough)
    graph_def, host_updates = apply_host_state(graph_def, traced, model, named.host_state, place, tensor_info)
    function = import_step(graph_def, traced)

    def at_batch(size: int, weighted: bool = sample_weight) -> SwapStep:  # the same plan, traced again
        return apply(model, planned, batch_size=size, placement=place, swap_op=chosen_op, inputs=inputs, verify=False,
                     sample_weight=weighted)

    step = SwapStep(function=function, traced=traced, graph_def=graph_def, plan=named, applied=applied,
                    skipped=skipped, placement=place, swap_op=chosen_op, model=model,
                    at_batch=None if model is None else at_batch, recomputed=recomputed, split=split,
                    host_updates=host_updates)
    log.info("applied %d swap(s) with %d swap-in(s) (%d skipped), %d recomputation(s), %d split region(s) and %d "
             "update(s) on the host, swap op %s, on %s", step.n_swap_outs, step.n_swap_ins, len(skipped),
             len(recomputed), len(split), len(host_updates), chosen_op, place.describe())
    if place.measured_on == "gpu":  # copies out land in TF's pinned host allocator, which has a limit
        warn_if_pinned_limit_short(step.swapped_bytes)
    if verify and (applied or recomputed or split or host_updates):
        step.verification = verify_first_call(step, verify_with)
    return step
