"""The benchmark models: compiled Keras 3 models used by the benchmarks and the test-suite (``builders``), and
their captured graphs cached on disk (``graphs``). ``python -m benchmarks.models save NAME DIR`` saves one."""

from benchmarks.models.builders import (REMAT_MODES, build_model, densenet121, example_batch, main, mlp, mobilenetv2,
                                        resnet50, small_cnn, transformer_encoder, unet2d, unet3d, unet3d_voxels, vgg16)
from benchmarks.models.graphs import captured_graph

__all__ = ["build_model", "captured_graph", "densenet121", "example_batch", "main", "mlp", "mobilenetv2",
    "REMAT_MODES", "resnet50", "small_cnn", "transformer_encoder", "unet2d", "unet3d", "unet3d_voxels", "vgg16"]
