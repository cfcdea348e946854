"""A GPT-style Keras model family for the large-model benchmark: token and position embeddings, pre-LayerNorm
blocks of causal multi-head attention (head size 64, so heads = width / 64) and a 4x GELU MLP, a final
LayerNorm and an untied head over the vocabulary, sparse categorical cross-entropy on every position, AdamW.
Members of one depth differ only in width, and each is built with Keras' names reset, so their captured steps
have the same op names (what
``benchmarks.large_model.scaling`` needs to derive a wide member from narrow ones)."""

from __future__ import annotations

from rewriter.trace.step_inputs import synthetic_batch  # noqa: F401 -- first: the environment before TensorFlow

import keras  # noqa: E402

HEAD_SIZE = 64


def gpt_parameters(width: int, depth: int, vocab: int, seq_len: int) -> int:
    """Trainable parameters of ``gpt(width, depth, vocab, seq_len)`` (checked against Keras' count in the tests)."""
    block = 12 * width * width + 13 * width  # attention 4w^2 + 4w, MLP 8w^2 + 5w, two LayerNorms 4w
    return vocab * width + seq_len * width + depth * block + 2 * width + width * vocab + vocab


def gpt(width: int, depth: int, *, vocab: int = 8192, seq_len: int = 512, seed: int = 0,
        optimizer=None) -> keras.Model:
    """The family's member of ``width`` (a multiple of 64) and ``depth`` blocks, compiled with ``optimizer``
    (default AdamW(1e-4, weight_decay=0.01)); no dropout, so a step is deterministic."""
    if width % HEAD_SIZE or width < HEAD_SIZE or depth < 1:
        raise ValueError(f"width must be a positive multiple of {HEAD_SIZE} and depth >= 1, got {width}, {depth}")
    L = keras.layers
    keras.utils.clear_session()  # names start afresh (adam_w, not adam_w_1): every member traces to the same op names
    keras.utils.set_random_seed(seed)
    tokens = keras.Input(shape=(seq_len,), dtype="int32", name="tokens")
    x = L.Embedding(vocab, width, name="token_embedding")(tokens)
    # positions 0..seq_len-1 from stock layers (as benchmarks.models.transformer_encoder): a frozen causal
    # Conv1D with an all-ones kernel and bias -1 counts them
    ones = L.Reshape((seq_len, 1), name="pos_ones_reshape")(L.Rescaling(scale=0.0, offset=1.0, name="pos_ones")(tokens))
    positions = L.Conv1D(1, seq_len, padding="causal", kernel_initializer="ones",
                         bias_initializer=keras.initializers.Constant(-1.0), trainable=False, name="pos_index")(ones)
    positions = L.Reshape((seq_len,), name="pos_index_reshape")(positions)
    x = L.Add(name="embed_add")([x, L.Embedding(seq_len, width, name="position_embedding")(positions)])
    for i in range(depth):
        h = L.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln1")(x)
        h = L.MultiHeadAttention(num_heads=width // HEAD_SIZE, key_dim=HEAD_SIZE, name=f"block{i}_attn")(
            h, h, use_causal_mask=True)
        x = L.Add(name=f"block{i}_attn_add")([x, h])
        h = L.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln2")(x)
        h = L.Dense(4 * width, activation="gelu", name=f"block{i}_mlp_in")(h)
        h = L.Dense(width, name=f"block{i}_mlp_out")(h)
        x = L.Add(name=f"block{i}_mlp_add")([x, h])
    x = L.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    logits = L.Dense(vocab, name="head")(x)
    model = keras.Model(tokens, logits, name="gpt")
    model.compile(optimizer=optimizer or keras.optimizers.AdamW(1e-4, weight_decay=0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    return model
