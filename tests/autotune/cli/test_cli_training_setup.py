"""The report and summary.json say what was tuned: optimizer (class, learning rate, the settings that
shape its state), loss and dtype policy (``rewriter.trace.training_setup``, ``autotune.run.training``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tensorflow")

import keras  # noqa: E402

from autotune.cli.command import main  # noqa: E402

pytestmark = pytest.mark.tf


def _model(policy: str) -> keras.Model:
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu", dtype=policy)(inputs)
    outputs = keras.layers.Dense(4, dtype="float32")(hidden)
    model = keras.Model(inputs, outputs, name="tiny", dtype=policy)
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=3e-4, weight_decay=0.01, use_ema=True,
                                                   gradient_accumulation_steps=4),
                  loss=keras.losses.Huber())
    return model


def test_summary_and_report_name_the_optimizer_loss_and_dtype_policy(tmp_path, capsys):
    _model("mixed_float16").save(tmp_path / "tiny.keras")
    code = main([str(tmp_path / "tiny.keras"), "--batch-size", "8", "--no-measure", "--quiet", "--trials", "2",
                 "--no-plots", "--out", str(tmp_path / "out")])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    optimizer = summary["optimizer"]
    assert optimizer["class"] == "AdamW" and optimizer["learning_rate"] == pytest.approx(3e-4)
    settings = optimizer["settings"]
    assert settings["weight_decay"] == pytest.approx(0.01) and settings["use_ema"] is True
    assert settings["gradient_accumulation_steps"] == 4 and settings["beta_1"] == pytest.approx(0.9)
    assert summary["loss"] == "Huber" and summary["dtype_policy"] == "mixed_float16 (1 layer), float32 (1 layer)"
    line = "optimizer AdamW (learning rate 0.0003; beta_1 0.9"
    assert line in stdout and "use_ema True" in stdout and "gradient_accumulation_steps 4" in stdout
    assert "loss Huber, dtype policy mixed_float16 (1 layer), float32 (1 layer)" in stdout
    assert line in (tmp_path / "out" / "report.md").read_text()


VAE_SOURCE = '''
import keras
import tensorflow as tf


@keras.saving.register_keras_serializable("test_vae")
class Sampling(keras.layers.Layer):
    def call(self, inputs):
        mean, log_var = inputs
        return mean + tf.exp(0.5 * log_var) * keras.random.normal(tf.shape(mean), seed=1)


@keras.saving.register_keras_serializable("test_vae")
class VAE(keras.Model):
    """The Keras guide's VAE, small: its train_step computes its own losses; compiled with an optimizer only."""

    def __init__(self, encoder=None, decoder=None, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder or encoder_model()
        self.decoder = decoder or decoder_model()

    def call(self, x):
        return self.decoder(self.encoder(x)[2])

    def train_step(self, data):
        with tf.GradientTape() as tape:
            mean, log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = tf.reduce_mean(tf.reduce_sum(keras.losses.binary_crossentropy(data, reconstruction),
                                                               axis=(1, 2)))
            kl_loss = tf.reduce_mean(tf.reduce_sum(-0.5 * (1 + log_var - tf.square(mean) - tf.exp(log_var)), axis=1))
            total = reconstruction_loss + kl_loss
        self.optimizer.apply(tape.gradient(total, self.trainable_weights), self.trainable_weights)
        return {"loss": total}

    def get_config(self):
        return {**super().get_config(), "encoder": keras.saving.serialize_keras_object(self.encoder),
                "decoder": keras.saving.serialize_keras_object(self.decoder)}

    @classmethod
    def from_config(cls, config):
        config["encoder"] = keras.saving.deserialize_keras_object(config["encoder"])
        config["decoder"] = keras.saving.deserialize_keras_object(config["decoder"])
        return cls(**config)


def encoder_model():
    inputs = keras.Input((16, 16, 1))
    x = keras.layers.Conv2D(8, 3, strides=2, padding="same", activation="relu")(inputs)
    x = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(x))
    mean, log_var = keras.layers.Dense(2)(x), keras.layers.Dense(2)(x)
    return keras.Model(inputs, [mean, log_var, Sampling()([mean, log_var])], name="encoder")


def decoder_model():
    latent = keras.Input((2,))
    x = keras.layers.Reshape((8, 8, 8))(keras.layers.Dense(8 * 8 * 8, activation="relu")(latent))
    x = keras.layers.Conv2DTranspose(8, 3, strides=2, padding="same", activation="relu")(x)
    return keras.Model(latent, keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid")(x), name="decoder")
'''


def test_a_model_that_computes_its_own_losses_is_tuned_and_trains_with_fit_x(tmp_path, capsys, monkeypatch):
    """The guide's VAE: compiled with an optimizer only, trained with fit(x); its step takes x alone."""
    import numpy as np

    import rewriter
    from simulator import SwapParams, plan_swaps

    (tmp_path / "vae_model.py").write_text(VAE_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import vae_model

    model = vae_model.VAE()
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    x = np.random.default_rng(0).random((20, 16, 16, 1), dtype=np.float32)
    model(x[:2])
    model.save(tmp_path / "vae.keras")
    code = main([str(tmp_path / "vae.keras"), "--batch-size", "8", "--import", "vae_model", "--no-measure", "--quiet",
                 "--no-plots", "--trials", "3", "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "loss none compiled (the model's train_step computes its own)" in captured.out
    # trained with the plan as it is trained without: fit(x)
    graph = rewriter.capture(model, 8)
    assert len(graph.meta["inputs"]) == 1  # x alone, no labels
    plan = plan_swaps(graph, SwapParams(threshold=1))
    assert plan.n_swaps > 0
    before = [w.numpy().copy() for w in model.trainable_weights]
    step = rewriter.use_swap_step(model, plan.to_json(graph), batch_size=8)
    history = model.fit(x, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 8 + 8 + a last batch of 4
    assert step.n_swap_outs > 0 and np.isfinite(history.history["loss"]).all()
    assert any(not np.array_equal(a, w.numpy()) for a, w in zip(before, model.trainable_weights))
