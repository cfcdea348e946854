"""The TensorFlow side of the tool: capture a training step, apply a swap plan, verify, measure, train.

    import rewriter
    g = rewriter.capture(model, batch_size=8)                 # -> simulator.OpGraph
    step = rewriter.apply(model, plan, graph=g, batch_size=8)  # -> SwapStep, step(x, y) -> loss
    step.verification                                          # what survived Grappler
    rewriter.measure(step, x, y)                               # peak bytes, step seconds
    rewriter.use_swap_step(model, step); model.fit(...)        # train with it
    rewriter.rewritten_graph_def(model, plan, graph=g, batch_size=8,
                                 placement=rewriter.GpuPlacement())  # what a GPU would run, without one
    device = rewriter.calibrate(model, batch_sizes=(2, 4))    # -> simulator.CalibratedDevice (step times)

The rooms, in the order they may import each other: ``tf_effects`` (what TensorFlow does beyond the graph),
``trace``, ``placement``, ``edit`` (the GraphDef edit), ``check`` (what survived), ``step`` (the rewritten step and
``model.fit``), ``timing`` (calibration and measurement); ``errors`` and ``environment`` beside them.

The CPU testbed (two logical CPUs) must be configured before TensorFlow initialises:
``rewriter.configure_testbed()`` first thing in the process, or the single-device testbed is used.
``import rewriter`` before TensorFlow also sets the environment the testbed needs
(``rewriter.environment``); imported after it, measurements warn about what missed.
"""

from rewriter.environment import prepare_environment

prepare_environment()  # before the modules below import TensorFlow

from rewriter.errors import CaptureError  # noqa: E402
from rewriter.check import Verification, verify  # noqa: E402
from rewriter.placement import CpuTestbedPlacement, GpuPlacement, Placement, configure_testbed, detect  # noqa: E402
from rewriter.step import (KerasStep, StateSnapshot, SwapStep, apply, restore_train_function,  # noqa: E402
                           rewritten_graph_def, swap_step_of, swapping, use_swap_step)
from rewriter.timing import CalibrationError, Measurement, calibrate, measure  # noqa: E402
from rewriter.trace import capture, capture_step, trace_function_step, trace_keras_step  # noqa: E402
from rewriter.trace.step_inputs import StepInputs  # noqa: E402
from simulator.plan import PlanError, load_plan  # noqa: E402 -- the plan's one reader and error

__all__ = [
    "CalibrationError", "CaptureError", "CpuTestbedPlacement", "GpuPlacement", "KerasStep", "Measurement", "Placement", "PlanError", "StateSnapshot", "StepInputs",
    "SwapStep", "Verification", "apply", "calibrate", "capture", "capture_step", "configure_testbed", "detect", "load_plan",
    "measure", "prepare_environment", "restore_train_function", "rewritten_graph_def", "swap_step_of", "swapping", "trace_function_step",
    "trace_keras_step", "use_swap_step", "verify",
]
