"""A contrastive model as users write them (keras-io style, written for these tests): its own
`train_step`, an encoder optimizer and a probe optimizer of its own, its own loss names.

    python tests/scripts/contrastive_user_model.py WORKDIR [--epochs=N] [--checkpoint_every_steps=N]

trains it on digits with `tfmp.callbacks.default_callbacks(WORKDIR)` (the README's diff) and
prints `resumed_from_step=N`; tests/test_user_models.py kills it with SIGKILL and reruns it.
"""

import argparse
import sys

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits


def digits():
    images, labels = load_digits(return_X_y=True)
    return (images.reshape(-1, 8, 8, 1) / 16.0).astype(np.float32), labels.astype(np.int32)


class ContrastiveModel(keras.Model):
    """Two noisy views of each image pulled together (cosine), a linear probe trained on the
    frozen features alongside. `inf_loss_at_step` plants an inf contrastive loss at that step."""

    def __init__(self, inf_loss_at_step: int = 0):
        super().__init__()
        self.inf_loss_at_step = inf_loss_at_step
        self.encoder = keras.Sequential([
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(32),
        ], name="encoder")
        self.probe = keras.layers.Dense(10, dtype="float32", name="probe")
        self.noise = keras.random.SeedGenerator(0)

    def compile(self, contrastive_optimizer, probe_optimizer, **kwargs):
        super().compile(**kwargs)
        self.contrastive_optimizer = contrastive_optimizer
        self.probe_optimizer = probe_optimizer
        self.c_loss_tracker = keras.metrics.Mean(name="c_loss")
        self.p_loss_tracker = keras.metrics.Mean(name="p_loss")

    def build_with_optimizers(self, sample_images):
        """Creates every variable up front. Needed under MirroredStrategy: an optimizer that
        `compile()` did not make is otherwise built inside the first replica step, which Keras
        3.15 cannot do there ("You must feed a value for placeholder"; plain Keras fails alike)."""
        self(sample_images)
        self.contrastive_optimizer.build(self.encoder.trainable_weights)
        self.probe_optimizer.build(self.probe.trainable_weights)

    @property
    def metrics(self):
        return [self.c_loss_tracker, self.p_loss_tracker]

    def call(self, images):
        return self.probe(self.encoder(images))

    def train_step(self, data):
        images, labels = data
        first = images + 0.1 * keras.random.normal(tf.shape(images), seed=self.noise)
        second = images + 0.1 * keras.random.normal(tf.shape(images), seed=self.noise)
        with tf.GradientTape() as tape:
            a = tf.cast(self.encoder(first, training=True), tf.float32)
            b = tf.cast(self.encoder(second, training=True), tf.float32)
            c_loss = 2.0 + tf.reduce_mean(keras.losses.cosine_similarity(a, b))
            if self.inf_loss_at_step:
                step = self.contrastive_optimizer.iterations + 1  # the step being taken, counted from 1
                c_loss = c_loss * tf.where(tf.equal(step, self.inf_loss_at_step), np.inf, 1.0)
            scaled = self.contrastive_optimizer.scale_loss(c_loss)
        gradients = tape.gradient(scaled, self.encoder.trainable_weights)
        self.contrastive_optimizer.apply_gradients(zip(gradients, self.encoder.trainable_weights))

        features = tf.stop_gradient(self.encoder(images, training=False))
        with tf.GradientTape() as tape:
            logits = self.probe(features)
            p_loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
            scaled = self.probe_optimizer.scale_loss(p_loss)
        gradients = tape.gradient(scaled, self.probe.trainable_weights)
        self.probe_optimizer.apply_gradients(zip(gradients, self.probe.trainable_weights))

        self.c_loss_tracker.update_state(c_loss)
        self.p_loss_tracker.update_state(p_loss)
        return {metric.name: metric.result() for metric in self.metrics}


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoint_every_steps", type=int, default=0)
    args = parser.parse_args(argv[1:])

    from tfmp import callbacks, precision

    images, labels = digits()
    model = ContrastiveModel()
    model.compile(contrastive_optimizer=precision.wrap_optimizer(keras.optimizers.Adam(1e-3)),
                  probe_optimizer=precision.wrap_optimizer(keras.optimizers.Adam(1e-3)))
    run_callbacks = callbacks.default_callbacks(args.workdir, checkpoint_every_steps=args.checkpoint_every_steps)
    model.fit(images, labels, batch_size=128, epochs=args.epochs, verbose=0, callbacks=run_callbacks)
    checkpointing = run_callbacks.checkpointing
    print(f"resumed_from_step={checkpointing.restored_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
