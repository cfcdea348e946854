"""The rewritten training step: built from a plan, run, trained with through ``model.fit``, and the GraphDef a
GPU would run, built without one."""

from rewriter.step.apply_plan import apply
from rewriter.step.gpu_graph import (jit_compile_note, optimize_for_gpu, replica_placement_problems,
                                     replicated_gpu_graph_def, rewritten_graph_def)
from rewriter.step.keras_fit import KerasStep, restore_train_function, swap_step_of, swapping, use_swap_step
from rewriter.step.replicated import ReplicatedStep, apply_replicated, use_replicated_step
from rewriter.step.swap_step import StateSnapshot, SwapStep

__all__ = ["apply", "apply_replicated", "ReplicatedStep", "use_replicated_step", "replicated_gpu_graph_def",
    "replica_placement_problems", "jit_compile_note", "KerasStep", "optimize_for_gpu", "restore_train_function",
    "rewritten_graph_def", "StateSnapshot", "swap_step_of", "swapping", "SwapStep", "use_swap_step"]
