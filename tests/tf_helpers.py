"""Shared set-up for the TensorFlow tests of the rewriter. Import it FIRST in a test module.

It sets the testbed's environment (``rewriter.environment``: every allocation visible, oneDNN's CPU
kernels) and splits the CPU into the testbed's two logical devices before TensorFlow's runtime
initialises (it cannot be done later).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from pathlib import Path

from rewriter.environment import prepare_environment, testbed_environment

prepare_environment()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from rewriter.placement.placements import configure_testbed  # noqa: E402

TESTBED = configure_testbed()
REPO = Path(__file__).resolve().parents[1]


def deterministic() -> None:
    tf.config.experimental.enable_op_determinism()


@contextlib.contextmanager
def grappler_options(**options):
    """Temporarily set ``tf.config.optimizer`` experimental options (affects functions built inside)."""
    before = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options(options)
    try:
        yield
    finally:
        restore = {key: before.get(key, True) for key in options}
        tf.config.optimizer.set_experimental_options(restore)


def weights_of(model) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in model.weights]


def optimizer_state(model) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in model.optimizer.variables]


def max_relative_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    worst = 0.0
    for left, right in zip(a, b, strict=True):
        left = left.astype(np.float64)
        right = right.astype(np.float64)
        scale = max(np.abs(left).max(initial=0.0), np.abs(right).max(initial=0.0), 1e-12)
        worst = max(worst, float(np.abs(left - right).max(initial=0.0) / scale))
    return worst


def bitwise_equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(left, right) for left, right in zip(a, b, strict=True))


def run_python(code: str, *, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter at the repository root (own TF runtime and devices)."""
    full_env = testbed_environment(PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout)
