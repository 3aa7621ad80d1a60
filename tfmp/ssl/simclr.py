"""`SimCLR`: contrastive pretraining as a `keras.Model` trained with `fit()`.

Chen et al. 2020, "A Simple Framework for Contrastive Learning of Visual
Representations". Each step draws two augmented views of every image, encodes both,
projects them with an MLP head, and pulls the two views of each image together
against all other images in the *global* batch (NT-Xent, `tfmp.ssl.losses`).

Mixed precision and distribution are part of the step, not an afterthought:

* the encoder and projector compute in the policy dtype; the projector's last layer
  and the loss are float32;
* under `mixed_float16` the loss goes through the optimizer's `scale_loss` and the
  `LossScaleOptimizer` skips steps with non-finite gradients;
* negatives come from all replicas (differentiable all-gather) and BatchNorm in the
  projector is synchronized, so N replicas compute what one device would on the
  same global batch;
* augmentation seeds fold in the run seed, the optimizer step and the replica id
  (`tfmp.data.augment.step_seed`): distinct streams per replica, reproducible runs.

An online linear probe on stop-gradient features (when labels are given) reports
`probe_accuracy` during pretraining without influencing the encoder.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmp import compilation
from tfmp.data import augment
from tfmp.models.layers import NormSettings, batch_norm
from tfmp.ssl.losses import nt_xent


class SimCLR(keras.Model):
    """SimCLR around any encoder that maps images to a feature vector.

    Args:
        encoder: a Keras model, images -> [batch, features].
        num_classes: size of the online linear probe (0: no probe).
        projection_dim: output size of the projection head.
        hidden_dim: hidden size of the projection head (default: the feature size).
        temperature: NT-Xent temperature.
        augment_config: SimCLR augmentation strengths.
        seed: the run seed augmentation streams derive from.
        norm: BatchNorm settings of the projection head (synchronized by default).
    """

    def __init__(self, encoder: keras.Model, *, num_classes: int = 0, projection_dim: int = 128, hidden_dim: int | None = None,
                 temperature: float = 0.2, augment_config: augment.AugmentConfig = augment.AugmentConfig(), seed: int = 0,
                 norm: NormSettings = NormSettings(synchronized=True), **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        feature_dim = encoder.output_shape[-1]
        self.projector = keras.Sequential([
            keras.layers.Dense(hidden_dim or feature_dim, use_bias=False, name="projector_hidden"),
            batch_norm(norm, name="projector_bn"),
            keras.layers.ReLU(name="projector_relu"),
            keras.layers.Dense(projection_dim, dtype="float32", name="projector_out"),
        ], name="projector")
        self.probe = keras.layers.Dense(num_classes, dtype="float32", name="online_probe") if num_classes else None
        self.temperature = temperature
        self.augment_config = augment_config
        self.seed = seed
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.contrastive_accuracy = keras.metrics.Mean(name="contrastive_accuracy")
        self.probe_loss_tracker = keras.metrics.Mean(name="probe_loss")
        self.probe_accuracy = keras.metrics.SparseCategoricalAccuracy(name="probe_accuracy")
        self._compiled_views = None  # set by compile(jit_compile=True) on several mirrored replicas

    def compile(self, optimizer=None, *, jit_compile="auto", **kwargs):
        """Keras' `compile`; `jit_compile=True` on several mirrored replicas compiles each replica's
        augmentations with XLA instead of the whole step, which XLA cannot (`tfmp.compilation`)."""
        per_replica = compilation.scope(jit_compile is True, self.distribute_strategy) == compilation.REPLICA_AUGMENTATIONS
        self._compiled_views = tf.function(self._draw_views, jit_compile=True) if per_replica else None
        super().compile(optimizer=optimizer, jit_compile=compilation.for_keras(jit_compile, self.distribute_strategy), **kwargs)

    def build(self, input_shape):
        features = self.encoder.output_shape[-1]
        self.projector.build((None, features))
        if self.probe is not None:
            self.probe.build((None, features))
        self.built = True

    def call(self, images, training=False):
        return self.encoder(images, training=training)

    @property
    def metrics(self):
        tracked = [self.loss_tracker, self.contrastive_accuracy]
        if self.probe is not None:
            tracked += [self.probe_loss_tracker, self.probe_accuracy]
        return tracked

    def views(self, images: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The two augmented views of this replica's batch at the current step."""
        context = tf.distribute.get_replica_context()
        replica_id = context.replica_id_in_sync_group if context is not None else 0
        seed = augment.step_seed(self.seed, self.optimizer.iterations, replica_id)
        return (self._compiled_views or self._draw_views)(images, seed)

    def _draw_views(self, images: tf.Tensor, seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        first_seed, second_seed = augment.split_seed(seed, 2)
        return (augment.simclr_augment(images, first_seed, self.augment_config),
                augment.simclr_augment(images, second_seed, self.augment_config))

    def train_step(self, data):
        images, labels = (data[0], data[1]) if isinstance(data, (tuple, list)) else (data, None)
        first, second = self.views(images)
        batch = tf.shape(first)[0]
        context = tf.distribute.get_replica_context()
        num_replicas = context.num_replicas_in_sync if context is not None else 1
        with tf.GradientTape() as tape:
            features = self.encoder(tf.concat([first, second], axis=0), training=True)
            projections = self.projector(features, training=True)
            loss, accuracy = nt_xent(projections[:batch], projections[batch:], self.temperature)
            total = loss
            if self.probe is not None and labels is not None:
                logits = self.probe(tf.stop_gradient(tf.cast(features[:batch], tf.float32)))
                labeled = labels >= 0  # -1 marks unlabeled images
                per_example = keras.losses.sparse_categorical_crossentropy(tf.maximum(labels, 0), logits, from_logits=True)
                weights = tf.cast(labeled, tf.float32)
                probe_loss = tf.reduce_sum(per_example * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)
                total = total + probe_loss
            # Keras sums gradients over replicas: scale each replica's loss by 1/N.
            scaled = total / tf.cast(num_replicas, total.dtype)
            if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
                scaled = self.optimizer.scale_loss(scaled)
        gradients = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)

        self.loss_tracker.update_state(loss)
        self.contrastive_accuracy.update_state(accuracy)
        if self.probe is not None and labels is not None:
            self.probe_loss_tracker.update_state(probe_loss)
            self.probe_accuracy.update_state(tf.maximum(labels, 0), logits, sample_weight=weights)
        return {metric.name: metric.result() for metric in self.metrics}
