"""Framework-free simulation of a training step with activation swapping (never imports TensorFlow).

The pieces: ``OpGraph`` (graph.py) holds one step as arrays; ``categorized_levels`` (ordering.py)
puts ops on levels; ``plan_swaps`` (planning.py) turns ``SwapParams`` into a ``SwapPlan``;
``replay`` (replay.py) predicts peak memory and step time on a ``DeviceModel`` (devices.py).
"""

from simulator.devices import DEVICES, CalibratedDevice, CalibrationError, CalibrationMismatchError, DeviceModel, get_device
from simulator.graph import BACKWARD, FORWARD, OTHER, PHASE_NAMES, UPDATE, GraphError, OpGraph
from simulator.ordering import categorized_levels, edge_distances, execution_order, n_levels
from simulator.planning import TRIGGER_OP_TYPES, ParamsError, Swap, SwapIn, SwapParams, SwapPlan, plan_swaps
from simulator.replay import Replay, replay

__all__ = [
    "BACKWARD", "DEVICES", "FORWARD", "OTHER", "PHASE_NAMES", "TRIGGER_OP_TYPES", "UPDATE",
    "CalibratedDevice", "CalibrationError", "CalibrationMismatchError", "DeviceModel", "GraphError", "OpGraph", "ParamsError", "Replay", "Swap", "SwapIn", "SwapParams", "SwapPlan",
    "categorized_levels", "edge_distances", "execution_order", "get_device", "n_levels", "plan_swaps", "replay",
]
