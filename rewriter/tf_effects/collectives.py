"""What ``tf.distribute`` makes of a step: the strategy a Keras model was built under, and the collective ops a
replicated step all-reduces its gradients with (docs/design.md 14). ``MirroredStrategy``'s and
``MultiWorkerMirroredStrategy``'s steps are captured replicated (``rewriter.trace.replicas``); every other strategy,
and a hand-written loop around ``strategy.run``, is refused in one line. On the testbed the all-reduce writes its result into its input, the pack (no allocation
of its own: ``rewriter.trace.tracing.FORWARDING_TYPES``), and holds one ring chunk while it runs
(``scratch_bytes``)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from rewriter.errors import CaptureError

COLLECTIVE_TYPES = frozenset({"CollectiveReduceV2", "CollectiveReduce", "CollectiveReduceV3", "NcclAllReduce",
                              "CollectiveGatherV2", "CollectiveAllToAllV2"})
# tf.distribute.MultiWorkerMirroredStrategy is the class CollectiveAllReduceStrategy
REPLICATED_STRATEGIES = ("MirroredStrategy", "CollectiveAllReduceStrategy")


def strategy_of(model):
    """The ``tf.distribute`` strategy ``model`` was built under (Keras' own record of it), else None."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    return strategy


def unsupported(strategy) -> str | None:
    """Why a model built under ``strategy`` cannot be captured replicated (None: it can)."""
    kind = type(strategy).__name__
    if kind in REPLICATED_STRATEGIES:
        return None
    return (f"tf.distribute.{kind} is not supported: only MirroredStrategy's and MultiWorkerMirroredStrategy's "
            "replicated steps are captured and trained with a plan (TPUStrategy and ParameterServerStrategy are not)")


def refuse_collectives(graph) -> None:
    """A hand-written step that all-reduces across devices (a custom loop around ``strategy.run``) is refused."""
    found = sorted({op.type for op in graph.get_operations() if op.type in COLLECTIVE_TYPES})
    if found:
        raise CaptureError(f"the step function all-reduces across devices ({', '.join(found)}): a custom training "
                           "loop around strategy.run is not captured; build the Keras model in "
                           "MirroredStrategy.scope() and use rewriter.capture_replicated (docs/design.md 14)")


def scratch_bytes(op) -> int:
    """The scratch an all-reduce holds on its device while it runs: one ring chunk, the pack over the group's
    size (``CollectiveAdapterImpl::TempChunk``: 5,257,168 and 5,257,280 bytes for a pack of 10,514,448 over two
    replicas, the chunks aligned); 0 for other ops, or a group size the graph does not state."""
    if op.type not in ("CollectiveReduceV2", "CollectiveReduceV3") or len(op.inputs) < 2:
        return 0
    try:
        group = int(np.asarray(tensor_util.constant_value(op.inputs[1])).reshape(-1)[0])
    except (TypeError, ValueError, IndexError):
        return 0
    shape = op.outputs[0].shape
    if group < 2 or not shape.is_fully_defined():
        return 0
    return int(shape.num_elements() * op.outputs[0].dtype.size // group)
