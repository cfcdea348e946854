"""Editing the step's GraphDef: swap nodes added, reads rewired, recomputations cloned, the step chained in
the plan's order."""

from rewriter.edit.chain_order import partners_adjacent
from rewriter.edit.graph_edit import SWAP_OPS, AppliedSwap, AppliedSwapIn, GraphEditor, SkippedSwap, edit_graph_def
from rewriter.edit.graph_refs import Ancestry, parse_ref
from rewriter.edit.recompute_clones import (CLONE_ATTR, KEEP_ATTR, AppliedRecompute, apply_recomputes,
                                            clone_tensor_info, unclonable_reason)
