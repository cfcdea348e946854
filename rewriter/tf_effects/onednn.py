"""oneDNN's buffers that the graph does not show: max pooling's workspace.

Where TensorFlow runs its oneDNN CPU kernels (no GPU, ``TF_ENABLE_ONEDNN_OPTS`` on: the testbed's
setting, ``rewriter.environment``), its layout pass pairs a ``MaxPool`` with the ``MaxPoolGrad``
that reads the pooled output (input 1): the forward op gets a second output, oneDNN's workspace
(the index of each window's maximum, one byte per output element for windows of fewer than 256
elements, else four), which the gradient reads instead of searching the window again. That buffer
lives from the forward op to its gradient: 0.14 MiB in multi_io at batch 8 (147456 bytes beside a
589824-byte pooled output), the rest of the measured peak once the step ran in its order.
``capture`` adds it as an output of the pooling read by its gradient. Without oneDNN (a GPU, oneDNN
off, or a float16 pooling that falls back to Eigen) there is no workspace and nothing is added.

Not modelled: on some CPUs oneDNN runs a one-sample convolution through a scratch buffer of its own
(measured on an AVX2-only AMD EPYC: 672000 bytes beside the 131072-byte output of a 3x3 convolution of
a 1 x 32 x 32 x 64 input to 32 channels; 12336 bytes from two samples on), which a split into one-sample
parts then holds while each part's convolution runs. Its size depends on the kernel oneDNN picks, not
on the batch (``tests/rewriter/edit/test_merged_ops.py`` measures it on the machine it runs on). The measured
run corrects the prediction where it shows.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.python.util import _pywrap_util_port

from rewriter.tf_effects.mixed_precision import HALF_TYPES, eigen_half_kernels

# forward pooling -> the gradient oneDNN pairs it with (simulator.device.presets.ONEDNN_POOL_READS: the read
# that must stay on the device), and the gradient's input that reads the pooled output
POOL_GRADS = {"MaxPool": "MaxPoolGrad", "MaxPool3D": "MaxPool3DGrad"}
POOLED_OUTPUT_SLOT = 1
WORKSPACE_DTYPE = "uint8"
SMALL_WINDOW = 256  # oneDNN's workspace holds uint8 indices below this window size, int32 from it


@functools.lru_cache(maxsize=1)
def onednn_kernels() -> bool:
    """True when TensorFlow's CPU kernels here are oneDNN's: no GPU, and oneDNN on."""
    if tf.config.list_physical_devices("GPU"):
        return False
    return bool(_pywrap_util_port.IsMklEnabled())


def pool_workspace_bytes(op, paired: bool) -> int:
    """Bytes of the workspace oneDNN keeps from max pooling ``op`` to its gradient; ``paired``: a
    gradient of the pair's type reads the pooled output (0 where there is no workspace)."""
    if not paired or op.type not in POOL_GRADS or not onednn_kernels():
        return 0
    pooled = op.outputs[0]
    if (pooled.dtype in HALF_TYPES and eigen_half_kernels()) or not pooled.shape.is_fully_defined():
        return 0
    window = 1
    for size in op.get_attr("ksize"):
        window *= int(size)
    return pooled.shape.num_elements() * (1 if window < SMALL_WINDOW else 4)
