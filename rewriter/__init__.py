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

``rewriter.apply``, ``rewriter.calibrate``, ``rewriter.capture``, ``rewriter.measure`` and ``rewriter.verify`` are both the
submodules and callables that run their namesake function.

The CPU testbed (two logical CPUs) must be configured before TensorFlow initialises:
``rewriter.configure_testbed()`` first thing in the process, or the single-device testbed is used.
``import rewriter`` before TensorFlow also sets the environment the testbed needs
(``rewriter.environment``); imported after it, measurements warn about what missed.
"""

import sys as _sys
import types as _types

from rewriter.environment import prepare_environment

prepare_environment()  # before the modules below import TensorFlow

from rewriter.swap_step import StateSnapshot, SwapStep  # noqa: E402
from rewriter.calibrate import CalibrationError  # noqa: E402
from rewriter.capture import CaptureError, capture_step, trace_function_step, trace_keras_step  # noqa: E402
from rewriter.step_inputs import StepInputs  # noqa: E402
from rewriter.keras import KerasStep, restore_train_function, swap_step_of, swapping, use_swap_step  # noqa: E402
from rewriter.measure import Measurement  # noqa: E402
from rewriter.placement import CpuTestbedPlacement, GpuPlacement, Placement, configure_testbed, detect  # noqa: E402
from rewriter.gpu import rewritten_graph_def  # noqa: E402
from rewriter.verify import Verification  # noqa: E402
from simulator.plan import PlanError, load_plan  # noqa: E402 -- the plan's one reader and error


class _CallableModule(_types.ModuleType):
    """A submodule that can be called as its namesake function: ``rewriter.apply(...)`` runs
    ``rewriter.apply.apply(...)`` while ``rewriter.apply.PlanError`` etc. stay reachable."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rsplit(".", 1)[1])(*args, **kwargs)


for _name in ("apply", "calibrate", "capture", "measure", "verify"):
    _sys.modules[f"{__name__}.{_name}"].__class__ = _CallableModule
apply = _sys.modules[f"{__name__}.apply"]
calibrate = _sys.modules[f"{__name__}.calibrate"]
capture = _sys.modules[f"{__name__}.capture"]
measure = _sys.modules[f"{__name__}.measure"]
verify = _sys.modules[f"{__name__}.verify"]

__all__ = [
    "CalibrationError", "CaptureError", "CpuTestbedPlacement", "GpuPlacement", "KerasStep", "Measurement", "Placement", "PlanError", "StateSnapshot", "StepInputs",
    "SwapStep", "Verification", "apply", "calibrate", "capture", "capture_step", "configure_testbed", "detect", "load_plan",
    "measure", "prepare_environment", "restore_train_function", "rewritten_graph_def", "swap_step_of", "swapping", "trace_function_step",
    "trace_keras_step", "use_swap_step", "verify",
]
