"""Framework-free simulation of a training step with activation swapping (never imports TensorFlow).

The pieces: ``OpGraph`` (graph.py) holds one step as arrays and puts ops on levels
(``categorized_levels``); ``ordering.py`` gives execution orders; ``plan_swaps`` (planning.py) turns
``SwapParams`` (params.py) into a ``SwapPlan``; plan.py owns the plan and its file (``NamedPlan``, the
form the rewriter applies); ``replay`` (replay.py) predicts peak memory and step time on a
``DeviceModel`` (``device/``). Rooms: ``kernels/`` (the compiled loops, a leaf), ``device/`` (presets, calibrated
devices, memory budgets), ``recompute/`` (recomputation's action and choice), ``split/`` (ops run in parts
along the batch, and the floor before and after; simulation only).
"""

from simulator.device import DEVICES, CalibratedDevice, CalibrationError, CalibrationMismatchError, DeviceModel, get_device
from simulator.graph import BACKWARD, FORWARD, OTHER, PHASE_NAMES, UPDATE, GraphError, OpGraph, categorized_levels
from simulator.ordering import edge_distances, execution_order, n_levels
from simulator.params import ParamsError, SwapParams
from simulator.plan import NamedPlan, NamedSwap, NamedSwapIn, PlanError, Swap, SwapIn, SwapPlan, load_plan
from simulator.planning import TRIGGER_OP_TYPES, plan_swaps
from simulator.replay import Replay, replay

__all__ = [
    "BACKWARD", "DEVICES", "FORWARD", "OTHER", "PHASE_NAMES", "TRIGGER_OP_TYPES", "UPDATE",
    "CalibratedDevice", "CalibrationError", "CalibrationMismatchError", "DeviceModel", "GraphError", "NamedPlan",
    "NamedSwap", "NamedSwapIn", "OpGraph", "ParamsError", "PlanError", "Replay", "Swap", "SwapIn", "SwapParams", "SwapPlan",
    "categorized_levels", "edge_distances", "execution_order", "get_device", "load_plan", "n_levels", "plan_swaps",
    "replay",
]
