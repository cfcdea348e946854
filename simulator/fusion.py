"""Ops a graph compiler may fuse with a swap-in's consumer, which a swap-in therefore cannot wait for.

TF's graph passes fuse chains of ops (oneDNN's layout pass: Conv2D+BiasAdd, Pad+Conv2D,
Conv2DBackpropFilter+BiasAddGrad; Grappler's remapper: contraction+bias(+add)(+activation),
FusedBatchNorm+activation, Sigmoid+Mul). A fused node takes over the control edges of its parts, so
a control edge from one part to a swap-in that feeds a later part would become a cycle. The rewriter
(``rewriter.apply``) therefore makes such a swap-in wait for the inputs of that part instead: it
starts one op or so earlier than the plan says, with its buffer live during that op. The replay
applies the same rule (``safe_wait_slots``) so that it predicts the step the rewriter builds (a
replay without it under-predicted a measured peak by 11.6 %). Both walk the same neighbourhood
(``fusion_neighbourhood``); the rule errs on the side of fusion, which costs memory, never a cycle,
but where it names a fusion no pass makes (it once took the 3D U-Net's sum of two convolution
halves for one) the swap-in comes back early for nothing and the largest size that fits shrinks.

Plain arrays only (no TensorFlow): the rewriter imports the walk and the type lists from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import numpy as np

from simulator import kernels
from simulator.graph import OpGraph
from simulator.ordering import position_of

_ACTIVATIONS = frozenset({"Relu", "Relu6", "Elu", "LeakyRelu", "Selu", "Tanh", "Sigmoid", "Softplus", "Gelu"})
_CONTRACTIONS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul", "BatchMatMul", "BatchMatMulV2",
                           "BatchMatMulV3"})
_ADDS = frozenset({"Add", "AddV2", "AddN"})
# A fused chain runs through these stages in order: Pad -> contraction or batch norm -> BiasAdd -> add
# -> activation (and Sigmoid -> Mul); an op can only be fused into a later stage (or an add into an
# add: Grappler merges add trees), so a contraction reading a contraction is never one chain.
_STAGE = {**dict.fromkeys(("Pad", "MirrorPad"), 0), **dict.fromkeys(_CONTRACTIONS, 1),
          **dict.fromkeys(("FusedBatchNorm", "FusedBatchNormV3"), 1), **dict.fromkeys(("BiasAdd", "BiasAddV1"), 2),
          **dict.fromkeys(_ADDS, 3), **dict.fromkeys(_ACTIVATIONS, 4)}
CHAIN_TAILS = frozenset(set(_STAGE) - {"Pad", "MirrorPad"} | {"Mul"})  # ops that can end (or sit inside) a chain
_NOT_FUSED = -2  # safe_wait_slots' memo: no wait of the swap-in is in danger
FUSION_HOPS = 4  # data edges upstream of a chain tail that may belong to its chain (Pad->Conv->Bias->Add->Relu)


def may_fuse_into(part: str, tail: str, tail_sources: Iterable[str] = ()) -> bool:
    """Whether an op of type ``part`` whose output ``tail`` reads may be fused into it
    (``tail_sources``: the types of the ops ``tail`` reads).

    A contraction goes straight into an add only as its bias add (an Add/AddV2 with a bias operand:
    Keras 3 adds biases that way); an add of two contractions' outputs is none, and counting it
    fusable brought one half of the 3D U-Net's split convolution back during the other: three
    full-resolution maps at once where the plan has two.
    """
    if tail == "Mul":
        return part == "Sigmoid"  # swish
    if part in _ACTIVATIONS or part not in _STAGE or tail not in _STAGE:
        return False
    if part in _CONTRACTIONS and tail in _ADDS and sum(kind in _CONTRACTIONS for kind in tail_sources) > 1:
        return False
    return _STAGE[part] < _STAGE[tail] or (part in _ADDS and tail in _ADDS)


# ops fused with another reader of the same input: a filter gradient with the bias gradient
SIBLING_FUSIONS = frozenset({"Conv2DBackpropFilter", "Conv3DBackpropFilterV2", "DepthwiseConv2dNativeBackpropFilter",
                             "BiasAddGrad"})


def fused_as_siblings(kind: str, other: str) -> bool:
    """Whether readers of one input of these two types may be fused (two filter gradients never are:
    the 3D U-Net's split convolution has two on one gradient, and treating them as fusable made a
    swap-in start one op early, which the replay then over-counted by 16 MiB)."""
    return kind in SIBLING_FUSIONS and other in SIBLING_FUSIONS and (kind == "BiasAddGrad") != (other == "BiasAddGrad")


Op = TypeVar("Op", int, str)


def fusion_neighbourhood(consumer: Op, op_type: Callable[[Op], str], sources: Callable[[Op], Sequence[Op]],
                         readers: Callable[[Op], Iterable[Op]]) -> set[Op]:
    """Ops a graph pass might fuse with ``consumer``: chain parts up to FUSION_HOPS data edges
    upstream (when it can end a chain), and sibling fusions on a shared input. One walk for both
    graph forms: the replay's op indices and the rewriter's GraphDef node names."""
    danger: set[Op] = set()
    kind = op_type(consumer)
    if kind in CHAIN_TAILS:
        frontier = [consumer]
        for _ in range(FUSION_HOPS):
            upper = []
            for op in frontier:
                found = sources(op)
                types = [op_type(source) for source in found]
                for source, source_type in zip(found, types):
                    if source not in danger and may_fuse_into(source_type, op_type(op), types):
                        danger.add(source)
                        upper.append(source)
            frontier = upper
    if kind in SIBLING_FUSIONS:
        for source in sources(consumer):
            for sibling in readers(source):
                if sibling != consumer and fused_as_siblings(kind, op_type(sibling)):
                    danger.add(sibling)
    return danger


class _Neighbourhoods:
    """Per-graph index: each op's data sources and each op's readers, and the fusion neighbourhoods
    already computed (structural: shared by every replay of the graph)."""

    def __init__(self, g: OpGraph):
        producer = g.tensor_producer[g.edge_tensor]
        self.sources: list[list[int]] = [[] for _ in range(g.n_ops)]
        self.readers: list[list[int]] = [[] for _ in range(g.n_ops)]
        self.inputs: list[list[tuple[int, int]]] = [[] for _ in range(g.n_ops)]  # (tensor, producer)
        self.controls: list[list[int]] = [[] for _ in range(g.n_ops)]
        for tensor, source, consumer in zip(g.edge_tensor.tolist(), producer.tolist(), g.edge_consumer.tolist()):
            self.inputs[consumer].append((tensor, source))
            if source not in self.sources[consumer]:
                self.sources[consumer].append(source)
            if consumer not in self.readers[source]:
                self.readers[source].append(consumer)
        for source, consumer in zip(g.control_src.tolist(), g.control_dst.tolist()):
            self.controls[consumer].append(source)
        self.op_type = g.op_type.tolist()
        self._danger: dict[int, frozenset[int]] = {}
        # safe_wait_slots' answer per swap-in key (tensor, trigger, after, readers): _NOT_FUSED (no
        # fused wait) or the slot it waits for instead (-1: none); slots are fixed, as this index is
        # per execution order. Also as sorted rows (kernels.memo_rows) for the compiled look-up.
        self.safe_memo: dict[tuple, int] = {}
        self.clear_memo()

    def clear_memo(self) -> None:
        self.safe_memo.clear()
        self.safe_rows = np.zeros((0, 4 + kernels.MEMO_READS), np.int64)
        self.safe_answers = np.zeros(0, np.int64)
        self._pending_rows: list[np.ndarray] = []
        self._pending_answers: list[np.ndarray] = []
        self._n_pending = 0

    def remember(self, rows: np.ndarray, answers: np.ndarray) -> None:
        """Add memo rows (those holding all their readers; the dict has them all). They join the
        sorted rows once a quarter as many are waiting (found in the dict meanwhile), so a long
        search re-sorts the memo a logarithmic number of times, not at every new key."""
        whole = rows[:, 3] <= kernels.MEMO_READS
        self._pending_rows.append(rows[whole])
        self._pending_answers.append(answers[whole])
        self._n_pending += int(whole.sum())
        if self._n_pending < max(64, len(self.safe_rows) // 4):
            return
        all_rows = np.concatenate([self.safe_rows, *self._pending_rows])
        all_answers = np.concatenate([self.safe_answers, *self._pending_answers])
        self._pending_rows, self._pending_answers, self._n_pending = [], [], 0
        order = np.lexsort(all_rows.T[::-1])
        keep = np.ones(len(order), bool)  # one row per key (a batch may repeat a key)
        keep[1:] = np.any(all_rows[order][1:] != all_rows[order][:-1], axis=1)
        self.safe_rows = np.ascontiguousarray(all_rows[order][keep])
        self.safe_answers = all_answers[order][keep]

    def danger(self, consumer: int) -> frozenset[int]:
        """``fusion_neighbourhood`` of ``consumer``, computed once per graph."""
        found = self._danger.get(consumer)
        if found is not None:
            return found
        danger = fusion_neighbourhood(consumer, self.op_type.__getitem__, self.sources.__getitem__,
                                      self.readers.__getitem__)
        self._danger[consumer] = result = frozenset(danger)
        return result

    def safe(self, waits: list[int], danger: set[int] | frozenset[int]) -> list[int]:
        """``waits`` with every op in ``danger`` replaced by its own sources (repeatedly)."""
        result, pending, seen = [], list(waits), set()
        while pending:
            op = pending.pop()
            if op in seen:
                continue
            seen.add(op)
            if op in danger:
                pending.extend(self.sources[op])
            else:
                result.append(op)
        return result


def _neighbourhoods(g: OpGraph) -> _Neighbourhoods:
    return g.cached("fusion_neighbourhoods", _Neighbourhoods, structural=True)


def _fusable_ops(g: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """(ops with a non-empty fusion neighbourhood, ops inside some op's neighbourhood): the filter
    that keeps the per-swap-in work of ``safe_wait_slots`` to the few swap-ins it can concern."""
    def compute(graph: OpGraph) -> tuple[np.ndarray, np.ndarray]:
        index = _neighbourhoods(graph)
        has_danger = np.zeros(graph.n_ops, bool)
        endangered = np.zeros(graph.n_ops, bool)
        takers = np.isin(graph.op_type, list(CHAIN_TAILS | SIBLING_FUSIONS))
        for op in np.flatnonzero(takers).tolist():
            danger = index.danger(op)
            if danger:
                has_danger[op] = True
                endangered[list(danger)] = True
        return has_danger, endangered
    return g.cached("fusable_ops", compute, structural=True)


def safe_wait_slots(g: OpGraph, tensor: np.ndarray, trigger: np.ndarray, after: np.ndarray,
                    consumer_ptr: np.ndarray, consumers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per swap-in of ``tensor[j]`` (a SwapPlan's in_trigger/in_after/in_consumer_ptr/in_consumers
    arrays): whether an op it waits for may be fused with one of its consumers, and if so the latest
    slot among the ops the rewriter has it wait for instead (-1: none, it waits for nothing).

    As the rewriter: a triggered swap-in waits for its trigger, a synchronous one for its first
    consumer's other inputs and control predecessors; both also for ``after`` unless that op made the
    tensor.
    """
    n = len(tensor)
    changed = np.zeros(n, bool)
    slots = np.full(n, -1, dtype=np.int64)
    if not n:
        return changed, slots
    has_danger, endangered = _fusable_ops(g)
    dangerous = has_danger[consumers]
    if not dangerous.any():  # no reader in any fusion neighbourhood (graphs without fusable chains)
        return changed, slots
    near = np.logical_or.reduceat(dangerous, consumer_ptr[:-1])
    # a triggered swap-in is concerned only if its trigger or `after` is in some neighbourhood
    waits_endangered = endangered[np.maximum(trigger, 0)] | endangered[np.maximum(after, 0)]
    candidates = np.flatnonzero(near & ((trigger < 0) | waits_endangered))
    if not len(candidates):
        return changed, slots
    index = _neighbourhoods(g)
    if len(index.safe_memo) > 200_000:  # a long search: keep the memo's memory bounded
        index.clear_memo()
    # the memo looked up for all candidates at once (compiled); the few it lacks are worked out here
    rows = kernels.memo_rows(candidates, tensor, trigger, after, consumer_ptr, consumers)
    answers = kernels.memo_lookup(rows, index.safe_rows, index.safe_answers)
    missing = np.flatnonzero(answers == kernels.MEMO_MISSING)
    if len(missing):
        reads = consumers.tolist()
        bounds = consumer_ptr.tolist()
        new: list[int] = []  # keys met for the first time
        for c in missing.tolist():
            j = int(candidates[c])
            key = (int(tensor[j]), int(trigger[j]), int(after[j]), tuple(reads[bounds[j]:bounds[j + 1]]))
            answer = index.safe_memo.get(key)
            if answer is None:
                waits = _safe_waits(index, key, int(g.tensor_producer[key[0]]), reads[bounds[j]])
                answer = index.safe_memo[key] = (_NOT_FUSED if waits is False
                                                 else int(position_of(g)[list(waits)].max()) if waits else -1)
                new.append(c)
            answers[c] = answer
        if new:
            index.remember(rows[new], answers[new])
    fused = answers != _NOT_FUSED
    changed[candidates[fused]] = True
    slots[candidates[fused]] = answers[fused]
    return changed, slots


def _safe_waits(index: _Neighbourhoods, key: tuple, made_by: int, first: int) -> tuple[int, ...] | bool:
    """The ops one swap-in really waits for, or False when none of its waits is in danger."""
    tensor, trigger, after, readers = key
    if trigger >= 0:
        waits = [trigger]
    else:
        waits = [source for t, source in index.inputs[first] if t != tensor] + index.controls[first]
    if after >= 0 and after != made_by:
        waits.append(after)
    danger: set[int] = set()
    for consumer in readers:
        danger |= index.danger(consumer)
    if not danger.intersection(waits):
        return False
    return tuple(index.safe(waits, danger))
