"""Recomputation beside swapping (docs/design.md 9): the action record and the graph that holds it
(``actions``), and the choice of which tensors to recompute (``choice``). The record sits below the replay
(device models and the plan read it), the choice above it (it replays candidates), so only the record is
re-exported here and the choice is imported by its path, ``simulator.recompute.choice``."""

from simulator.recompute.actions import (CLONE_MARK, NEVER_RECOMPUTED, RECOMPUTE_CLASSES, RECOMPUTE_SCOPES, Recompute,
                                         clone_name, original_levels, original_name, recomputed_tensors,
                                         with_recomputes)

__all__ = ["CLONE_MARK", "clone_name", "NEVER_RECOMPUTED", "original_levels", "original_name", "Recompute",
    "RECOMPUTE_CLASSES", "RECOMPUTE_SCOPES", "recomputed_tensors", "with_recomputes"]
