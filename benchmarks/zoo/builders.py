"""The zoo's model builders (Keras; ``benchmarks.zoo`` lists them without importing Keras).

Builders reuse ``benchmarks.models``' shared builders (compilation, applications, U-Net, transformer). The
custom layer and loss are registered as Keras serializables, so saved models load again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
from keras import layers

from benchmarks.models.builders import _application, _classification_loss, _compile, transformer_encoder, unet2d

NUM_CLASSES = 10


@contextlib.contextmanager
def mixed_precision(enabled: bool = True) -> Iterator[None]:
    """Keras' global dtype policy set to ``mixed_float16`` while a model is built and compiled (compile
    then wraps the optimizer in a ``LossScaleOptimizer``), restored afterwards."""
    if not enabled:
        yield
        return
    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(before)


# ---------------------------------------------------------------------- small hand-built models


def _image_input(size: int, channels: int = 3, name: str = "image"):
    return keras.Input(shape=(size, size, channels), name=name)


def _classifier(inputs, x, name: str, loss: Any = None) -> keras.Model:
    outputs = layers.Dense(NUM_CLASSES, activation="softmax", dtype="float32", name="head")(x)
    return _compile(keras.Model(inputs, outputs, name=name), loss or _classification_loss())


def mixed_cnn(*, image_size: int = 64, seed: int = 0) -> keras.Model:
    """Conv/BN/ReLU/MaxPool CNN (the verdict benchmark's mixed-precision case when built under mixed_float16)."""
    keras.utils.set_random_seed(seed)
    inputs = _image_input(image_size)
    x = inputs
    for i, filters in enumerate((32, 64, 128)):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"conv{i}")(x)
        x = layers.BatchNormalization(name=f"bn{i}")(x)
        x = layers.ReLU(name=f"relu{i}")(x)
        x = layers.MaxPooling2D(2, name=f"pool{i}")(x)
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    return _classifier(inputs, x, "cnn")


def separable_cnn(*, image_size: int = 64, seed: int = 0) -> keras.Model:
    """Depthwise and separable convolutions (MobileNet-style blocks without keras.applications)."""
    keras.utils.set_random_seed(seed)
    inputs = _image_input(image_size)
    x = layers.Conv2D(32, 3, strides=2, padding="same", name="stem")(inputs)
    for i, filters in enumerate((32, 64, 96)):
        x = layers.DepthwiseConv2D(3, padding="same", name=f"dw{i}")(x)
        x = layers.BatchNormalization(name=f"dw{i}_bn")(x)
        x = layers.ReLU(6.0, name=f"dw{i}_relu")(x)
        x = layers.SeparableConv2D(filters, 3, padding="same", activation="relu", name=f"sep{i}")(x)
        x = layers.MaxPooling2D(2, name=f"pool{i}")(x)
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    return _classifier(inputs, x, "separable_cnn")


def conv1d_net(*, length: int = 512, channels: int = 8, seed: int = 0) -> keras.Model:
    """1-D convolutions over a multichannel signal (Conv1D, SeparableConv1D, pooling, dilation)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(length, channels), name="signal")
    x = layers.Conv1D(32, 7, padding="same", activation="relu", name="conv0")(inputs)
    x = layers.Conv1D(32, 5, padding="causal", dilation_rate=2, activation="relu", name="conv1")(x)
    x = layers.MaxPooling1D(2, name="pool0")(x)
    x = layers.SeparableConv1D(64, 5, padding="same", activation="relu", name="sep0")(x)
    x = layers.BatchNormalization(name="bn0")(x)
    x = layers.AveragePooling1D(2, name="pool1")(x)
    x = layers.Conv1D(64, 3, padding="same", activation="relu", name="conv2")(x)
    x = layers.GlobalMaxPooling1D(name="gmp")(x)
    return _classifier(inputs, x, "conv1d_net")


def norm_mix(*, image_size: int = 48, seed: int = 0) -> keras.Model:
    """Dropout, SpatialDropout2D, BatchNormalization, LayerNormalization and GroupNormalization mixed."""
    keras.utils.set_random_seed(seed)
    inputs = _image_input(image_size)
    x = layers.Conv2D(32, 3, padding="same", name="conv0")(inputs)
    x = layers.BatchNormalization(name="bn0")(x)
    x = layers.Activation("relu", name="relu0")(x)
    x = layers.SpatialDropout2D(0.2, name="sdrop0")(x)
    x = layers.Conv2D(32, 3, padding="same", name="conv1")(x)
    x = layers.GroupNormalization(groups=8, name="gn1")(x)
    x = layers.Activation("relu", name="relu1")(x)
    x = layers.MaxPooling2D(2, name="pool1")(x)
    x = layers.Conv2D(64, 3, padding="same", name="conv2")(x)
    x = layers.LayerNormalization(name="ln2")(x)
    x = layers.Activation("gelu", name="gelu2")(x)
    x = layers.SpatialDropout2D(0.1, name="sdrop2")(x)
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    x = layers.Dense(64, activation="relu", name="fc")(x)
    x = layers.Dropout(0.3, name="drop")(x)
    return _classifier(inputs, x, "norm_mix")


def _token_input(seq_len: int):
    return keras.Input(shape=(seq_len,), dtype="int32", name="tokens")


def recurrent(*, kind: str = "lstm", seq_len: int = 64, vocab: int = 2000, embed: int = 64, units: int = 128,
              stacked: bool = False, bidirectional: bool = False, seed: int = 0) -> keras.Model:
    """Embedding + LSTM/GRU text classifier (optionally stacked and bidirectional)."""
    keras.utils.set_random_seed(seed)
    cell = {"lstm": layers.LSTM, "gru": layers.GRU}[kind]
    inputs = _token_input(seq_len)
    x = layers.Embedding(vocab, embed, name="embedding")(inputs)
    if stacked:
        first = cell(units, return_sequences=True, name=f"{kind}0")
        x = (layers.Bidirectional(first, name=f"bi{kind}0") if bidirectional else first)(x)
    last = cell(units, name=f"{kind}1")
    x = (layers.Bidirectional(last, name=f"bi{kind}1") if bidirectional and not stacked else last)(x)
    name = ("bi" if bidirectional else "") + ("stacked_" if stacked else "") + kind
    return _classifier(inputs, x, name)


def conv_gru(*, length: int = 128, channels: int = 4, seed: int = 0) -> keras.Model:
    """A 1-D convolution front end feeding a GRU over a float sequence (a time-series model)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(length, channels), name="series")
    x = layers.Conv1D(32, 5, padding="same", activation="relu", name="conv")(inputs)
    x = layers.MaxPooling1D(2, name="pool")(x)
    x = layers.GRU(64, return_sequences=True, name="gru0")(x)
    x = layers.LayerNormalization(name="ln")(x)
    x = layers.GRU(64, name="gru1")(x)
    return _classifier(inputs, x, "conv_gru")


def attention(*, seq_len: int = 64, seed: int = 0, **kwargs: Any) -> keras.Model:
    """A small encoder: Embedding, MultiHeadAttention, LayerNormalization, dropout (benchmarks' builder)."""
    settings = dict(vocab=2000, d_model=64, heads=4, ff=128, layers=2, num_classes=NUM_CLASSES, dropout=0.1)
    settings.update(kwargs)
    return transformer_encoder(seq_len=seq_len, seed=seed, **settings)


def token_lm(*, seq_len: int = 64, vocab: int = 1000, d_model: int = 64, heads: int = 4, ff: int = 256,
             blocks: int = 2, seed: int = 0) -> keras.Model:
    """A small decoder language model: causal self-attention, a GELU feed-forward and a vocabulary head on
    every token, a loss per token (its Dense layers and loss reshape the batch with the steps into rows)."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input(shape=(seq_len,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab, d_model, name="embed")(tokens)
    for k in range(blocks):
        h = layers.LayerNormalization(name=f"block{k}_ln1")(x)
        x = x + layers.MultiHeadAttention(heads, d_model // heads, name=f"block{k}_mha")(h, h, use_causal_mask=True)
        h = layers.LayerNormalization(name=f"block{k}_ln2")(x)
        h = layers.Dense(ff, activation="gelu", name=f"block{k}_ff1")(h)
        x = x + layers.Dense(d_model, name=f"block{k}_ff2")(h)
    logits = layers.Dense(vocab, name="head")(layers.LayerNormalization(name="ln_out")(x))
    model = keras.Model(tokens, logits, name="token_lm")
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def multi_io(*, image_size: int = 48, features: int = 16, seed: int = 0) -> keras.Model:
    """Two inputs (an image and tabular features), two outputs (a class and a regressed value) with
    per-output losses and loss weights."""
    keras.utils.set_random_seed(seed)
    image = _image_input(image_size)
    table = keras.Input(shape=(features,), name="features")
    x = layers.Conv2D(32, 3, padding="same", activation="relu", name="conv0")(image)
    x = layers.MaxPooling2D(2, name="pool0")(x)
    x = layers.Conv2D(64, 3, padding="same", activation="relu", name="conv1")(x)
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    t = layers.Dense(32, activation="relu", name="tab")(table)
    joined = layers.Concatenate(name="join")([x, t])
    joined = layers.Dense(64, activation="relu", name="shared")(joined)
    label = layers.Dense(NUM_CLASSES, activation="softmax", name="label")(joined)
    value = layers.Dense(1, name="value")(joined)
    model = keras.Model([image, table], [label, value], name="multi_io")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=False,
                  loss=[keras.losses.SparseCategoricalCrossentropy(), keras.losses.MeanSquaredError()],
                  loss_weights=[1.0, 0.5])
    return model


@keras.saving.register_keras_serializable(package="zoo")
class ScaledResidual(layers.Layer):
    """A custom layer: ``x + gamma * conv(x)`` with a learned per-channel ``gamma`` (LayerScale-like)."""

    def __init__(self, filters: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.filters = filters
        self.conv = layers.Conv2D(filters, 3, padding="same")

    def build(self, input_shape):
        self.conv.build(input_shape)
        self.gamma = self.add_weight(shape=(self.filters,), initializer=keras.initializers.Constant(0.1), name="gamma")

    def call(self, x):
        return x + self.gamma * keras.ops.relu(self.conv(x))

    def get_config(self):
        return {**super().get_config(), "filters": self.filters}


@keras.saving.register_keras_serializable(package="zoo")
def smooth_l1_loss(y_true, y_pred):
    """A custom loss (Huber with delta 1 written out): labels are float maps shaped as the output."""
    diff = keras.ops.abs(y_true - y_pred)
    return keras.ops.mean(keras.ops.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5), axis=-1)


def custom_layer_loss(*, image_size: int = 48, seed: int = 0) -> keras.Model:
    """An image-to-image regressor with a custom layer and a custom loss function."""
    keras.utils.set_random_seed(seed)
    inputs = _image_input(image_size)
    x = layers.Conv2D(32, 3, padding="same", activation="relu", name="stem")(inputs)
    x = ScaledResidual(32, name="res0")(x)
    x = layers.MaxPooling2D(2, name="pool")(x)
    x = ScaledResidual(32, name="res1")(x)
    x = layers.UpSampling2D(2, name="up")(x)
    outputs = layers.Conv2D(3, 1, name="out")(x)
    return _compile(keras.Model(inputs, outputs, name="custom_layer_loss"), smooth_l1_loss)


def sequential_mlp(*, features: int = 256, seed: int = 0) -> keras.Model:
    """A Sequential MLP with BatchNormalization and Dropout, the most common user model."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((features,), name="features"),
        layers.Dense(512, activation="relu"), layers.BatchNormalization(), layers.Dropout(0.2),
        layers.Dense(256, activation="relu"), layers.BatchNormalization(), layers.Dropout(0.2),
        layers.Dense(NUM_CLASSES, activation="softmax", dtype="float32"),
    ], name="sequential_mlp")
    return _compile(model, _classification_loss())


# ---------------------------------------------------------------------- users' models that fit only split


def _conv_stack(x, filters: tuple[int, ...] = (32, 64)):
    """Conv/ReLU at full resolution, pooled, then smaller convolutions and a global average (the zoo's
    multi_io image branch): one full-resolution layer holds most of the step's memory."""
    for i, width in enumerate(filters):
        if i:
            x = layers.MaxPooling2D(2, name=f"pool{i - 1}")(x)
        x = layers.Conv2D(width, 3, padding="same", activation="relu", name=f"conv{i}")(x)
    return layers.GlobalAveragePooling2D(name="gap")(x)


def augmented_cnn(*, image_size: int = 48, seed: int = 0) -> keras.Model:
    """Augmentation layers (RandomFlip, RandomRotation, RandomZoom, RandomContrast) before a conv stack:
    their random draws happen in the training step."""
    keras.utils.set_random_seed(seed)
    inputs = _image_input(image_size)
    x = layers.RandomFlip("horizontal", seed=seed, name="flip")(inputs)
    x = layers.RandomRotation(0.1, seed=seed, name="rotate")(x)
    x = layers.RandomZoom(0.1, seed=seed, name="zoom")(x)
    x = layers.RandomContrast(0.2, seed=seed, name="contrast")(x)
    return _classifier(inputs, _conv_stack(x), "augmented_cnn")


def metrics_cnn(*, image_size: int = 48, seed: int = 0) -> keras.Model:
    """A conv stack on one-hot labels compiled with several metrics (accuracy, top-3, AUC, precision,
    recall): their update ops run in the training step."""
    keras.utils.set_random_seed(seed)
    inputs = _image_input(image_size)
    outputs = layers.Dense(NUM_CLASSES, activation="softmax", name="head")(_conv_stack(inputs))
    return _compile(keras.Model(inputs, outputs, name="metrics_cnn"), keras.losses.CategoricalCrossentropy(),
                    metrics=["accuracy", keras.metrics.TopKCategoricalAccuracy(3, name="top3"),
                             keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision"),
                             keras.metrics.Recall(name="recall")])


def video_classifier(*, frames: int = 8, image_size: int = 32, seed: int = 0) -> keras.Model:
    """TimeDistributed convolutions over a clip's frames, pooled per frame and over time, a Dense head."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(frames, image_size, image_size, 3), name="clip")
    x = layers.TimeDistributed(layers.Conv2D(16, 3, padding="same", activation="relu"), name="conv0")(inputs)
    x = layers.TimeDistributed(layers.MaxPooling2D(2), name="pool0")(x)
    x = layers.TimeDistributed(layers.Conv2D(32, 3, padding="same", activation="relu"), name="conv1")(x)
    x = layers.TimeDistributed(layers.GlobalAveragePooling2D(), name="gap")(x)
    x = layers.GlobalAveragePooling1D(name="time_pool")(x)
    return _classifier(inputs, x, "video_classifier")


def frozen_backbone(*, backbone: str = "MobileNetV2", image_size: int = 32, alpha: float = 1.0,
                    seed: int = 0) -> keras.Model:
    """Transfer learning: a keras.applications backbone (``weights=None``: nothing downloaded) frozen
    (``trainable=False``, its batch normalisation in inference mode) under a new head."""
    keras.utils.set_random_seed(seed)
    base = getattr(keras.applications, backbone)(weights=None, include_top=False, alpha=alpha,
                                                 input_shape=(image_size, image_size, 3))
    base.trainable = False
    inputs = _image_input(image_size)
    x = base(inputs, training=False)
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    x = layers.Dropout(0.2, name="drop")(x)
    return _classifier(inputs, x, "frozen_backbone")


def _app(ctor_name: str, min_size: int) -> Callable[..., keras.Model]:
    ctor = getattr(keras.applications, ctor_name)

    def build(*, image_size: int, seed: int = 0, **extra: Any) -> keras.Model:
        return _application(ctor, image_size=image_size, num_classes=NUM_CLASSES, min_size=min_size, seed=seed,
                            optimizer=None, metrics=None, jit_compile=False, **extra)

    build.__name__ = ctor_name.lower()
    return build


BUILDERS: dict[str, Callable[..., keras.Model]] = {
    "EfficientNetB0": _app("EfficientNetB0", 32),
    "Xception": _app("Xception", 71),
    "MobileNetV3Small": _app("MobileNetV3Small", 32),
    "MobileNet": _app("MobileNet", 32),
    "ConvNeXtTiny": _app("ConvNeXtTiny", 32),
    "NASNetMobile": _app("NASNetMobile", 32),
    "EfficientNetV2B0": _app("EfficientNetV2B0", 32),
    "unet2d": unet2d,
    "mixed_cnn": mixed_cnn,
    "attention": attention,
    "token_lm": token_lm,
    "recurrent": recurrent,
    "conv_gru": conv_gru,
    "multi_io": multi_io,
    "separable_cnn": separable_cnn,
    "conv1d_net": conv1d_net,
    "norm_mix": norm_mix,
    "custom_layer_loss": custom_layer_loss,
    "sequential_mlp": sequential_mlp,
    "augmented_cnn": augmented_cnn,
    "metrics_cnn": metrics_cnn,
    "video_classifier": video_classifier,
    "frozen_backbone": frozen_backbone,
}
