"""The order the edited step runs in: the plan's order, with the ops a graph pass may merge moved next to
each other (``partners_adjacent``), enforced by control edges (``chain_in_order``). ``editor`` is the
``rewriter.edit.graph_edit.GraphEditor`` of the step being edited."""

from __future__ import annotations

import logging
from typing import Any

from rewriter.edit.graph_refs import Ancestry, parse_ref
from rewriter.tf_effects.grappler import may_vanish
from simulator.fusion import CHAIN_MERGES, CHAIN_TAILS, SIBLING_FUSIONS, fused_as_siblings
from simulator.graph import COMBINE_MARK  # a running combine's step (simulator.split.actions.combine_name)

log = logging.getLogger(__name__)
# filter gradients oneDNN's layout pass merges with the bias gradient of their gradient input
FILTER_GRADIENTS_MERGED = frozenset({"Conv2DBackpropFilter", "Conv3DBackpropFilterV2"})
# the later node of each pair ``merged_pairs`` looks for, which reads the earlier one's output
_MERGED_READERS = frozenset({"BiasAddGrad"} | {tail for _, tail in CHAIN_MERGES})


def _merge_partners(editor: Any, op: str, position: dict[str, int]) -> list[str]:
    """The ops before ``op`` in the order (``position``) that a graph pass may merge with it into one
    node: a sibling (a filter gradient's bias gradient on the same input), or a part of its fused chain
    (``GraphEditor.fusion_neighbourhood``) read by nothing outside the chain (a producer read elsewhere
    too is never merged: oneDNN and the remapper fuse single readers only)."""
    danger = [name for name in editor.fusion_neighbourhood([op]) if position.get(name, len(position)) < position[op]]
    if not danger:
        return []
    readers = editor.readers_index()
    kind = editor.nodes[op].op
    partners = set(danger)
    while True:  # a chain part merges when every reader is the op or a part that merges
        chain = partners | {op}
        dropped = {name for name in partners if not fused_as_siblings(kind, editor.nodes[name].op) and not all(
            reader in chain or reader not in editor.nodes or editor.bypassed(editor.nodes[reader])
            for reader in readers.get(name, ()))}
        if not dropped:
            return [name for name in danger if name in partners]
        partners -= dropped


def partners_adjacent(editor: Any, order: list[str]) -> list[str]:
    """``order`` with every op a graph pass may merge with a later op moved next to it, and the ops between
    them that depend on it after them. A split step's running combines stay where the order has them: each
    step is kept from Grappler and waits for the one before, the next partial waits for it, and gathered
    next to the last step they took each part's weight gradient along, out of a micro-batch's backward into
    the next one's (its inputs live the while: the transformer block of tests/rewriter/edit/test_micro_batches.py
    measured 8 % over its prediction).

    oneDNN's layout pass merges a Conv2DBackpropFilter and the BiasAddGrad reading the same gradient (a
    Conv2D and its BiasAdd, a Pad and its Conv2D) when the two have the same control inputs; the merged
    node takes over both nodes' edges, and no other path between them is looked for. Chained in the
    plan's order, partners with ops between them are joined by a path through those ops, so merged they
    close a cycle ("N nodes in a cycle" at the first call). The chain's own control edge on the later
    partner usually keeps them unmerged; a recomputation breaks that: the filter gradient's predecessor
    is then the clone it reads (a data input, no control edge), and the bias gradient and its update
    sit before the clones (ResNet-50's recomputed convolutions, tests/rewriter/test_recompute_clones.py). Next to each other, the
    partners' only path is their own edge, merged or not. The earlier partner runs where a merged node
    would, its dependents (a bias gradient's update: a few bytes) after it; one the later op waits for
    (through a trigger) cannot move: left as it is, with a warning, and where oneDNN merges the pair
    (``merged_pairs``) ``GraphEditor.check_acyclic`` refuses the plan (merged, they close a cycle).
    """
    result = list(order)
    takers = CHAIN_TAILS | SIBLING_FUSIONS
    position = {name: k for k, name in enumerate(result)}
    ancestry: Ancestry | None = None
    left: list[tuple[str, str, str]] = []  # partners kept apart: (op, its partner, what op waits for between)
    for op in order:
        if editor.nodes[op].op not in takers or COMBINE_MARK in op:
            continue
        partners = [name for name in _merge_partners(editor, op, position) if COMBINE_MARK not in name]
        if not partners:
            continue
        end = position[op]
        start = min(position[name] for name in partners)
        if end - start == len(partners):  # already together
            continue
        if ancestry is None:
            ancestry = Ancestry(editor.graph_def)
        moved = set(partners)
        segment = result[start:end]
        dependents = [name for name in segment if name not in moved
                      and any(ancestry.depends(name, partner) for partner in partners)]
        blocking = [name for name in dependents if ancestry.depends(op, name)]
        if blocking:
            left.append((op, partners[0], blocking[0]))
            continue
        later = set(dependents)
        result[start:end + 1] = ([name for name in segment if name not in moved and name not in later]
                                 + [name for name in segment if name in moved] + [op] + dependents)
        position.update((name, k) for k, name in enumerate(result[start:end + 1], start))
    if left:  # one line a step (a split step's running combines are such pairs by the hundred)
        op, partner, blocking = left[0]
        log.warning("%d op pair(s) a graph pass may merge are left in the plan's order, as a later one waits for "
                    "an op that depends on the first (e.g. %s and %s, through %s)", len(left), op, partner, blocking)
    return result


def merged_pairs(editor: Any) -> dict[str, str]:
    """The ops oneDNN's layout pass merges into one node, each mapped to the name of the node it becomes: a filter
    gradient and the BiasAddGrad reading the op that made its gradient input, its third (mkl_layout_pass.cc's
    GetConv2DBackpropFilterOrBiasAddGrad; a transposed convolution's filter gradient reads the gradient first and is
    never merged), and a Conv2D with the BiasAdd that alone reads it (GetConv2DOrBiasAdd), where the two have the
    same control inputs once Grappler's dependency optimizer has dropped those another input implies (the pass
    compares nothing else: no other path between them is looked for). ``GraphEditor.check_acyclic`` looks for
    cycles with them merged, which TensorFlow does not report: the step hangs (the zoo's custom_layer_loss and
    unet2d_transpose in 4 parts, docs/design.md 12)."""
    filters_of: dict[str, list[str]] = {}
    readers: dict[str, list[str]] = {}
    for node in editor.graph_def.node:
        inputs = editor.data_inputs(node)
        for _, ref in inputs:
            readers.setdefault(editor.resolve(ref)[0], []).append(node.name)
        if node.op in FILTER_GRADIENTS_MERGED and len(inputs) > 2:
            filters_of.setdefault(editor.resolve(inputs[2][1])[0], []).append(node.name)
    candidates: list[tuple[str, str]] = []  # (node merged into, node merged)
    for node in editor.graph_def.node:
        inputs = editor.data_inputs(node) if node.op in _MERGED_READERS else []
        source = editor.resolve(inputs[0][1])[0] if inputs else ""
        if node.op == "BiasAddGrad":
            candidates += [(name, node.name) for name in filters_of.get(source, [])[:1]]
        elif source in editor.nodes and (editor.nodes[source].op, node.op) in CHAIN_MERGES \
                and readers.get(source) == [node.name]:
            candidates.append((node.name, source))
    if not candidates:
        return {}
    ancestry = Ancestry(editor.graph_def)
    merged: dict[str, str] = {}
    for into, other in candidates:
        if into not in merged and other not in merged and \
                _kept_controls(editor, ancestry, into) == _kept_controls(editor, ancestry, other):
            merged[into] = merged[other] = into
    return merged


def _kept_controls(editor: Any, ancestry: Ancestry, name: str) -> set[str]:
    """The control inputs of ``name`` that Grappler's dependency optimizer keeps: those no other input depends on."""
    node = editor.nodes[name]
    sources = [parse_ref(ref.lstrip("^"))[0] for ref in node.input]
    controls = {parse_ref(ref[1:])[0] for ref in node.input if ref.startswith("^")}
    return {control for control in controls if sources.count(control) == 1
            and not any(ancestry.depends(other, control) for other in sources if other != control)}


def _siblings(editor: Any, first: str, second: str) -> bool:
    """Whether oneDNN's layout pass may merge ``first`` and ``second`` into one node: a filter gradient and
    the bias gradient reading the same gradient."""
    return fused_as_siblings(editor.nodes[first].op, editor.nodes[second].op) and bool(
        set(editor.sources(first, raw=False)) & set(editor.sources(second, raw=False)))


def chain_in_order(editor: Any, order: list[str], foldable: frozenset[str]) -> None:
    """Run the step in the order the simulator assumed: each op waits for the one before it and, past
    ops Grappler may remove (taking their control edges along), for every op back to one it keeps.

    Sibling partners next to each other (``partners_adjacent``) wait for the same ops instead, and the op
    after them for both: oneDNN's layout pass merges a filter gradient with its bias gradient only when
    their control inputs are equal, and left unmerged the step rounds otherwise than Keras' own."""
    since_kept: list[str] = []
    waits: dict[str, list[str]] = {}  # op -> the ops the chain made it wait for
    paired = False
    for before, after in zip(order, order[1:]):
        if not paired and not may_vanish(editor.nodes[before], editor.nodes, foldable):
            since_kept.clear()
        since_kept.append(before)
        paired = _siblings(editor, before, after)
        node = editor.nodes[after]
        waits[after] = []
        # what ``after`` reads or waits for already, built once per op (the chain past removable ops is long:
        # rebuilt per source it was quadratic, 155 s of DenseNet-121's 9 applies in a CLI run)
        present = set(node.input)
        read = {parse_ref(ref)[0] for ref in node.input}
        for source in (waits.get(before, []) if paired else since_kept):
            control = f"^{source}"
            if control not in present and source not in read:
                node.input.append(control)
                present.add(control)
                read.add(control)
                waits[after].append(source)
