"""Ops a graph compiler may fuse with a swap-in's consumer, which a swap-in therefore cannot wait for.

TF's graph passes fuse chains of ops (oneDNN's layout pass: Conv2D+BiasAdd, Pad+Conv2D,
Conv2DBackpropFilter+BiasAddGrad; Grappler's remapper: contraction+bias(+add)(+activation),
FusedBatchNorm+activation, Sigmoid+Mul). A fused node takes over the control edges of its parts, so
a control edge from one part to a swap-in that feeds a later part would become a cycle. The rewriter
(``rewriter.step.apply_plan``) therefore makes such a swap-in wait for the inputs of that part instead: it
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
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from simulator import kernels
from simulator.graph import OpGraph
from simulator.kernels.records import FusionRecord
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
# the operand of a chain op that a wait can come through without leaving the chain unfused (an Identity that waits
# for a copy out, rewriter.edit.graph_edit): a contraction's second operand, a bias add's bias
WAIT_OPERANDS = {**dict.fromkeys(_CONTRACTIONS, 1), "BiasAdd": 1, "BiasAddV1": 1}
CHAIN_TAILS = frozenset(set(_STAGE) - {"Pad", "MirrorPad"} | {"Mul"})  # ops that can end (or sit inside) a chain
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


def in_fused_chain(op: Op, op_type: Callable[[Op], str], sources: Callable[[Op], Sequence[Op]],
                   readers: Callable[[Op], Iterable[Op]]) -> bool:
    """Whether a graph pass might fuse ``op`` with an op it reads or one that reads it (the replay's
    ``FusionTables.has_danger | endangered``). Grappler's remapper fuses a chain (contraction+bias,
    Sigmoid+Mul into oneDNN's swish) only when its parts have no control edges, so a wait placed on such
    an op leaves the chain unfused and the step rounds differently from the plain one: the copy out
    the testbed makes an op wait for (``rewriter.edit.graph_edit``) is waited for through an operand outside
    the chain (``WAIT_OPERANDS``) or past the chain (EfficientNetB0: 16 Conv2D+BiasAdd, 1 MatMul+BiasAdd and
    33 swish fusions were lost with the wait on the chain itself)."""
    if fusion_neighbourhood(op, op_type, sources, readers):
        return True
    return any(op in fusion_neighbourhood(reader, op_type, sources, readers) for reader in readers(op))


class _Neighbourhoods:
    """Per-graph index: each op's data sources, readers, inputs and control predecessors, and the
    fusion neighbourhoods already computed (the walk's input for ``fusion_tables``)."""

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

    def danger(self, consumer: int) -> frozenset[int]:
        """``fusion_neighbourhood`` of ``consumer``, computed once per graph."""
        found = self._danger.get(consumer)
        if found is not None:
            return found
        danger = fusion_neighbourhood(consumer, self.op_type.__getitem__, self.sources.__getitem__,
                                      self.readers.__getitem__)
        self._danger[consumer] = result = frozenset(danger)
        return result


def _neighbourhoods(g: OpGraph) -> _Neighbourhoods:
    return g.cached("fusion_neighbourhoods", _Neighbourhoods, structural=True)


# (part, tail) fusions whose tail must read the very tensor the part reads: swish is Mul(x, Sigmoid(x))
SHARED_INPUT_FUSIONS = frozenset({("Sigmoid", "Mul")})


def fused_shared_reads(g: OpGraph) -> np.ndarray:
    """Per data edge of ``g``: a read by a chain tail of a tensor that a part fused into it reads too
    (swish's Mul reading x beside its Sigmoid). Moved to a swap-in, the two read different tensors and
    oneDNN's swish is not formed (EfficientNetB0 with a threshold of one level: 33 of 49 swishes lost),
    so the planner keeps such reads on the device."""
    def compute(graph: OpGraph) -> np.ndarray:
        index = _neighbourhoods(graph)
        shared = np.zeros(len(graph.edge_tensor), bool)
        tails = {tail for _, tail in SHARED_INPUT_FUSIONS}
        for edge, (tensor, consumer) in enumerate(zip(graph.edge_tensor.tolist(), graph.edge_consumer.tolist())):
            kind = index.op_type[consumer]
            if kind not in tails:
                continue
            shared[edge] = any((index.op_type[part], kind) in SHARED_INPUT_FUSIONS
                               and any(read == tensor for read, _ in index.inputs[part])
                               for part in index.danger(consumer))
        return shared
    return g.cached("fused_shared_reads", compute, structural=True)


def sibling_partners(g: OpGraph) -> tuple[tuple[int, ...], ...]:
    """Per op: the ops a graph pass may merge it with as siblings (``fused_as_siblings``: a filter gradient and
    the bias gradient of one gradient). Merged, the two take over each other's edges, so a wait that depends on
    one of them, placed before the other, closes a cycle TensorFlow does not report: the zoo's custom_layer_loss
    split in 4 parts hung in its first call on a swap-in into a filter gradient's part started by the running
    combine of the bias gradient's parts (docs/design.md 12). Triggers therefore depend on neither
    (``planning.sibling_bounds``)."""
    def compute(graph: OpGraph) -> tuple[tuple[int, ...], ...]:
        index = _neighbourhoods(graph)
        partners: list[tuple[int, ...]] = [()] * graph.n_ops
        for op in np.flatnonzero(np.isin(graph.op_type, list(SIBLING_FUSIONS))).tolist():
            kind = index.op_type[op]
            partners[op] = tuple(sorted(other for other in index.danger(op)
                                        if fused_as_siblings(kind, index.op_type[other])))
        return tuple(partners)
    return g.cached("sibling_partners", compute, structural=True)


# a contraction oneDNN's layout pass merges with the bias add that alone reads it (mkl_layout_pass.cc's
# GetConv2DOrBiasAdd), in the simulator (``merge_partners``) and the rewriter's check (``chain_order.merged_pairs``)
CHAIN_MERGES = frozenset({("Conv2D", "BiasAdd")})


def merge_partners(g: OpGraph) -> tuple[tuple[int, ...], ...]:
    """Per op: the ops a graph pass may merge it with into one node: its sibling partners (``sibling_partners``)
    and, for a contraction of ``CHAIN_MERGES``, the bias add that alone reads it (and the reverse). A merged node
    runs where its later part does, so a trigger that is one part of such a pair starts its swap-in only then
    (``planning.merge_end_positions``)."""
    def compute(graph: OpGraph) -> tuple[tuple[int, ...], ...]:
        index = _neighbourhoods(graph)
        partners = [set(siblings) for siblings in sibling_partners(graph)]
        for op, kind in enumerate(index.op_type):
            readers = index.readers[op]
            if len(readers) == 1 and (kind, index.op_type[readers[0]]) in CHAIN_MERGES:
                partners[op].add(readers[0])
                partners[readers[0]].add(op)
        return tuple(tuple(sorted(found)) for found in partners)
    return g.cached("merge_partners", compute, structural=True)


def _csr(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists per op as (pointer, values) arrays."""
    ptr = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(row) for row in rows], out=ptr[1:])
    return ptr, np.fromiter((value for row in rows for value in row), np.int64, int(ptr[-1]))


@dataclass(frozen=True)
class FusionTables:
    """The fusion neighbourhoods and the edges ``safe_wait_slots`` walks, as arrays for the compiled
    walk (``kernels.safe_wait_slots``): per op, whether its neighbourhood is non-empty
    (``has_danger``) and whether it lies in some op's (``endangered``); CSR per op (``*_ptr``) of
    its neighbourhood, its data sources (each once), its inputs (tensor, producer: one per edge) and
    its control predecessors. Structural: built once per graph and order."""

    has_danger: np.ndarray
    endangered: np.ndarray
    danger_ptr: np.ndarray
    danger_ops: np.ndarray
    source_ptr: np.ndarray
    source_ops: np.ndarray
    input_ptr: np.ndarray
    input_tensor: np.ndarray
    input_source: np.ndarray
    control_ptr: np.ndarray
    control_ops: np.ndarray
    wait_operand: np.ndarray  # per op, whether a wait can come through one of its operands (WAIT_OPERANDS)



def fusion_tables(g: OpGraph) -> FusionTables:
    """``FusionTables`` of ``g``."""
    def compute(graph: OpGraph) -> FusionTables:
        index = _neighbourhoods(graph)
        dangers: list[list[int]] = [[] for _ in range(graph.n_ops)]
        takers = np.isin(graph.op_type, list(CHAIN_TAILS | SIBLING_FUSIONS))
        for op in np.flatnonzero(takers).tolist():
            dangers[op] = sorted(index.danger(op))
        has_danger = np.asarray([bool(danger) for danger in dangers], bool).reshape(graph.n_ops)
        danger_ptr, danger_ops = _csr(dangers)
        endangered = np.zeros(graph.n_ops, bool)
        endangered[danger_ops] = True
        source_ptr, source_ops = _csr(index.sources)
        input_ptr, input_tensor = _csr([[tensor for tensor, _ in inputs] for inputs in index.inputs])
        _, input_source = _csr([[source for _, source in inputs] for inputs in index.inputs])
        control_ptr, control_ops = _csr(index.controls)
        wait_operand = np.isin(graph.op_type, list(WAIT_OPERANDS)).reshape(graph.n_ops)
        return FusionTables(has_danger, endangered, danger_ptr, danger_ops, source_ptr, source_ops, input_ptr,
                            input_tensor, input_source, control_ptr, control_ops, wait_operand)
    return g.cached("fusion_tables", compute, structural=True)


def fusion_record(g: OpGraph) -> FusionRecord:
    """``FusionTables`` of ``g`` as the compiled walk takes them (``kernels.safe_wait_slots``, the replay's)."""
    def compute(graph: OpGraph) -> FusionRecord:
        tables = fusion_tables(graph)
        return FusionRecord(position=position_of(graph), tensor_producer=graph.tensor_producer,
                            **{name: getattr(tables, name) for name in tables.__dataclass_fields__})
    return g.cached("fusion_record", compute, structural=True)


def safe_wait_slots(g: OpGraph, tensor: np.ndarray, trigger: np.ndarray, after: np.ndarray,
                    consumer_ptr: np.ndarray, consumers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per swap-in of ``tensor[j]`` (a SwapPlan's in_trigger/in_after/in_consumer_ptr/in_consumers
    arrays): whether an op it waits for may be fused with one of its consumers, and if so the latest
    slot among the ops the rewriter has it wait for instead (-1: none, it waits for nothing).

    As the rewriter: a triggered swap-in waits for its trigger, a synchronous one for its first
    consumer's other inputs and control predecessors; both also for ``after`` unless that op made the
    tensor; each of them inside a consumer's fusion neighbourhood is replaced by its own sources,
    repeatedly. Compiled (``kernels.safe_wait_slots``); the replay calls the same walk.
    """
    return kernels.safe_wait_slots(fusion_record(g), np.asarray(tensor, np.int64), np.asarray(trigger, np.int64),
                                   np.asarray(after, np.int64), np.asarray(consumer_ptr, np.int64),
                                   np.asarray(consumers, np.int64))
