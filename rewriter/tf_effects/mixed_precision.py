"""Mixed precision as TensorFlow runs it on this machine's CPU: the float16 kernels' scratch buffers.

Under Keras' ``mixed_float16`` policy the step's activations are float16, its variables float32,
with casts between (all of which the captured graph already has, with their sizes). What the graph
does not show is how the kernels run: oneDNN takes float16 only on CPUs with AVX512-FP16 or
AMX-FP16 ("oneDNN supports DT_HALF only on platforms with AVX-512. Falling back to the default
Eigen-based implementation"), and TensorFlow's own convolution gradients then unfold their input
into a column buffer allocated for the op (``allocate_temp``, released when it ends). Those
buffers are sized by a 30 MiB working-set target, not by the batch: a float16 CNN's filter
gradient at batch 8 takes 24.8 MB for a 37 KB kernel, and the step measured 33.2 MiB against 17.3
predicted without them. Eigen's float16 matrix products (``MatMul``, ``BatchMatMulV2``) compute in
float32: they hold float32 copies of their inputs and of their output while they run (measured in
the profiler's trace: q.k^T of an 8 x 4 x 64 x 64 attention, 256 KiB of float16 output, allocates
1 MiB). ``kernel_scratch_bytes`` gives those buffers (TensorFlow 2.21's
``Conv2DCustomBackpropFilterOp`` / ``Conv2DCustomBackpropInputOp`` sizing, the float32 copies);
``capture`` adds them as a transient output of the op, read by nothing, so it is live while the op
runs.

On a GPU (or a CPU whose oneDNN takes float16) none of this applies and nothing is added.
"""

from __future__ import annotations

import functools
import os

import tensorflow as tf

# TensorFlow's column-buffer sizing (conv_grad_filter_ops.cc, conv_grad_input_ops.cc, TF 2.21)
L3_TARGET_BYTES = 30 << 20
L2_BYTES = 256 << 10
HALF_TYPES = frozenset({tf.float16})
CPU_HALF_FEATURES = ("avx512_fp16", "amx_fp16")  # what oneDNN needs to run float16 kernels


@functools.lru_cache(maxsize=1)
def eigen_half_kernels() -> bool:
    """True when float16 convolution gradients run TensorFlow's Eigen kernels here: no GPU, and a
    CPU without the features oneDNN's float16 kernels need (``/proc/cpuinfo`` flags)."""
    if tf.config.list_physical_devices("GPU"):
        return False
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), [])
    except OSError:
        return False
    return not any(feature in flags for feature in CPU_HALF_FEATURES)


def _worker_threads() -> int:
    configured = tf.config.threading.get_intra_op_parallelism_threads()
    if configured:
        return int(configured)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _conv_dims(op) -> tuple[int, int, int, int, bool] | None:
    """(batch, output image size, filter total size, output depth, unfolds) of a Conv2D gradient;
    ``unfolds`` is False where TensorFlow runs the gradient as a plain matmul (1x1, stride 1)."""
    if op.get_attr("data_format") != b"NHWC":
        return None
    if op.type == "Conv2DBackpropFilter":
        image, filter_shape, grad = op.inputs[0].shape, op.outputs[0].shape, op.inputs[2].shape
    else:
        image, filter_shape, grad = op.outputs[0].shape, op.inputs[1].shape, op.inputs[2].shape
    if not (image.is_fully_defined() and filter_shape.is_fully_defined() and grad.is_fully_defined()):
        return None
    kh, kw, cin, cout = (int(d) for d in filter_shape)
    strides = list(op.get_attr("strides"))
    padding = op.get_attr("padding")
    one_by_one = kh == kw == 1 and strides[1] == strides[2] == 1 and padding in (b"VALID", b"SAME")
    whole_image = kh == int(image[1]) and kw == int(image[2]) and padding == b"VALID"
    return int(grad[0]), int(grad[1]) * int(grad[2]), kh * kw * cin, cout, not (one_by_one or whole_image)


MATMUL_TYPES = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
CONV_GRAD_TYPES = frozenset({"Conv2DBackpropFilter", "Conv2DBackpropInput"})
FLOAT32_BYTES = 4


def kernel_scratch_bytes(op) -> int:
    """Bytes a float16 Conv2D gradient (column buffer) or matrix product (float32 copies) allocates
    while it runs on this CPU (0 for every other op, or where the kernels are oneDNN's or a GPU's)."""
    if op.type not in MATMUL_TYPES | CONV_GRAD_TYPES or not op.inputs:
        return 0
    dtype = op.outputs[0].dtype
    if dtype not in HALF_TYPES or not eigen_half_kernels():
        return 0
    if op.type in MATMUL_TYPES:
        shapes = [t.shape for t in list(op.inputs) + list(op.outputs)]
        if not all(shape.is_fully_defined() for shape in shapes):
            return 0
        return FLOAT32_BYTES * sum(shape.num_elements() for shape in shapes)
    dims = _conv_dims(op)
    if dims is None or not dims[4]:
        return 0
    batch, image_size, filter_size, depth, _ = dims
    size = dtype.size
    target = L3_TARGET_BYTES // size
    if op.type == "Conv2DBackpropFilter":
        work = image_size * filter_size + image_size * depth + filter_size * depth
        shard = -(-target // work)
    else:
        work = image_size * depth + filter_size * depth + image_size * filter_size
        parallel = batch == 1 or work // _worker_threads() >= L2_BYTES // size
        shard = 1 if parallel else -(-target // work)
    return int(shard * image_size * filter_size * size)


def scratch_fit(op, small: int, large: int, b1: int, b2: int) -> tuple[float, float]:
    """``a + b * batch`` of an op's scratch from its two traces. A convolution gradient's column buffer
    does not grow with the batch (its shard count comes from the working-set target; at batch 1 it is
    one image), so it is the larger trace's, held at every batch; the rest (matrix products' copies, a
    loop iteration's temporaries, XLA's batch-independent buffers) is fitted as it was traced."""
    if op.type in CONV_GRAD_TYPES:
        return float(max(small, large)), 0.0
    slope = (large - small) / (b2 - b1)
    return small - slope * b1, slope
