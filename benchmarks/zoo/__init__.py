"""A zoo of small models that look like users' models, for checking the simulator where nobody tuned it.

``ZOO`` maps a name to a :class:`ZooModel`: the name of a builder in ``benchmarks.zoo.builders``
(a compiled Keras 3 model, random weights, nothing downloaded, deterministic for a seed) and the
batch at which one measured step on the 2-core CPU testbed takes a few seconds at most. The
families (``ZooModel.family``) cover what users' models are made of: keras.applications beyond
``benchmarks.models`` (EfficientNet, Xception, MobileNetV3, ConvNeXt, EfficientNetV2 (NAS-found, fused MBConv); NASNetMobile builds
too, ``builders.BUILDERS``, but its 17,600-op step takes over two minutes per measured plan here),
U-Nets with transposed convolutions and with upsampling, ``mixed_float16`` variants, recurrent
layers (LSTM, GRU, Bidirectional, stacked, with Embedding), attention, multi-input/multi-output
with per-output losses and weights, depthwise/separable and 1-D convolutions, normalization and
dropout mixes, and a custom layer with a custom loss. ``SMALL`` holds one tiny model per family
for the test suite.

This module does not import Keras (the fidelity benchmark's parent process lists the zoo without
starting TensorFlow); ``ZooModel.build`` does.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FAMILIES", "SMALL", "SPLIT_USERS", "ZOO", "ZooModel", "build_zoo_model"]


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: ``build(seed)`` gives the compiled model (``builder`` of ``benchmarks.zoo.builders``
    called with ``kwargs``, under Keras' ``mixed_float16`` policy if ``mixed_float16``); ``batch`` is the
    testbed's batch; labels follow from the outputs and losses (``benchmarks.models.example_batch``)."""

    name: str
    family: str
    builder: str
    batch: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    mixed_float16: bool = False

    def build(self, seed: int = 0):
        builders = importlib.import_module("benchmarks.zoo.builders")  # Keras: only where a model is built
        with builders.mixed_precision(self.mixed_float16):
            return builders.BUILDERS[self.builder](seed=seed, **self.kwargs)

    def example_batch(self, model, batch: int | None = None, seed: int = 0):
        """A synthetic (x, y) batch for ``model`` (``benchmarks.models.example_batch``)."""
        models = importlib.import_module("benchmarks.models")
        return models.example_batch(model, self.batch if batch is None else batch, seed=seed)

    def describe(self) -> str:
        options = ", ".join(f"{key}={value}" for key, value in self.kwargs.items())
        policy = ", mixed_float16" if self.mixed_float16 else ""
        return f"{self.name} ({self.builder}({options}){policy}) b{self.batch}"


_UNET = dict(image_size=64, channels=1, num_classes=2, base_filters=8, depth=3)

ZOO: dict[str, ZooModel] = {entry.name: entry for entry in (
    ZooModel("efficientnetb0", "applications", "EfficientNetB0", 4, {"image_size": 64}),
    ZooModel("xception", "applications", "Xception", 2, {"image_size": 71}),
    ZooModel("mobilenetv3small", "applications", "MobileNetV3Small", 8, {"image_size": 64}),
    ZooModel("convnexttiny", "applications", "ConvNeXtTiny", 4, {"image_size": 32}),
    ZooModel("efficientnetv2b0", "applications", "EfficientNetV2B0", 4, {"image_size": 32}),
    ZooModel("unet2d_transpose", "unet", "unet2d", 2, dict(_UNET, upsample="transpose")),
    ZooModel("unet2d_upsampling", "unet", "unet2d", 2, dict(_UNET, upsample="upsampling")),
    ZooModel("mixed16_cnn", "mixed_float16", "mixed_cnn", 8, {"image_size": 64}, mixed_float16=True),
    ZooModel("mixed16_unet2d", "mixed_float16", "unet2d", 2, dict(_UNET, upsample="transpose"), mixed_float16=True),
    ZooModel("mixed16_attention", "mixed_float16", "attention", 8, {"seq_len": 64}, mixed_float16=True),
    ZooModel("lstm", "recurrent", "recurrent", 16, {"kind": "lstm"}),
    ZooModel("gru", "recurrent", "recurrent", 16, {"kind": "gru"}),
    ZooModel("bilstm", "recurrent", "recurrent", 16, {"kind": "lstm", "bidirectional": True, "stacked": True,
                                                     "units": 64}),
    ZooModel("stacked_gru", "recurrent", "recurrent", 16, {"kind": "gru", "stacked": True, "units": 64}),
    ZooModel("conv_gru", "recurrent", "conv_gru", 16),
    ZooModel("attention", "attention", "attention", 8, {"seq_len": 64}),
    ZooModel("token_lm", "attention", "token_lm", 8, {"seq_len": 64}),
    ZooModel("multi_io", "multi_io", "multi_io", 8),
    ZooModel("separable_cnn", "separable", "separable_cnn", 8),
    ZooModel("conv1d_net", "conv1d", "conv1d_net", 8),
    ZooModel("norm_mix", "normalization", "norm_mix", 8),
    ZooModel("custom_layer_loss", "custom", "custom_layer_loss", 4),
    ZooModel("sequential_mlp", "mlp", "sequential_mlp", 32),
)}

FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(entry.family for entry in ZOO.values()))

# one tiny model per family, for the test suite (a capture and two measured steps in seconds)
SMALL: dict[str, ZooModel] = {entry.family: entry for entry in (
    ZooModel("mobilenet_32", "applications", "MobileNet", 2, {"image_size": 32}),  # V3Small: 3545 ops, 2.5x the time
    ZooModel("unet2d_transpose_32", "unet", "unet2d", 2, dict(_UNET, image_size=32, base_filters=4, depth=2)),
    ZooModel("mixed16_cnn_32", "mixed_float16", "mixed_cnn", 4, {"image_size": 32}, mixed_float16=True),
    ZooModel("lstm_16", "recurrent", "recurrent", 8, {"kind": "lstm", "seq_len": 16, "units": 32, "embed": 16}),
    ZooModel("attention_16", "attention", "attention", 4, {"seq_len": 16, "d_model": 32, "ff": 64}),
    ZooModel("multi_io_24", "multi_io", "multi_io", 4, {"image_size": 24}),
    ZooModel("separable_cnn_32", "separable", "separable_cnn", 4, {"image_size": 32}),
    ZooModel("conv1d_net_128", "conv1d", "conv1d_net", 4, {"length": 128}),
    ZooModel("norm_mix_24", "normalization", "norm_mix", 4, {"image_size": 24}),
    ZooModel("custom_layer_loss_48", "custom", "custom_layer_loss", 4, {"image_size": 48}),
    ZooModel("sequential_mlp_64", "mlp", "sequential_mlp", 8, {"features": 64}),
)}

# users' small models whose floor is above 85 % of their unswapped peak: they fit at half of it only split along
# the batch (python -m benchmarks split-users, benchmarks/results/split_user_models.md)
SPLIT_USERS: dict[str, ZooModel] = {entry.name: entry for entry in (
    ZooModel("augmented_cnn", "augmentation", "augmented_cnn", 8),
    ZooModel("metrics_cnn", "metrics", "metrics_cnn", 8),
    ZooModel("video_classifier", "time_distributed", "video_classifier", 8),
    ZooModel("frozen_backbone", "transfer", "frozen_backbone", 16, {"alpha": 0.35, "image_size": 64}),
    ZooModel("multi_io", "multi_io", "multi_io", 8),
)}


def build_zoo_model(name: str, seed: int = 0):
    """The compiled zoo model ``name``."""
    try:
        entry = ZOO[name]
    except KeyError:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}") from None
    return entry.build(seed=seed)
