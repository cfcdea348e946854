"""Compiled Keras 3 models used by the benchmarks and the test-suite.

Every builder in :data:`MODELS`

* returns a **compiled** :class:`keras.Model` (optimizer and loss set),
* starts from random weights (``weights=None``; nothing is ever downloaded),
* is deterministic: two builds with the same ``seed`` give identical weights,
* has fully static input shapes except for the batch dimension,
* uses only built-in Keras layers (no ``Lambda``, no custom layers), so
  ``model.save(...)`` / ``keras.models.load_model(...)`` round-trips work
  without ``custom_objects``.

Common keyword arguments of every builder:

``seed``
    Passed to :func:`keras.utils.set_random_seed` before the layers are
    created.  Note that this (re)seeds the global Python, NumPy, TensorFlow
    and Keras random generators, exactly like calling that function yourself.
``optimizer``
    Anything ``model.compile`` accepts (a string or an optimizer instance).
    ``None`` (the default) means ``SGD(learning_rate=0.01, momentum=0.9)``,
    created fresh for each build.  An optimizer *instance* must not be shared
    between models.
``jit_compile``
    Forwarded to ``model.compile``.  Defaults to ``False`` rather than Keras'
    ``"auto"`` because "auto" turns XLA on whenever a GPU is visible, and XLA
    clusters are opaque to graph-level activation swapping; pass ``"auto"`` or
    ``True`` to get Keras' behaviour back.
``metrics``
    Forwarded to ``model.compile`` (default: none, so ``train_on_batch``
    returns just the loss).

Use :func:`build_model` to build by name and :func:`example_batch` to get a
synthetic ``(x, y)`` batch that matches a model's inputs and loss (``rewriter.trace.step_inputs.synthetic_batch``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rewriter.trace.step_inputs import synthetic_batch  # first: the environment before TensorFlow (rewriter.environment)

import keras  # noqa: E402
from keras import layers  # noqa: E402

__all__ = [
    "MODELS",
    "build_model",
    "example_batch",
    "unet3d_voxels",
    "resnet50",
    "unet3d",
    "unet2d",
    "vgg16",
    "mobilenetv2",
    "densenet121",
    "transformer_encoder",
    "small_cnn",
    "mlp",
]


# --------------------------------------------------------------------------
# shared builders
# --------------------------------------------------------------------------


def _default_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)


def _compile(
    model: keras.Model,
    loss: Any,
    optimizer: Any = None,
    metrics: Any = None,
    jit_compile: bool | str = False,
) -> keras.Model:
    model.compile(
        optimizer=_default_optimizer() if optimizer is None else optimizer,
        loss=loss,
        metrics=metrics,
        jit_compile=jit_compile,
    )
    return model


def _classification_loss() -> keras.losses.Loss:
    # Every builder ends in a softmax, so from_logits=False.
    return keras.losses.SparseCategoricalCrossentropy(from_logits=False)


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if int(value) != value or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")


def unet3d_voxels(size: int) -> int:
    """Number of voxels of one ``size``-cubed 3D U-Net input volume."""
    return int(size) ** 3


# --------------------------------------------------------------------------
# keras.applications models
# --------------------------------------------------------------------------


def _application(
    ctor: Callable[..., keras.Model],
    *,
    image_size: int,
    num_classes: int,
    min_size: int,
    seed: int,
    optimizer: Any,
    metrics: Any,
    jit_compile: bool | str,
) -> keras.Model:
    _check_positive(image_size=image_size, num_classes=num_classes)
    if image_size < min_size:
        raise ValueError(
            f"{ctor.__name__} needs image_size >= {min_size}, got {image_size}"
        )
    keras.utils.set_random_seed(seed)
    model = ctor(
        weights=None,
        include_top=True,
        input_shape=(image_size, image_size, 3),
        classes=num_classes,
    )
    return _compile(model, _classification_loss(), optimizer, metrics, jit_compile)


def _application_builder(name: str, ctor: Callable[..., keras.Model], doc: str) -> Callable[..., keras.Model]:
    """One builder per keras.applications family, all with the same keyword arguments."""

    def build(
        image_size: int = 224,
        num_classes: int = 1000,
        *,
        seed: int = 0,
        optimizer: Any = None,
        metrics: Any = None,
        jit_compile: bool | str = False,
    ) -> keras.Model:
        return _application(ctor, image_size=image_size, num_classes=num_classes, min_size=32, seed=seed,
                            optimizer=optimizer, metrics=metrics, jit_compile=jit_compile)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = doc
    return build


resnet50 = _application_builder(
    "resnet50", keras.applications.ResNet50,
    "ResNet-50: the headline image-classification workload of the LMS/swapping literature.")
vgg16 = _application_builder(
    "vgg16", keras.applications.VGG16,
    "VGG-16: few, very large early activations and huge dense weights (swap vs. weight memory).")
mobilenetv2 = _application_builder(
    "mobilenetv2", keras.applications.MobileNetV2,
    "MobileNetV2: many cheap ops on large tensors, where swap transfers are hardest to hide.")
densenet121 = _application_builder(
    "densenet121", keras.applications.DenseNet121,
    "DenseNet-121: dense concatenations keep activations alive for long spans (long-lived swap candidates).")


# --------------------------------------------------------------------------
# U-Nets (Ronneberger et al. 2015 / Cicek et al. 2016 style)
# --------------------------------------------------------------------------


def _unet(
    ndim: int,
    *,
    size: int,
    channels: int,
    num_classes: int,
    base_filters: int,
    depth: int,
    seed: int,
    optimizer: Any,
    metrics: Any,
    jit_compile: bool | str,
    name: str,
    upsample: str = "transpose",
) -> keras.Model:
    _check_positive(
        size=size, channels=channels, num_classes=num_classes, base_filters=base_filters
    )
    if int(depth) != depth or depth < 0:
        raise ValueError(f"depth must be a non-negative integer, got {depth!r}")
    if upsample not in ("transpose", "upsampling"):
        raise ValueError(f"upsample must be 'transpose' or 'upsampling', got {upsample!r}")
    if size % (2**depth):
        raise ValueError(
            f"{name}: size {size} must be divisible by 2**depth = {2**depth}"
        )

    Conv = layers.Conv3D if ndim == 3 else layers.Conv2D
    ConvT = layers.Conv3DTranspose if ndim == 3 else layers.Conv2DTranspose
    Pool = layers.MaxPooling3D if ndim == 3 else layers.MaxPooling2D
    UpSampling = layers.UpSampling3D if ndim == 3 else layers.UpSampling2D

    keras.utils.set_random_seed(seed)

    def conv_block(x: Any, filters: int, tag: str) -> Any:
        # Two (3x3[x3] conv -> BatchNorm -> ReLU); the conv bias is redundant
        # in front of BatchNorm.
        for i in (1, 2):
            x = Conv(
                filters, 3, padding="same", use_bias=False, name=f"{tag}_conv{i}"
            )(x)
            x = layers.BatchNormalization(name=f"{tag}_bn{i}")(x)
            x = layers.ReLU(name=f"{tag}_relu{i}")(x)
        return x

    inputs = keras.Input(shape=(size,) * ndim + (channels,), name="image")
    x = inputs
    skips = []
    for level in range(depth):
        x = conv_block(x, base_filters * 2**level, f"down{level}")
        skips.append(x)
        x = Pool(pool_size=2, name=f"down{level}_pool")(x)

    x = conv_block(x, base_filters * 2**depth, "bottleneck")

    for level in reversed(range(depth)):
        filters = base_filters * 2**level
        if upsample == "transpose":
            x = ConvT(filters, 2, strides=2, padding="same", name=f"up{level}_upconv")(x)
        else:  # nearest-neighbour upsampling, then a 1x1 convolution to the level's width
            x = UpSampling(size=2, name=f"up{level}_upsample")(x)
            x = Conv(filters, 1, padding="same", name=f"up{level}_upconv")(x)
        x = layers.Concatenate(axis=-1, name=f"up{level}_concat")([skips[level], x])
        x = conv_block(x, filters, f"up{level}")

    if num_classes == 1:
        # Binary segmentation: sigmoid + binary cross-entropy on float masks.
        outputs = Conv(1, 1, activation="sigmoid", name="head")(x)
        loss = keras.losses.BinaryCrossentropy(from_logits=False)
    else:
        outputs = Conv(num_classes, 1, activation="softmax", name="head")(x)
        loss = _classification_loss()
    model = keras.Model(inputs, outputs, name=name)
    return _compile(model, loss, optimizer, metrics, jit_compile)


def unet3d(
    size: int = 64,
    channels: int = 1,
    num_classes: int = 2,
    base_filters: int = 16,
    depth: int = 4,
    *,
    seed: int = 0,
    optimizer: Any = None,
    metrics: Any = None,
    jit_compile: bool | str = False,
) -> keras.Model:
    """3D U-Net (Cicek et al. 2016): volumetric activations dwarf the weights; the canonical model that needs swapping."""
    return _unet(
        3,
        size=size,
        channels=channels,
        num_classes=num_classes,
        base_filters=base_filters,
        depth=depth,
        seed=seed,
        optimizer=optimizer,
        metrics=metrics,
        jit_compile=jit_compile,
        name="unet3d",
    )


def unet2d(
    image_size: int = 128,
    channels: int = 1,
    num_classes: int = 2,
    base_filters: int = 16,
    depth: int = 4,
    *,
    upsample: str = "transpose",
    seed: int = 0,
    optimizer: Any = None,
    metrics: Any = None,
    jit_compile: bool | str = False,
) -> keras.Model:
    """2D U-Net: the 3D U-Net's long skip connections at a size that is cheap to run on CPU
    (``upsample``: "transpose" convolutions or nearest "upsampling" and a 1x1 convolution)."""
    return _unet(
        2,
        size=image_size,
        channels=channels,
        num_classes=num_classes,
        base_filters=base_filters,
        depth=depth,
        seed=seed,
        optimizer=optimizer,
        metrics=metrics,
        jit_compile=jit_compile,
        name="unet2d",
        upsample=upsample,
    )


# --------------------------------------------------------------------------
# Transformer encoder
# --------------------------------------------------------------------------


def transformer_encoder(
    seq_len: int = 128,
    vocab: int = 8000,
    d_model: int = 256,
    heads: int = 4,
    ff: int = 1024,
    layers: int = 4,
    num_classes: int = 2,
    *,
    dropout: float = 0.0,
    seed: int = 0,
    optimizer: Any = None,
    metrics: Any = None,
    jit_compile: bool | str = False,
) -> keras.Model:
    """Transformer encoder classifier: attention's seq_len**2 activations, a non-convolutional memory profile."""
    num_layers = layers  # the ``layers`` argument shadows the keras.layers module
    _check_positive(
        seq_len=seq_len, vocab=vocab, d_model=d_model, heads=heads, ff=ff,
        num_classes=num_classes,
    )
    if int(num_layers) != num_layers or num_layers < 0:
        raise ValueError(f"layers must be a non-negative integer, got {num_layers!r}")
    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")

    L = keras.layers
    keras.utils.set_random_seed(seed)

    tokens = keras.Input(shape=(seq_len,), dtype="int32", name="tokens")
    tok = L.Embedding(vocab, d_model, name="token_embedding")(tokens)

    # Learned positional embedding built from stock layers only (no Lambda,
    # no custom layer, no raw ops): a frozen causal Conv1D with an all-ones
    # kernel and bias -1 computes the running count 0, 1, ..., seq_len - 1,
    # which indexes an ordinary Embedding(seq_len, d_model).
    ones = L.Rescaling(scale=0.0, offset=1.0, name="pos_ones")(tokens)
    ones = L.Reshape((seq_len, 1), name="pos_ones_reshape")(ones)
    positions = L.Conv1D(
        1,
        seq_len,
        padding="causal",
        kernel_initializer="ones",
        bias_initializer=keras.initializers.Constant(-1.0),
        trainable=False,
        name="pos_index",
    )(ones)
    positions = L.Reshape((seq_len,), name="pos_index_reshape")(positions)
    pos = L.Embedding(seq_len, d_model, name="position_embedding")(positions)

    x = L.Add(name="embed_add")([tok, pos])
    x = L.Dropout(dropout, name="embed_dropout")(x)

    # Post-LN encoder blocks (Vaswani et al. 2017 / BERT).
    for i in range(num_layers):
        attn = L.MultiHeadAttention(
            num_heads=heads, key_dim=d_model // heads, dropout=dropout, name=f"block{i}_mha"
        )(x, x)
        attn = L.Dropout(dropout, name=f"block{i}_attn_dropout")(attn)
        x = L.LayerNormalization(epsilon=1e-6, name=f"block{i}_ln1")(
            L.Add(name=f"block{i}_attn_add")([x, attn])
        )
        h = L.Dense(ff, activation="relu", name=f"block{i}_ff1")(x)
        h = L.Dense(d_model, name=f"block{i}_ff2")(h)
        h = L.Dropout(dropout, name=f"block{i}_ff_dropout")(h)
        x = L.LayerNormalization(epsilon=1e-6, name=f"block{i}_ln2")(
            L.Add(name=f"block{i}_ff_add")([x, h])
        )

    x = L.GlobalAveragePooling1D(name="pool")(x)
    outputs = L.Dense(num_classes, activation="softmax", name="head")(x)
    model = keras.Model(tokens, outputs, name="transformer_encoder")
    return _compile(model, _classification_loss(), optimizer, metrics, jit_compile)


# --------------------------------------------------------------------------
# tiny models for fast tests
# --------------------------------------------------------------------------


def small_cnn(
    image_size: int = 32,
    num_classes: int = 10,
    channels: int = 3,
    *,
    seed: int = 0,
    optimizer: Any = None,
    metrics: Any = None,
    jit_compile: bool | str = False,
) -> keras.Model:
    """Small Conv/BN/ReLU/MaxPool CNN: a real conv graph that trains in milliseconds, for fast tests."""
    _check_positive(image_size=image_size, num_classes=num_classes, channels=channels)
    if image_size < 4:
        raise ValueError(f"small_cnn needs image_size >= 4, got {image_size}")
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(image_size, image_size, channels), name="image")
    x = inputs
    for i, filters in enumerate((16, 32, 64)):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"conv{i}")(x)
        x = layers.BatchNormalization(name=f"bn{i}")(x)
        x = layers.ReLU(name=f"relu{i}")(x)
        if i < 2:
            x = layers.MaxPooling2D(2, name=f"pool{i}")(x)
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    outputs = layers.Dense(num_classes, activation="softmax", name="head")(x)
    model = keras.Model(inputs, outputs, name="small_cnn")
    return _compile(model, _classification_loss(), optimizer, metrics, jit_compile)


def mlp(
    features: int = 64,
    hidden: Sequence[int] = (128, 128),
    num_classes: int = 10,
    *,
    seed: int = 0,
    optimizer: Any = None,
    metrics: Any = None,
    jit_compile: bool | str = False,
) -> keras.Model:
    """Tiny MLP: the smallest possible trainable graph, for the fastest tests."""
    _check_positive(features=features, num_classes=num_classes)
    hidden = tuple(int(h) for h in hidden)
    _check_positive(**{f"hidden[{i}]": h for i, h in enumerate(hidden)})
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(features,), name="features")
    x = inputs
    for i, units in enumerate(hidden):
        x = layers.Dense(units, activation="relu", name=f"dense{i}")(x)
    outputs = layers.Dense(num_classes, activation="softmax", name="head")(x)
    model = keras.Model(inputs, outputs, name="mlp")
    return _compile(model, _classification_loss(), optimizer, metrics, jit_compile)


# --------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------

MODELS: dict[str, Callable[..., keras.Model]] = {
    "resnet50": resnet50,
    "unet3d": unet3d,
    "unet2d": unet2d,
    "vgg16": vgg16,
    "mobilenetv2": mobilenetv2,
    "densenet121": densenet121,
    "transformer_encoder": transformer_encoder,
    "small_cnn": small_cnn,
    "mlp": mlp,
}


# Keras' own recomputation (``keras.RematScope``, Keras >= 3.9) as a user would set it by hand: the
# baselines of the recomputation benchmarks. ``list_of_layers`` names the layers with the largest
# outputs (the full-resolution stage's convolutions and activations, not its batch normalisations:
# Keras' remat of a layer called with ``training=`` fails in a traced step on the TF backend).
REMAT_MODES = ("full", "activations", "larger_than", "list_of_layers")
REMAT_LAYERS: dict[str, tuple[str, ...]] = {
    "resnet50": ("conv1_conv", "conv1_relu")
    + tuple(f"conv2_block{b}_{k}_{kind}" for b in (1, 2, 3) for k in (1, 2) for kind in ("conv", "relu"))
    + tuple(f"conv2_block{b}_3_conv" for b in (1, 2, 3)) + tuple(f"conv2_block{b}_out" for b in (1, 2, 3)),
    "unet3d": tuple(f"{tag}_{kind}{i}" for tag in ("down0", "up0") for i in (1, 2) for kind in ("conv", "relu")),
}


def build_model(name: str, *, remat: str | None = None, **kwargs: Any) -> keras.Model:
    """Build the compiled model registered as ``name`` with ``kwargs``; ``remat``: built inside
    ``keras.RematScope(mode=remat)`` (``REMAT_MODES``; ``list_of_layers`` takes ``REMAT_LAYERS``)."""
    try:
        builder = MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}"
        ) from None
    if remat is None:
        return builder(**kwargs)
    if remat not in REMAT_MODES:
        raise ValueError(f"unknown remat mode {remat!r}; known: {', '.join(REMAT_MODES)}")
    layer_names = list(REMAT_LAYERS.get(name, ())) if remat == "list_of_layers" else None
    with keras.RematScope(mode=remat, layer_names=layer_names):
        return builder(**kwargs)


# --------------------------------------------------------------------------
# synthetic batches
# --------------------------------------------------------------------------


def example_batch(model: keras.Model, batch_size: int, seed: int = 0) -> tuple[Any, Any]:
    """Deterministic synthetic ``(x, y)`` batch matching ``model``'s inputs and loss: the tool's own
    ``rewriter.trace.step_inputs.synthetic_batch`` (the one place that decides what a batch holds)."""
    _check_positive(batch_size=batch_size)
    return synthetic_batch(model, batch_size, seed=seed)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.models save NAME DIR [--option value ...]``: save a compiled model."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m benchmarks.models",
                                     description="Save one of the suite's compiled models as DIR/NAME.keras.")
    parser.add_argument("command", choices=["save"])
    parser.add_argument("name", choices=sorted(MODELS))
    parser.add_argument("directory")
    parser.add_argument("--option", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                        help="builder keyword argument, e.g. --option image_size 128 (integers only)")
    args = parser.parse_args(argv)
    try:
        options = {key: int(value) for key, value in args.option}
    except ValueError:
        parser.error("--option values must be whole numbers")
    directory = Path(args.directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{args.name}.keras"
    build_model(args.name, **options).save(path)
    print(path)
    return 0
