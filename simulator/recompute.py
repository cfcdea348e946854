"""Recomputation beside swapping: the action record both the simulator and the rewriter read.

A tensor the backward pass reads far from where it was made may, instead of being kept or swapped,
be freed after its near readers and made again shortly before its far readers, by clones of the
(pure, cheap) ops that made it. The clones read their inputs (the recomputation's *sources*) as
ordinary tensors, so the swap plan can keep or swap those like any other tensor. See
``docs/design.md`` (recomputation) for the rules; the simulator models a recomputation as new ops in
the step's graph, the rewriter builds the same clones in the TF graph, under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass

CLONE_MARK = "/recompute_"


@dataclass(frozen=True)
class Recompute:
    """One recomputation, by name: the far reads of ``tensor`` are served by clones of ``ops``.

    ``ops`` lists the ops to clone, producers before readers; ``ops[-1]`` makes ``tensor``
    (``"op:output"``). Each clone reads the clone of an input's producer when that producer is in
    ``ops``, else the original tensor (a source). Every clone with no cloned input waits for
    ``trigger`` (a control edge), so the recomputation starts late, not beside its sources.
    ``consumers`` are the far readers, rewired from ``tensor`` to its clone.
    """

    tensor: str
    ops: tuple[str, ...]
    trigger: str
    consumers: tuple[str, ...]


def clone_name(op: str, index: int) -> str:
    """The clone of ``op`` made by the ``index``-th recomputation of a plan (same in TF and simulator)."""
    return f"{op}{CLONE_MARK}{index}"


def original_name(name: str) -> str:
    """The op a clone was made from (``name`` itself for an op that is not a clone)."""
    head, mark, tail = name.rpartition(CLONE_MARK)
    return head if mark and tail.isdigit() else name
