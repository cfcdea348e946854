"""Shared by the tests that run the command line."""

from __future__ import annotations


def uncalibrated(args) -> list[str]:
    """``args`` as strings, with --no-calibrate unless they ask for a calibration: calibrating costs each
    measured run tens of seconds, and tests/rewriter/test_calibrate.py runs the command line with it."""
    args = [str(a) for a in args]
    return args if "--calibrate" in args else args + ["--no-calibrate"]
