"""The TensorFlow side of the tool: capture a training step, apply a swap plan, verify, measure, train.

    import rewriter
    g = rewriter.capture(model, batch_size=8)                 # -> simulator.OpGraph
    step = rewriter.apply(model, plan, graph=g, batch_size=8)  # -> SwapStep, step(x, y) -> loss
    step.verification                                          # what survived Grappler
    rewriter.measure(step, x, y)                               # peak bytes, step seconds
    rewriter.use_swap_step(model, step); model.fit(...)        # train with it
    g = rewriter.capture_replicated(model, batch_size=16)     # built in MirroredStrategy.scope(): one replica
    step = rewriter.apply_replicated(model, plan, graph=g)    # the plan on every replica (docs/design.md 14)
    rewriter.use_replicated_step(model, step); model.fit(...)  # MultiWorkerMirroredStrategy too
    edit = rewriter.replicated_gpu_graph_def(model, plan, graph=g)  # replica k on GPU:k, swaps to CPU:0
    rewriter.replica_placement_problems(edit)                 # [] when every copy waits for its trigger
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

import importlib

from rewriter.environment import prepare_environment

prepare_environment()  # before anything below imports TensorFlow

# The public API by name -> the room that defines it. Loaded on first use (PEP 562), so that
# ``import rewriter`` (and ``rewriter.environment``, which a process imports before TensorFlow) costs
# nothing until the tool needs TensorFlow.
_HOMES = {
    "CaptureError": "rewriter.errors",
    "Verification": "rewriter.check", "verify": "rewriter.check",
    "CpuTestbedPlacement": "rewriter.placement", "GpuPlacement": "rewriter.placement", "Placement": "rewriter.placement",
    "configure_testbed": "rewriter.placement", "detect": "rewriter.placement",
    "KerasStep": "rewriter.step", "StateSnapshot": "rewriter.step", "SwapStep": "rewriter.step", "apply": "rewriter.step",
    "restore_train_function": "rewriter.step", "rewritten_graph_def": "rewriter.step", "swap_step_of": "rewriter.step",
    "swapping": "rewriter.step", "use_swap_step": "rewriter.step",
    "ReplicatedStep": "rewriter.step", "apply_replicated": "rewriter.step", "use_replicated_step": "rewriter.step",
    "replicated_gpu_graph_def": "rewriter.step", "replica_placement_problems": "rewriter.step",
    "CalibrationError": "rewriter.timing", "Measurement": "rewriter.timing", "calibrate": "rewriter.timing",
    "measure": "rewriter.timing", "measure_replicas": "rewriter.timing",
    "time_replicas": "rewriter.timing",
    "capture": "rewriter.trace", "capture_step": "rewriter.trace", "trace_function_step": "rewriter.trace",
    "trace_keras_step": "rewriter.trace", "StepInputs": "rewriter.trace", "capture_replicated": "rewriter.trace",
    "PlanError": "simulator.plan", "load_plan": "simulator.plan",  # the plan's one reader and error
}

__all__ = sorted([*_HOMES, "prepare_environment"])


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'rewriter' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
