"""Splitting ops along the batch (docs/design.md 12): which ops run exactly in parts (``classes``), the
graph that runs a region of them in parts (``actions``: ``with_splits``), and the floor of a step before
and after splitting the ops that set it (``floor``). The rewriter builds a plan's regions
(``rewriter.edit.split_parts``). The least overhead any plan of swaps, recomputations and splits can have
(``overhead_bound``) replays the step, so it sits above the device models and is imported by its path,
``simulator.split.overhead_bound``."""

from simulator.split.actions import (COMBINE_OP_TYPES, SPLIT_MARK, SplitRegion, held_regions, part_batches,
                                     read_split_records, split_origin, split_parts, split_records, split_regions,
                                     with_splits)
from simulator.split.classes import (BATCH_SUM, COMBINE_KINDS, ENDS, PER_SAMPLE, OpSplit, grow_region, op_split,
                                     splittable)
from simulator.split.floor import SplitFloor, floor_after_splitting

__all__ = ["BATCH_SUM", "COMBINE_KINDS", "COMBINE_OP_TYPES", "ENDS", "floor_after_splitting", "grow_region",
    "held_regions", "op_split", "OpSplit", "part_batches", "PER_SAMPLE", "read_split_records", "SPLIT_MARK",
    "split_origin", "split_parts", "split_records", "split_regions", "SplitFloor", "SplitRegion", "splittable",
    "with_splits"]
