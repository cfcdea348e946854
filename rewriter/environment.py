"""Process settings the CPU testbed relies on. TensorFlow reads them once, when it is imported or its
runtime starts, so they must be in the environment before that (docs/design.md 4).

* ``TF_CPU_ALLOCATOR_USE_BFC=true``: the CPU allocator reports every allocation (without it the
  profiler and ``get_memory_info`` miss those under 256 KiB, so measured peaks are too low).
* ``TF_ENABLE_ONEDNN_OPTS=1``: TensorFlow turns its oneDNN CPU kernels on by default only on CPUs
  with AVX-512-class features. Without them a convolution's gradient runs Eigen's kernel, whose
  im2col temporaries (864 MiB in one Conv3D gradient of a 64^3 U-Net) the simulator's
  ``cpu-testbed`` model does not have, and MaxPool has no workspace: the testbed would measure
  another program than the one it was calibrated on, depending on the machine.
* ``TF_CPP_MIN_LOG_LEVEL=2``: TensorFlow's C++ info and warning lines stay out of the output.
* ``TF_GPU_HOST_MEM_LIMIT_IN_MB``: beside a GPU, raised (when unset) to the machine's RAM less a margin,
  so that a plan's host copies are not cut at TensorFlow's 128 GiB default (``rewriter.host_memory``).

This module imports nothing of TensorFlow; ``import rewriter`` calls ``prepare_environment()``
before the rest of the package imports TensorFlow.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from rewriter.host_memory import raise_pinned_limit

TESTBED_ENV: Mapping[str, str] = {
    "TF_CPU_ALLOCATOR_USE_BFC": "true",
    "TF_ENABLE_ONEDNN_OPTS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}


def prepare_environment() -> None:
    """Set the testbed's settings where the user has not set them. Without effect once TensorFlow
    is imported (``rewriter.placement.placements`` warns when a measurement depends on a setting that missed)."""
    for name, value in TESTBED_ENV.items():
        os.environ.setdefault(name, value)
    raise_pinned_limit()


def testbed_environment(**extra: str) -> dict[str, str]:
    """The environment for a fresh interpreter that measures on the testbed (``extra`` on top)."""
    return {**os.environ, **TESTBED_ENV, **extra}
