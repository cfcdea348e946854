"""Editing the step's GraphDef: swap nodes added, reads rewired, recomputations cloned, regions split along the
batch, the step chained in the plan's order."""

from rewriter.edit.chain_order import partners_adjacent
from rewriter.edit.graph_edit import SWAP_OPS, AppliedSwap, AppliedSwapIn, GraphEditor, SkippedSwap, edit_graph_def
from rewriter.edit.graph_refs import Ancestry, parse_ref
from rewriter.edit.recompute_clones import (CLONE_ATTR, KEEP_ATTR, AppliedRecompute, apply_recomputes,
                                            clone_tensor_info, unclonable_reason)
from rewriter.edit.split_parts import SPLIT_ATTR, AppliedSplit, BatchShapes, apply_splits, check_part_shapes

__all__ = ["Ancestry", "AppliedRecompute", "AppliedSplit", "AppliedSwap", "AppliedSwapIn", "apply_recomputes",
    "apply_splits", "BatchShapes", "check_part_shapes", "CLONE_ATTR", "clone_tensor_info", "edit_graph_def",
    "GraphEditor", "KEEP_ATTR", "parse_ref", "partners_adjacent", "SkippedSwap", "SPLIT_ATTR", "SWAP_OPS",
    "unclonable_reason"]
