"""Shared fixtures. TensorFlow-using tests set the CPU testbed up before TF is imported."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from hypothesis import settings

try:
    from rewriter.environment import prepare_environment
except ImportError:  # no TensorFlow installed: the simulator's tests still run
    def prepare_environment() -> None:
        pass

# the simulator's properties (tests/simulator/test_properties.py) on ten times the default run's examples
settings.register_profile("thorough", max_examples=1000)

# The testbed's settings (every allocation visible, oneDNN kernels; docs/design.md 4) must precede TF's import.
prepare_environment()


def unit_device(bandwidth_bytes_per_s: float = 100.0, latency_s: float = 0.0):
    """A device on which an op takes its FLOP count in seconds and a copy bytes/bandwidth."""
    from simulator.device.presets import get_device

    return dataclasses.replace(
        get_device("v100-16gb"), name="unit", peak_flops=1.0, compute_efficiency=1.0,
        mem_bandwidth_bytes_per_s=1e30, bandwidth_efficiency=1.0, op_overhead_s=0.0,
        h2d_bytes_per_s=bandwidth_bytes_per_s, d2h_bytes_per_s=bandwidth_bytes_per_s, transfer_latency_s=latency_s,
        host_update_bytes_per_s=0.0, host_update_variable_s=0.0,  # a moved update keeps its ops' FLOP counts
    )


@pytest.fixture
def unit():
    return unit_device()


@pytest.fixture(scope="module", autouse=True)
def _op_determinism_off_after_module():
    """TensorFlow's op determinism is process-wide, and it changes the graphs TensorFlow builds (the sparse
    cross-entropy from a LogSoftmax and a gather), so the plans searched on them: a module that turns it on
    (``tests.tf_tools.deterministic``) turns it off when done. Every module then starts as a new process does,
    whichever modules its pytest-xdist worker ran before."""
    yield
    config = sys.modules.get("tensorflow.python.framework.config")  # loaded with TensorFlow, never imported here
    if config is not None:
        config.disable_op_determinism()


@pytest.fixture(autouse=True)
def _calibration_cache(tmp_path, monkeypatch):
    """Each test its own calibration cache (autotune.calibration_cache): none reuses another's, and the
    user's ~/.cache is never touched."""
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "autotune-cache"))
