"""Shared by the tests that run the command line."""

from __future__ import annotations


def quick_args(args) -> list[str]:
    """``args`` as strings, with --no-calibrate and --no-plots unless they ask for a calibration or the figures:
    calibrating costs each measured run tens of seconds (tests/rewriter/test_calibrate.py runs the command line
    with it), drawing the figures a few seconds (the tests that read them ask for them)."""
    args = [str(a) for a in args]
    return (args + ([] if "--calibrate" in args else ["--no-calibrate"])
            + ([] if "--plots" in args else ["--no-plots"]))
