"""Timing and measuring real steps: a device calibrated from the user's own hardware, re-anchored to steps timed
beside, and a step's measured peak and time (docs/design.md 4)."""

from rewriter.timing.anchored import ANCHOR, timed_beside_anchors
from rewriter.timing.device_calibration import CalibrationError, calibrate, fit_copies, pass_times, timed_passes
from rewriter.timing.measurement import Measurement, measure
from rewriter.timing.replica_peaks import ReplicaPeak, measure_replicas, time_replicas

__all__ = ["ANCHOR", "calibrate", "CalibrationError", "fit_copies", "measure", "Measurement", "measure_replicas", "pass_times",
    "ReplicaPeak",
    "time_replicas", "timed_beside_anchors", "timed_passes"]
