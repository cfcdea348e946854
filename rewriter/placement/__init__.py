"""Where swap ops run and how the accelerator-side peak is read: a real GPU or the CPU testbed
(docs/design.md 4)."""

from rewriter.placement.memtrace import accelerator_peak
from rewriter.placement.placements import (SWAP_IN_PREFIX, SWAP_OUT_PREFIX, CpuTestbedPlacement, GpuPlacement,
                                           PeakReading, Placement, configure_testbed, detect, gpu_reading,
                                           limit_device_memory, resolve)

__all__ = ["accelerator_peak", "configure_testbed", "CpuTestbedPlacement", "detect", "gpu_reading", "GpuPlacement",
    "limit_device_memory", "PeakReading", "Placement", "resolve", "SWAP_IN_PREFIX", "SWAP_OUT_PREFIX"]
