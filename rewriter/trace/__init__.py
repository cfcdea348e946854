"""Tracing the training step: the Keras or hand-written step traced once, its inputs and loss found, its ops
costed, exact graph rewrites applied, captured as a framework-free ``simulator.OpGraph``."""

from rewriter.trace.costs import tensor_nbytes
from rewriter.trace.graph_rewrites import REWRITES
from rewriter.trace.step_inputs import NO_STEP_INPUTS, StepInputs, check_input_shape_names, synthetic_batch
from rewriter.trace.replicas import Replicas, ReplicatedTrace, capture_replicated, resolve_replicas
from rewriter.trace.tracing import (TracedStep, capture, capture_step, import_step, rewrite_graph_def,
                                    trace_function_step, trace_keras_step)

__all__ = ["capture", "capture_replicated", "capture_step", "Replicas", "ReplicatedTrace", "resolve_replicas", "check_input_shape_names", "import_step", "NO_STEP_INPUTS",
    "rewrite_graph_def", "REWRITES", "StepInputs", "synthetic_batch", "tensor_nbytes", "trace_function_step",
    "trace_keras_step", "TracedStep"]
