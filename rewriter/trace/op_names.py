"""Op names that belong to the model, not to the process that traced it.

Keras names a layer created without a name from a per-process counter (a model loaded twice in one
process has ``softmax`` and then ``softmax_1``), and TensorFlow makes every name scope unique in the
graph by appending ``_1``, ``_2``, ... depending on what was named before. A plan that names ops as
one trace spelled them is then "made for another model" in the next process. So the capture records
each op's canonical name beside its name (``graph.meta["canonical_names"]``, carried by plans): each
path segment without its trailing ``_<digits>``, and where that leaves two ops with one name, ``~1``,
``~2``, ... by the order the trace created them (``~`` is no character of a TensorFlow op name, so a
canonical name never meets a real one). Two copies of a model trace the same ops in the same order,
so they get the same canonical names, and ``rewriter.apply`` turns a plan's names into this trace's
through them (``traced_names``). Ops a graph rewrite adds (``<conv>/part0``) are named by their
longest traced prefix (``canonical``).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from typing import Iterable

from simulator.plan import NamedPlan, NamedSwap, NamedSwapIn
from simulator.recompute.actions import CLONE_MARK, Recompute

_SUFFIX = re.compile(r"(_\d+)+$")
DUPLICATE_MARK = "~"


def _stripped(name: str) -> str:
    return "/".join(_SUFFIX.sub("", segment) or segment for segment in name.split("/"))


def canonical_names(names: Iterable[str]) -> dict[str, str]:
    """Traced op name -> canonical name, for the ops of one trace in the order they were created."""
    seen: Counter[str] = Counter()
    mapping = {}
    for name in names:
        base = _stripped(name)
        mapping[name] = base if not seen[base] else f"{base}{DUPLICATE_MARK}{seen[base]}"
        seen[base] += 1
    return mapping


def _renamed(name: str, mapping: dict[str, str]) -> str:
    """``name`` (an op, "op:k", or a recomputation's clone) through ``mapping``: the longest mapped
    prefix of its path is replaced; a name with none is kept (an op inside a function body)."""
    if not mapping:
        return name
    op, colon, output = name.rpartition(":") if re.search(r":\d+$", name) else (name, "", "")
    if CLONE_MARK in op:
        base, mark, index = op.rpartition(CLONE_MARK)
        return _renamed(base, mapping) + mark + index + colon + output
    if op in mapping:
        return mapping[op] + colon + output
    prefix = op
    while "/" in prefix:
        prefix = prefix.rpartition("/")[0]
        if prefix in mapping:
            return mapping[prefix] + op[len(prefix):] + colon + output
    return name


def canonical(name: str, mapping: dict[str, str]) -> str:
    """A traced op or tensor name as the capture names it."""
    return _renamed(name, mapping)


def traced_names(plan: NamedPlan, mapping: dict[str, str]) -> NamedPlan:
    """``plan`` with the names of the trace ``mapping`` (traced name -> canonical name) was made on: each
    name to its canonical one by the plan's ``canonical_names``, and that to this trace's. A plan
    without them (written before they existed, or by hand) keeps its names."""
    given = plan.canonical_names
    if not given or not mapping:
        return plan
    back = {value: key for key, value in mapping.items()}

    def name(text: str | None) -> str | None:
        return None if text is None else _renamed(_renamed(text, given), back)

    swaps = tuple(NamedSwap(tensor=name(swap.tensor), bytes=swap.bytes, sync_out=swap.sync_out,
                            swap_ins=tuple(NamedSwapIn(consumers=tuple(name(c) for c in item.consumers),
                                                       trigger=name(item.trigger), after=name(item.after))
                                           for item in swap.swap_ins))
                  for swap in plan.swaps)
    recomputes = tuple(Recompute(tensor=name(action.tensor), ops=tuple(name(op) for op in action.ops),
                                 trigger=name(action.trigger), consumers=tuple(name(c) for c in action.consumers))
                       for action in plan.recomputes)
    splits = tuple(replace(region, ops=tuple(name(op) for op in region.ops)) for region in plan.splits)
    return replace(plan, swaps=swaps, recomputes=recomputes, splits=splits, order=tuple(name(op) for op in plan.order),
                   canonical_names={traced: mapping[traced] for traced in mapping})
