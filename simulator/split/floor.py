"""The floor of a step before and after splitting the ops that set it (docs/design.md 12).

Swaps and recomputations move whole tensors, so no plan's peak goes under the *floor*: resident
memory plus the largest working set of one op, its inputs and outputs together
(``simulator.buffers.peak_lower_bound_bytes``). Splitting that op, with the ops around it, into
parts along the batch leaves each part a share of that working set, and the floor is then set by
another op, by a region's combine or boundary, or by what does not grow with the batch.
``floor_after_splitting`` splits regions until the op that sets the floor cannot be split further.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.buffers import largest_working_set_op, peak_lower_bound_bytes
from simulator.graph import OpGraph
from simulator.split.actions import SplitRegion, split_origin, with_splits
from simulator.split.classes import grow_region

MAX_REGIONS = 64  # a step whose floor keeps moving to new regions past this many is left there


@dataclass(frozen=True)
class SplitFloor:
    """The floor of ``graph``'s step before (``floor_bytes``) and after (``split_floor_bytes``)
    splitting ``regions`` in ``parts`` parts (``split_graph``, ``graph`` itself with no region);
    ``binding_op``: the op of the split graph whose working set sets the floor after, ``stop_reason`` why
    splitting went no further, and ``ends``: the ops where the regions end, each with why it cannot be split."""

    parts: int
    floor_bytes: int
    split_floor_bytes: int
    regions: tuple[SplitRegion, ...]
    binding_op: str
    stop_reason: str
    split_graph: OpGraph
    ends: tuple[tuple[str, str], ...] = ()

    @property
    def region_ops(self) -> int:
        return sum(len(region.ops) for region in self.regions)


def floor_after_splitting(g: OpGraph, parts: int) -> SplitFloor:
    """Split the op that sets ``g``'s floor, with every op reached from it over tensors that grow
    with the batch through ops that can be split (``grow_region``), in ``parts`` parts; repeat
    while the floor of the split graph is set by an op of the captured step not split yet that can
    be. The regions are kept only while each lowers the floor."""
    floor = peak_lower_bound_bytes(g)
    regions: list[SplitRegion] = []
    split: set[int] = set()
    ends: dict[str, str] = {}
    current, current_floor = g, floor
    op_index = g.op_index()
    reason = ""
    for _ in range(MAX_REGIONS):
        binding = str(current.op_name[largest_working_set_op(current)])
        origin = op_index[split_origin(binding)]
        if origin in split:
            reason = f"the floor is set by {binding}, a part of a split region"
            break
        region, found_ends = grow_region(g, origin, frozenset(split))
        if not region:
            reason = f"the floor is set by {binding}, which cannot run in parts: {found_ends[origin]}"
            break
        candidate = regions + [SplitRegion(tuple(str(g.op_name[op]) for op in region), parts)]
        trial = with_splits(g, candidate)
        trial_floor = peak_lower_bound_bytes(trial)
        if trial_floor >= current_floor:
            reason = (f"splitting the {len(region)} ops around {binding} in {parts} parts does not lower the floor "
                      f"({trial_floor} B against {current_floor} B)")
            break
        regions, current, current_floor = candidate, trial, trial_floor
        split.update(region)
        ends.update({str(g.op_name[op]): why for op, why in found_ends.items()})
    else:
        reason = f"stopped after {MAX_REGIONS} regions"
    return SplitFloor(parts=parts, floor_bytes=floor, split_floor_bytes=current_floor, regions=tuple(regions),
                      binding_op=str(current.op_name[largest_working_set_op(current)]), stop_reason=reason,
                      split_graph=current, ends=tuple(ends.items()))
