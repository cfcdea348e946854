"""Device models: accelerator presets, devices calibrated from measured steps, and the memory budgets beside them."""

from simulator.device.calibrated import CalibratedDevice, CalibrationError, CalibrationMismatchError
from simulator.device.memory_budgets import (DEFAULT_PINNED_LIMIT_BYTES, PINNED_LIMIT_ENV, HostBudget,
                                             host_usable_bytes, pinned_limit_bytes, pinned_limit_to_set,
                                             usable_gpu_bytes)
from simulator.device.presets import DEVICES, DeviceModel, GiB, get_device, preset_for_gpu

__all__ = ["CalibratedDevice", "CalibrationError", "CalibrationMismatchError", "DEFAULT_PINNED_LIMIT_BYTES",
    "DeviceModel", "DEVICES", "get_device", "GiB", "host_usable_bytes", "HostBudget", "pinned_limit_bytes",
    "PINNED_LIMIT_ENV", "pinned_limit_to_set", "preset_for_gpu", "usable_gpu_bytes"]
