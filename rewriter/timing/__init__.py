"""Timing and measuring real steps: a device calibrated from the user's own hardware, re-anchored to steps timed
beside, the host's rate at an optimizer's update, and a step's measured peak and time (docs/design.md 4)."""

from rewriter.timing.anchored import ANCHOR, timed_beside_anchors
from rewriter.timing.device_calibration import CalibrationError, calibrate, fit_copies, pass_times, timed_passes
from rewriter.timing.host_update_rate import HostUpdateError, HostUpdateRate, measure_host_update
from rewriter.timing.measurement import Measurement, measure
from rewriter.timing.replica_peaks import ReplicaPeak, measure_replicas, time_replicas

__all__ = ["ANCHOR", "calibrate", "CalibrationError", "fit_copies", "HostUpdateError", "HostUpdateRate", "measure",
    "Measurement", "measure_host_update", "measure_replicas", "pass_times",
    "ReplicaPeak",
    "time_replicas", "timed_beside_anchors", "timed_passes"]
